"""
Which speed levers help a paper-scale training step on one GPU? Each lever is a variant of the
step (forward, train.training_loss, backward, fused AdamW: bench.py's step), timed against the
plain step in the same process, the variants taking turns step by step, medians.

    python scripts/gpu_levers.py --out OUT/gpu_levers.json   # one GPU, --budget_s (210 s)
    python scripts/gpu_levers.py --device=cpu --tiny         # the same logic at toy shapes

The levers (train.py is not edited: the variants below subclass it or patch it here):
- bf16_ce: the cross-entropy on the bf16 logits, with no fp32 copy of them. Autocast keeps
  cross_entropy in fp32 (it is on autocast's fp32 list and would make the copy itself), so it runs
  with autocast off. Then torch takes the log-softmax in the logits' dtype (LossNLL.cpp:
  at::log_softmax(self, dim, self.scalar_type())): each row's max and sum of exponentials
  accumulate in fp32 (accscalar_t, cuda/SoftMax.cu) but the log-probabilities are stored in bf16,
  and the mean over the tokens accumulates in fp32 (cuda/Loss.cu) but comes back as a bf16 scalar,
  in steps of 0.0078 at a loss of 1.6 and of 0.0625 at 10.8.
- chunked_ce: the head and its cross-entropy on chunk_rows rows at a time (ChunkedLinearCE), so
  at most one chunk's logits exist at once.
- padded_head: the tied head's matmul on the embedding padded to a multiple of 64 rows (50,304,
  as nanoGPT does), padded where it is used, so the parameters do not change; the padding's
  logits are set to -inf in place (mask_padding), a write of 47 in every 50,304 logits.
- torch.compile's modes: default (as train.py compiles), reduce-overhead (CUDA graphs) and
  max-autotune-no-cudagraphs.
- expert_loop (moe): train.py's per-expert loop instead of F.grouped_mm; and the host syncs of a
  step, counted with torch.cuda.set_sync_debug_mode('warn').
- batches: train.get_batch (pinned memory, non_blocking copy) against copies from pageable memory
  and against batches already on the GPU.

Every variant starts from the same weights; its loss and gradients there are compared with the
plain eager step's (loss_diff, grad_diff: the largest relative difference over the parameters).
A speed-up is over the plain step of the same group: eager, compiled as train.py compiles, or fed
by train.get_batch. The numbers go to --out as JSON, rewritten after the eager phase and after
each compiled variant (a line printed for each), so a run stopped by a time limit leaves what it
measured; the last printed line is the whole JSON.

The time on an H200, estimated from gpu_check (whose runs compiled dense_active and moe in about
30 and 45 s, evaluation graphs included): about 10 s to import torch before --budget_s starts
counting; then about 40 s for the eager phase (CUDA's start, 2M synthetic tokens written, 9
variants of 24 steps at 60-120 ms each); then the compiles in the plan's order, each only if it
would end by --budget_s - 20 s (first the plain steps of dense_active, about 30 s, and of moe,
about 45 s); then 10 s of compiled and batch steps (the pageable batches have the pinned ones'
strides, so the compiled step is not compiled again for them). A compile that would not fit is
skipped and says so; max-autotune (guessed at 4x a compile) fits only on its own:
--models=dense_active --modes=max-autotune-no-cudagraphs.

In the GPU session (15 minutes of device time, start-up included; results/bench/README.md) this
is call 2, right after scripts/gpu_real_text.sh's call 1, while the machine is still warm, with
timeout_s 215 and, on one line, the command
    timeout --kill-after=5 200 python -u scripts/gpu_levers.py --budget_s=165
    --out "$OUT/gpu_levers.json" 2>&1 | tee "$OUT/gpu_levers.txt"
165 s of budget leaves time for the two plain compiles; the others are skipped and say so.
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from unittest import mock

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import gpu_profile  # noqa: E402
import plumbing  # noqa: E402
import train  # noqa: E402
from gpu_check import write_synthetic_data  # noqa: E402
from plumbing import UserError  # noqa: E402

HEAD_LEVERS = ('bf16_ce', 'chunked_ce', 'padded_head')
MODES = ('default', 'reduce-overhead', 'max-autotune-no-cudagraphs')
PAD_TO = 64  # the head's rows padded to a multiple of this: 50,257 -> 50,304
TINY = ['--d_model=32', '--n_head=2', '--moe_hidden=32', '--ffn_multiple_of=8',
        '--block_size=64', '--batch_size=4', '--vocab_size=1000']
WARMUP = 3  # steps before timing: compilation, CUDA graph recording, allocator, first calls
# auto picks a head lever for the compiled runs only if it made the eager step this much faster:
# less is within the noise of a ratio of medians
MIN_SPEEDUP = 1.02
# ... and only if it kept the plain step's numbers at the starting weights: the loss within this
# fraction of the plain loss and every gradient within EXACT_GRAD_DIFF (relative norm). The exact
# levers only reorder the head's sums, which in bf16 (8 bits, a relative step of 0.4%) moves the
# loss by far less than 0.1% and a gradient by a few roundings (test_gpu_levers.py, on a CPU)
EXACT_LOSS_RTOL = 1e-3
EXACT_GRAD_DIFF = 2e-2
# a compile's cost as a multiple of a default-mode compile's, for the time budget: max-autotune
# also times several kernels for every matmul shape (a guess: warmup_s says what each one took)
COMPILE_COST = {'default': 1.0, 'reduce-overhead': 1.0, 'max-autotune-no-cudagraphs': 4.0}
FIRST_COMPILE_S = 60  # before any compile was timed here: gpu_check's moe took about 45 s
RESERVE_S = 20  # of the budget, kept for timing the compiled variants and the batches
# every compiled variant adds an entry to the same forward's cache; past dynamo's limit (8) a
# variant would silently run eager
torch._dynamo.config.recompile_limit = 32


# ----------------------------------------------------------------------------- the head levers
def mask_padding(logits, vocab):
    """A padded head's extra columns set to -inf, in place: each adds exp(-inf) = 0 to its row's
    softmax, so the loss and its gradients are the unpadded head's, and the shapes stay padded
    into the backward's matmuls. A head without padding is left as it is."""
    if logits.shape[-1] > vocab:
        logits[..., vocab:] = float('-inf')
    return logits


