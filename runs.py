"""
A training run's life, which train.py needs and its method does not: the folder, config.json,
log.jsonl, console lines, W&B, checkpoints (safe loading, atomic saves, resume), DDP and Ctrl-C.
"""
import contextlib
import datetime
import json
import os
import pickle
import secrets
import sys
import time
import warnings

import torch
import torch.distributed as dist

import hardware
from errors import UserError

# keys a resumed run may change: where and how it runs, not what it trains
MAY_DIFFER = {'resume', 'device', 'dtype', 'compile', 'out_dir', 'data_dir', 'wandb_log',
              'wandb_project', 'wandb_run_name', 'keep_checkpoints'}


# ----------------------------------------------------------------------------- files
def save(path, obj):
    """torch.save (json for .json) via a temp file, fsync, rename: a kill or error keeps the old."""
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


def read_log(out_dir):
    """out_dir's log.jsonl as records; a line torn by a stop is left out."""
    records = []
    path = os.path.join(out_dir, 'log.jsonl')
    if not os.path.exists(path):
        return records
    for line in open(path):
        try:
            records.append(json.loads(line))
        except ValueError:
            pass
    return records


def last_logged_iter(out_dir):
    """The last step out_dir's log.jsonl reached, or None without a line."""
    records = read_log(out_dir)
    return records[-1]['iter'] if records else None


def open_log(out_dir, start):
    """log.jsonl for appending. On resume (start = the checkpoint's iter) it is cut back to the
    lines before iter `start`, so the resumed run writes the rest as an uninterrupted run would."""
    path = os.path.join(out_dir, 'log.jsonl')
    keep = []
    if start is not None:
        keep = [r for r in read_log(out_dir)
                if r['iter'] < start or (r['iter'] == start and 'val_loss' not in r)]
    with open(path + '.tmp', 'w') as f:
        f.write(''.join(json.dumps(r) + '\n' for r in keep))
    os.replace(path + '.tmp', path)
    return open(path, 'a', buffering=1)  # line-buffered: each record is on disk once written


# ----------------------------------------------------------------------------- checkpoints
def load_checkpoint(path):
    """Tensors and plain containers only (weights_only): a shared checkpoint cannot run code."""
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
    # a key newer than the checkpoint counts as its default, which is how the older code behaved
    changed = sorted(k for k in defaults
                     if k not in MAY_DIFFER and saved.get(k, defaults[k]) != getattr(c, k))
    if changed:
        settings = ', '.join(f'{k}={saved.get(k)!r}' for k in changed)
        raise UserError(f'{path} was written with another config ({settings}); resume with the '
                        'same settings, or train into another --out_dir')
    return ckpt


def checkpoint_to_resume(c, defaults):
    """The latest.pt to resume from (checked against the config), or None for a new run. A folder
    with a log needs --resume=True, unless its run stopped before its first checkpoint (no
    latest.pt or done.json, no line at ckpt_interval or past it): then it starts over."""
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
    """Put a run back as checkpoint_state found it. -> (start iter, best val); new run: (0, inf)."""
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


# ----------------------------------------------------------------------------- Ctrl-C
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


def what_can_resume(c):
    """A stopped run's way on: its latest.pt and the flag, or that there is none yet."""
    latest_path = os.path.join(c.out_dir, 'latest.pt')
    if os.path.exists(latest_path):
        saved_at = load_checkpoint(latest_path)['iter']
        return f'{latest_path} holds iter {saved_at}: add --resume=True to go on from there'
    way_on = (f'nothing to resume from yet (the first latest.pt comes at iter {c.ckpt_interval}, '
              'or at the end): the same command starts over')
    best_path = os.path.join(c.out_dir, 'best.pt')
    if os.path.exists(best_path):
        best_at = load_checkpoint(best_path)['iter']
        way_on += f' and replaces {best_path} (the best model so far, iter {best_at})'
    return way_on


# ----------------------------------------------------------------------------- DDP
def start_processes(device):
    """torchrun sets RANK, WORLD_SIZE; past one process, each joins DDP's group. -> (rank, world)"""
    rank, world = int(os.environ.get('RANK', 0)), int(os.environ.get('WORLD_SIZE', 1))
    if world > 1:
        dist.init_process_group('nccl' if device.type == 'cuda' else 'gloo')
    return rank, world


def mean_over_processes(t, world):
    """DDP: each process logs what it saw; the log shows the mean over all of them."""
    if world == 1:
        return t
    dist.all_reduce(t)
    return t / world


# ----------------------------------------------------------------------------- the run's files
def start_run(c, facts, resumed_at, layout):
    """The master process at the start of a run: out_dir, its log, config.json (the config, the
    run's facts from train.py, the machine) and the first console lines. resumed_at: the iter of
    the checkpoint resumed from, or None. layout: the MoE in words. -> the RunLog."""
    os.makedirs(c.out_dir, exist_ok=True)
    log = RunLog(c, resumed_at, facts)
    save(os.path.join(c.out_dir, 'config.json'),
         {**vars(c), **facts, 'cpu': hardware.cpu_name(), 'torch': torch.__version__})
    print_run_header(c, facts, resumed_at, layout)
    return log


