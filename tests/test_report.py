"""report.py on synthetic run folders whose numbers are known exactly."""
import json
import math
import shutil
import statistics

import pytest

import report
from errors import UserError
from tests.conftest import run

# best val losses by config and seed; the eval curves below end at these values
BEST = {'cpu_moe': {1: 1.20, 2: 1.22, 3: 1.19},
        'cpu_dense_active': {1: 1.25, 2: 1.24, 3: 1.26},
        'cpu_dense_total': {1: 1.18, 2: 1.23, 3: 1.17},
        'cpu_moe_top1': {1: 1.30}}
TOKENS = [0, 1000, 2000]


def curve(best, seed):
    """val loss at TOKENS: 5.5 at init, the best in the middle, a little worse at the end."""
    return [5.5, best, best + 0.01 * seed]


def routing(i, seed):
    """Routing stats that identify the eval point: busiest_frac = 0.3 + 0.1 * i + 0.01 * seed."""
    return {'load': [0.25] * 4, 'busiest_frac': 0.3 + 0.1 * i + 0.01 * seed,
            'usage_var': 0.001 * seed, 'router_entropy': 1.3, 'log_z': 2.0 + seed,
            'dropped_frac': 0.0}


def write_jsonl(path, records):
    path.write_text(''.join(json.dumps(r) + '\n' for r in records))


def read_config(folder):
    return json.loads((folder / 'config.json').read_text())


def write_run(folder, name, seed, total, active, moe, best_val=None):
    """A run of 2,500 training tokens at 6 x active FLOPs a token."""
    folder.mkdir(parents=True)
    config = {'config_name': name, 'seed': seed, 'iters': 20, 'tokens_per_iter': 100,
              'max_tokens': 2000,
              'd_model': 16, 'data_dir': str(folder.parent.parent / 'data'),
              'params': {'total': total, 'active': active}, 'flops_per_token': 6 * active}
    (folder / 'config.json').write_text(json.dumps(config))
    lines, best = [], math.inf
    values = curve(best_val or BEST[name][seed], seed)
    for i, (tokens, val) in enumerate(zip(TOKENS, values)):
        best = min(best, val)
        lines.append({'iter': 10 * i, 'tokens': tokens, 'val_loss': val, 'best_val': best})
        if moe:
            lines[-1].update(routing(i, seed))
        # a training line
        lines.append({'iter': 10 * i + 5, 'tokens': tokens + 500, 'loss': 3.0, 'ce': 3.0})
    write_jsonl(folder / 'log.jsonl', lines)


def write_runs(root):
    """The runs of BEST in root/out, with the params of a CPU-scale trio and a top-1 ablation."""
    sizes = {'cpu_moe': (270, 160, True), 'cpu_dense_active': (160, 160, False),
             'cpu_dense_total': (271, 271, False), 'cpu_moe_top1': (270, 105, True)}
    for n, (name, seeds) in enumerate(BEST.items()):
        # folder names deliberately say nothing: runs are matched by config.json
        for seed in seeds:
            write_run(root / 'out' / f'run{n}{seed}', name, seed, *sizes[name])


@pytest.fixture
def runs(tmp_path):
    write_runs(tmp_path)
    return tmp_path


def make_report(runs, main=report.main):
    """A report (report.py's main) over every folder in runs/out -> its report.json, read back."""
    main([str(runs / 'out' / '*'), '--out', str(runs / 'rep')])
    return json.loads((runs / 'rep' / 'report.json').read_text())


