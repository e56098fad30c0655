"""
Parts 4 and 5 of the real-text GPU check (scripts/gpu_real_text.py runs them): where a training
step's time goes, and nanoGPT's model timed at our shapes.

Where the time goes: profiler ranges added here around module forwards (train.py is untouched)
name the parts of a step: attention, the dense FFN or the experts, the router and the dispatch
around the experts, the head with its cross-entropy, and the optimizer. A kernel counts for the
innermost range around the op that launched it; the rest (embedding, norms, residual adds, the
loss sums) is 'other'. The backward gets the same ranges: an identity op on a module's output
opens its range when the gradient reaches it, one on its input closes it. torch.compile drops
profiler ranges inside compiled code, so this split is measured eager; the compiled steps are
timed whole, ours beside nanoGPT's, and split only into forward, optimizer and the rest.

FLOPs are counted for both models by two rules, each applied to both (flop_count): ours, as
train.py counts them, and nanoGPT's own, as its GPT.estimate_mfu counts them.
"""
import importlib.util
import time
from collections import defaultdict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import DeviceType

import train

# the parts of a step, each a profiler range; what none of them holds is 'other'
PARTS = ('head_and_ce', 'attention', 'ffn_or_experts', 'router_and_dispatch', 'optimizer')


# ----------------------------------------------------------------------------- ranges
class RangeEdge(torch.autograd.Function):
    """The identity. In the backward it opens a profiler range (on a module's output, name given)
    or closes the last one opened (on its input, name None). Autograd runs the newest node whose
    gradient is ready first, so a module's backward runs between its two edges."""

    @staticmethod
    def forward(ctx, x, name, open_ranges):
        ctx.name, ctx.open_ranges = name, open_ranges
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.name is not None:
            ctx.open_ranges.append(torch.profiler.record_function(ctx.name).__enter__())
        else:
            ctx.open_ranges.pop().__exit__(None, None, None)
        return grad, None, None


def in_range(name, forward, open_ranges):
    """forward(x, ...) inside the profiler range `name`, forward and backward. Its output is a
    tensor or, for the FFNs, (y, aux)."""
    def ranged(x, *args):
        x = RangeEdge.apply(x, None, open_ranges)
        with torch.profiler.record_function(name):
            out = forward(x, *args)
        if isinstance(out, tuple):
            return (RangeEdge.apply(out[0], name, open_ranges),) + out[1:]
        return RangeEdge.apply(out, name, open_ranges)
    return ranged


def add_ranges(model):
    """Puts each module's forward in its part's range (as instance attributes: train.py's classes
    stay as they are). -> the list of ranges open in the backward, empty after each step."""
    open_ranges = []
    for block in model.blocks:
        block.attn.forward = in_range('attention', block.attn.forward, open_ranges)
        if isinstance(block.ffn, train.MoE):
            # the experts' range sits inside the MoE's: innermost wins
            block.ffn.forward = in_range('router_and_dispatch', block.ffn.forward, open_ranges)
            block.ffn.run_experts = in_range('ffn_or_experts', block.ffn.run_experts, open_ranges)
        else:
            block.ffn.forward = in_range('ffn_or_experts', block.ffn.forward, open_ranges)
    model.lm_head.forward = in_range('head_and_ce', model.lm_head.forward, open_ranges)
    return open_ranges


