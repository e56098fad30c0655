"""
tinymoe: dense vs Mixtral-style MoE LLaMA decoders on TinyStories, in one file.

    python train.py config/moe.py --seed=1                  # train (defaults below = the paper recipe)
    python train.py config/dense_total.py --print_params=True  # parameter table, touches no data
    python train.py config/moe.py --seed=1 --resume=True    # continue an interrupted run exactly
    torchrun --standalone --nproc_per_node=4 train.py config/moe.py --grad_accum=4 --batch_size=32  # DDP

Read top to bottom: config -> model -> parameter accounting -> data -> training loop. The paper's three configs
share the defaults below and differ only in the FFN; config files, then --key=value overrides, replace them.
"""
import datetime
import json
import math
import os
import pickle
import platform
import sys
import time
import types
import warnings
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import configurator
from configurator import die
from prepare import UserError, check_prepared

# ----------------------------------------------------------------------------- config
out_dir = ''              # '' -> out/{config_name}-s{seed}[-d{data_seed}], so seeds never overwrite each other
config_name = ''          # '' -> file name of the last config file ('default' without one)
data_dir = 'data/tinystories'  # train.bin, val.bin, meta.json written by prepare.py
seed = 1                  # seeds init and the training-data order
data_seed = 0             # 0 -> seed; another value changes the data order alone (seed-noise studies)
print_params = False      # print the parameter table (and one JSON line) and exit, touching no data
# model: LLaMA-style. 160 x 4 layers fits the paper's 14.77M active / 21.06M total beside an 8.04M tied embedding
vocab_size = 50257        # >= the tokenizer's vocabulary (meta.json); GPT-2 BPE
block_size = 512          # context; TinyStories stories are ~200 GPT-2 tokens, so a window holds 2-3
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
bias_rate = 0.0           # > 0: aux-loss-free balancing (DeepSeek-V3), a selection-only bias per expert moved this much
shared_hidden = 0         # > 0: one always-on SwiGLU expert this wide beside the routed ones (DeepSeekMoE)
router_init_std = 0.02    # 0: a zero router, every expert equally likely at the start
router_lr_mult = 1.0      # the routers' learning rate as a multiple of learning_rate
router_decay = True       # weight decay on the routers (as on every matrix)
match = ''                # dense only: 'active' | 'total' = size ffn_hidden to the MoE's active/total params
match_tol = 0.01          # largest allowed relative param mismatch of a matched dense model
# optimisation: 426.3M tokens in 6,505 steps of 64Ki; many steps matter more than big batches for MoE routers
batch_size = 128          # sequences per micro-batch
grad_accum = 1            # micro-batches per optimizer step
max_tokens = 426_300_000  # token budget; iterations = max_tokens / tokens per step, rounded up
max_iters = 0             # if > 0, overrides max_tokens
learning_rate = 2e-3
min_lr = 2e-4             # cosine decay ends here (a tenth of the peak, as in LLaMA)
warmup_frac = 0.02        # linear warmup over this fraction of the iterations
weight_decay = 0.1        # on >= 2-D weights only
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
# evaluation and logging: one fixed set of validation windows for every config and seed
eval_interval = 250
eval_tokens = 2**20       # size of the fixed validation set (capped at the whole split)
log_interval = 50
ckpt_interval = 250       # steps between saves of out_dir/latest.pt, for resuming (a multiple of log_interval)
resume = False            # continue the run in out_dir from its latest.pt, exactly as if never stopped
# system
device = 'auto'           # 'auto' -> cuda if available, else cpu
compile = None            # torch.compile; None -> on for CUDA, off for CPU

DEFAULTS = {k: v for k, v in globals().items()
            if not k.startswith('_') and isinstance(v, (bool, int, float, str, type(None)))}


def configure(argv):
    """The defaults above, then config files and --key=value overrides (configurator.py), checked."""
    c = configurator.configure(dict(DEFAULTS), argv)
    configurator.check(c)
    if c.ffn == 'dense' and c.match:
        c.ffn_hidden = solve_ffn_hidden(c)
    return c