def test_table_gaps_and_curves_are_exact(runs):
    r = make_report(runs)
    for name, seeds in BEST.items():
        c = r['configs'][name]
        values = list(seeds.values())
        assert c['seeds'] == {str(s): v for s, v in seeds.items()}
        assert c['mean'] == pytest.approx(statistics.mean(values))
        assert c['std'] == pytest.approx(statistics.stdev(values) if len(values) > 1 else 0.0)
    assert r['configs']['cpu_moe']['role'] == 'moe'
    assert r['configs']['cpu_moe_top1']['role'] is None
    assert (r['configs']['cpu_moe']['total'], r['configs']['cpu_moe']['active']) == (270, 160)

    # 0.05, 0.02, 0.07
    active = [BEST['cpu_dense_active'][s] - BEST['cpu_moe'][s] for s in (1, 2, 3)]
    # 0.02, -0.01, 0.02
    total = [BEST['cpu_moe'][s] - BEST['cpu_dense_total'][s] for s in (1, 2, 3)]
    for gap, diffs in (('active', active), ('total', total)):
        g = r['gaps'][gap]
        assert g['n'] == 3
        assert g['per_seed'] == {str(s): pytest.approx(d) for s, d in zip((1, 2, 3), diffs)}
        assert g['mean'] == pytest.approx(statistics.mean(diffs))
        assert g['std'] == pytest.approx(statistics.stdev(diffs))
        assert g['se'] == pytest.approx(statistics.stdev(diffs) / 3 ** 0.5)
    assert r['gaps']['active']['positive'] == 3
    # -0.01 at seed 2
    assert r['gaps']['total']['positive'] == 2

    # at 1000 and 2000 tokens the seed-paired differences are those of the bests
    assert r['gap_vs_tokens']['tokens'] == TOKENS
    mean_active, mean_total = statistics.mean(active), statistics.mean(total)
    assert r['gap_vs_tokens']['active'] == pytest.approx([0.0, mean_active, mean_active])
    assert r['gap_vs_tokens']['total'] == pytest.approx([0.0, mean_total, mean_total])

    # routing diagnostics come from the best eval point (the middle one, i = 1), not the last
    d = r['diagnostics']['cpu_moe']
    # 0.4 + 0.01 * mean seed (2)
    assert d['busiest_frac']['mean'] == pytest.approx(0.42)
    assert [e['mean'] for e in d['load']] == pytest.approx([0.25] * 4)
    assert d['busiest_frac']['std'] == pytest.approx(0.01)
    assert d['log_z']['mean'] == pytest.approx(4.0) and d['dropped_frac']['mean'] == 0.0
    assert set(r['diagnostics']) == {'cpu_moe', 'cpu_moe_top1'}

    text = (runs / 'rep' / 'report.md').read_text()
    # 2,500 tokens at 6 x 160 FLOPs
    assert '| cpu_moe | moe | 270 | 160 | 2.4e+06 | 1,2,3 | 1.2033 ± 0.0153 |' in text
    assert (runs / 'rep' / 'cpu_val_loss_flops.png').exists()
    for png in ('cpu_val_loss.png', 'cpu_gaps.png', 'expert_load.png'):
        assert (runs / 'rep' / png).stat().st_size > 1000 and f']({png})' in text


def test_a_family_of_short_runs_says_its_gaps_are_not_the_recipes(runs):
    note = 'Short runs: these stop after 20 steps, before their configs\' token budget.'
    make_report(runs)
    assert note not in (runs / 'rep' / 'report.md').read_text()
    folder = next((runs / 'out').glob('run1*'))  # a cpu_dense_active run cut short by max_iters
    config = read_config(folder)
    (folder / 'config.json').write_text(json.dumps({**config, 'max_tokens': 10**6}))
    make_report(runs)
    text = (runs / 'rep' / 'report.md').read_text()
    assert text.count(note) == 1 and text.index('## Gaps: cpu') < text.index(note)


def test_a_run_whose_data_order_is_not_its_seeds_is_left_out_with_a_word(runs):
    """A seed-noise run (seed 1's init, data order 2) is not seed 1 of its config."""
    noise = runs / 'out' / 'noise'
    write_run(noise, 'cpu_moe', 1, 270, 160, True, best_val=0.5)
    (noise / 'config.json').write_text(json.dumps({**read_config(noise), 'data_seed': 2}))
    r = make_report(runs)
    # not the noise run's 0.5
    assert r['configs']['cpu_moe']['seeds']['1'] == pytest.approx(BEST['cpu_moe'][1])
    report_lines = (runs / 'rep' / 'report.md').read_text().splitlines()
    assert any('data_seed 2' in line for line in report_lines)


