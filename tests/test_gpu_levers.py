"""scripts/gpu_levers.py on a CPU: the exact head levers (chunked_ce, padded_head, both) give the
plain model's loss and gradients, dense and MoE; bf16_ce really computes in bf16; the --tiny dry
run writes every variant, measured or with the reason it was skipped.

Tolerance, in fp32 (24 significant bits, a relative step of 1.2e-7): the levers leave the trunk's
computation as it is and change only the order of the head's sums (the loss and the weight
gradient summed chunk by chunk; a matmul over 320 instead of 257 columns may block its sums
otherwise), which moves a value by a few units in its last place: the largest difference seen
was 4e-8 on gradients up to 0.12, and 5e-7 on a loss of 5.6. rtol 1e-5 with atol 1e-6 leaves
over 20x room, while a real error moves far more: a padding column left in the softmax adds
log(320/257) = 0.22 to the loss, a chunk left out drops its tokens' share of it."""
import json
import os
import re
import time

import pytest
import torch

import gpu_levers
import train
from conftest import config, run
from gpu_check import write_synthetic_data
from plumbing import UserError

TOLERANCE = dict(rtol=1e-5, atol=1e-6)  # the module docstring says why
EXACT_LEVERS = [('chunked_ce',), ('padded_head',), ('padded_head', 'chunked_ce')]


def toy(ffn):
    """A toy model's config: vocab 257 pads to 320; 3 x 16 tokens make chunks of 20, 20 and 8."""
    return config(ffn='dense', ffn_hidden=32) if ffn == 'dense' else config()


