"""
tinymoe: dense vs Mixtral-style MoE LLaMA decoders on TinyStories, in one file.

    python train.py config/moe.py --seed=1                       # train; the defaults: paper recipe
    python train.py config/dense_total.py --print_params=True    # parameter table, touches no data
    python train.py config/moe.py --seed=1 --resume=True         # continue an interrupted run
    torchrun --standalone --nproc_per_node=4 train.py config/moe.py --grad_accum=4 --batch_size=32

Read top to bottom: config -> model -> parameter accounting -> data -> training loop. The paper's
three configs differ only in the FFN. Errors, device, files and checkpoints: plumbing.py.
"""
import math
import os
import sys
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import configurator
import plumbing
from plumbing import UserError, copy_rows, routing_row, routing_stats, unpack_routing, weighted_sum
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
top_k = 2                 # experts per token; their routing weights are renormalised to sum to 1
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
grad_accum = 1            # micro-batches per step, all processes together (nanoGPT: per process)
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


def configure(argv):
    """The defaults above, then config files and --key=value overrides (configurator.py)."""
    c = configurator.configure(dict(DEFAULTS), argv)
    configurator.check(c)
    if c.ffn == 'dense' and c.match:
        c.ffn_hidden = solve_ffn_hidden(c)
    return c


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
    """The dense FFN: down(silu(gate(x)) * up(x)), as in LLaMA (gate_proj, up_proj, down_proj), and
    each MoE expert's. `gate` is only ever this projection: what the router gives an expert is its
    routing weight. Returns (y, None): no aux, where the MoE returns (y, aux)."""

    def __init__(self, d_model, hidden, resid_std):
        super().__init__()
        self.gate = linear(d_model, hidden, 0.02)
        self.up = linear(d_model, hidden, 0.02)
        self.down = linear(hidden, d_model, resid_std)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x)), None


