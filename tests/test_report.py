"""report.py on synthetic run folders whose numbers are known exactly."""
import json
import math
import os
import shutil
import statistics

import pytest

import report
from conftest import REPO, run
from plumbing import UserError

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


@pytest.fixture
def runs(tmp_path):
    sizes = {'cpu_moe': (270, 160, True), 'cpu_dense_active': (160, 160, False),
             'cpu_dense_total': (271, 271, False), 'cpu_moe_top1': (270, 105, True)}
    for n, (name, seeds) in enumerate(BEST.items()):
        # folder names deliberately say nothing: runs are matched by config.json
        for seed in seeds:
            write_run(tmp_path / 'out' / f'run{n}{seed}', name, seed, *sizes[name])
    return tmp_path


def make_report(runs):
    """report.py over every folder in runs/out -> its report.json, read back."""
    report.main([str(runs / 'out' / '*'), '--out', str(runs / 'rep')])
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

    # the ablation against its default MoE: seed-paired (seed 1 only), routing over training for
    # both
    v = r['variants']['cpu_moe_top1']
    assert v['base'] == 'cpu_moe' and v['n'] == 1 and v['mean'] == pytest.approx(0.10)
    busiest = r['variant_curves']['busiest_frac']
    # the default first
    assert list(busiest) == ['cpu_moe', 'cpu_moe_top1']
    assert busiest['cpu_moe_top1'] == {'tokens': TOKENS, 'mean': pytest.approx([0.31, 0.41, 0.51])}
    # the mean over seeds
    assert busiest['cpu_moe'] == {'tokens': TOKENS, 'mean': pytest.approx([0.32, 0.42, 0.52])}
    assert r['variant_curves']['log_z']['cpu_moe']['mean'] == pytest.approx([4.0] * 3)
    # one family is no scan
    assert r['scan'] == []

    # and against the dense models of its family, variant - dense: seed 1 only
    assert v['vs_dense_total']['per_seed'] == {'1': pytest.approx(1.30 - 1.18)}
    assert v['vs_dense_active']['n'] == 1
    assert v['vs_dense_active']['mean'] == pytest.approx(1.30 - 1.25)

    text = (runs / 'rep' / 'report.md').read_text()
    # 2,500 tokens at 6 x 160 FLOPs
    assert '| cpu_moe | moe | 270 | 160 | 2.4e+06 | 1,2,3 | 1.2033 ± 0.0153 |' in text
    assert (runs / 'rep' / 'cpu_val_loss_flops.png').exists()
    assert ('| cpu_moe_top1 | cpu_moe | +0.1000 ± 0.0000 | 1 | s1: +0.1000 | '
            '+0.1200 ± 0.0000 [0 of 1 < 0] | +0.0500 ± 0.0000 [0 of 1 < 0] |') in text
    for png in ('cpu_val_loss.png', 'cpu_gaps.png', 'expert_load.png', 'variants_routing.png'):
        assert (runs / 'rep' / png).stat().st_size > 1000 and f']({png})' in text


