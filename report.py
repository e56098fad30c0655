"""
The paper's table, both gaps, the gaps over training, routing health and plots, from run folders.

    python report.py out/cpu_*                  # -> ./report.md (also printed), report.json, *.png
    python report.py 'out/*' --out out/report

Runs are grouped by the config name and seed recorded in their config.json (not by folder names).
A config's role comes from its name: `moe`, `cpu_moe` -> moe; `dense_active`, `cpu_dense_active`
-> dense_active; `..._dense_total` -> dense_total; anything else (ablations) has none. Configs that
share a prefix (`cpu_`, or none for paper scale) form a family, and each family is compared as its
own triple. Gaps are seed-paired: seed s of one config against seed s of the other. The CPU study
builds its own sections (variants, scans, budgets) on these functions: study/report.py.
"""
import argparse
import glob
import json
import math
import os
import sys
import types
from collections import defaultdict

import train
from errors import UserError, one_line_errors

ROLES = ('dense_active', 'moe', 'dense_total')
# the paper's best val losses (mean, std over 3 seeds) and gaps, shown beside paper-scale results
PAPER = {'moe': (1.5788, 0.0020), 'dense_active': (1.6545, 0.0012), 'dense_total': (1.5608, 0.0025)}
PAPER_GAPS = {'active': 0.0758, 'total': 0.0180}
ROUTING = ('busiest_frac', 'usage_var', 'router_entropy', 'log_z', 'dropped_frac')
# a run has left the early plateau (training CE near 3.0) at its first logged step below this
EXIT_CE = 2.5
# the gap of two configs that share no seed
NO_GAP = {'mean': None, 'std': None, 'se': None, 'n': 0, 'positive': 0, 'per_seed': {}}
EMPTY_CURVE = {'tokens': [], 'active': [], 'total': []}
# the two gaps: which role is subtracted from which (a positive gap: the first model is worse)
GAP_ROLES = {'active': ('dense_active', 'moe'), 'total': ('moe', 'dense_total')}
GAP_LABELS = {'active': 'dense_active - moe', 'total': 'moe - dense_total'}
# |paired t| (mean / standard error) past which a gap is decided, as study/claims.py decides claims
T_DECIDES = 2.5
ROLE_WORDS = {'moe': 'the MoE', 'dense_active': 'dense_active', 'dense_total': 'dense_total'}


def role_of(name):
    """-> (family prefix, role), or (None, None) for configs outside the three-way comparison."""
    for role in ROLES:
        if name == role or name.endswith('_' + role):
            return name[:-len(role)], role
    return None, None


def mean_std(values):
    """Mean and sample standard deviation (0 for a single value)."""
    n = len(values)
    mean = sum(values) / n
    if n == 1:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def read_records(path, lines, warn):
    """The log's records; an unreadable line (a run killed mid-write) is skipped with a warning."""
    records = []
    for line in filter(None, lines):
        try:
            records.append(json.loads(line))
        except ValueError:
            warn(f'{path}: skipped an unreadable log line')
    return records


def add_flops(config, records):
    """Every record's training FLOPs so far, as train.py logs them (older logs: from the config)."""
    if 'flops_per_token' not in config:
        c = types.SimpleNamespace(**{**train.DEFAULTS, **config})
        config['flops_per_token'] = train.flops_per_token(c)
    for r in records:
        r.setdefault('flops', r['tokens'] * config['flops_per_token'])


def train_seconds(records):
    """Training time, evaluation excluded: each training line's new tokens over its tok_per_s."""
    seconds, tokens = 0.0, 0
    for r in records:
        if 'tok_per_s' in r:
            seconds += (r['tokens'] - tokens) / r['tok_per_s']
            tokens = r['tokens']
    return seconds


def fastest_step_ms(config, records):
    """The fastest logged training interval's ms per step: the step time least slowed by whatever
    else ran on the machine; None for a log without speeds."""
    speeds = [r['tok_per_s'] for r in records if 'tok_per_s' in r]
    if not speeds or 'tokens_per_iter' not in config:
        return None
    return 1e3 * config['tokens_per_iter'] / max(speeds)


