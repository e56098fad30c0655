"""
What train.py needs to run but a reader of the method does not: the one error path for mistakes
a user can fix, the device and its precision, atomic files, checkpoints (loading them safely,
checking and restoring a resumed run), the run's files and log, its speed and MFU, the stop on a
loss that is not finite, the routing statistics a run logs, and the MoE's row copies there and
back (copy_rows, weighted_sum) with faster backwards. Nothing here knows the model; train.py,
sample.py, export_hf.py, bench.py and prepare.py import from it, as they import configurator.py.
"""
import contextlib
import datetime
import importlib.util
import json
import os
import pickle
import platform
import secrets
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

# ----------------------------------------------------------------------------- errors
from errors import UserError, one_line_errors  # noqa: E402,F401


@contextlib.contextmanager
def ctrl_c_in_one_line(c):
    """Around a training run: Ctrl-C ends it in one line, where it stopped and how to go on,
    with exit status 130, as for any program Ctrl-C stops."""
    try:
        yield
    except KeyboardInterrupt:
        logged = last_logged_iter(c.out_dir)
        ends = '' if logged is None else f' (its log ends at iter {logged})'
        print(f'\ntrain.py: stopped by Ctrl-C{ends}; {what_can_resume(c)}', file=sys.stderr)
        sys.exit(130)


def last_logged_iter(out_dir):
    """The last step out_dir's log.jsonl reached, or None without a line."""
    iters = []
    if os.path.exists(os.path.join(out_dir, 'log.jsonl')):
        for line in open(os.path.join(out_dir, 'log.jsonl')):
            try:
                iters.append(json.loads(line)['iter'])
            except ValueError:  # a line torn by the stop
                pass
    return iters[-1] if iters else None


def what_can_resume(c):
    """A stopped run's way on: its latest.pt and the flag, or that nothing was saved yet."""
    latest_path = os.path.join(c.out_dir, 'latest.pt')
    if not os.path.exists(latest_path):
        return (f'nothing saved yet (the first checkpoint comes at iter {c.ckpt_interval}, or at '
                'the end): the same command starts over')
    saved_at = load_checkpoint(latest_path)['iter']
    return f'{latest_path} holds iter {saved_at}: add --resume=True to go on from there'


# ----------------------------------------------------------------------------- device
def pick_device(c):
    """device = 'auto': a CUDA GPU, else Apple's MPS, else the CPU."""
    if c.device != 'auto':
        return torch.device(c.device)
    if torch.cuda.is_available():
        return torch.device('cuda')
    if torch.backends.mps.is_available():
        return torch.device('mps')
    return torch.device('cpu')


def pick_dtype(c, device):
    """dtype = 'auto': bf16 on a GPU with bf16 tensor cores (compute capability 8 and up: A100,
    H100, L4, RTX 30xx ...), else fp16 with a GradScaler (V100, T4, where torch would emulate bf16,
    slowly); fp32 on a CPU (bf16 is slow there) and on MPS."""
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
    """-> (device, compile?, autocast, scaler). compile = None: on for a CUDA GPU; off, with a line
    saying why, where it cannot work. The scaler is a GradScaler for fp16 and a no-op otherwise."""
    device = pick_device(c)
    if device.type == 'cuda' and 'LOCAL_RANK' in os.environ:  # torchrun: one GPU per process
        device = torch.device('cuda', int(os.environ['LOCAL_RANK']))
        torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = True
    dtype = pick_dtype(c, device)
    if dtype == 'float32':
        autocast = contextlib.nullcontext()
    else:
        autocast = torch.autocast(device.type, dtype=getattr(torch, dtype))
    # fp16 gradients can underflow: the scaler scales the loss up and skips a step on inf or nan
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == 'float16')
    use_compile = device.type == 'cuda' if c.compile is None else c.compile
    problem = compile_problem(device)
    if use_compile and problem:
        print(f'compile is off: {problem}')
        use_compile = False
    return device, use_compile, autocast, scaler