def test_scan_orders_complete_families_by_tokens_per_parameter(runs):
    """A second complete family, 4x the parameters on the same tokens: one scan row per family,
    ordered by training tokens per total MoE parameter, with its seed-paired gaps and the epochs
    its data allows."""
    big = {'big_moe': (1.0, 1080, 640, True), 'big_dense_active': (1.1, 640, 640, False),
           'big_dense_total': (0.95, 1084, 1084, False)}
    for name, (best, total, active, moe) in big.items():
        write_run(runs / 'out' / name, name, 1, total, active, moe, best_val=best)
    # a third family whose dense_active shares no seed with its MoE: no active gap, but a row and
    # a plot
    for name, seed in (('odd_moe', 1), ('odd_dense_active', 2), ('odd_dense_total', 1)):
        write_run(runs / 'out' / name, name, seed, 270, 160, name == 'odd_moe', best_val=1.0)
    # a seed-noise run (seed 1's init, data order 2) is not seed 1 of its config: left out, with a
    # word
    noise = runs / 'out' / 'noise'
    write_run(noise, 'big_moe', 1, 1080, 640, True, best_val=0.5)
    (noise / 'config.json').write_text(json.dumps({**read_config(noise), 'data_seed': 2}))
    (runs / 'data').mkdir()
    (runs / 'data' / 'meta.json').write_text(json.dumps({'train_tokens': 1000}))
    r = make_report(runs)
    scan = [p for p in r['scan'] if p['family'] != 'odd_']
    # not the noise run's 0.5
    assert r['configs']['big_moe']['seeds'] == {'1': pytest.approx(1.0)}
    report_lines = (runs / 'rep' / 'report.md').read_text().splitlines()
    assert any('data_seed 2' in line for line in report_lines)
    odd = next(p for p in r['scan'] if p['family'] == 'odd_')
    assert odd['active']['n'] == 0 and odd['total']['n'] == 1
    assert [p['family'] for p in scan] == ['big_', 'cpu_']
    assert [p['tokens_per_param'] for p in scan] == pytest.approx([2000 / 1080, 2000 / 270])
    assert [p['epochs'] for p in scan] == pytest.approx([2.0, 2.0])
    assert scan[0]['active']['mean'] == pytest.approx(0.1)
    assert scan[0]['total']['mean'] == pytest.approx(0.05)
    assert scan[1]['active']['mean'] == pytest.approx(statistics.mean([0.05, 0.02, 0.07]))
    assert (runs / 'rep' / 'scan_gaps.png').stat().st_size > 1000


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
                                  'per_seed': {}}
    # seeds 1 and 2 are paired
    assert r['gaps']['active']['n'] == 2
    assert r['gap_vs_tokens']['total'] == [] and len(r['gap_vs_tokens']['active']) == 3
    text = capsys.readouterr().out
    assert 'missing cpu_dense_total' in text and 'skipped' in text and 'junk' in text
    assert '| cpu_moe | moe |' in text and (runs / 'rep' / 'cpu_val_loss.png').exists()


def test_diverged_truncated_and_old_logs_do_not_break_the_report(runs):
    folders = {}
    for folder in (runs / 'out').iterdir():
        config = read_config(folder)
        folders[config['config_name'] + str(config['seed'])] = folder
    # seed 2 of the MoE diverged after its first real eval, and its log ends in half a line
    log = folders['cpu_moe2'] / 'log.jsonl'
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    lines[4]['val_loss'] = float('nan')
    write_jsonl(log, lines)
    with open(log, 'a') as f:
        f.write('{"iter": 3')
    # seed 3 is an old log without routing statistics
    log = folders['cpu_moe3'] / 'log.jsonl'
    routing_keys = report.ROUTING + ('load',)
    old = []
    for x in log.read_text().splitlines():
        old.append({k: v for k, v in json.loads(x).items() if k not in routing_keys})
    write_jsonl(log, old)
    # strict JSON: NaN would not parse back as null
    r = make_report(runs)
    # the best finite eval
    assert r['configs']['cpu_moe']['seeds']['2'] == pytest.approx(1.22)
    # seeds 1 and 2
    assert r['diagnostics']['cpu_moe']['busiest_frac']['mean'] == pytest.approx((0.41 + 0.42) / 2)
    # and so is routing over training: the mean of the seeds that logged it
    busiest = r['variant_curves']['busiest_frac']['cpu_moe']['mean']
    assert busiest == pytest.approx([0.315, 0.415, 0.515])
    assert not math.isnan(r['configs']['cpu_moe']['mean'])


