"""gpu_check.py at its toy size on the CPU, end to end: every part runs and its report says what
it found; and the pieces that judge (the CPU recipe's tolerance, the data check, the resume check)
fail where they must."""
import json
import os
import subprocess
import sys
import types

import pytest
import torch

import gpu_check
from conftest import REPO, run
from errors import UserError

# one thread per process, as gpu_check.py runs its processes
ONE_THREAD = {**os.environ, 'OMP_NUM_THREADS': '1'}
# the committed CPU runs the check compares with, and the files each of them holds: a config and
# a log, no done.json and no checkpoints (a stand-in must hold what they hold, no more)
COMMITTED = os.path.join(REPO, 'results', 'cpu', 'warmup', 'runs')
COMMITTED_FILES = sorted(os.listdir(os.path.join(COMMITTED, 'w224_cpu_moe-s1')))


def train_reference(data, reference, configs=gpu_check.CPU_CONFIGS):
    """Stand-ins for the committed CPU runs: the toy CPU recipe trained here, fp32, one thread,
    as gpu_check.py will train its own fp32 runs on this CPU; then cut to the files a committed
    run holds."""
    for config in configs:
        out_dir = gpu_check.committed_run(str(reference), config, 1)
        argv = gpu_check.cpu_recipe_argv(config, 1, 'float32', 'toy', str(data), out_dir)
        out = subprocess.run([sys.executable, 'train.py', *argv], cwd=REPO, env=ONE_THREAD,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        for name in set(os.listdir(out_dir)) - set(COMMITTED_FILES):
            os.remove(os.path.join(out_dir, name))
        assert sorted(os.listdir(out_dir)) == COMMITTED_FILES


@pytest.fixture(scope='module')
def toy_check(prepared):
    """gpu_check.py --size=toy with the tiny bytes data standing in for both data sets."""
    data, reference = prepared / 'data', prepared / 'reference'
    train_reference(data, reference)
    out = subprocess.run([sys.executable, 'gpu_check.py', '--size=toy', f'--cpu_data={data}',
                          f'--paper_data={data}', f'--reference={reference}',
                          f'--out={prepared / "check"}'],
                         cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((prepared / 'check' / 'report.json').read_text())
    return report, (prepared / 'check' / 'report.md').read_text(), out.stdout


def test_the_report_has_a_line_per_part(toy_check):
    report, markdown, console = toy_check
    parts = report['parts']
    assert list(parts) == ['tests', 'cpu_recipe', 'paper', 'speed']
    lines = [f'- {name}: {part["status"]}: {part["why"]}' for name, part in parts.items()]
    assert [line for line in markdown.splitlines() if line.startswith('- ')] == lines
    assert markdown in console  # and it is printed
    assert report['size'] == 'toy' and report['torch'] == torch.__version__


@pytest.mark.skipif(torch.cuda.is_available(), reason='this machine has a GPU')
def test_the_gpu_tests_skip_themselves_without_a_gpu(toy_check):
    tests = toy_check[0]['parts']['tests']
    assert tests['status'] == 'skipped' and ' skipped, ' in tests['why']
    assert tests['why'].startswith('no CUDA GPU, so the GPU tests skip themselves: ')


def test_the_cpu_recipe_sits_beside_the_committed_runs(toy_check):
    """On the CPU that trained the stand-ins, fp32 is the same run: the same best val loss to the
    bit. bf16 rounds otherwise, within its tolerance."""
    recipe = toy_check[0]['parts']['cpu_recipe']
    assert recipe['status'] == 'passed'
    assert all(gap == 0.0 for gap in recipe['gaps']['float32'].values())
    assert all(0 < abs(gap) <= 0.03 for gap in recipe['gaps']['bfloat16'].values())
    assert [(r['config'], r['seed']) for r in recipe['runs']] == [
        (config, 1) for config in gpu_check.CPU_CONFIGS]
    for r in recipe['runs']:
        assert r['float32'] == r['committed'] != r['bfloat16']
    assert f'| cpu_moe | 1 | {recipe["runs"][0]["committed"]:.4f} |' in toy_check[1]


def test_the_paper_configs_learn_resume_sample_and_export(toy_check):
    paper = toy_check[0]['parts']['paper']
    assert paper['status'] == 'passed'
    found = paper['checks']
    assert list(found) == ['moe', 'dense_active', 'dense_total', 'resume', 'sample', 'export']
    assert paper['why'] == '; '.join(f'{name}: {text}' for name, text in found.items())
    # the CPU is deterministic: the resumed run's lines are the straight run's, exactly
    assert found['resume'] == ('resumed at 4: after it within 0.0e+00 of the straight run '
                               '(allowed 1.0e-03, noise 0.0e+00)')
    assert found['sample'].startswith('sample.py: "once upon a time')
    assert found['export'].startswith('MixtralForCausalLM logits within ')
    assert float(found['export'].split()[3]) <= gpu_check.PARITY_TOLERANCE


def test_speed_is_benchs_own_figures(toy_check):
    speed = toy_check[0]['parts']['speed']
    bench = speed['bench']
    assert speed['status'] == 'passed' and bench['compile'] is True
    assert speed['why'].startswith(f'moe {bench["tokens_per_s"]["moe"]:,.0f} tokens/s, ')
    assert f'moe / dense_active {bench["moe_over_dense_active"]:.3f}' in speed['why']
    assert speed['why'].endswith('no MFU: hardware.PEAK_FLOPS has no peak for this device')


# ----------------------------------------------------------------------------- its judges
def fake_run(folder, val_losses, iters=None):
    """A run folder as the committed runs hold one: config.json and an evaluation line per val
    loss, every 2 iters. It finished (its last evaluation at its last iter) unless iters says
    it has more to go."""
    folder.mkdir(parents=True)
    lines = [{'iter': 2 * i, 'val_loss': v} for i, v in enumerate(val_losses)]
    (folder / 'config.json').write_text(json.dumps({'iters': iters or lines[-1]['iter']}))
    (folder / 'log.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in lines))
    assert sorted(os.listdir(folder)) == COMMITTED_FILES


def recipe_args(tmp_path):
    """gpu_check's arguments for a toy check whose committed runs ended at val loss 1.0."""
    for config in gpu_check.CPU_CONFIGS:
        fake_run(tmp_path / 'reference' / f'w224_{config}-s1', [5.0, 1.0])
    return types.SimpleNamespace(size='toy', reference=str(tmp_path / 'reference'),
                                 work=str(tmp_path / 'runs'))


@pytest.mark.parametrize('fp32, bf16, over', [
    (1.019, 0.971, None), (1.021, 1.0, 'float32 cpu_moe +2.10%'),
    (1.0, 1.031, 'bfloat16 cpu_moe +3.10%')])
def test_the_cpu_recipe_fails_outside_its_tolerance(tmp_path, fp32, bf16, over):
    """2% for fp32, 3% for bf16, of the committed mean best val loss."""
    args = recipe_args(tmp_path)
    for config in gpu_check.CPU_CONFIGS:
        fake_run(tmp_path / 'runs' / f'float32_{config}-s1', [5.0, fp32])
        fake_run(tmp_path / 'runs' / f'bfloat16_{config}-s1', [5.0, bf16])
    recipe = gpu_check.cpu_recipe(args, dict.fromkeys(gpu_check.cpu_runs('toy'), 0))
    assert recipe['status'] == ('failed' if over else 'passed')
    assert recipe['why'].startswith('mean best val loss over seeds 1 (2 evaluations) against the '
                                    'committed CPU runs: float32 within '
                                    f'{fp32 - 1:+.2%} (allowed 2%), bfloat16 within '
                                    f'{bf16 - 1:+.2%} (allowed 3%)')
    assert (f'; over: {over}, ' in recipe['why']) == bool(over)


def test_a_failed_run_fails_the_cpu_recipe(tmp_path):
    done = {**dict.fromkeys(gpu_check.cpu_runs('toy'), 0), 'bfloat16_cpu_moe-s1': 1}
    recipe = gpu_check.cpu_recipe(recipe_args(tmp_path), done)
    assert recipe == {'status': 'failed',
                      'why': 'train.py failed: bfloat16_cpu_moe-s1 (logs/)'}


def test_a_run_that_stopped_short_fails_the_cpu_recipe(tmp_path):
    """train.py ended well, but the run's last evaluation is not at its last iter."""
    args = recipe_args(tmp_path)
    for name in gpu_check.cpu_runs('toy'):
        fake_run(tmp_path / 'runs' / name, [5.0, 1.0], iters=4 if name == 'float32_cpu_moe-s1'
                 else None)
    recipe = gpu_check.cpu_recipe(args, dict.fromkeys(gpu_check.cpu_runs('toy'), 0))
    assert recipe == {'status': 'failed',
                      'why': f'train.py ended, but {tmp_path}/runs/float32_cpu_moe-s1 has not '
                             'finished: its last evaluation is at iter 2 of 4'}


def test_runs_shorter_than_the_committed_ones_are_compared_at_iter_0(tmp_path):
    """As the toy size's 4 iters against the committed runs' 1,120: a best val loss after 4 iters
    says nothing against one after 1,120, so the runs meet at iter 0, before training."""
    args = recipe_args(tmp_path)
    for name in gpu_check.cpu_runs('toy'):
        fake_run(tmp_path / 'runs' / name, [5.05, 4.0, 3.0])
    recipe = gpu_check.cpu_recipe(args, dict.fromkeys(gpu_check.cpu_runs('toy'), 0))
    assert recipe['status'] == 'passed'
    assert recipe['why'] == ('mean best val loss over seeds 1 (iter 0) against the committed CPU '
                             'runs: float32 within +1.00% (allowed 2%), bfloat16 within +1.00% '
                             '(allowed 3%)')
    assert all(r['committed'] == 5.0 and r['float32'] == 5.05 for r in recipe['runs'])


def test_a_committed_run_is_read_from_its_log():
    """The committed runs hold no done.json: the best val loss is the lowest in the log, as
    report.py reads a run."""
    run_dir = os.path.join(COMMITTED, 'w224_cpu_moe-s1')
    with open(os.path.join(run_dir, 'log.jsonl')) as f:
        vals = [r['val_loss'] for r in map(json.loads, f) if 'val_loss' in r]
    assert len(vals) > 2 and gpu_check.best_val(run_dir, gpu_check.val_losses(run_dir)) == min(vals)


def test_the_committed_runs_of_the_full_check_are_finished():
    """Each config's last evaluation is at its last iter (config.json's iters)."""
    for config in gpu_check.CPU_CONFIGS:
        for seed in gpu_check.SIZES['full']['seeds']:
            assert gpu_check.not_finished(gpu_check.committed_run(COMMITTED, config, seed)) is None


def test_a_diverged_evaluation_is_never_the_best(tmp_path):
    fake_run(tmp_path / 'run', [float('nan'), 2.0, 1.0, float('inf')])
    assert gpu_check.not_finished(tmp_path / 'run') is None
    assert gpu_check.best_val(tmp_path / 'run', {0, 2, 4, 6}) == 1.0


@pytest.mark.parametrize('build, why', [
    (lambda run: fake_run(run, [5.0, 1.0], iters=8),
     'has not finished: its last evaluation is at iter 2 of 8'),
    (lambda run: fake_run(run, [float('nan')] * 2), 'has no finite val loss'),
    (lambda run: None, 'holds no config.json')], ids=['unfinished', 'diverged', 'missing'])
def test_a_missing_or_unfinished_committed_run_is_said_before_any_run(tmp_path, build, why):
    """The CPU recipe is skipped, and nothing is compared with a run that is no finished run."""
    reference = tmp_path / 'reference'
    for config in gpu_check.CPU_CONFIGS[1:]:
        fake_run(reference / f'w224_{config}-s1', [5.0, 1.0])
    build(reference / 'w224_cpu_moe-s1')
    args = types.SimpleNamespace(size='toy', reference=str(reference))
    assert gpu_check.start_problem(args) == (f'no committed run to compare with: {reference}/'
                                             f'w224_cpu_moe-s1 {why}')


def test_other_stories_than_the_committed_runs_are_said_before_any_run(prepared, tmp_path):
    """The committed cpu_moe seed 1 started from its val loss at iter 0; runs on data where the
    same weights start elsewhere cannot be set beside it."""
    data = prepared / 'data'
    train_reference(data, tmp_path / 'same', configs=['cpu_moe'])
    for reference in ('same', 'other'):  # only cpu_moe's start is compared
        for config in gpu_check.CPU_CONFIGS[1:]:
            fake_run(tmp_path / reference / f'w224_{config}-s1', [5.0, 1.0])
    args = types.SimpleNamespace(size='toy', cpu_data=str(data),
                                 reference=str(tmp_path / 'same'))
    assert gpu_check.start_problem(args) is None
    fake_run(tmp_path / 'other' / 'w224_cpu_moe-s1', [5.9])
    args.reference = str(tmp_path / 'other')
    problem = gpu_check.start_problem(args)
    assert problem.startswith('cpu_moe seed 1 starts at val loss 5.')
    assert problem.endswith(f' on {data} at size toy, the committed run at 5.9000: other stories '
                            '(the committed runs used a lowercased copy of the first 5,510 train '
                            'stories: TINYSTORIES=FILE)')


def log_lines(folder, values):
    """A log.jsonl of (iter, is an evaluation, loss) lines."""
    folder.mkdir()
    (folder / 'log.jsonl').write_text(''.join(
        json.dumps({'iter': it, 'val_loss' if is_eval else 'loss': v}) + '\n'
        for it, is_eval, v in values))


@pytest.mark.parametrize('after, ok', [(0.0035, True), (0.0045, False)])
def test_a_resumed_run_is_judged_by_the_noise_of_two_straight_runs(tmp_path, after, ok):
    """Up to the stop (iter 4, its training line) the runs differ by 0.001: after it (from the
    evaluation at 4 on) by up to 3 x 0.001 + 0.001 = 0.004."""
    straight = [(0, True, 5.0), (2, False, 4.0), (4, False, 3.0), (4, True, 3.0), (6, False, 2.0)]
    resumed = [(0, True, 5.0), (2, False, 4.001), (4, False, 3.0), (4, True, 3.0),
               (6, False, 2.0 + after)]
    log_lines(tmp_path / 'straight', straight)
    log_lines(tmp_path / 'resumed', resumed)
    console = tmp_path / 'console.txt'
    console.write_text('moe: ..., resumed at iter 4\n')
    assert gpu_check.resume_check(tmp_path / 'straight', tmp_path / 'resumed', 4, console)[0] == ok
    console.write_text('moe: ..., nothing to resume\n')
    assert not gpu_check.resume_check(tmp_path / 'straight', tmp_path / 'resumed', 4, console)[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason='this machine has a GPU')
def test_without_a_gpu_the_full_check_asks_for_the_toy_size():
    out = run('gpu_check.py')
    assert out.returncode == 1 and out.stderr == (
        'gpu_check.py: error: torch sees no CUDA GPU; on a CPU, check the logic at toy sizes: '
        'python gpu_check.py --size=toy\n')


def test_without_data_it_names_what_it_needs(tmp_path):
    out = run('gpu_check.py', '--size=toy', f'--cpu_data={tmp_path}')
    assert out.returncode == 1 and out.stderr == (
        f'gpu_check.py: error: no data in {tmp_path}: make gpu_check prepares it '
        '(TINYSTORIES=FILE for a local TinyStories file, else from the Hugging Face hub)\n')


def test_an_unknown_part_is_one_line():
    with pytest.raises(UserError, match="--parts: no part 'speeed'; choose from tests, "):
        gpu_check.parse_args(['--size=toy', '--parts=tests,speeed'])