def group_by_expert(experts, n_experts):
    """The routing's assignments (one per token and chosen expert) grouped by expert, keeping their
    order within an expert. experts: each assignment's expert. -> order: the assignment in each
    grouped slot; slot: each assignment's slot; counts: assignments per expert. order and slot are
    inverse permutations: order[slot[a]] = a.

    The same as order = experts.argsort(stable=True) and counts = experts.bincount(n_experts), but
    written as a running count, which torch.compile keeps in one graph. Three tokens, top-2, three
    experts: six assignments, experts = [2, 0, 2, 1, 2, 0] (the first choices, then the second):

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


grouped_mm_on_cpu = False  # True: the GPU's grouped_mm on a CPU too (tests; the loop is faster)


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
    choice-major: assignment a sends token a % N to its (a // N)-th choice. Assignments 0 to N - 1
    are the tokens' first choices, N to 2N - 1 their second ones, and so on."""

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

    def aux(self, probs, log_z, counts):
        """The layer's aux losses and routing row, from route's probs, log_z and rows per expert."""
        E, N = probs.shape
        load = counts.float() / (N * self.top_k)  # f_i: the share of the assignments to expert i
        # Switch load balancing, E * sum_i f_i * P_i (P_i: the mean router probability of expert i,
        # over the tokens): 1 when balanced; E when one expert gets every token (at top-1). f_i is
        # counted, with no gradient: only P_i trains the router through this loss
        lb = E * (load * probs.mean(dim=1)).sum()
        z = log_z.square().mean()  # the z-loss keeps the router's logits small
        # routing health, for the logs: plumbing.routing_stats makes busiest_frac & co. of the row
        with torch.no_grad():
            # how sure the router is: each token's entropy over the experts, averaged; <= ln(E)
            entropy = -(probs * probs.clamp_min(1e-30).log()).sum(dim=0).mean()
            routing = routing_row(load, entropy, log_z.mean())
        return {'lb': lb, 'z': z, 'routing': routing}

    def route(self, x):
        """Each token's top_k experts and their routing weights. For N tokens, E experts, k top_k:

            x        (N, d)    the tokens
            probs    (E, N)    each token's softmax over the experts
            log_z    (N,)      the log of each token's softmax denominator, for the z-loss
            weights  (k * N,)  each assignment's routing weight, choice-major (a = choice * N + t)
            experts  (k * N,)  each assignment's expert, choice-major

        Experts first, (E, N), where Mixtral's code in transformers has (N, E): reductions over
        the experts then run along rows (10x faster on a CPU), and each `dim` below is the other
        one of theirs: dim 0 is the experts, dim 1 the tokens."""
        k = self.top_k
        # the router in fp32 even under autocast, as Switch Transformer's "selective precision"
        with torch.autocast(x.device.type, enabled=False):
            logits = self.router.weight.float() @ x.float().t()  # (E, N)
        log_z = logits.logsumexp(dim=0)
        probs = (logits - log_z).exp()  # the softmax over experts
        scores = probs
        if self.bias is not None:  # the bias picks the experts but never weighs them
            scores = probs + self.bias[:, None]
        experts = scores.topk(k, dim=0).indices  # (k, N): row c holds each token's c-th choice
        weights = probs.gather(0, experts)  # (k, N): their routing weights
        # Mixtral renormalises. At top-1 that would make every weight 1 and leave the router no
        # gradient from the loss, so top-1 keeps the probability (Switch)
        if k > 1:
            weights = weights / weights.sum(dim=0)
        # flattened row after row, the (k, N) tables become choice-major: a = c * N + t
        return probs, log_z, weights.flatten(), experts.flatten()

    def dispatch(self, x, weights, experts):
        """Dropless dispatch: each expert runs once, on the rows routed to it, grouped together.
        weights, experts: per assignment, choice-major (assignment a is token a % N's (a // N)-th
        choice). -> (y: each token's k expert outputs, weighted and summed; counts: rows per
        expert). tests/test_model.py's reference_dispatch computes the same as a plain loop."""
        N, k = x.shape[0], self.top_k
        order, slot, counts = group_by_expert(experts, self.n_experts)
        tokens = order % N  # slot s gets token tokens[s]'s row, for expert experts[order[s]]
        slots = slot.view(k, N).t().contiguous()  # token t's k slots: (N, k), copied once, read 3x
        weights = weights.view(k, N).t()  # and their routing weights, the same way
        # copy_rows(x, tokens, slots) is x[tokens]; weighted_sum(ys, weights, slots, tokens)[t] is
        # sum_c weights[t, c] * ys[slots[t, c]]: each with a faster backward (plumbing.py)
        ys = self.run_experts(copy_rows(x, tokens, slots), counts)
        y = weighted_sum(ys.float(), weights, slots, tokens)  # in fp32, also under autocast
        return y.to(x.dtype), counts

    @torch.no_grad()
    def update_bias(self, routing):
        """Aux-loss-free balancing (DeepSeek-V3), after an optimizer step: each expert's selection
        bias moves by bias_rate towards equal load (down if it got more than 1/E of the
        assignments, up if less). routing: this layer's routing row of the last micro-batch."""
        load, _, _ = unpack_routing(routing)
        self.bias += self.bias_rate * (1 / self.n_experts - load).sign()

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


# run_experts' loop needs the rows per expert as Python ints (counts.tolist()). This lets
# torch.compile keep them as symbols instead of breaking the graph there: one graph per step
torch._dynamo.config.capture_scalar_outputs = True


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


# the auxiliary losses each MoE layer returns in its aux dict: averaged over the layers, weighed
# into the training loss (training_loss) and logged by these names. A new one: add it here too
AUX_LOSSES = ('lb', 'z')


def merge_aux(layers):
    """The MoE layers' aux dicts -> the model's ({} for a dense model): each of AUX_LOSSES averaged
    over the layers, 'routing' (a routing row per layer) and the dicts themselves under 'layers'."""
    if not layers:
        return {}
    merged = {key: torch.stack([a[key] for a in layers]).mean() for key in AUX_LOSSES}
    return {**merged, 'routing': torch.stack([a['routing'] for a in layers]), 'layers': layers}


def training_loss(ce, aux, c):
    """CE plus the routers' auxiliary losses (mean over MoE layers). Validation reports CE alone."""
    if not aux:
        return ce
    return ce + c.aux_loss_coef * aux['lb'] + c.z_loss_coef * aux['z']