def load_runs(paths, warn):
    """{config name: {seed: run}} from run folders; other folders are reported and skipped."""
    runs = defaultdict(dict)
    for path in paths:
        if not os.path.isfile(os.path.join(path, 'config.json')):
            # not a run folder (e.g. a report folder next to the runs)
            continue
        try:
            with open(os.path.join(path, 'config.json')) as f:
                config = json.load(f)
            name, seed = config['config_name'], config['seed']
            with open(os.path.join(path, 'log.jsonl')) as f:
                lines = f.read().splitlines()
        except (OSError, ValueError, KeyError, TypeError) as e:
            warn(f'skipped {path}: not a readable run ({type(e).__name__})')
            continue
        # init and data order apart: a seed-noise run
        if config.get('data_seed', 0) not in (0, seed):
            warn(f'skipped {path}: its data order (data_seed {config["data_seed"]}) is not its '
                 'seed\'s, so it is no seed of its config')
            continue
        records = read_records(path, lines, warn)
        # a diverged (NaN/inf) evaluation is never a best checkpoint
        evals = [r for r in records if 'val_loss' in r]
        finite = [r for r in evals if math.isfinite(r['val_loss'])]
        if not finite:
            warn(f'skipped {path}: no finite evaluation yet')
            continue
        if seed in runs[name]:
            warn(f'skipped {path}: {name} seed {seed} already comes from '
                 f'{runs[name][seed]["path"]}')
            continue
        add_flops(config, records)
        best = min(finite, key=lambda r: r['val_loss'])
        exit_step = next((r['iter'] for r in records if r.get('ce', math.inf) < EXIT_CE), None)
        finished = evals[-1]['iter'] == config.get('iters')
        runs[name][seed] = {'path': path, 'config': config, 'evals': evals, 'best': best,
                            'exit_step': exit_step, 'finished': finished,
                            'last_val': evals[-1]['val_loss'],
                            'flops': records[-1]['flops'], 'tokens': records[-1]['tokens'],
                            'train_seconds': train_seconds(records),
                            'fastest_step_ms': fastest_step_ms(config, records)}
        if not finished:
            warn(f'{path} has not finished (last eval at iter {evals[-1]["iter"]} of '
                 f'{config.get("iters")})')
    return runs


def paired(a, b):
    """Seed-paired differences a - b of best val losses over the seeds both have: mean, sample std,
    standard error (std / sqrt(n)), n, how many > 0, each seed's; None without a shared seed."""
    seeds = sorted(set(a) & set(b))
    per_seed = {str(s): a[s]['best']['val_loss'] - b[s]['best']['val_loss'] for s in seeds}
    if not per_seed:
        return None
    mean, std = mean_std(list(per_seed.values()))
    n = len(per_seed)
    se = std / math.sqrt(n) if n > 1 else None  # one seed has no standard error
    positive = sum(v > 0 for v in per_seed.values())
    return {'mean': mean, 'std': std, 'se': se, 'n': n, 'positive': positive, 'per_seed': per_seed}


def val_at_tokens(run):
    """{tokens: val loss} over a run's evaluations."""
    return {r['tokens']: r['val_loss'] for r in run['evals']}


