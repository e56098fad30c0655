"""The real-text GPU check (scripts/gpu_real_text.sh and .py) on a CPU: its --tiny dry run at toy
size goes through every part (the CPU-recipe runs and their comparison with the committed CPU runs;
the paper configs, the stopped and resumed run, sample.py, export_hf.py and the logits of
transformers' model; the GPU tests' command; the profile's split; the compiled timings beside
nanoGPT's, when gpu_carry/ holds its model.py) and leaves at most 8 files, as the GPU tool returns;
and the pieces it is built from."""
import json
import math
import os
import statistics
import subprocess
import sys
import tarfile
import time
import types

import pytest
import torch

import gpu_profile
import gpu_real_text
import train
from conftest import REPO

NANOGPT = os.path.join(REPO, 'gpu_carry', 'nanogpt_model.py')


@pytest.fixture(scope='module')
def dry_run(prepared):
    """One --tiny run of the whole check through its shell entry, the tiny bytes data standing in
    for both data sets."""
    out = prepared / 'gpu_check'
    data = str(prepared / 'data')
    res = subprocess.run(['bash', 'scripts/gpu_real_text.sh', str(out), '--tiny',
                          '--work', str(prepared / 'gpu_work'), '--cpu_data', data,
                          '--paper_data', data, '--slots', '2'],
                         cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, 'PYTHON': sys.executable})
    assert res.returncode == 0, res.stdout[-3000:]
    return out, res.stdout


def load(out, name):
    return json.load(open(out / name))


def logs_in(out):
    """The names in OUT/logs.tar.gz."""
    with tarfile.open(out / 'logs.tar.gz') as tar:
        return tar.getnames()


def test_every_part_runs_and_is_timed(dry_run):
    out, stdout = dry_run
    summary = load(out, 'summary.json')
    assert summary['finished'] and summary['device'] == 'cpu'
    # part 2 runs beside part 1, so either may end first
    assert sorted(name.split()[0] for name in summary['parts']) == ['1', '2', '3', '4', '5']
    for name, part in summary['parts'].items():
        assert part['ok'], (name, part)
        assert f'{name:<32} yes' in stdout
    assert summary['time_plan_s'] == {'parts_1_2_3_end': 185, 'part_5_end': 280,
                                      'part_4_end': 330}
    if not torch.cuda.is_available():  # then the GPU tests are all skipped, and pytest says so
        tests = summary['parts']['3 gpu tests']
        assert tests['counts']['skipped'] > 0 and 'failed' not in tests['counts']


def test_out_holds_at_most_8_files_and_the_logs_are_packed(dry_run):
    out, _ = dry_run
    assert sorted(os.listdir(out)) == ['console.txt', 'logs.tar.gz', 'nanogpt.json',
                                       'paper_real_text.json', 'profile.json', 'real_text.json',
                                       'summary.json']
    names = logs_in(out)
    for name in ('gpu_tests.txt', 'sample.txt', 'nvidia_smi.txt', 'float32_cpu_moe-s1.txt',
                 'runs/bfloat16/cpu_dense_total-s1.jsonl', 'runs/paper/moe_stopped.jsonl',
                 'runs/paper/moe_resumed.jsonl'):
        assert f'logs/{name}' in names
    assert '== part 5 nanogpt beside ours: ok' in open(out / 'console.txt').read()


def test_the_shell_entry_stops_the_script_40_s_after_its_budget(tmp_path):
    """A stand-in interpreter that hangs: with --budget_s=-38 the hard limit is 2 s. What it
    printed and the logs still come back."""
    hang = tmp_path / 'hang.sh'  # called as: -u scripts/gpu_real_text.py --out OUT ...
    hang.write_text('#!/usr/bin/env bash\necho "$@"; echo half > "$4/summary.json.tmp"; '
                    'sleep 60\n')
    hang.chmod(0o755)
    out = tmp_path / 'out'
    t0 = time.time()
    res = subprocess.run(['bash', 'scripts/gpu_real_text.sh', str(out), '--budget_s=-38'],
                         cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, 'PYTHON': str(hang)})
    assert res.returncode == 124 and time.time() - t0 < 30
    console = open(out / 'console.txt').read()
    assert '--budget_s -38 --budget_s=-38' in console
    assert sorted(os.listdir(out)) == ['console.txt', 'logs.tar.gz']
    assert logs_in(out) == ['logs', 'logs/nvidia_smi.txt']


