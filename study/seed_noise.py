"""Where the CPU study's seed noise comes from: the init, the data order, or the finite
validation set.

    make noise                                        # its runs, then this script
    python -m study.seed_noise --runs out/first --out results/cpu/noise

`seed` sets both the init and the data order; `data_seed` sets the data order alone. For cpu_moe
and cpu_dense_active, three groups of three runs each share seed 1's init or its data order:
    both vary     {config}-s1, -s2, -s3                        (the first protocol's main runs)
    init varies   {config}-s1, noise_{config}-i2-d1, -i3-d1    (seed 1's data order)
    data varies   {config}-s1, noise_{config}-i1-d2, -i1-d3    (seed 1's init)
in the --runs folder (make noise: out/first/, the first protocol's 2% warmup).
On CPU a run is deterministic, so a group's spread is its source's alone (gradient noise comes
with the data order). The validation set is one fixed sample of text, the same for every run: its
finite size adds a standard error that no number of seeds removes, estimated here from seed 1's
best.pt window by window.

And one mechanism: every run starts on a plateau near the unigram loss (about 3 nats for bytes)
and leaves it after some steps. For each CPU-preset config (cpu_*, seed-noise runs included) the
script gives the first logged step whose training CE is below --plateau_ce, and how that step
correlates with the best val loss. Those runs are every finished run under --runs, so they are
not the same set as a report.py table of the main protocol's seeds.
"""
import argparse
import glob
import json
import math
import os
import statistics
import types

import torch
import torch.nn.functional as F

from errors import UserError, one_line_errors
from report import mean_std
from sample import load_model
from train import load_data

CONFIGS = ('cpu_moe', 'cpu_dense_active')
# (init seed, data seed) of each run; seed s alone means (s, s). The Makefile's NOISE_RUNS train
# the runs with init != data; the seeds 1-5 row is the main protocol's STUDY_SEEDS.
GROUPS = {
    'init varies (data order of seed 1)': [(1, 1), (2, 1), (3, 1)],
    'data order varies (init of seed 1)': [(1, 1), (1, 2), (1, 3)],
    'both vary (seeds 1-3)': [(1, 1), (2, 2), (3, 3)],
    'both vary (seeds 1-5)': [(s, s) for s in range(1, 6)],
}


def run_dir(runs, config, init, data):
    if init == data:
        name = f'{config}-s{init}'
    else:
        name = f'noise_{config}-i{init}-d{data}'
    return os.path.join(runs, name)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def best_val(runs, config, init, data):
    """The run's best val loss, after checking that its config.json says what its folder name
    says."""
    out_dir = run_dir(runs, config, init, data)
    try:
        c = read_json(os.path.join(out_dir, 'config.json'))
        best = read_json(os.path.join(out_dir, 'done.json'))['best_val']
    except (OSError, ValueError, KeyError):
        raise UserError(f'no finished run in {out_dir}; '
                        'run `make noise` (it trains what is missing)')
    data_seed = c.get('data_seed') or c['seed']
    if (c['seed'], data_seed) != (init, data):
        raise UserError(f'{out_dir} was trained with seed {c["seed"]} and data_seed '
                        f'{c.get("data_seed")}, not init {init} and data order {data}; '
                        'move it away and rerun make noise')
    return best


def noise_table(best):
    """{(config, init seed, data seed): best val loss} -> per group of GROUPS: the std over its
    runs of each config's loss and of the paired active gap (dense_active - moe, > 0: the MoE is
    better), and the gap's mean."""
    rows = {}
    for group, members in GROUPS.items():
        vals = {cfg: [best[(cfg, *m)] for m in members] for cfg in CONFIGS}
        gaps = [d - m for m, d in zip(vals['cpu_moe'], vals['cpu_dense_active'])]
        gap_mean, gap_std = mean_std(gaps)
        row = {'runs': len(members)}
        for cfg, v in vals.items():
            row[cfg] = mean_std(v)[1]
        row['active_gap'] = gap_std
        row['active_gap_mean'] = gap_mean
        rows[group] = row
    return rows


def plateau_escapes(runs, ce):
    """{config: [(first logged step with training CE < ce, or None; best val loss)]} over the
    finished runs of the CPU preset's configs; a seed-noise run counts under its config
    (noise_cpu_moe -> cpu_moe)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(runs, '*', 'done.json'))):
        folder = os.path.dirname(path)
        try:
            config_name = read_json(os.path.join(folder, 'config.json'))['config_name']
            with open(os.path.join(folder, 'log.jsonl')) as f:
                records = [json.loads(line) for line in f if line.strip()]
            best = read_json(path)['best_val']
        except (OSError, ValueError, KeyError):
            continue  # not a readable run: nothing to say about it
        name = config_name.removeprefix('noise_')
        if name.startswith('cpu_'):
            below = (r['iter'] for r in records if 'ce' in r and r['ce'] < ce)
            step = next(below, None)
            out.setdefault(name, []).append((step, best))
    return out


@torch.no_grad()
def window_losses(out_dir):
    """Mean CE of best.pt on each window of the run's fixed validation set."""
    model, _ = load_model(out_dir, 'cpu')
    c = types.SimpleNamespace(**read_json(os.path.join(out_dir, 'config.json')))
    _, windows = load_data(c)
    losses = []
    # batched as train.evaluate() batches them
    for batch in windows.split(c.batch_size):
        logits = model(batch[:, :-1])[0].float()
        # (B, T): one loss per position
        ce = F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction='none')
        losses.append(ce.mean(dim=1))
    return torch.cat(losses).double()


