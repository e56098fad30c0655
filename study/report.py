"""
The CPU study's reports: report.py's table, gaps, curves and routing, and the study's own
sections from the same run folders: MoE variants against their default, the gaps against tokens
per parameter (a scan), and with budget runs who wins at equal tokens, FLOPs and time, k* and the
step-time ratios r (study/compute.py). Run from the top of the repository:

    python -m study.report results/cpu/runs/cpu_{moe,dense_active,dense_total}-s* --out out/cpu
    python -m study.report 'results/cpu/compute/runs/*' --out out/compute \
        --bench results/cpu/compute/bench --ratio results/cpu/compute/ratio

Variants: a config named after an MoE config plus a suffix (cpu_moe_noz, cpu_moe_shared) against
that MoE, seed-paired, and against the dense models of its family. Scan: with two or more complete
families (scan_d64_cpu_..., b25_cpu_...), both gaps per family by training tokens per parameter.
study/README.md names the command behind each report in results/cpu.
"""
import os
import sys

import report
from errors import one_line_errors
from study import compute


def variants(runs, warn):
    """MoE variants: a config named <moe config>_<change> (cpu_moe_noz) against that MoE config,
    seed-paired, and against the dense models of its family (vs_dense_total, vs_dense_active:
    variant - dense, negative = the variant is better). Returns (differences by variant, {key:
    {config: curve}} for busiest_frac and log_z over training with every default and variant
    once, defaults first)."""
    bases = [name for name in runs if compute.role_of(name)[1] == 'moe']
    deltas, curves = {}, {'busiest_frac': {}, 'log_z': {}}
    for name in sorted(runs):
        # the longest MoE config name this one extends: cpu_moe for cpu_moe_noz
        base = max((b for b in bases if name.startswith(b + '_')), key=len, default=None)
        if base is None or compute.role_of(name)[1]:
            continue
        delta = report.paired(runs[name], runs[base])
        if not delta:
            warn(f'{name} and {base} share no seed: no paired difference')
            continue
        deltas[name] = {'base': base, **delta}
        for role in ('dense_total', 'dense_active'):
            dense = compute.role_of(base)[0] + role
            vs_dense = None
            if dense in runs:
                vs_dense = report.paired(runs[name], runs[dense])
            deltas[name]['vs_' + role] = vs_dense or report.NO_GAP
    defaults = sorted({d['base'] for d in deltas.values()})
    for key, by_config in curves.items():
        for name in defaults + list(deltas):
            by_config[name] = curve_mean(runs[name], key)
    return deltas, curves


def curve_mean(seeds, key, x='tokens'):
    """{x: [...], 'mean': [...]}: an eval key's mean over the seeds that logged it, at the eval
    points they share."""
    points, curves = report.seed_curves(seeds, key, x)
    return {x: points, 'mean': report.pointwise_mean(curves)}


def scan(families, runs):
    """Both gaps per complete family, ordered by training tokens per total MoE parameter (a scan
    of model sizes on one token budget, or of budgets); [] for fewer than two families."""
    complete = {family: fam for family, fam in families.items() if len(fam['configs']) == 3}
    if len(complete) < 2:
        return []
    points = []
    for family, fam in complete.items():
        c = next(iter(runs[fam['configs']['moe']].values()))['config']
        tokens = c['iters'] * c['tokens_per_iter']
        points.append({'family': family, 'd_model': c['d_model'],
                       'moe_total': c['params']['total'], 'moe_active': c['params']['active'],
                       'tokens': tokens, 'tokens_per_param': tokens / c['params']['total'],
                       'epochs': compute.data_epochs(c, tokens), **fam['gaps']})
    return sorted(points, key=lambda p: p['tokens_per_param'])


def summarise(runs, warn, step_times=None, ratios=()):
    """report.summarise (budget runs in no family), then the study's sections: the variants, the
    scan, each MoE's budgets, its k*, and each step-time ratio's verdict against it."""
    out = report.summarise(runs, warn, compute.role_of)
    out['variants'], out['variant_curves'] = variants(runs, warn)
    out['scan'] = scan(out['families'], runs)
    out['compute'] = compute.compute_gaps(runs, warn, step_times)
    out['break_even'] = {name: compute.break_even(entry) for name, entry in out['compute'].items()}
    out['step_time_ratio'] = compute.verdicts(ratios, out['break_even'])
    return out


# ----------------------------------------------------------------------------- report.md
def scan_gap_text(g):
    """A scan row's gap: mean ± std [seeds > 0 of seeds], or the one seed's value."""
    if not g['n']:
        return 'missing'
    if g['n'] == 1:
        return f'{g["mean"]:+.4f} (1 seed)'
    return f'{g["mean"]:+.4f} ± {g["std"]:.4f} [{g["positive"]} of {g["n"]}]'


def scan_lines(points):
    lines = [
        '', '## Gaps against tokens per parameter', '',
        'One row per complete family, by training tokens per total MoE parameter. Seed-paired '
        'gaps, mean ± std [seeds > 0 of seeds]: active gap > 0 = the MoE beats dense_active; '
        'total gap > 0 = dense_total beats the MoE.', '',
        '| family | d_model | MoE total / active | tokens | tokens per param | epochs | '
        'active gap | total gap |',
        '|---|---|---|---|---|---|---|---|',
    ]
    for p in points:
        family = p['family'].rstrip('_') or 'paper scale'
        epochs = '-' if p['epochs'] is None else f'{p["epochs"]:.2f}'
        lines.append(f'| {family} | {p["d_model"]} | {p["moe_total"]:,} / {p["moe_active"]:,} | '
                     f'{p["tokens"] / 1e6:.2f}M | {p["tokens_per_param"]:.1f} | {epochs} | '
                     f'{scan_gap_text(p["active"])} | {scan_gap_text(p["total"])} |')
    return lines


