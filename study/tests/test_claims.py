"""study/claims.py on made-up run folders whose answers are known."""
import json
import os

import pytest

from study import claims

XEON = 'Intel(R) Xeon(R) Processor (AVX512), 1 threads'


def write_run(folder, name, seed, best, busiest=0.3, log_z=0.5, top_k=2, flops=1e12,
              cpu=XEON, params=(229_240, 136_312)):
    """A finished run folder: config.json and a log with a training line and two evaluations,
    the last one best at `best`, its routing at `busiest` and `log_z` in each of 4 layers."""
    path = os.path.join(folder, f'{name}-s{seed}')
    os.makedirs(path)
    config = {'config_name': name, 'seed': seed, 'iters': 2, 'top_k': top_k, 'cpu': cpu,
              'tokens_per_iter': 10, 'flops_per_token': flops / 20,
              'params': {'total': params[0], 'active': params[1]}}
    routing = {'busiest_frac': busiest, 'log_z': log_z,
               'layers': [{'busiest_frac': busiest}] * 4}
    records = [{'iter': 0, 'tokens': 0, 'flops': 0, 'val_loss': 5.0, **routing},
               {'iter': 1, 'tokens': 10, 'flops': flops / 2, 'loss': 2.0, 'ce': 2.0,
                'tok_per_s': 100.0, **routing},
               {'iter': 2, 'tokens': 20, 'flops': flops, 'val_loss': best, **routing}]
    with open(os.path.join(path, 'config.json'), 'w') as f:
        json.dump(config, f)
    with open(os.path.join(path, 'log.jsonl'), 'w') as f:
        f.writelines(json.dumps(r) + '\n' for r in records)


# a small spread, the same for every config: the paired gaps are exactly the offsets below
NOISE = [0.003, -0.002, 0.001, -0.004, 0.002, 0.0, -0.001, 0.004, -0.003, 0.001]


def write_ablations(folder):
    for seed, noise in enumerate(NOISE, start=1):
        write_run(folder, 'w224_cpu_moe', seed, 1.20 + noise)
        # the naive router: worse, and lopsided (every layer near 0.95 of 1/top_k = 1)
        write_run(folder, 'w224_cpu_moe_top1_nolb', seed, 1.25 + noise + noise / 2,
                  busiest=0.95 + noise, top_k=1)
        write_run(folder, 'w224_cpu_moe_top1', seed, 1.23 + noise - noise / 2, busiest=0.3,
                  top_k=1)
        # no z-loss: the same loss give or take the noise, larger logits
        write_run(folder, 'w224_cpu_moe_noz', seed, 1.20 + noise * 1.5, log_z=2.0)


def test_the_ablation_claims_are_decided_by_paired_t(tmp_path):
    write_ablations(tmp_path)
    runs = claims.report.load_runs(sorted(str(p) for p in tmp_path.iterdir()), print)
    found = {c['claim']: c for c in claims.claims(runs)}
    collapse = found['naive top-1 collapses']
    assert collapse['gap']['mean'] == pytest.approx(0.65, abs=1e-3)
    assert collapse['verdict'].startswith('holds')
    balancing = found['Switch balancing prevents it, and helps']
    assert balancing['gap']['mean'] == pytest.approx(0.02, abs=1e-3) and balancing['gap']['n'] == 10
    assert balancing['verdict'] == 'holds: balancing lowers the loss'
    assert found['top-2 gives the main gain']['verdict'] == 'top-2 is better'
    assert found['the z-loss does not change the loss']['verdict'] == (
        'consistent: no difference established')
    assert found['the z-loss keeps the router logits small']['gap']['mean'] == pytest.approx(1.5)
    # with a seed pair missing, nothing is decided
    fewer = {name: {s: run for s, run in seeds.items() if s != 10} for name, seeds in runs.items()}
    assert {c['verdict'] for c in claims.claims(fewer)} == {'not yet: 9 of 10 seed pairs'}
    rows = claims.ablations(runs)
    assert rows['w224_cpu_moe_top1_nolb']['runs_with_a_collapsed_layer'] == 10
    assert rows['w224_cpu_moe_top1']['runs_with_a_collapsed_layer'] == 0


def test_equal_flops_interpolates_each_dense_model_in_log_flops():
    curve = [(1e12, 1.30), (4e12, 1.20)]
    assert claims.at_flops(curve, 2e12) == pytest.approx(1.25)
    assert claims.at_flops(curve, 8e12) is None  # beyond the budgets trained: no figure