def test_missing_runs_are_reported_not_fatal(runs, capsys):
    for folder in (runs / 'out').iterdir():
        config = read_config(folder)
        name = config['config_name']
        if name == 'cpu_dense_total' or (name == 'cpu_moe' and config['seed'] == 3):
            shutil.rmtree(folder)
    (runs / 'out' / 'junk').mkdir()
    # no config_name
    (runs / 'out' / 'junk' / 'config.json').write_text('{"seed": 1}')
    r = make_report(runs)
    assert r['gaps']['total'] == {'mean': None, 'std': None, 'se': None, 'n': 0, 'positive': 0,
                                  'per_seed': {}, 't': None, 'decided': False, 'ahead': None,
                                  'paper_sign': None}
    # seeds 1 and 2 are paired
    assert r['gaps']['active']['n'] == 2
    assert r['gap_vs_tokens']['total'] == [] and len(r['gap_vs_tokens']['active']) == 3
    text = capsys.readouterr().out
    assert 'missing cpu_dense_total' in text and 'skipped' in text and 'junk' in text
    assert '| cpu_moe | moe |' in text and (runs / 'rep' / 'cpu_val_loss.png').exists()


def drawn_plots(monkeypatch):
    """{file name: (title, y label, legend entries, bands)} of the plots report.py draws, each
    figure read where report.save would write it."""
    import matplotlib.pyplot as plt
    drawn = {}

    def save(fig, out_dir, name):
        ax = fig.axes[0]
        legend = [text.get_text() for text in ax.get_legend().get_texts()]
        drawn[name] = (ax.get_title(), ax.get_ylabel(), legend, len(ax.collections))
        plt.close(fig)
        return name
    monkeypatch.setattr(report, 'save', save)
    return drawn


def test_gaps_in_words_with_their_paired_t_and_verdict(runs, monkeypatch):
    """Three seeds: the active gap's t passes 2.5, the total gap's does not; both have the paper's
    sign. The plots say how many seeds they show, and where each gap has the MoE ahead."""
    drawn = drawn_plots(monkeypatch)
    r = make_report(runs)
    text = (runs / 'rep' / 'report.md').read_text()
    expected = {}
    for gap, (a, b) in (('active', ('cpu_dense_active', 'cpu_moe')),
                        ('total', ('cpu_moe', 'cpu_dense_total'))):
        diffs = [BEST[a][s] - BEST[b][s] for s in (1, 2, 3)]
        expected[gap] = (statistics.mean(diffs),
                         statistics.mean(diffs) / (statistics.stdev(diffs) / math.sqrt(3)))
    (active, t_active), (total, t_total) = expected['active'], expected['total']
    # 0.0467 / 0.0145 and 0.01 / 0.01
    assert t_active == pytest.approx(3.212, abs=1e-3) and t_total == pytest.approx(1.0)
    assert (f'- matched-active: the MoE is ahead of dense_active by {active:.4f} over 3 seeds, '
            f'paired t {t_active:.2f}: decided (|t| > 2.5).') in text.splitlines()
    assert (f'- matched-total: dense_total is ahead of the MoE by {total:.4f} over 3 seeds, '
            f'paired t {t_total:.2f}: not decided (|t| ≤ 2.5).') in text.splitlines()
    assert 'other sign' not in text and 'decides nothing' not in text
    for gap, t, decided, ahead in (('active', t_active, True, 'moe'),
                                   ('total', t_total, False, 'dense_total')):
        g = r['families']['cpu_']['gaps'][gap]
        assert g['t'] == pytest.approx(t) and g['decided'] is decided
        assert g['ahead'] == ahead and g['paper_sign'] is True
        # the headline gaps are the same
        assert r['gaps'][gap] == g

    title, _, legend, bands = drawn['cpu_val_loss.png']
    assert legend == ['cpu_dense_active (3 seeds)', 'cpu_moe (3 seeds)',
                      'cpu_dense_total (3 seeds)']
    assert 'min-max' in title and bands == 3
    _, ylabel, legend, _ = drawn['cpu_gaps.png']
    assert legend == ['active gap: dense_active - moe (the MoE ahead above 0)',
                      'total gap: moe - dense_total (the MoE ahead below 0)']
    assert ylabel == 'val loss difference (first - second model)'


