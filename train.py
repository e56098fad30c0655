"""
tinymoe: dense vs Mixtral-style MoE LLaMA decoders on TinyStories; the whole method, in one file.

    python train.py config/moe.py --seed=1                       # train; the defaults: paper recipe
    python train.py config/dense_total.py --print_params=True    # parameter table, touches no data
    python train.py config/moe.py --seed=1 --resume=True         # continue an interrupted run
    torchrun --standalone --nproc_per_node=4 train.py config/moe.py --grad_accum=4 --batch_size=32

Top to bottom: config, model, parameter accounting, data, device and precision, training. The
paper's three configs differ only in the FFN. runs.py keeps the run's files and checkpoints.
"""
import importlib.util
import json
import math
import os
import sys
import time
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import configurator
import runs
from errors import UserError, one_line_errors

# ----------------------------------------------------------------------------- config
out_dir = ''              # '' -> out/{config_name}-s{seed}[-d{data_seed}]: one per seed
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
top_k = 2                 # experts per token; above 1 their weights are renormalised to sum to 1
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
grad_accum = 1            # micro-batches per step, all processes together (as in nanoGPT)
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
keep_checkpoints = False  # also keep each save as ckpt_<step>.pt: the routing along training
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
# not a config key: the tests set it to run grouped_mm on a CPU, where the loop is faster
GROUPED_MM_ON_CPU = False


def configure(argv):
    """The defaults above, then config files and --key=value overrides (configurator.py)."""
    c = configurator.configure(dict(DEFAULTS), argv)
    configurator.check(c)
    c.out_dir = c.out_dir or configurator.run_dir(c)
    if c.ffn == 'dense' and c.match:
        c.ffn_hidden = solve_ffn_hidden(c)
    return c


# ----------------------------------------------------------------------------- model
def linear(d_in, d_out, std):
    layer = nn.Linear(d_in, d_out, bias=False)
    nn.init.normal_(layer.weight, std=std)
    return layer


def rope_cache(head_dim, length, theta):
    """cos/sin in Llama's rotate-half layout: exporting to transformers permutes no q or k."""
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
    """The dense FFN and each expert's: down(silu(gate(x)) * up(x)), as in LLaMA. Returns
    (y, None): no aux, where the MoE returns (y, aux)."""

    def __init__(self, d_model, hidden, resid_std):
        super().__init__()
        self.gate = linear(d_model, hidden, 0.02)
        self.up = linear(d_model, hidden, 0.02)
        self.down = linear(hidden, d_model, resid_std)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x)), None


def group_by_expert(experts, n_experts):
    """The assignments grouped by expert, in order within each. experts: each assignment's
    expert. -> order: the assignment in each slot; slot: each assignment's slot (order[slot[a]]
    = a); counts: assignments per expert. The same as experts.argsort(stable=True) and bincount,
    as a running count that torch.compile keeps in one graph. Three tokens, top-2, three experts:

        is_expert  0 1 0 0 0 1    running  0 1 1 1 1 2    one count: along expert 0's row,
                   0 0 0 1 0 0             2 2 2 3 3 3    then on along expert 1's, and so on
                   1 0 1 0 1 0             4 4 5 5 6 6
        slot     = 3 0 4 2 5 1    running at (each assignment's expert, the assignment), minus 1
        order    = 1 5 3 0 2 4    slot inverted: the assignments slot by slot
        counts   = 2 1 3          running's last column (2, 3, 6), each less the one before
    """
    E = n_experts
    is_expert = experts == torch.arange(E, device=experts.device)[:, None]  # (E, assignments)
    # running[e, a]: the assignments to experts before e, plus those to e up to and including a
    running = is_expert.flatten().cumsum(0).view(E, -1)
    slot = running.gather(0, experts[None]).squeeze(0) - 1
    order = torch.empty_like(slot).scatter_(0, slot, torch.arange(len(slot), device=slot.device))
    ends = running[:, -1]  # where each expert's slots end
    counts = ends.diff(prepend=ends.new_zeros(1))
    return order, slot, counts


