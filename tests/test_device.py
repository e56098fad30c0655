"""The GPU a learner has, checked on a CPU: which device and precision `auto` picks (with the
availability of CUDA, bf16 and MPS monkeypatched), fp16 training with a GradScaler, where compile is
turned off and why, and the MFU on the training line."""
import contextlib
import json

import pytest
import torch

import hardware
import runs
import train
from conftest import TINY, config, interrupt_training, run
from errors import UserError


@pytest.mark.parametrize('cuda, capability, mps, device, dtype', [
    (True, (9, 0), False, 'cuda', 'bfloat16'),   # an H100
    (True, (8, 0), False, 'cuda', 'bfloat16'),   # an A100
    (True, (7, 5), False, 'cuda', 'float16'),    # a T4 (a V100 is 7.0): fp16 with a GradScaler
    (False, None, True, 'mps', 'float32'),       # a Mac
    (False, None, False, 'cpu', 'float32')])
def test_auto_picks_cuda_then_mps_then_the_cpu_and_bf16_only_where_supported(
        monkeypatch, cuda, capability, mps, device, dtype):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: cuda)
    # bf16 tensor cores from compute capability 8 (torch's is_bf16_supported also counts emulation)
    monkeypatch.setattr(torch.cuda, 'get_device_capability', lambda device: capability)
    monkeypatch.setattr(torch.backends.mps, 'is_available', lambda: mps)
    c = config()
    picked = train.pick_device(c)
    assert picked.type == device and train.pick_dtype(c, picked) == dtype
    # the dtype key overrides
    assert train.pick_dtype(config(dtype='float16'), picked) == 'float16'


def test_compile_is_turned_off_where_it_cannot_work_with_one_line_saying_why(monkeypatch, capsys):
    assert 'MPS' in train.compile_problem(torch.device('mps'))
    assert train.compile_problem(torch.device('cpu')) is None
    real_find_spec = train.importlib.util.find_spec
    monkeypatch.setattr(train.importlib.util, 'find_spec',
                        lambda name: None if name == 'triton' else real_find_spec(name))
    assert 'Triton' in train.compile_problem(torch.device('cuda'))
    # asked for on a Mac: off, with the reason
    monkeypatch.setattr(train, 'pick_device', lambda c: torch.device('mps'))
    _, use_compile, autocast, scaler = train.setup_device(config(compile=True))
    assert use_compile is False and not scaler.is_enabled()
    assert isinstance(autocast, contextlib.nullcontext)
    assert capsys.readouterr().out == (
        "compile is off: torch.compile does not support Apple's MPS well enough to train\n")


def fp16_step(model, opt, autocast, scaler, c, idx, break_grad=False):
    """One training step as train.py takes it in fp16; break_grad puts an inf in a gradient."""
    with autocast:
        _, ce, aux = model(idx[:, :-1], idx[:, 1:])
        loss = train.training_loss(ce, aux, c)
    scaler.scale(loss).backward()
    if break_grad:
        model.embed.weight.grad[0, 0] = float('inf')
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return loss


def test_fp16_steps_with_a_grad_scaler_and_skips_a_step_with_an_inf_gradient():
    c = config(dtype='float16', device='cpu')
    _, _, autocast, scaler = train.setup_device(c)
    assert scaler.is_enabled() and scaler.get_scale() == 2.0 ** 16
    torch.manual_seed(0)
    model = train.Transformer(c)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, c.vocab_size, (4, c.block_size + 1))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    loss = fp16_step(model, opt, autocast, scaler, c, idx)
    assert loss.isfinite()
    stepped = {k: v.clone() for k, v in model.state_dict().items()}
    assert not torch.equal(stepped['embed.weight'], start['embed.weight'])
    # an inf in a gradient: no weight moves and the loss scale halves
    fp16_step(model, opt, autocast, scaler, c, idx, break_grad=True)
    assert all(torch.equal(v, stepped[k]) for k, v in model.state_dict().items())
    assert scaler.get_scale() == 2.0 ** 15


