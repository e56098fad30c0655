"""
The paper's claims at CPU scale under the CPU recipe (224 warmup steps, the recipe's tokens): the
ablations at cpu_moe's layout, the activation rate at a fixed total size, and the shared expert
against dense_total under its pre-registered test. From the committed run folders:

    python -m study.claims results/cpu/warmup/runs results/cpu/claims/runs --out results/cpu/claims

Every comparison is seed-paired (seed s against seed s) and read with a paired t; the runs are
named as make warmup and make claims_runs / shared_runs name them (w224_<config>-s<seed>).
"""
import argparse
import glob
import math
import os
import sys

import report
from errors import UserError, one_line_errors

# a paper claim is decided where a paired t passes this (either sign); else "not established".
# Only once every planned seed pair is in: a t over fewer seeds decides nothing
T_DECIDES = 2.5
PLANNED_SEEDS = 10
MOE, DENSE_ACTIVE, DENSE_TOTAL = 'w224_cpu_moe', 'w224_cpu_dense_active', 'w224_cpu_dense_total'
ABLATIONS = {'w224_cpu_moe_top1': 'top-1, Switch balancing',
             'w224_cpu_moe_top1_nolb': 'top-1, no balancing (the naive router)',
             'w224_cpu_moe_noz': 'top-2, no z-loss',
             'w224_cpu_moe_nolb': 'top-2, no balancing'}
# 8 experts x 44 (cpu_moe's total FFN size) by top-k
ACTIVATION = {1: 'w224_cpu_moe_fine8_top1', 2: 'w224_cpu_moe_fine8_top2',
              4: 'w224_cpu_moe_fine8', 8: 'w224_cpu_moe_fine8_top8'}
# the dense models at other token budgets (make warmup): their best val loss against training
# FLOPs, with the recipe's tokens (100) between them, gives each dense model at any FLOPs
DENSE_BUDGETS = (25, 50, 200)
SHARED = 'w224_cpu_moe_shared'
# the pre-registered test (results/cpu/shared_preregistration.md): seeds 21-50, two-sided 5%;
# SHARED_T is t's 97.5% point at 29 degrees of freedom, so it also gives the gap's 95% interval
SHARED_SEEDS = range(21, 51)
SHARED_T = 2.045
# a layer has collapsed when its busiest expert takes at least this share of the most it can
# take (1/top_k: every token's choices the same experts)
COLLAPSED = 0.9


def t_of(gap):
    """The paired t of report.paired's gap; None without two seeds or with no spread."""
    if not gap or not gap['se']:
        return None
    return gap['mean'] / gap['se']


def verdict(t, if_positive, if_negative, threshold=T_DECIDES, if_neither='not established'):
    """What a paired t decides: if_positive above threshold, if_negative below -threshold."""
    if t is None or abs(t) <= threshold:
        return if_neither
    return if_positive if t > 0 else if_negative


def decide(gap, if_positive, if_negative, if_neither='not established'):
    """verdict of the gap's t once every planned seed pair is in; before, 'not yet: n of 10'."""
    n = gap['n'] if gap else 0
    if n < PLANNED_SEEDS:
        return f'not yet: {n} of {PLANNED_SEEDS} seed pairs'
    return verdict(t_of(gap), if_positive, if_negative, if_neither=if_neither)


def gap_text(gap):
    """'+0.0123 ± 0.0045 (9 of 10 > 0, t 8.6)'."""
    if not gap:
        return '-'
    t = t_of(gap)
    t_text = f', t {t:.1f}' if t is not None else ''
    return (f'{gap["mean"]:+.4f} ± {gap["std"]:.4f} ({gap["positive"]} of {gap["n"]} > 0'
            f'{t_text})')


def paired_values(a, b, value):
    """report.paired's gap of any per-run value: value(run_a) - value(run_b), paired by seed."""
    as_best = {s: {'best': {'val_loss': value(run)}} for s, run in a.items()}
    bs_best = {s: {'best': {'val_loss': value(run)}} for s, run in b.items()}
    return report.paired(as_best, bs_best)


def final_busiest(run):
    """busiest_frac at the run's last evaluation, the mean over its layers."""
    return run['evals'][-1]['busiest_frac']


