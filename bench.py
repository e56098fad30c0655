"""
What does the MoE cost? Times training steps of the MoE, dense_active, dense_total and a naive MoE.

    python bench.py config/cpu_moe.py                  # eager, on this machine's device
    python bench.py config/cpu_moe.py --compile=True --steps=20
    python bench.py config/cpu_moe.py --profile=True   # also: where the MoE's extra time goes
    python bench.py config/cpu_moe.py --layer=True     # instead: one FFN layer, the MoE's in parts
    python bench.py config/moe.py --levers=bf16_ce,padded_vocab   # also: speed levers (LEVERS)

All models come from the given config's shared recipe (only the FFN differs, as in training). The
naive MoE is the simplest correct implementation: every expert runs on every token and the outputs
are combined with the sparse top-k routing weights. Steps (forward, backward, AdamW) run on the same
batches, the models interleaved, in several rounds; the medians are reported. The last line is one
JSON object. Any other --key=value is a train.py config override.
"""
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import hardware
import train
from errors import UserError, one_line_errors


class NaiveMoE(train.MoE):
    """The reference: each expert on all N tokens (E x FFN compute), summed by routing weights."""

    def dispatch(self, x, weights, experts):
        N, E = x.shape[0], self.n_experts
        # routing weights as (E, N), zero where a token skips an expert (assignment a: token a % N)
        gates = torch.zeros(E, N, device=x.device)
        gates = gates.scatter(0, experts.view(-1, N), weights.view(-1, N))
        gate_h = torch.einsum('nd,edh->enh', x, self.gate)
        up_h = torch.einsum('nd,edh->enh', x, self.up)
        h = F.silu(gate_h) * up_h
        # counted with a comparison: bincount would break the compiled graph
        counts = (experts[:, None] == torch.arange(E, device=x.device)).sum(dim=0)
        return torch.einsum('enh,ehd,en->nd', h, self.down, gates.to(h.dtype)), counts


class ExpertLoopMoE(train.MoE):
    """train.MoE's loop over the experts, which it runs off the GPU, also where it would run
    grouped_mm: what grouped_mm saves on a GPU (on a CPU the two are the same model)."""

    def run_experts(self, xs, counts):
        gate, up, down = self.gate.unbind(0), self.up.unbind(0), self.down.unbind(0)
        rows = xs.split(counts.tolist())
        return torch.cat([(F.silu(xe @ gate[e]) * (xe @ up[e])) @ down[e]
                          for e, xe in enumerate(rows)])


class Bf16CrossEntropy(train.Transformer):
    """The cross-entropy on the logits as autocast leaves them, bf16, where train.py takes it on
    an fp32 copy: one fewer copy of the largest tensor of the step. Autocast would upcast them
    itself (cross_entropy is on its fp32 list), so it is turned off around the loss."""

    def forward(self, idx, targets):
        logits, _, aux = super().forward(idx)
        with torch.autocast(idx.device.type, enabled=False):
            ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten()).float()
        return None, ce, aux


# --levers: ways to a faster step, each the MoE changed in one way, a model of its own in the timing
LEVERS = {'bf16_ce': ('the cross-entropy in bf16', Bf16CrossEntropy),
          'padded_vocab': ('the vocabulary padded to a multiple of 64, as nanoGPT pads GPT-2\'s',
                           None),
          'expert_loop': ('the loop over the experts, not grouped_mm', ExpertLoopMoE),
          'reduce_overhead': ("compiled with mode='reduce-overhead' (CUDA graphs)", None),
          'max_autotune': ("compiled with mode='max-autotune-no-cudagraphs'", None)}
COMPILE_MODES = {'reduce_overhead': 'reduce-overhead', 'max_autotune': 'max-autotune-no-cudagraphs'}
VARIANTS = {'naive_moe': NaiveMoE, **{name: cls for name, (_, cls) in LEVERS.items() if cls}}


def read_result(path):
    """The JSON line a file this script's output went to ends with."""
    try:
        with open(path) as f:
            return json.loads(f.read().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError) as e:
        raise UserError(f'cannot read bench.py\'s JSON line from {path} ({e}); make it '
                        'with: OMP_NUM_THREADS=1 python bench.py CONFIG > FILE') from None