# The expert loop needs the tokens per expert as ints: compiled, they become symbolic sizes (one graph, any routing)
torch._dynamo.config.capture_scalar_outputs = True


# ----------------------------------------------------------------------------- model
def linear(d_in, d_out, std):
    layer = nn.Linear(d_in, d_out, bias=False)
    nn.init.normal_(layer.weight, std=std)
    return layer


def rope_cache(head_dim, length, theta):
    """cos/sin in Llama's rotate-half layout (dimension i pairs with i + head_dim/2): export is a rename, no permute."""
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
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    """The dense FFN: down(silu(gate(x)) * up(x)), as in LLaMA."""
    def __init__(self, d_model, hidden, resid_std):
        super().__init__()
        self.gate = linear(d_model, hidden, 0.02)
        self.up = linear(d_model, hidden, 0.02)
        self.down = linear(hidden, d_model, resid_std)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    """Mixtral-style routed SwiGLU experts, dropless: every token goes to each of its top_k experts.
    Returns (y, aux): aux holds this layer's load-balancing loss, z-loss and routing statistics."""

    def __init__(self, c, resid_std):
        super().__init__()
        self.n_experts, self.top_k = c.n_experts, c.top_k
        E, d, h = c.n_experts, c.d_model, c.moe_hidden
        self.router = linear(d, E, c.router_init_std)
        self.gate = nn.Parameter(torch.randn(E, d, h) * 0.02)
        self.up = nn.Parameter(torch.randn(E, d, h) * 0.02)
        self.down = nn.Parameter(torch.randn(E, h, d) * resid_std)
        self.shared = SwiGLU(d, c.shared_hidden, resid_std) if c.shared_hidden else None
        self.register_buffer('bias', torch.zeros(E) if c.bias_rate else None)  # moved by the loop, not by gradients

    def forward(self, x):
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        N, E, k = x.shape[0], self.n_experts, self.top_k
        probs, log_z, weights, experts = self.route(x)
        y, counts = self.dispatch(x, weights, experts)
        if self.shared is not None:  # every token also goes through the shared expert, ungated
            y = y + self.shared(x)
        load = counts.float() / (N * k)  # f_i: share of assignments that go to expert i
        with torch.no_grad():  # routing health for the logs, packed in one row: no host sync, one op to average
            entropy = -(probs * probs.clamp_min(1e-30).log()).sum(dim=0).mean()  # nats, at most ln(E)
            routing = torch.cat([load, entropy.view(1), log_z.mean().view(1)])  # [load_0..load_E-1, entropy, log_z]
        return y.view(shape), {'lb': E * (load * probs.mean(dim=1)).sum(),  # Switch: 1 when balanced, E collapsed
                               'z': log_z.square().mean(), 'routing': routing}

    def route(self, x):
        """x (N, d) -> probs (E, N), log_z (N,), the N*k assignments' gate weights and experts (a: token a % N)."""
        k = self.top_k
        # fp32 even under autocast; (E, N), experts first: reductions over experts run along rows (10x faster on CPU)
        with torch.autocast(x.device.type, enabled=False):
            logits = self.router.weight.float() @ x.float().t()  # (E, N)
        log_z = logits.logsumexp(dim=0)  # (N,), for the z-loss
        probs = (logits - log_z).exp()  # the softmax over experts
        scores = probs if self.bias is None else probs + self.bias[:, None]  # the bias picks experts, never weighs
        experts = scores.topk(k, dim=0).indices  # (k, N): each token's k experts
        weights = probs.gather(0, experts)  # and their gate weights
        if k > 1:  # Mixtral renormalises; at top-1 that gives weight 1 and no router gradient: keep it (Switch)
            weights = weights / weights.sum(dim=0)
        return probs, log_z, weights.flatten(), experts.flatten()

    def dispatch(self, x, weights, experts):
        """Each expert on its own contiguous slice of the assignments, grouped by expert; then back to assignment
        order, each token summing its k outputs, gate-weighted. -> (y, assignments per expert)"""
        N, E, k = x.shape[0], self.n_experts, self.top_k
        # = experts.argsort(stable=True), without a sort (compile-friendly): running counts over an (E, N*k) grid
        place = (experts == torch.arange(E, device=x.device)[:, None]).flatten().cumsum(0).view(E, -1)
        rank = place.gather(0, experts[None]).squeeze(0) - 1  # assignment -> grouped row
        order = torch.empty_like(rank).scatter_(0, rank, torch.arange(len(rank), device=x.device))  # row -> assignment
        counts = place[:, -1].diff(prepend=place.new_zeros(1))
        xs = gather_rows(x, order % N, rank)  # (N*k, d): each token's row once per expert it goes to, grouped
        ys = gather_rows(self.experts(xs, counts), rank, order).view(k, N, -1)  # back to assignment order
        y = (ys.float() * weights.view(k, N, 1)).sum(dim=0)  # combined in fp32, also under autocast
        return y.to(x.dtype), counts

    def experts(self, xs, counts):
        """Each expert's SwiGLU on its slice of xs (grouped by expert, counts[e] rows for expert e)."""
        if torch.is_autocast_enabled(xs.device.type):  # autocast does not cover grouped_mm: cast as it would
            xs = xs.to(torch.get_autocast_dtype(xs.device.type))
        if grouped_mm_ok(xs, self.gate.shape[-1]):  # one kernel per matrix for all experts, no host sync
            ends = counts.cumsum(0).to(torch.int32)
            gate, up, down = (w.to(xs.dtype) for w in (self.gate, self.up, self.down))
            h = F.silu(F.grouped_mm(xs, gate, offs=ends)) * F.grouped_mm(xs, up, offs=ends)
            return F.grouped_mm(h, down, offs=ends)
        # else a loop (tolist() waits for the routing); unbind: self.gate[e]'s gradient is a zeroed (E, d, h) each
        gate, up, down = self.gate.unbind(0), self.up.unbind(0), self.down.unbind(0)
        return torch.cat([(F.silu(xe @ gate[e]) * (xe @ up[e])) @ down[e]
                          for e, xe in enumerate(xs.split(counts.tolist()))])