def collapsed_layers(run):
    """How many layers had collapsed at the run's last evaluation (COLLAPSED)."""
    ceiling = 1 / run['config']['top_k']
    layers = run['evals'][-1]['layers']
    return sum(layer['busiest_frac'] >= COLLAPSED * ceiling for layer in layers)


def best_val(run):
    return run['best']['val_loss']


def mean_pm(values):
    mean, std = report.mean_std(values)
    return f'{mean:.4f} ± {std:.4f}'


# ----------------------------------------------------------------------------- the machines
def machines(runs, pairs):
    """Each config's CPUs (config.json's cpu), and the seed pairs trained on two kinds of CPU."""
    kinds = {name: sorted({run['config'].get('cpu', '?') for run in seeds.values()})
             for name, seeds in runs.items()}
    mixed = []
    for a, b in pairs:
        for seed in sorted(set(runs.get(a, {})) & set(runs.get(b, {}))):
            cpus = runs[a][seed]['config'].get('cpu'), runs[b][seed]['config'].get('cpu')
            if cpus[0] != cpus[1]:
                mixed.append(f'{a} / {b} seed {seed}: {cpus[0]} / {cpus[1]}')
    return {'kinds': kinds, 'mixed_pairs': mixed}


# ----------------------------------------------------------------------------- the ablations
def ablations(runs):
    """Each ablation against cpu_moe, paired: best val loss and final busiest_frac."""
    rows = {}
    for name, what in ABLATIONS.items():
        if name not in runs or MOE not in runs:
            continue
        seeds = runs[name]
        rows[name] = {
            'what': what, 'seeds': sorted(seeds),
            'best_val': [best_val(seeds[s]) for s in sorted(seeds)],
            'vs_moe': report.paired(seeds, runs[MOE]),
            'busiest_frac': [final_busiest(seeds[s]) for s in sorted(seeds)],
            'busiest_vs_moe': paired_values(seeds, runs[MOE], final_busiest),
            'runs_with_a_collapsed_layer': sum(collapsed_layers(r) > 0 for r in seeds.values()),
            'exit_step': [seeds[s]['exit_step'] for s in sorted(seeds)]}
    return rows


def claims(runs):
    """The paper's ablation claims, each with the paired comparison that decides it."""
    top1, naive = runs.get('w224_cpu_moe_top1'), runs.get('w224_cpu_moe_top1_nolb')
    noz, nolb, moe = runs.get('w224_cpu_moe_noz'), runs.get('w224_cpu_moe_nolb'), runs.get(MOE)
    out = []

    def claim(text, what, gap, if_positive, if_negative, if_neither='not established'):
        decided = decide(gap, if_positive, if_negative, if_neither)
        out.append({'claim': text, 'statistic': what, 'gap': gap, 't': t_of(gap),
                    'verdict': decided})

    if top1 and naive:
        claim('naive top-1 collapses', 'busiest_frac at the end: top-1 without - with balancing',
              paired_values(naive, top1, final_busiest),
              'holds: the naive router sends more to its busiest expert',
              'reversed: the balanced router is the more lopsided')
        claim('Switch balancing prevents it, and helps', 'best val loss: top-1 without - with '
              'balancing', report.paired(naive, top1), 'holds: balancing lowers the loss',
              'reversed: balancing raises the loss at top-1')
    if top1 and moe:
        claim('top-2 gives the main gain', 'best val loss: top-1 - top-2 (both balanced)',
              report.paired(top1, moe), 'top-2 is better', 'top-1 is better')
    if noz and moe:
        claim('the z-loss does not change the loss', 'best val loss: no z-loss - cpu_moe',
              report.paired(noz, moe), 'reversed: the z-loss lowers the loss',
              'reversed: the z-loss raises the loss', 'consistent: no difference established')
        claim('the z-loss keeps the router logits small', 'log_z at the end: no z-loss - cpu_moe',
              paired_values(noz, moe, lambda r: r['evals'][-1]['log_z']),
              'holds: without it the logits grow', 'reversed: without it the logits shrink')
    if nolb and moe:
        claim('top-2 needs balancing too', 'best val loss: top-2 without - with balancing',
              report.paired(nolb, moe), 'holds: balancing lowers the loss',
              'reversed: balancing raises the loss at top-2')
    return out


