"""study/compute.py and the study's scripts around it on runs whose numbers are known exactly:
who wins under which budget, k* and its interval, step-time ratios and their verdicts, whole-run
pairs, a run's val loss at one step, and the token budgets make compute plans."""
import glob
import json
import math
import os
import statistics

import pytest

import bench
from errors import UserError
from study import compute, compute_budget, pair_ratio, val_at_step
from study import report as study_report
from tests.conftest import REPO
from tests.test_report import write_jsonl, write_run


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
    # r's quartiles 0.6-0.7 lie below the fixture's k* intervals (two seeds: the t-interval is
    # 0.72-1.78): the MoE loses on time
    write_ratio(tmp_path / 'ratio', 'alone', 'cpu_moe',
                {'median': 0.65, 'q1': 0.6, 'q3': 0.7, 'rounds': [0.6, 0.65, 0.7]})
    # an r with no k* here: in the table without a verdict
    write_ratio(tmp_path / 'ratio', 'paper_width', 'cpu_moe_d160',
                {'median': 2.0, 'q1': 1.9, 'q3': 2.1, 'rounds': [1.9, 2.0, 2.1]})
    study_report.main([str(tmp_path / 'out' / '*'), '--out', str(tmp_path / 'rep'),
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
    assert compute.budget_of('time_cpu_moe') == ('time', 'cpu_moe')
    assert compute.budget_of('k1.35_w224_cpu_moe') == ('k1.35', 'w224_cpu_moe')
    assert compute.budget_of('k2_cpu_moe_shared') == ('k2', 'cpu_moe_shared')
    assert compute.budget_of('w224_cpu_moe') == ('tokens', 'w224_cpu_moe')
    assert compute.budget_of('kind_cpu_moe') == ('tokens', 'kind_cpu_moe')
    assert compute.budget_label('k1.2', {'k': 1.2}) == '1.20x the tokens'
    assert compute.budget_label('flops', {'k': 1.5}) == 'equal FLOPs'


def test_crossing_is_linear_between_trained_ks_or_says_which_side():
    assert compute.crossing([1.0, 1.25, 1.5], [0.03, -0.01, -0.02]) == pytest.approx(1.1875)
    assert compute.crossing([1.0, 1.5], [-0.01, -0.02]) == -math.inf  # the MoE wins at every k
    assert compute.crossing([1.0, 1.5], [0.02, 0.01]) == math.inf  # and at none


def test_break_even_k_star_its_interval_and_each_seeds():
    # seed 1 reaches 0 at k 1.25, seed 2 at 1.125, their mean (0.03, -0.01, -0.025) at 1.1875;
    # seed 3 was trained at one k only and is left out
    entry = {'budgets': {'tokens': gap_at_k(1.0, {'1': 0.04, '2': 0.02, '3': 0.5}),
                         'time': gap_at_k(1.25, {'1': 0.0, '2': -0.02}),
                         'flops': gap_at_k(1.5, {'1': -0.02, '2': -0.03})}}
    b = compute.break_even(entry)
    assert b['seeds'] == 2 and b['k_star'] == pytest.approx(1.1875)
    assert b['per_seed'] == {'1': pytest.approx(1.25), '2': pytest.approx(1.125)}
    # resampling two seeds: both seed 2 (k* 1.125) a quarter of the time, both seed 1 a quarter
    assert b['bootstrap_interval'] == [pytest.approx(1.125), pytest.approx(1.25)]
    # the t-interval: 1.1875 +- 6.314 (t, 1 degree of freedom) x 0.0884 / sqrt(2) = 0.3946
    assert b['t_interval'] == [pytest.approx(0.7929, abs=1e-4), pytest.approx(1.5821, abs=1e-4)]
    assert b['interval'] == b['t_interval']  # the wider at both ends
    assert compute.t_interval([1.1, math.inf]) is None  # a seed that never crosses: no t
    assert [g['k'] for g in b['per_k']] == [1.0, 1.25, 1.5]
    assert b['per_k'][0]['n'] == 3  # each k's own gap, over all of its seeds
    assert compute.break_even({'budgets': {'tokens': entry['budgets']['tokens']}}) is None


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
    rows = compute.read_ratio_folder(str(tmp_path))
    assert rows == [{'config': 'cpu_moe', 'setting': 'alone', 'hardware': 'a CPU',
                     'torch': '2.x', **rounds},
                    {'config': 'cpu_moe_shared', 'setting': 'side_by_side',
                     'hardware': 'a CPU', 'torch': '2.x', **rounds}]
    row = rows[0]

    def trained(low, high, ks=(1.0, 1.5)):
        return {'k_star': 1.15, 'interval': [low, high], 'per_k': [{'k': k} for k in ks]}
    # the quartiles 1.25-1.35 against k*'s interval
    assert compute.verdict(row, trained(1.1, 1.2)) == 'wins'
    assert compute.verdict(row, trained(1.3, 1.4)) == 'undecided'
    assert compute.verdict(row, trained(1.2, 1.26)) == 'undecided'
    assert compute.verdict(row, trained(1.4, 1.5)) == 'loses'
    assert compute.verdict(row, None) is None
    # k* below every trained k (the MoE ahead at all of them): it wins where r is above the first k
    assert compute.verdict(row, trained(-math.inf, -math.inf, ks=(1.2, 1.5))) == 'wins'
    assert compute.verdict(row, trained(-math.inf, -math.inf, ks=(1.3, 1.5))) == 'undecided'
    assert compute.verdict(row, trained(-math.inf, 1.1, ks=(1.2, 1.5))) == 'wins'
    # and above every trained k: it loses where r is below the last one
    assert compute.verdict(row, trained(math.inf, math.inf, ks=(1.0, 1.4))) == 'loses'
    assert compute.verdict(row, trained(math.inf, math.inf, ks=(1.0, 1.3))) == 'undecided'
    assert compute.interval_within_trained(trained(-math.inf, 1.1, ks=(1.0, 1.5))) == [1.0, 1.1]
    # a warmup study's k* (w224_cpu_moe) is the one the ratio of cpu_moe is set against
    entries = {'w224_cpu_moe_shared': trained(1.4, 1.5), 'w224_cpu_moe': trained(1.1, 1.2)}
    assert compute.break_even_name('cpu_moe', entries) == 'w224_cpu_moe'
    assert compute.break_even_name('cpu_moe_sparse16', entries) is None
    # the plot draws an r only beside its MoE's k*: given cpu_moe's alone, cpu_moe_shared's is out
    assert compute.ratios_with_k_star(rows, entries) == [('w224_cpu_moe', row),
                                                        ('w224_cpu_moe_shared', rows[1])]
    only_moe = {'w224_cpu_moe': entries['w224_cpu_moe']}
    assert compute.ratios_with_k_star(rows, only_moe) == [('w224_cpu_moe', row)]
    lines = compute.ratio_lines([{**row, 'verdict': 'wins'}], entries)
    assert lines[-1] == ('| cpu_moe | alone | a CPU | 2.x | 5 | 1.300 [1.250-1.350] | '
                         '1.150 [1.100-1.200] | wins |')


def test_ratio_folders_without_ratios_per_round_are_one_clear_error(tmp_path):
    with pytest.raises(UserError, match='make them with: make ratio'):
        compute.read_ratio_folder(str(tmp_path))
    (tmp_path / 'alone').mkdir()
    result = {'ms_per_step': {'moe': 40.0, 'dense_total': 50.0}}
    (tmp_path / 'alone' / 'cpu_moe.txt').write_text(json.dumps(result) + '\n')
    with pytest.raises(UserError, match='no step-time ratio per round.*make ratio'):
        compute.read_ratio_folder(str(tmp_path))


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


def test_whole_runs_side_by_side_give_r_per_pair(tmp_path, capsys):
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
    # compute.py --ratio reads it as a setting of its own
    (tmp_path / 'ratio' / 'whole_runs').mkdir(parents=True)
    (tmp_path / 'ratio' / 'whole_runs' / 'cpu_moe.txt').write_text(out)
    [row] = compute.read_ratio_folder(str(tmp_path / 'ratio'))
    assert row['setting'] == 'whole_runs' and row['median'] == r['median']
    (tmp_path / 'cpu_moe-s2' / 'moe' / 'done.json').unlink()
    with pytest.raises(UserError, match='not a finished run; train the pair with: make ratio'):
        pair_ratio.main([str(tmp_path / 'cpu_moe-s2')])


def test_val_at_step_pairs_one_evaluation_with_the_other_configs_best(tmp_path, capsys):
    """time_cpu_moe's evaluation at step 20 (the best + 0.01 x seed, by curve) and at step 10 (the
    best itself) against cpu_dense_total's best, seed by seed."""
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


def test_compute_budget_prints_the_tokens_of_dense_totals_flops_and_time(tmp_path, capsys):
    """The --max_tokens that make compute passes: the recipe's 4,585,000 tokens times
    cpu_dense_total's FLOPs a token over cpu_moe's (1,639,176 / 1,085,832), or times dense_total's
    step time over the MoE's from a bench.py output file."""
    compute_budget.main(['flops', os.path.join(REPO, 'config', 'cpu_moe.py')])
    assert capsys.readouterr().out == f'{round(4585000 * 1639176 / 1085832)}\n'
    bench_file = tmp_path / 'cpu_moe.txt'
    result = {'ms_per_step': {'moe': 160.0, 'dense_total': 200.0}, 'hardware': 'a CPU'}
    bench_file.write_text('a table\n' + json.dumps(result) + '\n')
    compute_budget.main(['time', os.path.join(REPO, 'config', 'cpu_moe.py'), str(bench_file)])
    assert capsys.readouterr().out == f'{round(4585000 * 200 / 160)}\n'
    assert bench.read_step_times(bench_file) == {'moe': 160.0, 'dense_total': 200.0,
                                                 'hardware': 'a CPU', 'torch': None}


def test_a_budget_is_planned_once_and_then_read(tmp_path, capsys, monkeypatch):
    """make compute's tokens come from the budgets file; a budget missing there is planned from
    the bench file and written in, and a bench file measured again later changes nothing."""
    monkeypatch.chdir(REPO)  # configs are named from the repository, as make names them
    budgets, bench_dir = tmp_path / 'budgets.json', tmp_path / 'bench'
    bench_dir.mkdir()
    budgets.write_text(json.dumps({'time_cpu_moe_shared': 6019949}))
    result = {'ms_per_step': {'moe': 160.0, 'dense_total': 200.0}}
    (bench_dir / 'cpu_moe.txt').write_text(json.dumps(result) + '\n')
    compute_budget.main(['tokens', 'time_cpu_moe_shared', str(budgets), str(bench_dir)])
    compute_budget.main(['tokens', 'time_cpu_moe', str(budgets), str(bench_dir)])
    assert capsys.readouterr().out == f'6019949\n{round(4585000 * 200 / 160)}\n'
    planned = {'time_cpu_moe': round(4585000 * 200 / 160), 'time_cpu_moe_shared': 6019949}
    assert json.loads(budgets.read_text()) == planned
    result['ms_per_step']['moe'] = 100.0
    (bench_dir / 'cpu_moe.txt').write_text(json.dumps(result) + '\n')
    compute_budget.main(['tokens', 'time_cpu_moe', str(budgets), str(bench_dir)])
    assert capsys.readouterr().out == f'{planned["time_cpu_moe"]}\n'
    with pytest.raises(UserError, match='not a budget run'):
        compute_budget.main(['tokens', 'cpu_moe', str(budgets), str(bench_dir)])
    budgets.write_text('{"time_cpu_moe": 57')  # cut off: not an empty plan to start again from
    with pytest.raises(UserError, match='not valid JSON.*restore it from git'):
        compute_budget.main(['tokens', 'time_cpu_moe', str(budgets), str(bench_dir)])
    assert budgets.read_text() == '{"time_cpu_moe": 57'


def test_a_budget_run_finds_its_config_in_config_or_the_studys(monkeypatch):
    monkeypatch.chdir(REPO)  # configs are named from the repository, as make names them
    assert compute_budget.config_file('cpu_moe') == 'config/cpu_moe.py'
    assert compute_budget.config_file('cpu_moe_sparse16') == 'study/config/cpu_moe_sparse16.py'


def test_the_committed_budgets_are_what_the_committed_runs_trained_for():
    with open(os.path.join(REPO, 'results', 'cpu', 'compute', 'budgets.json')) as f:
        budgets = json.load(f)
    runs = os.path.join(REPO, 'results', 'cpu', 'compute', 'runs')
    trained = {}
    for path in glob.glob(f'{runs}/flops_*/config.json') + glob.glob(f'{runs}/time_*/config.json'):
        with open(path) as f:
            c = json.load(f)
        trained.setdefault(c['config_name'], set()).add(c['max_tokens'])
    assert {name: {tokens} for name, tokens in budgets.items()} == trained
