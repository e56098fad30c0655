"""What the routers do under the CPU recipe (make route): route.py's statistics and settling curves
of each run, mean and spread over seeds per config, and the shared expert's pre-registered test
(results/cpu/route/prereg.md).

    python -m study.route_report results/cpu/route/runs --out results/cpu/route

Each run folder holds config.json and log.jsonl as train.py wrote them (the log is kept, not read),
and route.py's stats.json (--stats, on the validation split) and settle.json (--settle).
"""
import argparse
import json
import math
import os
import sys
from collections import defaultdict

from errors import UserError, one_line_errors
from report import mean_std
from study.compute import t_statistic

# the pre-registered test: U of cpu_moe_shared - U of cpu_moe, paired over these seeds, two-sided
# at 5% with 9 degrees of freedom
PREREG_SEEDS = tuple(range(51, 61))
PREREG_PAIR = ('cpu_moe_shared', 'cpu_moe')
PREREG_T = 2.262
# looked at after the runs, deciding nothing: the number of experts alone can move U (8 experts
# with no shared one against cpu_moe's 4), and the shared expert against 8 routed ones
DESCRIPTIVE_PAIRS = (('cpu_moe_fine8_top2', 'cpu_moe'), ('cpu_moe_shared', 'cpu_moe_fine8_top2'))
SETTLED = 0.9  # "settled": the step from which a run's share of its final routing stays >= this
LAYER_KEYS = ('u_token', 'u_class', 'repeat', 'repeat_chance', 'any_shared', 'any_shared_chance')


def read_runs(folder):
    """{config: {seed: run}} of the run folders in folder; a run: its config.json, stats, settle."""
    runs = defaultdict(dict)
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        try:
            with open(os.path.join(path, 'config.json')) as f:
                config = json.load(f)
            with open(os.path.join(path, 'stats.json')) as f:
                stats = json.load(f)
            with open(os.path.join(path, 'settle.json')) as f:
                settle = json.load(f)
        except OSError as e:
            raise UserError(f'{path} is not a routed run ({e.strerror}: {e.filename}); make '
                            'route writes config.json, stats.json and settle.json') from None
        if settle['steps'][-1] != config['iters']:
            raise UserError(f'{path} stops at step {settle["steps"][-1]} of {config["iters"]}: '
                            'finish its run (make route_runs) before its statistics')
        config_name = config['config_name'].removeprefix('route_')
        runs[config_name][config['seed']] = {'config': config, 'stats': stats, 'settle': settle}
    if not runs:
        raise UserError(f'no runs in {folder}')
    return runs


def spread(values):
    """mean, std (n - 1) and n of a list, its Nones left out; std None for one value."""
    values = [v for v in values if v is not None]
    if not values:
        return {'mean': None, 'std': None, 'n': 0}
    mean, std = mean_std(values)
    return {'mean': mean, 'std': std if len(values) > 1 else None, 'n': len(values)}


def settled_step(settle):
    """The first kept step from which the share of the final routing stays >= SETTLED."""
    step = settle['steps'][-1]
    for s, share in reversed(list(zip(settle['steps'], settle['mean']))):
        if share < SETTLED:
            break
        step = s
    return step


def summarise_config(seeds):
    """A config's statistics over its seeds: per layer and the run's mean over layers."""
    runs = list(seeds.values())
    n_layers = len(runs[0]['stats']['layers'])
    layers = []
    for i in range(n_layers):
        layer = {}
        for key in LAYER_KEYS:
            if key in runs[0]['stats']['layers'][i]:
                layer[key] = spread([r['stats']['layers'][i][key] for r in runs])
        layers.append(layer)
    steps = runs[0]['settle']['steps']
    shares = [[r['settle']['mean'][j] for r in runs] for j in range(len(steps))]
    return {'seeds': sorted(seeds), 'cpu': sorted({r['config']['cpu'] for r in runs}),
            'n_experts': runs[0]['stats']['n_experts'], 'top_k': runs[0]['stats']['top_k'],
            'u_token': spread([r['stats']['u_token'] for r in runs]),
            'layers': layers,
            'settle': {'steps': steps, 'share': [spread(s) for s in shares]},
            'settled_step': spread([settled_step(r['settle']) for r in runs])}


