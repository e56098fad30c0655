"""Resume, crash-safe checkpoints, NaN stops, DDP with torchrun, and bad input: the faults a long
run meets."""
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import runs
import train
from conftest import REPO, TINY, config, read_log, run
from errors import UserError

RESUMABLE = TINY + ['--ckpt_interval=10']


def train_args(prepared, out_dir, *extra):
    return ['train.py', 'config/cpu_moe.py', f'--data_dir={prepared / "data"}',
            f'--out_dir={out_dir}', *RESUMABLE, *extra]


STOP_AT = ('import os, signal, sys, time, train\n'
           # train.py sends itself the signal named (SIGKILL; SIGINT: Ctrl-C) as it reaches step
           # `at`, and waits for it
           'stop, at, real = getattr(signal, sys.argv[1]), int(sys.argv[2]), train.get_batch\n'
           # Ctrl-C raises KeyboardInterrupt, as in a terminal, also where the tests run in the
           # background (a shell starts background jobs with SIGINT ignored)
           'signal.signal(signal.SIGINT, signal.default_int_handler)\n'
           'def get_batch(c, step, device):\n'
           '    if step == at:\n'
           '        os.kill(os.getpid(), stop)\n'
           '        time.sleep(60)\n'
           '    return real(c, step, device)\n'
           'train.get_batch = get_batch\n'
           'train.command(sys.argv[3:])')


def stopped_run(signal_name, at, args):
    """train.py with args, stopped by the signal at step `at`."""
    return subprocess.run([sys.executable, '-c', STOP_AT, signal_name, str(at), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_a_run_killed_between_checkpoints_resumes_bit_for_bit(prepared):
    """Run A straight through; run B is SIGKILLed at step 35 (after the checkpoint at 20 and the log
    line at 30, which the resume must cut back), resumed, killed again at step 25 (before any new
    log line), and resumed to the end. On CPU every logged value equals run A's exactly: data order,
    LR schedule, optimizer state and RNG are all restored."""
    args = ['config/cpu_moe.py', f'--data_dir={prepared / "data"}', *TINY, '--ckpt_interval=20']
    out = run('train.py', *args, f'--out_dir={prepared / "straight"}')
    assert out.returncode == 0, out.stderr
    b = prepared / 'killed'
    for attempt, at in enumerate((35, 25)):
        proc = stopped_run('SIGKILL', at, [*args, f'--out_dir={b}'] + ['--resume=True'] * attempt)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        assert (runs.load_checkpoint(str(b / 'latest.pt'))['iter'] == 20
                and not (b / 'done.json').exists())
        logged = [r['iter'] for r in read_log(b)]
        # the lines the resume has to cut back (or not)
        assert logged[-1] == (30 if at == 35 else 20), logged
    out = run('train.py', *args, f'--out_dir={b}', '--resume=True')
    assert out.returncode == 0, out.stderr
    assert 'resumed at iter 20' in out.stdout
    assert read_log(b) == read_log(prepared / 'straight')
    final = [runs.load_checkpoint(str(d / 'latest.pt'))['model']
             for d in (b, prepared / 'straight')]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])


def test_resume_refuses_another_config_and_a_fresh_run_refuses_a_used_out_dir(prepared):
    out_dir = prepared / 'straight'  # finished by the test above, or made here
    if not (out_dir / 'done.json').exists():
        assert run(*train_args(prepared, out_dir)).returncode == 0
    before = {p.name: p.read_bytes() for p in out_dir.iterdir()}
    out = run(*train_args(prepared, out_dir), '--resume=True', '--learning_rate=0.02')
    assert (out.returncode != 0 and 'learning_rate=0.01' in out.stderr
            and 'Traceback' not in out.stderr)
    out = run(*train_args(prepared, out_dir))
    assert (out.returncode != 0 and '--resume=True' in out.stderr
            and 'Traceback' not in out.stderr)
    # nothing overwritten
    assert {p.name: p.read_bytes() for p in out_dir.iterdir()} == before