def read_step_times(path):
    """The MoE's and dense_total's ms per step and what measured them, from a bench.py output."""
    result = read_result(path)
    try:
        ms = result['ms_per_step']
        return {'moe': ms['moe'], 'dense_total': ms['dense_total'],
                'hardware': result.get('hardware'), 'torch': result.get('torch')}
    except (KeyError, TypeError) as e:
        raise UserError(f'{path} has no step times of moe and dense_total ({e!r}); make it '
                        'with: OMP_NUM_THREADS=1 python bench.py CONFIG > FILE') from None


def build(argv, levers=()):
    """The configs of the four models always timed and of the levers asked for; the recipe's MoE
    settings size the two matched dense models."""
    moe = ["--ffn='moe'", "--match=''", '--ffn_hidden=0']
    dense = ["--ffn='dense'", '--ffn_hidden=0', '--bias_rate=0.0']
    variants = {'moe': moe, 'dense_active': dense + ["--match='active'"],
                'dense_total': dense + ["--match='total'"], 'naive_moe': moe,
                **{name: moe for name in levers}}
    if 'padded_vocab' in levers:  # more rows in the embedding and the head it is tied to
        padded = math.ceil(train.configure(argv).vocab_size / 64) * 64
        variants['padded_vocab'] = moe + [f'--vocab_size={padded}']
    return {name: train.configure(argv + extra) for name, extra in variants.items()}


def make_model(name, cfg):
    """The model timed as name, from the same seed: the variants (naive MoE, levers) have the MoE's
    weights, computed their way (padded_vocab's drawn anew, for its larger embedding)."""
    torch.manual_seed(0)
    model = train.Transformer(cfg)
    cls = VARIANTS.get(name)
    if cls and issubclass(cls, train.Transformer):  # a lever on the whole model
        model.__class__ = cls
    elif cls:  # the MoE layers, computed another way
        for block in model.blocks:
            block.ffn.__class__ = cls
    return model


def paired_ratio_quartiles(times, reference_times):
    """How far to trust a ratio of medians on a noisy machine: the quartiles of the ratios of each
    step to the reference model's on the same batch, timed right after it."""
    q1, _, q3 = statistics.quantiles([t / r for t, r in zip(times, reference_times)], n=4)
    return q1, q3


def spread(ratios):
    """Measured ratios as {median, q1, q3, rounds}, the quartiles inclusive: within the values."""
    if len(ratios) == 1:
        q1 = q3 = ratios[0]
    else:
        q1, _, q3 = statistics.quantiles(ratios, n=4, method='inclusive')
    return {'median': statistics.median(ratios), 'q1': q1, 'q3': q3, 'rounds': ratios}


def round_ratios(times, reference_times, rounds):
    """Each round's median step of the reference over the model's, as a distribution: a machine's
    speed moves with its load; one ratio of medians hides how far two measurements fall apart."""
    steps = len(times) // rounds
    return spread([statistics.median(reference_times[i * steps:(i + 1) * steps])
                   / statistics.median(times[i * steps:(i + 1) * steps]) for i in range(rounds)])


def op_times(model, batches, step, sync, on_gpu):
    """{op: ms per step} from torch.profiler: each kernel's time on a GPU, each op's self CPU time
    on a CPU (on a GPU: launch overhead). Ranges (the optimizer's step) hold ops: left out."""
    from torch.profiler import DeviceType, ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        for batch in batches:
            step(*model, batch)
        sync()
    device, key = ((DeviceType.CUDA, 'self_device_time_total') if on_gpu
                   else (DeviceType.CPU, 'self_cpu_time_total'))
    return {e.key: getattr(e, key) / 1e3 / len(batches) for e in prof.key_averages()
            if e.device_type == device and not e.is_user_annotation}


