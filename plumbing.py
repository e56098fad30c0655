"""
What train.py needs to run but a reader of the method does not: the one error path for mistakes
a user can fix, the device and its precision, atomic files, checkpoints (loading them safely,
checking and restoring a resumed run) and the log file. Nothing here knows the model; train.py,
sample.py, export_hf.py, bench.py and prepare.py import from it, as they import configurator.py.
"""
import contextlib
import json
import os
import pickle
import platform
import sys
import warnings

import torch
import torch.distributed as dist


# ----------------------------------------------------------------------------- errors
class UserError(Exception):
    """Something the user can fix: a missing file, a bad setting, a run folder already in use.
    Library code raises it with a message that names the fix; the script's entry point prints it."""


@contextlib.contextmanager
def one_line_errors(script):
    """Around a script's main: a UserError becomes one line, `script: error: message`, on stderr and
    exit status 1 (nothing was written: the code raises before it writes). Any other exception is a
    bug and keeps its traceback."""
    try:
        yield
    except UserError as e:
        print(f'{script}: error: {e}', file=sys.stderr)
        sys.exit(1)


# ----------------------------------------------------------------------------- device
def setup_device(c):
    """-> (device, compile?, autocast): bf16 and compiled on GPU; fp32, eager on CPU (bf16 is slow
    there)."""
    if c.device != 'auto':
        device = torch.device(c.device)
    elif torch.cuda.is_available():
        device = torch.device('cuda')
    else:
        device = torch.device('cpu')
    if device.type == 'cuda' and 'LOCAL_RANK' in os.environ:  # torchrun: one GPU per process
        device = torch.device('cuda', int(os.environ['LOCAL_RANK']))
        torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = True
    if device.type == 'cuda':
        autocast = torch.autocast('cuda', dtype=torch.bfloat16)
    else:
        autocast = contextlib.nullcontext()
    use_compile = device.type == 'cuda' if c.compile is None else c.compile
    return device, use_compile, autocast


def cpu_name():
    """CPU model, vector ISA, torch threads: a bit-for-bit rerun needs all three the same (they
    change the rounding)."""
    info = open('/proc/cpuinfo').read() if os.path.exists('/proc/cpuinfo') else ''
    models = [line.split(':', 1)[1].strip() for line in info.splitlines()
              if line.startswith('model name')]
    model = models[0] if models else platform.machine()
    isa, threads = torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()
    return f'{model} ({isa}), {threads} threads'


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
    except pickle.UnpicklingError:  # it names something to import and call, or it is damaged
        raise UserError(f'{path} is not a plain checkpoint (damaged, or it holds more than tensors '
                        'and plain data): refusing to unpickle arbitrary objects') from None


def checkpoint_state(model, optimizer, c, meta, it, tokens, best_val, device):
    """Everything a step depends on: weights, optimizer moments, the step (-> data, learning rate),
    the RNG; and the config and data it was trained with."""
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == 'cuda' else None
    return {'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'config': vars(c),
            'meta': meta, 'iter': it, 'tokens': tokens, 'best_val': best_val,
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
    may_differ = {'resume', 'device', 'compile', 'out_dir', 'data_dir'}
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
    folder that already holds a log is never overwritten: it needs --resume=True."""
    latest_path = os.path.join(c.out_dir, 'latest.pt')
    if os.path.exists(os.path.join(c.out_dir, 'log.jsonl')) and not c.resume:
        raise UserError(f'{c.out_dir} already holds a run (log.jsonl): continue it with '
                        '--resume=True, or choose another --out_dir (or remove that folder)')
    if c.resume and os.path.isfile(latest_path):
        return load_resume_checkpoint(latest_path, c, defaults)
    return None


def restore(ckpt, model, optimizer, device):
    """Put a run back where checkpoint_state found it. -> (start iter, best val loss so far)."""
    model.load_state_dict(ckpt['model'])
    optimizer.load_state_dict(ckpt['optimizer'])
    torch.set_rng_state(ckpt['rng']['torch'])
    if ckpt['rng']['cuda'] is not None and device.type == 'cuda':
        torch.cuda.set_rng_state(ckpt['rng']['cuda'], device)
    return ckpt['iter'], ckpt['best_val']


# ----------------------------------------------------------------------------- the console and DDP
def print_run_header(c, params, iters, tokens_per_iter, device, use_compile, world, resumed_at):
    """The first line of a run: its size, its length, where it runs, and whether it resumed."""
    how = device.type
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


def print_param_table(c, n, flops_per_token, target):
    """train.py --print_params: the parameter counts n, the training FLOPs per token and, for a
    dense model matched to an MoE, its target count; then all of it as one JSON line."""
    if c.ffn == 'moe':
        what = f'moe: {c.n_experts} experts, top-{c.top_k}, expert hidden {c.moe_hidden}'
        if c.shared_hidden:
            what += f', shared expert {c.shared_hidden}'
    else:
        what = f'dense: ffn_hidden {c.ffn_hidden}'
        if c.match:
            what += f' (matched to the MoE {c.match} params)'
    print(f'{c.config_name} | d_model {c.d_model}, {c.n_layer} layers, {c.n_head} heads, '
          f'vocab {c.vocab_size} | {what}')
    for key in ('embedding', 'lm_head', 'attention', 'ffn', 'router', 'norms', 'total', 'active'):
        print(f'  {key:<10} {n[key]:>12,}  ({n[key] / 1e6:.3f}M)')
    print(f'  training FLOPs per token: {flops_per_token:,} ({flops_per_token / 1e6:.3f}M)')
    summary = {**n, 'ffn_hidden': c.moe_hidden if c.ffn == 'moe' else c.ffn_hidden,
               'flops_per_token': flops_per_token}
    if target is not None:
        error = (n['total'] - target) / target
        summary.update(match=c.match, match_target=target, match_error=error)
        print(f'  matched to MoE {c.match} = {target:,}: off by {error:+.3%}')
    print(json.dumps(summary))


def print_eval_line(r, iters):
    """An evaluation record of log.jsonl, as the console shows it."""
    line = f'eval {r["iter"]}/{iters} | val {r["val_loss"]:.4f} | best {r["best_val"]:.4f}'
    if 'busiest_frac' in r:
        line += f' | busiest_frac {r["busiest_frac"]:.3f}'
        line += f' | router_entropy {r["router_entropy"]:.3f}'
    print(line)


def print_train_line(r, iters, eta):
    """A training record of log.jsonl, as the console shows it, with the time left."""
    losses = ' | '.join(f'{key} {r[key]:.4f}' for key in ('loss', 'ce', 'lb', 'z') if key in r)
    if 'busiest_frac' in r:
        losses += f' | busiest {r["busiest_frac"]:.3f}'
    print(f'iter {r["iter"]}/{iters} | {losses} | lr {r["lr"]:.2e} | '
          f'{r["tok_per_s"] / 1e3:.1f}k tok/s | eta {eta}')


def mean_over_processes(t, world):
    """DDP: each process logs what it saw; the log shows the mean over all of them."""
    dist.all_reduce(t)
    return t / world