def cross_entropy(logits, targets):
    """Transformer.forward's loss, line for line (fp32 logits), for the head's range."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def ranged_loss(model, c, batch, open_ranges, autocast):
    """train.py's training loss with the cross-entropy taken outside the model, inside the head's
    range: the model returns the logits when given no targets."""
    x, y = batch
    with autocast:
        logits, _, aux = model(x)
        ce = in_range('head_and_ce', cross_entropy, open_ranges)(logits, y)
        return train.training_loss(ce, aux, c)


def is_range(evt):
    """A profiler range (record_function), not an op. On a GPU each range also appears as a device
    event spanning the kernels inside it (a gpu_user_annotation, pytorch#130730), linked to the
    range's CPU event as if it were a kernel the range launched: counted, either would add the time
    inside the range a second time. Older torch has no is_user_annotation."""
    return getattr(evt, 'is_user_annotation', False)


def own_time(evt, on_gpu):
    """Microseconds: the kernels an op launched itself (GPU), or its own CPU time (CPU)."""
    if on_gpu:
        return sum(kernel.duration for kernel in evt.kernels)
    return evt.self_cpu_time_total


def time_by_range(prof, names, on_gpu):
    """Each op's own time added to the innermost enclosing range in names, else to 'other'.
    -> {name: microseconds}, 'other' included."""
    times = dict.fromkeys([*names, 'other'], 0.0)
    for evt in prof.events():
        # a kernel counts through the op that launched it; a range holds ops, launches none
        if evt.device_type != DeviceType.CPU or is_range(evt):
            continue
        enclosing = evt
        while enclosing is not None and enclosing.name not in names:
            enclosing = enclosing.cpu_parent
        times[enclosing.name if enclosing else 'other'] += own_time(evt, on_gpu)
    return times


def kernel_time(prof):
    """Microseconds of all GPU kernels, whether or not an op is known to have launched them."""
    return sum(evt.time_range.elapsed_us() for evt in prof.events()
               if evt.device_type == DeviceType.CUDA and not is_range(evt))


def top_kernels(prof, on_gpu, n=8):
    """The n kernels (CPU: ops) with the most time, as {name: share of all of it}."""
    times = defaultdict(float)
    for evt in prof.events():
        if is_range(evt):
            continue
        if on_gpu and evt.device_type == DeviceType.CUDA:
            times[evt.name] += evt.time_range.elapsed_us()
        elif not on_gpu and evt.device_type == DeviceType.CPU:
            times[evt.name] += evt.self_cpu_time_total
    total = sum(times.values()) or 1.0
    top = sorted(times.items(), key=lambda item: -item[1])[:n]
    return {name[:120]: t / total for name, t in top}


# ----------------------------------------------------------------------------- steps
def sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def train_step(model, loss_of, optimizer, batch):
    """One step as train.py takes it: forward, backward, clip the gradient norm at 1.0, AdamW."""
    with torch.profiler.record_function('forward'):
        loss = loss_of(model, batch)
    loss.backward()
    with torch.profiler.record_function('optimizer'):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def seconds_per_step(model, loss_of, optimizer, batch, device, warmup, steps):
    """Wall time per step after `warmup` steps (which hold any compilation)."""
    for _ in range(warmup):
        train_step(model, loss_of, optimizer, batch)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step(model, loss_of, optimizer, batch)
    sync(device)
    return (time.perf_counter() - t0) / steps


def profiled(model, loss_of, optimizer, batch, device, steps):
    """torch.profiler over `steps` steps (CPU ops, and GPU kernels on a GPU)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == 'cuda':
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            train_step(model, loss_of, optimizer, batch)
        sync(device)
    return prof


def random_batch(vocab_size, batch_size, block_size, device):
    """Inputs and targets of random tokens, each contiguous (nanoGPT views its targets)."""
    idx = torch.randint(0, vocab_size, (batch_size, block_size + 1), device=device)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def autocast_for(device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


def our_model(c, device):
    """A paper-config model and train.py's optimizer for it (fused AdamW on a GPU)."""
    torch.manual_seed(0)
    model = train.Transformer(c).to(device)
    optimizer = torch.optim.AdamW(train.param_groups(model, c), lr=c.learning_rate,
                                  betas=(c.beta1, c.beta2), fused=device.type == 'cuda')
    return model, optimizer


# ----------------------------------------------------------------------------- part 4
def where_the_time_goes(c, device, steps):
    """Part 4 for one config: eager bf16 steps, their time split into PARTS and 'other'. The
    shares are of all kernel time (CPU: op time) in the profiled steps."""
    on_gpu = device.type == 'cuda'
    model, optimizer = our_model(c, device)
    open_ranges = add_ranges(model)
    autocast = autocast_for(device)

    def loss_of(model, batch):
        return ranged_loss(model, c, batch, open_ranges, autocast)
    batch = random_batch(c.vocab_size, c.batch_size, c.block_size, device)
    wall = seconds_per_step(model, loss_of, optimizer, batch, device, warmup=2, steps=steps)
    prof = profiled(model, loss_of, optimizer, batch, device, steps)
    times = time_by_range(prof, PARTS, on_gpu)
    total = sum(times.values())
    result = {'compiled': False, 'dtype': 'bfloat16', 'batch_size': c.batch_size,
              'block_size': c.block_size, 'steps_profiled': steps,
              'wall_ms_per_step': 1e3 * wall, 'measured_ms_per_step': total / steps / 1e3,
              'measured': 'GPU kernel time' if on_gpu else 'CPU op time',
              'shares': {part: t / total for part, t in times.items()},
              'ranges_left_open': len(open_ranges), 'top_kernels': top_kernels(prof, on_gpu)}
    if on_gpu:  # kernels no op claimed: they would be missing from the shares
        result['unclaimed_kernel_ms_per_step'] = (kernel_time(prof) - total) / steps / 1e3
    return result


# ----------------------------------------------------------------------------- part 5
def load_nanogpt(path):
    """nanoGPT's model.py, imported from a file outside this repository."""
    spec = importlib.util.spec_from_file_location('nanogpt_model', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flop_count(matmul_params, params, c):
    """Training FLOPs per token by two rules, from a model's matmul params and its params.
    flops_per_token, ours (train.flops_per_token): 6 per matmul param (the output layer's
    included, the embedding lookup's not) plus causal attention, 6 x n_layer x block_size x
    d_model (the scores and values over half the T x T square).
    flops_per_token_nanogpt_rule, nanoGPT's (its GPT.estimate_mfu): 6 per param but the position
    embedding's (the token embedding and the norm gains included) plus attention over the whole
    square, 12 x n_layer x block_size x d_model."""
    attention = c.n_layer * c.block_size * c.d_model
    return {'matmul_params': matmul_params, 'flops_per_token': 6 * matmul_params + 6 * attention,
            'params_nanogpt_rule': params,
            'flops_per_token_nanogpt_rule': 6 * params + 12 * attention}


def linear_weights(model):
    """Matmul params of a model whose matmuls are all nn.Linear (the tied head counted once)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def nanogpt_at_our_shapes(module, c, device):
    """nanoGPT's GPT at c's width, depth, heads, vocabulary and context, without biases or dropout
    (ours has neither), its own optimizer settings (fused AdamW on a GPU). -> (model, optimizer,
    loss_of, FLOP count)."""
    config = module.GPTConfig(block_size=c.block_size, vocab_size=c.vocab_size,
                              n_layer=c.n_layer, n_head=c.n_head, n_embd=c.d_model,
                              dropout=0.0, bias=False)
    torch.manual_seed(0)
    model = module.GPT(config).to(device)
    optimizer = model.configure_optimizers(c.weight_decay, c.learning_rate, (c.beta1, c.beta2),
                                           device.type)
    autocast = autocast_for(device)

    def loss_of(model, batch):
        with autocast:
            return model(*batch)[1]
    flops = flop_count(linear_weights(model), model.get_num_params(), c)
    return model, optimizer, loss_of, flops


def ours_at_our_shapes(c, device):
    """Our model of config c, as nanogpt_at_our_shapes gives nanoGPT's. nanoGPT's rule counts the
    MoE's active params: the experts a token does not use do no work for it."""
    model, optimizer = our_model(c, device)
    autocast = autocast_for(device)
    attention = 6 * c.n_layer * c.block_size * c.d_model
    flops = flop_count((train.flops_per_token(c) - attention) // 6,
                       train.count_params(c)['active'], c)

    def loss_of(model, batch):
        with autocast:
            _, ce, aux = model(*batch)
            return train.training_loss(ce, aux, c)
    return model, optimizer, loss_of, flops


def mfu(tokens_per_s, flops_per_token, peak_flops):
    """The share of the GPU's peak FLOP/s done at tokens_per_s, or None (no known peak: a CPU)."""
    return tokens_per_s * flops_per_token / peak_flops if peak_flops else None


def timed_compiled(built, c, device, steps, peak_flops):
    """Part 5 for one model: compiled steps timed, tokens/s, the MFU by each FLOP rule, and a
    short profile of them."""
    model, optimizer, loss_of, flops = built
    on_gpu = device.type == 'cuda'
    # inductor on a GPU; on a CPU (--tiny) dynamo's capture alone, to check the logic quickly
    compiled = torch.compile(model, backend='inductor' if on_gpu else 'eager')
    batch = random_batch(c.vocab_size, c.batch_size, c.block_size, device)
    t0 = time.time()
    seconds = seconds_per_step(compiled, loss_of, optimizer, batch, device, warmup=3, steps=steps)
    tokens_per_s = c.batch_size * c.block_size / seconds
    prof = profiled(compiled, loss_of, optimizer, batch, device, 3)
    times = time_by_range(prof, ('forward', 'optimizer'), on_gpu)
    claimed = sum(times.values())
    total = kernel_time(prof) if on_gpu else claimed
    return {**flops, 'compiled': True, 'ms_per_step': 1e3 * seconds, 'tokens_per_s': tokens_per_s,
            'mfu': mfu(tokens_per_s, flops['flops_per_token'], peak_flops),
            'mfu_nanogpt_rule': mfu(tokens_per_s, flops['flops_per_token_nanogpt_rule'],
                                    peak_flops),
            'seconds_with_compile': time.time() - t0,
            # backward_and_rest: the backward, outside both ranges, and any kernel no op claimed
            'shares': {'forward': times['forward'] / total, 'optimizer': times['optimizer'] / total,
                       'backward_and_rest': 1 - (times['forward'] + times['optimizer']) / total},
            'unclaimed_kernel_share': 1 - claimed / total,
            'top_kernels': top_kernels(prof, on_gpu)}