def test_who_wins_under_which_budget(tmp_path):
    """cpu_moe at the recipe's tokens, at dense_total's FLOPs (flops_cpu_moe) and at its time
    (time_cpu_moe), against cpu_dense_total seed by seed (with t), with each budget's tokens,
    epochs, FLOPs, training time (from tok_per_s), fastest step and end-of-run behaviour, and the
    step times of --bench."""
    best = {'cpu_dense_total': (1.20, 1.22), 'cpu_moe': (1.25, 1.24),
            'flops_cpu_moe': (1.18, 1.23), 'time_cpu_moe': (1.21, 1.21)}
    scale = {'cpu_dense_total': 1.0, 'cpu_moe': 1.0, 'flops_cpu_moe': 1.5, 'time_cpu_moe': 1.25}
    for name, values in best.items():
        for seed, value in enumerate(values, 1):
            folder = tmp_path / 'out' / f'{name}-s{seed}'
            write_run(folder, name, seed, 270, 270 if 'dense' in name else 160, False, value)
            # the budget's tokens, at 1,000 (dense) or 2,000 tokens a second
            lines = [json.loads(x) for x in (folder / 'log.jsonl').read_text().splitlines()]
            for r in lines:
                r['tokens'] = round(r['tokens'] * scale[name])
                if 'ce' in r:
                    r['tok_per_s'] = 1000.0 if 'dense' in name else 2000.0
            write_jsonl(folder / 'log.jsonl', lines)
    # the training split: 2,000 tokens
    (tmp_path / 'data').mkdir()
    (tmp_path / 'data' / 'meta.json').write_text(json.dumps({'train_tokens': 2000}))
    bench_dir = tmp_path / 'bench'
    bench_dir.mkdir()
    step_ms = {'moe': 40.0, 'dense_total': 50.0, 'dense_active': 30.0}
    (bench_dir / 'cpu_moe.txt').write_text('a table\n' + json.dumps(
        {'ms_per_step': step_ms, 'hardware': 'a CPU', 'torch': '2.x'}) + '\n')
    # r's quartiles 1.0-1.1 lie below the fixture's k* interval: the MoE loses on time
    write_ratio(tmp_path / 'ratio', 'alone', 'cpu_moe',
                {'median': 1.05, 'q1': 1.0, 'q3': 1.1, 'rounds': [1.0, 1.05, 1.1]})
    # an r with no k* here: in the table without a verdict
    write_ratio(tmp_path / 'ratio', 'paper_width', 'cpu_moe_d160',
                {'median': 2.0, 'q1': 1.9, 'q3': 2.1, 'rounds': [1.9, 2.0, 2.1]})
    report.main([str(tmp_path / 'out' / '*'), '--out', str(tmp_path / 'rep'),
                 '--bench', str(bench_dir), '--ratio', str(tmp_path / 'ratio')])
    r = json.loads((tmp_path / 'rep' / 'report.json').read_text())
    assert [row['verdict'] for row in r['step_time_ratio']] == ['loses', None]
    moe = r['compute']['cpu_moe']
    assert moe['step_ms'] == {'moe': 40.0, 'dense_total': 50.0, 'hardware': 'a CPU',
                              'torch': '2.x'}
    # each curve's best is in its middle, 0.01 x seed below its last evaluation
    assert (moe['best_is_last'], moe['rise_after_best']) == (0, pytest.approx(0.015))
    assert moe['epochs'] == pytest.approx(2500 / 2000)
    assert moe['train_seconds_per_seed'] == {'1': 2.5, '2': 2.5}
    # 100 tokens a step
    assert moe['fastest_step_ms'] == pytest.approx(1e3 * 100 / 1000)
    assert moe['budgets']['tokens']['fastest_step_ms'] == pytest.approx(1e3 * 100 / 2000)
    assert moe['dense_total'] == 'cpu_dense_total' and list(moe['budgets']) == ['tokens', 'flops',
                                                                                 'time']
    assert (moe['tokens'], moe['flops'], moe['train_seconds']) == (2500, 2500 * 6 * 270, 2.5)
    for budget, name in (('tokens', 'cpu_moe'), ('flops', 'flops_cpu_moe'),
                         ('time', 'time_cpu_moe')):
        b = moe['budgets'][budget]
        assert b['tokens'] == round(2500 * scale[name])
        assert b['flops'] == b['tokens'] * 6 * 160 and b['train_seconds'] == b['tokens'] / 2000
        diffs = [m - d for m, d in zip(best[name], best['cpu_dense_total'])]
        g = b['vs_dense_total']
        assert g['per_seed'] == {str(s): pytest.approx(d) for s, d in enumerate(diffs, 1)}
        assert g['mean'] == pytest.approx(statistics.mean(diffs))
        se = statistics.stdev(diffs) / math.sqrt(2)
        assert g['t'] == pytest.approx(statistics.mean(diffs) / se)
        assert b['epochs'] == pytest.approx(b['tokens'] / 2000)
    # budget runs are in no family of their own
    assert set(r['families']) == {'cpu_'}
    assert (tmp_path / 'rep' / 'cpu_moe_budgets.png').exists()
    assert (tmp_path / 'rep' / 'who_wins.png').exists()
    assert (tmp_path / 'rep' / 'break_even.png').exists()
    text = (tmp_path / 'rep' / 'report.md').read_text()
    row = ('| cpu_moe | equal FLOPs | 0.00M | 1.88 | 3.6e+06 | 2 s '
           '| -0.0050 ± 0.0212 [1 of 2 < 0] | -0.3 | 0 of 2 (+0.0150) |')
    assert row in text
    assert ('| cpu_moe_d160 | paper_width | a CPU | 2.x | 3 | 2.000 [1.900-2.100] | - | - |'
            in text)
    assert ('- cpu_moe: 40.0 ms a step, its dense_total 50.0 ms (1.250x); a CPU, torch 2.x. Its '
            'equal-time runs trained for 1.250x the tokens. The fastest logged training intervals: '
            '50.0 and 100.0 ms (2.000x).') in text
    assert [moe['budgets'][b]['k'] for b in ('tokens', 'flops', 'time')] == [1.0, 1.5, 1.25]
    assert r['break_even']['cpu_moe']['seeds'] == 2


