"""report.py on synthetic run folders whose numbers are known exactly."""
import json
import math
import statistics

import pytest

import report

# best val losses by config and seed; the eval curves below end at these values
BEST = {'cpu_moe': {1: 1.20, 2: 1.22, 3: 1.19},
        'cpu_dense_active': {1: 1.25, 2: 1.24, 3: 1.26},
        'cpu_dense_total': {1: 1.18, 2: 1.23, 3: 1.17},
        'cpu_moe_top1': {1: 1.30}}
TOKENS = [0, 1000, 2000]


def curve(best, seed):
    """val loss at TOKENS: 5.5 at init, the best in the middle, a little worse at the end."""
    return [5.5, best, best + 0.01 * seed]


def write_run(folder, name, seed, total, active, moe, best_val=None):
    folder.mkdir(parents=True)
    config = {'config_name': name, 'seed': seed, 'iters': 20, 'tokens_per_iter': 100, 'd_model': 16,
              'data_dir': str(folder.parent.parent / 'data'), 'params': {'total': total, 'active': active}}
    (folder / 'config.json').write_text(json.dumps(config))
    lines, best = [], math.inf
    for i, (tokens, val) in enumerate(zip(TOKENS, curve(best_val or BEST[name][seed], seed))):
        best = min(best, val)
        lines.append({'iter': 10 * i, 'tokens': tokens, 'val_loss': val, 'best_val': best})
        if moe:  # routing stats that identify the eval point: busiest_frac = 0.3 + 0.1 * i + 0.01 * seed
            lines[-1].update(load=[0.25] * 4, busiest_frac=0.3 + 0.1 * i + 0.01 * seed, usage_var=0.001 * seed,
                             router_entropy=1.3, log_z=2.0 + seed, dropped_frac=0.0)
        lines.append({'iter': 10 * i + 5, 'tokens': tokens + 500, 'loss': 3.0, 'ce': 3.0})  # a training line
    (folder / 'log.jsonl').write_text(''.join(json.dumps(line) + '\n' for line in lines))


@pytest.fixture
def runs(tmp_path):
    sizes = {'cpu_moe': (270, 160, True), 'cpu_dense_active': (160, 160, False),
             'cpu_dense_total': (271, 271, False), 'cpu_moe_top1': (270, 105, True)}
    for n, (name, seeds) in enumerate(BEST.items()):
        for seed in seeds:  # folder names deliberately say nothing: runs are matched by config.json
            write_run(tmp_path / 'out' / f'run{n}{seed}', name, seed, *sizes[name])
    return tmp_path