def test_one_seed_decides_nothing_and_shows_no_spread(tmp_path, monkeypatch):
    """make cpu SEEDS=1: the MoE ahead of both dense models, by 0.03 (the paper's sign) and by 0.05
    (the other sign from the paper's)."""
    bests = {'cpu_moe': (1.20, 270, 160, True), 'cpu_dense_active': (1.23, 160, 160, False),
             'cpu_dense_total': (1.25, 271, 271, False)}
    for name, (best, total, active, moe) in bests.items():
        write_run(tmp_path / 'out' / name, name, 1, total, active, moe, best_val=best)
    drawn = drawn_plots(monkeypatch)
    r = make_report(tmp_path)
    lines = (tmp_path / 'rep' / 'report.md').read_text().splitlines()
    assert ('- matched-active: the MoE is ahead of dense_active by 0.0300 on 1 seed: one seed '
            'decides nothing.') in lines
    assert ('- matched-total: the MoE is ahead of dense_total by 0.0500 on 1 seed: one seed '
            'decides nothing; the other sign from the paper\'s +0.0180.') in lines
    # no spread from one seed: not in the table, the gaps or the routing
    assert not any('± 0.0000' in line for line in lines)
    assert any(line.startswith('| matched-active: dense_active - moe | +0.0300 | - |')
               for line in lines)
    gaps = r['gaps']
    assert gaps['active']['t'] is None and gaps['active']['decided'] is False
    assert (gaps['active']['ahead'], gaps['active']['paper_sign']) == ('moe', True)
    assert (gaps['total']['ahead'], gaps['total']['paper_sign']) == ('moe', False)

    title, _, legend, bands = drawn['cpu_val_loss.png']
    assert legend == ['cpu_dense_active (1 seed)', 'cpu_moe (1 seed)', 'cpu_dense_total (1 seed)']
    assert title == 'cpu: validation loss' and bands == 0


@pytest.mark.parametrize('mean,decided,ahead,paper_sign', [(0.026, True, 'moe', True),
                                                           (0.024, False, 'moe', True),
                                                           (-0.024, False, 'dense_active', False),
                                                           (-0.026, True, 'dense_active', False)])
def test_an_active_gap_is_decided_where_its_t_passes_2_5(mean, decided, ahead, paper_sign):
    """t = mean / standard error: 0.026 / 0.01 = 2.6 and 0.024 / 0.01 = 2.4, either sign."""
    gap = {'mean': mean, 'std': 0.02, 'se': 0.01, 'n': 4, 'positive': 2, 'per_seed': {}}
    g = report.judged('active', gap)
    assert g['t'] == pytest.approx(mean / 0.01)
    assert (g['decided'], g['ahead'], g['paper_sign']) == (decided, ahead, paper_sign)


def damage_logs(runs):
    """Seed 2 of the MoE diverged after its first real eval, its log cut off mid-line; seed 3
    is an old log without routing statistics."""
    folders = {}
    for folder in (runs / 'out').iterdir():
        config = read_config(folder)
        folders[config['config_name'] + str(config['seed'])] = folder
    log = folders['cpu_moe2'] / 'log.jsonl'
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    lines[4]['val_loss'] = float('nan')
    write_jsonl(log, lines)
    with open(log, 'a') as f:
        f.write('{"iter": 3')
    log = folders['cpu_moe3'] / 'log.jsonl'
    routing_keys = report.ROUTING + ('load',)
    old = []
    for x in log.read_text().splitlines():
        old.append({k: v for k, v in json.loads(x).items() if k not in routing_keys})
    write_jsonl(log, old)


def test_diverged_truncated_and_old_logs_do_not_break_the_report(runs):
    damage_logs(runs)
    # strict JSON: NaN would not parse back as null
    r = make_report(runs)
    # the best finite eval
    assert r['configs']['cpu_moe']['seeds']['2'] == pytest.approx(1.22)
    # seeds 1 and 2
    assert r['diagnostics']['cpu_moe']['busiest_frac']['mean'] == pytest.approx((0.41 + 0.42) / 2)
    assert not math.isnan(r['configs']['cpu_moe']['mean'])