class CopyRows(torch.autograd.Function):
    """CopyRows.apply(x, tokens, bags) = x[tokens]: each token's row copied to its k slots; bags
    (len(x), k) lists them. x[tokens]'s backward scatter-adds copy by copy: this one sums each
    token's bag in one pass (embedding_bag)."""

    @staticmethod
    def forward(ctx, x, tokens, bags):
        ctx.save_for_backward(bags)
        return x.index_select(0, tokens)

    @staticmethod
    def backward(ctx, grad):
        bags, = ctx.saved_tensors
        return F.embedding_bag(bags, grad, mode='sum'), None, None


class WeightedSum(torch.autograd.Function):
    """WeightedSum.apply(ys, weights, bags, tokens)[t] = sum_c weights[t, c] * ys[bags[t, c]]:
    each token's k expert outputs, weighted. tokens[s]: the token whose bag holds slot s. One
    embedding_bag; its backward is a gather, where embedding_bag's own would scatter-add."""

    @staticmethod
    def forward(ctx, ys, weights, bags, tokens):
        ctx.save_for_backward(ys, weights, bags, tokens)
        return F.embedding_bag(bags, ys, per_sample_weights=weights, mode='sum')

    @staticmethod
    def backward(ctx, grad):
        ys, weights, bags, tokens = ctx.saved_tensors
        grad_slots = grad.index_select(0, tokens)  # slot s: the gradient of the output it went to
        slot_weights = weights.new_empty(len(tokens)).scatter_(0, bags.flatten(), weights.flatten())
        grad_ys = grad_slots * slot_weights[:, None]
        grad_weights = (grad_slots * ys).sum(dim=1)[bags]  # d y[t] / d weights[t, c]
        return grad_ys, grad_weights, None, None


def grouped_mm_ok(x, hidden):
    """F.grouped_mm, where torch has it: bf16, rows of 16 bytes, CUDA (or GROUPED_MM_ON_CPU)."""
    aligned = x.shape[-1] % 8 == 0 and hidden % 8 == 0
    where = x.is_cuda or (x.is_cpu and GROUPED_MM_ON_CPU)
    return where and x.dtype == torch.bfloat16 and hasattr(F, 'grouped_mm') and aligned