def cross_entropy(logits, targets, in_bf16):
    """Mean CE over all tokens: on an fp32 copy of the logits, as train.py, or (in_bf16) on the
    logits as they are, with autocast off so that it does not make the fp32 copy itself."""
    logits, targets = logits.flatten(0, 1), targets.flatten()
    if not in_bf16:
        return F.cross_entropy(logits.float(), targets)
    with torch.autocast(logits.device.type, enabled=False):
        return F.cross_entropy(logits, targets).float()


class ChunkedLinearCE(torch.autograd.Function):
    """The summed cross-entropy of the logits x @ weight.T, chunk_rows rows of x at a time. The
    forward also computes the gradients, chunk by chunk, while each chunk's logits are at hand,
    and the backward only scales them: at most one chunk's logits exist at once, and none are
    recomputed (checkpointing each chunk would run its head matmul a second time).

    x: (N, d); weight: (V, d), V >= vocab (a padded head); targets: (N,); dtype: the matmuls'
    (autocast's). The softmax and the sums are in fp32, as in train.py's loss."""

    @staticmethod
    def forward(ctx, x, weight, targets, vocab, chunk_rows, dtype):
        with torch.autocast(x.device.type, enabled=False):  # every dtype below is explicit
            xc, wc = x.to(dtype), weight.to(dtype)
            loss = torch.zeros((), device=x.device)
            grad_x = torch.empty_like(xc)
            grad_w = torch.zeros_like(weight, dtype=torch.float32)
            for start in range(0, len(x), chunk_rows):
                rows = slice(start, start + chunk_rows)
                target = targets[rows]
                logits = mask_padding((xc[rows] @ wc.t()).float(), vocab)
                lse = logits.logsumexp(dim=1)
                loss += (lse - logits.gather(1, target[:, None]).squeeze(1)).sum()
                # d loss / d logits = softmax - one_hot(target), made in the logits' place
                grad = logits.sub_(lse[:, None]).exp_()
                grad[torch.arange(len(target), device=x.device), target] -= 1
                grad = grad.to(dtype)
                grad_x[rows] = grad @ wc
                grad_w += (grad.t() @ xc[rows]).float()
        ctx.save_for_backward(grad_x, grad_w)
        ctx.x_dtype = x.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        return (grad_x * grad_loss).to(ctx.x_dtype), grad_w * grad_loss, None, None, None, None