def gap_at_k(k, per_seed):
    """A budget entry as compute_gaps makes it: its k and its seed-paired gap."""
    gap = {'per_seed': per_seed, 'mean': statistics.mean(per_seed.values()), 'std': 0.0,
           'n': len(per_seed), 'positive': sum(v > 0 for v in per_seed.values()), 't': None}
    return {'k': k, 'vs_dense_total': gap}


def test_budget_runs_are_named_by_their_budget_or_their_token_multiplier():
    assert report.budget_of('time_cpu_moe') == ('time', 'cpu_moe')
    assert report.budget_of('k1.35_w224_cpu_moe') == ('k1.35', 'w224_cpu_moe')
    assert report.budget_of('k2_cpu_moe_shared') == ('k2', 'cpu_moe_shared')
    assert report.budget_of('w224_cpu_moe') == ('tokens', 'w224_cpu_moe')
    assert report.budget_of('kind_cpu_moe') == ('tokens', 'kind_cpu_moe')
    assert report.budget_label('k1.2', {'k': 1.2}) == '1.20x the tokens'
    assert report.budget_label('flops', {'k': 1.5}) == 'equal FLOPs'


def test_crossing_is_linear_between_trained_ks_or_says_which_side():
    assert report.crossing([1.0, 1.25, 1.5], [0.03, -0.01, -0.02]) == pytest.approx(1.1875)
    assert report.crossing([1.0, 1.5], [-0.01, -0.02]) == -math.inf  # the MoE wins at every k
    assert report.crossing([1.0, 1.5], [0.02, 0.01]) == math.inf  # and at none


def test_break_even_k_star_its_interval_and_each_seeds():
    # seed 1 reaches 0 at k 1.25, seed 2 at 1.125, their mean (0.03, -0.01, -0.025) at 1.1875;
    # seed 3 was trained at one k only and is left out
    entry = {'budgets': {'tokens': gap_at_k(1.0, {'1': 0.04, '2': 0.02, '3': 0.5}),
                         'time': gap_at_k(1.25, {'1': 0.0, '2': -0.02}),
                         'flops': gap_at_k(1.5, {'1': -0.02, '2': -0.03})}}
    b = report.break_even(entry)
    assert b['seeds'] == 2 and b['k_star'] == pytest.approx(1.1875)
    assert b['per_seed'] == {'1': pytest.approx(1.25), '2': pytest.approx(1.125)}
    # resampling two seeds: both seed 2 (k* 1.125) a quarter of the time, both seed 1 a quarter
    assert b['interval'] == [pytest.approx(1.125), pytest.approx(1.25)]
    assert [g['k'] for g in b['per_k']] == [1.0, 1.25, 1.5]
    assert b['per_k'][0]['n'] == 3  # each k's own gap, over all of its seeds
    assert report.break_even({'budgets': {'tokens': entry['budgets']['tokens']}}) is None


def write_ratio(folder, setting, config, rounds):
    """A make ratio output: bench.py's table, then its JSON line."""
    (folder / setting).mkdir(parents=True, exist_ok=True)
    result = {'ms_per_step': {'moe': 40.0, 'dense_total': 50.0}, 'hardware': 'a CPU',
              'torch': '2.x', 'dense_total_over_moe_rounds': rounds}
    (folder / setting / f'{config}.txt').write_text('a table\n' + json.dumps(result) + '\n')