class MoE(nn.Module):
    """Mixtral-style routed SwiGLU experts, dropless: each token goes to all its top_k experts.
    An assignment is one (token, expert) pair, k * N of them for N tokens, choice-major:
    assignment a sends token a % N to its (a // N)-th choice. Returns (y, aux)."""

    def __init__(self, c, resid_std):
        super().__init__()
        self.n_experts, self.top_k, self.bias_rate = c.n_experts, c.top_k, c.bias_rate
        E, d, h = c.n_experts, c.d_model, c.moe_hidden
        self.router = linear(d, E, c.router_init_std)
        # the experts' SwiGLU projections, stacked: expert e's are gate[e], up[e], down[e]
        self.gate = nn.Parameter(torch.randn(E, d, h) * 0.02)
        self.up = nn.Parameter(torch.randn(E, d, h) * 0.02)
        self.down = nn.Parameter(torch.randn(E, h, d) * resid_std)
        self.shared = SwiGLU(d, c.shared_hidden, resid_std) if c.shared_hidden else None
        # bias balancing's bias: moved by update_bias after each step, not by gradients
        self.register_buffer('bias', torch.zeros(E) if c.bias_rate else None)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # the tokens as rows: (N, d)
        probs, log_z, weights, experts = self.route(x)
        y, counts = self.dispatch(x, weights, experts)
        if self.shared is not None:  # every token also goes through the shared expert, weight 1
            shared_y, _ = self.shared(x)
            y = y + shared_y
        return y.view(shape), self.aux(probs, log_z, counts)

    def route(self, x):
        """Each token's top_k experts and their routing weights. For N tokens, E experts, k top_k:

            x        (N, d)    the tokens
            probs    (E, N)    each token's softmax over the experts
            log_z    (N,)      the log of each token's softmax denominator, for the z-loss
            weights  (k * N,)  each assignment's routing weight, choice-major (a = choice * N + t)
            experts  (k * N,)  each assignment's expert, choice-major

        Experts first (Mixtral's code: (N, E)): dim 0 is the experts, reduced along rows."""
        k = self.top_k
        # the router in fp32 even under autocast: Switch Transformer's "selective precision"
        with torch.autocast(x.device.type, enabled=False):
            logits = self.router.weight.float() @ x.float().t()  # (E, N)
        log_z = logits.logsumexp(dim=0)
        probs = (logits - log_z).exp()  # the softmax over experts
        scores = probs
        if self.bias is not None:  # the bias picks the experts but never weighs them
            scores = probs + self.bias[:, None]
        experts = scores.topk(k, dim=0).indices  # (k, N): row c holds each token's c-th choice
        weights = probs.gather(0, experts)  # (k, N): their routing weights
        # Mixtral renormalises. At top-1 every weight would be 1, leaving the router no gradient
        # from the loss, so top-1 keeps the probability (Switch)
        if k > 1:
            weights = weights / weights.sum(dim=0)
        # flattened row after row, the (k, N) tables become choice-major: a = c * N + t
        return probs, log_z, weights.flatten(), experts.flatten()

    def dispatch(self, x, weights, experts):
        """Each expert runs once, on its rows grouped together. -> (y: each token's k outputs,
        weighted and summed; counts: rows per expert). The tests' reference_dispatch: a loop."""
        N, k = x.shape[0], self.top_k
        order, slot, counts = group_by_expert(experts, self.n_experts)
        tokens = order % N  # slot s gets token tokens[s]'s row, for expert experts[order[s]]
        slots = slot.view(k, N).t().contiguous()  # token t's k slots: (N, k), the bags
        weights = weights.view(k, N).t()  # and their routing weights, the same way
        ys = self.run_experts(CopyRows.apply(x, tokens, slots), counts)
        y = WeightedSum.apply(ys.float(), weights, slots, tokens)  # in fp32, also under autocast
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

    def aux(self, probs, log_z, counts):
        """The aux losses, the rows per expert and the routing row (for the logs)."""
        E, N = probs.shape
        load = counts.float() / (N * self.top_k)  # f_i: the share of the assignments to expert i
        # Switch: E * sum_i f_i * P_i, P_i expert i's mean probability. 1 when balanced, E when
        # collapsed at top-1. f_i is counted (no gradient): the router trains through P_i
        lb = E * (load * probs.mean(dim=1)).sum()
        z = log_z.square().mean()  # the z-loss keeps the router's logits small
        with torch.no_grad():
            # how sure the router is: each token's entropy over the experts, averaged; <= ln(E)
            entropy = -(probs * probs.clamp_min(1e-30).log()).sum(dim=0).mean()
            routing = routing_row(load, entropy, log_z.mean())
        return {'lb': lb, 'z': z, 'counts': counts, 'routing': routing}

    @torch.no_grad()
    def update_bias(self, counts):
        """Aux-loss-free balancing (DeepSeek-V3): after a step, each bias moves bias_rate down
        if its expert got over 1/E of the step's assignments, up if under. In integers: exact."""
        self.bias += self.bias_rate * (counts.sum() - self.n_experts * counts).sign()


# run_experts' loop needs the rows per expert as Python ints (counts.tolist()). This lets
# torch.compile keep them as symbols instead of breaking the graph there: one graph per step
torch._dynamo.config.capture_scalar_outputs = True


# A layer's routing statistics travel as one row, [load_0 .. load_E-1, entropy, log_z]: one host
# sync to log them, one op to average them over batches, layers or processes
def routing_row(load, entropy, log_z):
    return torch.cat([load, entropy.view(1), log_z.view(1)])


def unpack_routing(rows):
    """routing_row's inverse, for one row or a stack of them: -> load, entropy, log_z."""
    return rows[..., :-2], rows[..., -2], rows[..., -1]


def routing_record(rows):
    """A log record's routing fields from a routing row per layer: per layer and their mean.
    busiest_frac = max_i load_i, the collapse metric: 1/n_experts balanced, 1/top_k collapsed."""
    load, entropy, log_z = unpack_routing(rows.cpu())  # one host sync
    layers = [{'load': layer_load.tolist(), 'busiest_frac': layer_load.max().item(),
               'usage_var': layer_load.var(unbiased=False).item(),
               'router_entropy': layer_entropy.item(), 'log_z': layer_log_z.item()}
              for layer_load, layer_entropy, layer_log_z in zip(load, entropy, log_z)]
    mean = {key: sum(layer[key] for layer in layers) / len(layers)
            for key in ('busiest_frac', 'usage_var', 'router_entropy', 'log_z')}
    # dropped_frac: the share of assignments no expert ran; the dispatch is dropless
    return {'load': load.mean(dim=0).tolist(), **mean, 'dropped_frac': 0.0, 'layers': layers}


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