def check_window_losses(per_window, best):
    """The per-window losses must add up to what train.py logged for best.pt."""
    for cfg, w in per_window.items():
        logged = best[(cfg, 1, 1)]
        scored = w.mean().item()
        if abs(scored - logged) > 1e-4:
            raise UserError(f'{cfg}-s1: best.pt scores {scored:.5f} on the validation set but '
                            f'its run logged {logged:.5f}; was the data in its data_dir prepared '
                            'again?')


def standard_errors(per_window):
    """The validation set's own sampling error, std over windows / sqrt(windows): per model, and
    for the pair's active gap."""
    n = len(per_window['cpu_moe'])
    se = {cfg: (w.std() / math.sqrt(n)).item() for cfg, w in per_window.items()}
    gap = per_window['cpu_dense_active'] - per_window['cpu_moe']
    se['active_gap'] = (gap.std() / math.sqrt(n)).item()
    return n, se


def escape_summary(runs):
    """[(step, best val) per run] -> how many runs, how many never left, the steps of those that
    did, the mean best val over all of them, and r(step, best val) where it is defined."""
    # the runs that left the plateau
    paired = [(s, b) for s, b in runs if s is not None]
    steps = [s for s, _ in paired]
    # a correlation needs at least three points and some spread in both variables
    spread = len(set(steps)) > 1 and len({b for _, b in paired}) > 1
    r = None
    if len(paired) > 2 and spread:
        r = statistics.correlation(*zip(*paired))
    return {'runs': len(runs), 'never': len(runs) - len(steps), 'steps': steps,
            'best_val_mean': statistics.mean(b for _, b in runs), 'r': r}


def escape_row(name, e):
    """One markdown row of the plateau table."""
    if e['steps']:
        mean = statistics.mean(e['steps'])
        steps = f'{mean:.0f} ({min(e["steps"])}-{max(e["steps"])})'
    else:
        steps = '-'
    never = f', {e["never"]} never' if e['never'] else ''
    r = '-' if e['r'] is None else f'{e["r"]:+.2f}'
    return f'| {name} | {e["runs"]}{never} | {steps} | {e["best_val_mean"]:.4f} | {r} |'


def markdown(rows, n, se, plateau_ce, escapes):
    lines = [
        '# Seed noise at CPU scale: where it comes from', '',
        'Standard deviation of the best validation loss over runs that differ only in the named '
        'source (`python -m study.seed_noise`). Active gap = dense_active - moe, paired run by '
        'run.', '',
        '| what varies | runs | cpu_moe std | cpu_dense_active std | active gap std | '
        'active gap mean |',
        '|---|---|---|---|---|---|',
    ]
    for group, r in rows.items():
        lines.append(f'| {group} | {r["runs"]} | {r["cpu_moe"]:.4f} | '
                     f'{r["cpu_dense_active"]:.4f} | {r["active_gap"]:.4f} | '
                     f'{r["active_gap_mean"]:+.4f} |')
    lines.append(f'| the validation set (standard error over its {n} windows, seed 1) | - | '
                 f'{se["cpu_moe"]:.4f} | {se["cpu_dense_active"]:.4f} | '
                 f'{se["active_gap"]:.4f} | - |')
    lines += [
        '',
        'Neighbouring windows share stories, so the validation standard error is if anything a '
        'slight underestimate. Three runs per group give a rough std (its own relative error is '
        'about 50%).',
    ]
    lines += [
        '', '## Leaving the early plateau', '',
        f'First logged step (every log_interval steps) whose training CE is below {plateau_ce}, '
        'per config, over all its finished runs (seed-noise runs included), and the correlation '
        'r of that step with the run\'s best val loss.', '',
        '| config | runs | step: mean (min-max) | best val mean | r(step, best val) |',
        '|---|---|---|---|---|',
    ]
    for name, e in escapes.items():
        lines.append(escape_row(name, e))
    return '\n'.join(lines) + '\n'


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--runs', default='out/first', help='folder holding the run folders')
    p.add_argument('--out', default='results/cpu/noise',
                   help='where report.md and report.json go')
    p.add_argument('--plateau_ce', type=float, default=2.5,
                   help='training CE that marks leaving the plateau')
    args = p.parse_args(argv)

    best = {}
    for members in GROUPS.values():
        for m in members:
            for cfg in CONFIGS:
                best[(cfg, *m)] = best_val(args.runs, cfg, *m)
    rows = noise_table(best)

    per_window = {cfg: window_losses(run_dir(args.runs, cfg, 1, 1)) for cfg in CONFIGS}
    check_window_losses(per_window, best)
    n, se = standard_errors(per_window)
    escapes = {}
    for name, runs in plateau_escapes(args.runs, args.plateau_ce).items():
        escapes[name] = escape_summary(runs)
    summary = {'std_by_source': rows, 'val_windows': n, 'val_standard_error': se,
               'plateau_ce': args.plateau_ce, 'plateau_escape': escapes}

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, 'report.json'), 'w') as f:
        json.dump(summary, f, indent=1)
    text = markdown(rows, n, se, args.plateau_ce, escapes)
    with open(os.path.join(args.out, 'report.md'), 'w') as f:
        f.write(text)
    print(text, end='')


if __name__ == '__main__':
    with one_line_errors('seed_noise.py'):
        main()