def test_cpu_recipe_seeds_sit_next_to_the_committed_runs(dry_run):
    """--tiny trains seed 1 only (compare's means and spread: the test further down)."""
    out, _ = dry_run
    r = load(out, 'real_text.json')
    assert len(r['runs']) == 6 and all(run['returncode'] == 0 for run in r['runs'].values())
    assert r['not_started'] == [] and r['slots'] == 2
    assert r['compile'] is False and not r['data']['same_as_committed_runs']
    committed = [json.loads(line) for line in
                 open(os.path.join(REPO, 'results', 'cpu', 'warmup', 'runs', 'w224_cpu_moe-s1',
                                   'log.jsonl'))]
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
        assert f'logs/runs/{dtype}/cpu_moe-s1.jsonl' in logs_in(out)


def test_paper_runs_learn_resume_sample_and_export(dry_run):
    out, _ = dry_run
    r = load(out, 'paper_real_text.json')
    for name in ('moe', 'dense_active', 'dense_total'):
        run = r['runs'][name]
        assert run['returncode'] == 0 and run['finished'] and run['dtype_used'] == 'bfloat16'
        assert run['loss_falls'] and run['last_loss'] < run['first_loss']
        vals = dict(run['val_losses'])
        assert list(vals) == [0, 2, 4, 6, 8]
        assert run['best_val'] == [min(vals, key=vals.get), min(vals.values())]
        assert run['last_val_minus_best'] == vals[8] - min(vals.values()) >= 0
        assert run['last_val_minus_halfway'] == pytest.approx(vals[8] - vals[4])
    # 8 steps of 4 x 4 x 64 tokens over the tiny data's train split
    meta = json.load(open(r['data']['dir'] + '/meta.json'))
    assert r['epochs'] == pytest.approx(8 * 1024 / meta['train_tokens'])
    resume = r['resume']
    assert resume['returncode'] == 0 and resume['stopped_at'] == resume['resumed_at'] == 4
    # on a CPU a resumed run repeats the straight run's numbers exactly: after the stop, the
    # training and eval lines at 6 and 8
    assert resume['lines_after'] == resume['lines_expected_after'] == 4
    assert resume['val_at_stop_diff'] == resume['noise_floor'] == 0
    assert resume['max_abs_diff_after'] == 0 and resume['close']
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
    dense = r['models']['dense_active']
    c = gpu_real_text.paper_config(gpu_real_text.parse_args(['--out', 'x', '--tiny']),
                                   'dense_active')
    assert dense['flops_per_token'] == train.flops_per_token(c)
    assert dense['flops_per_token_nanogpt_rule'] == (6 * train.count_params(c)['active']
                                                     + 12 * layers * block * d)
    assert dense['tokens_per_s'] > 0
    assert dense['mfu'] is None and dense['mfu_nanogpt_rule'] is None  # no known peak on a CPU
    assert r['models']['moe']['tokens_per_s'] > 0
    nanogpt = r['models']['nanogpt']
    if os.path.isfile(NANOGPT):
        # 12 d^2 a layer (qkv 3, projection 1, MLP 4 + 4) and the output layer
        assert nanogpt['matmul_params'] == layers * 12 * d * d + vocab * d
        # the MFU ratio is the ratio of FLOP/s, each model counted by the same rule
        for rule, ratio in (('flops_per_token', 'nanogpt_over_ours_mfu'),
                            ('flops_per_token_nanogpt_rule', 'nanogpt_over_ours_mfu_nanogpt_rule')):
            done = {m: r['models'][m]['tokens_per_s'] * r['models'][m][rule]
                    for m in ('nanogpt', 'dense_active')}
            assert r[ratio] == pytest.approx(done['nanogpt'] / done['dense_active'])
        assert 'nanogpt_over_ours_tokens_per_s' not in r
    else:
        assert 'gpu_carry.sh' in nanogpt['error'] and 'nanogpt_over_ours_mfu' not in r


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


