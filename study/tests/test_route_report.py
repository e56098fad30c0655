"""study/route_report.py on synthetic routed runs whose statistics are known exactly."""
import json
import statistics

import pytest

from study import route_report

STEPS = [50, 100, 150]


def write_routed(root, config, seed, u_token, shares, iters=150):
    """A routed run as make route keeps it: config.json, stats.json (two layers), settle.json."""
    folder = root / f'route_{config}-s{seed}'
    folder.mkdir(parents=True)
    (folder / 'config.json').write_text(json.dumps(
        {'config_name': f'route_{config}', 'seed': seed, 'cpu': 'a CPU, 1 threads',
         'iters': iters}))
    layer = {'u_token': u_token, 'u_class': u_token / 2, 'repeat': 0.2, 'repeat_chance': 0.25,
             'any_shared': 0.6, 'any_shared_chance': 0.5}
    (folder / 'stats.json').write_text(json.dumps(
        {'n_experts': 4, 'top_k': 2, 'u_token': u_token, 'layers': [layer, layer]}))
    (folder / 'settle.json').write_text(json.dumps({'steps': STEPS, 'mean': shares}))


def d(seed):
    """The per-seed gap of the test below, U(shared) - U(moe): -0.004 at seed 51 to +0.014 at 60,
    7 of them > 0 (seed 53's is 0); mean 0.005, t 2.61."""
    return 0.004 + 0.002 * (seed - 55)


@pytest.fixture
def routed(tmp_path):
    for seed in route_report.PREREG_SEEDS:
        write_routed(tmp_path, 'cpu_moe', seed, 0.4, [0.5, 0.95, 1.0])
        write_routed(tmp_path, 'cpu_moe_shared', seed, 0.4 + d(seed), [0.95, 0.85, 1.0])
    return tmp_path


def test_the_preregistered_test_is_the_paired_t_over_seeds_51_to_60(routed):
    route_report.main([str(routed), '--out', str(routed.parent / 'rep')])
    r = json.loads((routed.parent / 'rep' / 'report.json').read_text())
    gaps = [d(s) for s in route_report.PREREG_SEEDS]
    mean, std = statistics.mean(gaps), statistics.stdev(gaps)
    p = r['prereg']
    assert p['seeds'] == list(range(51, 61)) and p['positive'] == 7
    assert p['mean'] == pytest.approx(mean) and p['std'] == pytest.approx(std)
    assert p['t'] == pytest.approx(mean / (std / 10 ** 0.5)) and p['t'] > route_report.PREREG_T
    assert p['interval'] == pytest.approx([mean - 2.262 * std / 10 ** 0.5,
                                           mean + 2.262 * std / 10 ** 0.5])
    assert p['verdict'] == 'confirmed'
    text = (routed.parent / 'rep' / 'report.md').read_text()
    assert '**Verdict: confirmed.**' in text


def test_a_config_is_summarised_over_its_seeds_and_settles_where_it_stays_settled(routed):
    r = route_report.summarise(route_report.read_runs(str(routed)))
    moe, shared = r['configs']['cpu_moe'], r['configs']['cpu_moe_shared']
    assert moe['u_token'] == {'mean': pytest.approx(0.4), 'std': pytest.approx(0), 'n': 10}
    assert moe['layers'][1]['repeat_chance']['mean'] == pytest.approx(0.25)
    assert shared['u_token']['mean'] == pytest.approx(0.4 + statistics.mean(
        d(s) for s in route_report.PREREG_SEEDS))
    # shares 0.5, 0.95, 1.0 settle at step 100; 0.95, 0.85, 1.0 only at 150 (0.85 < 0.9 between)
    assert moe['settled_step']['mean'] == 100 and shared['settled_step']['mean'] == 150
    assert moe['settle']['share'][0]['mean'] == pytest.approx(0.5)


def test_the_verdict_waits_for_all_ten_seeds(routed):
    for path in routed.glob('route_cpu_moe_shared-s6*'):
        for f in path.iterdir():
            f.unlink()
        path.rmdir()
    p = route_report.summarise(route_report.read_runs(str(routed)))['prereg']
    assert p['seeds'] == list(range(51, 60)) and p['verdict'] is None
    assert 'interval' not in p


@pytest.mark.parametrize('scale, verdict', [(-1, 'reversed'), (0.5, 'not established')])
def test_the_verdict_follows_the_sign_and_size_of_t(tmp_path, scale, verdict):
    """The same gaps negated (t -2.61), or lowered by 0.0025 each (t +1.31)."""
    for seed in route_report.PREREG_SEEDS:
        write_routed(tmp_path, 'cpu_moe', seed, 0.4, [0.5, 0.95, 1.0])
        gap = d(seed) * scale if scale < 0 else d(seed) - 0.0025
        write_routed(tmp_path, 'cpu_moe_shared', seed, 0.4 + gap, [0.5, 0.95, 1.0])
    p = route_report.summarise(route_report.read_runs(str(tmp_path)))['prereg']
    assert p['verdict'] == verdict and abs(p['t']) != pytest.approx(route_report.PREREG_T)


def test_a_run_short_of_its_last_step_is_refused(routed):
    write_routed(routed, 'cpu_moe_top1', 51, 0.4, [0.5, 0.95, 1.0], iters=1120)
    with pytest.raises(route_report.UserError, match='stops at step 150 of 1120'):
        route_report.read_runs(str(routed))


def test_the_expert_count_control_is_shown_beside_the_test(routed):
    for seed in route_report.PREREG_SEEDS:
        write_routed(routed, 'cpu_moe_fine8_top2', seed, 0.45, [0.5, 0.95, 1.0])
    r = route_report.summarise(route_report.read_runs(str(routed)))
    control = r['descriptive']['cpu_moe_fine8_top2 - cpu_moe']
    assert control['mean'] == pytest.approx(0.05) and control['positive'] == 10
    assert r['descriptive']['cpu_moe_shared - cpu_moe_fine8_top2']['mean'] == pytest.approx(-0.045)