def test_resume_takes_a_checkpoint_from_before_a_new_config_key(tmp_path):
    """A key the checkpoint predates (data_seed) counts as its default; a real difference is still
    refused."""
    c = config()
    saved = {k: v for k, v in vars(c).items() if k != 'data_seed'}
    path = str(tmp_path / 'latest.pt')
    torch.save({'config': saved}, path)
    assert runs.load_resume_checkpoint(path, c, train.DEFAULTS)['config'] == saved
    torch.save({'config': {**saved, 'data_seed': 2}}, path)
    with pytest.raises(UserError, match='another config \\(data_seed=2\\)'):
        runs.load_resume_checkpoint(path, c, train.DEFAULTS)


def test_ctrl_c_is_one_line_saying_where_the_run_stopped_and_how_to_go_on(prepared):
    """Stopped before its first checkpoint (iter 10), a run has nothing to resume and the same
    command starts it over; stopped after it, the line names latest.pt and --resume=True."""
    out_dir = prepared / 'ctrl_c'
    args = train_args(prepared, out_dir)[1:]  # a checkpoint every 10 steps, a log line every 10
    first = stopped_run('SIGINT', 5, args)
    # best.pt is there, from the evaluation at iter 0: the message says what starting over does
    assert first.returncode == 130 and first.stderr.strip() == (
        'train.py: stopped by Ctrl-C (its log ends at iter 0); nothing to resume from yet (the '
        'first latest.pt comes at iter 10, or at the end): the same command starts over and '
        f'replaces {out_dir / "best.pt"} (the best model so far, iter 0)')
    second = stopped_run('SIGINT', 15, args)
    assert f'{out_dir} holds a run stopped before its first checkpoint: starting it over' in (
        second.stdout)
    assert second.returncode == 130 and second.stderr.strip() == (
        f'train.py: stopped by Ctrl-C (its log ends at iter 10); {out_dir / "latest.pt"} holds '
        'iter 10: add --resume=True to go on from there')
    out = run('train.py', *args, '--resume=True')
    assert out.returncode == 0 and 'resumed at iter 10' in out.stdout, out.stderr
    assert [r['iter'] for r in read_log(out_dir)] == [0, 10, 20, 20, 30, 40, 40]


def test_a_log_past_the_first_checkpoint_is_a_run_even_without_its_checkpoints(prepared,
                                                                               tmp_path):
    """A kept copy of a run (log.jsonl and config.json, as results/ holds them) is never
    overwritten, though it has no latest.pt to resume from."""
    finished = prepared / 'ctrl_c'  # finished by the test above, or made here
    if not (finished / 'done.json').exists():
        assert run(*train_args(prepared, finished)).returncode == 0
    kept = tmp_path / 'kept'
    kept.mkdir()
    for name in ('log.jsonl', 'config.json'):
        (kept / name).write_bytes((finished / name).read_bytes())
    before = (kept / 'log.jsonl').read_bytes()
    out = run(*train_args(prepared, kept))
    assert out.returncode != 0 and '--resume=True' in out.stderr, out.stderr
    assert (kept / 'log.jsonl').read_bytes() == before


def test_resume_with_nothing_to_resume_starts_from_zero(prepared):
    out_dir = prepared / 'fresh_resume'
    out = run(*train_args(prepared, out_dir, '--max_iters=10'), '--resume=True')
    assert out.returncode == 0 and 'nothing to resume' in out.stdout
    assert json.load(open(out_dir / 'done.json'))['iters'] == 10


