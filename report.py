"""
The paper's table, both gaps, the gaps over training, routing health and plots, from run folders.

    python report.py out/cpu_*                      # -> ./report.md (also printed), report.json, *.png
    python report.py 'out/*' --out results/cpu

Runs are grouped by the config name and seed recorded in their config.json (not by folder names).
A config's role comes from its name: `moe`, `cpu_moe` -> moe; `dense_active`, `cpu_dense_active` ->
dense_active; `..._dense_total` -> dense_total; anything else (ablations) has none. Configs that share a
prefix (`cpu_`, or none for paper scale) form a family, and each family is compared as its own triple.
Gaps are seed-paired: seed s of one config against seed s of the other. Also, when present: MoE variants
(`cpu_moe_noz` against `cpu_moe`, seed-paired, with routing over training) and, for two or more complete
families, the gaps against training tokens per total MoE parameter (a scan).
"""
import argparse
import glob
import json
import math
import os
import sys
from collections import defaultdict

ROLES = ('dense_active', 'moe', 'dense_total')
# the paper's best validation losses (mean, std over 3 seeds) and gaps, shown beside paper-scale results
PAPER = {'moe': (1.5788, 0.0020), 'dense_active': (1.6545, 0.0012), 'dense_total': (1.5608, 0.0025)}
PAPER_GAPS = {'active': 0.0758, 'total': 0.0180}
ROUTING = ('busiest_frac', 'usage_var', 'router_entropy', 'log_z', 'dropped_frac')
EXIT_CE = 2.5  # a run has left the early plateau (training CE near 3.0) at its first logged step below this
NO_GAP = {'mean': None, 'std': None, 'se': None, 'n': 0, 'positive': 0, 'per_seed': {}}  # configs sharing no seed


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
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return mean, std


def load_runs(paths, warn):
    """{config name: {seed: run}} from run folders; folders that are not runs are reported and skipped."""
    runs = defaultdict(dict)
    for path in paths:
        if not os.path.isfile(os.path.join(path, 'config.json')):
            continue  # not a run folder (e.g. a report folder next to the runs)
        try:
            with open(os.path.join(path, 'config.json')) as f:
                config = json.load(f)
            name, seed = config['config_name'], config['seed']
            with open(os.path.join(path, 'log.jsonl')) as f:
                lines = f.read().splitlines()
        except (OSError, ValueError, KeyError, TypeError) as e:
            warn(f'skipped {path}: not a readable run ({type(e).__name__})')
            continue
        if config.get('data_seed', 0) not in (0, seed):  # init and data order apart: a seed-noise run
            warn(f'skipped {path}: its data order (data_seed {config["data_seed"]}) is not its seed\'s; '
                 'scripts/seed_noise.py reads such runs')
            continue
        records = []
        for line in filter(None, lines):
            try:
                records.append(json.loads(line))
            except ValueError:  # e.g. the last line of a run killed mid-write
                warn(f'{path}: skipped an unreadable log line')
        # a diverged (NaN/inf) evaluation is never a best checkpoint
        evals = [r for r in records if 'val_loss' in r]
        finite = [r for r in evals if math.isfinite(r['val_loss'])]
        if not finite:
            warn(f'skipped {path}: no finite evaluation yet')
            continue
        if seed in runs[name]:
            warn(f'skipped {path}: {name} seed {seed} already comes from {runs[name][seed]["path"]}')
            continue
        best = min(finite, key=lambda r: r['val_loss'])
        exit_step = next((r['iter'] for r in records if r.get('ce', math.inf) < EXIT_CE), None)
        runs[name][seed] = {'path': path, 'config': config, 'evals': evals, 'best': best, 'exit_step': exit_step,
                            'finished': evals[-1]['iter'] == config.get('iters')}
        if not runs[name][seed]['finished']:
            warn(f'{path} has not finished (last eval at iter {evals[-1]["iter"]} of {config.get("iters")})')
    return runs