def loss_and_grads(model, c, idx):
    _, ce, aux = model(idx[:, :-1], idx[:, 1:])
    loss = train.training_loss(ce, aux, c)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def batch(c):
    return torch.randint(0, c.vocab_size, (3, c.block_size + 1),
                         generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize('ffn', ['dense', 'moe'])
@pytest.mark.parametrize('levers', EXACT_LEVERS, ids='+'.join)
def test_exact_head_levers_give_the_plain_loss_and_gradients(ffn, levers):
    c = toy(ffn)
    plain = gpu_levers.make_model(c, (), chunk_rows=20)
    lever = gpu_levers.make_model(c, levers, chunk_rows=20)
    # the same weights, and the same parameters: the padding is made at use, not stored
    assert sum(p.numel() for p in lever.parameters()) == train.count_params(c)['total']
    for p, q in zip(plain.parameters(), lever.parameters(), strict=True):
        assert torch.equal(p, q)
    idx = batch(c)
    plain_loss, plain_grads = loss_and_grads(plain, c, idx)
    lever_loss, lever_grads = loss_and_grads(lever, c, idx)
    torch.testing.assert_close(lever_loss, plain_loss, **TOLERANCE)
    for grad, plain_grad in zip(lever_grads, plain_grads, strict=True):
        torch.testing.assert_close(grad, plain_grad, **TOLERANCE)


def test_bf16_ce_computes_the_loss_in_bf16_near_the_fp32_loss():
    """Under autocast, a plain F.cross_entropy would upcast the logits itself: the bf16 lever's
    loss must be a bf16 number, within a few bf16 roundings (up to 2^-8 = 0.4% each) of the
    fp32 path's."""
    c = toy('moe')
    idx = batch(c)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        _, fp32, _ = gpu_levers.make_model(c, (), 20)(idx[:, :-1], idx[:, 1:])
        _, bf16, _ = gpu_levers.make_model(c, ('bf16_ce',), 20)(idx[:, :-1], idx[:, 1:])
    assert fp32.dtype == bf16.dtype == torch.float32
    assert bf16 == bf16.bfloat16().float() and fp32 != fp32.bfloat16().float()
    assert abs(bf16 - fp32) <= 0.02 * fp32


def test_compile_plan_compiles_each_references_first_and_the_head_levers_once():
    plan = gpu_levers.compile_plan(['dense_active', 'moe'], list(gpu_levers.MODES),
                                   ('padded_head',))
    assert plan == [('dense_active', (), 'default'), ('moe', (), 'default'),
                    ('dense_active', ('padded_head',), 'default'),
                    ('dense_active', (), 'reduce-overhead'), ('moe', (), 'reduce-overhead'),
                    ('dense_active', (), 'max-autotune-no-cudagraphs'),
                    ('moe', (), 'max-autotune-no-cudagraphs')]
    # without the default mode, the head levers are not compiled; the reference still is
    assert gpu_levers.compile_plan(['moe'], ['reduce-overhead'], ('padded_head',)) == [
        ('moe', (), 'default'), ('moe', (), 'reduce-overhead')]


def test_a_compile_that_would_end_past_the_budget_is_skipped_and_says_so():
    plan = gpu_levers.compile_plan(['moe'], ['default', 'reduce-overhead'], ('padded_head',))
    args = gpu_levers.parse_args(['--device=cpu', '--tiny', '--budget_s=30'])
    # a CUDA device (nothing runs on it): the budget is checked before anything is built
    setup = (torch.device('cuda'), None, lambda: None)
    results = {'moe': {}}

    def report(m, name, r):
        results[m][name] = r
    ran = gpu_levers.compiled_phase(plan, {'moe': None}, setup, {}, [], args,
                                    deadline=time.time() + 59, report=report)
    assert ran == {'moe': {}}
    # before any compile was timed, one is expected to take FIRST_COMPILE_S = 60 s
    why = {'skipped': 'its compile (about 60 s) would end past --budget_s=30'}
    assert results == {'moe': {'default plain': why, 'default padded_head': why,
                               'reduce-overhead plain': why}}


def measured(ms, loss_diff=1e-4, grad_diff=5e-3):
    """An eager variant's result at a loss of 10: its ms and its differences from plain's."""
    return {'ms': ms, 'loss': 10.0 + loss_diff, 'loss_diff': loss_diff, 'grad_diff': grad_diff}


def test_auto_combo_takes_the_exact_levers_that_sped_up_the_eager_step():
    eager = {'plain': measured(100.0, 0.0, 0.0), 'padded_head': measured(90.0),  # 1.11x: taken
             'chunked_ce': measured(99.0),  # 1.01x: noise
             'bf16_ce': measured(50.0)}  # fastest, but it changes the loss
    assert gpu_levers.best_levers(eager) == ('padded_head',)
    eager['chunked_ce'] = {'error': 'OutOfMemoryError: ...'}
    assert gpu_levers.best_levers(eager) == ('padded_head',)


@pytest.mark.parametrize('loss_diff, grad_diff', [(0.02, 5e-3), (1e-4, 0.1)])
def test_auto_combo_leaves_out_a_faster_lever_that_changed_the_numbers(loss_diff, grad_diff):
    """A loss 0.2% off, or a gradient 10% off: not bf16 rounding, whatever the speed."""
    eager = {'plain': measured(100.0, 0.0, 0.0), 'chunked_ce': measured(90.0),
             'padded_head': measured(80.0, loss_diff, grad_diff)}
    assert gpu_levers.best_levers(eager) == ('chunked_ce',)


def test_pageable_batches_have_the_strides_of_get_batchs(tmp_path):
    """Copied to another device, x and y keep get_batch's strides (views of the windows), so a step
    compiled for those is not compiled again. The meta device stands in for a GPU: a copy of a
    strided view there comes out contiguous, as on a GPU."""
    c = config(data_dir=str(tmp_path), batch_size=4)
    write_synthetic_data(str(tmp_path), c.vocab_size, 1000, 100)
    x, y = train.get_batch(c, 3, torch.device('cpu'))
    on_meta = gpu_levers.pageable_batch(c, 3, torch.device('meta'))
    assert [t.stride() for t in on_meta] == [x.stride(), y.stride()] == [(17, 1), (17, 1)]
    on_cpu = gpu_levers.pageable_batch(c, 3, torch.device('cpu'))
    assert torch.equal(on_cpu[0], x) and torch.equal(on_cpu[1], y)


@pytest.mark.parametrize('argv, message', [
    (['--combo=bf16_ce,chunked_ce'], 'choose one'),
    (['--combo=fused_ce'], "unknown head lever 'fused_ce'"),
    (['--modes=fast'], "unknown torch.compile mode 'fast'"),
    (['--models=dense_huge'], 'no config/dense_huge.py'),
    (['--steps=0'], 'must be >= 1'),
])
def test_user_errors_name_the_fix(argv, message):
    with pytest.raises(UserError, match=message):
        gpu_levers.parse_args(['--device=cpu', '--tiny'] + argv)


def test_paper_scale_on_a_cpu_is_refused():
    with pytest.raises(UserError, match='add --tiny'):
        gpu_levers.parse_args(['--device=cpu'])


def test_tiny_dry_run_writes_every_variant_measured_or_skipped(tmp_path):
    out_path = tmp_path / 'levers.json'
    out = run(os.path.join('scripts', 'gpu_levers.py'), '--device=cpu', '--tiny',
              '--combo=padded_head,chunked_ce', f'--out={out_path}')
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == json.load(open(out_path)) and os.listdir(tmp_path) == ['levers.json']
    # the results were saved, and a line printed ('  12 s  what: {...}'), as each part ended
    progress = re.findall(r'^ *\d+ s  (.+?): \{', out.stdout, flags=re.MULTILINE)
    assert progress == ['dense_active eager', 'moe eager',
                        'dense_active compiled default plain', 'moe compiled default plain',
                        'dense_active compiled default padded_head+chunked_ce',
                        'dense_active compiled reduce-overhead plain',
                        'moe compiled reduce-overhead plain',
                        'dense_active compiled max-autotune-no-cudagraphs plain',
                        'moe compiled max-autotune-no-cudagraphs plain',
                        'dense_active compiled, timed', 'moe compiled, timed']
    assert list(result['models']) == ['dense_active', 'moe']
    assert result['best_levers'] == ['padded_head', 'chunked_ce']
    for m, model in result['models'].items():
        eager = model['eager']
        measured = ['plain', 'bf16_ce', 'chunked_ce', 'padded_head']
        assert list(eager) == measured + (['expert_loop'] if m == 'moe' else [])
        for name in measured:
            assert eager[name]['ms'] > 0 and eager[name]['mfu'] > 0, (m, name)
        assert eager['plain']['speedup'] == 1.0 and eager['plain']['loss_diff'] == 0.0
        # bf16 autocast, as on the GPU: the exact levers' differences are bf16 rounding at most
        for name in ('chunked_ce', 'padded_head'):
            assert abs(eager[name]['loss_diff']) < 1e-4 * eager['plain']['loss']
            assert eager[name]['grad_diff'] < 1e-2
        compiled = ['default plain', 'reduce-overhead plain', 'max-autotune-no-cudagraphs plain']
        if m == 'dense_active':  # the head levers are compiled on the first model only
            compiled.insert(1, 'default padded_head+chunked_ce')
        assert list(model['compiled']) == compiled
        skipped = [model['compiled'][name]['skipped'] for name in compiled]
        assert all('CUDA GPU only' in why for why in skipped)
        assert 'CUDA GPU' in model['host_syncs']['skipped']
    assert 'F.grouped_mm needs a CUDA GPU' in result['models']['moe']['eager']['expert_loop'][
        'skipped']
    sources = result['batches']['sources']
    assert sources['pageable']['ms'] > 0 and sources['on_device']['ms'] > 0
    assert sources['pinned'] == {'skipped': 'pinned memory needs a CUDA GPU'}
    assert 'eager plain ' in out.stdout and 'head levers compiled: padded_head+chunked_ce' in (
        out.stdout)

