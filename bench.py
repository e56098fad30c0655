"""
What does the MoE cost? Times training steps of the MoE, dense_active, dense_total and a naive MoE.

    python bench.py config/cpu_moe.py                  # eager, on this machine's device
    python bench.py config/cpu_moe.py --compile=True --steps=20
    python bench.py config/cpu_moe.py --profile=True   # also: where the MoE's extra time goes
    python bench.py config/cpu_moe.py --stages=True    # also: the MoE built up in stages (STAGES)

All models come from the given config's shared recipe (only the FFN differs, as in training). The
naive MoE is the simplest correct implementation: every expert runs on every token and the outputs
are combined with the sparse top-k routing weights. Steps (forward, backward, AdamW) run on the same
batches, the models interleaved, in several rounds; the medians are reported. The last line is one
JSON object. Any other --key=value is a train.py config override.
"""
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import plumbing
import train


class NaiveMoE(train.MoE):
    """The reference: each expert on all N tokens (E x the FFN compute), then the sum weighted by
    the routing weights."""

    def dispatch(self, x, weights, experts):
        N, E = x.shape[0], self.n_experts
        # the routing weights as an (E, N) matrix, zero where a token does not go to an expert
        # (assignment a is token a % N)
        gates = torch.zeros(E, N, device=x.device)
        gates = gates.scatter(0, experts.view(-1, N), weights.view(-1, N))
        gate_h = torch.einsum('nd,edh->enh', x, self.gate)
        up_h = torch.einsum('nd,edh->enh', x, self.up)
        h = F.silu(gate_h) * up_h
        # counted with a comparison: bincount would break the compiled graph
        counts = (experts[:, None] == torch.arange(E, device=x.device)).sum(dim=0)
        return torch.einsum('enh,ehd,en->nd', h, self.down, gates.to(h.dtype)), counts


def no_aux(x, n_experts):
    """The aux of a stage without aux losses and statistics: zeros in their places."""
    zero = x.new_zeros(())
    return {'lb': zero, 'z': zero, 'routing': train.routing_row(x.new_zeros(n_experts), zero, zero)}