def chunked_ce(x, weight, targets, vocab, chunk_rows):
    """Mean CE over all tokens through ChunkedLinearCE, its matmuls in autocast's dtype."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    total = ChunkedLinearCE.apply(x.flatten(0, 1), weight, targets.flatten(), vocab, chunk_rows,
                                  dtype)
    return total / targets.numel()


class LeverTransformer(train.Transformer):
    """train.Transformer with head levers (a tuple of HEAD_LEVERS). The trunk (embedding, blocks,
    final norm) runs as train.py's forward, with the head swapped for the identity; the head,
    still the embedding matrix, and the cross-entropy are computed here, the levers' way."""

    def __init__(self, c, levers, chunk_rows):
        super().__init__(c)  # the same weights as train.Transformer's from the same seed
        self.levers, self.chunk_rows, self.vocab = levers, chunk_rows, c.vocab_size
        self.lm_head = nn.Identity()  # train.py's forward then returns the final norm's output

    def forward(self, idx, targets):
        x, _, aux = super().forward(idx)
        weight = self.embed.weight  # the tied head
        if 'padded_head' in self.levers:
            weight = F.pad(weight, (0, 0, 0, -self.vocab % PAD_TO))  # zero rows at the end
        if 'chunked_ce' in self.levers:
            return None, chunked_ce(x, weight, targets, self.vocab, self.chunk_rows), aux
        logits = mask_padding(F.linear(x, weight), self.vocab)
        return None, cross_entropy(logits, targets, in_bf16='bf16_ce' in self.levers), aux


def make_model(c, levers, chunk_rows):
    """The model of a variant; every variant starts from the same weights (seed 0)."""
    torch.manual_seed(0)
    return LeverTransformer(c, levers, chunk_rows) if levers else train.Transformer(c)


def variant_name(levers):
    return '+'.join(levers) or 'plain'


# ----------------------------------------------------------------------------- variants
class Variant:
    """One way of taking a training step: a model (compiled or not) with its own fused AdamW.
    What it measured, or why it failed, goes to self.result."""

    def __init__(self, name, c, device, autocast, chunk_rows, levers=(), mode=None,
                 expert_loop=False):
        self.name, self.c, self.autocast, self.mode = name, c, autocast, mode
        self.expert_loop = expert_loop
        self.model = make_model(c, levers, chunk_rows).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4,
                                     fused=device.type == 'cuda')
        self.step_model = torch.compile(self.model, mode=mode) if mode else self.model
        self.result = {}

    def routing(self):
        """expert_loop: train.MoE runs its per-expert loop, as off the GPU (grouped_mm_ok: no)."""
        if self.expert_loop:
            return mock.patch.object(train, 'grouped_mm_ok', lambda xs, hidden: False)
        return contextlib.nullcontext()

    def loss(self, x, y):
        if self.mode == 'reduce-overhead':
            # CUDA graph trees: a new step begins, so the last step's graph outputs may be reused
            torch.compiler.cudagraph_mark_step_begin()
        with self.routing(), self.autocast:
            _, ce, aux = self.step_model(x, y)
            return train.training_loss(ce, aux, self.c)

    def step(self, x, y):
        self.loss(x, y).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def attempt(self, what, *args):
        """what(*args), or on any error None and the error in self.result: a lever that fails
        is a result, and the other variants still run."""
        try:
            return what(*args)
        except Exception as e:
            self.result['error'] = error_line(e)
            return None