# ----------------------------------------------------------------------------- parameter accounting
def count_params(c, ffn=None):
    """Exact counts from the config alone, for its own FFN or for ffn = 'moe' | 'dense'. A dense
    config matched to an MoE holds that MoE's sizes (n_experts, top_k, moe_hidden, ...): ffn='moe'
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
    """The dense width whose params are closest to the MoE's active or total ones (c.match): the
    closest multiple of ffn_multiple_of (GPU-friendly shapes) if it is within match_tol, else the
    closest width of all. At cpu_moe's layout the routers round away: 176 and 352, 2x and 4x
    moe_hidden, the routers' params short of the target (--print_params shows both)."""
    target = count_params(c, ffn='moe')[c.match]
    dense = count_params(c, ffn='dense')
    # rest: the embedding, attention and norms, the same in the dense model and the MoE
    rest = dense['total'] - dense['ffn']
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
    """Training FLOPs per token, forward and backward: 6 per active matmul parameter (the output
    layer's included, the embedding lookup's not) plus causal attention, 6 * n_layer * block_size *
    d_model (scores and values over half the T x T square). train.py logs, bench.py and the GPU
    check all count with this."""
    n = count_params(c)
    head = c.vocab_size * c.d_model  # the output layer, tied to the embedding or not
    matmul = n['active'] - n['norms'] - n['embedding'] - n['lm_head'] + head
    return 6 * matmul + 6 * c.n_layer * c.block_size * c.d_model


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
    windows = plumbing.to_device(torch.from_numpy(windows), device)
    return windows[:, :-1], windows[:, 1:]


# ----------------------------------------------------------------------------- training
@torch.no_grad()
def evaluate(model, val_windows, c, device, autocast, rank=0, world=1):
    """Mean CE over the fixed validation windows and (MoE) the routing statistics over all of them.
    Under DDP each process takes every world-th batch and the sums are all-reduced."""
    model.eval()
    sum_dtype = torch.float32 if device.type == 'mps' else torch.float64  # MPS has no fp64
    total = torch.zeros((), dtype=sum_dtype, device=device)
    # a routing row per layer (routing_row's), in full: a process with no batch still all-reduces
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
    return val_loss, routing_stats(routing / len(val_windows))


def param_groups(model, c):
    """AdamW's groups: matrices decayed, norm gains not; the routers with their own learning rate
    and decay."""
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


def loss_terms(loss, ce, aux):
    """The losses a training line logs, as one tensor: (loss, ce), then AUX_LOSSES for an MoE."""
    terms = [loss, ce]
    if aux:
        terms += [aux[key] for key in AUX_LOSSES]
    return torch.stack(terms).detach()


def build(c, device, use_compile, ddp):
    """-> (model, optimizer, step_model, train_model): the model, the same in every process (one
    seed); AdamW; the model evaluation calls, compiled if use_compile; for training, DDP's wrap."""
    torch.manual_seed(c.seed)
    model = Transformer(c).to(device)
    counted, has = count_params(c)['total'], sum(p.numel() for p in model.parameters())
    assert counted == has, (f'count_params counts {counted:,} params, the model has {has:,}: '
                            'count a new parameter in count_params too')
    optimizer = torch.optim.AdamW(param_groups(model, c), lr=c.learning_rate,
                                  betas=(c.beta1, c.beta2), fused=device.type == 'cuda')
    step_model = torch.compile(model) if use_compile else model
    train_model = DistributedDataParallel(step_model) if ddp else step_model
    return model, optimizer, step_model, train_model