class GatherRows(torch.autograd.Function):
    """x.repeat(copies, 1)[perm] without the repeat (copies = k: each token to its k experts; 1: undo a permutation),
    whose gradient is a gather by the inverse permutation, not a scatter-add (atomic adds in compiled CPU code)."""

    @staticmethod
    def forward(ctx, x, rows, inverse):  # rows = perm % len(x); inverse: perm's inverse
        ctx.save_for_backward(inverse)
        ctx.n_rows = x.shape[0]
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad):
        inverse, = ctx.saved_tensors
        grad = grad.index_select(0, inverse)
        if grad.shape[0] > ctx.n_rows:
            grad = grad.view(-1, ctx.n_rows, grad.shape[-1]).sum(dim=0)
        return grad, None, None


gather_rows = GatherRows.apply


def grouped_mm_ok(x, hidden):
    """F.grouped_mm (torch >= 2.8) wants bf16 on a CUDA GPU and rows aligned to 16 bytes (widths % 8 == 0)."""
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(F, 'grouped_mm') and x.shape[-1] % 8 == hidden % 8 == 0


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        resid_std = 0.02 / math.sqrt(2 * c.n_layer)  # residual projections scaled down, as in GPT-2
        self.attn_norm = nn.RMSNorm(c.d_model, eps=c.norm_eps)
        self.attn = Attention(c, resid_std)
        self.ffn_norm = nn.RMSNorm(c.d_model, eps=c.norm_eps)
        self.ffn = MoE(c, resid_std) if c.ffn == 'moe' else SwiGLU(c.d_model, c.ffn_hidden, resid_std)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.ffn_norm(x)
        y, aux = self.ffn(h) if isinstance(self.ffn, MoE) else (self.ffn(h), None)
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
        """-> (logits, None, aux) without targets, (None, ce, aux) with them. aux ({} if dense): the MoE layers'
        mean 'lb' and 'z', their dicts under 'layers', and 'routing' (a row per layer) for routing_stats()."""
        T = idx.shape[1]
        x = self.embed(idx)
        layers = []
        for block in self.blocks:
            x, aux = block(x, self.cos[:T], self.sin[:T])
            if aux is not None:
                layers.append(aux)
        aux = {'lb': torch.stack([a['lb'] for a in layers]).mean(), 'z': torch.stack([a['z'] for a in layers]).mean(),
               'layers': layers, 'routing': torch.stack([a['routing'] for a in layers])} if layers else {}
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits, None, aux
        ce = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return None, ce, aux