def error_line(e):
    """An exception as one line for the JSON: its type and the first line of its message."""
    lines = str(e).strip().splitlines()
    return f'{type(e).__name__}: {lines[0][:300] if lines else ""}'


def loss_and_grads(variant, x, y):
    """One forward and backward at the variant's starting weights, no step: the loss and every
    parameter's gradient, copied (a CUDA-graphed backward reuses its memory)."""
    loss = variant.loss(x, y)
    loss.backward()
    grads = [p.grad.detach().clone() for p in variant.model.parameters()]
    variant.model.zero_grad(set_to_none=True)
    return loss.item(), grads


def differences(got, reference):
    """A variant's (loss, grads) against the plain eager step's: the loss difference and the
    largest relative gradient difference over the parameters."""
    (loss, grads), (ref_loss, ref_grads) = got, reference
    worst = max(((g - r).norm() / r.norm().clamp_min(1e-30)).item()
                for g, r in zip(grads, ref_grads))
    return {'loss': loss, 'loss_diff': loss - ref_loss, 'grad_diff': worst}


def prepare(variant, reference, batches):
    """Check the variant against the reference, then warm it up (a compiled variant compiles in
    its first call); warmup_s: the time both took."""
    t0 = time.time()
    got = variant.attempt(loss_and_grads, variant, *batches[0])
    if got is None:
        return
    variant.result.update(differences(got, reference))
    for x, y in batches[:WARMUP]:
        variant.attempt(variant.step, x, y)
        if 'error' in variant.result:
            return
    variant.result['warmup_s'] = time.time() - t0


def time_steps(variants, batches, rounds, sync):
    """ms per step of each variant (median), the variants taking turns step by step so that
    drifts of the machine hit all alike, as in bench.py. One that fails drops out of the turns."""
    times = {v.name: [] for v in variants}
    for _ in range(rounds):
        for x, y in batches:
            for v in variants:
                if 'error' in v.result:
                    continue
                sync()
                t0 = time.perf_counter()
                v.attempt(v.step, x, y)
                sync()
                times[v.name].append(time.perf_counter() - t0)
    for v in variants:
        if 'error' not in v.result:
            v.result['ms'] = 1e3 * statistics.median(times[v.name])


def count_host_syncs(variant, x, y):
    """How many times one step makes the host wait for the GPU: in sync debug mode 'warn' torch
    warns at each synchronizing call (.item(), .tolist(), a copy to the host, ...)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        torch.cuda.set_sync_debug_mode('warn')
        try:
            variant.step(x, y)
        finally:
            torch.cuda.set_sync_debug_mode('default')
    return sum('synchronizing CUDA operation' in str(w.message) for w in caught)


def grouped_mm_used(c, device):
    """Whether train.MoE's experts run as F.grouped_mm here (bf16 autocast, as set up below)."""
    rows = torch.empty(1, c.d_model, device=device, dtype=torch.bfloat16)
    return train.grouped_mm_ok(rows, c.moe_hidden)


# ----------------------------------------------------------------------------- the phases
def eager_phase(c, setup, batches, args):
    """Every lever eager, against the plain step. -> ({variant: result}, the plain step's (loss,
    grads) at the starting weights, {variant: host syncs per step} or {'skipped': why})."""
    device, autocast, sync = setup
    names = ['plain', *HEAD_LEVERS] + (['expert_loop'] if c.ffn == 'moe' else [])
    results, variants = {}, []
    for name in names:
        if name == 'expert_loop' and not grouped_mm_used(c, device):
            results[name] = {'skipped': 'train.py runs this per-expert loop here already: '
                                        'F.grouped_mm needs a CUDA GPU, bf16 and torch >= 2.8'}
            continue
        levers = (name,) if name in HEAD_LEVERS else ()
        v = Variant(name, c, device, autocast, args.chunk_rows, levers,
                    expert_loop=name == 'expert_loop')
        variants.append(v)
        results[name] = v.result
    # the plain step's own differences from this reference are its run-to-run noise
    reference = loss_and_grads(variants[0], *batches[0])
    for v in variants:
        prepare(v, reference, batches)
    time_steps(variants, batches, args.rounds, sync)
    syncs = {'skipped': 'torch.cuda.set_sync_debug_mode needs a CUDA GPU'}
    if device.type == 'cuda':
        syncs = {v.name: v.attempt(count_host_syncs, v, *batches[0]) for v in variants}
    return results, reference, syncs


