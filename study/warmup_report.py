"""The CPU study under a warmup fixed in steps (make warmup): the sweep, the rule's pick, the
study at the picked warmup, the token budgets under it, and the routers' first steps.

    python -m study.warmup_report --chosen 112 --out results/cpu/warmup RUN_FOLDER...

A run's name says its cell: `w112_b25_cpu_moe` is cpu_moe with a warmup of 112 steps
(`--warmup_iters=112`) on 25% of the recipe's tokens; without `w<steps>_` the warmup is the
first protocol's, 2% of the run's steps (`cpu_moe`: 22 steps), without `b<percent>_` the budget is
the recipe's. Gaps are seed-paired as in report.py: vs_dense_total = config - cpu_dense_total of the
same warmup and budget (negative: the config is better), active = cpu_dense_active - cpu_moe.
"""
import argparse
import json
import math
import os
import re
import sys
import types
from collections import defaultdict

import report
import train
from errors import UserError, one_line_errors
from study.compute import t_statistic

FRACTION = '2%'  # the warmup of a run without w<steps>_: the first protocol's 2% of its steps
WARMUPS = (FRACTION, '56', '112', '224')
SWEEP_SEEDS = (1, 2, 3, 4, 5)  # the sweep's seeds: the rule reads cpu_dense_total's on these
RULE = ('the warmup (of 22, 56, 112 and 224 steps) with the lowest mean best val loss of '
        'cpu_dense_total over seeds 1-5')
TRIO = ('cpu_dense_active', 'cpu_moe', 'cpu_dense_total')
STUDY_SEEDS = tuple(range(1, 11))
# the shared expert's test on fresh seeds, written down before its runs (README.md): on these
# seeds alone, a paired t below REPLICATION_T (5%, two-sided, 9 degrees of freedom)
REPLICATION_SEEDS = tuple(range(11, 21))
REPLICATION_T = -2.26
# the routers' first steps, as the plot shows them
EARLY_STEPS = 300
NAME = re.compile(r'(?:w(\d+)_)?(?:b(\d+)_)?(cpu_\w+)$')


def cell_of(name):
    """'w112_b25_cpu_moe' -> ('112', '25', 'cpu_moe'); 'cpu_moe' -> ('2%', '100', 'cpu_moe');
    None for a name outside the study."""
    m = NAME.match(name)
    if m is None:
        return None
    steps, percent, config = m.groups()
    return steps or FRACTION, percent or '100', config


def group_cells(runs, wanted):
    """{warmup: {budget: {config: {seed: run}}}} of every run the names place, of the wanted
    seeds."""
    cells = defaultdict(lambda: defaultdict(dict))
    for name, seeds in runs.items():
        cell = cell_of(name)
        if cell is not None and only_seeds(seeds, wanted):
            warmup, budget, config = cell
            cells[warmup][budget][config] = only_seeds(seeds, wanted)
    return cells


def only_seeds(seeds, wanted):
    return {s: run for s, run in seeds.items() if s in wanted}


def gap_entry(a, b):
    """report.paired(a, b) with its t statistic; NO_GAP where they share no seed."""
    gap = report.paired(a, b) or report.NO_GAP
    return {**gap, 't': t_statistic(gap) if gap['n'] else None}


def config_entry(seeds):
    """A config's best val losses in one cell, its warmup in steps and its plateau exits."""
    c = types.SimpleNamespace(**{**train.DEFAULTS, **next(iter(seeds.values()))['config']})
    mean, std = report.mean_std([r['best']['val_loss'] for r in seeds.values()])
    return {'warmup_steps': train.warmup_steps(c, c.iters), 'iters': c.iters,
            'mean': mean, 'std': std, 'n': len(seeds),
            'per_seed': {str(s): seeds[s]['best']['val_loss'] for s in sorted(seeds)},
            'exit_step': {str(s): seeds[s]['exit_step'] for s in sorted(seeds)}}


