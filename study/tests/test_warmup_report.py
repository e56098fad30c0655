"""study/warmup_report.py on synthetic runs whose best val losses are known exactly."""
import json
import statistics

import pytest

from study import warmup_report
from tests.test_report import read_config, write_run

SEEDS = (1, 2, 3, 4, 5)
# best val loss of seed s: BASE[warmup][config] + 0.001 * s. cpu_dense_total is best at 112
# steps, cpu_moe at 224: the rule must follow the dense model alone.
BASE = {'2%': {'cpu_dense_active': 1.30, 'cpu_moe': 1.28, 'cpu_dense_total': 1.230},
        '56': {'cpu_dense_active': 1.29, 'cpu_moe': 1.25, 'cpu_dense_total': 1.220},
        '112': {'cpu_dense_active': 1.28, 'cpu_moe': 1.22, 'cpu_dense_total': 1.210},
        '224': {'cpu_dense_active': 1.28, 'cpu_moe': 1.19, 'cpu_dense_total': 1.215}}
SIZES = {'cpu_moe': (270, 160, True), 'cpu_dense_active': (160, 160, False),
         'cpu_dense_total': (271, 271, False), 'cpu_moe_shared': (270, 160, True)}


def best(warmup, config, seed):
    return BASE[warmup][config] + 0.001 * seed


def add_run(root, name, seed, best_val, warmup_iters=0, iters=20):
    config = warmup_report.cell_of(name)[2]
    folder = root / f'{name}-s{seed}'
    write_run(folder, config, seed, *SIZES[config], best_val=best_val)
    c = read_config(folder)
    c.update(config_name=name, warmup_iters=warmup_iters, iters=iters)
    (folder / 'config.json').write_text(json.dumps(c))


@pytest.fixture
def sweep(tmp_path):
    for warmup, configs in BASE.items():
        for config in configs:
            for seed in SEEDS:
                if warmup == '2%':
                    add_run(tmp_path, config, seed, best(warmup, config, seed))
                else:
                    add_run(tmp_path, f'w{warmup}_{config}', seed, best(warmup, config, seed),
                            warmup_iters=int(warmup))
    return tmp_path


def report(root, chosen='112'):
    out = root / 'rep'
    warmup_report.main(['--chosen', chosen, '--out', str(out)] +
                       [str(p) for p in root.iterdir() if p.name != 'rep'])
    return json.loads((out / 'report.json').read_text()), (out / 'report.md').read_text()


@pytest.mark.parametrize('name, cell', [
    ('cpu_moe', ('2%', '100', 'cpu_moe')), ('b25_cpu_moe', ('2%', '25', 'cpu_moe')),
    ('w112_cpu_moe_shared', ('112', '100', 'cpu_moe_shared')),
    ('w112_b200_cpu_dense_total', ('112', '200', 'cpu_dense_total')),
    ('moe', None), ('flops_cpu_moe', None)])
def test_a_runs_name_says_its_warmup_budget_and_config(name, cell):
    assert warmup_report.cell_of(name) == cell


def test_the_rule_picks_by_dense_total_alone_and_the_gaps_are_exact(sweep):
    r, text = report(sweep)
    assert r['picked'] == '112'  # not 224, where the MoE is best
    assert r['dense_total_means']['56'] == pytest.approx(1.223)
    moe = r['sweep']['224']['configs']['cpu_moe']
    assert moe['mean'] == pytest.approx(1.193) and moe['n'] == 5
    # every seed: moe - dense_total = 1.19 - 1.215 (the seed's share cancels)
    gap = moe['vs_dense_total']
    assert gap['mean'] == pytest.approx(-0.025) and gap['positive'] == 0 and gap['n'] == 5
    assert r['sweep']['56']['active']['mean'] == pytest.approx(0.04)
    assert r['cells']['2%']['100']['configs']['cpu_moe']['warmup_steps'] == 1  # 2% of 20 steps
    assert r['cells']['112']['100']['configs']['cpu_moe']['warmup_steps'] == 112
    assert 'Picked: 112' in text and 'Warnings' not in text


def test_paired_t_and_a_study_past_the_sweeps_seeds(sweep):
    # seeds 6-7 at the chosen warmup: in the study, not in the sweep
    for seed, moe, dense in ((6, 1.20, 1.21), (7, 1.23, 1.21)):
        add_run(sweep, 'w112_cpu_moe', seed, moe, warmup_iters=112)
        add_run(sweep, 'w112_cpu_dense_total', seed, dense, warmup_iters=112)
    r, _ = report(sweep)
    assert r['sweep']['112']['configs']['cpu_moe']['n'] == 5
    gap = r['cells']['112']['100']['configs']['cpu_moe']['vs_dense_total']
    diffs = [0.01] * 5 + [-0.01, 0.02]
    assert gap['n'] == 7 and gap['positive'] == 6
    assert gap['mean'] == pytest.approx(statistics.mean(diffs))
    se = statistics.stdev(diffs) / 7 ** 0.5
    assert gap['t'] == pytest.approx(statistics.mean(diffs) / se)