def test_step_time_ratios_against_k_star_give_each_machine_a_verdict(tmp_path):
    rounds = {'median': 1.3, 'q1': 1.25, 'q3': 1.35, 'rounds': [1.2, 1.25, 1.3, 1.35, 1.4]}
    write_ratio(tmp_path, 'alone', 'cpu_moe', rounds)
    write_ratio(tmp_path, 'side_by_side', 'cpu_moe_shared', rounds)
    rows = report.read_ratio_folder(str(tmp_path))
    assert rows == [{'config': 'cpu_moe', 'setting': 'alone', 'hardware': 'a CPU',
                     'torch': '2.x', **rounds},
                    {'config': 'cpu_moe_shared', 'setting': 'side_by_side',
                     'hardware': 'a CPU', 'torch': '2.x', **rounds}]
    row = rows[0]

    def trained(low, high, ks=(1.0, 1.5)):
        return {'k_star': 1.15, 'interval': [low, high], 'per_k': [{'k': k} for k in ks]}
    # the quartiles 1.25-1.35 against k*'s interval
    assert report.verdict(row, trained(1.1, 1.2)) == 'wins'
    assert report.verdict(row, trained(1.3, 1.4)) == 'undecided'
    assert report.verdict(row, trained(1.2, 1.26)) == 'undecided'
    assert report.verdict(row, trained(1.4, 1.5)) == 'loses'
    assert report.verdict(row, None) is None
    # k* below every trained k (the MoE ahead at all of them): it wins where r is above the first k
    assert report.verdict(row, trained(-math.inf, -math.inf, ks=(1.2, 1.5))) == 'wins'
    assert report.verdict(row, trained(-math.inf, -math.inf, ks=(1.3, 1.5))) == 'undecided'
    assert report.verdict(row, trained(-math.inf, 1.1, ks=(1.2, 1.5))) == 'wins'
    # and above every trained k: it loses where r is below the last one
    assert report.verdict(row, trained(math.inf, math.inf, ks=(1.0, 1.4))) == 'loses'
    assert report.verdict(row, trained(math.inf, math.inf, ks=(1.0, 1.3))) == 'undecided'
    assert report.interval_within_trained(trained(-math.inf, 1.1, ks=(1.0, 1.5))) == [1.0, 1.1]
    # a warmup study's k* (w224_cpu_moe) is the one the ratio of cpu_moe is set against
    entries = {'w224_cpu_moe_shared': trained(1.4, 1.5), 'w224_cpu_moe': trained(1.1, 1.2)}
    assert report.break_even_name('cpu_moe', entries) == 'w224_cpu_moe'
    assert report.break_even_name('cpu_moe_sparse16', entries) is None
    # the plot draws an r only beside its MoE's k*: given cpu_moe's alone, cpu_moe_shared's is out
    assert report.ratios_with_k_star(rows, entries) == [('w224_cpu_moe', row),
                                                        ('w224_cpu_moe_shared', rows[1])]
    only_moe = {'w224_cpu_moe': entries['w224_cpu_moe']}
    assert report.ratios_with_k_star(rows, only_moe) == [('w224_cpu_moe', row)]
    lines = report.ratio_lines([{**row, 'verdict': 'wins'}], entries)
    assert lines[-1] == ('| cpu_moe | alone | a CPU | 2.x | 5 | 1.300 [1.250-1.350] | '
                         '1.150 [1.100-1.200] | wins |')


def test_ratio_folders_without_ratios_per_round_are_one_clear_error(tmp_path):
    with pytest.raises(UserError, match='make them with: make ratio'):
        report.read_ratio_folder(str(tmp_path))
    (tmp_path / 'alone').mkdir()
    result = {'ms_per_step': {'moe': 40.0, 'dense_total': 50.0}}
    (tmp_path / 'alone' / 'cpu_moe.txt').write_text(json.dumps(result) + '\n')
    with pytest.raises(UserError, match='no step-time ratio per round.*make ratio'):
        report.read_ratio_folder(str(tmp_path))


