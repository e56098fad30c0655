"""
tinymoe: dense vs Mixtral-style MoE LLaMA decoders on TinyStories, in one file.

    python train.py config/moe.py --seed=1                       # train; the defaults: paper recipe
    python train.py config/dense_total.py --print_params=True    # parameter table, touches no data
    python train.py config/moe.py --seed=1 --resume=True         # continue an interrupted run
    torchrun --standalone --nproc_per_node=4 train.py config/moe.py --grad_accum=4 --batch_size=32

Read top to bottom: config -> model -> parameter accounting -> data -> training loop. The paper's
three configs differ only in the FFN. Errors, device, files and checkpoints: plumbing.py.
"""
import datetime
import math
import os
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import configurator
import plumbing
from plumbing import UserError
from prepare import check_prepared

# ----------------------------------------------------------------------------- config
# '' -> out/{config_name}-s{seed}[-d{data_seed}], so seeds never overwrite each other
out_dir = ''
config_name = ''          # '' -> file name of the last config file ('default' without one)
data_dir = 'data/tinystories'  # train.bin, val.bin, meta.json written by prepare.py
seed = 1                  # seeds init and the training-data order
data_seed = 0             # 0 -> seed; another value changes the data order alone (noise studies)
print_params = False      # print the parameter table (and one JSON line) and exit, touching no data
# model: LLaMA-style. 160 x 4 layers beside an 8.04M tied embedding gives 14.72M active / 20.99M
# total params, the paper's 14.77M / 21.06M within 0.35%
vocab_size = 50257        # >= the tokenizer's vocabulary (meta.json); GPT-2 BPE
block_size = 512          # context; a TinyStories story is ~200 GPT-2 tokens: a window holds 2-3
n_layer = 4
n_head = 5                # head_dim 32
d_model = 160
norm_eps = 1e-5
rope_theta = 10000.0
tie_embeddings = True     # lm_head shares the embedding matrix
# feed-forward block: the only thing the three paper configs change
ffn = 'moe'               # 'dense' (SwiGLU) | 'moe' (routed SwiGLU experts)
ffn_hidden = 0            # dense hidden width; with match set it is solved for
ffn_multiple_of = 32      # solved dense widths are multiples of this (GPU-friendly shapes)
n_experts = 4
top_k = 2                 # experts per token; their gate weights are renormalised to sum to 1
moe_hidden = 1632         # hidden width of each expert
aux_loss_coef = 0.01      # Switch load-balancing loss weight (0 turns it off)
z_loss_coef = 0.001       # router z-loss weight (0 turns it off)
# > 0: aux-loss-free balancing (DeepSeek-V3): a selection-only bias per expert, moved this much
bias_rate = 0.0
shared_hidden = 0         # > 0: an always-on SwiGLU expert this wide (DeepSeekMoE)
router_init_std = 0.02    # 0: a zero router, every expert equally likely at the start
router_lr_mult = 1.0      # the routers' learning rate as a multiple of learning_rate
router_decay = True       # weight decay on the routers (as on every matrix)
match = ''                # dense only: 'active' | 'total' = size ffn_hidden to the MoE's params
match_tol = 0.01          # largest allowed relative param mismatch of a matched dense model
# optimisation: 426.3M tokens in 6,505 steps of 64Ki (routers need many steps, not big batches)
batch_size = 128          # sequences per micro-batch
grad_accum = 1            # micro-batches per optimizer step
max_tokens = 426_300_000  # token budget; iterations = max_tokens / tokens per step, rounded up
max_iters = 0             # if > 0, overrides max_tokens
learning_rate = 2e-3
min_lr = 2e-4             # cosine decay ends here (a tenth of the peak, as in LLaMA)
warmup_frac = 0.02        # linear warmup over this fraction of the iterations
warmup_iters = 0          # if > 0, overrides warmup_frac: a warmup of this many iterations
weight_decay = 0.1        # on >= 2-D weights only
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
# evaluation and logging: one fixed set of validation windows for every config and seed
eval_interval = 250
eval_tokens = 2**20       # size of the fixed validation set (capped at the whole split)
log_interval = 50
ckpt_interval = 250       # steps between saves of latest.pt (a multiple of log_interval)
resume = False            # continue the run in out_dir from its latest.pt, as if never stopped
wandb_log = False         # also log to Weights & Biases (pip install wandb); as nanoGPT names it
wandb_project = 'tinymoe'
wandb_run_name = ''       # '' -> the out_dir's name, e.g. cpu_moe-s1
# system
device = 'auto'           # 'auto' -> a CUDA GPU, else Apple's MPS, else the CPU
dtype = 'auto'            # 'float32' | 'bfloat16' | 'float16'; auto: bf16 on GPUs (old ones: fp16)
compile = None            # torch.compile; None -> on for CUDA, off for CPU