def test_our_matmul_params_are_the_dense_models_linear_weights():
    """For a dense model, train.flops_per_token's matmul params are its nn.Linear weights, as
    they are counted for nanoGPT's model; nanoGPT's rule counts all its params."""
    c = gpu_real_text.paper_config(gpu_real_text.parse_args(['--out', 'x', '--tiny']),
                                   'dense_active')
    model, _, _, flops = gpu_profile.ours_at_our_shapes(c, torch.device('cpu'))
    assert flops['matmul_params'] == gpu_profile.linear_weights(model)
    assert flops['params_nanogpt_rule'] == sum(p.numel() for p in model.parameters())


@pytest.mark.skipif(not os.path.isfile(NANOGPT), reason='gpu_carry/ has no nanoGPT model.py')
def test_the_nanogpt_rule_is_nanogpts_own_estimate_mfu():
    c = gpu_real_text.paper_config(gpu_real_text.parse_args(['--out', 'x', '--tiny']),
                                   'dense_active')
    module = gpu_profile.load_nanogpt(NANOGPT)
    model, _, _, flops = gpu_profile.nanogpt_at_our_shapes(module, c, torch.device('cpu'))
    # estimate_mfu(fwdbwd_per_iter, dt): flops_per_token x block_size x fwdbwd_per_iter / dt over
    # the A100's 312 TFLOP/s
    theirs = model.estimate_mfu(1, 1.0) * 312e12 / c.block_size
    assert flops['flops_per_token_nanogpt_rule'] == pytest.approx(theirs, rel=1e-12)
    # and ours counts attention over half the square, nanoGPT's over all of it
    attention = c.n_layer * c.block_size * c.d_model
    assert flops['flops_per_token'] == 6 * flops['matmul_params'] + 6 * attention


def fake_event(name, device_type, parent=None, range_=False, kernel_us=(), us=0.0):
    """A profiler event as gpu_profile reads them: a CPU op (kernel_us: the kernels it launched),
    a range (range_), or a device event of us microseconds."""
    return types.SimpleNamespace(
        name=name, device_type=device_type, cpu_parent=parent, is_user_annotation=range_,
        kernels=[types.SimpleNamespace(duration=t) for t in kernel_us], self_cpu_time_total=us,
        time_range=types.SimpleNamespace(elapsed_us=lambda: us))


def test_a_ranges_own_gpu_span_counts_as_no_kernel():
    """On a GPU each profiler range is also a device event spanning its kernels, and its CPU event
    gets that span as a kernel (pytorch#130730): neither is a kernel of its own."""
    cpu, cuda = gpu_profile.DeviceType.CPU, gpu_profile.DeviceType.CUDA
    attention = fake_event('attention', cpu, range_=True, kernel_us=[10.0])
    events = [attention,
              fake_event('aten::mm', cpu, parent=attention, kernel_us=[7.0]),
              fake_event('aten::add', cpu, kernel_us=[3.0]),
              fake_event('attention', cuda, range_=True, us=10.0),
              fake_event('gemm_kernel', cuda, us=7.0),
              fake_event('add_kernel', cuda, us=3.0)]
    prof = types.SimpleNamespace(events=lambda: events)
    assert gpu_profile.time_by_range(prof, ('attention',), on_gpu=True) == {'attention': 7.0,
                                                                            'other': 3.0}
    assert gpu_profile.kernel_time(prof) == 10.0
    assert gpu_profile.top_kernels(prof, on_gpu=True) == {'gemm_kernel': 0.7, 'add_kernel': 0.3}


def test_compare_gives_the_means_the_spread_and_a_paired_t():
    cpu = {1: 1.20, 2: 1.30, 3: 1.25}
    close = gpu_real_text.compare({1: 1.21, 2: 1.29, 3: 1.27, 4: None}, cpu)
    assert close['paired_seeds'] == 3 and close['seeds'][4] == {'gpu': None, 'cpu': None}
    assert close['diff_of_means'] == pytest.approx(0.0066667, abs=1e-6)
    assert close['within_seed_spread'] and close['cpu']['std'] == pytest.approx(0.05)
    differences = [0.01, -0.01, 0.02]
    t = statistics.mean(differences) / (statistics.stdev(differences) / math.sqrt(3))
    assert close['paired_t'] == pytest.approx(t)
    # two degrees of freedom: |t| must pass 4.30, not the 2.78 of five seeds
    assert close['t_df'] == 2 and close['t_critical_5pct'] == 4.303
    assert close['cpu']['n'] == 3 and close['significant_at_5pct'] is False
    far = gpu_real_text.compare({1: 1.50, 2: 1.62, 3: 1.55}, cpu)
    assert far['diff_of_means'] == pytest.approx(0.92 / 3)
    assert not far['within_seed_spread'] and far['paired_t'] > 10
    assert far['significant_at_5pct'] is True
    # t = 5 with one degree of freedom: above 2.78, below 12.71
    pair = gpu_real_text.compare({1: 1.30, 2: 1.45}, {1: 1.20, 2: 1.30})
    assert pair['paired_t'] == pytest.approx(5.0) and pair['significant_at_5pct'] is False