def print_run_header(c, facts, resumed_at, layout):
    """The first line of a run: its size, its length, where it runs, and whether it resumed. Then
    what a reader could miss: the MoE a dense model was matched to, a warmup that never ends."""
    params, iters = facts['params'], facts['iters']
    how = f'{facts["device_used"]} {facts["dtype_used"]}'
    if facts['compile_used']:
        how += ' compiled'
    if facts['world_size'] > 1:
        how += f' x {facts["world_size"]} processes'
    how += f' -> {c.out_dir}'
    if resumed_at is not None:
        how += f', resumed at iter {resumed_at}'
    elif c.resume:
        how += ', nothing to resume'
    print(f'{c.config_name}: {params["total"] / 1e6:.3f}M params ({params["active"] / 1e6:.3f}M '
          f'active), {iters} iters x {facts["tokens_per_iter"]} tokens, {how}')
    if c.match:
        print(f'  ffn_hidden {c.ffn_hidden}: matched to the {c.match} params of the MoE '
              f'{layout} (its config\'s MoE keys; README: "Add an expert layout")')
    if c.warmup_iters >= iters:
        print(f'  warmup_iters {c.warmup_iters} >= {iters} iters: the learning rate never leaves '
              'its warmup; set --warmup_iters (README: "Short experiments")')


def warn_if_beyond_a_cpu(model, c, batch, iters):
    """A GPU config started on a CPU says so before its first evaluation: how long its steps would
    take at a second forward of two windows' speed here (the first is slow), x 3 (a step's FLOPs).
    10 hours: a GPU config takes hundreds, the CPU recipe minutes even on a loaded CPU."""
    x, y = batch
    # no autograd (a DDP hook must not fire on one process), the RNG put back (a router may draw)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        model(x[:2], y[:2])
        start = time.time()
        model(x[:2], y[:2])
        tok_per_s = x[:2].numel() / (3 * (time.time() - start))
    hours = iters * c.batch_size * c.grad_accum * c.block_size / tok_per_s / 3600
    if hours > 10:
        print(f'  a config made for a GPU: at {tok_per_s:,.0f} tok/s, as its first windows train '
              f'on this CPU, its {iters:,} steps would take about {hours:,.0f} hours. On a CPU, '
              'train the CPU recipe instead: make cpu, or config/cpu_moe.py')


def finish_run(c, log, iters, tokens, best_val):
    """The master process at the end of a run: the log closed, done.json (the finished-run marker:
    make skips the run) and the last console line."""
    log.close()
    save(os.path.join(c.out_dir, 'done.json'),
         {'iters': iters, 'tokens': tokens, 'best_val': best_val})
    print(f'done: best val loss {best_val:.4f} ({c.out_dir})')


class RunLog:
    """Where a run's records go: log.jsonl (cut back to `resumed_at` on resume), the console and,
    with wandb_log, Weights & Biases. A training record gets its MFU here, per GPU, where the
    GPU's peak is known (hardware.PEAK_FLOPS), and its console line the time left."""

    def __init__(self, c, resumed_at, facts):
        self.file = open_log(c.out_dir, resumed_at)
        self.wandb = open_wandb(c) if c.wandb_log else None
        self.peak = hardware.peak_flops(torch.device(facts['device_used']))
        self.flops_per_token, self.world = facts['flops_per_token'], facts['world_size']
        self.start, self.t_start = resumed_at or 0, time.time()

    def eval(self, r, iters):
        """An evaluation record, and its console line."""
        self.write(r, 'val')
        line = f'eval {r["iter"]}/{iters} | val {r["val_loss"]:.4f} | best {r["best_val"]:.4f}'
        if 'busiest_frac' in r:
            line += f' | busiest_frac {r["busiest_frac"]:.3f}'
            line += f' | router_entropy {r["router_entropy"]:.3f}'
        print(line)

    def train(self, r, losses, iters):
        """A training record, and its console line: losses, busiest share, lr, speed, time left."""
        if self.peak:
            r['mfu'] = r['tok_per_s'] / self.world * self.flops_per_token / self.peak
        self.write(r, 'train')
        losses = ' | '.join(f'{key} {r[key]:.4f}' for key in losses if key in r)
        if 'busiest_frac' in r:
            losses += f' | busiest {r["busiest_frac"]:.3f}'
        mfu = f' | mfu {r["mfu"]:.1%}' if 'mfu' in r else ''
        eta = self.time_left(r['iter'], iters)
        print(f'iter {r["iter"]}/{iters} | {losses} | lr {r["lr"]:.2e} | '
              f'{r["tok_per_s"] / 1e3:.1f}k tok/s{mfu} | eta {eta}')

    def time_left(self, done, iters):
        """At the mean pace since the run (re)started, evaluations included."""
        seconds = (time.time() - self.t_start) / (done - self.start) * (iters - done)
        return datetime.timedelta(seconds=round(seconds))

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