def routing_stats(routing):
    """Routing health from the per-layer rows of aux['routing'], per layer and as the mean over layers.
    busiest_frac = max_i load_i (1/n_experts is perfect balance, 1.0 a collapsed top-1 router)."""
    routing = routing.cpu()  # one host sync
    layers = [{'load': row[:-2].tolist(), 'busiest_frac': row[:-2].max().item(),
               'usage_var': row[:-2].var(unbiased=False).item(), 'router_entropy': row[-2].item(),
               'log_z': row[-1].item()} for row in routing]
    mean = {key: sum(layer[key] for layer in layers) / len(layers)
            for key in ('busiest_frac', 'usage_var', 'router_entropy', 'log_z')}
    return {'load': routing[:, :-2].mean(dim=0).tolist(), **mean, 'dropped_frac': 0.0, 'layers': layers}  # dropless


def training_loss(ce, aux, c):
    """CE plus the routers' auxiliary losses (mean over MoE layers). Validation reports CE alone."""
    return ce + c.aux_loss_coef * aux['lb'] + c.z_loss_coef * aux['z'] if aux else ce


# ----------------------------------------------------------------------------- parameter accounting
def count_params(c):
    """Exact counts from the config alone; active = total minus the experts a token does not use."""
    d, L, V = c.d_model, c.n_layer, c.vocab_size
    n = {'embedding': V * d, 'lm_head': 0 if c.tie_embeddings else V * d,
         'attention': L * 4 * d * d, 'norms': (2 * L + 1) * d}
    if c.ffn == 'moe':
        per_expert = 3 * d * c.moe_hidden
        n['ffn'], n['router'] = L * (c.n_experts * per_expert + 3 * d * c.shared_hidden), L * c.n_experts * d
        unused = L * (c.n_experts - c.top_k) * per_expert
    else:
        n['ffn'], n['router'], unused = L * 3 * d * c.ffn_hidden, 0, 0
    n['total'] = sum(n.values())
    n['active'] = n['total'] - unused
    return n


def solve_ffn_hidden(c):
    """The dense width (a multiple of ffn_multiple_of) whose params are closest to the MoE's active or total ones."""
    target = count_params(types.SimpleNamespace(**{**vars(c), 'ffn': 'moe'}))[c.match]
    base = count_params(types.SimpleNamespace(**{**vars(c), 'ffn': 'dense', 'ffn_hidden': 0}))['total']
    per_unit, m = 3 * c.d_model * c.n_layer, c.ffn_multiple_of
    hidden = max(m, round((target - base) / per_unit / m) * m)
    mismatch = (base + per_unit * hidden - target) / target
    if abs(mismatch) > c.match_tol:
        die(f'no dense width matches the MoE {c.match} params ({target:,}) within match_tol={c.match_tol}: '
            f'the closest, ffn_hidden={hidden}, is off by {mismatch:+.2%}; change ffn_multiple_of or match_tol')
    return hidden


def print_param_table(c):
    n = count_params(c)
    what = (f'moe: {c.n_experts} experts, top-{c.top_k}, expert hidden {c.moe_hidden}'
            + f', shared expert {c.shared_hidden}' * bool(c.shared_hidden) if c.ffn == 'moe' else
            f'dense: ffn_hidden {c.ffn_hidden}' + (f' (matched to the MoE {c.match} params)' if c.match else ''))
    print(f'{c.config_name} | d_model {c.d_model}, {c.n_layer} layers, {c.n_head} heads, vocab {c.vocab_size} | {what}')
    for key in ('embedding', 'lm_head', 'attention', 'ffn', 'router', 'norms', 'total', 'active'):
        print(f'  {key:<10} {n[key]:>12,}  ({n[key] / 1e6:.3f}M)')
    summary = {**n, 'ffn_hidden': c.moe_hidden if c.ffn == 'moe' else c.ffn_hidden}
    if c.match:
        target = count_params(types.SimpleNamespace(**{**vars(c), 'ffn': 'moe'}))[c.match]
        summary.update(match=c.match, match_target=target, match_error=(n['total'] - target) / target)
        print(f'  matched to MoE {c.match} = {target:,}: off by {summary["match_error"]:+.3%}')
    print(json.dumps(summary))