def test_a_failing_checkpoint_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / 'latest.pt')
    runs.save(path, {'iter': 1, 'w': torch.ones(3)})
    real_save = torch.save

    # the disk fills up (or the process dies) in the middle of the write
    def save_half_then_fail(obj, f):
        real_save(obj, f)
        f.truncate(f.tell() // 2)
        raise OSError(28, 'No space left on device')

    monkeypatch.setattr(torch, 'save', save_half_then_fail)
    with pytest.raises(OSError):
        runs.save(path, {'iter': 2, 'w': torch.zeros(3)})
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ['latest.pt']  # no temp file left behind
    ckpt = torch.load(path, weights_only=True)
    assert ckpt['iter'] == 1 and torch.equal(ckpt['w'], torch.ones(3))


def test_a_nan_loss_stops_the_run_naming_the_iteration(prepared, monkeypatch):
    """The loss turns NaN at iter 16 (step 15): the run stops at the next log line, names iter 16,
    and the checkpoints keep their pre-NaN state (latest.pt from iter 10)."""
    out_dir = prepared / 'nan'
    real_loss, steps = train.training_loss, []

    def loss_that_breaks(ce, aux, c):
        steps.append(1)
        return real_loss(ce, aux, c) * (float('nan') if len(steps) == 16 else 1.0)

    monkeypatch.setattr(train, 'training_loss', loss_that_breaks)
    with pytest.raises(UserError) as stop:
        train.main(train_args(prepared, out_dir)[1:])
    message = str(stop.value)
    assert 'not finite' in message and 'iter 16' in message and 'iter 10' in message
    ckpt = torch.load(out_dir / 'latest.pt', weights_only=True)
    assert ckpt['iter'] == 10 and all(v.isfinite().all() for v in ckpt['model'].values())
    assert not (out_dir / 'done.json').exists()
    assert max(json.loads(line)['iter'] for line in open(out_dir / 'log.jsonl')) == 10


def ddp_args(prepared):
    """4 micro-batches per step: two for each of 2 processes, so the no_sync() branch runs."""
    return ['config/cpu_moe.py', f'--data_dir={prepared / "data"}', *TINY, '--max_iters=6',
            '--log_interval=2', '--ckpt_interval=2', '--eval_interval=6', '--batch_size=4',
            '--grad_accum=4']


@pytest.fixture(scope='module')
def one_process(prepared):
    """The DDP runs' reference: 1 process doing all four micro-batches of each step, eager."""
    out = run('train.py', *ddp_args(prepared), f'--out_dir={prepared / "ddp1"}')
    assert out.returncode == 0, out.stderr
    return prepared / 'ddp1'


@pytest.mark.parametrize('compiled', [False, True], ids=['eager', 'compiled'])
def test_ddp_with_two_gloo_processes_equals_one_process(prepared, one_process, compiled):
    """torchrun, 2 CPU processes (gloo), eager and compiled as a GPU trains, against 1 eager
    process: the same windows, the same losses and the same final weights and AdamW moments.
    Compiled code sums in another order: after 6 steps a weight of ~0.1 differs by up to 1e-5
    (seen on an AMD EPYC), where a wrong gradient average moves it by a step, ~1e-2."""
    ddp = prepared / f'ddp2_compiled_{compiled}'
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    two = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone',
                          '--nproc_per_node=2', 'train.py', *ddp_args(prepared),
                          f'--compile={compiled}', f'--out_dir={ddp}'],
                         cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    used = json.load(open(ddp / 'config.json'))
    assert (used['world_size'], used['compile_used']) == (2, compiled)
    runs = [one_process, ddp]
    logs = [read_log(d) for d in runs]
    assert [r['iter'] for r in logs[0]] == [r['iter'] for r in logs[1]]
    # (a training line's routing statistics are of its last micro-batch(es): not compared)
    for a, b in zip(*logs):
        for key in (('val_loss', 'busiest_frac', 'router_entropy') if 'val_loss' in a
                    else ('loss', 'ce', 'lb', 'z')):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), (a['iter'], key)
    ckpts = [torch.load(d / 'latest.pt', weights_only=True) for d in runs]
    assert ckpts[0]['iter'] == ckpts[1]['iter'] == 6
    for name, w in ckpts[0]['model'].items():
        torch.testing.assert_close(ckpts[1]['model'][name], w, rtol=1e-4, atol=1e-5, msg=name)
    for i, state in ckpts[0]['optimizer']['state'].items():
        for key in ('exp_avg', 'exp_avg_sq'):
            torch.testing.assert_close(ckpts[1]['optimizer']['state'][i][key], state[key],
                                       rtol=1e-3, atol=1e-9)


# train.py, each process writing the MoE biases after every update_bias to $BIAS_LOG<rank>
BIAS_LOG = f"""import json, os, sys
sys.path.insert(0, {REPO!r})
import train
real, seen = train.MoE.update_bias, []
def update_bias(self, counts):
    real(self, counts)
    seen.append(self.bias.tolist())
train.MoE.update_bias = update_bias
train.main(sys.argv[1:])
json.dump(seen, open(os.environ['BIAS_LOG'] + os.environ.get('RANK', '0'), 'w'))
"""