def test_plotted_curves_share_points_and_leave_out_the_untrained_model():
    """The val loss curves a plot draws: the points every seed logged, without x = 0."""
    seeds = {1: {'evals': [{'flops': 0, 'val_loss': 5.5}, {'flops': 10, 'val_loss': 2.0},
                           {'flops': 20, 'val_loss': 1.5}]},
             2: {'evals': [{'flops': 0, 'val_loss': 5.4}, {'flops': 10, 'val_loss': 2.2}]}}
    assert report.trained_val_curves(seeds, 'flops') == ([10], [[2.0], [2.2]])
    assert report.pointwise_mean([[2.0, 1.0], [2.2, 3.0]]) == pytest.approx([2.1, 2.0])


def test_flops_of_logs_written_before_train_logged_them():
    """A run whose config.json has no flops_per_token gets train.py's count."""
    config = {'config_name': 'cpu_moe', 'ffn': 'moe', 'd_model': 44, 'n_layer': 4, 'n_head': 2,
              'vocab_size': 257, 'block_size': 256, 'moe_hidden': 88, 'n_experts': 4,
              'top_k': 2}
    records = [{'iter': 0, 'tokens': 0}, {'iter': 10, 'tokens': 40960}]
    report.add_flops(config, records)
    assert config['flops_per_token'] == 1_085_832  # cpu_moe's, as train.py counts it
    assert [r['flops'] for r in records] == [0, 40960 * 1_085_832]


def test_no_runs_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match='no runs found in .*nothing'):
        report.main([str(tmp_path / 'nothing*')])
    # from the command line: one line on stderr, exit status 1, no traceback
    out = run('report.py', str(tmp_path / 'nothing*'))
    assert out.returncode == 1
    assert out.stderr.startswith('report.py: error: no runs found in ')
    assert len(out.stderr.splitlines()) == 1


@pytest.mark.parametrize('name,expected', [('moe', ('', 'moe')), ('cpu_moe', ('cpu_', 'moe')),
                                           ('cpu_dense_total', ('cpu_', 'dense_total')),
                                           ('dense_active', ('', 'dense_active')),
                                           ('cpu_moe_top1', (None, None)),
                                           ('moe_noz', (None, None))])
def test_roles_come_from_config_names(name, expected):
    assert report.role_of(name) == expected


def test_plateau_exit_is_the_first_logged_step_below_the_threshold(tmp_path):
    """Training CE 3.0, 2.6, 2.4 (exit at that step), then 2.0; a run that never gets below 2.5;
    an eval line's val_loss below 2.5 does not count."""
    def write(folder, seed, ces):
        folder.mkdir(parents=True)
        config = {'config_name': 'cpu_moe', 'seed': seed, 'iters': 100, 'tokens_per_iter': 10,
                  'max_tokens': 1000, 'params': {'total': 5, 'active': 3}}
        (folder / 'config.json').write_text(json.dumps(config))
        lines = [{'iter': 0, 'tokens': 0, 'val_loss': 2.0, 'best_val': 2.0}]
        for i, ce in enumerate(ces):
            lines.append({'iter': 25 * (i + 1), 'tokens': 250 * (i + 1), 'loss': ce + 0.1,
                          'ce': ce})
        write_jsonl(folder / 'log.jsonl', lines)
    write(tmp_path / 'a', 1, [3.0, 2.6, 2.4, 2.0])
    write(tmp_path / 'b', 2, [3.0, 2.9, 2.7, 2.6])
    write(tmp_path / 'c', 3, [2.4, 2.0, 1.9, 1.8])
    folders = [str(tmp_path / x) for x in ('a', 'b', 'c')]
    report.main(folders + ['--out', str(tmp_path / 'rep')])
    r = json.loads((tmp_path / 'rep' / 'report.json').read_text())
    assert r['configs']['cpu_moe']['exit_step'] == {'1': 75, '2': None, '3': 25}
    assert '| 50 [25-75], never: 1 |' in (tmp_path / 'rep' / 'report.md').read_text()