def summarise_cell(configs):
    """Each config of one warmup and budget, with its gap to cpu_dense_total; and the active gap."""
    dense = configs.get('cpu_dense_total', {})
    out = {'configs': {}}
    for name, seeds in sorted(configs.items()):
        out['configs'][name] = config_entry(seeds)
        if name != 'cpu_dense_total':
            out['configs'][name]['vs_dense_total'] = gap_entry(seeds, dense)
    out['active'] = gap_entry(configs.get('cpu_dense_active', {}), configs.get('cpu_moe', {}))
    return out


def pick(cells):
    """The rule's warmup and the cpu_dense_total means it compares; None for the pick while a
    warmup lacks one of the sweep's seeds."""
    means = {}
    for warmup in WARMUPS:
        seeds = cells.get(warmup, {}).get('100', {}).get('cpu_dense_total', {})
        sweep = only_seeds(seeds, SWEEP_SEEDS)
        if len(sweep) == len(SWEEP_SEEDS):
            means[warmup] = report.mean_std([r['best']['val_loss'] for r in sweep.values()])[0]
    if len(means) < len(WARMUPS):
        return None, means
    return min(means, key=means.get), means


def early_curves(seeds, key):
    """{seed: ([steps], [values])} of a training-line key over the first EARLY_STEPS steps."""
    out = {}
    for s, run in sorted(seeds.items()):
        path = os.path.join(run['path'], 'log.jsonl')
        with open(path) as f:
            records = report.read_records(path, f.read().splitlines(), warn=lambda message: None)
        points = [(r['iter'], r[key]) for r in records
                  if key in r and 'tok_per_s' in r and r['iter'] <= EARLY_STEPS]
        out[str(s)] = ([p[0] for p in points], [p[1] for p in points])
    return out


def replication(runs, chosen):
    """The shared expert against dense_total at the chosen warmup on the fresh seeds alone, and
    on every seed pooled; None before both configs have a fresh seed."""
    fresh = group_cells(runs, REPLICATION_SEEDS).get(chosen, {}).get('100', {})
    pooled = group_cells(runs, STUDY_SEEDS + REPLICATION_SEEDS).get(chosen, {}).get('100', {})
    shared, dense = 'cpu_moe_shared', 'cpu_dense_total'
    if shared not in fresh or dense not in fresh:
        return None
    gap = gap_entry(fresh[shared], fresh[dense])
    complete = gap['n'] == len(REPLICATION_SEEDS)
    return {'seeds': list(REPLICATION_SEEDS), 'rule_t': REPLICATION_T,
            'configs': {name: config_entry(fresh[name]) for name in (shared, dense)},
            'vs_dense_total': gap, 'pooled': gap_entry(pooled[shared], pooled[dense]),
            'established': complete and gap['t'] is not None and gap['t'] < REPLICATION_T}


def gap_of(cell, gap):
    """A cell's active gap (dense_active - moe) or total gap (moe - dense_total)."""
    if gap == 'active':
        return cell['active']
    return cell['configs'].get('cpu_moe', {}).get('vs_dense_total', report.NO_GAP)


def move_entry(before, after):
    """How a gap moves between two budgets: per seed (those both have), the gap at `after` minus
    the gap at `before`, with report.paired's fields and t; NO_GAP under two seeds."""
    seeds = sorted(set(before['per_seed']) & set(after['per_seed']), key=int)
    per_seed = {s: after['per_seed'][s] - before['per_seed'][s] for s in seeds}
    if len(per_seed) < 2:
        return {**report.NO_GAP, 't': None}
    mean, std = report.mean_std(list(per_seed.values()))
    move = {'mean': mean, 'std': std, 'se': std / math.sqrt(len(per_seed)), 'n': len(per_seed),
            'positive': sum(v > 0 for v in per_seed.values()), 'per_seed': per_seed}
    return {**move, 't': t_statistic(move)}


def budget_moves(budgets):
    """{'25-50': {'active': move, 'total': move}, ...}: each gap's move from one budget to the
    next (budgets: {budget: summarise_cell} of one warmup)."""
    order = sorted(budgets, key=int)
    return {f'{small}-{large}': {gap: move_entry(gap_of(budgets[small], gap),
                                                 gap_of(budgets[large], gap))
                                 for gap in ('active', 'total')}
            for small, large in zip(order, order[1:])}