# Tensor-core peaks in FLOP/s for the MFU: dense (NVIDIA's data sheets give them with sparsity,
# twice as high), bf16 (fp16 on the V100 and T4, which have no bf16). Keyed by the exact name
# torch.cuda.get_device_name reports: by a part of it, an A10G would get the A10's peak and an H100
# PCIe the SXM's
PEAK_FLOPS = {
    'NVIDIA A10': 125e12,  # A10 data sheet: BF16 125 TFLOPS
    # NVIDIA publishes no data sheet for AWS's A10G; 70 TFLOPS BF16 is the figure AWS users quote
    'NVIDIA A10G': 70e12,
    # A100 data sheet: BF16 312 TFLOPS, every form factor and memory size
    'NVIDIA A100-SXM4-40GB': 312e12, 'NVIDIA A100-SXM4-80GB': 312e12,
    'NVIDIA A100-PCIE-40GB': 312e12, 'NVIDIA A100 80GB PCIe': 312e12,
    # H100 data sheet: BF16 1,979 / 1,513 / 1,671 TFLOPS with sparsity for SXM / PCIe / NVL
    'NVIDIA H100 80GB HBM3': 989e12, 'NVIDIA H100 PCIe': 756e12, 'NVIDIA H100 NVL': 835e12,
    # H200 data sheet: BF16 1,979 / 1,671 TFLOPS with sparsity for SXM / NVL
    'NVIDIA H200': 989e12, 'NVIDIA H200 NVL': 835e12,
    'NVIDIA L4': 121e12,  # L4 data sheet: BF16 242 TFLOPS with sparsity
    'NVIDIA L40': 181e12,  # L40 data sheet: BF16 181.05 TFLOPS
    'NVIDIA L40S': 362e12,  # L40S data sheet: BF16 362.05 TFLOPS
    # V100 data sheet: tensor (fp16) 125 TFLOPS SXM2, 112 PCIe
    'Tesla V100-SXM2-16GB': 125e12, 'Tesla V100-SXM2-32GB': 125e12,
    'Tesla V100-PCIE-16GB': 112e12, 'Tesla V100-PCIE-32GB': 112e12,
    'Tesla T4': 65e12,  # T4 data sheet: mixed precision (fp16) 65 TFLOPS
}


def peak_flops(device):
    """The GPU's peak FLOP/s, for the MFU, or None (a CPU, MPS, a GPU not in PEAK_FLOPS)."""
    if device.type != 'cuda':
        return None
    return PEAK_FLOPS.get(torch.cuda.get_device_name(device))


def hardware_name(device):
    """The GPU's name, or the CPU's (cpu_name), for results that depend on the machine."""
    if device.type == 'cuda':
        return torch.cuda.get_device_name(device)
    return cpu_name()


def cpu_name():
    """CPU model, vector ISA, torch threads: a bit-for-bit rerun needs all three the same (they
    change the rounding)."""
    info = open('/proc/cpuinfo').read() if os.path.exists('/proc/cpuinfo') else ''
    models = [line.split(':', 1)[1].strip() for line in info.splitlines()
              if line.startswith('model name')]
    model = models[0] if models else platform.machine()
    isa, threads = torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()
    return f'{model} ({isa}), {threads} threads'


def to_device(batch, device):
    """A CPU tensor on the device: through pinned memory to a CUDA GPU, without waiting for the
    copy; on the CPU it stays the same tensor."""
    if device.type == 'cuda':
        return batch.pin_memory().to(device, non_blocking=True)
    return batch.to(device)


# ----------------------------------------------------------------------------- speed
class CopyRows(torch.autograd.Function):
    """copy_rows(x, rows, bags) = x[rows]: row t of x copied to the places listed in bags[t], one
    bag per row (rows[s] is the row at place s). train.py's MoE copies each token's row to its k
    experts' slots with it. bags is (len(x), copies) and must say what rows says: the forward reads
    rows, the backward bags.

    Why not plain x[rows]: its backward scatter-adds each copy's gradient into place, one row at a
    time. Knowing each row's places, the backward sums each bag in one pass (embedding_bag)."""

    @staticmethod
    def forward(ctx, x, rows, bags):
        ctx.save_for_backward(bags)
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad):
        bags, = ctx.saved_tensors
        return F.embedding_bag(bags, grad, mode='sum'), None, None