def gap_vs_tokens(a, b):
    """Mean over paired seeds of val_loss(a) - val_loss(b) at every eval point they all share."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return {}
    curves = [(val_at_tokens(a[s]), val_at_tokens(b[s])) for s in seeds]
    tokens = sorted(set.intersection(*(set(x) & set(y) for x, y in curves)))
    return {t: sum(x[t] - y[t] for x, y in curves) / len(curves) for t in tokens}


def mean_and_std(values):
    """{'mean': ..., 'std': ...}, as report.json holds them."""
    mean, std = mean_std(values)
    return {'mean': mean, 'std': std}


def routing_diagnostics(name, seeds, warn):
    """Routing at each seed's best checkpoint, mean and std over seeds; None for a dense config.
    Older logs without routing keys are left out, with a warning."""
    routed = [r['best'] for r in seeds.values() if 'busiest_frac' in r['best']]
    if not routed:
        return None
    if len(routed) < len(seeds):
        warn(f'{name}: {len(seeds) - len(routed)} seed(s) logged no routing statistics')
    diagnostics = {key: mean_and_std([b[key] for b in routed]) for key in ROUTING}
    # per expert, over seeds
    diagnostics['load'] = [mean_and_std(list(v)) for v in zip(*(b['load'] for b in routed))]
    diagnostics['n'] = len(routed)  # the seeds the std is over: none from one
    return diagnostics


def judged(gap, g):
    """A paired gap with its paired t (None under two seeds or without spread), whether it is
    decided, the role ahead (None: a tie or no gap) and whether that is the paper's sign."""
    first, second = GAP_ROLES[gap]
    t = g['mean'] / g['se'] if g['se'] else None
    ahead = None if not g['mean'] else (second if g['mean'] > 0 else first)  # > 0: first worse
    return {**g, 't': t, 'decided': t is not None and abs(t) > T_DECIDES, 'ahead': ahead,
            'paper_sign': None if ahead is None else (g['mean'] > 0) == (PAPER_GAPS[gap] > 0)}


def family_gaps(runs, roles):
    """-> (gaps, gap_vs_tokens) of a family: both seed-paired gaps, judged, and their curves."""
    gaps = {gap: NO_GAP for gap in GAP_ROLES}
    curves = {}
    for gap, (a, b) in GAP_ROLES.items():
        if a in roles and b in roles:
            gaps[gap] = paired(runs[roles[a]], runs[roles[b]]) or NO_GAP
            curves[gap] = gap_vs_tokens(runs[roles[a]], runs[roles[b]])
    tokens = sorted(set.intersection(*(set(c) for c in curves.values()))) if curves else []
    curve = {'tokens': tokens}
    for gap in GAP_ROLES:
        curve[gap] = [curves[gap][t] for t in tokens] if gap in curves else []
    return {gap: judged(gap, g) for gap, g in gaps.items()}, curve


def summarise(runs, warn, role_of=role_of):
    """The table, each family's gaps and routing, from load_runs' runs. role_of names each
    config's family and role; another can leave some configs out of every family."""
    configs, families = {}, defaultdict(dict)
    for name in sorted(runs):
        seeds = runs[name]
        family, role = role_of(name)
        params = next(iter(seeds.values()))['config']['params']
        if any(r['config']['params'] != params for r in seeds.values()):
            warn(f'{name}: seeds have different parameter counts (different overrides under one '
                 'name?)')
        mean, std = mean_std([r['best']['val_loss'] for r in seeds.values()])
        flops, _ = mean_std([r['flops'] for r in seeds.values()])
        configs[name] = {'role': role, 'total': params['total'], 'active': params['active'],
                         'flops': flops,
                         'seeds': {str(s): seeds[s]['best']['val_loss'] for s in sorted(seeds)},
                         'mean': mean, 'std': std,
                         'exit_step': {str(s): seeds[s]['exit_step'] for s in sorted(seeds)}}
        diagnostics = routing_diagnostics(name, seeds, warn)
        if diagnostics:
            configs[name]['diagnostics'] = diagnostics
        if role:
            families[family][role] = name

    out = {'configs': configs, 'families': {}}
    for family, roles in sorted(families.items()):
        missing = [family + r for r in ROLES if r not in roles]
        if missing:
            warn(f'family {family or "(paper scale)"}: missing {", ".join(missing)}; its gaps are '
                 'incomplete')
        gaps, curve = family_gaps(runs, roles)
        for gap, (a, b) in GAP_ROLES.items():
            if a in roles and b in roles and not gaps[gap]['n']:
                warn(f'{roles[a]} and {roles[b]} share no seed: no {gap} gap')
        out['families'][family] = {'configs': roles, 'gaps': gaps, 'gap_vs_tokens': curve}
    # the top-level gaps: the first complete family's (paper scale sorts first), as scripts expect
    headline = headline_family(out['families'])
    out['gaps'], out['gap_vs_tokens'] = headline['gaps'], headline['gap_vs_tokens']
    out['diagnostics'] = {name: c['diagnostics'] for name, c in configs.items()
                          if 'diagnostics' in c}
    return out