DEFAULTS = {k: v for k, v in globals().items()
            if not k.startswith('_') and isinstance(v, (bool, int, float, str, type(None)))}


def configure(argv):
    """The defaults above, then config files and --key=value overrides (configurator.py)."""
    c = configurator.configure(dict(DEFAULTS), argv)
    configurator.check(c)
    if c.ffn == 'dense' and c.match:
        c.ffn_hidden = solve_ffn_hidden(c)
    return c


# The expert loop needs the tokens per expert as ints; compiled, they stay symbolic: one graph
torch._dynamo.config.capture_scalar_outputs = True


# ----------------------------------------------------------------------------- model
def linear(d_in, d_out, std):
    layer = nn.Linear(d_in, d_out, bias=False)
    nn.init.normal_(layer.weight, std=std)
    return layer


def rope_cache(head_dim, length, theta):
    """cos/sin in Llama's rotate-half layout (dimension i pairs with i + head_dim/2), so that the
    export to transformers is a rename, with no permutation of q and k."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(length).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # (length, head_dim)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, c, resid_std):
        super().__init__()
        self.n_head = c.n_head
        self.qkv = linear(c.d_model, 3 * c.d_model, 0.02)
        self.proj = linear(c.d_model, c.d_model, resid_std)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, n_head, T, head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    """The dense FFN: down(silu(gate(x)) * up(x)), as in LLaMA. Returns (y, None): no aux, where the
    MoE returns (y, aux)."""

    def __init__(self, d_model, hidden, resid_std):
        super().__init__()
        self.gate = linear(d_model, hidden, 0.02)
        self.up = linear(d_model, hidden, 0.02)
        self.down = linear(hidden, d_model, resid_std)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x)), None


def routing_row(load, entropy, log_z):
    """One MoE layer's routing statistics as one row: [load_0 .. load_E-1, entropy, log_z]. One
    tensor per layer, so the statistics cost one host sync to log and one op to average."""
    return torch.cat([load, entropy.view(1), log_z.view(1)])


def unpack_routing(rows):
    """routing_row's inverse, for one row or a stack of them: -> load, entropy, log_z."""
    return rows[..., :-2], rows[..., -2], rows[..., -1]


def group_by_expert(experts, n_experts):
    """The routing's assignments (one per token and chosen expert) grouped by expert, keeping their
    order within an expert. experts: each assignment's expert. -> order: the assignment in each
    grouped slot; slot: each assignment's slot (order's inverse); counts: assignments per expert.

    The same as order = experts.argsort(stable=True) and counts = experts.bincount(n_experts), but
    written as a running count, which torch.compile keeps in one graph."""
    E = n_experts
    is_expert = experts == torch.arange(E, device=experts.device)[:, None]  # (E, assignments)
    # running[e, a]: the assignments to experts before e, plus those to e up to and including a
    running = is_expert.flatten().cumsum(0).view(E, -1)
    slot = running.gather(0, experts[None]).squeeze(0) - 1
    order = torch.empty_like(slot).scatter_(0, slot, torch.arange(len(slot), device=slot.device))
    ends = running[:, -1]  # where each expert's slots end
    counts = ends.diff(prepend=ends.new_zeros(1))
    return order, slot, counts


class GatherRows(torch.autograd.Function):
    """gather_rows(x, rows, inverse) = x[rows], where rows = perm % len(x) for a permutation perm of
    copies * len(x) rows and inverse is perm's inverse. The dispatch uses it twice: to copy each
    token's row to its k experts (copies = k) and to put the experts' rows back (copies = 1).

    Why not plain x[rows]: its backward scatter-adds each row's gradient into place, which compiled
    CPU code does with atomic adds, slowly. Knowing the inverse, the backward can be a gather
    instead: the gradient rows in inverse order, then the copies of each row summed."""

    @staticmethod
    def forward(ctx, x, rows, inverse):
        ctx.save_for_backward(inverse)
        ctx.n_rows = x.shape[0]
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad):
        inverse, = ctx.saved_tensors
        grad = grad.index_select(0, inverse)
        if grad.shape[0] > ctx.n_rows:  # copies > 1: copy c of row t is row c * n_rows + t
            grad = grad.view(-1, ctx.n_rows, grad.shape[-1]).sum(dim=0)
        return grad, None, None