def paired_u(a, b, seeds):
    """U of a - U of b, per seed of `seeds` where both have a U: mean, std, se, t, positive."""
    d = {str(s): a[s]['stats']['u_token'] - b[s]['stats']['u_token'] for s in seeds
         if s in a and s in b and None not in (a[s]['stats']['u_token'], b[s]['stats']['u_token'])}
    out = {'seeds': [int(s) for s in d], 'per_seed': d}
    if len(d) < 2:
        return out
    mean, std = mean_std(list(d.values()))
    se = std / math.sqrt(len(d))
    return {**out, 'mean': mean, 'std': std, 'se': se,
            't': t_statistic({'mean': mean, 'se': se}), 'positive': sum(v > 0 for v in d.values())}


def prereg_test(runs):
    """The pre-registered test on the seeds both configs have of PREREG_SEEDS: d_s, paired t, the
    95% interval of the mean and the verdict (decided only with all 10 seeds and a t)."""
    a, b = (runs.get(name, {}) for name in PREREG_PAIR)
    out = {**paired_u(a, b, PREREG_SEEDS), 'threshold': PREREG_T, 'verdict': None}
    if out['seeds'] == list(PREREG_SEEDS) and out.get('t') is not None:
        mean, se = out['mean'], out['se']
        out['interval'] = [mean - PREREG_T * se, mean + PREREG_T * se]
        if out['t'] > PREREG_T:
            out['verdict'] = 'confirmed'
        elif out['t'] < -PREREG_T:
            out['verdict'] = 'reversed'
        else:
            out['verdict'] = 'not established'
    return out


def summarise(runs):
    descriptive = {f'{a} - {b}': paired_u(runs.get(a, {}), runs.get(b, {}), PREREG_SEEDS)
                   for a, b in DESCRIPTIVE_PAIRS}
    return {'configs': {name: summarise_config(seeds) for name, seeds in sorted(runs.items())},
            'prereg': prereg_test(runs), 'descriptive': descriptive}


# ----------------------------------------------------------------------------- report.md
def value(s, digits=3):
    """mean ± std, the mean alone for one seed, - for none."""
    if s['mean'] is None:
        return '-'
    if s['std'] is None:
        return f'{s["mean"]:.{digits}f}'
    return f'{s["mean"]:.{digits}f} ± {s["std"]:.{digits}f}'


def prereg_lines(p):
    lines = ['## The pre-registered test: do routed experts specialise more beside a shared '
             'expert?', '',
             'U of `cpu_moe_shared` minus U of `cpu_moe`, per seed (U = I(byte; first choice) / '
             'H(first choice), the mean over the 4 layers); [prereg.md](prereg.md) fixed the test '
             f'before the runs: paired t over seeds 51-60, |t| > {p["threshold"]}.', '']
    if 't' not in p:
        return lines + [f'Not decided yet: {len(p["seeds"])} of {len(PREREG_SEEDS)} seeds.', '']
    t = '-' if p['t'] is None else f'{p["t"]:+.2f}'
    per_seed = ', '.join(f's{s}: {v:+.4f}' for s, v in p['per_seed'].items())
    lines += [f'- d = {p["mean"]:+.4f} ± {p["std"]:.4f} (mean ± std), {p["positive"]} of '
              f'{len(p["seeds"])} seeds > 0, paired t {t}.', f'- per seed: {per_seed}.']
    if p['verdict'] is None:
        lines.append(f'- Not decided: {len(p["seeds"])} of {len(PREREG_SEEDS)} seeds, t {t}.')
    else:
        low, high = p['interval']
        lines.append(f'- 95% interval of the mean: {low:+.4f} to {high:+.4f}. '
                     f'**Verdict: {p["verdict"]}.**')
    return lines + ['', 'What the verdict cannot tell apart: `cpu_moe_shared` has 6 routed '
                    'experts, `cpu_moe` 4, and the number of experts alone moves U (with each '
                    'byte spread as widely, more experts raise it). The comparisons below, looked '
                    'at after the runs, decide nothing.', '']