def headline_family(families):
    """The first complete family, else the first family, else one with no gaps."""
    for fam in families.values():
        if len(fam['configs']) == 3:
            return fam
    if families:
        return next(iter(families.values()))
    return {'gaps': {gap: judged(gap, NO_GAP) for gap in GAP_ROLES}, 'gap_vs_tokens': EMPTY_CURVE}


def seed_curves(seeds, key, x='tokens'):
    """(points, curves): the eval points (x = 'tokens' or 'flops') shared by the seeds that
    logged an eval key, and each such seed's values of it at those points."""
    by_seed = []
    for run in seeds.values():
        curve = {r[x]: r[key] for r in run['evals'] if key in r}
        if curve:
            by_seed.append(curve)
    points = sorted(set.intersection(*(set(c) for c in by_seed))) if by_seed else []
    return points, [[c[p] for p in points] for c in by_seed]


def pointwise_mean(curves):
    """The mean over the curves at each point."""
    return [sum(values) / len(values) for values in zip(*curves)]


def trained_val_curves(seeds, x):
    """seed_curves of the val loss less the untrained point (x = 0), which would squash a plot."""
    points, curves = seed_curves(seeds, 'val_loss', x)
    if points and points[0] == 0:
        points, curves = points[1:], [c[1:] for c in curves]
    return points, curves


# ----------------------------------------------------------------------------- report.md
def mean_pm_std(mean, std, n=None, fmt='.4f'):
    """mean ± std over n seeds; the mean alone from one seed, which has no spread."""
    if n == 1:
        return f'{mean:{fmt}}'
    return f'{mean:{fmt}} ± {std:.4f}'


def seeds_text(n):
    return '1 seed' if n == 1 else f'{n} seeds'


def exit_text(exit_steps):
    """The "leaves the plateau" cell: mean [min-max] of the runs that left, how many never did."""
    steps = [s for s in exit_steps.values() if s is not None]
    never = len(exit_steps) - len(steps)
    parts = []
    if steps:
        parts.append(f'{sum(steps) / len(steps):.0f} [{min(steps)}-{max(steps)}]')
    if never:
        parts.append(f'never: {never}')
    return ', '.join(parts)


def config_lines(summary):
    lines = ['| config | role | total params | active params | training FLOPs | seeds | '
             'best val loss | paper | leaves the plateau |',
             '|---|---|---|---|---|---|---|---|---|']
    for name, c in summary['configs'].items():
        paper = mean_pm_std(*PAPER[c['role']]) if name in ROLES else ''
        lines.append(f'| {name} | {c["role"] or "-"} | {c["total"]:,} | {c["active"]:,} | '
                     f'{c["flops"]:.3g} | {",".join(c["seeds"])} | '
                     f'{mean_pm_std(c["mean"], c["std"], len(c["seeds"]))} | {paper} | '
                     f'{exit_text(c["exit_step"])} |')
    return lines