def paired(a, b):
    """Seed-paired differences a - b of best validation losses, over the seeds both configs have: mean, sample std,
    standard error of the mean (std / sqrt(n)), n, how many are > 0, and each seed's; None without a shared seed."""
    seeds = sorted(set(a) & set(b))
    per_seed = {str(s): a[s]['best']['val_loss'] - b[s]['best']['val_loss'] for s in seeds}
    if not per_seed:
        return None
    mean, std = mean_std(list(per_seed.values()))
    n = len(per_seed)
    return {'mean': mean, 'std': std, 'se': std / math.sqrt(n) if n > 1 else None, 'n': n,
            'positive': sum(v > 0 for v in per_seed.values()), 'per_seed': per_seed}


def gap_vs_tokens(a, b):
    """Mean over paired seeds of val_loss(a) - val_loss(b) at every eval point that all of them share."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return {}
    curves = [({r['tokens']: r['val_loss'] for r in a[s]['evals']},
               {r['tokens']: r['val_loss'] for r in b[s]['evals']}) for s in seeds]
    tokens = sorted(set.intersection(*(set(x) & set(y) for x, y in curves)))
    return {t: sum(x[t] - y[t] for x, y in curves) / len(curves) for t in tokens}


def summarise(runs, warn):
    configs, families = {}, defaultdict(dict)
    for name in sorted(runs):
        seeds = runs[name]
        family, role = role_of(name)
        params = next(iter(seeds.values()))['config']['params']
        if any(r['config']['params'] != params for r in seeds.values()):
            warn(f'{name}: seeds have different parameter counts (different overrides under one name?)')
        mean, std = mean_std([r['best']['val_loss'] for r in seeds.values()])
        configs[name] = {'role': role, 'total': params['total'], 'active': params['active'],
                         'seeds': {str(s): seeds[s]['best']['val_loss'] for s in sorted(seeds)},
                         'mean': mean, 'std': std, 'exit_step': {str(s): seeds[s]['exit_step'] for s in sorted(seeds)}}
        routed = [r['best'] for r in seeds.values() if 'busiest_frac' in r['best']]  # MoE runs
        if routed:  # routing at the best checkpoint; older logs without routing keys are left out
            if len(routed) < len(seeds):
                warn(f'{name}: {len(seeds) - len(routed)} seed(s) logged no routing statistics')
            stats = {key: [b[key] for b in routed] for key in ROUTING}
            stats['load'] = list(zip(*(b['load'] for b in routed)))  # per expert, over seeds
            configs[name]['diagnostics'] = {key: dict(zip(('mean', 'std'), mean_std(values)))
                                            for key, values in stats.items() if key != 'load'}
            configs[name]['diagnostics']['load'] = [dict(zip(('mean', 'std'), mean_std(list(v))))
                                                    for v in stats['load']]
        if role:
            families[family][role] = name

    out = {'configs': configs, 'families': {}}
    for family, roles in sorted(families.items()):
        missing = [family + r for r in ROLES if r not in roles]
        if missing:
            warn(f'family {family or "(paper scale)"}: missing {", ".join(missing)}; its gaps are incomplete')
        fam = {'configs': roles, 'gaps': {gap: NO_GAP for gap in ('active', 'total')}}
        curves = {}
        for gap, (a, b) in (('active', ('dense_active', 'moe')), ('total', ('moe', 'dense_total'))):
            if a in roles and b in roles:
                fam['gaps'][gap] = paired(runs[roles[a]], runs[roles[b]]) or NO_GAP
                if not fam['gaps'][gap]['n']:
                    warn(f'{roles[a]} and {roles[b]} share no seed: no {gap} gap')
                curves[gap] = gap_vs_tokens(runs[roles[a]], runs[roles[b]])
        tokens = sorted(set.intersection(*(set(c) for c in curves.values()))) if curves else []
        fam['gap_vs_tokens'] = {'tokens': tokens, **{gap: [curves[gap][t] for t in tokens] if gap in curves else []
                                                     for gap in ('active', 'total')}}
        out['families'][family] = fam
    # the top-level gaps are the first complete family's (paper scale sorts first), as scripts expect
    headline = next((f for f in out['families'].values() if len(f['configs']) == 3), None) or \
        next(iter(out['families'].values()), {'gaps': {gap: NO_GAP for gap in ('active', 'total')},
                                              'gap_vs_tokens': {'tokens': [], 'active': [], 'total': []}})
    out['gaps'], out['gap_vs_tokens'] = headline['gaps'], headline['gap_vs_tokens']
    out['diagnostics'] = {name: c['diagnostics'] for name, c in configs.items() if 'diagnostics' in c}
    out['variants'], out['variant_curves'] = variants(runs, warn)
    out['scan'] = scan(out['families'], runs)
    return out


def variants(runs, warn):
    """MoE variants: a config named <moe config>_<change> (cpu_moe_noz) against that MoE config, seed-paired, and
    against the dense models of its family (vs_dense_total, vs_dense_active: variant - dense, negative = the
    variant is better). Returns (differences by variant, {key: {config: curve}} for busiest_frac and log_z over
    training with every default and variant once, defaults first)."""
    bases = [name for name in runs if role_of(name)[1] == 'moe']
    deltas, curves = {}, {'busiest_frac': {}, 'log_z': {}}
    for name in sorted(runs):
        base = max((b for b in bases if name.startswith(b + '_')), key=len, default=None)
        if base is None or role_of(name)[1]:
            continue
        delta = paired(runs[name], runs[base])
        if not delta:
            warn(f'{name} and {base} share no seed: no paired difference')
            continue
        deltas[name] = {'base': base, **delta}
        for role in ('dense_total', 'dense_active'):
            dense = role_of(base)[0] + role
            deltas[name]['vs_' + role] = (paired(runs[name], runs[dense]) if dense in runs else None) or NO_GAP
    for key, by_config in curves.items():
        for name in sorted({d['base'] for d in deltas.values()}) + list(deltas):
            by_config[name] = curve_mean(runs[name], key)
    return deltas, curves


def curve_mean(seeds, key):
    """{'tokens': [...], 'mean': [...]}: an eval key's mean over the seeds that logged it, at the eval points
    they share."""
    curves = [c for c in ({r['tokens']: r[key] for r in s['evals'] if key in r} for s in seeds.values()) if c]
    tokens = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    return {'tokens': tokens, 'mean': [sum(c[t] for c in curves) / len(curves) for t in tokens]}


def scan(families, runs):
    """Both gaps per complete family, ordered by training tokens per total MoE parameter (a scan of model
    sizes on one token budget, or of budgets); [] for fewer than two families."""
    complete = {family: fam for family, fam in families.items() if len(fam['configs']) == 3}
    if len(complete) < 2:
        return []
    points = []
    for family, fam in complete.items():
        c = next(iter(runs[fam['configs']['moe']].values()))['config']
        tokens = c['iters'] * c['tokens_per_iter']
        try:  # epochs need the data's size, from the run's data_dir when it is still there
            epochs = tokens / json.load(open(os.path.join(c['data_dir'], 'meta.json')))['train_tokens']
        except (OSError, ValueError, KeyError):
            epochs = None
        points.append({'family': family, 'd_model': c['d_model'], 'moe_total': c['params']['total'],
                       'moe_active': c['params']['active'], 'tokens': tokens,
                       'tokens_per_param': tokens / c['params']['total'], 'epochs': epochs, **fam['gaps']})
    return sorted(points, key=lambda p: p['tokens_per_param'])


def markdown(summary, runs, warnings, plots):
    f = lambda m, s: f'{m:.4f} ± {s:.4f}'
    lines = ['# tinymoe report', '', f'Runs: {sum(len(s) for s in runs.values())} in {len(runs)} configs. '
             'Best validation loss (CE on the fixed validation set) per run; mean ± sample std over seeds.', '',
             f'"Leaves the plateau": the mean over seeds of the first logged step with training CE < {EXIT_CE} '
             '(its range in brackets; never: runs that did not).', '',
             '| config | role | total params | active params | seeds | best val loss | paper | leaves the plateau |',
             '|---|---|---|---|---|---|---|---|']
    for name, c in summary['configs'].items():
        paper = f(*PAPER[c['role']]) if name in ROLES else ''
        steps = [s for s in c['exit_step'].values() if s is not None]
        never = len(c['exit_step']) - len(steps)
        exits = (f'{sum(steps) / len(steps):.0f} [{min(steps)}-{max(steps)}]' if steps else '') + \
            (f'{", " * bool(steps)}never: {never}' if never else '')
        lines.append(f'| {name} | {c["role"] or "-"} | {c["total"]:,} | {c["active"]:,} | '
                     f'{",".join(c["seeds"])} | {f(c["mean"], c["std"])} | {paper} | {exits} |')
    for family, fam in summary['families'].items():
        title = family.rstrip('_') or 'paper scale'
        lines += ['', f'## Gaps: {title}', '',
                  'Seed-paired differences of best validation loss; positive = the first model is worse.', '',
                  '| gap | mean ± std | standard error | seeds > 0 | per seed | paper |', '|---|---|---|---|---|---|']
        for gap, label in (('active', 'matched-active: dense_active - moe'), ('total', 'matched-total: moe - dense_total')):
            if fam['gaps'][gap]['n']:
                g = fam['gaps'][gap]
                per_seed = ', '.join(f's{s}: {v:+.4f}' for s, v in g['per_seed'].items())
                paper = f'{PAPER_GAPS[gap]:+.4f}' if not family else ''
                se = '-' if g['se'] is None else f'{g["se"]:.4f}'
                lines.append(f'| {label} | {g["mean"]:+.4f} ± {g["std"]:.4f} | {se} | {g["positive"]} of '
                             f'{g["n"]} | {per_seed} | {paper} |')
            else:
                lines.append(f'| {label} | missing | | | | |')
        curve = fam['gap_vs_tokens']
        shown = [g for g in ('active', 'total') if curve[g]]
        if curve['tokens'] and shown:
            lines += ['', 'Gap versus training tokens (mean over paired seeds, val loss at each eval):', '',
                      '| tokens | ' + ' | '.join(shown) + ' |', '|---|' + '---|' * len(shown)]
            for i, t in enumerate(curve['tokens']):
                lines.append(f'| {t / 1e6:.2f}M | ' + ' | '.join(f'{curve[g][i]:+.4f}' for g in shown) + ' |')
    if summary['diagnostics']:
        lines += ['', '## Routing at the best checkpoint', '',
                  'Mean over MoE layers, on the validation set; mean ± std over seeds. busiest_frac is the largest '
                  'expert share (1/n_experts = perfect balance, 1.0 = collapsed); router_entropy in nats; load is '
                  'the share of assignments per expert.', '',
                  '| config | ' + ' | '.join(ROUTING) + ' | load |', '|---|' + '---|' * (len(ROUTING) + 1)]
        for name, d in summary['diagnostics'].items():
            lines.append(f'| {name} | ' + ' | '.join(f'{d[k]["mean"]:.4f} ± {d[k]["std"]:.4f}' for k in ROUTING) +
                         ' | ' + ', '.join(f'{e["mean"]:.3f}' for e in d['load']) + ' |')
    if summary['scan']:
        lines += ['', '## Gaps against tokens per parameter', '',
                  'One row per complete family, by training tokens per total MoE parameter. Seed-paired gaps, '
                  'mean ± std [seeds > 0 of seeds]: active gap > 0 = the MoE beats dense_active; total gap > 0 = '
                  'dense_total beats the MoE.', '',
                  '| family | d_model | MoE total / active | tokens | tokens per param | epochs | active gap | '
                  'total gap |', '|---|---|---|---|---|---|---|---|']
        for p in summary['scan']:
            gap = lambda g: ('missing' if not p[g]['n'] else f'{p[g]["mean"]:+.4f} (1 seed)' if p[g]['n'] == 1 else
                             f'{p[g]["mean"]:+.4f} ± {p[g]["std"]:.4f} [{p[g]["positive"]} of {p[g]["n"]}]')
            epochs = '-' if p['epochs'] is None else f'{p["epochs"]:.2f}'
            lines.append(f'| {p["family"].rstrip("_") or "paper scale"} | {p["d_model"]} | {p["moe_total"]:,} / '
                         f'{p["moe_active"]:,} | {p["tokens"] / 1e6:.2f}M | {p["tokens_per_param"]:.1f} | {epochs} | '
                         f'{gap("active")} | {gap("total")} |')
    if summary['variants']:
        lines += ['', '## MoE variants against their default', '',
                  'Seed-paired differences of best validation loss, variant - default and variant - each dense '
                  'model of its family (positive = the variant is worse; [k of n < 0]: seeds where the variant is '
                  'better); routing at the best checkpoint is in the table above.', '',
                  '| variant | default | difference | seeds | per seed | vs dense_total | vs dense_active |',
                  '|---|---|---|---|---|---|---|']
        vs = lambda g: '-' if not g['n'] else (f'{g["mean"]:+.4f} ± {g["std"]:.4f} '
                                              f'[{sum(v < 0 for v in g["per_seed"].values())} of {g["n"]} < 0]')
        for name, d in summary['variants'].items():
            lines.append(f'| {name} | {d["base"]} | {d["mean"]:+.4f} ± {d["std"]:.4f} | {d["n"]} | ' +
                         ', '.join(f's{s}: {x:+.4f}' for s, x in d['per_seed'].items()) +
                         f' | {vs(d["vs_dense_total"])} | {vs(d["vs_dense_active"])} |')
        for key, curves in summary['variant_curves'].items():
            at_tokens = [dict(zip(c['tokens'], c['mean'])) for c in curves.values()]
            tokens = sorted(set().union(*at_tokens))
            lines += ['', f'{key} over training (validation set, mean over seeds):', '',
                      '| tokens | ' + ' | '.join(curves) + ' |', '|---|' + '---|' * len(curves)]
            for t in tokens:
                at = [c.get(t) for c in at_tokens]
                lines.append(f'| {t / 1e6:.2f}M | ' + ' | '.join('' if v is None else f'{v:.3f}' for v in at) + ' |')
    if plots:
        lines += ['', '## Plots', ''] + [f'![{p}]({p})' for p in plots]
    if warnings:
        lines += ['', '## Missing or incomplete', ''] + [f'- {w}' for w in warnings]
    return '\n'.join(lines) + '\n'


def plot(summary, runs, out_dir):
    """PNG files next to report.md: val loss vs tokens, both gaps vs tokens, expert load over training."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    written = []
    for family, fam in summary['families'].items():
        tag = family.rstrip('_') or 'paper'
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for role in ROLES:
            if role not in fam['configs']:
                continue
            seeds = runs[fam['configs'][role]].values()
            tokens = sorted(set.intersection(*({r['tokens'] for r in s['evals']} for s in seeds)))
            tokens = [t for t in tokens if t > 0]  # the untrained model's loss would squash the axis
            curves = [[{r['tokens']: r['val_loss'] for r in s['evals']}[t] for t in tokens] for s in seeds]
            if not tokens:
                continue
            mean = [sum(v) / len(v) for v in zip(*curves)]
            ax.plot(tokens, mean, label=f'{fam["configs"][role]} ({len(curves)} seeds)')
            ax.fill_between(tokens, [min(v) for v in zip(*curves)], [max(v) for v in zip(*curves)], alpha=0.25)
        ax.set(xlabel='training tokens', ylabel='validation loss', title=f'{tag}: validation loss (band: min-max over seeds)')
        low = min((line.get_ydata().min() for line in ax.get_lines()), default=None)
        if low is not None and math.isfinite(low):  # early losses would squash the interesting end
            ax.set_ylim(top=min(ax.get_ylim()[1], 1.5 * low))
        ax.legend()
        written.append(save(fig, out_dir, f'{tag}_val_loss.png'))

        curve = fam['gap_vs_tokens']
        if curve['tokens']:
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for gap, label in (('active', 'dense_active - moe'), ('total', 'moe - dense_total')):
                if curve[gap]:
                    ax.plot(curve['tokens'], curve[gap], marker='o', label=f'{gap} gap: {label}')
            ax.axhline(0, color='gray', lw=0.8)
            ax.set(xlabel='training tokens', ylabel='val loss difference', title=f'{tag}: gaps over training (mean over seeds)')
            ax.legend()
            written.append(save(fig, out_dir, f'{tag}_gaps.png'))

    if summary['scan']:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for gap, label in (('active', 'dense_active - moe'), ('total', 'moe - dense_total')):
            points = [p for p in summary['scan'] if p[gap]['n']]  # a family whose configs share no seed has none
            ax.errorbar([p['tokens_per_param'] for p in points], [p[gap]['mean'] for p in points],
                        yerr=[p[gap]['std'] for p in points], marker='o', capsize=3, label=f'{gap} gap: {label}')
        ax.axhline(0, color='gray', lw=0.8)
        ax.set_xscale('log')
        ax.set(xlabel='training tokens per total MoE parameter', ylabel='best val loss difference',
               title='gaps against tokens per parameter (bars: std over seeds)')
        ax.legend()
        written.append(save(fig, out_dir, 'scan_gaps.png'))

    if summary['variants']:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, key in zip(axes, ('busiest_frac', 'log_z')):
            for name, c in summary['variant_curves'][key].items():
                ax.plot(c['tokens'], c['mean'], marker='.', label=name)
            ax.set(xlabel='training tokens', ylabel=key, title=f'{key} on the validation set (mean over seeds)')
            ax.legend(fontsize=8)
        written.append(save(fig, out_dir, 'variants_routing.png'))

    moe_runs = [name for name in summary['diagnostics']]
    if moe_runs:
        fig, axes = plt.subplots(1, len(moe_runs), figsize=(4.5 * len(moe_runs), 3.8), squeeze=False)
        for ax, name in zip(axes[0], moe_runs):
            seed = min(s for s in runs[name] if any('load' in r for r in runs[name][s]['evals']))
            evals = [r for r in runs[name][seed]['evals'] if 'load' in r]
            for i in range(len(evals[0]['load'])):
                ax.plot([r['tokens'] for r in evals], [r['load'][i] for r in evals], label=f'expert {i}')
            ax.set(xlabel='training tokens', ylabel='share of assignments', title=f'{name} s{seed}', ylim=(0, 1))
            ax.legend(fontsize=7)
        fig.suptitle('expert load on the validation set (mean over layers)')
        written.append(save(fig, out_dir, 'expert_load.png'))
    return written