# the aux losses an MoE layer returns, averaged over layers, weighed in and logged by these names
AUX_LOSSES = ('lb', 'z')


def merge_aux(layers):
    """The MoE layers' aux -> the model's ({} if dense): AUX_LOSSES averaged, the rest stacked."""
    if not layers:
        return {}
    merged = {key: torch.stack([a[key] for a in layers]).mean() for key in AUX_LOSSES}
    stacked = {key: torch.stack([a[key] for a in layers]) for key in ('counts', 'routing')}
    return {**merged, **stacked, 'layers': layers}


def training_loss(ce, aux, c):
    """CE plus the routers' aux losses (means over MoE layers). Validation reports CE alone."""
    if not aux:
        return ce
    return ce + c.aux_loss_coef * aux['lb'] + c.z_loss_coef * aux['z']


# ----------------------------------------------------------------------------- parameter accounting
def count_params(c, ffn=None):
    """Exact counts from the config, for its FFN or ffn = 'moe' | 'dense' (a matched dense
    config holds its MoE's keys). active: total less the experts a token does not use."""
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
    """The dense width closest to the MoE's active or total params (c.match): a multiple of
    ffn_multiple_of within match_tol, else any width. cpu_moe's 4 x 88 at d_model 44: 176, 352."""
    target = count_params(c, ffn='moe')[c.match]
    dense = count_params(c, ffn='dense')
    rest = dense['total'] - dense['ffn']  # embedding, attention, norms: as in the MoE
    per_unit = 3 * c.d_model * c.n_layer  # gate, up and down grow by d_model each, in every layer
    for m in (c.ffn_multiple_of, 1):
        hidden = max(m, round((target - rest) / per_unit / m) * m)
        mismatch = (rest + per_unit * hidden - target) / target
        if abs(mismatch) <= c.match_tol:
            return hidden
    raise UserError(f'no dense width matches the MoE {c.match} params ({target:,}) within '
                    f'match_tol={c.match_tol}: the closest, ffn_hidden={hidden}, is off by '
                    f'{mismatch:+.2%}; raise match_tol')


def flops_per_token(c):
    """Training FLOPs per token: 6 per active matmul param (the output layer's, not the lookup's)
    plus causal attention's 6 * n_layer * block_size * d_model (half the T x T square)."""
    n = count_params(c)
    head = c.vocab_size * c.d_model  # the output layer, tied to the embedding or not
    matmul = n['active'] - n['norms'] - n['embedding'] - n['lm_head'] + head
    return 6 * matmul + 6 * c.n_layer * c.block_size * c.d_model


def moe_layout(c):
    """The MoE a config describes (or a dense config is matched to), in words."""
    layout = f'{c.n_experts} experts x {c.moe_hidden}, top-{c.top_k}'
    if c.shared_hidden:
        layout += f', shared expert {c.shared_hidden}'
    return layout


def print_param_table(c):
    """--print_params: counts, FLOPs per token, a matched model's target; then one JSON line."""
    n, flops = count_params(c), flops_per_token(c)
    what = f'moe: {moe_layout(c)}'
    summary = {**n, 'moe_hidden': c.moe_hidden, 'flops_per_token': flops}
    if c.ffn == 'dense':
        what = f'dense: ffn_hidden {c.ffn_hidden}'
        summary = {**n, 'ffn_hidden': c.ffn_hidden, 'flops_per_token': flops}
    if c.match:
        what += f' (matched to the {c.match} params of the MoE {moe_layout(c)})'
    print(f'{c.config_name} | d_model {c.d_model}, {c.n_layer} layers, {c.n_head} heads, '
          f'vocab {c.vocab_size} | {what}')
    for key in ('embedding', 'lm_head', 'attention', 'ffn', 'router', 'norms', 'total', 'active'):
        print(f'  {key:<10} {n[key]:>12,}  ({n[key] / 1e6:.3f}M)')
    print(f'  training FLOPs per token: {flops:,} ({flops / 1e6:.3f}M)')
    if c.match:
        target = count_params(c, ffn='moe')[c.match]
        error = (n['total'] - target) / target
        summary.update(match=c.match, match_target=target, match_error=error)
        print(f'  matched to MoE {c.match} = {target:,}: off by {error:+.3%}')
    print(json.dumps(summary))