def summarise(runs, chosen):
    cells = group_cells(runs, STUDY_SEEDS)
    picked, means = pick(cells)
    out = {'rule': RULE, 'dense_total_means': means, 'picked': picked, 'chosen': chosen,
           'cells': {}}
    for warmup in sorted(cells, key=lambda w: (w != FRACTION, int(w) if w.isdigit() else 0)):
        out['cells'][warmup] = {budget: summarise_cell(cells[warmup][budget])
                                for budget in sorted(cells[warmup], key=int)}
    # the sweep: seeds 1-5 at the recipe's budget, every warmup
    out['sweep'] = {}
    for warmup in WARMUPS:
        configs = cells.get(warmup, {}).get('100', {})
        sweep = {name: only_seeds(seeds, SWEEP_SEEDS) for name, seeds in configs.items()
                 if name in TRIO}
        if sweep:
            out['sweep'][warmup] = summarise_cell(sweep)
    out['moves'] = {warmup: budget_moves(out['cells'][warmup])
                    for warmup in (FRACTION, chosen) if warmup in out['cells']}
    out['replication'] = replication(runs, chosen)
    # the routers' first steps: cpu_moe under the recipe's warmup and the chosen one
    out['early'] = {}
    for warmup in (FRACTION, chosen):
        seeds = cells.get(warmup, {}).get('100', {}).get('cpu_moe')
        if seeds:
            out['early'][warmup] = {key: early_curves(seeds, key)
                                    for key in ('ce', 'busiest_frac', 'router_entropy')}
    return out


# ----------------------------------------------------------------------------- report.md
def gap_text(g):
    """mean ± std [k of n > 0], t."""
    if not g['n']:
        return '-'
    if g['n'] == 1:
        return f'{g["mean"]:+.4f} (1 seed)'
    t = f', t {g["t"]:+.2f}' if g['t'] is not None else ''
    return f'{g["mean"]:+.4f} ± {g["std"]:.4f} [{g["positive"]} of {g["n"]} > 0{t}]'


def warmup_label(warmup, entry):
    steps = entry['warmup_steps']
    return f'{steps} (2%)' if warmup == FRACTION else str(steps)


def loss_cell(configs, name):
    """mean ± std, and the number of seeds where it is not the sweep's all."""
    e = configs.get(name)
    if e is None:
        return '-'
    seeds = '' if e['n'] == len(SWEEP_SEEDS) else f' ({e["n"]} seeds)'
    return report.mean_pm_std(e['mean'], e['std']) + seeds


def rule_lines(summary):
    lines = ['## The rule and its pick', '', f'The rule: {summary["rule"]}.', '',
             '| warmup | cpu_dense_total, mean of seeds 1-5 |', '|---|---|']
    for warmup, mean in summary['dense_total_means'].items():
        label = '22 (2%)' if warmup == FRACTION else warmup
        lines.append(f'| {label} | {mean:.4f} |')
    picked = summary['picked']
    lines += ['', f'Picked: {picked or "not yet (a warmup lacks seeds)"}; the study below ran '
              f'at {summary["chosen"]} steps.', '']
    return lines


def sweep_lines(sweep):
    lines = ['## The sweep: seeds 1-5, the recipe\'s tokens', '',
             '| warmup | cpu_dense_active | cpu_moe | cpu_dense_total | active: dense_active - '
             'moe | total: moe - dense_total | cpu_moe leaves the plateau |',
             '|---|---|---|---|---|---|---|']
    for warmup, cell in sweep.items():
        configs = cell['configs']
        moe = configs.get('cpu_moe')
        first = next(iter(configs.values()))
        total = moe['vs_dense_total'] if moe else report.NO_GAP
        exits = report.exit_text(moe['exit_step']) if moe else '-'
        lines.append(f'| {warmup_label(warmup, first)} | '
                     f'{" | ".join(loss_cell(configs, n) for n in TRIO)} | '
                     f'{gap_text(cell["active"])} | {gap_text(total)} | {exits} |')
    return lines + ['']