def test_bias_balancing_moves_every_process_by_the_whole_steps_load(prepared, tmp_path):
    """Bias balancing under DDP: 2 gloo processes, one micro-batch each, move their biases by the
    load of the step's two micro-batches together, as 1 process with both does. After every step
    each process's bias is the other's and the one process's, and the losses are its losses."""
    script = tmp_path / 'bias_log.py'
    script.write_text(BIAS_LOG)
    args = ['config/cpu_moe.py', f'--data_dir={prepared / "data"}', *TINY, '--max_iters=6',
            '--log_interval=2', '--ckpt_interval=2', '--eval_interval=6', '--batch_size=4',
            '--grad_accum=2', '--bias_rate=0.01']
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'BIAS_LOG': str(tmp_path / 'one')}
    one = subprocess.run([sys.executable, str(script), *args, f'--out_dir={tmp_path / "one"}'],
                         cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert one.returncode == 0, one.stderr[-3000:]
    env['BIAS_LOG'] = str(tmp_path / 'two')
    two = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone',
                          '--nproc_per_node=2', str(script), *args,
                          f'--out_dir={tmp_path / "two"}'],
                         cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    seen = {name: json.load(open(tmp_path / name)) for name in ('one0', 'two0', 'two1')}
    assert len(seen['one0']) == 6 * 2  # 6 steps, 2 MoE layers
    assert seen['two0'] == seen['two1'] == seen['one0']
    assert any(v != 0 for layer in seen['one0'] for v in layer)  # the biases moved
    for a, b in zip(read_log(tmp_path / 'one'), read_log(tmp_path / 'two')):
        for key in ('loss', 'val_loss'):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4), (a['iter'], key)


def test_grad_accum_must_split_over_the_processes(prepared):
    env = {**os.environ, 'WORLD_SIZE': '2', 'RANK': '0'}
    out = subprocess.run([sys.executable, 'train.py', 'config/cpu_moe.py',
                          f'--data_dir={prepared / "data"}', *TINY,
                          f'--out_dir={prepared / "odd"}'],
                         cwd=REPO, capture_output=True, text=True, env=env)
    assert (out.returncode != 0 and 'grad_accum (1) must be a multiple' in out.stderr
            and 'Traceback' not in out.stderr)


# ----------------------------------------------------------------------------- bad data
def broken_copy(prepared, tmp_path, damage):
    data = tmp_path / 'data'
    shutil.copytree(prepared / 'data', data)
    damage(data)
    return data


def truncate_odd(data):
    with open(data / 'train.bin', 'r+b') as f:
        f.truncate(os.path.getsize(data / 'train.bin') - 1)


def id_out_of_vocab(data):
    tokens = np.fromfile(data / 'val.bin', dtype=np.uint16)
    tokens[5] = 300  # the bytes vocabulary has 257 ids
    tokens.tofile(data / 'val.bin')


def bigger_vocab(data):
    meta = json.load(open(data / 'meta.json'))
    json.dump({**meta, 'vocab_size': 50257}, open(data / 'meta.json', 'w'))


def corrupt_meta(data):
    (data / 'meta.json').write_text('{"vocab_size": 25')


@pytest.mark.parametrize('damage, message', [(truncate_odd, 'truncated or corrupt'),
                                             (id_out_of_vocab, 'token id 300'),
                                             (bigger_vocab, 'vocab_size 50257'),
                                             (corrupt_meta, 'meta.json is corrupt')])
def test_damaged_data_is_one_clear_error(prepared, tmp_path, damage, message):
    data = broken_copy(prepared, tmp_path, damage)
    out = run('train.py', 'config/cpu_moe.py', f'--data_dir={data}', f'--out_dir={tmp_path / "o"}',
              *TINY)
    assert out.returncode != 0 and message in out.stderr, out.stderr
    assert out.stderr.count('\n') == 1 and not (tmp_path / 'o').exists()
    assert 'prepare.py' in out.stderr or damage is bigger_vocab  # names the fix


def test_sample_refuses_a_checkpoint_whose_weights_do_not_fit_its_config(prepared, tmp_path):
    out_dir = prepared / 'straight'
    if not (out_dir / 'done.json').exists():
        assert run(*train_args(prepared, out_dir)).returncode == 0
    ckpt = torch.load(out_dir / 'best.pt', weights_only=True)
    # e.g. a checkpoint edited, or made by another version of the code
    ckpt['config']['d_model'] = 64
    torch.save(ckpt, tmp_path / 'best.pt')
    out = run('sample.py', f'--out_dir={tmp_path}', '--max_new_tokens=5')
    assert out.returncode != 0 and 'not a usable tinymoe checkpoint' in out.stderr
    assert out.stderr.count('\n') == 1