# ----------------------------------------------------------------------------- data
def load_data(c):
    """The prepared data's meta (prepare.py checks its files against the config) and the fixed validation windows."""
    try:
        meta = check_prepared(c.data_dir, c.vocab_size, c.block_size)
    except UserError as e:
        die(str(e))
    val = np.memmap(os.path.join(c.data_dir, 'val.bin'), dtype=np.uint16, mode='r')
    # the fixed validation set: evenly spaced windows over the whole split, the same for every config and seed
    n = max(1, min(c.eval_tokens, len(val) - 1) // c.block_size)
    starts = np.linspace(0, len(val) - c.block_size - 1, n).round().astype(np.int64)
    return meta, torch.from_numpy(np.stack([val[s:s + c.block_size + 1] for s in starts]).astype(np.int64))


def get_batch(c, step, device):
    """All windows of one optimizer step, from (data seed, step) alone: the same data order for every config of a
    seed, and a resumed run needs nothing but the step number."""
    # a fresh memmap per batch: a long-lived one grows resident memory (nanoGPT's workaround)
    data = np.memmap(os.path.join(c.data_dir, 'train.bin'), dtype=np.uint16, mode='r')
    rng = np.random.default_rng([c.data_seed or c.seed, step])
    starts = rng.integers(0, len(data) - c.block_size, size=c.batch_size * c.grad_accum)
    windows = torch.from_numpy(np.stack([data[s:s + c.block_size + 1] for s in starts]).astype(np.int64))
    if device.type == 'cuda':
        windows = windows.pin_memory().to(device, non_blocking=True)
    return windows[:, :-1], windows[:, 1:]


@torch.no_grad()
def evaluate(model, val_windows, c, device, autocast, rank=0, world=1):
    """Mean CE over the fixed validation windows, and (MoE) routing statistics over all of them. Under DDP each
    process takes every world-th batch and the sums are all-reduced: no process waits for another's evaluation."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    routing = torch.zeros(c.n_layer, c.n_experts + 2, device=device)  # rows as in aux['routing']
    for batch in val_windows.split(c.batch_size)[rank::world]:
        batch = batch.to(device)
        with autocast:
            _, ce, aux = model(batch[:, :-1], batch[:, 1:])
        total += ce.double() * len(batch)
        if aux:  # every window has block_size tokens: weighting by windows weights by tokens
            routing += aux['routing'] * len(batch)
    for t in (total, routing) if world > 1 else ():
        dist.all_reduce(t)
    model.train()
    return total.item() / len(val_windows), routing_stats(routing / len(val_windows)) if c.ffn == 'moe' else {}


def save(path, obj):
    """torch.save (json for a .json path) to a temp file, fsync, rename: a kill or an error mid-write leaves the
    previous file intact."""
    tmp = path + '.tmp'
    try:
        with open(tmp, 'wb') as f:
            f.write(json.dumps(obj, indent=2).encode()) if path.endswith('.json') else torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path):
    """Tensors and plain containers only (weights_only): opening a checkpoint someone shared cannot run code."""
    try:
        with warnings.catch_warnings():  # torch warns about some refused files: the one line below says it all
            warnings.simplefilter('ignore')
            return torch.load(path, map_location='cpu', weights_only=True)
    except pickle.UnpicklingError:  # it names something to import and call (how a pickle runs code), or is damaged
        die(f'{path} is not a plain checkpoint (damaged, or it holds more than tensors and plain data): refusing '
            'to unpickle arbitrary objects')


def load_resume_checkpoint(path, c):
    """latest.pt of an interrupted run, checked against this run's config."""
    try:
        ckpt = load_checkpoint(path)
        saved = ckpt['config']
    except Exception as e:
        die(f'{path} cannot be loaded ({type(e).__name__}); remove it to start over')
    may_differ = {'resume', 'device', 'compile', 'out_dir', 'data_dir'}
    # a key newer than the checkpoint counts as its default, which is how the older code behaved
    changed = sorted(k for k in DEFAULTS if k not in may_differ and saved.get(k, DEFAULTS[k]) != getattr(c, k))
    if changed:
        die(f'{path} was written with another config ({", ".join(f"{k}={saved.get(k)!r}" for k in changed)}); '
            'resume with the same settings, or train into another --out_dir')
    return ckpt


# ----------------------------------------------------------------------------- training
def param_groups(model, c):
    """AdamW's groups: matrices decayed, norm gains not; the routers with their own learning rate and decay."""
    routers = [p for name, p in model.named_parameters() if name.endswith('router.weight')]
    rest = [p for p in model.parameters() if all(p is not r for r in routers)]
    return [{'params': [p for p in rest if p.dim() >= 2], 'weight_decay': c.weight_decay, 'lr_mult': 1.0},
            {'params': [p for p in rest if p.dim() < 2], 'weight_decay': 0.0, 'lr_mult': 1.0},
            {'params': routers, 'weight_decay': c.weight_decay * c.router_decay, 'lr_mult': c.router_lr_mult}]


def setup_device(c):
    """-> (device, compile?, autocast): bf16 and compiled on GPU; fp32, eager on CPU (bf16 is slow there)."""
    device = torch.device('cuda' if c.device == 'auto' and torch.cuda.is_available() else
                          'cpu' if c.device == 'auto' else c.device)
    if device.type == 'cuda' and 'LOCAL_RANK' in os.environ:  # torchrun: one GPU per process
        device = torch.device('cuda', int(os.environ['LOCAL_RANK']))
        torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = True
    autocast = torch.autocast('cuda', dtype=torch.bfloat16) if device.type == 'cuda' else nullcontext()
    return device, device.type == 'cuda' if c.compile is None else c.compile, autocast


def cpu_name():
    """CPU model, vector ISA, torch threads: a bit-for-bit rerun needs all three the same (they change the rounding)."""
    info = open('/proc/cpuinfo').read() if os.path.exists('/proc/cpuinfo') else ''
    model = next((line.split(':', 1)[1].strip() for line in info.splitlines() if line.startswith('model name')), '')
    isa, threads = torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()
    return f'{model or platform.machine()} ({isa}), {threads} threads'


def lr_at(it, c, iters):
    """Linear warmup to learning_rate, then cosine decay to min_lr at the last iteration."""
    warmup = max(1, round(c.warmup_frac * iters))
    if it < warmup:
        return c.learning_rate * (it + 1) / warmup
    progress = (it - warmup) / max(1, iters - 1 - warmup)
    return c.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (c.learning_rate - c.min_lr)


def open_log(log_path, start):
    """log.jsonl for appending, cut back on resume to the lines before iter `start` (a torn last line is dropped)."""
    keep = ''
    for line in open(log_path) if start is not None and os.path.exists(log_path) else []:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r['iter'] < start or (r['iter'] == start and 'val_loss' not in r):
            keep += json.dumps(r) + '\n'
    with open(log_path + '.tmp', 'w') as f:
        f.write(keep)
    os.replace(log_path + '.tmp', log_path)
    return open(log_path, 'a', buffering=1)  # line-buffered: each record is on disk once written


def main(argv):
    c = configure(argv)
    if c.print_params:
        print_param_table(c)
        return
    meta, val_windows = load_data(c)
    # torchrun sets RANK and WORLD_SIZE: one process per GPU (or CPU process), gradients averaged by DDP
    rank, world = int(os.environ.get('RANK', 0)), int(os.environ.get('WORLD_SIZE', 1))
    ddp, master = world > 1, rank == 0
    log_path, latest_path = (os.path.join(c.out_dir, name) for name in ('log.jsonl', 'latest.pt'))
    ckpt = load_resume_checkpoint(latest_path, c) if c.resume and os.path.isfile(latest_path) else None
    if os.path.exists(log_path) and not c.resume:
        die(f'{c.out_dir} already holds a run (log.jsonl): continue it with --resume=True, or choose another '
            '--out_dir (or remove that folder)')

    device, use_compile, autocast = setup_device(c)
    if ddp:
        dist.init_process_group('nccl' if device.type == 'cuda' else 'gloo')
    torch.manual_seed(c.seed)
    model = Transformer(c).to(device)
    params = count_params(c)
    assert params['total'] == sum(p.numel() for p in model.parameters()), 'parameter accounting is off'
    optimizer = torch.optim.AdamW(param_groups(model, c), lr=c.learning_rate, betas=(c.beta1, c.beta2),
                                  fused=device.type == 'cuda')
    step_model = torch.compile(model) if use_compile else model
    train_model = torch.nn.parallel.DistributedDataParallel(step_model) if ddp else step_model

    tokens_per_iter = c.batch_size * c.grad_accum * c.block_size  # global: over all processes
    iters = c.max_iters or -(-c.max_tokens // tokens_per_iter)  # enough steps to see at least max_tokens
    start, best_val = 0, float('inf')
    if ckpt:  # everything a step depends on: weights, optimizer moments, step number (-> data, lr), RNG
        model.load_state_dict(ckpt['model'])
        optimizer.load_state_dict(ckpt['optimizer'])
        start, best_val = ckpt['iter'], ckpt['best_val']
        torch.set_rng_state(ckpt['rng']['torch'])
        if ckpt['rng']['cuda'] is not None and device.type == 'cuda':
            torch.cuda.set_rng_state(ckpt['rng']['cuda'], device)
    if master:
        os.makedirs(c.out_dir, exist_ok=True)
        log_file = open_log(log_path, start if ckpt else None)
        save(os.path.join(c.out_dir, 'config.json'), {
            **vars(c), 'params': params, 'iters': iters, 'tokens_per_iter': tokens_per_iter, 'device_used': device.type,
            'compile_used': use_compile, 'world_size': world, 'cpu': cpu_name(), 'torch': torch.__version__})
        how = f'{device.type}{" compiled" * use_compile}{f" x {world} processes" * ddp} -> {c.out_dir}'
        print(f'{c.config_name}: {params["total"] / 1e6:.3f}M params ({params["active"] / 1e6:.3f}M active), '
              f'{iters} iters x {tokens_per_iter} tokens, {how}'
              + (f', resumed at iter {start}' if ckpt else ', nothing to resume' * c.resume))

    def checkpoint(name, it):
        save(os.path.join(c.out_dir, name), {
            'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'config': vars(c), 'meta': meta,
            'iter': it, 'tokens': it * tokens_per_iter, 'best_val': best_val,
            'rng': {'torch': torch.get_rng_state(),
                    'cuda': torch.cuda.get_rng_state(device) if device.type == 'cuda' else None}})

    last_saved = start if ckpt else None  # the iter of latest.pt
    sums, n_sums = 0, 0  # running (loss, ce[, lb, z]) since the last log line, summed on the device
    first_bad = torch.tensor(iters, device=device)  # first step with a non-finite loss (iters: none), no sync
    t_start = t_last = time.time()
    tokens_last = start * tokens_per_iter
    my_micro = range(rank, c.grad_accum, world)  # this process's share of every step's micro-batches
    for it in range(start, iters + 1):
        if it % c.eval_interval == 0 or it == iters:  # every process evaluates its share of the windows
            t_eval = time.time()
            val_loss, routing = evaluate(step_model, val_windows, c, device, autocast, rank, world)
            improved, best_val = val_loss < best_val, min(best_val, val_loss)
            if master:
                log_file.write(json.dumps({'iter': it, 'tokens': it * tokens_per_iter, 'val_loss': val_loss,
                                           'best_val': best_val, **routing}) + '\n')
                print(f'eval {it}/{iters} | val {val_loss:.4f} | best {best_val:.4f}' +
                      ''.join(f' | {key} {routing[key]:.3f}' for key in ('busiest_frac', 'router_entropy') if routing))
            if master and improved:
                checkpoint('best.pt', it)
            t_last += time.time() - t_eval  # throughput excludes evaluation
        if it == iters:
            break

        lr = lr_at(it, c, iters)
        for group in optimizer.param_groups:
            group['lr'] = lr * group['lr_mult']
        x, y = get_batch(c, it, device)  # the whole step's windows, the same in every process
        for i, micro in enumerate(my_micro):
            rows = slice(micro * c.batch_size, (micro + 1) * c.batch_size)
            # DDP averages gradients over processes in the last micro-batch's backward only
            with train_model.no_sync() if ddp and i < len(my_micro) - 1 else nullcontext():
                with autocast:
                    _, ce, aux = train_model(x[rows], y[rows])
                    loss = training_loss(ce, aux, c)
                (loss / len(my_micro)).backward()
            sums = sums + torch.stack([loss, ce] + ([aux['lb'], aux['z']] if aux else [])).detach()
            n_sums += 1
            first_bad = torch.where(loss.isfinite(), first_bad, first_bad.clamp(max=it))
        if c.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for block, row in zip(model.blocks, aux['routing'] if c.bias_rate else []):  # (DDP: rank 0's bias is used)
            block.ffn.bias += c.bias_rate * (1 / c.n_experts - row[:-2]).sign()  # towards equal load: last micro-batch

        done = it + 1  # steps done; `iter` means the same in training and eval lines
        if done % c.log_interval == 0 or done == iters:
            if ddp:
                dist.all_reduce(first_bad, op=dist.ReduceOp.MIN)
            if first_bad.item() < iters:  # stop before anything is saved from a broken model
                have = 'none yet' if last_saved is None else f'{latest_path} (iter {last_saved}), and best.pt'
                die(f'the loss is not finite (nan or inf) at iter {first_bad.item() + 1}; stopped before saving '
                    f'anything from it. Last good checkpoint: {have}. Try a lower learning_rate')
            stats = [sums / n_sums] + ([aux['routing']] if aux else [])  # routing: of the last micro-batch
            for t in stats if ddp else []:  # each process logs what it saw; the log shows the mean over all
                dist.all_reduce(t)
                t /= world
            means = dict(zip(('loss', 'ce', 'lb', 'z'), stats[0].tolist()))
            routing = routing_stats(stats[1]) if aux else {}
            now, tokens = time.time(), done * tokens_per_iter
            tok_per_s = (tokens - tokens_last) / (now - t_last)
            if master:
                log_file.write(json.dumps({'iter': done, 'tokens': tokens, **means, 'lr': lr, 'tok_per_s': tok_per_s,
                                           **routing}) + '\n')
                eta = datetime.timedelta(seconds=round((now - t_start) / (done - start) * (iters - done)))
                losses = ' | '.join(f'{k} {v:.4f}' for k, v in means.items())
                busy = f' | busiest {routing["busiest_frac"]:.3f}' if routing else ''
                print(f'iter {done}/{iters} ({done / iters:.0%}) | {losses}{busy} | lr {lr:.2e} | '
                      f'{tok_per_s / 1e3:.1f}k tok/s | eta {eta}')
                if done % c.ckpt_interval == 0 or done == iters:
                    checkpoint('latest.pt', done)
                    last_saved = done
            sums, n_sums = 0, 0
            t_last, tokens_last = time.time(), tokens

    if ddp:  # free DDP's reducer first: a gloo group destroyed from it can hang at exit (pytorch#56297)
        del train_model
        dist.destroy_process_group()
    if master:
        log_file.close()
        save(os.path.join(c.out_dir, 'done.json'),  # the finished-run marker (make skips the run)
                  {'iters': iters, 'tokens': iters * tokens_per_iter, 'best_val': best_val})
        print(f'done: best val loss {best_val:.4f} ({c.out_dir})')


if __name__ == '__main__':
    main(sys.argv[1:])