def family_lines(family, fam):
    lines = [
        '', f'## Gaps: {family.rstrip("_") or "paper scale"}', '',
        'Seed-paired differences of best validation loss; positive = the first model is worse.', '',
        '| gap | mean ± std | standard error | seeds > 0 | per seed | paper |',
        '|---|---|---|---|---|---|',
    ]
    for gap in GAP_ROLES:
        label = f'matched-{gap}: {GAP_LABELS[gap]}'
        g = fam['gaps'][gap]
        if not g['n']:
            lines.append(f'| {label} | missing | | | | |')
            continue
        per_seed = ', '.join(f's{s}: {v:+.4f}' for s, v in g['per_seed'].items())
        # the paper's gaps sit beside the paper-scale family only
        paper = '' if family else f'{PAPER_GAPS[gap]:+.4f}'
        se = '-' if g['se'] is None else f'{g["se"]:.4f}'
        lines.append(f'| {label} | {mean_pm_std(g["mean"], g["std"], g["n"], "+.4f")} | {se} | '
                     f'{g["positive"]} of {g["n"]} | {per_seed} | {paper} |')
    said = [gap_sentence(gap, g) for gap, g in fam['gaps'].items() if g['n']]
    if said:
        lines += [''] + said
    curve = fam['gap_vs_tokens']
    shown = [g for g in GAP_ROLES if curve[g]]
    if curve['tokens'] and shown:
        lines += [
            '', 'Gap versus training tokens (mean over paired seeds, val loss at each eval):', '',
            '| tokens | ' + ' | '.join(shown) + ' |',
            '|---|' + '---|' * len(shown),
        ]
        for i, t in enumerate(curve['tokens']):
            cells = ' | '.join(f'{curve[g][i]:+.4f}' for g in shown)
            lines.append(f'| {t / 1e6:.2f}M | ' + cells + ' |')
    return lines


def gap_sentence(gap, g):
    """A gap in words: who leads by how much, what its seeds decide, a sign unlike the paper's."""
    first, second = GAP_ROLES[gap]
    words = f'{ROLE_WORDS[first]} and {ROLE_WORDS[second]} tie'
    if g['ahead']:
        behind = first if g['ahead'] == second else second
        words = f'{ROLE_WORDS[g["ahead"]]} is ahead of {ROLE_WORDS[behind]} by {abs(g["mean"]):.4f}'
    sign = ''
    if g['paper_sign'] is False:
        sign = f'; the other sign from the paper\'s {PAPER_GAPS[gap]:+.4f}'
    return f'- matched-{gap}: {words} {verdict_text(g)}{sign}.'


def verdict_text(g):
    """What a gap's seeds decide: nothing from one seed, else what its paired t says."""
    n, t = g['n'], g['t']
    if n == 1:
        return 'on 1 seed: one seed decides nothing'
    if t is None:
        return f'over {n} seeds without spread: no t, nothing decided'
    if g['decided']:
        return f'over {n} seeds, paired t {t:.2f}: decided (|t| > {T_DECIDES})'
    return f'over {n} seeds, paired t {t:.2f}: not decided (|t| ≤ {T_DECIDES})'


def routing_lines(diagnostics):
    lines = [
        '', '## Routing at the best checkpoint', '',
        'Mean over MoE layers, on the validation set; mean ± std over seeds. busiest_frac is the '
        'largest expert share (1/n_experts = perfect balance, 1/top_k = collapsed); '
        'router_entropy in nats; load is the share of assignments per expert.', '',
        '| config | ' + ' | '.join(ROUTING) + ' | load |',
        '|---|' + '---|' * (len(ROUTING) + 1),
    ]
    for name, d in diagnostics.items():
        stats = ' | '.join(mean_pm_std(d[k]['mean'], d[k]['std'], d['n']) for k in ROUTING)
        load = ', '.join(f'{e["mean"]:.3f}' for e in d['load'])
        lines.append(f'| {name} | ' + stats + ' | ' + load + ' |')
    return lines


def short_run_lines(roles, runs):
    """A note under a family whose runs stop before their configs' token budget (max_iters): the
    MoE may still be on its early plateau, so their gaps say nothing of the recipe's."""
    short = sorted({r['config']['iters'] for name in roles.values() for r in runs[name].values()
                    if r['config']['iters'] * r['config']['tokens_per_iter']
                    < r['config']['max_tokens']})
    if not short:
        return []
    steps = ', '.join(f'{n:,}' for n in short)
    return ['', f'Short runs: these stop after {steps} steps, before their configs\' token budget. '
            'Their gaps are not the recipe\'s: at CPU scale the MoE leaves its early plateau after '
            '100-250 steps, and a short run\'s gap can even take the other sign.']


