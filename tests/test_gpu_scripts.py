"""The real-text GPU check (scripts/gpu_real_text.py) on a CPU: its --tiny dry run at toy size goes
through every part (the CPU-recipe runs and their comparison with the committed CPU runs; the
paper configs, the stopped and resumed run, sample.py, export_hf.py and the logits of
transformers' model; the GPU tests' command; the profile's split; the compiled timings beside
nanoGPT's, when gpu_carry/ holds its model.py), and the pieces it is built from."""
import json
import math
import os
import statistics
import subprocess
import sys

import pytest
import torch

import gpu_profile
import gpu_real_text
import train
from conftest import REPO

NANOGPT = os.path.join(REPO, 'gpu_carry', 'nanogpt_model.py')


@pytest.fixture(scope='module')
def dry_run(prepared):
    """One --tiny run of the whole check, the tiny bytes data standing in for both data sets."""
    out = prepared / 'gpu_check'
    data = str(prepared / 'data')
    res = subprocess.run([sys.executable, 'scripts/gpu_real_text.py', '--tiny', '--out', str(out),
                          '--work', str(prepared / 'gpu_work'), '--cpu_data', data,
                          '--paper_data', data, '--slots', '2'],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return out, res.stdout


def load(out, name):
    return json.load(open(out / name))


def test_every_part_runs_and_is_timed(dry_run):
    out, stdout = dry_run
    summary = load(out, 'summary.json')
    assert summary['finished'] and summary['device'] == 'cpu'
    assert [name.split()[0] for name in summary['parts']] == ['1', '2', '3', '4', '5']
    for name, part in summary['parts'].items():
        assert part['ok'], (name, part)
        assert f'{name:<32} yes' in stdout
    if not torch.cuda.is_available():  # then the GPU tests are all skipped, and pytest says so
        assert 'skipped' in summary['parts']['3 gpu tests']['last_line']


def test_cpu_recipe_seeds_sit_next_to_the_committed_runs(dry_run):
    """--tiny trains seed 1 only (compare's means and spread: the test further down)."""
    out, _ = dry_run
    r = load(out, 'real_text.json')
    assert len(r['runs']) == 6 and all(run['returncode'] == 0 for run in r['runs'].values())
    assert r['compile'] is False and not r['data']['same_as_committed_runs']
    committed = [json.loads(line) for line in
                 open(os.path.join(REPO, 'results', 'cpu', 'runs', 'cpu_moe-s1', 'log.jsonl'))]
    best = min(record['val_loss'] for record in committed if 'val_loss' in record)
    for dtype in ('float32', 'bfloat16'):
        for config in ('cpu_moe', 'cpu_dense_active', 'cpu_dense_total'):
            table = r['compare'][dtype][config]
            assert list(table['seeds']) == ['1'] and table['paired_seeds'] == 1
            # four steps at a learning rate still warming up: far above the CPU runs' 1.2-1.3
            pair = table['seeds']['1']
            assert 4 < pair['gpu'] < 6 and 1 < pair['cpu'] < 2
        assert r['compare'][dtype]['cpu_moe']['seeds']['1']['cpu'] == best
        assert r['gaps'][dtype]['seeds'] == [1]
        assert os.path.isfile(out / 'runs' / dtype / 'cpu_moe-s1.jsonl')


def test_paper_runs_learn_resume_sample_and_export(dry_run):
    out, _ = dry_run
    r = load(out, 'paper_real_text.json')
    for name in ('moe', 'dense_active', 'dense_total'):
        run = r['runs'][name]
        assert run['returncode'] == 0 and run['finished'] and run['dtype_used'] == 'bfloat16'
        assert run['loss_falls'] and run['val_falls'] and run['last_loss'] < run['first_loss']
        assert [it for it, _ in run['val_losses']] == [0, 2, 4, 6, 8]
    resume = r['resume']
    assert resume['returncode'] == 0 and resume['stopped_at'] == resume['resumed_at'] == 4
    # on a CPU a resumed run repeats the straight run's numbers exactly
    assert resume['lines_after'] == resume['lines_expected_after'] == 5
    assert resume['max_abs_diff_after'] == resume['max_abs_diff_before'] == 0 and resume['close']
    assert r['sample']['returncode'] == 0 and r['sample']['text'].startswith('once upon a time')
    assert r['export']['returncode'] == 0
    if 'transformers' in r['export']:  # installed: our logits and transformers' agree
        assert r['export']['parity_ok'] and r['export']['hf_class'] == 'MixtralForCausalLM'


def test_profile_splits_each_step_into_its_parts(dry_run):
    out, _ = dry_run
    models = load(out, 'profile.json')['models']
    for name in ('moe', 'dense_active'):
        m = models[name]
        assert m['ranges_left_open'] == 0 and m['measured'] == 'CPU op time'
        assert sum(m['shares'].values()) == pytest.approx(1)
        for part in ('head_and_ce', 'attention', 'ffn_or_experts', 'optimizer', 'other'):
            assert m['shares'][part] > 0, (name, part)
    assert models['moe']['shares']['router_and_dispatch'] > 0
    assert models['dense_active']['shares']['router_and_dispatch'] == 0


def test_nanogpt_and_ours_are_counted_the_same_way(dry_run):
    out, _ = dry_run
    r = load(out, 'nanogpt.json')
    d, layers, vocab, block = (r['shapes'][k] for k in ('d_model', 'n_layer', 'vocab_size',
                                                         'block_size'))
    attention = 6 * layers * block * d
    dense = r['models']['dense_active']
    c = gpu_real_text.paper_config(gpu_real_text.parse_args(['--out', 'x', '--tiny']),
                                   'dense_active')
    assert dense['flops_per_token'] == train.flops_per_token(c)
    assert dense['attention_flops'] == attention and dense['tokens_per_s'] > 0
    assert dense['mfu'] is None  # no known peak on a CPU
    assert r['models']['moe']['tokens_per_s'] > 0
    nanogpt = r['models']['nanogpt']
    if os.path.isfile(NANOGPT):
        # 12 d^2 a layer (qkv 3, projection 1, MLP 4 + 4) and the output layer
        assert nanogpt['matmul_params'] == layers * 12 * d * d + vocab * d
        assert nanogpt['tokens_per_s'] > 0 and 'nanogpt_over_ours_tokens_per_s' in r
    else:
        assert 'gpu_carry.sh' in nanogpt['error']


def test_ranges_change_nothing_in_the_loss_or_the_gradients():
    c = gpu_real_text.paper_config(gpu_real_text.parse_args(['--out', 'x', '--tiny']), 'moe')
    device = torch.device('cpu')
    batch = gpu_profile.random_batch(c.vocab_size, 3, c.block_size, device)
    plain, _ = gpu_profile.our_model(c, device)
    ranged, _ = gpu_profile.our_model(c, device)
    open_ranges = gpu_profile.add_ranges(ranged)
    _, ce, aux = plain(*batch)
    loss = train.training_loss(ce, aux, c)
    fp32 = torch.autocast('cpu', enabled=False)
    ranged_loss = gpu_profile.ranged_loss(ranged, c, batch, open_ranges, fp32)
    assert torch.equal(loss, ranged_loss)
    loss.backward()
    ranged_loss.backward()
    assert open_ranges == []
    for p, q in zip(plain.parameters(), ranged.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_our_flop_count_is_nanogpts_rule_for_a_dense_model():
    """For a dense model, train.flops_per_token's matmul params are its nn.Linear weights: the rule
    nanoGPT's count uses."""
    c = gpu_real_text.paper_config(gpu_real_text.parse_args(['--out', 'x', '--tiny']),
                                   'dense_active')
    model, _, _, flops = gpu_profile.ours_at_our_shapes(c, torch.device('cpu'))
    assert flops['matmul_params'] == gpu_profile.linear_weights(model)


def test_compare_gives_the_means_the_spread_and_a_paired_t():
    cpu = {1: 1.20, 2: 1.30, 3: 1.25}
    close = gpu_real_text.compare({1: 1.21, 2: 1.29, 3: 1.27, 4: None}, cpu)
    assert close['paired_seeds'] == 3 and close['seeds'][4] == {'gpu': None, 'cpu': None}
    assert close['diff_of_means'] == pytest.approx(0.0066667, abs=1e-6)
    assert close['within_seed_spread'] and close['cpu']['std'] == pytest.approx(0.05)
    differences = [0.01, -0.01, 0.02]
    t = statistics.mean(differences) / (statistics.stdev(differences) / math.sqrt(3))
    assert close['paired_t'] == pytest.approx(t)
    far = gpu_real_text.compare({1: 1.50, 2: 1.62, 3: 1.55}, cpu)
    assert far['diff_of_means'] == pytest.approx(0.92 / 3)
    assert not far['within_seed_spread'] and far['paired_t'] > 10


def write_log(path, losses, vals):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, 'log.jsonl'), 'w') as f:
        for it, val in vals.items():
            f.write(json.dumps({'iter': it, 'val_loss': val}) + '\n')
        for it, loss in losses.items():
            f.write(json.dumps({'iter': it, 'loss': loss}) + '\n')


def test_a_resumed_run_that_drifts_is_not_close(tmp_path):
    losses = {2: 5.0, 4: 4.0, 6: 3.0, 8: 2.0}
    vals = {0: 6.0, 4: 4.5, 8: 2.5}
    write_log(tmp_path / 'straight', losses, vals)
    console = tmp_path / 'console.txt'
    console.write_text('moe: ..., resumed at iter 4\n')
    for drift, close in ((0.01, True), (0.05, False)):
        write_log(tmp_path / 'resumed', {**losses, 8: 2.0 + drift}, vals)
        r = gpu_real_text.resume_check(tmp_path / 'straight', tmp_path / 'resumed', 4, console)
        assert r['close'] is close and r['max_abs_diff_after'] == pytest.approx(drift)
        assert r['lines_after'] == 4 and r['max_abs_diff_before'] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason='this machine has a GPU')
def test_without_a_gpu_it_asks_for_tiny(tmp_path):
    res = subprocess.run([sys.executable, 'scripts/gpu_real_text.py', '--out', str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and '--tiny' in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