def variant_lines(variants, variant_curves):
    lines = [
        '', '## MoE variants against their default', '',
        'Seed-paired differences of best validation loss, variant - default and variant - each '
        'dense model of its family (positive = the variant is worse; [k of n < 0]: seeds where '
        'the variant is better); routing at the best checkpoint is in the table above.', '',
        '| variant | default | difference | seeds | per seed | vs dense_total | vs dense_active |',
        '|---|---|---|---|---|---|---|',
    ]
    for name, d in variants.items():
        per_seed = ', '.join(f's{s}: {x:+.4f}' for s, x in d['per_seed'].items())
        lines.append(f'| {name} | {d["base"]} | {d["mean"]:+.4f} ± {d["std"]:.4f} | {d["n"]} | '
                     f'{per_seed} | {compute.vs_dense_text(d["vs_dense_total"])} | '
                     f'{compute.vs_dense_text(d["vs_dense_active"])} |')
    for key, curves in variant_curves.items():
        at_tokens = [dict(zip(c['tokens'], c['mean'])) for c in curves.values()]
        tokens = sorted(set().union(*at_tokens))
        lines += [
            '', f'{key} over training (validation set, mean over seeds):', '',
            '| tokens | ' + ' | '.join(curves) + ' |',
            '|---|' + '---|' * len(curves),
        ]
        for t in tokens:
            at = [c.get(t) for c in at_tokens]
            cells = ' | '.join('' if v is None else f'{v:.3f}' for v in at)
            lines.append(f'| {t / 1e6:.2f}M | ' + cells + ' |')
    return lines


def markdown(summary, runs, warnings, plots):
    """report.py's report.md with the study's sections before its plots."""
    lines = report.report_lines(summary, runs)
    if summary['scan']:
        lines += scan_lines(summary['scan'])
    if summary['variants']:
        lines += variant_lines(summary['variants'], summary['variant_curves'])
    if summary['compute']:
        lines += compute.compute_lines(summary['compute'])
        lines += compute.break_even_lines(summary['break_even'])
    if summary['step_time_ratio']:
        lines += compute.ratio_lines(summary['step_time_ratio'], summary['break_even'])
    return '\n'.join(lines + report.closing_lines(plots, warnings)) + '\n'


# ----------------------------------------------------------------------------- plots
def plot(summary, runs, out_dir):
    """report.py's plots with the study's: the scan, the variants' routing, each MoE's budgets, who
    wins, break-even."""
    plt = report.pyplot()
    written = report.family_plots(plt, summary, runs, out_dir)
    if summary['scan']:
        written.append(plot_scan(plt, summary['scan'], out_dir))
    if summary['variants']:
        written.append(plot_variant_routing(plt, summary['variant_curves'], out_dir))
    if summary['diagnostics']:
        written.append(report.plot_expert_load(plt, list(summary['diagnostics']), runs, out_dir))
    for name, entry in summary['compute'].items():
        written.append(compute.plot_budgets(plt, name, entry, runs, out_dir))
    if summary['compute']:
        written.append(compute.plot_who_wins(plt, summary['compute'], out_dir))
    if any(summary['break_even'].values()):
        written.append(compute.plot_break_even(plt, summary['break_even'],
                                               summary['step_time_ratio'], out_dir))
    return written


def plot_scan(plt, points, out_dir):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for gap, label in report.GAP_LABELS.items():
        # a family whose configs share no seed has no gap
        shown = [p for p in points if p[gap]['n']]
        ax.errorbar([p['tokens_per_param'] for p in shown], [p[gap]['mean'] for p in shown],
                    yerr=[p[gap]['std'] for p in shown], marker='o', capsize=3,
                    label=f'{gap} gap: {label}')
    ax.axhline(0, color='gray', lw=0.8)
    ax.set_xscale('log')
    ax.set(xlabel='training tokens per total MoE parameter', ylabel='best val loss difference',
           title='gaps against tokens per parameter (bars: std over seeds)')
    ax.legend()
    return report.save(fig, out_dir, 'scan_gaps.png')


def plot_variant_routing(plt, variant_curves, out_dir):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key in zip(axes, ('busiest_frac', 'log_z')):
        for name, c in variant_curves[key].items():
            ax.plot(c['tokens'], c['mean'], marker='.', label=name)
        ax.set(xlabel='training tokens', ylabel=key,
               title=f'{key} on the validation set (mean over seeds)')
        ax.legend(fontsize=8)
    return report.save(fig, out_dir, 'variants_routing.png')


def main(argv=None):
    p = report.parser(__doc__)
    p.add_argument('--bench', help='a folder of bench.py outputs, <MoE config>.txt, whose step '
                   'times set the equal-time budgets (make compute)')
    p.add_argument('--ratio', help='a folder of make ratio\'s step-time ratios, '
                   '<setting>/<MoE config>.txt, to set against k*')
    args = p.parse_args(argv)
    warnings = []
    runs = report.read_runs(args.runs, warnings)
    os.makedirs(args.out, exist_ok=True)
    step_times = compute.read_bench_folder(args.bench) if args.bench else None
    ratios = compute.read_ratio_folder(args.ratio) if args.ratio else ()
    summary = summarise(runs, warnings.append, step_times, ratios)
    plots = plot(summary, runs, args.out)
    report.write(args.out, summary, markdown(summary, runs, warnings, plots))


if __name__ == '__main__':
    with one_line_errors('study.report'):
        main(sys.argv[1:])
