"""The path a GPU trains on, run on every machine: on the CPU, where train.GROUPED_MM_ON_CPU forces
the F.grouped_mm path (the CPU trains with the loop over experts, which is faster there), and on a
CUDA GPU (marked `gpu`, skipped without one: `python -m pytest -m gpu tests` runs the CUDA kernels'
own numbers there). At the paper's widths: grouped_mm against the loop over experts, compiled
against eager, bf16 autocast against fp32. At toy widths: train.py as it trains on a GPU (bf16
autocast, torch.compile, grouped_mm, fused AdamW, the MFU line), stopped and resumed, then
sample.py and export_hf.py on the run.

Tolerances. bf16 keeps 8 significant bits, a relative step of 2^-8 = 0.39%. Two bf16 computations
that accumulate in fp32 but round inputs and outputs differently (grouped_mm against the loop,
inductor's kernels against eager) may differ by a few of those steps in an element: rtol 1.6e-2
(torch's own bf16 default), with atol at 1% of the largest element for values near 0. fp32 keeps
24 bits, a step of 6e-8; summed in another order (compiled code fuses and splits sums), a sum of
thousands of terms moves by about 1e-6 of its size: rtol 1e-4 and atol 1e-5 of the largest element
leave a margin of 100, while a wrong gate weight or a dropped expert moves gradients by whole
percents. The loss is a mean over thousands of tokens of CE computed in fp32 from bf16 logits: its
rounding errors average out, so bf16 against fp32 must agree to 1% of the loss."""
import contextlib
import io
import json
import types

import pytest
import torch

import hardware
import runs
import train
from conftest import TINY, interrupt_training, run

# each test runs on the CPU and, marked gpu, on a CUDA GPU
DEVICES = ['cpu', pytest.param('cuda', marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')])]
# the paper's widths; 8 windows of 512 tokens (a sixteenth of a step) keep the CPU to seconds
SEQUENCES = 8
TOKENS = SEQUENCES * 512


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch):
    """'cpu' (the grouped_mm path forced) or 'cuda'."""
    monkeypatch.setattr(train, 'GROUPED_MM_ON_CPU', True)
    return request.param


def close(a, b, dtype):
    """Within the rounding of dtype (the module docstring says why these tolerances)."""
    rtol, atol = (1.6e-2, 1e-2) if dtype == torch.bfloat16 else (1e-4, 1e-5)
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol * b.abs().max().item())


def paper_model(device, ffn='moe', *overrides):
    c = train.configure([f'config/{ffn}.py', f'--device={device}', *overrides])
    torch.manual_seed(0)
    return c, train.Transformer(c).to(device)


def paper_moe_and_routing(device):
    """The paper model's first MoE layer, TOKENS random inputs and their routing (a gate weight and
    an expert per assignment)."""
    c, model = paper_model(device)
    moe = model.blocks[0].ffn
    x = torch.randn(TOKENS, c.d_model, device=device)
    _, _, weights, experts = moe.route(x)
    return moe, x, weights.detach(), experts


def dispatch_and_grads(moe, x, weights, experts, dtype, dispatch=None):
    """moe.dispatch (or `dispatch`, a compiled one) with the routing given, in dtype (bf16: under
    autocast) -> its output, the rows per expert and the gradients of the input, the gate weights
    and the experts' three matrices."""
    moe.zero_grad()
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        y, counts = (dispatch or moe.dispatch)(x, weights, experts)
    # a real loss: grouped_mm's backward refuses the expanded gradient of y.sum() ("Invalid
    # strides/sizes")
    y.float().square().mean().backward()
    grads = {name: getattr(moe, name).grad.clone() for name in ('gate', 'up', 'down')}
    return {'y': y, 'counts': counts, 'x': x.grad, 'weights': weights.grad, **grads}


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
def test_grouped_mm_equals_the_loop_over_experts_at_the_papers_widths(device, dtype, monkeypatch):
    """train.py takes grouped_mm in bf16 only (compiled, it wants bf16). In fp32, on the CPU, it
    must match the loop below bf16's rounding too: no row may go to another expert's matrices."""
    if device == 'cuda' and dtype == torch.float32:
        pytest.skip('grouped_mm in fp32 is checked on the CPU only')
    moe, x, weights, experts = paper_moe_and_routing(device)
    monkeypatch.setattr(train, 'grouped_mm_ok', lambda xs, hidden: True)
    grouped = dispatch_and_grads(moe, x, weights, experts, dtype)
    monkeypatch.setattr(train, 'grouped_mm_ok', lambda xs, hidden: False)
    loop = dispatch_and_grads(moe, x, weights, experts, dtype)
    assert torch.equal(grouped.pop('counts'), loop.pop('counts'))
    for name, value in loop.items():
        assert value.abs().max() > 0, name
        close(grouped[name], value, dtype)