def study_lines(cells, chosen):
    lines = ['## The study: every seed, the recipe\'s tokens', '',
             '| warmup | config | seeds | best val loss | vs cpu_dense_total | leaves the plateau '
             f'(train CE < {report.EXIT_CE}) |', '|---|---|---|---|---|---|']
    for warmup in (FRACTION, chosen):
        configs = cells.get(warmup, {}).get('100', {'configs': {}})['configs']
        for name, e in configs.items():
            gap = gap_text(e['vs_dense_total']) if 'vs_dense_total' in e else ''
            lines.append(f'| {warmup_label(warmup, e)} | {name} | {e["n"]} | '
                         f'{report.mean_pm_std(e["mean"], e["std"])} | {gap} | '
                         f'{report.exit_text(e["exit_step"])} |')
    lines += ['', '| gap | ' + ' | '.join(f'warmup {w}' for w in (FRACTION, chosen)) +
              ' | paper |', '|---|---|---|---|']
    active = [gap_text(cells.get(w, {}).get('100', {}).get('active', report.NO_GAP))
              for w in (FRACTION, chosen)]
    lines.append(f'| active: dense_active - moe | {" | ".join(active)} | '
                 f'+{report.PAPER_GAPS["active"]:.4f} |')
    total = [gap_text(cells.get(w, {}).get('100', {'configs': {}})['configs']
                      .get('cpu_moe', {}).get('vs_dense_total', report.NO_GAP))
             for w in (FRACTION, chosen)]
    lines.append(f'| total: moe - dense_total | {" | ".join(total)} | '
                 f'+{report.PAPER_GAPS["total"]:.4f} |')
    paper = ', '.join(f'{k} {m:.4f} ± {s:.4f}' for k, (m, s) in report.PAPER.items())
    return lines + ['', f'Paper (3 seeds, 426.3M tokens): {paper}.', '']


def budget_lines(cells, chosen):
    lines = ['## The token budgets', '',
             '| warmup | budget | warmup steps | active: dense_active - moe | total: moe - '
             'dense_total | cpu_moe_shared - dense_total |', '|---|---|---|---|---|---|']
    for warmup in (FRACTION, chosen):
        for budget, cell in cells.get(warmup, {}).items():
            configs = cell['configs']
            if 'cpu_moe' not in configs:
                continue
            shared = configs.get('cpu_moe_shared', {}).get('vs_dense_total', report.NO_GAP)
            lines.append(f'| {"2%" if warmup == FRACTION else warmup} | {budget}% | '
                         f'{configs["cpu_moe"]["warmup_steps"]} | {gap_text(cell["active"])} | '
                         f'{gap_text(configs["cpu_moe"]["vs_dense_total"])} | '
                         f'{gap_text(shared)} |')
    return lines + ['']


def move_lines(moves):
    lines = ['## How the gaps move with the budget', '',
             'Per seed, a gap at the larger budget minus the same gap at the smaller, over the '
             'seeds both have: a positive move of the active gap, it grows; a negative move of the '
             '(positive) total gap, it narrows.', '',
             '| warmup | budgets | active gap, larger - smaller | total gap, larger - smaller |',
             '|---|---|---|---|']
    for warmup, pairs in moves.items():
        for budgets, move in pairs.items():
            small, large = budgets.split('-')
            lines.append(f'| {warmup} | {small}% -> {large}% | {gap_text(move["active"])} | '
                         f'{gap_text(move["total"])} |')
    return lines + ['']


def replication_lines(r):
    seeds = f'seeds {r["seeds"][0]}-{r["seeds"][-1]}'
    gap = r['vs_dense_total']
    if gap['n'] < len(r['seeds']):
        verdict = f'not decided yet: {gap["n"]} of {len(r["seeds"])} seeds'
    elif r['established']:
        verdict = f'yes: t {gap["t"]:+.2f} < {r["rule_t"]}'
    else:
        verdict = f'no: t {gap["t"]:+.2f} is not below {r["rule_t"]}'
    shared, dense = (report.mean_pm_std(r['configs'][name]['mean'], r['configs'][name]['std'])
                     for name in ('cpu_moe_shared', 'cpu_dense_total'))
    return ['## The replication: cpu_moe_shared against cpu_dense_total on fresh seeds', '',
            f'Written down before its runs: the shared expert beats dense_total at equal tokens if '
            f'its paired gap on {seeds} alone has t below {r["rule_t"]}.', '',
            '| seeds | cpu_moe_shared | cpu_dense_total | cpu_moe_shared - dense_total | '
            'beats dense_total |', '|---|---|---|---|---|',
            f'| {seeds} | {shared} | {dense} | {gap_text(gap)} | {verdict} |',
            f'| all, pooled after looking | | | {gap_text(r["pooled"])} | |', '']