def kept_the_numbers(r):
    """Whether a variant's loss and gradients at the starting weights were the plain eager step's,
    up to bf16 rounding (EXACT_LOSS_RTOL, EXACT_GRAD_DIFF)."""
    return ('loss_diff' in r and abs(r['loss_diff']) <= EXACT_LOSS_RTOL * abs(r['loss'])
            and r['grad_diff'] <= EXACT_GRAD_DIFF)


def best_levers(eager):
    """The head levers the compiled runs combine by default: of those meant to keep the loss
    exact (every one but bf16_ce), the ones that did keep the plain step's numbers here and made
    the eager step at least MIN_SPEEDUP faster."""
    plain_ms = eager['plain'].get('ms')
    return tuple(lever for lever in ('padded_head', 'chunked_ce')
                 if plain_ms and 'ms' in eager[lever] and kept_the_numbers(eager[lever])
                 and plain_ms / eager[lever]['ms'] >= MIN_SPEEDUP)


def compile_plan(models, modes, best):
    """(model, levers, mode) in the order they are compiled; the time budget cuts from the end.
    First each model's plain step compiled as train.py does (every compiled variant's reference),
    then the best head levers on the first model only (the head is the same in every model),
    then the plain step under each other mode."""
    plan = [(m, (), 'default') for m in models]
    if best and 'default' in modes:
        plan.append((models[0], best, 'default'))
    plan += [(m, (), mode) for mode in modes if mode != 'default' for m in models]
    return plan


def compiled_phase(plan, configs, setup, references, batches, args, deadline, report):
    """The plan's variants compiled in order while the time budget allows, then timed together.
    report(model, name, result) is called as each is compiled (its loss and gradient check and
    warmup_s; the timing adds ms later, to the same dict) or skipped.
    -> {model: {name: Variant}} (those that ran)."""
    device, autocast, sync = setup
    ran = {m: {} for m in configs}
    default_compile_s = []  # what a default-mode compile took here, for the budget
    skips = torch._dynamo.utils.counters['inductor']
    for m, levers, mode in plan:
        name = f'{mode} {variant_name(levers)}'
        if device.type != 'cuda':
            report(m, name, {'skipped': 'compiled variants are timed on a CUDA GPU only (a '
                                        'compile on a CPU takes minutes and says nothing about '
                                        'the GPU)'})
            continue
        estimate = max(default_compile_s, default=FIRST_COMPILE_S) * COMPILE_COST[mode]
        if time.time() + estimate > deadline:
            report(m, name, {'skipped': f'its compile (about {estimate:.0f} s) would end past '
                                        f'--budget_s={args.budget_s:g}'})
            continue
        v = Variant(name, configs[m], device, autocast, args.chunk_rows, levers, mode)
        skips_before = skips['cudagraph_skips']
        prepare(v, references[m], batches)
        if mode == 'reduce-overhead' and 'error' not in v.result:
            # > 0: some or all of the step ran without CUDA graphs (inductor logs why)
            v.result['cudagraph_skips'] = skips['cudagraph_skips'] - skips_before
        if mode == 'default' and 'warmup_s' in v.result:
            default_compile_s.append(v.result['warmup_s'])
        ran[m][name] = v
        report(m, name, v.result)
    time_steps([v for by_name in ran.values() for v in by_name.values()], batches, args.rounds,
               sync)
    return ran