def print_profile(models, batches, step, sync, on_gpu, top=15):
    """Where the MoE's step goes op by op, and where it outspends dense_active on the same steps."""
    what = 'kernel time' if on_gpu else 'self CPU time'
    moe, dense = (op_times(models[name], batches, step, sync, on_gpu)
                  for name in ('moe', 'dense_active'))
    total = sum(moe.values())
    print(f"where the MoE's step goes ({what}, share of {total:.2f} ms per step, top {top}):")
    for op, ms in sorted(moe.items(), key=lambda kv: -kv[1])[:top]:
        print(f'  {ms / total:6.1%}  {op[:100]}')
    extra = {op: moe.get(op, 0) - dense.get(op, 0) for op in moe.keys() | dense.keys()}
    print(f'where the MoE spends more than dense_active ({what}, ms per step, top {top}):')
    for op, ms in sorted(extra.items(), key=lambda kv: -kv[1])[:top]:
        print(f'  {ms:+8.2f}  {op[:100]}')


# --layer: one FFN layer, forward and backward, on one step's tokens at the recipe's width
class NoExperts(train.MoE):
    """The MoE's dispatch with experts that pass their rows through: what grouping, the copy of
    each token's row to its experts' slots and the weighted sum back cost on their own."""

    def run_experts(self, xs, counts):
        return xs


def forward_backward(forward, grad, autocast):
    """forward() under autocast (as in training), then its backward from grad, cast to its dtype."""
    with autocast:
        out = forward()
    out.backward(grad.to(out.dtype))


def layer_parts(configs, device, autocast):
    """The parts --layer times, each a forward and backward of one layer on the same tokens:
    dense_active's SwiGLU, the MoE layer, and the MoE in three parts that take most of it (the
    routing, the dispatch, the experts' matmuls alone, on rows already grouped by expert)."""
    c = configs['moe']
    torch.manual_seed(0)
    moe = train.MoE(c, resid_std=0.02).to(device)
    no_experts = NoExperts(c, resid_std=0.02).to(device)
    dense = train.SwiGLU(c.d_model, configs['dense_active'].ffn_hidden, 0.02).to(device)
    N = c.batch_size * c.block_size
    x = torch.randn(N, c.d_model, device=device, requires_grad=True)
    grad_y = torch.randn(N, c.d_model, device=device)  # what flows back into the layer's output
    grad_weights = torch.randn(N * c.top_k, device=device)  # and into the routing weights
    with torch.no_grad():  # one routing, fixed, for the dispatch and the experts
        _, _, weights, experts = moe.route(x)
        order, _, counts = train.group_by_expert(experts, c.n_experts)
    weights.requires_grad_()
    xs = x.detach()[order % N].requires_grad_()  # the rows as the experts get them
    leaves = [x, weights, xs, *moe.parameters(), *dense.parameters()]

    def fresh(part):
        """part, then the gradients it left dropped, as a training step sets them to None."""
        def run():
            part()
            for leaf in leaves:
                leaf.grad = None
        return run

    def moe_layer():
        with autocast:
            y, aux = moe(x)
        torch.autograd.backward([y, aux['lb'] + aux['z']], [grad_y.to(y.dtype), None])

    def routing():
        with autocast:
            probs, log_z, weights, _ = moe.route(x)
            aux = moe.aux(probs, log_z, counts)
        torch.autograd.backward([aux['lb'] + aux['z'], weights], [None, grad_weights])

    parts = {'dense_active': lambda: forward_backward(lambda: dense(x)[0], grad_y, autocast),
             'moe': moe_layer,
             'routing': routing,
             'dispatch': lambda: forward_backward(
                 lambda: no_experts.dispatch(x, weights, experts)[0], grad_y, autocast),
             # the rows themselves as the gradient from above: any tensor of their shape would do
             'experts': lambda: forward_backward(
                 lambda: moe.run_experts(xs, counts), xs.detach(), autocast)}
    return {name: fresh(part) for name, part in parts.items()}