# ----------------------------------------------------------------------------- data
def check_prepared(c):
    """data_dir's meta.json, its files checked against the config before the run starts."""
    path = {name: os.path.join(c.data_dir, name) for name in ('train.bin', 'val.bin', 'meta.json')}
    tokenizer_arg, stories_arg = '', ''  # GPT-2 BPE, all of TinyStories: the paper's data
    if c.vocab_size == 257:  # bytes of 5,510 stories: the CPU recipe's
        tokenizer_arg, stories_arg = ' --tokenizer bytes', ' --hf_stories 5510'
    prep = f'python prepare.py --out_dir {c.data_dir}{stories_arg}{tokenizer_arg}'
    missing = [p for p in path.values() if not os.path.isfile(p)]
    if missing:
        raise UserError(f'{missing[0]} not found; prepare the data first: {prep} (or --input '
                        f'FILE{tokenizer_arg} for a local TinyStories text file)')
    try:
        meta = json.load(open(path['meta.json']))
        tokens = {split: meta[f'{split}_tokens'] for split in ('train', 'val')}
        data_vocab = meta['vocab_size']
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path['meta.json']} is corrupt ({e!r}); rerun {prep} --force")
    if data_vocab != c.vocab_size:
        raise UserError(f'the data in {c.data_dir} has vocab_size {data_vocab} '
                        f'({meta.get("tokenizer")} tokenizer) but the config says {c.vocab_size}: '
                        'use a config made for this data (cpu_* for bytes) or set vocab_size')
    fix = f'rerun {prep} --force'
    for split, n in tokens.items():
        bin_path = path[f'{split}.bin']
        if n < c.block_size + 1:
            raise UserError(f'{split} split has {n} tokens, fewer than block_size + 1 = '
                            f'{c.block_size + 1}')
        size = os.path.getsize(bin_path)
        if size != 2 * n:
            raise UserError(f'{bin_path} has {size} bytes but meta.json says {n} uint16 tokens: '
                            f'truncated or corrupt; {fix}')
        # an out-of-vocab id would crash the run midway (on CUDA: a device-side assert)
        top = int(np.memmap(bin_path, dtype=np.uint16, mode='r').max())
        if top >= c.vocab_size:
            raise UserError(f'{bin_path} holds token id {top} >= vocab_size {c.vocab_size}: it '
                            f'does not match its meta.json; {fix}')
    return meta