class ExpertsOnlyMoE(train.MoE):
    """Stage 1: the experts alone, each on an equal slice of the tokens' k copies, then each
    token's copies summed: what running k narrow experts per token costs, with no router and no
    grouping."""

    def forward(self, x):
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        N, k, E = x.shape[0], self.top_k, self.n_experts
        # near-equal slices, summing to N * k
        rows = torch.tensor([(N * k + e) // E for e in range(E)], device=x.device)
        y = self.run_experts(x.repeat(k, 1), rows).view(k, N, -1).sum(dim=0)
        return y.view(shape), no_aux(x, self.n_experts)


class RoutedMoE(train.MoE):
    """Stage 2: + the router and the grouping of the tokens by its choice: the MoE layer without
    its aux losses and routing statistics."""

    def forward(self, x):
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        y, _ = self.dispatch(x, *self.route(x)[2:])
        return y.view(shape), no_aux(x, self.n_experts)


# --stages: the MoE built up, each stage a model of its own in the timing; the last stage is the
# MoE as trained
STAGES = {'experts_only': ('the experts alone', ExpertsOnlyMoE),
          'routed': ('+ router and grouping', RoutedMoE),
          'moe': ('+ aux losses and statistics (the MoE)', None)}
VARIANTS = {'naive_moe': NaiveMoE, **{name: cls for name, (_, cls) in STAGES.items() if cls}}


def read_result(path):
    """The JSON line a file this script's output went to ends with."""
    try:
        with open(path) as f:
            return json.loads(f.read().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError) as e:
        raise plumbing.UserError(f'cannot read bench.py\'s JSON line from {path} ({e}); make it '
                                 'with: OMP_NUM_THREADS=1 python bench.py CONFIG > FILE') from None


def read_step_times(path):
    """The MoE's and dense_total's ms per step and what measured them, from a bench.py output."""
    result = read_result(path)
    try:
        ms = result['ms_per_step']
        return {'moe': ms['moe'], 'dense_total': ms['dense_total'],
                'hardware': result.get('hardware'), 'torch': result.get('torch')}
    except (KeyError, TypeError) as e:
        raise plumbing.UserError(f'{path} has no step times of moe and dense_total ({e!r}); '
                                 'make it with: OMP_NUM_THREADS=1 python bench.py CONFIG > FILE'
                                 ) from None


def build(argv):
    """The configs of the four models always timed; the recipe's MoE settings size the two
    matched dense models."""
    moe = ["--ffn='moe'", "--match=''", '--ffn_hidden=0']
    dense = ["--ffn='dense'", '--ffn_hidden=0', '--bias_rate=0.0']
    variants = {'moe': moe, 'dense_active': dense + ["--match='active'"],
                'dense_total': dense + ["--match='total'"], 'naive_moe': moe}
    return {name: train.configure(argv + extra) for name, extra in variants.items()}


def make_model(name, cfg):
    """The model timed as name: every model starts from the same seed; the variants (the naive
    MoE, the stages) have the MoE's weights, computed their way."""
    torch.manual_seed(0)
    model = train.Transformer(cfg)
    if name in VARIANTS:
        for block in model.blocks:
            block.ffn.__class__ = VARIANTS[name]
    return model


def paired_ratio_quartiles(times, reference_times):
    """How much to trust a ratio of medians on a noisy machine: the first and third quartiles of
    the step-by-step ratios, each step against the reference model's step on the same batch, one
    timed right after the other."""
    q1, _, q3 = statistics.quantiles([t / r for t, r in zip(times, reference_times)], n=4)
    return q1, q3


def spread(ratios):
    """Measured ratios as a distribution: {median, q1, q3, rounds}, the quartiles by the inclusive
    rule (within the measured values, as few as there are)."""
    if len(ratios) == 1:
        q1 = q3 = ratios[0]
    else:
        q1, _, q3 = statistics.quantiles(ratios, n=4, method='inclusive')
    return {'median': statistics.median(ratios), 'q1': q1, 'q3': q3, 'rounds': ratios}


def round_ratios(times, reference_times, rounds):
    """The step-time ratio reference / model as a distribution over the rounds: each round's
    median step of the reference over the model's. What a machine charges moves with its load, so
    one ratio of medians hides how far apart two measurements can fall."""
    steps = len(times) // rounds
    return spread([statistics.median(reference_times[i * steps:(i + 1) * steps])
                   / statistics.median(times[i * steps:(i + 1) * steps]) for i in range(rounds)])


def print_profile_difference(models, batches, step, top=15):
    """torch.profiler over the same steps of moe and dense_active: the ops where the MoE spends
    more time. Self CPU time: on a CPU that is the compute; on a GPU it is the launch overhead (use
    nsys for kernels)."""
    from torch.profiler import profile
    self_ms = {}
    for name in ('moe', 'dense_active'):
        with profile() as prof:
            for batch in batches:
                step(*models[name], batch)
        self_ms[name] = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    moe, dense = self_ms['moe'], self_ms['dense_active']
    extra = {op: (moe.get(op, 0) - dense.get(op, 0)) / 1e3 / len(batches)
             for op in moe.keys() | dense.keys()}
    print(f'where the MoE spends more than dense_active (self CPU time, ms per step, top {top}):')
    for op, ms in sorted(extra.items(), key=lambda kv: -kv[1])[:top]:
        print(f'  {ms:+8.2f}  {op}')


def main(argv):
    steps = next((int(a.split('=', 1)[1]) for a in argv if a.startswith('--steps=')), 10)
    rounds = next((int(a.split('=', 1)[1]) for a in argv if a.startswith('--rounds=')), 3)
    profile, stages = '--profile=True' in argv, '--stages=True' in argv
    ours = ('--steps=', '--rounds=', '--profile=', '--stages=')
    argv = [a for a in argv if not a.startswith(ours)]
    if steps < 1 or rounds < 1 or steps * rounds < 2:
        raise plumbing.UserError('--steps and --rounds must be >= 1 and time at least 2 steps in '
                                 'all (e.g. --steps=10 --rounds=3)')
    configs = build(argv)
    c = configs['moe']
    if stages:
        configs.update({name: c for name, (_, cls) in STAGES.items() if cls})
    device, use_compile, autocast, _ = plumbing.setup_device(c)  # as in training
    # a GPU runs asynchronously: wait for it before reading the clock
    sync = {'cuda': torch.cuda.synchronize, 'mps': torch.mps.synchronize}.get(device.type,
                                                                             lambda: None)

    models = {}
    for name, cfg in configs.items():
        model = make_model(name, cfg).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == 'cuda')
        models[name] = (torch.compile(model) if use_compile else model, opt, cfg)

    g = torch.Generator().manual_seed(0)
    shape = (c.batch_size, c.block_size + 1)
    batches = [torch.randint(0, c.vocab_size, shape, generator=g).to(device) for _ in range(steps)]

    def step(model, opt, cfg, batch):
        with autocast:
            _, ce, aux = model(batch[:, :-1], batch[:, 1:])
            loss = train.training_loss(ce, aux, cfg)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for model, opt, cfg in models.values():  # warm-up: compilation, allocator, first-call costs
        for batch in batches[:3]:
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
        print_profile_difference(models, batches, step)
    tokens = c.batch_size * c.block_size
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    paired = paired_ratio_quartiles(times['moe'], times['dense_active'])
    per_round = round_ratios(times['moe'], times['dense_total'], rounds)
    mode = 'compiled' if use_compile else 'eager'
    print(f'{c.config_name} recipe on {device.type} {mode}: {tokens} tokens per step, median of '
          f'{rounds} x {steps} steps')
    print(f'{"model":<13} {"total":>11} {"active":>11} {"ms/step":>9} {"tokens/s":>10} '
          f'{"GFLOP/s":>9}')
    for name, cfg in configs.items():
        n = train.count_params(cfg)
        gflops = train.flops_per_token(cfg) * tokens / ms[name] * 1e-6
        tok_s = tokens / ms[name] * 1e3
        print(f'{name:<13} {n["total"]:>11,} {n["active"]:>11,} {ms[name]:>9.1f} {tok_s:>10,.0f} '
              f'{gflops:>9.1f}')
    print(f'moe / dense_active: {ms["moe"] / ms["dense_active"]:.3f} (the middle half of the '
          f'per-step ratios: {paired[0]:.3f} to {paired[1]:.3f})')
    print(f'dense_total / moe: {ms["dense_total"] / ms["moe"]:.3f} (over the {rounds} rounds: '
          f'median {per_round["median"]:.3f}, quartiles {per_round["q1"]:.3f} to '
          f'{per_round["q3"]:.3f})')
    result = {'device': device.type, 'compile': use_compile, 'torch': torch.__version__,
              'hardware': plumbing.hardware_name(device),
              'ms_per_step': ms,
              'tokens_per_s': {name: tokens / v * 1e3 for name, v in ms.items()},
              'moe_over_dense_active': ms['moe'] / ms['dense_active'],
              'moe_over_dense_active_quartiles': list(paired),
              'naive_over_moe': ms['naive_moe'] / ms['moe'],
              'dense_total_over_moe': ms['dense_total'] / ms['moe'],
              'dense_total_over_moe_rounds': per_round}
    if stages:
        over_dense = {name: ms[name] / ms['dense_active'] for name in STAGES}
        result['stages_over_dense_active'] = over_dense
        ratios = [f'{label} {ms[name] / ms["dense_active"]:.3f}'
                  for name, (label, _) in STAGES.items()]
        print('the MoE built up in stages, each / dense_active: ' + ', '.join(ratios))
    print(json.dumps(result))


if __name__ == '__main__':
    with plumbing.one_line_errors('bench.py'):
        main(sys.argv[1:])
