"""study/report.py on tests/test_report.py's synthetic runs: the variants against their default,
the scan over tokens per parameter, and the variants' routing over training."""
import json
import statistics

import pytest

from errors import UserError
from study import compute
from study import report as study_report
from tests.test_report import TOKENS, damage_logs, make_report, write_run, write_runs


@pytest.fixture
def runs(tmp_path):
    write_runs(tmp_path)
    return tmp_path


def test_an_ablation_is_paired_with_its_default_moe_and_its_dense_models(runs):
    r = make_report(runs, study_report.main)
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
    assert ('| cpu_moe_top1 | cpu_moe | +0.1000 ± 0.0000 | 1 | s1: +0.1000 | '
            '+0.1200 ± 0.0000 [0 of 1 < 0] | +0.0500 ± 0.0000 [0 of 1 < 0] |') in text
    png = runs / 'rep' / 'variants_routing.png'
    assert png.stat().st_size > 1000 and '](variants_routing.png)' in text


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
    (runs / 'data').mkdir()
    (runs / 'data' / 'meta.json').write_text(json.dumps({'train_tokens': 1000}))
    r = make_report(runs, study_report.main)
    scan = [p for p in r['scan'] if p['family'] != 'odd_']
    odd = next(p for p in r['scan'] if p['family'] == 'odd_')
    assert odd['active']['n'] == 0 and odd['total']['n'] == 1
    assert [p['family'] for p in scan] == ['big_', 'cpu_']
    assert [p['tokens_per_param'] for p in scan] == pytest.approx([2000 / 1080, 2000 / 270])
    assert [p['epochs'] for p in scan] == pytest.approx([2.0, 2.0])
    assert scan[0]['active']['mean'] == pytest.approx(0.1)
    assert scan[0]['total']['mean'] == pytest.approx(0.05)
    assert scan[1]['active']['mean'] == pytest.approx(statistics.mean([0.05, 0.02, 0.07]))
    assert (runs / 'rep' / 'scan_gaps.png').stat().st_size > 1000


def test_routing_over_training_is_the_mean_of_the_seeds_that_logged_it(runs):
    damage_logs(runs)
    r = make_report(runs, study_report.main)
    busiest = r['variant_curves']['busiest_frac']['cpu_moe']['mean']
    assert busiest == pytest.approx([0.315, 0.415, 0.515])


def test_a_bench_folder_without_outputs_is_one_clear_error(runs):
    (runs / 'bench').mkdir()
    with pytest.raises(UserError, match='give the folder make compute writes them to'):
        study_report.main([str(runs / 'out' / '*'), '--bench', str(runs / 'bench')])


def test_a_variant_is_matched_to_its_familys_dense_total_without_its_base_moes_runs():
    runs = {'w224_cpu_moe_shared': {}, 'w224_cpu_dense_total': {}, 'cpu_dense_total': {}}
    assert compute.dense_total_of('w224_cpu_moe_shared', runs) == 'w224_cpu_dense_total'
    assert compute.dense_total_of('cpu_moe', runs) == 'cpu_dense_total'
    assert compute.dense_total_of('cpu_moe_shared', {'cpu_moe_shared': {}}) is None
    assert compute.dense_total_of('cpu_dense_active', runs) is None