def load_data(c):
    """meta.json and the validation windows: evenly spaced, the same for every config and seed."""
    meta = check_prepared(c)
    val = np.memmap(os.path.join(c.data_dir, 'val.bin'), dtype=np.uint16, mode='r')
    n = max(1, min(c.eval_tokens, len(val) - 1) // c.block_size)
    starts = np.linspace(0, len(val) - c.block_size - 1, n).round().astype(np.int64)
    windows = np.stack([val[s:s + c.block_size + 1] for s in starts]).astype(np.int64)
    return meta, torch.from_numpy(windows)


def get_batch(c, step, device):
    """A step's windows from (data seed, step) alone: every config of a seed sees the same."""
    # a fresh memmap per batch: a long-lived one grows resident memory (nanoGPT's workaround)
    data = np.memmap(os.path.join(c.data_dir, 'train.bin'), dtype=np.uint16, mode='r')
    rng = np.random.default_rng([c.data_seed or c.seed, step])
    starts = rng.integers(0, len(data) - c.block_size, size=c.batch_size * c.grad_accum)
    windows = np.stack([data[s:s + c.block_size + 1] for s in starts]).astype(np.int64)
    windows = torch.from_numpy(windows)
    if device.type == 'cuda':  # through pinned memory, without waiting for the copy
        windows = windows.pin_memory().to(device, non_blocking=True)
    else:
        windows = windows.to(device)  # MPS; on the CPU the same tensor
    return windows[:, :-1], windows[:, 1:]


# ----------------------------------------------------------------------------- device and precision
def pick_device(c):
    """device = 'auto': a CUDA GPU, else Apple's MPS, else the CPU."""
    if c.device != 'auto':
        return torch.device(c.device)
    if torch.cuda.is_available():
        return torch.device('cuda')
    return torch.device('mps' if torch.backends.mps.is_available() else 'cpu')


def pick_dtype(c, device):
    """dtype = 'auto': bf16 on GPUs with bf16 tensor cores (compute capability 8+: A100, H100),
    fp16 with a GradScaler on older ones (V100, T4); fp32 on a CPU (bf16 is slow there), MPS."""
    if c.dtype != 'auto':
        return c.dtype
    if device.type != 'cuda':
        return 'float32'
    major, _ = torch.cuda.get_device_capability(device)
    return 'bfloat16' if major >= 8 else 'float16'


def compile_problem(device):
    """Why torch.compile cannot train on this device, or None."""
    if device.type == 'mps':
        return "torch.compile does not support Apple's MPS well enough to train"
    if device.type == 'cuda' and importlib.util.find_spec('triton') is None:
        return 'torch.compile needs Triton on a CUDA GPU, and it is not installed'
    return None


def setup_device(c):
    """-> (device, compile?, autocast, scaler); compile None: on for CUDA where it can work."""
    device = pick_device(c)
    if device.type == 'cuda' and 'LOCAL_RANK' in os.environ:  # torchrun: one GPU per process
        device = torch.device('cuda', int(os.environ['LOCAL_RANK']))
        torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = True
    dtype = pick_dtype(c, device)
    autocast = nullcontext()
    if dtype != 'float32':
        autocast = torch.autocast(device.type, dtype=getattr(torch, dtype))
    # fp16 gradients can underflow: the scaler scales the loss up and skips a step on inf or nan
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == 'float16')
    use_compile = device.type == 'cuda' if c.compile is None else c.compile
    problem = compile_problem(device)
    if use_compile and problem:
        print(f'compile is off: {problem}')
        use_compile = False
    return device, use_compile, autocast, scaler


# ----------------------------------------------------------------------------- training
@torch.no_grad()
def evaluate(model, val_windows, c, device, autocast, rank=0, world=1):
    """Mean CE and (MoE) routing over the validation windows; DDP: every world-th batch each."""
    model.eval()
    sum_dtype = torch.float32 if device.type == 'mps' else torch.float64  # MPS has no fp64
    total = torch.zeros((), dtype=sum_dtype, device=device)
    # a routing row per layer (E loads, entropy, log_z): a process with no batch all-reduces too
    routing = torch.zeros(c.n_layer, c.n_experts + 2, device=device)
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
    return val_loss, routing_record(routing / len(val_windows))


def param_groups(model, c):
    """AdamW's groups: matrices decayed, norm gains not; routers with their own lr and decay."""
    routers = [p for name, p in model.named_parameters() if name.endswith('router.weight')]
    router_ids = {id(p) for p in routers}  # by identity: `p in routers` would compare values
    rest = [p for p in model.parameters() if id(p) not in router_ids]
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


def so_far(it, c):
    """Every log line's start: steps, tokens, FLOPs."""
    tokens = it * c.batch_size * c.grad_accum * c.block_size
    return {'iter': it, 'tokens': tokens, 'flops': tokens * flops_per_token(c)}