def descriptive_lines(descriptive):
    lines = ['## Beside the test, looked at after the runs', '',
             '| U of - U of | mean ± std | seeds > 0 | paired t |', '|---|---|---|---|']
    for pair, d in descriptive.items():
        if 't' not in d:
            lines.append(f'| {pair} | - | | |')
            continue
        t = '-' if d['t'] is None else f'{d["t"]:+.2f}'
        lines.append(f'| {pair} | {d["mean"]:+.4f} ± {d["std"]:.4f} | {d["positive"]} of '
                     f'{len(d["seeds"])} | {t} |')
    return lines + ['']


def config_lines(configs):
    lines = ['## Per config, mean ± std over seeds', '',
             'First choices on the whole validation split. U token and U class: I(byte; expert) '
             'and I(byte class; expert) over H(expert); repeat: consecutive bytes with the same '
             'first choice, beside chance for independent bytes; settled: the step from which a '
             f'run keeps >= {SETTLED} of its final top-k choices.', '',
             '| config | experts | seeds | layer | U token | U class | repeat (chance) | '
             'any of k shared (chance) |', '|---|---|---|---|---|---|---|---|']
    for name, s in configs.items():
        for i, layer in enumerate(s['layers']):
            u_class = value(layer['u_class']) if 'u_class' in layer else '-'
            lines.append(f'| {name} | {s["n_experts"]}, top-{s["top_k"]} | {len(s["seeds"])} | '
                         f'{i} | {value(layer["u_token"])} | {u_class} | '
                         f'{value(layer["repeat"])} ({value(layer["repeat_chance"])}) | '
                         f'{value(layer["any_shared"])} ({value(layer["any_shared_chance"])}) |')
    lines += ['', '| config | U token, mean over layers | settled at step | share of the final '
              'routing at steps 100, 250, 500 |', '|---|---|---|---|']
    for name, s in configs.items():
        shares = dict(zip(s['settle']['steps'], s['settle']['share']))
        at = ', '.join(value(shares[step], 2) if step in shares else '-'
                       for step in (100, 250, 500))
        lines.append(f'| {name} | {value(s["u_token"])} | {value(s["settled_step"], 0)} | '
                     f'{at} |')
    cpus = sorted({cpu for s in configs.values() for cpu in s['cpu']})
    return lines + ['', f'Trained on: {"; ".join(cpus)}.', '']


def plot_settle(configs, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, s in configs.items():
        steps = s['settle']['steps']
        mean = [x['mean'] for x in s['settle']['share']]
        std = [x['std'] or 0 for x in s['settle']['share']]
        ax.plot(steps, mean, label=f'{name} ({len(s["seeds"])} seeds)')
        ax.fill_between(steps, [m - d for m, d in zip(mean, std)],
                        [m + d for m, d in zip(mean, std)], alpha=0.2)
    ax.set_xlabel('step')
    ax.set_ylabel('share of the final top-k choices')
    ax.set_title('When the routing settles (mean over layers; band: ± std over seeds)',
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('runs', help='the folder of routed runs')
    p.add_argument('--out', required=True)
    args = p.parse_args(argv)
    summary = summarise(read_runs(args.runs))
    os.makedirs(args.out, exist_ok=True)
    plot_settle(summary['configs'], os.path.join(args.out, 'settle.png'))
    lines = ['# What the routers do, under the CPU recipe', '']
    lines += prereg_lines(summary['prereg']) + descriptive_lines(summary['descriptive'])
    lines += config_lines(summary['configs'])
    lines += ['![When the routing settles](settle.png)', '']
    with open(os.path.join(args.out, 'report.md'), 'w') as f:
        f.write('\n'.join(lines))
    with open(os.path.join(args.out, 'report.json'), 'w') as f:
        json.dump(summary, f, indent=1)
    print('\n'.join(lines))


if __name__ == '__main__':
    with one_line_errors('study.route_report'):
        main(sys.argv[1:])