def test_a_budget_under_the_fixed_warmup_keeps_its_steps(sweep):
    for config in ('cpu_moe', 'cpu_dense_total'):
        add_run(sweep, f'w112_b25_{config}', 1, best('112', config, 1), warmup_iters=112,
                iters=5)
    r, text = report(sweep)
    cell = r['cells']['112']['25']['configs']['cpu_moe']
    assert cell['warmup_steps'] == 112 and cell['iters'] == 5
    assert cell['vs_dense_total']['mean'] == pytest.approx(0.01)
    assert '| 112 | 25% | 112 |' in text


def test_a_study_at_another_warmup_than_the_rules_is_a_warning(sweep):
    r, text = report(sweep, chosen='224')
    assert r['picked'] == '112' and 'the rule picks 112, the study ran at 224' in text


def test_no_pick_while_a_warmup_lacks_a_seed(sweep):
    for folder in sweep.glob('w56_cpu_dense_total-s5'):
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    r, text = report(sweep)
    assert r['picked'] is None and '56' not in r['dense_total_means']
    assert 'not yet' in text and '| 1.2225 ± 0.0013 (4 seeds) |' in text  # seeds 1-4 at 56


def test_the_replication_on_fresh_seeds_is_judged_alone_and_pooled_apart(sweep):
    # seeds 1-5 from the fixture: shared = dense_total exactly (gap 0); seeds 11-20: the shared
    # expert ahead by 0.010 +- a spread of 0.002, so t is far below -2.26
    for seed in SEEDS:
        add_run(sweep, 'w112_cpu_moe_shared', seed, best('112', 'cpu_dense_total', seed),
                warmup_iters=112)
    fresh = range(11, 21)
    for seed in fresh:
        dense = 1.2 + 0.001 * seed
        shared = dense - 0.010 + (0.002 if seed % 2 else -0.002)
        add_run(sweep, 'w112_cpu_dense_total', seed, dense, warmup_iters=112)
        add_run(sweep, 'w112_cpu_moe_shared', seed, shared, warmup_iters=112)
    r, text = report(sweep)
    rep = r['replication']
    gaps = [-0.010 + (0.002 if s % 2 else -0.002) for s in fresh]
    assert rep['vs_dense_total']['mean'] == pytest.approx(-0.010)
    assert rep['vs_dense_total']['n'] == 10 and rep['vs_dense_total']['positive'] == 0
    t = statistics.mean(gaps) / (statistics.stdev(gaps) / 10 ** 0.5)
    assert rep['vs_dense_total']['t'] == pytest.approx(t) and rep['established'] is True
    # pooled: 5 seeds at 0 and 10 at -0.010
    assert rep['pooled']['n'] == 15 and rep['pooled']['mean'] == pytest.approx(-0.010 * 10 / 15)
    # the study's own cells keep seeds 1-10: the fresh seeds are not in them
    assert r['cells']['112']['100']['configs']['cpu_dense_total']['n'] == 5
    assert f'yes: t {t:+.2f} < -2.26' in text


def test_a_replication_short_of_seeds_is_not_decided(sweep):
    for seed in (11, 12):
        add_run(sweep, 'w112_cpu_dense_total', seed, 1.21, warmup_iters=112)
        add_run(sweep, 'w112_cpu_moe_shared', seed, 1.20 + 0.001 * seed, warmup_iters=112)
    r, text = report(sweep)
    assert r['replication']['established'] is False
    assert 'not decided yet: 2 of 10 seeds' in text


def test_a_gaps_move_between_budgets_is_paired_by_seed(sweep):
    """At 112 steps, a 50% budget whose cpu_moe is 0.01 * s worse than at 100% (the other configs
    as at 100%): from 50% to 100% the active gap moves by +0.01 * s, the total gap by -0.01 * s,
    seeds 1-5: mean 0.03, std of 0.01 * (1..5), t = 0.03 / (std / sqrt 5)."""
    for seed in SEEDS:
        for config in ('cpu_dense_active', 'cpu_moe', 'cpu_dense_total'):
            worse = 0.01 * seed if config == 'cpu_moe' else 0
            add_run(sweep, f'w112_b50_{config}', seed, best('112', config, seed) + worse,
                    warmup_iters=112, iters=10)
    r, text = report(sweep)
    std = statistics.stdev([0.01 * s for s in SEEDS])
    active, total = (r['moves']['112']['50-100'][gap] for gap in ('active', 'total'))
    assert active['mean'] == pytest.approx(0.03) and total['mean'] == pytest.approx(-0.03)
    assert active['std'] == pytest.approx(std) and active['n'] == 5 and active['positive'] == 5
    assert active['t'] == pytest.approx(0.03 / (std / 5 ** 0.5))
    assert total['t'] == pytest.approx(-active['t']) and total['positive'] == 0
    assert list(r['moves']) == ['2%', '112']  # the 2% warmup has one budget: no move
    assert r['moves']['2%'] == {}
    row = f'| 112 | 50% -> 100% | +0.0300 ± {std:.4f} [5 of 5 > 0, t +{active["t"]:.2f}] |'
    assert row in text