class Meter:
    """A training line's figures since the last: each loss's mean over the micro-batches (summed
    on the device: no host sync), the first step whose loss was not finite, and tokens/s."""

    def __init__(self, c, start, iters, tokens_per_iter, device, world):
        self.c, self.iters, self.tokens_per_iter, self.world = c, iters, tokens_per_iter, world
        self.names = ('loss', 'ce', *AUX_LOSSES)  # a dense model's terms are the first two
        self.sums, self.n = 0, 0
        self.first_bad = torch.tensor(iters, device=device)  # iters: none yet
        self.last, self.t_last = start, time.time()  # where the line started

    def add(self, it, loss, ce, aux):
        terms = [loss, ce]
        if aux:
            terms += [aux[key] for key in AUX_LOSSES]
        self.sums, self.n = self.sums + torch.stack(terms).detach(), self.n + 1
        this_step = torch.where(loss.isfinite(), self.iters, it)  # iters where finite, else it
        self.first_bad = torch.minimum(self.first_bad, this_step)

    @contextmanager
    def paused(self):
        t = time.time()
        yield
        self.t_last += time.time() - t

    def line(self, done, last_saved):
        """The record after `done` steps. Stops on a loss that was not finite, before saving."""
        if self.world > 1:  # the earliest bad step of any process
            dist.all_reduce(self.first_bad, op=dist.ReduceOp.MIN)
        bad = self.first_bad.item()
        if bad < self.iters:
            have = 'none yet'
            if last_saved is not None:
                have = f'{self.c.out_dir}/latest.pt (iter {last_saved}), and best.pt'
            raise UserError(f'the loss is not finite (nan or inf) at iter {bad + 1}; stopped '
                            f'before saving from it. Last good checkpoint: {have}. Try a lower '
                            'learning_rate')
        means = runs.mean_over_processes(self.sums / self.n, self.world)
        now = time.time()
        tok_per_s = (done - self.last) * self.tokens_per_iter / (now - self.t_last)
        self.sums, self.n, self.last, self.t_last = 0, 0, done, now
        return {**so_far(done, self.c), **dict(zip(self.names, means.tolist())),
                'tok_per_s': tok_per_s}


def build(c, device, use_compile, ddp):
    """-> (model, optimizer, eval_model, train_model): the model (one seed: the same in every
    process), AdamW, what evaluation calls (compiled?) and what steps call (DDP's wrap of it)."""
    torch.manual_seed(c.seed)
    model = Transformer(c).to(device)
    counted, has = count_params(c)['total'], sum(p.numel() for p in model.parameters())
    assert counted == has, (f'count_params counts {counted:,} params, the model has {has:,}: '
                            'count a new parameter in count_params too')
    optimizer = torch.optim.AdamW(param_groups(model, c), lr=c.learning_rate,
                                  betas=(c.beta1, c.beta2), fused=device.type == 'cuda')
    eval_model = torch.compile(model) if use_compile else model
    train_model = DistributedDataParallel(eval_model) if ddp else eval_model
    return model, optimizer, eval_model, train_model


def main(argv):
    run(configure(argv))