def report_lines(summary, runs):
    """report.md up to its plots: the table, each family's gaps, routing."""
    n_runs = sum(len(s) for s in runs.values())
    lines = [
        '# tinymoe report', '',
        f'Runs: {n_runs} in {len(runs)} configs. Best validation loss (CE on the fixed validation '
        'set) per run; mean ± sample std over seeds.', '',
        f'"Leaves the plateau": the mean over seeds of the first logged step with training CE < '
        f'{EXIT_CE} (its range in brackets; never: runs that did not).', '',
    ]
    lines += config_lines(summary)
    for family, fam in summary['families'].items():
        lines += family_lines(family, fam)
        lines += short_run_lines(fam['configs'], runs)
    if summary['diagnostics']:
        lines += routing_lines(summary['diagnostics'])
    return lines


def closing_lines(plots, warnings):
    """report.md's end: the plots, then what was missing or incomplete."""
    lines = []
    if plots:
        lines += ['', '## Plots', ''] + [f'![{p}]({p})' for p in plots]
    if warnings:
        lines += ['', '## Missing or incomplete', ''] + [f'- {w}' for w in warnings]
    return lines


def markdown(summary, runs, warnings, plots):
    return '\n'.join(report_lines(summary, runs) + closing_lines(plots, warnings)) + '\n'


# ----------------------------------------------------------------------------- plots
def pyplot():
    """matplotlib's pyplot, drawing into files only."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt


def family_plots(plt, summary, runs, out_dir):
    """Per family: val loss against tokens and against FLOPs, and both gaps against tokens."""
    written = []
    for family, fam in summary['families'].items():
        tag = family.rstrip('_') or 'paper'
        written.append(plot_val_loss(plt, fam, runs, out_dir, tag, 'tokens'))
        written.append(plot_val_loss(plt, fam, runs, out_dir, tag, 'flops'))
        if fam['gap_vs_tokens']['tokens']:
            written.append(plot_gaps(plt, fam['gap_vs_tokens'], out_dir, tag))
    return written


def plot(summary, runs, out_dir):
    """PNGs beside report.md: val loss vs tokens and FLOPs, both gaps vs tokens, expert load."""
    plt = pyplot()
    written = family_plots(plt, summary, runs, out_dir)
    if summary['diagnostics']:
        written.append(plot_expert_load(plt, list(summary['diagnostics']), runs, out_dir))
    return written


def plot_val_loss(plt, fam, runs, out_dir, tag, x):
    """Validation loss against training tokens or (x = 'flops') training FLOPs: the MoE and
    dense_total cost different FLOPs a token."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for role in ROLES:
        if role not in fam['configs']:
            continue
        name = fam['configs'][role]
        points, curves = trained_val_curves(runs[name], x)
        if not points:
            continue
        line, = ax.plot(points, pointwise_mean(curves), label=f'{name} ({seeds_text(len(curves))})')
        if len(curves) > 1:  # a band from two seeds on
            low = [min(v) for v in zip(*curves)]
            high = [max(v) for v in zip(*curves)]
            # the line's colour: a config without a band must not shift the bands' colours
            ax.fill_between(points, low, high, alpha=0.25, facecolor=line.get_color())
    xlabel = 'training FLOPs' if x == 'flops' else 'training tokens'
    band = ' (band: min-max over seeds)' if ax.collections else ''
    ax.set(xlabel=xlabel, ylabel='validation loss', title=f'{tag}: validation loss{band}')
    low = min((line.get_ydata().min() for line in ax.get_lines()), default=None)
    # early losses would squash the interesting end
    if low is not None and math.isfinite(low):
        ax.set_ylim(top=min(ax.get_ylim()[1], 1.5 * low))
    ax.legend()
    suffix = '_flops' if x == 'flops' else ''
    return save(fig, out_dir, f'{tag}_val_loss{suffix}.png')


