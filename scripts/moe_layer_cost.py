"""
Where one MoE layer's extra time goes, stage by stage. bench.py times whole training steps; this times one FFN
layer's forward + backward at a recipe's shapes (batch_size x block_size tokens of d_model), building the MoE
layer up from what any loop over experts costs to the layer as trained:

    python scripts/moe_layer_cost.py config/cpu_moe.py [--steps=30] [--rounds=5] [--any_config_key=value]

  dense_active   the dense SwiGLU of the same active parameters
  experts        the MoE's experts alone: each on an equal, contiguous slice of the tokens' k copies, summed
  grouping       + a real routing's grouping: counting sort, the gathers there and back, the gate-weighted sum
  router         + the router computing that routing (logits, softmax, top-k, renormalised weights)
  moe            + the load-balancing and z-losses and the routing statistics: the MoE layer as trained

Eager, on this machine's device (CPU unless --device says otherwise). The stages run interleaved, one round of
--steps steps each at a time; the medians over rounds are reported. The last line is one JSON object.
"""
import json
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import bench  # noqa: E402
import train  # noqa: E402

STAGES = {'dense_active': 'the dense SwiGLU, {hidden} wide',
          'experts': 'the MoE experts alone, on equal slices',
          'grouping': '+ grouping by a real routing',
          'router': '+ the router choosing that routing',
          'moe': '+ aux losses and statistics: the layer'}


def stages(moe, dense, x, c):
    """The stages' forward passes on x (N, d_model), each -> (output (N, d_model), loss terms beside the output)."""
    N, E, k = x.shape[0], c.n_experts, c.top_k
    with torch.no_grad():
        _, _, weights, experts = moe.route(x)  # one routing, held fixed for the grouping stage
    equal = torch.tensor([len(part) for part in torch.arange(N * k).tensor_split(E)])  # rows per expert

    def moe_layer():
        y, aux = moe(x)
        return y, c.aux_loss_coef * aux['lb'] + c.z_loss_coef * aux['z']

    return {'dense_active': lambda: (dense(x), 0),
            'experts': lambda: (moe.experts(x.repeat(k, 1), equal).view(k, N, -1).sum(dim=0), 0),
            'grouping': lambda: (moe.dispatch(x, weights, experts)[0], 0),
            'router': lambda: (moe.dispatch(x, *moe.route(x)[2:])[0], 0),
            'moe': moe_layer}


def main(argv):
    steps = next((int(a.split('=', 1)[1]) for a in argv if a.startswith('--steps=')), 30)
    rounds = next((int(a.split('=', 1)[1]) for a in argv if a.startswith('--rounds=')), 5)
    if steps < 1 or rounds < 1:
        sys.exit('moe_layer_cost.py: --steps and --rounds must be >= 1')
    configs = bench.build([a for a in argv if not a.startswith(('--steps=', '--rounds='))])
    c, dense_c = configs['moe'], configs['dense_active']
    device = train.setup_device(c)[0]
    torch.manual_seed(0)
    moe = train.MoE(c, resid_std=0.02).to(device)
    dense = train.SwiGLU(c.d_model, dense_c.ffn_hidden, resid_std=0.02).to(device)
    N = c.batch_size * c.block_size
    x = torch.randn(N, c.d_model, device=device, requires_grad=True)  # unit RMS, as after the FFN's RMSNorm
    probe = torch.randn(N, c.d_model, device=device)  # the loss's gradient with respect to the layer's output
    sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)

    def step(forward):
        y, aux_loss = forward()
        ((y * probe).sum() + aux_loss).backward()

    forwards = stages(moe, dense, x, c)
    for forward in forwards.values():  # warm-up
        for _ in range(3):
            step(forward)
    times = {name: [] for name in forwards}
    for _ in range(rounds):
        for name, forward in forwards.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(forward)
            sync()
            times[name].append((time.perf_counter() - t0) / steps)

    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    print(f'one FFN layer of the {c.config_name} recipe, forward + backward on {device.type}, eager: {N} tokens of '
          f'd_model {c.d_model}, {c.n_experts} experts x {c.moe_hidden}, top-{c.top_k}; median of {rounds} x {steps} steps')
    print(f'{"stage":<44} {"ms/layer":>9} {"+ms over the row above":>22}')
    for i, name in enumerate(ms):
        extra = f'{ms[name] - list(ms.values())[i - 1]:+.2f}' if i else ''
        print(f'{STAGES[name].format(hidden=dense_c.ffn_hidden):<44} {ms[name]:>9.2f} {extra:>22}')
    per_step = c.n_layer * (ms['moe'] - ms['dense_active'])
    print(f'moe layer / dense_active layer: {ms["moe"] / ms["dense_active"]:.3f}; x {c.n_layer} layers = '
          f'{per_step:+.1f} ms per training step')
    print(json.dumps({'device': device.type, 'tokens': N, 'ms_per_layer': ms,
                      'moe_over_dense_active_layer': ms['moe'] / ms['dense_active'],
                      'extra_ms_per_step': per_step}))


if __name__ == '__main__':
    main(sys.argv[1:])