# ----------------------------------------------------------------------------- activation rate
def flops_curve(runs, name, seed):
    """[(training FLOPs, best val loss)] of a dense model at every budget it has for this seed."""
    names = [name] + [name.replace('w224_', f'w224_b{b}_') for b in DENSE_BUDGETS]
    points = [(runs[n][seed]['flops'], best_val(runs[n][seed]))
              for n in names if seed in runs.get(n, {})]
    return sorted(points)


def at_flops(curve, flops):
    """The curve's loss at these FLOPs, linear in log FLOPs between the budgets around them; None
    outside the budgets trained."""
    for (f0, l0), (f1, l1) in zip(curve, curve[1:]):
        if f0 <= flops <= f1:
            w = math.log(flops / f0) / math.log(f1 / f0)
            return l0 + w * (l1 - l0)
    return None


def equal_flops_gap(runs, moe_name, dense_name):
    """The MoE against a dense model trained for the MoE's own training FLOPs (interpolated over
    the dense model's budgets), paired by seed, over the seeds that have every budget."""
    per_seed = {}
    for seed, run in runs[moe_name].items():
        curve = flops_curve(runs, dense_name, seed)
        dense = at_flops(curve, run['flops']) if len(curve) == len(DENSE_BUDGETS) + 1 else None
        if dense is not None:
            per_seed[seed] = {'best': {'val_loss': dense}}
    moe = {s: run for s, run in runs[moe_name].items() if s in per_seed}
    return report.paired(moe, per_seed)


def activation(runs):
    """8 x 44 at each top-k: best val loss, and the gap to both dense models at equal tokens and
    at equal training FLOPs."""
    rows = {}
    for k, name in ACTIVATION.items():
        if name not in runs:
            continue
        seeds = runs[name]
        params = next(iter(seeds.values()))['config']['params']
        rows[k] = {'name': name, 'active_fraction': params['active'] / params['total'],
                   'best_val': [best_val(seeds[s]) for s in sorted(seeds)],
                   'busiest_frac': [final_busiest(seeds[s]) for s in sorted(seeds)]}
        for dense in (DENSE_TOTAL, DENSE_ACTIVE):
            if dense in runs:
                role = dense.removeprefix('w224_cpu_')
                rows[k][f'vs_{role}_tokens'] = report.paired(seeds, runs[dense])
                rows[k][f'vs_{role}_flops'] = equal_flops_gap(runs, name, dense)
    ks = sorted(rows)
    steps = {f'top-{b} - top-{a}': report.paired(runs[ACTIVATION[b]], runs[ACTIVATION[a]])
             for a, b in zip(ks, ks[1:])}
    # the answers: how the loss moves from one k to the next, and where each k stands against
    # dense_total at equal tokens
    moves = {step: decide(gap, 'the loss rises', 'the loss falls') for step, gap in steps.items()}
    against_total = {k: decide(row.get('vs_dense_total_tokens'), 'behind dense_total',
                               'ahead of dense_total') for k, row in rows.items()}
    return {'rows': rows, 'steps': steps, 'moves': moves, 'against_total': against_total}


# ----------------------------------------------------------------------------- the shared expert
def shared(runs):
    """The pre-registered test on seeds 21-50, and all seeds pooled (looked at afterwards)."""
    if SHARED not in runs or DENSE_TOTAL not in runs:
        return None
    fresh = {s: r for s, r in runs[SHARED].items() if s in SHARED_SEEDS}
    gap = report.paired(fresh, runs[DENSE_TOTAL])
    t = t_of(gap)
    complete = gap is not None and gap['n'] == len(SHARED_SEEDS)
    test = verdict(t, 'reversed: dense_total beats the shared expert',
                   'confirmed: the shared expert beats dense_total', SHARED_T)
    interval = None
    if complete:
        half = SHARED_T * gap['se']
        interval = [gap['mean'] - half, gap['mean'] + half]
    else:
        test = 'not yet: the pre-registered test needs all 30 seed pairs'
    return {'preregistered': gap, 't': t, 'interval_95': interval, 'verdict': test,
            'pooled_afterwards': report.paired(runs[SHARED], runs[DENSE_TOTAL])}