def time_layer(configs, device, sync, autocast, rounds):
    """--layer's timings: each part rounds x 20 times, interleaved; the medians, in ms."""
    parts = layer_parts(configs, device, autocast)
    times = {name: [] for name in parts}
    for run in range(rounds * 20 + 3):  # the first 3 passes over the parts warm up, untimed
        for name, part in parts.items():
            sync()
            t0 = time.perf_counter()
            part()
            sync()
            if run >= 3:
                times[name].append(time.perf_counter() - t0)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    # outside the three parts: reshapes, the calls between them, and medians timed apart differing
    ms['remainder'] = ms['moe'] - ms['routing'] - ms['dispatch'] - ms['experts']
    c = configs['moe']
    print(f'one FFN layer, forward and backward, {c.batch_size * c.block_size} tokens of width '
          f'{c.d_model}, {hardware.hardware_name(device)}: median ms of {rounds * 20}, and each '
          'over dense_active\'s')
    for name, v in ms.items():
        print(f'{name:<13} {v:>7.3f} {v / ms["dense_active"]:>6.3f}')
    shares = {'routing': ms['routing'] / ms['moe'], 'dispatch': ms['dispatch'] / ms['moe'],
              'not_experts': 1 - ms['experts'] / ms['moe']}
    print(f'of the MoE layer: routing {shares["routing"]:.0%}, dispatch {shares["dispatch"]:.0%}; '
          f'the layer less its experts\' matmuls {shares["not_experts"]:.0%}')
    print(json.dumps({'hardware': hardware.hardware_name(device), 'torch': torch.__version__,
                      'layer_ms': ms, 'layer_shares': shares}))


def option(argv, key, default):
    """The value of bench.py's own --key=value in argv, or default."""
    return next((a.split('=', 1)[1] for a in argv if a.startswith(f'--{key}=')), default)