class WeightedSum(torch.autograd.Function):
    """weighted_sum(ys, weights, bags, rows) = y, where y[t] = sum_c weights[t, c] * ys[bags[t, c]]
    and rows[s] is the t whose bag holds row s of ys (each row of ys is in exactly one bag: bags and
    rows say the same, the forward reads one, the backward both). ys and weights share a dtype.
    train.py's MoE sums each token's k expert outputs with it, weighted by the router.

    The forward is one embedding_bag: one pass over ys. Its own backward scatter-adds into ys row by
    row; knowing rows, each row's gradient is a gather of grad instead."""

    @staticmethod
    def forward(ctx, ys, weights, bags, rows):
        ctx.save_for_backward(ys, weights, bags, rows)
        return F.embedding_bag(bags, ys, per_sample_weights=weights, mode='sum')

    @staticmethod
    def backward(ctx, grad):
        ys, weights, bags, rows = ctx.saved_tensors
        grad_rows = grad.index_select(0, rows)  # row s: the gradient of the output it went to
        row_weights = weights.new_empty(len(rows)).scatter_(0, bags.flatten(), weights.flatten())
        grad_ys = grad_rows * row_weights[:, None]
        grad_weights = (grad_rows * ys).sum(dim=1)[bags]  # d y[t] / d weights[t, c]: ys[bags[t, c]]
        return grad_ys, grad_weights, None, None


copy_rows, weighted_sum = CopyRows.apply, WeightedSum.apply


# ----------------------------------------------------------------------------- routing statistics
def routing_row(load, entropy, log_z):
    """One MoE layer's routing statistics as one row: [load_0 .. load_E-1, entropy, log_z]. One
    tensor per layer, so the statistics cost one host sync to log and one op to average."""
    return torch.cat([load, entropy.view(1), log_z.view(1)])


def unpack_routing(rows):
    """routing_row's inverse, for one row or a stack of them: -> load, entropy, log_z."""
    return rows[..., :-2], rows[..., -2], rows[..., -1]


def routing_stats(rows):
    """Routing health from one routing row per layer, per layer and as the mean over layers.
    busiest_frac = max_i load_i: 1/n_experts is perfect balance; 1/top_k, its ceiling, a collapsed
    router that sends every token to the same experts (1.0 at top-1)."""
    load, entropy, log_z = unpack_routing(rows.cpu())  # one host sync
    layers = [{'load': layer_load.tolist(), 'busiest_frac': layer_load.max().item(),
               'usage_var': layer_load.var(unbiased=False).item(),
               'router_entropy': layer_entropy.item(), 'log_z': layer_log_z.item()}
              for layer_load, layer_entropy, layer_log_z in zip(load, entropy, log_z)]
    mean = {key: sum(layer[key] for layer in layers) / len(layers)
            for key in ('busiest_frac', 'usage_var', 'router_entropy', 'log_z')}
    # dropped_frac: the share of assignments no expert ran; the dispatch is dropless
    return {'load': load.mean(dim=0).tolist(), **mean, 'dropped_frac': 0.0, 'layers': layers}


# ----------------------------------------------------------------------------- files
def save(path, obj):
    """torch.save (json for a .json path) to a temp file, fsync, rename: a kill or an error
    mid-write leaves the previous file intact."""
    tmp = path + '.tmp'
    try:
        with open(tmp, 'wb') as f:
            if path.endswith('.json'):
                f.write(json.dumps(obj, indent=2).encode())
            else:
                torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def open_log(log_path, start):
    """log.jsonl for appending. On resume (start = the checkpoint's iter) it is cut back to the
    lines before iter `start`, so the resumed run writes the rest as an uninterrupted run would; a
    torn last line is dropped."""
    keep = ''
    if start is not None and os.path.exists(log_path):
        for line in open(log_path):
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


# ----------------------------------------------------------------------------- checkpoints
def load_checkpoint(path):
    """Tensors and plain containers only (weights_only): opening a checkpoint someone shared cannot
    run code."""
    try:
        # torch warns about some refused files: the one line below says it all
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            return torch.load(path, map_location='cpu', weights_only=True)
    # it names something to import and call, or it is damaged (truncated: a RuntimeError)
    except (pickle.UnpicklingError, RuntimeError, EOFError):
        raise UserError(f'{path} is not a plain checkpoint (damaged, or it holds more than tensors '
                        'and plain data): refusing to unpickle arbitrary objects') from None