def training_loss(model, c, idx, autocast=True):
    with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=autocast):
        _, ce, aux = model(idx[:, :-1], idx[:, 1:])
        return train.training_loss(ce, aux, c), aux


@pytest.fixture
def full_precision_matmuls():
    """fp32 matmuls in full fp32 for one test, as they were after it: TF32 keeps 10 bits."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision('highest')
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize('ffn', ['moe', 'dense_active'])
def test_compiled_equals_eager_in_fp32(device, ffn, full_precision_matmuls):
    """A training step's loss and every gradient, compiled against eager. In fp32, because in bf16
    they cannot be compared element by element: compiled and eager code round differently, a few
    tokens near a tie between two experts go to the other one, and the gradients those tokens feed
    move by whole percents of their largest element. In fp32 the routing stays the same (checked:
    the tokens per expert). One layer of the paper's widths: the layers are alike, and one
    compiles sooner than four."""
    c, model = paper_model(device, ffn, '--n_layer=1')
    idx = torch.randint(0, c.vocab_size, (SEQUENCES, c.block_size + 1), device=device)
    steps = []
    for m in (model, torch.compile(model)):
        model.zero_grad()
        loss, aux = training_loss(m, c, idx, autocast=False)
        loss.backward()
        load = train.unpack_routing(aux['routing'])[0] if aux else None
        steps.append((loss.detach(), load, [p.grad.clone() for p in model.parameters()]))
    (eager_loss, eager_load, eager_grads), (compiled_loss, compiled_load, compiled_grads) = steps
    if ffn == 'moe':
        assert torch.equal(compiled_load, eager_load)
    close(compiled_loss, eager_loss, torch.float32)
    for (name, _), compiled_grad, grad in zip(model.named_parameters(), compiled_grads,
                                              eager_grads):
        assert grad.abs().max() > 0, name
        close(compiled_grad, grad, torch.float32)


def test_compiled_moe_equals_eager_in_bf16_with_the_routing_given(device):
    """The MoE layer as a GPU trains it, grouped_mm in bf16 under autocast, compiled against
    eager. The routing is given to both, so every token goes to the same experts and the outputs
    and all gradients must agree within bf16 rounding."""
    moe, x, weights, experts = paper_moe_and_routing(device)
    eager = dispatch_and_grads(moe, x, weights, experts, torch.bfloat16)
    compiled = dispatch_and_grads(moe, x, weights, experts, torch.bfloat16,
                                  torch.compile(moe.dispatch))
    assert torch.equal(compiled.pop('counts'), eager.pop('counts'))
    for name, value in eager.items():
        close(compiled[name], value, torch.bfloat16)


@pytest.mark.parametrize('ffn', ['moe', 'dense_total'])
def test_bf16_autocast_loss_is_the_fp32_loss_within_1_percent(device, ffn):
    c, model = paper_model(device, ffn)
    idx = torch.randint(0, c.vocab_size, (SEQUENCES, c.block_size + 1), device=device)
    with torch.no_grad():
        bf16, _ = training_loss(model, c, idx)
        fp32, _ = training_loss(model, c, idx, autocast=False)
    assert abs(bf16.item() - fp32.item()) <= 1e-2 * fp32.item()


# ----------------------------------------------------------------------------- train.py end to end
def fused_adamw(asked):
    """torch.optim.AdamW as train.py builds it on a GPU, fused, whatever the device; `asked` gets
    the fused= train.py passed (True on CUDA only)."""
    adamw = torch.optim.AdamW

    def build(params, **kwargs):
        asked.append(kwargs['fused'])
        return adamw(params, **{**kwargs, 'fused': True})
    return build


@pytest.fixture(scope='module', params=DEVICES)
def gpu_route(request, prepared):
    """train.py at toy widths (multiples of 8, as grouped_mm wants) the way a GPU trains: bf16
    autocast, compiled, grouped_mm, fused AdamW and, with a made-up peak, the MFU line. One run
    straight through 8 steps; one stopped in step 6, after latest.pt at step 4, and resumed."""
    device = request.param
    folder = prepared / f'gpu_route_{device}'
    args = ['config/cpu_moe.py', f'--data_dir={prepared / "data"}', *TINY, '--max_iters=8',
            '--eval_interval=4', '--log_interval=2', '--ckpt_interval=4', f"--device='{device}'",
            "--dtype='bfloat16'", '--compile=True']
    r = types.SimpleNamespace(device=device, straight=folder / 'straight',
                              resumed=folder / 'resumed', fused_asked=[])
    console = io.StringIO()
    # one thread, as the CPU study trains: in a whole `make test` with two threads, the resumed
    # run's z-loss once differed from the straight run's by 1.6e-5 at step 6
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(console):
        mp.setattr(train, 'GROUPED_MM_ON_CPU', device == 'cpu')
        mp.setattr(torch.optim, 'AdamW', fused_adamw(r.fused_asked))
        mp.setattr(hardware, 'peak_flops', lambda device: 1e12)
        # each run compiles as a process of its own would: dynamo forgets the shapes it saw (the
        # runs then get the same compiled code, which inductor's cache hands out)
        torch._dynamo.reset()
        train.main(args + [f'--out_dir={r.straight}'])
        torch._dynamo.reset()
        interrupt_training(mp, args + [f'--out_dir={r.resumed}'], at_call=6)
        torch._dynamo.reset()
        train.main(args + [f'--out_dir={r.resumed}', '--resume=True'])
        c = train.configure(args)
        # the rows the MoE layers ran: bf16, under autocast
        rows = torch.zeros(1, c.d_model, dtype=torch.bfloat16, device=device)
        r.grouped_mm = train.grouped_mm_ok(rows, c.moe_hidden)
    torch.set_num_threads(threads)
    r.console = console.getvalue()
    return r


def records(run_dir):
    return [json.loads(line) for line in open(run_dir / 'log.jsonl')]


def test_train_py_trains_as_on_a_gpu(gpu_route):
    r = gpu_route
    used = json.load(open(r.straight / 'config.json'))
    assert (used['device_used'], used['dtype_used'], used['compile_used']) == (
        r.device, 'bfloat16', True)
    # train.py fuses AdamW on CUDA by itself; on the CPU the test does
    assert r.fused_asked == [r.device == 'cuda'] * 3
    assert r.grouped_mm  # the experts ran as grouped_mm
    train_lines = [x for x in records(r.straight) if 'loss' in x]
    assert [x['iter'] for x in train_lines] == [2, 4, 6, 8]
    assert all(x['mfu'] > 0 for x in train_lines)
    # the straight run's 4 lines, the stopped run's 2 and the resumed run's 2
    printed = [line for line in r.console.splitlines() if line.startswith('iter ')]
    assert len(printed) == 8 and all(' | mfu ' in line for line in printed)
    assert train_lines[-1]['loss'] < train_lines[0]['loss'] - 0.3


def test_a_stopped_run_resumes_and_ends_as_the_straight_run(gpu_route):
    """The same lines (losses, evaluations) and the same weights at the end: the checkpoint holds
    the fused AdamW's moments and, on CUDA, its random state."""
    r = gpu_route
    assert 'resumed at iter 4' in r.console
    straight, resumed = records(r.straight), records(r.resumed)
    assert [x['iter'] for x in resumed] == [x['iter'] for x in straight] == [0, 2, 4, 4, 6, 8, 8]
    for a, b in zip(straight, resumed):
        assert a.keys() == b.keys(), a['iter']  # training and eval lines have their own keys
        for key in ('loss', 'ce', 'lb', 'z', 'val_loss', 'busiest_frac'):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5), (a['iter'], key)
    ckpts = [runs.load_checkpoint(str(d / 'latest.pt')) for d in (r.straight, r.resumed)]
    assert ckpts[0]['iter'] == ckpts[1]['iter'] == 8
    assert (ckpts[1]['rng']['cuda'] is not None) == (r.device == 'cuda')
    for name, w in ckpts[0]['model'].items():
        torch.testing.assert_close(ckpts[1]['model'][name], w, rtol=1e-5, atol=1e-7, msg=name)


def test_sample_py_continues_a_prompt_from_it(gpu_route):
    out = run('sample.py', '--out_dir', str(gpu_route.resumed), '--start', 'once upon',
              '--num_samples', '1', '--max_new_tokens', '20', '--device', gpu_route.device)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith('once upon') and out.stdout.endswith('---------------\n')


def test_export_hf_py_exports_its_best_weights(gpu_route, tmp_path):
    safetensors = pytest.importorskip('safetensors.torch', reason='export_hf.py needs safetensors')
    out = run('export_hf.py', '--out_dir', str(gpu_route.resumed), '--to', str(tmp_path / 'hf'))
    assert out.returncode == 0, out.stderr
    exported = safetensors.load_file(tmp_path / 'hf' / 'model.safetensors')
    best = runs.load_checkpoint(str(gpu_route.resumed / 'best.pt'))['model']
    assert torch.equal(exported['model.embed_tokens.weight'], best['embed.weight'])