gather_rows = GatherRows.apply


# F.grouped_mm on the CPU too, where the loop over experts is faster: the tests set it to run the
# GPU's path on any machine
grouped_mm_on_cpu = False


def grouped_mm_ok(x, hidden):
    """F.grouped_mm (torch >= 2.8) wants bf16 and rows aligned to 16 bytes; it runs on a CUDA GPU,
    or on the CPU if grouped_mm_on_cpu."""
    aligned = x.shape[-1] % 8 == 0 and hidden % 8 == 0
    where = x.is_cuda or (x.is_cpu and grouped_mm_on_cpu)
    return where and x.dtype == torch.bfloat16 and hasattr(F, 'grouped_mm') and aligned


class MoE(nn.Module):
    """Mixtral-style routed SwiGLU experts, dropless: every token goes to each of its top_k experts.
    Returns (y, aux): aux holds this layer's load-balancing loss, z-loss and routing row.

    An assignment is one (token, expert) pair; a layer has k * N of them for N tokens, numbered
    choice-major: assignment a sends token a % N to its (a // N)-th choice."""

    def __init__(self, c, resid_std):
        super().__init__()
        self.n_experts, self.top_k, self.bias_rate = c.n_experts, c.top_k, c.bias_rate
        E, d, h = c.n_experts, c.d_model, c.moe_hidden
        self.router = linear(d, E, c.router_init_std)
        # the experts' weights, stacked: expert e's SwiGLU is gate[e], up[e], down[e]
        self.gate = nn.Parameter(torch.randn(E, d, h) * 0.02)
        self.up = nn.Parameter(torch.randn(E, d, h) * 0.02)
        self.down = nn.Parameter(torch.randn(E, h, d) * resid_std)
        self.shared = SwiGLU(d, c.shared_hidden, resid_std) if c.shared_hidden else None
        # bias balancing's bias: moved by update_bias after each step, not by gradients
        self.register_buffer('bias', torch.zeros(E) if c.bias_rate else None)

    def forward(self, x):
        shape, x = x.shape, x.reshape(-1, x.shape[-1])  # the tokens as rows: (N, d)
        N, E, k = x.shape[0], self.n_experts, self.top_k
        probs, log_z, weights, experts = self.route(x)
        y, counts = self.dispatch(x, weights, experts)
        if self.shared is not None:  # every token also goes through the shared expert, ungated
            shared_y, _ = self.shared(x)
            y = y + shared_y
        load = counts.float() / (N * k)  # f_i: the share of the assignments that go to expert i
        # Switch load balancing, E * sum_i f_i * P_i (P_i: the mean router probability of expert i):
        # 1 when balanced; E when one expert gets every token (at top-1)
        lb = E * (load * probs.mean(dim=1)).sum()
        with torch.no_grad():  # routing health, for the logs
            # how sure the router is: each token's entropy over the experts, averaged; <= ln(E)
            entropy = -(probs * probs.clamp_min(1e-30).log()).sum(dim=0).mean()
            routing = routing_row(load, entropy, log_z.mean())
        return y.view(shape), {'lb': lb, 'z': log_z.square().mean(), 'routing': routing}

    def route(self, x):
        """x (N, d) -> probs (E, N), log_z (N,), and per assignment its gate weight and expert."""
        k = self.top_k
        # fp32 even under autocast. Experts first, (E, N): reductions over the experts then run
        # along rows (10x faster on a CPU)
        with torch.autocast(x.device.type, enabled=False):
            logits = self.router.weight.float() @ x.float().t()
        log_z = logits.logsumexp(dim=0)  # (N,), for the z-loss
        probs = (logits - log_z).exp()  # the softmax over experts
        scores = probs
        if self.bias is not None:  # the bias picks the experts but never weighs them
            scores = probs + self.bias[:, None]
        experts = scores.topk(k, dim=0).indices  # (k, N): each token's k experts
        weights = probs.gather(0, experts)  # and their gate weights
        # Mixtral renormalises. At top-1 that would make every weight 1 and leave the router no
        # gradient from the loss, so top-1 keeps the probability (Switch)
        if k > 1:
            weights = weights / weights.sum(dim=0)
        return probs, log_z, weights.flatten(), experts.flatten()

    def dispatch(self, x, weights, experts):
        """Dropless dispatch: each expert runs once, on the rows routed to it, grouped together.
        -> (y: each token's k expert outputs, gate-weighted and summed; counts: rows per expert).
        tests/test_model.py holds the same computation as a plain loop over the experts."""
        N, k = x.shape[0], self.top_k
        order, slot, counts = group_by_expert(experts, self.n_experts)
        # each token's row once per expert it goes to, grouped by expert (perm = order, k copies)
        xs = gather_rows(x, order % N, slot)
        ys = self.run_experts(xs, counts)
        # back to assignment order, row a = assignment a (perm = slot, 1 copy); then each token's
        # k rows weighted
        ys = gather_rows(ys, slot, order).view(k, N, -1)
        y = (ys.float() * weights.view(k, N, 1)).sum(dim=0)  # combined in fp32, also under autocast
        return y.to(x.dtype), counts

    def run_experts(self, xs, counts):
        """Each expert's SwiGLU on its rows of xs, grouped by expert (counts[e] rows for e)."""
        if torch.is_autocast_enabled(xs.device.type):  # autocast does not cover grouped_mm: cast
            xs = xs.to(torch.get_autocast_dtype(xs.device.type))
        if grouped_mm_ok(xs, self.gate.shape[-1]):
            # one kernel per matrix for all experts; the counts stay on the device (no host sync)
            ends = counts.cumsum(0).to(torch.int32)
            gate, up, down = (w.to(xs.dtype) for w in (self.gate, self.up, self.down))
            h = F.silu(F.grouped_mm(xs, gate, offs=ends)) * F.grouped_mm(xs, up, offs=ends)
            return F.grouped_mm(h, down, offs=ends)
        # else a loop; tolist() waits for the routing. unbind, not self.gate[e], whose gradient
        # would be a zero-filled (E, d, h) for every expert
        gate, up, down = self.gate.unbind(0), self.up.unbind(0), self.down.unbind(0)
        rows = xs.split(counts.tolist())
        return torch.cat([(F.silu(xe @ gate[e]) * (xe @ up[e])) @ down[e]
                          for e, xe in enumerate(rows)])

    @torch.no_grad()
    def update_bias(self, routing):
        """Aux-loss-free balancing (DeepSeek-V3), after an optimizer step: each expert's selection
        bias moves by bias_rate towards equal load (down if it got more than 1/E of the
        assignments, up if less). routing: this layer's routing row of the last micro-batch."""
        load, _, _ = unpack_routing(routing)
        self.bias += self.bias_rate * (1 / self.n_experts - load).sign()


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        resid_std = 0.02 / math.sqrt(2 * c.n_layer)  # residual projections scaled down, as in GPT-2
        self.attn_norm = nn.RMSNorm(c.d_model, eps=c.norm_eps)
        self.attn = Attention(c, resid_std)
        self.ffn_norm = nn.RMSNorm(c.d_model, eps=c.norm_eps)
        if c.ffn == 'moe':
            self.ffn = MoE(c, resid_std)
        else:
            self.ffn = SwiGLU(c.d_model, c.ffn_hidden, resid_std)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        y, aux = self.ffn(self.ffn_norm(x))  # aux: None for the dense FFN
        return x + y, aux