def test_train_runs_in_fp16_and_resumes_its_loss_scale(prepared, tmp_path, monkeypatch):
    """train.py end to end with --dtype=float16 on the CPU: it learns; and a run interrupted at
    step 15 and resumed from latest.pt (step 10) ends with the same weights and the same scaler
    state (scale and steps since it last grew) as one never interrupted."""
    args = ['config/cpu_moe.py', f'--data_dir={prepared / "data"}', *TINY, "--dtype='float16'",
            '--ckpt_interval=10']
    out = run('train.py', *args, f'--out_dir={tmp_path / "fp16"}')
    assert out.returncode == 0, out.stderr
    interrupt_training(monkeypatch, args + [f'--out_dir={tmp_path / "resumed"}'], at_call=15)
    train.main(args + [f'--out_dir={tmp_path / "resumed"}', '--resume=True'])
    straight, resumed = (runs.load_checkpoint(str(tmp_path / d / 'latest.pt'))
                         for d in ('fp16', 'resumed'))
    assert straight['scaler'] == resumed['scaler'] and straight['scaler']['_growth_tracker'] == 40
    assert all(torch.equal(v, resumed['model'][k]) for k, v in straight['model'].items())
    evals = [json.loads(line)['val_loss'] for line in open(tmp_path / 'fp16' / 'log.jsonl')
             if 'val_loss' in line]
    assert evals[-1] < 0.6 * evals[0]
    ckpt = runs.load_checkpoint(str(tmp_path / 'fp16' / 'latest.pt'))
    assert ckpt['scaler']['scale'] > 0 and ckpt['config']['dtype'] == 'float16'


@pytest.mark.skipif(torch.backends.mps.is_available(), reason='this machine has an Apple GPU')
def test_asking_for_mps_without_it_is_one_line_naming_the_fix():
    fix = "device='mps' but torch sees no Apple GPU; use --device=cpu"
    with pytest.raises(UserError, match=fix):
        config(device='mps')


# the names torch.cuda.get_device_name reports (as nvidia-smi does) and each one's dense bf16 peak
# (fp16 on the T4); a name that holds another one (A10G, H100 PCIe) gets its own
@pytest.mark.parametrize('name, peak', [
    ('NVIDIA A10', 125e12), ('NVIDIA A10G', 70e12), ('NVIDIA A100-SXM4-40GB', 312e12),
    ('NVIDIA A100 80GB PCIe', 312e12), ('NVIDIA H100 80GB HBM3', 989e12),
    ('NVIDIA H100 PCIe', 756e12), ('NVIDIA H200', 989e12), ('NVIDIA L4', 121e12),
    ('NVIDIA L40S', 362e12), ('Tesla T4', 65e12), ('Some Other GPU', None),
    ('NVIDIA GeForce RTX 4090', None)])
def test_peak_flops_by_gpu_name(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda device: name)
    assert hardware.peak_flops(torch.device('cuda')) == peak
    assert hardware.peak_flops(torch.device('cpu')) is None


def test_the_logged_mfu_is_throughput_times_flops_over_the_peak(prepared, tmp_path, monkeypatch):
    """A CPU given a made-up peak of 1 GFLOP/s: every training line's mfu is its tokens/s times
    the FLOPs a token over that peak."""
    monkeypatch.setattr(hardware, 'peak_flops', lambda device: 1e9)
    args = ['config/cpu_moe.py', f'--data_dir={prepared / "data"}', *TINY,
            f'--out_dir={tmp_path / "mfu"}']
    train.main(args)
    flops_per_token = train.flops_per_token(train.configure(args))
    lines = [json.loads(line) for line in open(tmp_path / 'mfu' / 'log.jsonl')]
    train_lines = [r for r in lines if 'tok_per_s' in r]
    assert len(train_lines) == 4
    for r in train_lines:
        assert r['mfu'] == r['tok_per_s'] * flops_per_token / 1e9


def test_the_training_line_shows_mfu_where_it_is_known_and_the_time_left(tmp_path, capsys,
                                                                         monkeypatch):
    """2M tok/s at 156,250 FLOPs a token on a made-up 1 TFLOP/s peak: an MFU of 31.25%. 10 of 100
    steps done in 60 s: 540 s left."""
    facts = {'device_used': 'cpu', 'flops_per_token': 156_250, 'world_size': 1}
    clock = iter([100.0, 160.0, 100.0, 160.0])
    monkeypatch.setattr(runs.time, 'time', lambda: next(clock))
    lines = []
    for peak in (1e12, None):
        monkeypatch.setattr(hardware, 'peak_flops', lambda device: peak)
        log = runs.RunLog(config(out_dir=str(tmp_path)), None, facts)
        record = {'iter': 10, 'loss': 2.0, 'ce': 2.0, 'lr': 1e-3, 'tok_per_s': 2e6}
        log.train(record, ('loss', 'ce'), 100)
        log.close()
        lines.append((record, capsys.readouterr().out))
    (with_peak, with_mfu), (without_peak, without) = lines
    assert with_peak['mfu'] == 0.3125 and '2000.0k tok/s | mfu 31.2% | eta 0:09:00' in with_mfu
    assert 'mfu' not in without_peak and 'mfu' not in without