def pageable_batch(c, it, device):
    """train.get_batch's (x, y) for step it, from pageable memory: its windows copied to the device
    whole (the host waits for the copy), then sliced as get_batch slices them. Copying x and y
    themselves would make them contiguous, and a step compiled for get_batch's strided views
    would compile again for them. (x and y made back into windows: a copy of 0.5 MB on the host.)"""
    x, y = train.get_batch(c, it, torch.device('cpu'))
    windows = torch.cat([x, y[:, -1:]], dim=1).to(device)
    return windows[:, :-1], windows[:, 1:]


def batch_sources(c, device, steps):
    """Three ways a step gets its (x, y), by step number: train.get_batch (pinned memory, a
    non_blocking copy), the same windows copied from pageable memory (pageable_batch), and
    batches made beforehand, already on the device."""
    made = [train.get_batch(c, it, device) for it in range(steps)]
    sources = {'pinned': lambda it: train.get_batch(c, it, device),
               'pageable': lambda it: pageable_batch(c, it, device),
               'on_device': lambda it: made[it]}
    if device.type != 'cuda':
        del sources['pinned']
    return sources


def batches_phase(variant, c, setup, args):
    """Lever 5: variant's step fed by each of batch_sources, `steps` steps back to back and one
    sync at the end, as in training, where the host may run ahead of the GPU; the sources take
    turns, median over the rounds."""
    device, _, sync = setup
    sources = batch_sources(c, device, args.steps)

    def seconds_per_step(fetch):
        sync()
        t0 = time.perf_counter()
        for it in range(args.steps):
            variant.step(*fetch(it))
        sync()
        return (time.perf_counter() - t0) / args.steps

    results = {name: {} for name in sources}
    if device.type != 'cuda':
        results['pinned'] = {'skipped': 'pinned memory needs a CUDA GPU'}
    times = {name: [] for name in sources}
    # the first round warms up: the first pinned buffer, the first copies
    for _ in range(args.rounds + 1):
        for name, fetch in sources.items():
            if 'error' in results[name]:
                continue
            try:
                times[name].append(seconds_per_step(fetch))
            except Exception as e:
                results[name]['error'] = error_line(e)
    for name in sources:
        if 'error' not in results[name]:
            results[name]['ms'] = 1e3 * statistics.median(times[name][1:])
    return results


def add_rates(group, reference, c, peak_flops):
    """Speed-up over the group's reference variant and MFU, beside each measured ms."""
    tokens = c.batch_size * c.block_size
    ref_ms = group.get(reference, {}).get('ms')
    for r in group.values():
        if 'ms' in r:
            r['mfu'] = gpu_profile.mfu(tokens / (r['ms'] / 1e3), train.flops_per_token(c),
                                       peak_flops)
            if ref_ms:
                r['speedup'] = ref_ms / r['ms']


# ----------------------------------------------------------------------------- report
def save_progress(args, result, what, r):
    """The result so far to --out, and a line saying what was added (r): a run stopped by a time
    limit still leaves everything it measured (plumbing.save: a kill mid-write leaves the last
    version)."""
    plumbing.save(args.out, result)
    print(f'{time.time() - args.t_start:5.0f} s  {what}: {json.dumps(r)}', flush=True)


def print_table(result):
    print(f'{"model":<13} {"variant":<44} {"ms/step":>8} {"speed-up":>8} {"MFU":>6} '
          f'{"loss diff":>10} {"grad diff":>9}')
    groups = [(m, group, name, r) for m, model in result['models'].items()
              for group in ('eager', 'compiled') for name, r in model[group].items()]
    groups += [(result['batches']['model'], 'batches', name, r)
               for name, r in result['batches']['sources'].items()]
    for m, group, name, r in groups:
        label = f'{group} {name}'
        if 'ms' not in r:
            print(f'{m:<13} {label:<44} {r.get("skipped") or r.get("error")}')
            continue
        speedup = f'{r["speedup"]:.3f}' if 'speedup' in r else ''
        diffs = (f'{r["loss_diff"]:>+10.2e} {r["grad_diff"]:>9.2e}' if 'loss_diff' in r
                 else '')
        print(f'{m:<13} {label:<44} {r["ms"]:>8.2f} {speedup:>8} {100 * r["mfu"]:>5.1f}% '
              f'{diffs}')
    for m, model in result['models'].items():
        print(f'{m} host syncs per step: {model["host_syncs"]}')
    print(f'head levers compiled: {variant_name(result["best_levers"])}')