class Transformer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.block_size = c.block_size
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.norm = nn.RMSNorm(c.d_model, eps=c.norm_eps)
        self.lm_head = linear(c.d_model, c.vocab_size, 0.02)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_cache(c.d_model // c.n_head, c.block_size, c.rope_theta)
        self.register_buffer('cos', cos, persistent=False)
        self.register_buffer('sin', sin, persistent=False)

    def forward(self, idx, targets=None):
        """-> (logits, None, aux) without targets, (None, ce, aux) with them; aux as merge_aux's."""
        T = idx.shape[1]
        x = self.embed(idx)
        layers = []
        for block in self.blocks:
            x, aux = block(x, self.cos[:T], self.sin[:T])
            if aux is not None:
                layers.append(aux)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits, None, merge_aux(layers)
        ce = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return None, ce, merge_aux(layers)


def merge_aux(layers):
    """The MoE layers' aux dicts -> the model's ({} for a dense model): 'lb' and 'z' averaged over
    the layers, 'routing' (a routing row per layer) and the dicts themselves under 'layers'."""
    if not layers:
        return {}
    return {'lb': torch.stack([a['lb'] for a in layers]).mean(),
            'z': torch.stack([a['z'] for a in layers]).mean(),
            'routing': torch.stack([a['routing'] for a in layers]), 'layers': layers}


def training_loss(ce, aux, c):
    """CE plus the routers' auxiliary losses (mean over MoE layers). Validation reports CE alone."""
    if not aux:
        return ce
    return ce + c.aux_loss_coef * aux['lb'] + c.z_loss_coef * aux['z']


def routing_stats(rows):
    """Routing health from one routing row per layer, per layer and as the mean over layers.
    busiest_frac = max_i load_i (1/n_experts is perfect balance, 1.0 a collapsed top-1 router)."""
    load, entropy, log_z = unpack_routing(rows.cpu())  # one host sync
    layers = [{'load': layer_load.tolist(), 'busiest_frac': layer_load.max().item(),
               'usage_var': layer_load.var(unbiased=False).item(),
               'router_entropy': layer_entropy.item(), 'log_z': layer_log_z.item()}
              for layer_load, layer_entropy, layer_log_z in zip(load, entropy, log_z)]
    mean = {key: sum(layer[key] for layer in layers) / len(layers)
            for key in ('busiest_frac', 'usage_var', 'router_entropy', 'log_z')}
    # dropped_frac: the share of assignments no expert ran; the dispatch is dropless
    return {'load': load.mean(dim=0).tolist(), **mean, 'dropped_frac': 0.0, 'layers': layers}


# ----------------------------------------------------------------------------- parameter accounting
def count_params(c, ffn=None):
    """Exact counts from the config alone, for its own FFN or for ffn = 'moe' | 'dense'. A dense
    config matched to an MoE carries that MoE's sizes (n_experts, top_k, moe_hidden, ...): ffn='moe'
    counts the MoE it is matched to. active = total minus the experts a token does not use."""
    d, L, V = c.d_model, c.n_layer, c.vocab_size
    n = {'embedding': V * d, 'lm_head': 0 if c.tie_embeddings else V * d,
         'attention': L * 4 * d * d, 'norms': (2 * L + 1) * d}
    unused = 0
    if (ffn or c.ffn) == 'moe':
        per_expert = 3 * d * c.moe_hidden
        n['ffn'] = L * (c.n_experts * per_expert + 3 * d * c.shared_hidden)
        n['router'] = L * c.n_experts * d
        unused = L * (c.n_experts - c.top_k) * per_expert
    else:
        n['ffn'], n['router'] = L * 3 * d * c.ffn_hidden, 0
    n['total'] = sum(n.values())  # every part counted above
    n['active'] = n['total'] - unused
    return n


def solve_ffn_hidden(c):
    """The dense width (a multiple of ffn_multiple_of) whose params are closest to the MoE's active
    or total ones (c.match)."""
    target = count_params(c, ffn='moe')[c.match]
    dense = count_params(c, ffn='dense')
    rest = dense['total'] - dense['ffn']  # the same in both; the dense width makes up the routers
    per_unit = 3 * c.d_model * c.n_layer  # gate, up and down grow by d_model each, in every layer
    m = c.ffn_multiple_of
    hidden = max(m, round((target - rest) / per_unit / m) * m)
    mismatch = (rest + per_unit * hidden - target) / target
    if abs(mismatch) > c.match_tol:
        raise UserError(f'no dense width matches the MoE {c.match} params ({target:,}) within '
                        f'match_tol={c.match_tol}: the closest, ffn_hidden={hidden}, is off by '
                        f'{mismatch:+.2%}; change ffn_multiple_of or match_tol')
    return hidden


def flops_per_token(c):
    """Training FLOPs per token, forward and backward: 6 per active matmul parameter (the output
    layer's included, the embedding lookup's not) plus causal attention, 6 * n_layer * block_size *
    d_model (scores and values over half the T x T square). train.py logs, bench.py and the GPU
    check all count with this."""
    n = count_params(c)
    head = c.vocab_size * c.d_model  # the output layer, tied to the embedding or not
    matmul = n['active'] - n['norms'] - n['embedding'] - n['lm_head'] + head
    return 6 * matmul + 6 * c.n_layer * c.block_size * c.d_model


def print_param_table(c):
    """--print_params: counts, FLOPs per token, a matched model's target (plumbing prints them)."""
    target = count_params(c, ffn='moe')[c.match] if c.match else None
    plumbing.print_param_table(c, count_params(c), flops_per_token(c), target)


# ----------------------------------------------------------------------------- data
def load_data(c):
    """The prepared data's meta (checked against the config) and the fixed validation windows:
    evenly spaced over the whole split, the same for every config and seed."""
    meta = check_prepared(c.data_dir, c.vocab_size, c.block_size)
    val = np.memmap(os.path.join(c.data_dir, 'val.bin'), dtype=np.uint16, mode='r')
    n = max(1, min(c.eval_tokens, len(val) - 1) // c.block_size)
    starts = np.linspace(0, len(val) - c.block_size - 1, n).round().astype(np.int64)
    windows = np.stack([val[s:s + c.block_size + 1] for s in starts]).astype(np.int64)
    return meta, torch.from_numpy(windows)


def get_batch(c, step, device):
    """All windows of one optimizer step, from (data seed, step) alone: the same data order for
    every config of a seed, and a resumed run needs nothing but the step number."""
    # a fresh memmap per batch: a long-lived one grows resident memory (nanoGPT's workaround)
    data = np.memmap(os.path.join(c.data_dir, 'train.bin'), dtype=np.uint16, mode='r')
    rng = np.random.default_rng([c.data_seed or c.seed, step])
    starts = rng.integers(0, len(data) - c.block_size, size=c.batch_size * c.grad_accum)
    windows = np.stack([data[s:s + c.block_size + 1] for s in starts]).astype(np.int64)
    windows = torch.from_numpy(windows)
    if device.type == 'cuda':
        windows = windows.pin_memory().to(device, non_blocking=True)
    else:
        windows = windows.to(device)  # the CPU (this is the same tensor) or MPS
    return windows[:, :-1], windows[:, 1:]


# ----------------------------------------------------------------------------- training
@torch.no_grad()
def evaluate(model, val_windows, c, device, autocast, rank=0, world=1):
    """Mean CE over the fixed validation windows and (MoE) the routing statistics over all of them.
    Under DDP each process takes every world-th batch and the sums are all-reduced."""
    model.eval()
    sum_dtype = torch.float32 if device.type == 'mps' else torch.float64  # MPS has no fp64
    total = torch.zeros((), dtype=sum_dtype, device=device)
    # one routing row per layer, shaped in full: a process may get no batch and must still reduce
    zero = torch.zeros((), device=device)
    routing = torch.stack([routing_row(zero.new_zeros(c.n_experts), zero, zero)] * c.n_layer)
    for batch in val_windows.split(c.batch_size)[rank::world]:
        batch = batch.to(device)
        with autocast:
            _, ce, aux = model(batch[:, :-1], batch[:, 1:])
        total += ce.to(total.dtype) * len(batch)
        if aux:  # every window has block_size tokens: weighting by windows weights by tokens
            routing += aux['routing'] * len(batch)
    if world > 1:
        dist.all_reduce(total)
        dist.all_reduce(routing)
    model.train()
    val_loss = total.item() / len(val_windows)
    if c.ffn != 'moe':
        return val_loss, {}
    return val_loss, routing_stats(routing / len(val_windows))


def param_groups(model, c):
    """AdamW's groups: matrices decayed, norm gains not; the routers with their own learning rate
    and decay."""
    routers = [p for name, p in model.named_parameters() if name.endswith('router.weight')]
    rest = [p for p in model.parameters() if all(p is not r for r in routers)]
    router_decay = c.weight_decay if c.router_decay else 0.0
    return [{'params': [p for p in rest if p.dim() >= 2], 'weight_decay': c.weight_decay,
             'lr_mult': 1.0},
            {'params': [p for p in rest if p.dim() < 2], 'weight_decay': 0.0, 'lr_mult': 1.0},
            {'params': routers, 'weight_decay': router_decay, 'lr_mult': c.router_lr_mult}]


def warmup_steps(c, iters):
    """warmup_iters, or else warmup_frac of the iterations (at least one)."""
    return c.warmup_iters if c.warmup_iters > 0 else max(1, round(c.warmup_frac * iters))


def lr_at(it, c, iters):
    """Linear warmup to learning_rate, then cosine decay to min_lr at the last iteration."""
    warmup = warmup_steps(c, iters)
    if it < warmup:
        return c.learning_rate * (it + 1) / warmup
    progress = (it - warmup) / max(1, iters - 1 - warmup)
    return c.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (c.learning_rate - c.min_lr)


def loss_terms(loss, ce, aux):
    """The losses a training line logs, as one tensor: (loss, ce), and (lb, z) for an MoE."""
    terms = [loss, ce]
    if aux:
        terms += [aux['lb'], aux['z']]
    return torch.stack(terms).detach()


def main(argv):
    c = configure(argv)
    if c.print_params:
        print_param_table(c)
        return
    meta, val_windows = load_data(c)
    # torchrun sets RANK and WORLD_SIZE: one process per GPU (or CPU process), gradients averaged
    rank, world = int(os.environ.get('RANK', 0)), int(os.environ.get('WORLD_SIZE', 1))
    ddp, master = world > 1, rank == 0
    ckpt = plumbing.checkpoint_to_resume(c, DEFAULTS)  # None: a new run

    device, use_compile, autocast, scaler = plumbing.setup_device(c)
    if ddp:
        dist.init_process_group('nccl' if device.type == 'cuda' else 'gloo')
    torch.manual_seed(c.seed)
    model = Transformer(c).to(device)
    params = count_params(c)
    assert params['total'] == sum(p.numel() for p in model.parameters()), 'param count is off'
    optimizer = torch.optim.AdamW(param_groups(model, c), lr=c.learning_rate,
                                  betas=(c.beta1, c.beta2), fused=device.type == 'cuda')
    step_model = torch.compile(model) if use_compile else model
    train_model = DistributedDataParallel(step_model) if ddp else step_model

    tokens_per_iter = c.batch_size * c.grad_accum * c.block_size  # global: over all processes
    flops_per_iter = tokens_per_iter * flops_per_token(c)  # for the logs' cumulative training FLOPs
    peak_flops = plumbing.peak_flops(device)  # None where not known (the CPU): no MFU
    iters = c.max_iters or -(-c.max_tokens // tokens_per_iter)  # enough steps for max_tokens
    start, best_val = 0, float('inf')
    if ckpt:
        start, best_val = plumbing.restore(ckpt, model, optimizer, scaler, device)
    if master:
        os.makedirs(c.out_dir, exist_ok=True)
        log = plumbing.RunLog(c, start if ckpt else None)
        plumbing.save(os.path.join(c.out_dir, 'config.json'), {
            **vars(c), 'params': params, 'iters': iters, 'tokens_per_iter': tokens_per_iter,
            'flops_per_token': flops_per_token(c), 'device_used': device.type,
            'dtype_used': plumbing.pick_dtype(c, device),
            'compile_used': use_compile, 'world_size': world, 'cpu': plumbing.cpu_name(),
            'torch': torch.__version__})
        plumbing.print_run_header(c, params, iters, tokens_per_iter, device, use_compile, world,
                                  start if ckpt else None)

    def checkpoint(name, it):
        state = plumbing.checkpoint_state(model, optimizer, scaler, c, meta, it,
                                          it * tokens_per_iter, best_val, device)
        plumbing.save(os.path.join(c.out_dir, name), state)

    last_saved = start if ckpt else None  # the iter of latest.pt
    sums, n_sums = 0, 0  # running loss_terms since the last log line, summed on the device
    # the first step with a non-finite loss (iters: none yet), kept on the device: no host sync
    first_bad = torch.tensor(iters, device=device)
    t_start = t_last = time.time()
    tokens_last = start * tokens_per_iter
    my_micro = range(rank, c.grad_accum, world)  # this process's share of each step's micro-batches
    for it in range(start, iters + 1):
        # evaluation and best.pt: on the fixed validation set, each process its share of it
        if it % c.eval_interval == 0 or it == iters:
            t_eval = time.time()
            val_loss, routing = evaluate(step_model, val_windows, c, device, autocast, rank, world)
            improved = val_loss < best_val
            best_val = min(best_val, val_loss)
            if master:
                record = {'iter': it, 'tokens': it * tokens_per_iter, 'flops': it * flops_per_iter,
                          'val_loss': val_loss, 'best_val': best_val, **routing}
                log.eval(record, iters)
                if improved:
                    checkpoint('best.pt', it)
            t_last += time.time() - t_eval  # throughput excludes evaluation
        if it == iters:
            break

        # learning rate: warmup and cosine decay, times each group's multiple (the routers')
        lr = lr_at(it, c, iters)
        for group in optimizer.param_groups:
            group['lr'] = lr * group['lr_mult']

        # forward and backward: the step's windows are the same in every process; each takes its
        # micro-batches and accumulates their gradients
        x, y = get_batch(c, it, device)
        for i, micro in enumerate(my_micro):
            rows = slice(micro * c.batch_size, (micro + 1) * c.batch_size)
            last_micro = i == len(my_micro) - 1
            # DDP averages gradients over processes in the last micro-batch's backward only
            with train_model.no_sync() if ddp and not last_micro else nullcontext():
                with autocast:
                    _, ce, aux = train_model(x[rows], y[rows])
                    loss = training_loss(ce, aux, c)
                scaler.scale(loss / len(my_micro)).backward()  # scaled in fp16 only
            sums = sums + loss_terms(loss, ce, aux)
            n_sums += 1
            first_bad = torch.where(loss.isfinite(), first_bad, first_bad.clamp(max=it))

        # step: clip the gradient norm, AdamW (fp16: unscaled first, skipped on inf)
        scaler.unscale_(optimizer)
        if c.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        # bias balancing, from the last micro-batch's routing. Under DDP each process moves its
        # own bias, and DDP copies rank 0's buffers to the others at each forward
        if c.bias_rate:
            for block, routing_of_layer in zip(model.blocks, aux['routing']):
                block.ffn.update_bias(routing_of_layer)

        # log: every log_interval steps, the mean losses since the last line and the routing of
        # the last micro-batch; and latest.pt every ckpt_interval steps
        done = it + 1  # steps done; `iter` means the same in training and eval lines
        if done % c.log_interval != 0 and done != iters:
            continue
        if ddp:
            dist.all_reduce(first_bad, op=dist.ReduceOp.MIN)
        if first_bad.item() < iters:  # stop before anything is saved from a broken model
            have = 'none yet'
            if last_saved is not None:
                latest_path = os.path.join(c.out_dir, 'latest.pt')
                have = f'{latest_path} (iter {last_saved}), and best.pt'
            raise UserError(f'the loss is not finite (nan or inf) at iter {first_bad.item() + 1}; '
                            'stopped before saving anything from it. Last good checkpoint: '
                            f'{have}. Try a lower learning_rate')
        means = sums / n_sums
        routing_rows = aux['routing'] if aux else None
        if ddp:
            means = plumbing.mean_over_processes(means, world)
            if aux:
                routing_rows = plumbing.mean_over_processes(routing_rows, world)
        now, tokens = time.time(), done * tokens_per_iter
        record = {'iter': done, 'tokens': tokens, 'flops': done * flops_per_iter,
                  **dict(zip(('loss', 'ce', 'lb', 'z'), means.tolist())), 'lr': lr,
                  'tok_per_s': (tokens - tokens_last) / (now - t_last)}
        if aux:
            record.update(routing_stats(routing_rows))
        if peak_flops:  # model FLOP utilisation, per GPU
            record['mfu'] = record['tok_per_s'] / world * flops_per_token(c) / peak_flops
        if master:
            eta = round((now - t_start) / (done - start) * (iters - done))  # seconds left
            log.train(record, iters, datetime.timedelta(seconds=eta))
            if done % c.ckpt_interval == 0 or done == iters:
                checkpoint('latest.pt', done)
                last_saved = done
        sums, n_sums = 0, 0
        t_last, tokens_last = time.time(), tokens

    # free DDP's reducer first: a gloo group destroyed from it can hang at exit (pytorch#56297)
    if ddp:
        del train_model
        dist.destroy_process_group()
    if master:
        log.close()
        # the finished-run marker (make skips the run)
        plumbing.save(os.path.join(c.out_dir, 'done.json'),
                      {'iters': iters, 'tokens': iters * tokens_per_iter, 'best_val': best_val})
        print(f'done: best val loss {best_val:.4f} ({c.out_dir})')


if __name__ == '__main__':
    with plumbing.one_line_errors('train.py'):
        main(sys.argv[1:])