def test_the_shared_expert_verdict_waits_for_all_30_seeds_then_applies_the_threshold(tmp_path):
    for seed in range(1, 51):
        write_run(tmp_path, 'w224_cpu_dense_total', seed, 1.19 + NOISE[seed % 10])
    for seed in range(1, 31):  # seeds 21-30 only of the fresh ones
        write_run(tmp_path, 'w224_cpu_moe_shared', seed, 1.18 + NOISE[(seed * 3) % 10])
    runs = claims.report.load_runs(sorted(str(p) for p in tmp_path.iterdir()), print)
    assert claims.shared(runs)['verdict'].startswith('not yet')
    assert claims.shared(runs)['interval_95'] is None
    for seed in range(31, 51):
        write_run(tmp_path, 'w224_cpu_moe_shared', seed, 1.18 + NOISE[(seed * 3) % 10])
    runs = claims.report.load_runs(sorted(str(p) for p in tmp_path.iterdir()), print)
    result = claims.shared(runs)
    assert result['preregistered']['n'] == 30 and result['pooled_afterwards']['n'] == 50
    assert result['t'] < -claims.SHARED_T
    assert result['verdict'] == 'confirmed: the shared expert beats dense_total'
    # the gaps' mean is -0.01, their standard error 0.00061026: -0.01 -/+ 2.045 standard errors
    assert result['interval_95'] == pytest.approx([-0.011248, -0.008752], abs=1e-6)


def test_the_activation_plot_s_dense_lines_average_the_paired_seeds_only(tmp_path):
    for seed, noise in enumerate(NOISE, start=1):
        write_run(tmp_path, 'w224_cpu_dense_total', seed, 1.19 + noise)
        write_run(tmp_path, 'w224_cpu_dense_total', seed + 20, 1.30)  # the shared test's seeds
    runs = claims.report.load_runs(sorted(str(p) for p in tmp_path.iterdir()), print)
    # NOISE sums to 0.001: seeds 1-10 average 1.19 + 0.0001
    assert claims.mean_over_seeds(runs, 'w224_cpu_dense_total', range(1, 11)) == \
        pytest.approx(1.1901)
    assert claims.mean_over_seeds(runs, 'w224_cpu_dense_total', range(41, 51)) is None
    assert claims.mean_over_seeds(runs, 'w224_cpu_dense_active', range(1, 11)) is None


def test_a_pair_trained_on_two_kinds_of_cpu_is_named(tmp_path):
    write_run(tmp_path, 'w224_cpu_moe', 1, 1.2)
    write_run(tmp_path, 'w224_cpu_moe_noz', 1, 1.2, cpu='AMD EPYC (AVX512), 1 threads')
    runs = claims.report.load_runs(sorted(str(p) for p in tmp_path.iterdir()), print)
    mixed = claims.machines(runs, [('w224_cpu_moe_noz', 'w224_cpu_moe')])['mixed_pairs']
    assert mixed == [f'w224_cpu_moe_noz / w224_cpu_moe seed 1: AMD EPYC (AVX512), 1 threads / '
                     f'{XEON}']


def test_the_report_is_written_from_the_folders(tmp_path):
    write_ablations(tmp_path / 'runs')
    claims.main([str(tmp_path / 'runs'), '--out', str(tmp_path / 'report')])
    text = (tmp_path / 'report' / 'report.md').read_text()
    assert '| naive top-1 collapses | busiest_frac at the end' in text
    assert 'Seed pairs on two kinds of CPU: 0.' in text
    assert (tmp_path / 'report' / 'collapse.png').exists()
    summary = json.loads((tmp_path / 'report' / 'report.json').read_text())
    assert summary['shared'] is None and summary['activation']['rows'] == {}


def test_the_activation_answers_say_how_the_loss_moves_with_k(tmp_path):
    """top-1 far behind top-2; top-4 a noisy step from top-2; dense_total ahead of top-1 and
    level (by construction, only noise apart) with top-4."""
    for seed, noise in enumerate(NOISE, start=1):
        write_run(tmp_path, 'w224_cpu_dense_total', seed, 1.19 + noise)
        write_run(tmp_path, 'w224_cpu_moe_fine8_top1', seed, 1.27 + 1.5 * noise, top_k=1)
        write_run(tmp_path, 'w224_cpu_moe_fine8_top2', seed, 1.21 + 0.5 * noise)
        write_run(tmp_path, 'w224_cpu_moe_fine8', seed, 1.19 + noise + NOISE[seed % 10], top_k=4)
    runs = claims.report.load_runs(sorted(str(p) for p in tmp_path.iterdir()), print)
    act = claims.activation(runs)
    assert act['steps']['top-2 - top-1']['mean'] == pytest.approx(-0.06, abs=1e-3)
    assert act['moves'] == {'top-2 - top-1': 'the loss falls', 'top-4 - top-2': 'the loss falls'}
    assert act['against_total'] == {1: 'behind dense_total', 2: 'behind dense_total',
                                    4: 'not established'}
    # with 9 seed pairs nothing is decided yet
    one_less = {name: dict(list(seeds.items())[:9]) for name, seeds in runs.items()}
    assert claims.activation(one_less)['moves']['top-2 - top-1'] == 'not yet: 9 of 10 seed pairs'