# ----------------------------------------------------------------------------- report.md
def markdown(summary):
    lines = ['# The paper\'s claims at CPU scale (224 warmup steps)', '',
             f'Seed-paired gaps (mean ± std over seeds, seeds > 0, paired t). A claim is decided '
             f'where |t| > {T_DECIDES}; else "not established".', '', '## Machines', '']
    lines += [f'- {name}: {", ".join(kinds)}' for name, kinds in
              sorted(summary['machines']['kinds'].items())]
    mixed = summary['machines']['mixed_pairs']
    lines += ['', f'Seed pairs on two kinds of CPU: {len(mixed)}.'] + [f'- {m}' for m in mixed]
    lines += ['', '## Ablations at cpu_moe\'s layout (4 x 88)', '',
              '| config | what | seeds | best val loss | minus cpu_moe | busiest_frac at end | '
              'minus cpu_moe | runs with a collapsed layer |', '|---|---|---|---|---|---|---|---|']
    for name, row in summary['ablations'].items():
        lines.append(f'| {name} | {row["what"]} | {len(row["seeds"])} | '
                     f'{mean_pm(row["best_val"])} | {gap_text(row["vs_moe"])} | '
                     f'{mean_pm(row["busiest_frac"])} | {gap_text(row["busiest_vs_moe"])} | '
                     f'{row["runs_with_a_collapsed_layer"]} |')
    lines += ['', f'A layer has collapsed when its busiest expert takes at least {COLLAPSED:.0%} '
              'of the most it can (1/top_k).', '', '## The claims', '',
              '| claim | statistic | gap | verdict |', '|---|---|---|---|']
    lines += [f'| {c["claim"]} | {c["statistic"]} | {gap_text(c["gap"])} | {c["verdict"]} |'
              for c in summary['claims']]
    lines += activation_lines(summary['activation']) + shared_lines(summary['shared'])
    return '\n'.join(lines) + '\n'


def activation_lines(act):
    lines = ['', '## Activation rate: 8 experts x 44 at top-k 1, 2, 4, 8', '',
             'Equal FLOPs: each dense model\'s best val loss at the MoE run\'s training FLOPs, '
             'interpolated (linear in log FLOPs) between its runs at 25, 50, 100 and 200% of the '
             'recipe\'s tokens (seeds that have all four).', '',
             '| top-k | active fraction | best val loss | vs dense_total, equal tokens | '
             'vs dense_total, equal FLOPs | vs dense_active, equal tokens | '
             'vs dense_active, equal FLOPs |', '|---|---|---|---|---|---|---|']
    for k, row in sorted(act['rows'].items()):
        cells = [gap_text(row.get(f'vs_{role}_{x}')) for role in ('dense_total', 'dense_active')
                 for x in ('tokens', 'flops')]
        lines.append(f'| {k} | {row["active_fraction"]:.2f} | {mean_pm(row["best_val"])} | '
                     + ' | '.join(cells) + ' |')
    lines += ['', 'From one top-k to the next (best val loss, paired):', '']
    lines += [f'- {step}: {gap_text(gap)}: **{act["moves"][step]}**'
              for step, gap in act['steps'].items()]
    standing = [f'top-{k} {answer}' for k, answer in sorted(act['against_total'].items())]
    lines += ['', 'Against dense_total at equal tokens (the table\'s first gap column): '
              + '; '.join(standing) + '.']
    return lines


def shared_lines(result):
    if result is None:
        return []
    interval = ''
    if result['interval_95']:
        low, high = result['interval_95']
        interval = f"; the mean gap's 95% interval {low:+.4f} to {high:+.4f}"
    return ['', '## The shared expert against dense_total, pre-registered', '',
            'The test fixed in results/cpu/shared_preregistration.md before its runs: seeds 21-50, '
            f'paired t of cpu_moe_shared - cpu_dense_total, |t| > {SHARED_T}.', '',
            f'- seeds 21-50: {gap_text(result["preregistered"])}{interval}: '
            f'**{result["verdict"]}**',
            f'- every seed, pooled (looked at afterwards): '
            f'{gap_text(result["pooled_afterwards"])}']


# ----------------------------------------------------------------------------- plots
def plot(summary, runs, out_dir):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    plots = []
    if summary['ablations']:
        plots.append(plot_collapse(plt, runs, out_dir))
    if summary['activation']['rows']:
        plots.append(plot_activation(plt, summary['activation'], runs, out_dir))
    return plots