def checkpoint_state(model, optimizer, scaler, c, meta, it, tokens, best_val, device):
    """Everything a step depends on: weights, optimizer moments, the fp16 loss scale, the step
    (-> data, learning rate), the RNG; and the config and data it was trained with."""
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == 'cuda' else None
    return {'model': model.state_dict(), 'optimizer': optimizer.state_dict(),
            'scaler': scaler.state_dict(), 'config': vars(c), 'meta': meta, 'iter': it,
            'tokens': tokens, 'best_val': best_val,
            'rng': {'torch': torch.get_rng_state(), 'cuda': cuda_rng}}


def load_resume_checkpoint(path, c, defaults):
    """latest.pt of an interrupted run, checked against this run's config (defaults: train.py's)."""
    try:
        ckpt = load_checkpoint(path)
        saved = ckpt['config']
    except UserError:
        raise
    except Exception as e:  # not a file torch can read, or not one of ours
        raise UserError(f'{path} cannot be loaded ({type(e).__name__}); remove it to start over')
    may_differ = {'resume', 'device', 'dtype', 'compile', 'out_dir', 'data_dir', 'wandb_log',
                  'wandb_project', 'wandb_run_name', 'keep_checkpoints'}
    # a key newer than the checkpoint counts as its default, which is how the older code behaved
    changed = sorted(k for k in defaults
                     if k not in may_differ and saved.get(k, defaults[k]) != getattr(c, k))
    if changed:
        settings = ', '.join(f'{k}={saved.get(k)!r}' for k in changed)
        raise UserError(f'{path} was written with another config ({settings}); resume with the '
                        'same settings, or train into another --out_dir')
    return ckpt


def checkpoint_to_resume(c, defaults):
    """The latest.pt to resume from (checked against the config), or None for a new run. A run
    folder that already holds a log is never overwritten: it needs --resume=True. Except the log
    of a run stopped before its first checkpoint (no latest.pt or done.json, no line at
    ckpt_interval or past it): nothing to resume or keep, so it starts over."""
    latest_path = os.path.join(c.out_dir, 'latest.pt')
    saved = os.path.exists(latest_path) or os.path.exists(os.path.join(c.out_dir, 'done.json'))
    stopped_early = not saved and (last_logged_iter(c.out_dir) or 0) < c.ckpt_interval
    if os.path.exists(os.path.join(c.out_dir, 'log.jsonl')) and not c.resume:
        if not stopped_early:
            raise UserError(f'{c.out_dir} already holds a run (log.jsonl): continue it with '
                            '--resume=True, or choose another --out_dir (or remove that folder)')
        print(f'{c.out_dir} holds a run stopped before its first checkpoint: starting it over')
    if c.resume and os.path.isfile(latest_path):
        return load_resume_checkpoint(latest_path, c, defaults)
    return None


def restore(ckpt, model, optimizer, scaler, device):
    """Put a run back where checkpoint_state found it. -> (start iter, best val loss so far); for a
    new run (ckpt None) nothing to put back: (0, inf)."""
    if ckpt is None:
        return 0, float('inf')
    model.load_state_dict(ckpt['model'])
    optimizer.load_state_dict(ckpt['optimizer'])
    if ckpt.get('scaler'):  # an fp16 run's loss scale (older checkpoints have none)
        scaler.load_state_dict(ckpt['scaler'])
    torch.set_rng_state(ckpt['rng']['torch'])
    if ckpt['rng']['cuda'] is not None and device.type == 'cuda':
        torch.cuda.set_rng_state(ckpt['rng']['cuda'], device)
    return ckpt['iter'], ckpt['best_val']