def test_table_gaps_and_curves_are_exact(runs):
    report.main([str(runs / 'out' / '*'), '--out', str(runs / 'rep')])
    r = json.loads((runs / 'rep' / 'report.json').read_text())
    for name, seeds in BEST.items():
        c = r['configs'][name]
        values = list(seeds.values())
        assert c['seeds'] == {str(s): v for s, v in seeds.items()}
        assert c['mean'] == pytest.approx(statistics.mean(values))
        assert c['std'] == pytest.approx(statistics.stdev(values) if len(values) > 1 else 0.0)
    assert r['configs']['cpu_moe']['role'] == 'moe' and r['configs']['cpu_moe_top1']['role'] is None
    assert (r['configs']['cpu_moe']['total'], r['configs']['cpu_moe']['active']) == (270, 160)

    active = [BEST['cpu_dense_active'][s] - BEST['cpu_moe'][s] for s in (1, 2, 3)]  # 0.05, 0.02, 0.07
    total = [BEST['cpu_moe'][s] - BEST['cpu_dense_total'][s] for s in (1, 2, 3)]  # 0.02, -0.01, 0.02
    for gap, diffs in (('active', active), ('total', total)):
        g = r['gaps'][gap]
        assert g['n'] == 3
        assert g['per_seed'] == {str(s): pytest.approx(d) for s, d in zip((1, 2, 3), diffs)}
        assert g['mean'] == pytest.approx(statistics.mean(diffs))
        assert g['std'] == pytest.approx(statistics.stdev(diffs))
        assert g['se'] == pytest.approx(statistics.stdev(diffs) / 3 ** 0.5)
    assert r['gaps']['active']['positive'] == 3 and r['gaps']['total']['positive'] == 2  # -0.01 at seed 2

    # at 1000 and 2000 tokens the seed-paired differences are those of the bests
    assert r['gap_vs_tokens']['tokens'] == TOKENS
    assert r['gap_vs_tokens']['active'] == pytest.approx([0.0, statistics.mean(active), statistics.mean(active)])
    assert r['gap_vs_tokens']['total'] == pytest.approx([0.0, statistics.mean(total), statistics.mean(total)])

    # routing diagnostics come from the best eval point (the middle one, i = 1), not the last
    d = r['diagnostics']['cpu_moe']
    assert d['busiest_frac']['mean'] == pytest.approx(0.42)  # 0.4 + 0.01 * mean seed (2)
    assert [e['mean'] for e in d['load']] == pytest.approx([0.25] * 4)
    assert d['busiest_frac']['std'] == pytest.approx(0.01)
    assert d['log_z']['mean'] == pytest.approx(4.0) and d['dropped_frac']['mean'] == 0.0
    assert set(r['diagnostics']) == {'cpu_moe', 'cpu_moe_top1'}

    # the ablation against its default MoE: seed-paired (seed 1 only), routing over training for both
    v = r['variants']['cpu_moe_top1']
    assert v['base'] == 'cpu_moe' and v['n'] == 1 and v['mean'] == pytest.approx(0.10)
    busiest = r['variant_curves']['busiest_frac']
    assert list(busiest) == ['cpu_moe', 'cpu_moe_top1']  # the default first
    assert busiest['cpu_moe_top1'] == {'tokens': TOKENS, 'mean': pytest.approx([0.31, 0.41, 0.51])}
    assert busiest['cpu_moe'] == {'tokens': TOKENS, 'mean': pytest.approx([0.32, 0.42, 0.52])}  # seed mean
    assert r['variant_curves']['log_z']['cpu_moe']['mean'] == pytest.approx([4.0] * 3)
    assert r['scan'] == []  # one family is no scan

    # and against the dense models of its family, variant - dense: seed 1 only
    assert v['vs_dense_total']['per_seed'] == {'1': pytest.approx(1.30 - 1.18)}
    assert v['vs_dense_active']['n'] == 1 and v['vs_dense_active']['mean'] == pytest.approx(1.30 - 1.25)

    text = (runs / 'rep' / 'report.md').read_text()
    assert '| cpu_moe | moe | 270 | 160 | 1,2,3 | 1.2033 ± 0.0153 |' in text
    assert ('| cpu_moe_top1 | cpu_moe | +0.1000 ± 0.0000 | 1 | s1: +0.1000 | +0.1200 ± 0.0000 [0 of 1 < 0] | '
            '+0.0500 ± 0.0000 [0 of 1 < 0] |') in text
    for png in ('cpu_val_loss.png', 'cpu_gaps.png', 'expert_load.png', 'variants_routing.png'):
        assert (runs / 'rep' / png).stat().st_size > 1000 and f']({png})' in text