def write_log(path, losses, vals):
    with open(path, 'w') as f:
        for it, val in vals.items():
            f.write(json.dumps({'iter': it, 'val_loss': val}) + '\n')
        for it, loss in losses.items():
            f.write(json.dumps({'iter': it, 'loss': loss}) + '\n')


def test_a_resumed_run_is_judged_by_the_noise_of_two_straight_runs(tmp_path):
    """Stopped at 4: the stopped run differs from the straight one by 0.01 at iter 2, so lines
    after the stop may differ by up to 3 x 0.01 + 1e-4; the eval at the stop must repeat the
    stopped run's own within 1e-4."""
    losses, vals = {2: 5.0, 4: 4.0, 6: 3.0, 8: 2.0}, {0: 6.0, 4: 4.5, 8: 2.5}
    straight, stopped, resumed = (tmp_path / f'{name}.jsonl'
                                  for name in ('straight', 'stopped', 'resumed'))
    write_log(straight, losses, vals)
    write_log(stopped, {2: 5.01, 4: 4.0}, {0: 6.0, 4: 4.5})
    console = tmp_path / 'console.txt'
    console.write_text('moe: ..., resumed at iter 4\n')
    for drift, at_stop, close in ((0.03, 4.5, True), (0.04, 4.5, False), (0.0, 4.501, False)):
        write_log(resumed, {2: 5.01, 4: 4.0, 6: 3.0, 8: 2.0 + drift}, {**vals, 4: at_stop})
        r = gpu_real_text.resume_check(straight, stopped, resumed, 4, console)
        assert r['close'] is close, (drift, at_stop)
        assert r['noise_floor'] == pytest.approx(0.01) and r['max_abs_diff_after'] == (
            pytest.approx(drift))
        assert r['val_at_stop_diff'] == pytest.approx(at_stop - 4.5)
        assert r['lines_after'] == r['lines_expected_after'] == 3


def test_pytest_counts_read_its_summary_line():
    line = '1 failed, 2 passed, 250 deselected, 2 errors in 41.20s (0:00:41)'
    assert gpu_real_text.pytest_counts(line) == {'failed': 1, 'passed': 2, 'deselected': 250,
                                                 'error': 2}
    assert gpu_real_text.pytest_counts('3 passed, 1 error in 9.1s') == {'passed': 3, 'error': 1}


def test_an_error_while_jobs_run_kills_them(tmp_path):
    """on_end raises as the first job ends (once the second has started): the second, still
    running, must not outlive run_jobs."""
    pid_file = tmp_path / 'pid'
    args = types.SimpleNamespace(logs=str(tmp_path), env=dict(os.environ), t_start=time.time())
    wait_for_slow = f'until [ -s {pid_file} ]; do sleep 0.1; done'
    jobs = [gpu_real_text.Job('quick', ['sh', '-c', wait_for_slow]),
            gpu_real_text.Job('slow', ['sh', '-c', f'echo $$ > {pid_file}; exec sleep 60'])]

    def on_end(job, returncode, seconds):
        raise RuntimeError('a bug in on_end')
    end = time.time() + 60
    with pytest.raises(RuntimeError, match='a bug'):
        gpu_real_text.run_jobs(args, jobs, 2, end, end, on_end)
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(int(pid_file.read_text()), 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason='this machine has a GPU')
def test_without_a_gpu_it_asks_for_tiny(tmp_path):
    res = subprocess.run([sys.executable, 'scripts/gpu_real_text.py', '--out', str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and '--tiny' in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