def plot_gaps(plt, curve, out_dir, tag):
    """Both gaps against tokens; they subtract in opposite orders: each says where the MoE leads."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for gap, label in GAP_LABELS.items():
        side = 'above' if GAP_ROLES[gap][1] == 'moe' else 'below'
        if curve[gap]:
            ax.plot(curve['tokens'], curve[gap], marker='o',
                    label=f'{gap} gap: {label} (the MoE ahead {side} 0)')
    ax.axhline(0, color='gray', lw=0.8)
    ax.set(xlabel='training tokens', ylabel='val loss difference (first - second model)',
           title=f'{tag}: gaps over training (mean over seeds)')
    ax.legend()
    return save(fig, out_dir, f'{tag}_gaps.png')


def plot_expert_load(plt, moe_runs, runs, out_dir):
    """Each MoE config's expert load over training, for its lowest seed that logged it."""
    fig, axes = plt.subplots(1, len(moe_runs), figsize=(4.5 * len(moe_runs), 3.8), squeeze=False)
    for ax, name in zip(axes[0], moe_runs):
        seed = min(s for s in runs[name] if any('load' in r for r in runs[name][s]['evals']))
        evals = [r for r in runs[name][seed]['evals'] if 'load' in r]
        tokens = [r['tokens'] for r in evals]
        for i in range(len(evals[0]['load'])):
            ax.plot(tokens, [r['load'][i] for r in evals], label=f'expert {i}')
        ax.set(xlabel='training tokens', ylabel='share of assignments', title=f'{name} s{seed}',
               ylim=(0, 1))
        ax.legend(fontsize=7)
    fig.suptitle('expert load on the validation set (mean over layers)')
    return save(fig, out_dir, 'expert_load.png')


def save(fig, out_dir, name):
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, name), dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return name


# ----------------------------------------------------------------------------- report.json
def finite_or_none(x):
    """NaN and inf (a diverged run) as null, so that report.json stays strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_or_none(v) for v in x]
    return x


# ----------------------------------------------------------------------------- the command line
def parser(description):
    """A report's command line: run folders or globs, and where the report goes."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('runs', nargs='+', help='run folders or globs (e.g. out/cpu_*)')
    p.add_argument('--out', default='.', help='folder for report.md, report.json and the plots')
    return p


def read_runs(patterns, warnings):
    """load_runs over run folders or globs, its warnings into warnings; an error without runs."""
    # a pattern that matches nothing stands for itself (a folder named as given, or a warning)
    paths = sorted({path for pattern in patterns for path in (glob.glob(pattern) or [pattern])})
    runs = load_runs([p for p in paths if os.path.isdir(p)], warnings.append)
    warnings.extend(f'skipped {p}: not a folder' for p in paths if not os.path.isdir(p))
    if not runs:
        raise UserError('no runs found in ' + ' '.join(patterns) + '; give run folders (each '
                        'with a config.json and a log.jsonl) or globs that match them')
    return runs


def write(out_dir, summary, text):
    """report.md and report.json into out_dir, and the text printed."""
    with open(os.path.join(out_dir, 'report.md'), 'w') as f:
        f.write(text)
    with open(os.path.join(out_dir, 'report.json'), 'w') as f:
        json.dump(finite_or_none(summary), f, indent=2)
    print(text)


def main(argv=None):
    args = parser(__doc__).parse_args(argv)
    warnings = []
    runs = read_runs(args.runs, warnings)
    os.makedirs(args.out, exist_ok=True)
    summary = summarise(runs, warnings.append)
    plots = plot(summary, runs, args.out)
    write(args.out, summary, markdown(summary, runs, warnings, plots))


if __name__ == '__main__':
    with one_line_errors('report.py'):
        main(sys.argv[1:])