def test_scan_orders_complete_families_by_tokens_per_parameter(runs):
    """A second complete family, 4x the parameters on the same tokens: one scan row per family, ordered by
    training tokens per total MoE parameter, with its seed-paired gaps and the epochs its data allows."""
    big = {'big_moe': (1.0, 1080, 640, True), 'big_dense_active': (1.1, 640, 640, False),
           'big_dense_total': (0.95, 1084, 1084, False)}
    for name, (best, total, active, moe) in big.items():
        write_run(runs / 'out' / name, name, 1, total, active, moe, best_val=best)
    # a third family whose dense_active shares no seed with its MoE: no active gap, but a row and a plot
    for name, seed in (('odd_moe', 1), ('odd_dense_active', 2), ('odd_dense_total', 1)):
        write_run(runs / 'out' / name, name, seed, 270, 160, name == 'odd_moe', best_val=1.0)
    # a seed-noise run (seed 1's init, data order 2) is not seed 1 of its config: left out, with a word
    write_run(runs / 'out' / 'noise', 'big_moe', 1, 1080, 640, True, best_val=0.5)
    config = json.loads((runs / 'out' / 'noise' / 'config.json').read_text())
    (runs / 'out' / 'noise' / 'config.json').write_text(json.dumps({**config, 'data_seed': 2}))
    (runs / 'data').mkdir()
    (runs / 'data' / 'meta.json').write_text(json.dumps({'train_tokens': 1000}))
    report.main([str(runs / 'out' / '*'), '--out', str(runs / 'rep')])
    r = json.loads((runs / 'rep' / 'report.json').read_text())
    scan = [p for p in r['scan'] if p['family'] != 'odd_']
    assert r['configs']['big_moe']['seeds'] == {'1': pytest.approx(1.0)}  # not the noise run's 0.5
    assert any('data_seed 2' in w for w in (runs / 'rep' / 'report.md').read_text().splitlines())
    odd = next(p for p in r['scan'] if p['family'] == 'odd_')
    assert odd['active']['n'] == 0 and odd['total']['n'] == 1
    assert [p['family'] for p in scan] == ['big_', 'cpu_']
    assert [p['tokens_per_param'] for p in scan] == pytest.approx([2000 / 1080, 2000 / 270])
    assert [p['epochs'] for p in scan] == pytest.approx([2.0, 2.0])
    assert scan[0]['active']['mean'] == pytest.approx(0.1) and scan[0]['total']['mean'] == pytest.approx(0.05)
    assert scan[1]['active']['mean'] == pytest.approx(statistics.mean([0.05, 0.02, 0.07]))
    assert (runs / 'rep' / 'scan_gaps.png').stat().st_size > 1000


def test_missing_runs_are_reported_not_fatal(runs, capsys):
    import shutil
    for folder in (runs / 'out').iterdir():
        config = json.loads((folder / 'config.json').read_text())
        if config['config_name'] == 'cpu_dense_total' or (config['config_name'] == 'cpu_moe' and config['seed'] == 3):
            shutil.rmtree(folder)
    (runs / 'out' / 'junk').mkdir()
    (runs / 'out' / 'junk' / 'config.json').write_text('{"seed": 1}')  # no config_name
    report.main([str(runs / 'out' / '*'), '--out', str(runs / 'rep')])
    r = json.loads((runs / 'rep' / 'report.json').read_text())
    assert r['gaps']['total'] == {'mean': None, 'std': None, 'se': None, 'n': 0, 'positive': 0, 'per_seed': {}}
    assert r['gaps']['active']['n'] == 2  # seeds 1 and 2 are paired
    assert r['gap_vs_tokens']['total'] == [] and len(r['gap_vs_tokens']['active']) == 3
    text = capsys.readouterr().out
    assert 'missing cpu_dense_total' in text and 'skipped' in text and 'junk' in text
    assert '| cpu_moe | moe |' in text and (runs / 'rep' / 'cpu_val_loss.png').exists()


def test_diverged_truncated_and_old_logs_do_not_break_the_report(runs):
    import math as m
    folders = {json.loads((f / 'config.json').read_text())['config_name'] + str(json.loads((f / 'config.json').read_text())['seed']): f
               for f in (runs / 'out').iterdir()}
    # seed 2 of the MoE diverged after its first real eval, and its log ends in half a line
    log = folders['cpu_moe2'] / 'log.jsonl'
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    lines[4]['val_loss'] = float('nan')
    log.write_text(''.join(json.dumps(x) + '\n' for x in lines) + '{"iter": 3')
    # seed 3 is an old log without routing statistics
    log = folders['cpu_moe3'] / 'log.jsonl'
    log.write_text(''.join(json.dumps({k: v for k, v in json.loads(x).items() if k not in report.ROUTING + ('load',)}) + '\n'
                           for x in log.read_text().splitlines()))
    report.main([str(runs / 'out' / '*'), '--out', str(runs / 'rep')])
    r = json.loads((runs / 'rep' / 'report.json').read_text())  # strict JSON: NaN would not parse back as null
    assert r['configs']['cpu_moe']['seeds']['2'] == pytest.approx(1.22)  # the best finite eval
    assert r['diagnostics']['cpu_moe']['busiest_frac']['mean'] == pytest.approx((0.41 + 0.42) / 2)  # seeds 1, 2
    # and so is routing over training: the mean of the seeds that logged it
    assert r['variant_curves']['busiest_frac']['cpu_moe']['mean'] == pytest.approx([0.315, 0.415, 0.515])
    assert not m.isnan(r['configs']['cpu_moe']['mean'])