def training_busiest(run):
    """[(iter, busiest_frac)] of a run's training lines."""
    records = report.read_records(run['path'], open(os.path.join(run['path'], 'log.jsonl')),
                                  lambda message: None)
    return [(r['iter'], r['busiest_frac']) for r in records
            if 'busiest_frac' in r and 'val_loss' not in r]


def plot_collapse(plt, runs, out_dir):
    """busiest_frac over training for cpu_moe and each ablation: a thin line per seed."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = [MOE] + [name for name in ABLATIONS if name in runs]
    for i, name in enumerate(names):
        for j, run in enumerate(runs.get(name, {}).values()):
            steps, busiest = zip(*training_busiest(run))
            label = name.removeprefix('w224_') if j == 0 else None
            ax.plot(steps, busiest, color=f'C{i}', lw=0.7, alpha=0.6, label=label)
    ax.set_xlabel('step')
    ax.set_ylabel('busiest_frac (training batch, mean over layers)')
    ax.axhline(0.25, color='gray', ls=':', lw=1)
    ax.legend(fontsize=8)
    return report.save(fig, out_dir, 'collapse.png')


def mean_over_seeds(runs, name, seeds):
    """name's mean best val loss over those of `seeds` it has; None if it has none of them."""
    values = [best_val(run) for seed, run in runs.get(name, {}).items() if seed in seeds]
    if not values:
        return None
    return sum(values) / len(values)


def plot_activation(plt, act, runs, out_dir):
    """Best val loss against the active fraction, each seed a dot; both dense models as lines,
    each the mean over the seeds the top-k runs pair with (dense_total has more, for the
    shared expert's test)."""
    seeds = {seed for name in ACTIVATION.values() for seed in runs.get(name, {})}
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for k, row in sorted(act['rows'].items()):
        xs = [row['active_fraction']] * len(row['best_val'])
        ax.plot(xs, row['best_val'], '.', color='C0', alpha=0.5)
        ax.plot(row['active_fraction'], sum(row['best_val']) / len(row['best_val']), 'o',
                color='C0')
        ax.annotate(f'top-{k}', (row['active_fraction'], max(row['best_val'])),
                    textcoords='offset points', xytext=(0, 6), ha='center', fontsize=8)
    for i, dense in enumerate((DENSE_TOTAL, DENSE_ACTIVE)):
        mean = mean_over_seeds(runs, dense, seeds)
        if mean is not None:
            ax.axhline(mean, color=f'C{i + 1}', ls='--',
                       label=f'{dense.removeprefix("w224_")} (mean)')
    ax.set_xlabel('active fraction of the params (8 experts x 44)')
    ax.set_ylabel('best val loss')
    ax.legend(fontsize=8)
    return report.save(fig, out_dir, 'activation.png')


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('folders', nargs='+', help='folders of run folders (w224_<config>-s<seed>)')
    p.add_argument('--out', required=True, help='folder for report.md, report.json, the plots')
    args = p.parse_args(argv)
    paths = sorted(path for folder in args.folders
                   for path in glob.glob(os.path.join(folder, 'w224_*')))
    warnings = []
    runs = report.load_runs(paths, warnings.append)
    if MOE not in runs:
        raise UserError(f'no {MOE} runs in {" ".join(args.folders)}; give the folders that hold '
                        'make warmup\'s and make claims_runs\' runs')
    os.makedirs(args.out, exist_ok=True)
    pairs = [(name, MOE) for name in ABLATIONS] + [(name, dense) for name in ACTIVATION.values()
                                                   for dense in (DENSE_ACTIVE, DENSE_TOTAL)]
    summary = {'machines': machines(runs, pairs + [(SHARED, DENSE_TOTAL)]),
               'ablations': ablations(runs), 'claims': claims(runs),
               'activation': activation(runs), 'shared': shared(runs), 'warnings': warnings}
    summary['plots'] = plot(summary, runs, args.out)
    text = markdown(summary)
    if warnings:
        text += '\n## Warnings\n\n' + ''.join(f'- {w}\n' for w in warnings)
    report.write(args.out, summary, text)


if __name__ == '__main__':
    with one_line_errors('study.claims'):
        main(sys.argv[1:])