def run(c):
    if c.print_params:  # counts, FLOPs per token and, matched, the MoE's counts: no data touched
        print_param_table(c)
        return
    meta, val_windows = load_data(c)
    ckpt = runs.checkpoint_to_resume(c, DEFAULTS)  # None: a new run
    device, use_compile, autocast, scaler = setup_device(c)
    rank, world = runs.start_processes(device)  # torchrun: a process per GPU, under DDP
    ddp, master = world > 1, rank == 0
    model, optimizer, eval_model, train_model = build(c, device, use_compile, ddp)

    # a step: grad_accum micro-batches of batch_size windows, over all processes together
    tokens_per_iter = c.batch_size * c.grad_accum * c.block_size
    iters = c.max_iters or math.ceil(c.max_tokens / tokens_per_iter)  # enough steps for max_tokens
    start, best_val = runs.restore(ckpt, model, optimizer, scaler, device)  # new run: 0, inf
    last_saved = start if ckpt else None  # the iter of latest.pt
    if master:  # out_dir, log.jsonl, config.json and the run's first console lines
        facts = {'params': count_params(c), 'iters': iters, 'tokens_per_iter': tokens_per_iter,
                 'flops_per_token': flops_per_token(c), 'device_used': device.type,
                 'dtype_used': pick_dtype(c, device), 'compile_used': use_compile,
                 'world_size': world}
        log = runs.start_run(c, facts, last_saved, moe_layout(c))
        if device.type == 'cpu':  # a config made for a GPU says so before its first evaluation
            runs.warn_if_beyond_a_cpu(model, c, get_batch(c, start, device), iters)
    meter = Meter(c, start, iters, tokens_per_iter, device, world)

    def save_checkpoint(name, it, best_val):
        with meter.paused():  # saving is not training: left out of tokens per second
            state = runs.checkpoint_state(model, optimizer, scaler, c, meta, it,
                                          it * tokens_per_iter, best_val, device)
            runs.save(os.path.join(c.out_dir, name), state)

    def evaluate_and_keep_best(it, best_val):
        """The eval line, and best.pt if the val loss improved. -> the best so far."""
        with meter.paused():  # evaluation is not training either
            val_loss, routing = evaluate(eval_model, val_windows, c, device, autocast, rank, world)
        if master:
            log.eval({**so_far(it, c), 'val_loss': val_loss, 'best_val': min(best_val, val_loss),
                      **routing}, iters)
            if val_loss < best_val:
                save_checkpoint('best.pt', it, val_loss)
        return min(best_val, val_loss)

    # this process's share of each step's micro-batches (grad_accum: a multiple of world, checked)
    my_micro = range(rank, c.grad_accum, world)
    for it in range(start, iters):
        # evaluation and best.pt, on the fixed validation set (and once more after the last step)
        if it % c.eval_interval == 0:
            best_val = evaluate_and_keep_best(it, best_val)

        # learning rate: warmup and cosine decay, times each group's multiple (the routers')
        lr = lr_at(it, c, iters)
        for group in optimizer.param_groups:
            group['lr'] = lr * group['lr_mult']

        # forward and backward: every process has the step's windows and takes its micro-batches
        x, y = get_batch(c, it, device)
        counts = 0  # this process's rows per expert and layer in the step, for bias balancing
        for i, micro in enumerate(my_micro):
            rows = slice(micro * c.batch_size, (micro + 1) * c.batch_size)
            last_micro = i == len(my_micro) - 1
            # DDP averages gradients over processes in the last micro-batch's backward only
            with train_model.no_sync() if ddp and not last_micro else nullcontext():
                with autocast:
                    _, ce, aux = train_model(x[rows], y[rows])
                    loss = training_loss(ce, aux, c)
                scaler.scale(loss / len(my_micro)).backward()  # scaled in fp16 only
            meter.add(it, loss, ce, aux)
            if c.bias_rate:
                counts = counts + aux['counts']

        # step: clip the gradient norm, AdamW (fp16: unscaled first, skipped on inf)
        scaler.unscale_(optimizer)
        if c.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        # bias balancing by the load of the step's whole batch: the same move in every process
        if c.bias_rate:
            if ddp:
                dist.all_reduce(counts)
            for block, layer_counts in zip(model.blocks, counts):
                block.ffn.update_bias(layer_counts)

        # log: the mean losses since the last line and the last micro-batch's routing, both over
        # the processes, and the speed; save latest.pt every ckpt_interval steps
        done = it + 1  # steps done; `iter` means the same in training and eval lines
        if done % c.log_interval == 0 or done == iters:
            record = {**meter.line(done, last_saved), 'lr': lr}
            if aux:  # the last micro-batch's
                record.update(routing_record(runs.mean_over_processes(aux['routing'], world)))
            if master:
                log.train(record, meter.names, iters)
                if done % c.ckpt_interval == 0 or done == iters:
                    if c.keep_checkpoints:  # for route.py --settle; before latest.pt, so that
                        save_checkpoint(f'ckpt_{done}.pt', done, best_val)  # none is missed
                    save_checkpoint('latest.pt', done, best_val)
                    last_saved = done
    best_val = evaluate_and_keep_best(iters, best_val)  # the trained model's

    if ddp:  # DDP's reducer freed first: a gloo group destroyed from it can hang (pytorch#56297)
        del train_model
        dist.destroy_process_group()
    if master:
        runs.finish_run(c, log, iters, iters * tokens_per_iter, best_val)


def command(argv):
    """train.py as a command: an error a user can fix, or a Ctrl-C, ends it in one line."""
    with one_line_errors('train.py'):
        c = configure(argv)
        with runs.ctrl_c_in_one_line(c):  # where the run stopped, how to go on from there
            run(c)


if __name__ == '__main__':
    command(sys.argv[1:])