def test_no_runs_is_one_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        report.main([str(tmp_path / 'nothing*')])
    assert e.value.code != 0 and 'no runs found' in capsys.readouterr().err


@pytest.mark.parametrize('name,expected', [('moe', ('', 'moe')), ('cpu_moe', ('cpu_', 'moe')),
                                           ('cpu_dense_total', ('cpu_', 'dense_total')),
                                           ('dense_active', ('', 'dense_active')),
                                           ('cpu_moe_top1', (None, None)), ('moe_noz', (None, None))])
def test_roles_come_from_config_names(name, expected):
    assert report.role_of(name) == expected


def test_plateau_table_shows_the_routers_steps_and_each_runs_exit(tmp_path, capsys):
    import plateau  # scripts/, on the path through conftest
    for name, ces in (('moe', [4.6, 3.0, 2.9, 2.4]), ('dense', [4.6, 2.4, 2.0, 1.9])):
        (tmp_path / name).mkdir()
        lines = [{'iter': 25 * (i + 1), 'ce': ce, **({'busiest_frac': 0.5 - 0.05 * i, 'router_entropy': 1.38,
                                                    'log_z': 0.2 * i} if name == 'moe' else {})}
                 for i, ce in enumerate(ces)] + [{'iter': 100, 'val_loss': 2.3, 'best_val': 2.3}]
        (tmp_path / name / 'log.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in lines))
    plateau.main([str(tmp_path / 'moe'), str(tmp_path / 'dense'), '--until', '75', '--out', str(tmp_path / 'p.md')])
    rows = (tmp_path / 'p.md').read_text().splitlines()
    assert rows[0] == '| run | exit | value | 25 | 50 | 75 |'
    assert rows[2:] == ['| moe | 100 | ce | 4.60 | 3.00 | 2.90 |', '| moe | 100 | busiest_frac | 0.50 | 0.45 | 0.40 |',
                        '| moe | 100 | router_entropy | 1.38 | 1.38 | 1.38 |', '| moe | 100 | log_z | 0.00 | 0.20 | 0.40 |',
                        '| dense | 50 | ce | 4.60 | 2.40 | 2.00 |']
    assert capsys.readouterr().out.strip() == '\n'.join(rows)


def test_plateau_exit_is_the_first_logged_step_below_the_threshold(tmp_path):
    """Training CE 3.0, 2.6, 2.4 (exit at that step), then 2.0; a run that never gets below 2.5; an eval line's
    val_loss below 2.5 does not count."""
    def write(folder, seed, ces):
        folder.mkdir(parents=True)
        (folder / 'config.json').write_text(json.dumps({'config_name': 'cpu_moe', 'seed': seed, 'iters': 100,
                                                        'tokens_per_iter': 10, 'params': {'total': 5, 'active': 3}}))
        lines = [{'iter': 0, 'tokens': 0, 'val_loss': 2.0, 'best_val': 2.0}]
        lines += [{'iter': 25 * (i + 1), 'tokens': 250 * (i + 1), 'loss': ce + 0.1, 'ce': ce} for i, ce in enumerate(ces)]
        (folder / 'log.jsonl').write_text(''.join(json.dumps(line) + '\n' for line in lines))
    write(tmp_path / 'a', 1, [3.0, 2.6, 2.4, 2.0])
    write(tmp_path / 'b', 2, [3.0, 2.9, 2.7, 2.6])
    write(tmp_path / 'c', 3, [2.4, 2.0, 1.9, 1.8])
    report.main([str(tmp_path / 'a'), str(tmp_path / 'b'), str(tmp_path / 'c'), '--out', str(tmp_path / 'rep')])
    r = json.loads((tmp_path / 'rep' / 'report.json').read_text())
    assert r['configs']['cpu_moe']['exit_step'] == {'1': 75, '2': None, '3': 25}
    assert '| 50 [25-75], never: 1 |' in (tmp_path / 'rep' / 'report.md').read_text()