# ----------------------------------------------------------------------------- training runs
def start_run(c, params, iters, tokens_per_iter, flops_per_token, device, use_compile, world,
              resumed_at):
    """The master process at the start of a run: out_dir, its log, config.json (the config, the
    run's figures from train.py and the machine that trains it) and the first console line.
    resumed_at: the iter of the checkpoint resumed from, or None. -> the RunLog."""
    os.makedirs(c.out_dir, exist_ok=True)
    log = RunLog(c, resumed_at)
    save(os.path.join(c.out_dir, 'config.json'), {
        **vars(c), 'params': params, 'iters': iters, 'tokens_per_iter': tokens_per_iter,
        'flops_per_token': flops_per_token, 'device_used': device.type,
        'dtype_used': pick_dtype(c, device), 'compile_used': use_compile, 'world_size': world,
        'cpu': cpu_name(), 'torch': torch.__version__})
    print_run_header(c, params, iters, tokens_per_iter, device, use_compile, world, resumed_at)
    return log


def start_processes(device):
    """torchrun sets RANK and WORLD_SIZE; with more than one process, each joins the process group
    through which DDP averages the gradients. -> (rank, world)."""
    rank, world = int(os.environ.get('RANK', 0)), int(os.environ.get('WORLD_SIZE', 1))
    if world > 1:
        dist.init_process_group('nccl' if device.type == 'cuda' else 'gloo')
    return rank, world


def finish_run(c, log, iters, tokens, best_val):
    """The master process at the end of a run: the log closed, done.json (the finished-run marker:
    make skips the run) and the last console line."""
    log.close()
    save(os.path.join(c.out_dir, 'done.json'),
         {'iters': iters, 'tokens': tokens, 'best_val': best_val})
    print(f'done: best val loss {best_val:.4f} ({c.out_dir})')


def stop_if_not_finite(first_bad, iters, last_saved, out_dir, world):
    """Stops the run before anything is saved from a broken model. first_bad: the first step
    whose loss was not finite, or iters if none was, a tensor on the device (under DDP, the
    earliest over the processes counts). last_saved: the iter of latest.pt, or None."""
    if world > 1:
        dist.all_reduce(first_bad, op=dist.ReduceOp.MIN)
    if first_bad.item() >= iters:
        return
    have = 'none yet'
    if last_saved is not None:
        have = f'{os.path.join(out_dir, "latest.pt")} (iter {last_saved}), and best.pt'
    raise UserError(f'the loss is not finite (nan or inf) at iter {first_bad.item() + 1}; '
                    f'stopped before saving anything from it. Last good checkpoint: {have}. '
                    'Try a lower learning_rate')


def warn_if_beyond_a_cpu(model, c, batch, iters):
    """A config made for a GPU, started on a CPU, says so before its first evaluation: how long
    its steps would take at the speed of a forward of two windows here, times 3 for the backward
    (a step's FLOPs). No gradient, nothing saved: the run goes on as it would have."""
    x, y = batch
    start = time.time()
    # no autograd (under DDP no gradient hook fires on one process alone), and the random state
    # put back after (a router that draws noise draws here too)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        model(x[:2], y[:2])
    tok_per_s = x[:2].numel() / (3 * (time.time() - start))
    hours = iters * c.batch_size * c.grad_accum * c.block_size / tok_per_s / 3600
    if hours > 1:
        print(f'  a config made for a GPU: at {tok_per_s:,.0f} tok/s, as its first windows train '
              f'on this CPU, its {iters:,} steps would take about {hours:,.0f} hours. On a CPU, '
              'train the CPU recipe instead: make cpu, or config/cpu_moe.py')