def write_pair_run(folder, tok_per_s):
    """A finished run of 10 steps of 100 tokens, logged at steps 5 and 10 at tok_per_s."""
    folder.mkdir(parents=True)
    (folder / 'config.json').write_text(json.dumps({'iters': 10, 'cpu': 'a CPU',
                                                    'torch': '2.x'}))
    lines = [{'iter': 0, 'tokens': 0, 'val_loss': 5.0},
             {'iter': 5, 'tokens': 500, 'tok_per_s': tok_per_s},
             {'iter': 10, 'tokens': 1000, 'tok_per_s': tok_per_s}]
    (folder / 'log.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in lines))
    (folder / 'done.json').write_text('{}')


def test_whole_runs_side_by_side_give_r_per_pair(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(os.path.join(REPO, 'scripts'))
    import pair_ratio
    # the MoE at 1000 tokens/s (1 s for its 10 steps: 100 ms a step) in both pairs; dense_total at
    # 800 and 500: r 1.25 and 2.0
    for seed, dense_speed in ((1, 800), (2, 500)):
        write_pair_run(tmp_path / f'cpu_moe-s{seed}' / 'moe', 1000)
        write_pair_run(tmp_path / f'cpu_moe-s{seed}' / 'dense_total', dense_speed)
    pair_ratio.main([str(tmp_path / 'cpu_moe-s1'), str(tmp_path / 'cpu_moe-s2')])
    out = capsys.readouterr().out
    result = json.loads(out.splitlines()[-1])
    ms = result['ms_per_step']
    assert ms == {'moe': pytest.approx(100.0), 'dense_total': pytest.approx(162.5)}
    assert (result['hardware'], result['torch']) == ('a CPU', '2.x')
    r = result['dense_total_over_moe_rounds']
    assert r['rounds'] == [pytest.approx(1.25), pytest.approx(2.0)]
    # quartiles by the inclusive rule: within the measured values
    assert (r['median'], r['q1'], r['q3']) == (pytest.approx(1.625), pytest.approx(1.4375),
                                               pytest.approx(1.8125))
    # report.py --ratio reads it as a setting of its own
    (tmp_path / 'ratio' / 'whole_runs').mkdir(parents=True)
    (tmp_path / 'ratio' / 'whole_runs' / 'cpu_moe.txt').write_text(out)
    [row] = report.read_ratio_folder(str(tmp_path / 'ratio'))
    assert row['setting'] == 'whole_runs' and row['median'] == r['median']
    (tmp_path / 'cpu_moe-s2' / 'moe' / 'done.json').unlink()
    with pytest.raises(UserError, match='not a finished run; train the pair with: make ratio'):
        pair_ratio.main([str(tmp_path / 'cpu_moe-s2')])


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


def test_a_bench_folder_without_outputs_is_one_clear_error(runs):
    (runs / 'bench').mkdir()
    with pytest.raises(UserError, match='give the folder make compute writes them to'):
        report.main([str(runs / 'out' / '*'), '--bench', str(runs / 'bench')])


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


def test_plateau_table_shows_the_routers_steps_and_each_runs_exit(tmp_path, capsys):
    # scripts/, on the path through conftest
    import plateau
    for name, ces in (('moe', [4.6, 3.0, 2.9, 2.4]), ('dense', [4.6, 2.4, 2.0, 1.9])):
        (tmp_path / name).mkdir()
        lines = []
        for i, ce in enumerate(ces):
            line = {'iter': 25 * (i + 1), 'ce': ce}
            if name == 'moe':
                line.update(busiest_frac=0.5 - 0.05 * i, router_entropy=1.38, log_z=0.2 * i)
            lines.append(line)
        lines.append({'iter': 100, 'val_loss': 2.3, 'best_val': 2.3})
        write_jsonl(tmp_path / name / 'log.jsonl', lines)
    plateau.main([str(tmp_path / 'moe'), str(tmp_path / 'dense'), '--until', '75',
                  '--out', str(tmp_path / 'p.md')])
    rows = (tmp_path / 'p.md').read_text().splitlines()
    assert rows[0] == '| run | exit | value | 25 | 50 | 75 |'
    assert rows[2:] == ['| moe | 100 | ce | 4.600 | 3.000 | 2.900 |',
                        '| moe | 100 | busiest_frac | 0.500 | 0.450 | 0.400 |',
                        '| moe | 100 | router_entropy | 1.380 | 1.380 | 1.380 |',
                        '| moe | 100 | log_z | 0.000 | 0.200 | 0.400 |',
                        '| dense | 50 | ce | 4.600 | 2.400 | 2.000 |']
    assert capsys.readouterr().out.strip() == '\n'.join(rows)


def test_plateau_shows_a_busiest_frac_just_below_040_as_such(tmp_path):
    """Three decimals: 0.399 (below the 0.40 the README reads off the runs) is not shown as
    0.40."""
    import plateau
    (tmp_path / 'moe').mkdir()
    write_jsonl(tmp_path / 'moe' / 'log.jsonl', [{'iter': 150, 'ce': 2.826, 'busiest_frac': 0.399}])
    name, lines, exit_step = plateau.read(str(tmp_path / 'moe'), 250)
    assert '| 0.399 |' in plateau.table([(name, lines, exit_step)])


def test_plateau_unreadable_log_is_one_clear_error(tmp_path):
    import plateau
    with pytest.raises(UserError, match='cannot read .*log.jsonl'):
        plateau.main([str(tmp_path / 'nowhere')])


def test_plateau_exit_is_the_first_logged_step_below_the_threshold(tmp_path):
    """Training CE 3.0, 2.6, 2.4 (exit at that step), then 2.0; a run that never gets below 2.5;
    an eval line's val_loss below 2.5 does not count."""
    def write(folder, seed, ces):
        folder.mkdir(parents=True)
        config = {'config_name': 'cpu_moe', 'seed': seed, 'iters': 100, 'tokens_per_iter': 10,
                  'params': {'total': 5, 'active': 3}}
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


def test_val_at_step_pairs_one_evaluation_with_the_other_configs_best(tmp_path, capsys):
    """time_cpu_moe's evaluation at step 20 (the best + 0.01 x seed, by curve) and at step 10 (the
    best itself) against cpu_dense_total's best, seed by seed."""
    import val_at_step
    best = {'time_cpu_moe': (1.15, 1.16), 'cpu_dense_total': (1.20, 1.22)}
    for name, values in best.items():
        for seed, value in enumerate(values, 1):
            write_run(tmp_path / name / f's{seed}', name, seed, 270, 160, False, value)
    moe = [str(tmp_path / 'time_cpu_moe' / f's{s}') for s in (1, 2)]
    dense = [str(tmp_path / 'cpu_dense_total' / f's{s}') for s in (1, 2)]
    gap = val_at_step.main(['--iter', '20'] + moe + ['--against'] + dense)
    assert gap['per_seed'] == {'1': pytest.approx(1.16 - 1.20), '2': pytest.approx(1.18 - 1.22)}
    assert 'at step 20: -0.0400 ± 0.0000 [2 of 2 < 0]' in capsys.readouterr().out
    gap = val_at_step.main(['--iter', '10'] + moe + ['--against'] + dense)
    assert gap['per_seed'] == {'1': pytest.approx(-0.05), '2': pytest.approx(-0.06)}
    with pytest.raises(UserError, match=r'no evaluation at step 15; pick one of \[0, 10, 20\]'):
        val_at_step.main(['--iter', '15'] + moe + ['--against'] + dense)
    with pytest.raises(UserError, match='give the runs of one config'):
        val_at_step.main(['--iter', '10'] + moe + dense + ['--against'] + dense)


def test_val_at_step_bias_pairs_a_shorter_plan_with_the_longer_run_at_its_tokens(tmp_path,
                                                                                  capsys):
    """cpu_moe ends at 2,500 tokens with its best 1.25; time_cpu_moe, on twice the tokens,
    evaluates 1.15 at 2,000 and 1.16 at 4,000 tokens: 1.1525 at 2,500, linearly."""
    import val_at_step
    for name, best, scale in (('cpu_moe', 1.25, 1), ('time_cpu_moe', 1.15, 2)):
        folder = tmp_path / name
        write_run(folder, name, 1, 270, 160, False, best)
        lines = [json.loads(x) for x in (folder / 'log.jsonl').read_text().splitlines()]
        write_jsonl(folder / 'log.jsonl', [{**r, 'tokens': r['tokens'] * scale} for r in lines])
    pairs = val_at_step.main(['--bias', str(tmp_path / 'cpu_moe'), str(tmp_path / 'time_cpu_moe')])
    assert pairs == [('cpu_moe', 1, 'tokens', 'time', pytest.approx(1.25 - 1.1525))]
    assert 'ended worse in 1 of 1 pairs: +0.0975' in capsys.readouterr().out
    with pytest.raises(UserError, match='no config has runs planned for two budgets'):
        val_at_step.main(['--bias', str(tmp_path / 'cpu_moe')])


def test_a_variant_is_matched_to_its_familys_dense_total_without_its_base_moes_runs():
    runs = {'w224_cpu_moe_shared': {}, 'w224_cpu_dense_total': {}, 'cpu_dense_total': {}}
    assert report.dense_total_of('w224_cpu_moe_shared', runs) == 'w224_cpu_dense_total'
    assert report.dense_total_of('cpu_moe', runs) == 'cpu_dense_total'
    assert report.dense_total_of('cpu_moe_shared', {'cpu_moe_shared': {}}) is None
    assert report.dense_total_of('cpu_dense_active', runs) is None