def main(argv):
    c = configure(argv)
    if c.print_params:  # counts, FLOPs per token and, matched, the MoE's counts: no data touched
        plumbing.print_param_table(c, count_params(c), count_params(c, ffn='moe'),
                                   flops_per_token(c))
        return
    meta, val_windows = load_data(c)
    ckpt = plumbing.checkpoint_to_resume(c, DEFAULTS)  # None: a new run
    device, use_compile, autocast, scaler = plumbing.setup_device(c)
    rank, world = plumbing.start_processes(device)  # torchrun: a process per GPU, under DDP
    ddp, master = world > 1, rank == 0
    model, optimizer, step_model, train_model = build(c, device, use_compile, ddp)

    # a step: grad_accum micro-batches of batch_size windows, counted over all processes together
    tokens_per_iter = c.batch_size * c.grad_accum * c.block_size
    iters = c.max_iters or math.ceil(c.max_tokens / tokens_per_iter)  # enough steps for max_tokens
    start, best_val = plumbing.restore(ckpt, model, optimizer, scaler, device)  # new run: 0, inf
    last_saved = start if ckpt else None  # the iter of latest.pt
    if master:  # out_dir, log.jsonl, config.json and the run's first console line
        log = plumbing.start_run(c, count_params(c), iters, tokens_per_iter, flops_per_token(c),
                                 device, use_compile, world, resumed_at=last_saved)
        if device.type == 'cpu':  # a config made for a GPU says so before its first evaluation
            plumbing.warn_if_beyond_a_cpu(model, c, get_batch(c, start, device), iters)
    meter = plumbing.Meter(device, start, iters, tokens_per_iter, flops_per_token(c), world)

    def save_checkpoint(name, it, best_val):
        """best.pt or latest.pt: all a run at step `it` needs to go on as if never stopped."""
        with meter.paused():  # saving is not training: left out of tokens per second
            state = plumbing.checkpoint_state(model, optimizer, scaler, c, meta, it,
                                              it * tokens_per_iter, best_val, device)
            plumbing.save(os.path.join(c.out_dir, name), state)

    def evaluate_and_keep_best(it, best_val):
        """The eval line at step `it`, and best.pt if the val loss improved. -> the best so far."""
        with meter.paused():  # evaluation is not training either
            val_loss, routing = evaluate(step_model, val_windows, c, device, autocast, rank, world)
        if master:
            log.eval({**meter.so_far(it), 'val_loss': val_loss,
                      'best_val': min(best_val, val_loss), **routing}, iters)
            if val_loss < best_val:
                save_checkpoint('best.pt', it, val_loss)
        return min(best_val, val_loss)

    my_micro = range(rank, c.grad_accum, world)  # this process's share of each step's micro-batches
    for it in range(start, iters):
        # evaluation and best.pt, on the fixed validation set (and once more after the last step)
        if it % c.eval_interval == 0:
            best_val = evaluate_and_keep_best(it, best_val)

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
            meter.add(it, loss, loss_terms(loss, ce, aux))
        # the last micro-batch's routing rows, one per MoE layer: for bias balancing and the log
        routing = aux['routing'] if aux else None

        # step: clip the gradient norm, AdamW (fp16: unscaled first, skipped on inf)
        scaler.unscale_(optimizer)
        if c.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        # bias balancing. Under DDP each process moves its own bias, and DDP copies rank 0's
        # buffers to the others at each forward
        if c.bias_rate:
            for block, layer_routing in zip(model.blocks, routing):
                block.ffn.update_bias(layer_routing)

        # log every log_interval steps: the mean losses since the last line, the last routing
        # (both averaged over the processes), the speed; latest.pt every ckpt_interval steps
        done = it + 1  # steps done; `iter` means the same in training and eval lines
        if done % c.log_interval == 0 or done == iters:
            # stops the run here if a loss was not finite, before anything is saved from it
            losses = ('loss', 'ce', *AUX_LOSSES)  # a dense model's line has the first two
            record = meter.line(done, losses, last_saved, c.out_dir)
            record['lr'] = lr
            if routing is not None:
                record.update(routing_stats(plumbing.mean_over_processes(routing, world)))
            if master:
                log.train(record, losses, iters, meter.time_left(done))
                if done % c.ckpt_interval == 0 or done == iters:
                    if c.keep_checkpoints:  # route.py --settle reads them; before latest.pt,
                        save_checkpoint(f'ckpt_{done}.pt', done, best_val)  # so none is missed
                    save_checkpoint('latest.pt', done, best_val)
                    last_saved = done
    best_val = evaluate_and_keep_best(iters, best_val)  # the trained model's

    if ddp:  # DDP's reducer freed first: a gloo group destroyed from it can hang (pytorch#56297)
        del train_model
        dist.destroy_process_group()
    if master:
        plumbing.finish_run(c, log, iters, iters * tokens_per_iter, best_val)


def command(argv):
    """train.py as a command: an error a user can fix, or a Ctrl-C, ends it in one line."""
    with plumbing.one_line_errors('train.py'):
        c = configure(argv)
        with plumbing.ctrl_c_in_one_line(c):  # where the run stopped, how to go on from there
            main(argv)


if __name__ == '__main__':
    command(sys.argv[1:])