class Meter:
    """What a run's training lines report, measured between two lines: the losses of every
    micro-batch, summed on the device (no host sync in a step), and the first step whose loss was
    not finite; the speed in tokens per second, evaluation and saving left out, the model FLOP
    utilisation per GPU where the GPU's peak is known (PEAK_FLOPS), and the time left."""

    def __init__(self, device, start, iters, tokens_per_iter, flops_per_token, world):
        self.iters, self.world = iters, world
        self.tokens_per_iter, self.flops_per_token = tokens_per_iter, flops_per_token
        self.peak = peak_flops(device)  # None: no MFU
        self.sums, self.n = 0, 0  # the losses summed over the micro-batches since the last line
        self.first_bad = torch.tensor(iters, device=device)  # iters: none yet
        self.start = self.last = start  # the iter the run, and the line, started from
        self.t_start = self.t_last = time.time()

    def so_far(self, it):
        """How far the run is after `it` steps, as every log line begins: steps, tokens, FLOPs."""
        tokens = it * self.tokens_per_iter
        return {'iter': it, 'tokens': tokens, 'flops': tokens * self.flops_per_token}

    def add(self, it, loss, terms):
        """One micro-batch of step `it`: its training loss, and the losses a line logs (terms)."""
        self.sums, self.n = self.sums + terms, self.n + 1
        this_step = torch.where(loss.isfinite(), self.iters, it)  # iters where finite, else it
        self.first_bad = torch.minimum(self.first_bad, this_step)

    @contextlib.contextmanager
    def paused(self):
        """What runs inside (evaluation, saving) is not training: tokens per second leave it out."""
        t = time.time()
        yield
        self.t_last += time.time() - t

    def line(self, done, names, last_saved, out_dir):
        """The training line after `done` steps: so_far, the mean of each loss (named by names)
        since the last line, over all processes, tok_per_s and mfu. First stops the run if a loss
        was not finite (last_saved, out_dir: for the message). The next line counts from here."""
        stop_if_not_finite(self.first_bad, self.iters, last_saved, out_dir, self.world)
        means = mean_over_processes(self.sums / self.n, self.world)
        now = time.time()
        tok_per_s = (done - self.last) * self.tokens_per_iter / (now - self.t_last)
        record = {**self.so_far(done), **dict(zip(names, means.tolist())), 'tok_per_s': tok_per_s}
        if self.peak:
            record['mfu'] = tok_per_s / self.world * self.flops_per_token / self.peak
        self.sums, self.n = 0, 0
        self.last, self.t_last = done, now
        return record

    def time_left(self, done):
        """At the mean pace since the run (re)started, evaluations included."""
        seconds = (time.time() - self.t_start) / (done - self.start) * (self.iters - done)
        return datetime.timedelta(seconds=round(seconds))


# ----------------------------------------------------------------------------- the console and DDP
def moe_layout(c):
    """The MoE a config describes, in words: its own FFN, or the one a matched dense model is sized
    to (a dense config holds that MoE's n_experts, moe_hidden, top_k and shared_hidden)."""
    layout = f'{c.n_experts} experts x {c.moe_hidden}, top-{c.top_k}'
    if c.shared_hidden:
        layout += f', shared expert {c.shared_hidden}'
    return layout


def print_run_header(c, params, iters, tokens_per_iter, device, use_compile, world, resumed_at):
    """The first line of a run: its size, its length, where it runs, and whether it resumed. Then
    what a reader could miss: the MoE a dense model was matched to, a warmup that never ends."""
    how = f'{device.type} {pick_dtype(c, device)}'
    if use_compile:
        how += ' compiled'
    if world > 1:
        how += f' x {world} processes'
    how += f' -> {c.out_dir}'
    if resumed_at is not None:
        how += f', resumed at iter {resumed_at}'
    elif c.resume:
        how += ', nothing to resume'
    print(f'{c.config_name}: {params["total"] / 1e6:.3f}M params ({params["active"] / 1e6:.3f}M '
          f'active), {iters} iters x {tokens_per_iter} tokens, {how}')
    if c.match:
        print(f'  ffn_hidden {c.ffn_hidden}: matched to the {c.match} params of the MoE '
              f'{moe_layout(c)} (its config\'s MoE keys; README: "Add an expert layout")')
    if c.warmup_iters >= iters:
        print(f'  warmup_iters {c.warmup_iters} >= {iters} iters: the learning rate never leaves '
              'its warmup; set --warmup_iters (README: "Short experiments")')