# ----------------------------------------------------------------------------- main
def parse_levers(text):
    levers = tuple(x for x in text.split(',') if x and x != 'plain')
    unknown = [x for x in levers if x not in HEAD_LEVERS]
    if unknown:
        raise UserError(f'unknown head lever {unknown[0]!r} in --combo; choose from '
                        f'{", ".join(HEAD_LEVERS)}, plain or auto')
    if 'bf16_ce' in levers and 'chunked_ce' in levers:
        raise UserError('--combo: bf16_ce and chunked_ce are two ways of computing the same '
                        'cross-entropy; choose one')
    return levers


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--device', default='cuda', help='cuda (default) or cpu')
    p.add_argument('--tiny', action='store_true',
                   help='toy shapes, a few steps: checks the logic, not the speed')
    p.add_argument('--models', default='dense_active,moe',
                   help='configs in config/, comma-separated; the first also gets the compiled '
                        'head levers and the batches')
    p.add_argument('--modes', default=','.join(MODES),
                   help='torch.compile modes, most wanted first (default: all three)')
    p.add_argument('--combo', default='auto',
                   help="head levers compiled together: 'auto' (those that sped up the eager "
                        "step and kept its loss and gradients), 'plain' or e.g. "
                        "padded_head,chunked_ce")
    p.add_argument('--chunk_rows', type=int, default=None,
                   help='rows per chunk of chunked_ce (default 8192, tiny 64)')
    p.add_argument('--steps', type=int, default=None,
                   help='timed steps per round and variant (default 10, tiny 2)')
    p.add_argument('--rounds', type=int, default=2)
    p.add_argument('--budget_s', type=float, default=210,
                   help='no compile starts that would end later than this after the start, '
                        'less 20 s for the timing (default 210)')
    p.add_argument('--peak_flops', type=float, default=plumbing.PEAK_FLOPS['NVIDIA H200'],
                   help='for the MFU (default: H200 bf16)')
    p.add_argument('--out', default=os.path.join(REPO, 'results', 'gpu', 'gpu_levers.json'),
                   help='the JSON file, rewritten as the run goes (the GPU session: '
                        '$OUT/gpu_levers.json, whence it comes back)')
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(',') if m]
    args.modes = [m for m in args.modes.split(',') if m]
    if args.chunk_rows is None:
        args.chunk_rows = 64 if args.tiny else 8192
    if args.steps is None:
        args.steps = 2 if args.tiny else 10
    for m in args.models:
        if not os.path.isfile(os.path.join(REPO, 'config', f'{m}.py')):
            raise UserError(f'--models: no config/{m}.py; e.g. --models=dense_active,moe')
    for mode in args.modes:
        if mode not in MODES:
            raise UserError(f'--modes: unknown torch.compile mode {mode!r}; choose from '
                            f'{", ".join(MODES)}')
    if not args.models or args.steps < 1 or args.rounds < 1 or args.chunk_rows < 1:
        raise UserError('--models must name a config, and --steps, --rounds and --chunk_rows '
                        'must be >= 1')
    args.combo_levers = None if args.combo == 'auto' else parse_levers(args.combo)
    if args.device.startswith('cuda') and not torch.cuda.is_available():
        raise UserError('no CUDA device visible to torch; on a CPU run: python '
                        'scripts/gpu_levers.py --device=cpu --tiny')
    if not args.device.startswith('cuda') and not args.tiny:
        raise UserError('paper-scale steps on a CPU take minutes each; add --tiny')
    return args