def save(fig, out_dir, name):
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, name), dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return name


def finite_or_none(x):
    """NaN and inf (a diverged run) as null, so that report.json stays strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_or_none(v) for v in x]
    return x


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('runs', nargs='+', help='run folders or globs (e.g. out/cpu_*)')
    p.add_argument('--out', default='.', help='folder for report.md, report.json and the plots')
    args = p.parse_args(argv)
    warnings = []
    paths = sorted({path for pattern in args.runs for path in (glob.glob(pattern) or [pattern])})
    runs = load_runs([p for p in paths if os.path.isdir(p)], warnings.append)
    warnings += [f'skipped {p}: not a folder' for p in paths if not os.path.isdir(p)]
    if not runs:
        print('report.py: error: no runs found in ' + ' '.join(args.runs), file=sys.stderr)
        sys.exit(1)
    os.makedirs(args.out, exist_ok=True)
    summary = summarise(runs, warnings.append)
    plots = plot(summary, runs, args.out)
    text = markdown(summary, runs, warnings, plots)
    with open(os.path.join(args.out, 'report.md'), 'w') as f:
        f.write(text)
    with open(os.path.join(args.out, 'report.json'), 'w') as f:
        json.dump(finite_or_none(summary), f, indent=2)
    print(text)


if __name__ == '__main__':
    main()