def print_param_table(c, n, moe_n, flops_per_token):
    """train.py --print_params: the parameter counts n, the training FLOPs per token and, for a
    dense model matched to an MoE, that MoE's count it was matched to (moe_n: the MoE's counts);
    then all of it as one JSON line."""
    if c.ffn == 'moe':
        what = f'moe: {moe_layout(c)}'
        width = {'moe_hidden': c.moe_hidden}
    else:
        what = f'dense: ffn_hidden {c.ffn_hidden}'
        width = {'ffn_hidden': c.ffn_hidden}
        if c.match:
            what += f' (matched to the {c.match} params of the MoE {moe_layout(c)})'
    print(f'{c.config_name} | d_model {c.d_model}, {c.n_layer} layers, {c.n_head} heads, '
          f'vocab {c.vocab_size} | {what}')
    for key in ('embedding', 'lm_head', 'attention', 'ffn', 'router', 'norms', 'total', 'active'):
        print(f'  {key:<10} {n[key]:>12,}  ({n[key] / 1e6:.3f}M)')
    print(f'  training FLOPs per token: {flops_per_token:,} ({flops_per_token / 1e6:.3f}M)')
    summary = {**n, **width, 'flops_per_token': flops_per_token}
    if c.match:
        target = moe_n[c.match]
        error = (n['total'] - target) / target
        summary.update(match=c.match, match_target=target, match_error=error)
        print(f'  matched to MoE {c.match} = {target:,}: off by {error:+.3%}')
    print(json.dumps(summary))


class RunLog:
    """Where a run's records go: log.jsonl (cut back to `start` on resume), the console and, with
    wandb_log, Weights & Biases."""

    def __init__(self, c, start):
        self.file = open_log(os.path.join(c.out_dir, 'log.jsonl'), start)
        self.wandb = open_wandb(c) if c.wandb_log else None

    def eval(self, r, iters):
        """An evaluation record, and its console line."""
        self.write(r, 'val')
        line = f'eval {r["iter"]}/{iters} | val {r["val_loss"]:.4f} | best {r["best_val"]:.4f}'
        if 'busiest_frac' in r:
            line += f' | busiest_frac {r["busiest_frac"]:.3f}'
            line += f' | router_entropy {r["router_entropy"]:.3f}'
        print(line)

    def train(self, r, losses, iters, eta):
        """A training record, and its console line: the losses named (those it has), the busiest
        expert's share, the learning rate, the speed and the time left."""
        self.write(r, 'train')
        losses = ' | '.join(f'{key} {r[key]:.4f}' for key in losses if key in r)
        if 'busiest_frac' in r:
            losses += f' | busiest {r["busiest_frac"]:.3f}'
        mfu = f' | mfu {r["mfu"]:.1%}' if 'mfu' in r else ''
        print(f'iter {r["iter"]}/{iters} | {losses} | lr {r["lr"]:.2e} | '
              f'{r["tok_per_s"] / 1e3:.1f}k tok/s{mfu} | eta {eta}')

    def write(self, r, kind):
        self.file.write(json.dumps(r) + '\n')
        if self.wandb is not None:
            self.wandb.log(wandb_record(r, kind), step=r['iter'])

    def close(self):
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def open_wandb(c):
    """The run's W&B run. A resumed run continues the one it started: its id is kept in
    out_dir/wandb_id. The files go to out_dir/wandb (WANDB_MODE=offline keeps them there)."""
    import wandb  # optional: configurator.check makes sure it is there when wandb_log is on
    id_path = os.path.join(c.out_dir, 'wandb_id')
    if os.path.exists(id_path):
        run_id = open(id_path).read().strip()
    else:
        run_id = secrets.token_hex(4)  # W&B takes any short lowercase id
        with open(id_path, 'w') as f:
            f.write(run_id + '\n')
    name = c.wandb_run_name or os.path.basename(os.path.normpath(c.out_dir))
    return wandb.init(project=c.wandb_project, name=name, id=run_id, resume='allow',
                      config=vars(c), dir=c.out_dir)


def wandb_record(r, kind):
    """A log.jsonl record as W&B's flat keys: train/loss, val/val_loss, train/load/0, and per
    layer train/layers/0/busiest_frac ...; iter, tokens and flops as they are."""
    out = {}
    for key, value in r.items():
        if key in ('iter', 'tokens', 'flops'):
            out[key] = value
        elif key == 'layers':
            for i, layer in enumerate(value):
                out.update(wandb_record(layer, f'{kind}/layers/{i}'))
        elif isinstance(value, list):  # the load per expert
            out.update({f'{kind}/{key}/{e}': v for e, v in enumerate(value)})
        else:
            out[f'{kind}/{key}'] = value
    return out


def mean_over_processes(t, world):
    """DDP: each process logs what it saw; the log shows the mean over all of them. One process:
    t as it is."""
    if world == 1:
        return t
    dist.all_reduce(t)
    return t / world