def main(argv):
    steps, rounds = int(option(argv, 'steps', 10)), int(option(argv, 'rounds', 3))
    profile, layer = '--profile=True' in argv, '--layer=True' in argv
    levers = [name for name in option(argv, 'levers', '').split(',') if name]
    ours = ('--steps=', '--rounds=', '--profile=', '--layer=', '--levers=')
    argv = [a for a in argv if not a.startswith(ours)]
    if steps < 1 or rounds < 1 or steps * rounds < 2:
        raise UserError('--steps and --rounds must be >= 1 and time at least 2 steps in '
                                 'all (e.g. --steps=10 --rounds=3)')
    unknown = [name for name in levers if name not in LEVERS]
    if unknown:
        raise UserError(f'no lever {unknown[0]!r}; --levers takes a comma-separated list '
                                 f'of {", ".join(LEVERS)}')
    configs = build(argv, levers)
    c = configs['moe']
    device, use_compile, autocast, _ = train.setup_device(c)  # as in training
    if not use_compile and COMPILE_MODES.keys() & set(levers):
        raise UserError(f'--levers: {", ".join(COMPILE_MODES)} are ways of compiling; '
                                 'add --compile=True')
    # a GPU runs asynchronously: wait for it before reading the clock
    sync = {'cuda': torch.cuda.synchronize, 'mps': torch.mps.synchronize}.get(device.type,
                                                                             lambda: None)
    if layer:
        if c.compile or profile or levers:  # compile: only if asked for (None: auto)
            raise UserError('--layer times one layer eagerly, on its own: leave out '
                                     '--compile, --profile and --levers')
        return time_layer(configs, device, sync, autocast, rounds)

    models = {}
    for name, cfg in configs.items():
        model = make_model(name, cfg).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == 'cuda')
        if use_compile:
            model = torch.compile(model, mode=COMPILE_MODES.get(name))  # None: the default mode
        models[name] = (model, opt, cfg)

    g = torch.Generator().manual_seed(0)
    shape = (c.batch_size, c.block_size + 1)
    batches = [torch.randint(0, c.vocab_size, shape, generator=g).to(device) for _ in range(steps)]

    def step(model, opt, cfg, batch):
        """A training step; -> its loss."""
        # CUDA graphs (reduce_overhead) reuse their outputs' memory: the last step's are done with
        torch.compiler.cudagraph_mark_step_begin()
        with autocast:
            _, ce, aux = model(batch[:, :-1], batch[:, 1:])
            loss = train.training_loss(ce, aux, cfg)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    # warm-up: compilation, allocator, first-call costs. The first step's losses, all from the same
    # weights but padded_vocab's, say whether a lever changes what the step computes
    first_loss = {}
    for name, (model, opt, cfg) in models.items():
        first_loss[name] = step(model, opt, cfg, batches[0]).item()
        for batch in batches[1:3]:
            step(model, opt, cfg, batch)
    times = {name: [] for name in models}
    for _ in range(rounds):
        # interleaved step by step: drifts of the machine hit all models alike
        for batch in batches:
            for name, (model, opt, cfg) in models.items():
                sync()
                t0 = time.perf_counter()
                step(model, opt, cfg, batch)
                sync()
                times[name].append(time.perf_counter() - t0)

    if profile:
        print_profile(models, batches, step, sync, on_gpu=device.type == 'cuda')
    tokens = c.batch_size * c.block_size
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    tokens_per_s = {name: tokens / v * 1e3 for name, v in ms.items()}
    peak = hardware.peak_flops(device)  # None: no MFU (a CPU, a GPU not in hardware.PEAK_FLOPS)
    mfu = {name: tokens_per_s[name] * train.flops_per_token(cfg) / peak
           for name, cfg in configs.items()} if peak else None
    paired = paired_ratio_quartiles(times['moe'], times['dense_active'])
    per_round = round_ratios(times['moe'], times['dense_total'], rounds)
    mode = 'compiled' if use_compile else 'eager'
    print(f'{c.config_name} recipe on {device.type} {mode}: {tokens} tokens per step, median of '
          f'{rounds} x {steps} steps')
    print(f'{"model":<15} {"total":>11} {"active":>11} {"ms/step":>9} {"tokens/s":>10} '
          f'{"GFLOP/s":>9}' + (f' {"MFU":>6}' if mfu else ''))
    for name, cfg in configs.items():
        n = train.count_params(cfg)
        gflops = train.flops_per_token(cfg) * tokens_per_s[name] * 1e-9
        print(f'{name:<15} {n["total"]:>11,} {n["active"]:>11,} {ms[name]:>9.1f} '
              f'{tokens_per_s[name]:>10,.0f} {gflops:>9.1f}'
              + (f' {mfu[name]:>6.1%}' if mfu else ''))
    print(f'moe / dense_active: {ms["moe"] / ms["dense_active"]:.3f} (the middle half of the '
          f'per-step ratios: {paired[0]:.3f} to {paired[1]:.3f})')
    print(f'dense_total / moe: {ms["dense_total"] / ms["moe"]:.3f} (over the {rounds} rounds: '
          f'median {per_round["median"]:.3f}, quartiles {per_round["q1"]:.3f} to '
          f'{per_round["q3"]:.3f})')
    result = {'device': device.type, 'compile': use_compile, 'torch': torch.__version__,
              'hardware': hardware.hardware_name(device),
              'ms_per_step': ms, 'tokens_per_s': tokens_per_s, 'peak_flops': peak, 'mfu': mfu,
              'moe_over_dense_active': ms['moe'] / ms['dense_active'],
              'moe_over_dense_active_quartiles': list(paired),
              'naive_over_moe': ms['naive_moe'] / ms['moe'],
              'dense_total_over_moe': ms['dense_total'] / ms['moe'],
              'dense_total_over_moe_rounds': per_round}
    if levers:
        result['levers'] = {name: {'over_moe': ms[name] / ms['moe'],
                                   'first_loss_minus_moe': first_loss[name] - first_loss['moe']}
                            for name in levers}
        print('levers, each step / the MoE\'s (its first loss - the MoE\'s):')
        for name, r in result['levers'].items():
            print(f'  {name:<16} {r["over_moe"]:.3f} ({r["first_loss_minus_moe"]:+.2e})  '
                  f'{LEVERS[name][0]}')
    print(json.dumps(result))


if __name__ == '__main__':
    with one_line_errors('bench.py'):
        main(sys.argv[1:])