# ----------------------------------------------------------------------- checkpoints someone shared
class OpensAFile:
    """What a malicious pickle can do: unpickling calls open(path, 'w')."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, 'w')


class RunsAShellCommand(OpensAFile):
    def __reduce__(self):  # os.system, which torch's safe loader blocks by module
        return os.system, (f'touch {self.path}',)


@pytest.fixture(scope='module')
def tiny_run(prepared):
    """A finished tiny cpu_moe run, with best.pt and latest.pt as train.py writes them."""
    out = run('train.py', 'config/cpu_moe.py', f'--data_dir={prepared / "data"}',
              f'--out_dir={prepared / "tiny"}', *TINY, '--max_iters=10', '--ckpt_interval=10')
    assert out.returncode == 0, out.stderr
    return prepared / 'tiny'


REFUSED = ('is not a plain checkpoint (damaged, or it holds more than tensors and plain data): '
           'refusing to unpickle arbitrary objects')


def test_a_checkpoint_that_would_run_code_is_refused_by_every_entry_point(prepared, tiny_run,
                                                                          tmp_path):
    """best.pt and latest.pt of a real run, with an object whose unpickling would create a file:
    sample.py, export_hf.py and a resume each refuse in one line, create nothing, change nothing."""
    run_dir, planted = tmp_path / 'shared-run', tmp_path / 'planted.txt'
    shutil.copytree(tiny_run, run_dir)
    for name in ('best.pt', 'latest.pt'):
        ckpt = torch.load(run_dir / name, weights_only=True)
        torch.save({**ckpt, 'meta': {**ckpt['meta'], 'note': OpensAFile(str(planted))}},
                   run_dir / name)
    before = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()}
    for args in (['sample.py', f'--out_dir={run_dir}'],
                 ['export_hf.py', '--out_dir', str(run_dir), '--to', str(tmp_path / 'hf')],
                 ['train.py', 'config/cpu_moe.py', f'--data_dir={prepared / "data"}',
                  f'--out_dir={run_dir}', *TINY, '--max_iters=10', '--ckpt_interval=10',
                  '--resume=True']):
        out = run(*args)
        assert out.returncode != 0 and out.stderr.count('\n') == 1, (args[0], out.stderr)
        assert out.stderr.endswith(REFUSED + '\n'), out.stderr
        assert not planted.exists(), args[0]
        assert ({p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()} == before
                and not (tmp_path / 'hf').exists())
    # the control: the unsafe loader does run the pickle's code
    torch.load(run_dir / 'best.pt', weights_only=False)
    assert planted.exists()


@pytest.mark.parametrize('payload, protocol', [(RunsAShellCommand, 2), (OpensAFile, 4), (None, 2)])
def test_the_safe_loader_refuses_blocked_modules_newer_pickles_and_damaged_files(tmp_path,
                                                                                 payload, protocol):
    """The loader all three entry points share, on what the test above does not try: os.system
    (which torch's message words differently), pickle protocol 4 (which makes torch warn) and a
    damaged file: one line each."""
    path, planted = tmp_path / 'best.pt', tmp_path / 'planted.txt'
    if payload:
        torch.save({'model': {'w': torch.ones(2)}, 'note': payload(str(planted))}, path,
                   pickle_protocol=protocol)
    else:
        path.write_bytes(b'not a checkpoint')
    with pytest.raises(UserError) as refused:
        runs.load_checkpoint(str(path))
    assert str(refused.value) == f'{path} {REFUSED}' and not planted.exists()


def test_checkpoints_written_by_train_load_with_the_safe_loader(tiny_run):
    """Everything a checkpoint holds (weights, AdamW state, fp16 loss scale, config, meta, RNG)
    is plain data for weights_only."""
    for name in ('best.pt', 'latest.pt'):
        ckpt = runs.load_checkpoint(str(tiny_run / name))
        assert set(ckpt) == {'model', 'optimizer', 'scaler', 'config', 'meta', 'iter', 'tokens',
                             'best_val', 'rng'}
        assert ckpt['rng']['torch'].dtype == torch.uint8 and ckpt['optimizer']['state']
        assert ckpt['config']['ffn'] == 'moe'
    assert runs.load_checkpoint(str(tiny_run / 'latest.pt'))['iter'] == 10


def test_a_process_with_no_validation_batch_still_reduces_full_shaped_sums(prepared, monkeypatch):
    """Under DDP with more processes than validation batches, a process evaluates nothing: its
    sums must still have the shapes the others all-reduce (a 0-d routing sum would abort gloo)."""
    from contextlib import nullcontext
    c = config(data_dir=str(prepared / 'data'), eval_tokens=16 * 4)
    model = train.Transformer(c)
    _, windows = train.load_data(c)
    reduced = []
    monkeypatch.setattr(train.dist, 'all_reduce', lambda t: reduced.append(t.shape))
    # 4 windows in one batch: process 1 of 2 gets none
    loss, routing = train.evaluate(model, windows, c, torch.device('cpu'), nullcontext(),
                                   rank=1, world=2)
    assert reduced == [torch.Size([]), torch.Size([c.n_layer, c.n_experts + 2])]
    assert loss == 0.0 and routing['busiest_frac'] == 0.0


def test_a_damaged_checkpoint_is_one_line_in_sample_and_export(tiny_run, tmp_path):
    """A best.pt cut short (a full disk, a partial copy): one line naming it, no traceback."""
    run_dir = tmp_path / 'damaged'
    shutil.copytree(tiny_run, run_dir)
    data = (run_dir / 'best.pt').read_bytes()
    (run_dir / 'best.pt').write_bytes(data[:len(data) // 2])
    for args in (['sample.py', f'--out_dir={run_dir}'],
                 ['export_hf.py', '--out_dir', str(run_dir), '--to', str(tmp_path / 'hf')]):
        out = run(*args)
        assert out.returncode == 1 and out.stderr.count('\n') == 1, out.stderr
        assert out.stderr.endswith(REFUSED + '\n') and 'Traceback' not in out.stderr


@pytest.mark.parametrize('vocab_size, hint', [
    (257, 'python prepare.py --out_dir D --hf_stories 5510 --tokenizer bytes (or --input FILE '
          '--tokenizer bytes for'),
    (50257, 'python prepare.py --out_dir D (or --input FILE for')])
def test_missing_data_names_the_prepare_command_of_the_configs_tokenizer(tmp_path, vocab_size,
                                                                         hint):
    with pytest.raises(UserError) as e:
        train.check_prepared(config(data_dir=str(tmp_path / 'D'), vocab_size=vocab_size))
    assert hint.replace(' D', f' {tmp_path / "D"}') in str(e.value)


@pytest.mark.parametrize('iters, says', [(10**6, True), (2000, False), (10, False)])
def test_a_config_beyond_a_cpu_says_how_long_it_would_take(monkeypatch, capsys, iters, says):
    """At 1 s for the probe's second forward of two windows of 16 tokens (the first, slow one is
    not timed), and 3 times that for a training step, 32 / 3 tok/s: 10^6 steps of 4 x 16 tokens are
    6 x 10^6 s, 1,667 hours; 2,000 steps are 3.3 hours, under the 10 that a GPU config's hundreds
    pass, and nothing is said."""
    c = config(batch_size=4)
    model = train.Transformer(c)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    clock = iter([100.0, 101.0])
    events = []

    def read_clock():
        events.append('clock')
        return next(clock)
    monkeypatch.setattr(runs.time, 'time', read_clock)
    windows = torch.zeros(4, c.block_size + 1, dtype=torch.long)

    def noisy_model(x, y):  # a model whose forward draws random numbers, as a noisy router would
        events.append('forward')
        torch.rand(1)
        return model(x, y)
    runs.warn_if_beyond_a_cpu(noisy_model, c, (windows[:, :-1], windows[:, 1:]), iters)
    assert events == ['forward', 'clock', 'forward', 'clock']
    expected = ('  a config made for a GPU: at 11 tok/s, as its first windows train on this CPU, '
                'its 1,000,000 steps would take about 1,667 hours. On a CPU, train the CPU recipe '
                'instead: make cpu, or config/cpu_moe.py\n')
    assert capsys.readouterr().out == (expected if says else '')
    # no step taken, no gradient left behind, the same random state: the run goes on as it would
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