def configs_for(args, data_dir):
    """The paper's configs as the GPU trains them (bf16 autocast), reading batches from
    data_dir; compile off: this script compiles its own variants. Toy shapes with --tiny."""
    extra = [f'--device={args.device!r}', "--dtype='bfloat16'", '--compile=False',
             f'--data_dir={data_dir!r}']
    if args.tiny:
        extra += TINY
    return {m: train.configure([os.path.join(REPO, 'config', f'{m}.py')] + extra)
            for m in args.models}


def random_batches(c, device, n):
    """n batches (x, y) of random token ids on the device, the same for every variant."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(n):
        windows = torch.randint(0, c.vocab_size, (c.batch_size, c.block_size + 1), generator=g)
        windows = windows.to(device)
        batches.append((windows[:, :-1], windows[:, 1:]))
    return batches


def main(argv):
    args = parse_args(argv)
    args.t_start = t_start = time.time()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with tempfile.TemporaryDirectory() as data_dir:
        configs = configs_for(args, data_dir)
        first = configs[args.models[0]]
        n_train = 20_000 if args.tiny else 2_000_000
        write_synthetic_data(data_dir, first.vocab_size, n_train, n_train // 10)
        device, _, autocast, _ = plumbing.setup_device(first)  # bf16 autocast, as in training
        # a GPU runs asynchronously: wait for it before reading the clock
        sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)
        setup = (device, autocast, sync)
        batches = random_batches(first, device, args.steps)

        result = {'device': args.device, 'hardware': plumbing.hardware_name(device),
                  'torch': torch.__version__, 'tiny': args.tiny, 'dtype': 'bfloat16',
                  'steps': args.steps, 'rounds': args.rounds, 'chunk_rows': args.chunk_rows,
                  'pad_to': PAD_TO, 'budget_s': args.budget_s, 'peak_flops': args.peak_flops,
                  'models': {}}
        references = {}
        for m, c in configs.items():
            eager, references[m], syncs = eager_phase(c, setup, batches, args)
            add_rates(eager, 'plain', c, args.peak_flops)
            result['models'][m] = {
                'params': train.count_params(c), 'flops_per_token': train.flops_per_token(c),
                'tokens_per_step': c.batch_size * c.block_size,
                'grouped_mm': c.ffn == 'moe' and grouped_mm_used(c, device),
                'eager': eager, 'host_syncs': syncs}
            save_progress(args, result, f'{m} eager', eager)
        best = args.combo_levers
        if best is None:  # --combo=auto
            best = best_levers(result['models'][args.models[0]]['eager'])
        result['best_levers'] = list(best)

        plan = compile_plan(args.models, args.modes, best)
        deadline = t_start + args.budget_s - RESERVE_S
        for m in configs:
            result['models'][m]['compiled'] = {}

        def report(m, name, r):
            result['models'][m]['compiled'][name] = r
            save_progress(args, result, f'{m} compiled {name}', r)
        ran = compiled_phase(plan, configs, setup, references, batches, args, deadline, report)
        for m, c in configs.items():
            add_rates(result['models'][m]['compiled'], 'default plain', c, args.peak_flops)
            save_progress(args, result, f'{m} compiled, timed', result['models'][m]['compiled'])

        # the batches: on the first model's step compiled as train.py does, else eager
        variant = ran[args.models[0]].get('default plain')
        if variant is None or 'error' in variant.result:
            variant = Variant('eager plain', first, device, autocast, args.chunk_rows)
        sources = batches_phase(variant, first, setup, args)
        add_rates(sources, 'pinned', first, args.peak_flops)
        result['batches'] = {'model': args.models[0], 'step': variant.name, 'sources': sources}
    result['wall_s'] = time.time() - t_start

    print_table(result)
    plumbing.save(args.out, result)
    print(json.dumps(result))


if __name__ == '__main__':
    with plumbing.one_line_errors('gpu_levers.py'):
        main(sys.argv[1:])