def markdown(summary, warnings, plot_name):
    lines = ['# The CPU study under a warmup fixed in steps', '',
             'Best val loss, mean ± std over seeds; gaps seed-paired, mean ± std [seeds > 0 of '
             'seeds, paired t]; a negative gap to cpu_dense_total: the config is better.', '']
    lines += rule_lines(summary)
    lines += sweep_lines(summary['sweep'])
    lines += study_lines(summary['cells'], summary['chosen'])
    lines += budget_lines(summary['cells'], summary['chosen'])
    lines += move_lines(summary['moves'])
    if summary['replication']:
        lines += replication_lines(summary['replication'])
    if plot_name:
        lines += [f'![cpu_moe\'s first {EARLY_STEPS} steps]({plot_name})', '']
    if warnings:
        lines += ['## Warnings', ''] + [f'- {w}' for w in warnings] + ['']
    return '\n'.join(lines)


def plot_early(early, out_dir):
    """Training CE, busiest_frac and router entropy over the first steps: each seed thin, under
    each warmup."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    keys = ('ce', 'busiest_frac', 'router_entropy')
    fig, axes = plt.subplots(1, len(keys), figsize=(13, 3.6))
    for (warmup, curves), color in zip(early.items(), ('tab:red', 'tab:blue')):
        label = 'warmup 2% (22 steps)' if warmup == FRACTION else f'warmup {warmup} steps'
        for ax, key in zip(axes, keys):
            for i, (steps, values) in enumerate(curves[key].values()):
                ax.plot(steps, values, color=color, lw=0.9, alpha=0.6,
                        label=label if i == 0 else None)
    for ax, key in zip(axes, keys):
        ax.set_xlabel('step')
        ax.set_title(f'cpu_moe: {key}, each seed')
    axes[0].axhline(report.EXIT_CE, color='gray', ls=':', lw=0.8)
    axes[1].axhline(0.25, color='gray', ls=':', lw=0.8)  # 4 experts, evenly loaded
    axes[0].legend()
    fig.tight_layout()
    name = 'early_routing.png'
    fig.savefig(os.path.join(out_dir, name), dpi=110)
    plt.close(fig)
    return name


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('runs', nargs='+', help='run folders')
    p.add_argument('--chosen', required=True, help='the warmup (steps) the study ran at')
    p.add_argument('--out', default='results/cpu/warmup', help='folder for report.md/.json')
    args = p.parse_args(argv)
    warnings = []
    runs = report.load_runs([r for r in args.runs if os.path.isdir(r)], warnings.append)
    if not runs:
        raise UserError('no runs found; give run folders (each with a config.json and a '
                        'log.jsonl), e.g. results/cpu/warmup/runs/*')
    summary = summarise(runs, args.chosen)
    if summary['picked'] and summary['picked'] != args.chosen:
        warnings.append(f'the rule picks {summary["picked"]}, the study ran at {args.chosen}')
    os.makedirs(args.out, exist_ok=True)
    plot_name = plot_early(summary['early'], args.out) if summary['early'] else None
    text = markdown(summary, warnings, plot_name)
    with open(os.path.join(args.out, 'report.md'), 'w') as f:
        f.write(text)
    with open(os.path.join(args.out, 'report.json'), 'w') as f:
        json.dump(report.finite_or_none(summary), f, indent=1)
    print(text)


if __name__ == '__main__':
    with one_line_errors('warmup_report.py'):
        main(sys.argv[1:])
