"""
The paper's table, both gaps, the gaps over training, routing health and plots, from run folders.

    python report.py out/cpu_*                  # -> ./report.md (also printed), report.json, *.png
    python report.py 'out/*' --out out/report

Runs are grouped by the config name and seed recorded in their config.json (not by folder names).
A config's role comes from its name: `moe`, `cpu_moe` -> moe; `dense_active`, `cpu_dense_active`
-> dense_active; `..._dense_total` -> dense_total; anything else (ablations) has none. Configs that
share a prefix (`cpu_`, or none for paper scale) form a family, and each family is compared as its
own triple. Gaps are seed-paired: seed s of one config against seed s of the other. Also, when
present: MoE variants (`cpu_moe_noz` against `cpu_moe`, seed-paired, with routing over training)
and, for two or more complete families, the gaps against training tokens per total MoE parameter
(a scan); and with flops_<config> / time_<config> runs (make compute), each MoE against its
dense_total at equal tokens, training FLOPs and time.
"""
import argparse
import glob
import json
import math
import os
import random
import re
import statistics
import sys
import types
from collections import defaultdict

import bench
import train
from plumbing import UserError, one_line_errors

ROLES = ('dense_active', 'moe', 'dense_total')
# the paper's best validation losses (mean, std over 3 seeds) and gaps, shown beside paper-scale
# results
PAPER = {'moe': (1.5788, 0.0020), 'dense_active': (1.6545, 0.0012),
         'dense_total': (1.5608, 0.0025)}
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
# a run named <budget>_<config> trains the config for another budget than the recipe's tokens:
# cpu_dense_total's training FLOPs, or its time (make compute, scripts/compute_budget.py)
BUDGETS = ('tokens', 'flops', 'time')
BUDGET_LABELS = {'tokens': 'equal tokens', 'flops': 'equal FLOPs', 'time': 'equal time'}
# resamples of the seeds behind break_even's 90% interval
BOOTSTRAP = 2000


def budget_of(name):
    """'flops_cpu_moe' -> ('flops', 'cpu_moe'); a run at a token multiplier k of a config,
    'k1.2_cpu_moe' -> ('k1.2', 'cpu_moe'); a config at its own token budget -> ('tokens', name)."""
    prefix, _, config = name.partition('_')
    multiplier = re.fullmatch(r'k\d+(\.\d+)?', prefix)
    if (prefix in BUDGETS[1:] or multiplier) and config:
        return prefix, config
    return 'tokens', name


def budget_label(budget, b):
    """'equal FLOPs', or for a run at a token multiplier '1.20x the tokens'."""
    return BUDGET_LABELS.get(budget) or f'{b["k"]:.2f}x the tokens'


def role_of(name):
    """-> (family prefix, role), or (None, None) for configs outside the three-way comparison
    (budget runs among them: they are compared by compute_gaps)."""
    if budget_of(name)[0] != 'tokens':
        return None, None
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
    """The log's records; an unreadable line (e.g. the last of a run killed mid-write) is skipped
    with a warning."""
    records = []
    for line in filter(None, lines):
        try:
            records.append(json.loads(line))
        except ValueError:
            warn(f'{path}: skipped an unreadable log line')
    return records


def add_flops(config, records):
    """The training FLOPs so far on every record, as train.py logs them; computed from the config
    for logs written before it did (train.flops_per_token, the one count)."""
    if 'flops_per_token' not in config:
        c = types.SimpleNamespace(**{**train.DEFAULTS, **config})
        config['flops_per_token'] = train.flops_per_token(c)
    for r in records:
        r.setdefault('flops', r['tokens'] * config['flops_per_token'])


def train_seconds(records):
    """Training time from the log, evaluation excluded: each training line's tokens since the
    line before, over its tok_per_s."""
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
    """{config name: {seed: run}} from run folders; folders that are not runs are reported and
    skipped."""
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
                 'seed\'s; scripts/seed_noise.py reads such runs')
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
        below = (r['iter'] for r in records if r.get('ce', math.inf) < EXIT_CE)
        exit_step = next(below, None)
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
    """Seed-paired differences a - b of best validation losses, over the seeds both configs have:
    mean, sample std, standard error of the mean (std / sqrt(n)), n, how many are > 0, and each
    seed's; None without a shared seed."""
    seeds = sorted(set(a) & set(b))
    per_seed = {str(s): a[s]['best']['val_loss'] - b[s]['best']['val_loss'] for s in seeds}
    if not per_seed:
        return None
    mean, std = mean_std(list(per_seed.values()))
    n = len(per_seed)
    # one seed has no standard error
    se = std / math.sqrt(n) if n > 1 else None
    positive = sum(v > 0 for v in per_seed.values())
    return {'mean': mean, 'std': std, 'se': se, 'n': n, 'positive': positive,
            'per_seed': per_seed}


def val_at_tokens(run):
    """{tokens: val loss} over a run's evaluations."""
    return {r['tokens']: r['val_loss'] for r in run['evals']}


def gap_vs_tokens(a, b):
    """Mean over paired seeds of val_loss(a) - val_loss(b) at every eval point that all of them
    share."""
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
    per_expert = zip(*(b['load'] for b in routed))
    diagnostics['load'] = [mean_and_std(list(v)) for v in per_expert]
    return diagnostics


def family_gaps(runs, roles):
    """-> (gaps, gap_vs_tokens) of one family: both seed-paired gaps and their curves over
    training, for the roles it has."""
    gaps = {gap: NO_GAP for gap in GAP_ROLES}
    curves = {}
    for gap, (a, b) in GAP_ROLES.items():
        if a in roles and b in roles:
            gaps[gap] = paired(runs[roles[a]], runs[roles[b]]) or NO_GAP
            curves[gap] = gap_vs_tokens(runs[roles[a]], runs[roles[b]])
    tokens = []
    if curves:
        tokens = sorted(set.intersection(*(set(c) for c in curves.values())))
    curve = {'tokens': tokens}
    for gap in GAP_ROLES:
        curve[gap] = [curves[gap][t] for t in tokens] if gap in curves else []
    return gaps, curve


def summarise(runs, warn, step_times=None, ratios=()):
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
    # the top-level gaps are the first complete family's (paper scale sorts first), as scripts
    # expect
    headline = headline_family(out['families'])
    out['gaps'], out['gap_vs_tokens'] = headline['gaps'], headline['gap_vs_tokens']
    out['diagnostics'] = {name: c['diagnostics'] for name, c in configs.items()
                          if 'diagnostics' in c}
    out['variants'], out['variant_curves'] = variants(runs, warn)
    out['scan'] = scan(out['families'], runs)
    out['compute'] = compute_gaps(runs, warn, step_times)
    out['break_even'] = {name: break_even(entry) for name, entry in out['compute'].items()}
    out['step_time_ratio'] = []
    for row in ratios:
        entry = out['break_even'].get(break_even_name(row['config'], out['break_even']))
        out['step_time_ratio'].append({**row, 'verdict': verdict(row, entry)})
    return out


def break_even_name(config, names):
    """The name an MoE config's k* goes by among names: its own or a warmup study's (cpu_moe ->
    w224_cpu_moe); None if neither is there."""
    return next((name for name in names
                 if name == config or re.fullmatch(rf'w\d+_{re.escape(config)}', name)), None)


def interval_within_trained(entry):
    """k*'s 90% interval for the plot, its ends cut to the trained k's: an end beyond them (+-inf)
    says only on which side k* lies."""
    ks = [g['k'] for g in entry['per_k']]
    return [min(max(k, ks[0]), ks[-1]) for k in entry['interval']]


def verdict(ratio, break_even_entry):
    """Where an MoE wins on time on the machine that measured a step-time ratio r: 'wins' if r's
    first quartile lies above k*'s 90% interval, 'loses' if its third quartile lies below it, else
    'undecided'; None without a k*."""
    if break_even_entry is None:
        return None
    low, high = break_even_entry['interval']
    ks = [g['k'] for g in break_even_entry['per_k']]
    # an end beyond the trained k's (+-inf) says only that k* lies below the first or above the last
    at_most = max(high, ks[0])
    at_least = min(low, ks[-1])
    if ratio['q1'] > at_most:
        return 'wins'
    if ratio['q3'] < at_least:
        return 'loses'
    return 'undecided'


def headline_family(families):
    """The first complete family, else the first family, else one with no gaps."""
    for fam in families.values():
        if len(fam['configs']) == 3:
            return fam
    if families:
        return next(iter(families.values()))
    return {'gaps': {gap: NO_GAP for gap in GAP_ROLES}, 'gap_vs_tokens': EMPTY_CURVE}


def variants(runs, warn):
    """MoE variants: a config named <moe config>_<change> (cpu_moe_noz) against that MoE config,
    seed-paired, and against the dense models of its family (vs_dense_total, vs_dense_active:
    variant - dense, negative = the variant is better). Returns (differences by variant, {key:
    {config: curve}} for busiest_frac and log_z over training with every default and variant
    once, defaults first)."""
    bases = [name for name in runs if role_of(name)[1] == 'moe']
    deltas, curves = {}, {'busiest_frac': {}, 'log_z': {}}
    for name in sorted(runs):
        # the longest MoE config name this one extends: cpu_moe for cpu_moe_noz
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
            vs_dense = None
            if dense in runs:
                vs_dense = paired(runs[name], runs[dense])
            deltas[name]['vs_' + role] = vs_dense or NO_GAP
    defaults = sorted({d['base'] for d in deltas.values()})
    for key, by_config in curves.items():
        for name in defaults + list(deltas):
            by_config[name] = curve_mean(runs[name], key)
    return deltas, curves


def dense_total_of(config, runs):
    """The dense_total an MoE config is matched to: its family's (cpu_moe -> cpu_dense_total),
    or for a variant its base MoE's (cpu_moe_shared -> cpu_dense_total, read from the name, so
    the base MoE's own runs need not be given); None if that dense_total is not in runs."""
    words = config.split('_')
    # the longest leading words that name an MoE: cpu_moe for cpu_moe_shared
    prefixes = ['_'.join(words[:n]) for n in range(len(words), 0, -1)]
    base = next((p for p in prefixes if role_of(p)[1] == 'moe'), None)
    if base is None:
        return None
    dense = role_of(base)[0] + 'dense_total'
    return dense if dense in runs else None


def budget_summary(seeds):
    """A config's tokens, epochs, training FLOPs and training seconds (means over its seeds), and
    whether more of the data still helped at the end: the seeds whose best evaluation is their
    last, and the mean rise of the last evaluation over the best."""
    out = {key: mean_std([r[key] for r in seeds.values()])[0]
           for key in ('tokens', 'flops', 'train_seconds')}
    # each run's wall clock beside its FLOPs: what else ran on the machine shows here
    out['train_seconds_per_seed'] = {str(s): seeds[s]['train_seconds'] for s in sorted(seeds)}
    out['epochs'] = data_epochs(next(iter(seeds.values()))['config'], out['tokens'])
    out['n'] = len(seeds)
    out['best_is_last'] = sum(r['best']['iter'] == r['evals'][-1]['iter'] for r in seeds.values())
    rises = [r['last_val'] - r['best']['val_loss'] for r in seeds.values()]
    out['rise_after_best'] = mean_std(rises)[0]
    fastest = [r['fastest_step_ms'] for r in seeds.values() if r['fastest_step_ms']]
    out['fastest_step_ms'] = min(fastest, default=None)
    return out


def t_statistic(gap):
    """The paired t statistic, mean / standard error; None where it is undefined."""
    return gap['mean'] / gap['se'] if gap['se'] else None


def budget_entry(seeds, dense):
    """One budget of an MoE: its summary and its seed-paired gap to its dense_total."""
    gap = paired(seeds, dense) or NO_GAP
    return {**budget_summary(seeds), 'vs_dense_total': {**gap, 't': t_statistic(gap)}}


def compute_gaps(runs, warn, step_times=None):
    """Who wins under which budget: each MoE trained at the recipe's tokens and, where its
    flops_/time_ runs exist, at dense_total's training FLOPs and time, against that dense_total,
    seed-paired (vs_dense_total: MoE - dense_total, negative = the MoE is better), with the step
    times that set the time budget ({config: bench.read_step_times(...)}) where given. Only MoEs
    with a budget run; {} without any."""
    out = {}
    for name in sorted(runs):
        budget, config = budget_of(name)
        if budget == 'tokens':
            continue
        if config not in runs:
            warn(f'{name}: no {config} runs at the recipe\'s tokens given; it is left out')
            continue
        dense = dense_total_of(config, runs)
        if dense is None:
            continue
        if config not in out:  # the MoE's first budget run: its dense_total and its recipe run
            out[config] = {'dense_total': dense, **budget_summary(runs[dense]),
                           'budgets': {'tokens': budget_entry(runs[config], runs[dense])}}
            if step_times and config in step_times:
                out[config]['step_ms'] = step_times[config]
        out[config]['budgets'][budget] = budget_entry(runs[name], runs[dense])
    for entry in out.values():  # each budget's token multiplier; the named budgets first, then by k
        budgets = entry['budgets']
        for b in budgets.values():
            b['k'] = b['tokens'] / entry['tokens']
        multipliers = sorted((b for b in budgets if b not in BUDGETS),
                             key=lambda b: budgets[b]['k'])
        entry['budgets'] = {b: budgets[b] for b in [*BUDGETS, *multipliers] if b in budgets}
    return out


def crossing(ks, gaps):
    """The k at which a gap (MoE - dense_total) first reaches 0 as k grows, linear between the
    trained k's: -inf if it is <= 0 already at the first k, inf if it never gets there."""
    if gaps[0] <= 0:
        return -math.inf
    for k0, g0, k1, g1 in zip(ks, gaps, ks[1:], gaps[1:]):
        if g1 <= 0:
            return k0 + (k1 - k0) * g0 / (g0 - g1)
    return math.inf


def break_even(entry, resamples=BOOTSTRAP):
    """k*: the token multiplier k (the MoE's tokens / its dense_total's, each run with its own
    schedule) at which the seed-mean gap to dense_total reaches 0; an MoE wins on time on a
    machine where dense_total's step takes more than k* times the MoE's. Over the seeds trained
    at every k: k*, a 90% interval from resampling those seeds, and each seed's own crossing.
    None with fewer than two k's."""
    budgets = sorted(entry['budgets'].values(), key=lambda b: b['k'])
    per_k = [b['vs_dense_total']['per_seed'] for b in budgets]
    seeds = sorted(set.intersection(*(set(p) for p in per_k)), key=int)
    if len(budgets) < 2 or not seeds:
        return None
    ks = [b['k'] for b in budgets]

    def mean_crossing(sample):
        return crossing(ks, [sum(p[s] for s in sample) / len(sample) for p in per_k])

    rng = random.Random(0)  # the same interval on every run of the report
    boot = sorted(mean_crossing(rng.choices(seeds, k=len(seeds))) for _ in range(resamples))
    interval = [boot[int(0.05 * resamples)], boot[int(0.95 * resamples) - 1]]
    per_k_gaps = [{'k': b['k'], **{key: b['vs_dense_total'][key]
                                   for key in ('mean', 'std', 'n', 'positive', 't', 'per_seed')}}
                  for b in budgets]
    return {'k_star': mean_crossing(seeds), 'interval': interval, 'seeds': len(seeds),
            'per_seed': {s: crossing(ks, [p[s] for p in per_k]) for s in seeds},
            'per_k': per_k_gaps}


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


def curve_mean(seeds, key, x='tokens'):
    """{x: [...], 'mean': [...]}: an eval key's mean over the seeds that logged it, at the eval
    points they share."""
    points, curves = seed_curves(seeds, key, x)
    return {x: points, 'mean': pointwise_mean(curves)}


def trained_val_curves(seeds, x):
    """seed_curves of the validation loss without the untrained model's point (x = 0): its loss
    would squash a plot's axis."""
    points, curves = seed_curves(seeds, 'val_loss', x)
    if points and points[0] == 0:
        points, curves = points[1:], [c[1:] for c in curves]
    return points, curves


def data_epochs(config, tokens):
    """Epochs over the training split, from the run's data_dir when it is still there; else
    None."""
    try:
        with open(os.path.join(config['data_dir'], 'meta.json')) as f:
            train_tokens = json.load(f)['train_tokens']
    except (OSError, ValueError, KeyError):
        return None
    return tokens / train_tokens


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
                       'epochs': data_epochs(c, tokens), **fam['gaps']})
    return sorted(points, key=lambda p: p['tokens_per_param'])


# ----------------------------------------------------------------------------- report.md
def mean_pm_std(mean, std):
    return f'{mean:.4f} ± {std:.4f}'


def exit_text(exit_steps):
    """The "leaves the plateau" cell: mean [min-max] of the runs that left, and how many never
    did."""
    steps = [s for s in exit_steps.values() if s is not None]
    never = len(exit_steps) - len(steps)
    parts = []
    if steps:
        parts.append(f'{sum(steps) / len(steps):.0f} [{min(steps)}-{max(steps)}]')
    if never:
        parts.append(f'never: {never}')
    return ', '.join(parts)


def scan_gap_text(g):
    """A scan row's gap: mean ± std [seeds > 0 of seeds], or the one seed's value."""
    if not g['n']:
        return 'missing'
    if g['n'] == 1:
        return f'{g["mean"]:+.4f} (1 seed)'
    return f'{g["mean"]:+.4f} ± {g["std"]:.4f} [{g["positive"]} of {g["n"]}]'


def vs_dense_text(g):
    """A variant against a dense model: mean ± std [seeds where the variant is better]."""
    if not g['n']:
        return '-'
    better = sum(v < 0 for v in g['per_seed'].values())
    return f'{g["mean"]:+.4f} ± {g["std"]:.4f} [{better} of {g["n"]} < 0]'


def config_lines(summary):
    lines = [
        '| config | role | total params | active params | training FLOPs | seeds | '
        'best val loss | paper | leaves the plateau |',
        '|---|---|---|---|---|---|---|---|---|',
    ]
    for name, c in summary['configs'].items():
        paper = mean_pm_std(*PAPER[c['role']]) if name in ROLES else ''
        lines.append(f'| {name} | {c["role"] or "-"} | {c["total"]:,} | {c["active"]:,} | '
                     f'{c["flops"]:.3g} | {",".join(c["seeds"])} | '
                     f'{mean_pm_std(c["mean"], c["std"])} | {paper} | '
                     f'{exit_text(c["exit_step"])} |')
    return lines


def family_lines(family, fam):
    title = family.rstrip('_') or 'paper scale'
    lines = [
        '', f'## Gaps: {title}', '',
        'Seed-paired differences of best validation loss; positive = the first model is worse.',
        '',
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
        lines.append(f'| {label} | {g["mean"]:+.4f} ± {g["std"]:.4f} | {se} | {g["positive"]} '
                     f'of {g["n"]} | {per_seed} | {paper} |')
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


def compute_lines(compute):
    lines = [
        '', '## Who wins under which budget', '',
        'Each MoE against the dense model of its total params, trained for the recipe\'s tokens, '
        'for that dense model\'s training FLOPs and for its time (train.py\'s FLOPs count; equal '
        'time from bench.py\'s step times, below). MoE - dense_total, seed-paired: negative = the '
        'MoE is better; [k of n]: seeds where it is; t = mean / standard error. Training time is '
        'from the logs, evaluation excluded: it also counts what else ran on the machine. "Best '
        'at the end": seeds whose best evaluation is their last, and the mean rise of the last '
        'over the best.', '',
        '| MoE | budget | tokens | epochs | training FLOPs | training time | vs dense_total | t | '
        'best at the end | per seed |',
        '|---|---|---|---|---|---|---|---|---|---|',
    ]
    for name, entry in compute.items():
        lines.append(f'| {entry["dense_total"]} | (the reference) | {budget_cells(entry)} | | | '
                     f'{end_text(entry)} | |')
        for budget, b in entry['budgets'].items():
            g = b['vs_dense_total']
            t = '-' if g['t'] is None else f'{g["t"]:.1f}'
            per_seed = ', '.join(f's{s}: {v:+.4f}' for s, v in g['per_seed'].items())
            lines.append(f'| {name} | {budget_label(budget, b)} | {budget_cells(b)} | '
                         f'{vs_dense_text(g)} | {t} | {end_text(b)} | {per_seed} |')
    timed = {name: entry['step_ms'] for name, entry in compute.items() if 'step_ms' in entry}
    if timed:
        lines += ['', 'The step times that set equal time (bench.py: one process, interleaved):',
                  '']
    for name, ms in timed.items():
        ratio = ms['dense_total'] / ms['moe']
        lines.append(f'- {name}: {ms["moe"]:.1f} ms a step, its dense_total '
                     f'{ms["dense_total"]:.1f} ms ({ratio:.3f}x); {ms["hardware"]}, '
                     f'torch {ms["torch"]}.{trained_for_text(compute[name])} '
                     f'{fastest_text(compute[name])}')
    return lines


def trained_for_text(entry):
    """The token multiplier the equal-time runs trained for: the step-time ratio of the bench
    file they were planned from, which a later measurement may not repeat."""
    if 'time' not in entry['budgets']:
        return ''
    return f' Its equal-time runs trained for {entry["budgets"]["time"]["k"]:.3f}x the tokens.'


def k_text(k):
    """A crossing: its value, or the side of the trained k's it lies beyond."""
    if k == -math.inf:
        return 'below the trained k\'s'
    if k == math.inf:
        return 'above the trained k\'s'
    return f'{k:.3f}'


def break_even_lines(break_even):
    lines = ['', '## Break-even: the token multiplier k* against the step-time ratio r', '',
             'k: the MoE\'s tokens over its dense_total\'s, each run with its own warmup and '
             'cosine schedule. k*: where the seed-mean gap (MoE - dense_total) reaches 0, linear '
             'between the trained k\'s: the gap falls ever more slowly with k, so the line between '
             'two trained k\'s lies above it and k* leans high, against the MoE. The 90% interval '
             f'resamples the seeds trained at every k ({BOOTSTRAP} times). The MoE wins on time on '
             'a machine where dense_total\'s step takes more than k* times the MoE\'s (r > k*).',
             '', '| MoE | seeds | gap at each k | k* | 90% interval | each seed\'s k*: median '
             '[min-max] |', '|---|---|---|---|---|---|']
    for name, b in break_even.items():
        if b is None:
            continue
        gaps = ', '.join(f'{g["k"]:.3f}: {g["mean"]:+.4f}' for g in b['per_k'])
        seeds = b['per_seed'].values()
        low, high = b['interval']
        lines.append(f'| {name} | {b["seeds"]} | {gaps} | {k_text(b["k_star"])} | '
                     f'{k_text(low)} - {k_text(high)} | {k_text(statistics.median(seeds))} '
                     f'[{k_text(min(seeds))} - {k_text(max(seeds))}] |')
    return lines


def ratio_lines(ratios, break_even):
    """The verdict table: each measured r beside its MoE's k*."""
    lines = ['', '## Where an MoE wins on time: r against k*', '',
             'r: cpu_dense_total\'s step time over the MoE\'s, one thread each, median and '
             'quartiles over rounds: bench.py\'s rounds, the models interleaved step by step '
             '(alone, side by side, paper width), or pairs of whole runs started together (whole '
             'runs). The MoE wins on time where r\'s quartiles lie above k*\'s 90% interval, '
             'loses where they lie below it; undecided where they overlap.', '',
             '| MoE | setting | machine | torch | rounds or pairs | r: median [q1-q3] | k* [90%] | '
             'on time |',
             '|---|---|---|---|---|---|---|---|']
    for row in ratios:
        entry = break_even.get(break_even_name(row['config'], break_even))
        k_star = '-'
        if entry is not None:
            low, high = entry['interval']
            k_star = f'{k_text(entry["k_star"])} [{k_text(low)}-{k_text(high)}]'
        lines.append(f'| {row["config"]} | {row["setting"]} | {row["hardware"]} | '
                     f'{row["torch"]} | {len(row["rounds"])} | {row["median"]:.3f} '
                     f'[{row["q1"]:.3f}-{row["q3"]:.3f}] | {k_star} | {row["verdict"] or "-"} |')
    return lines


def fastest_text(entry):
    """The fastest logged training intervals of an MoE and its dense_total, as a check on the
    step times bench.py measured."""
    moe = entry['budgets']['tokens']['fastest_step_ms']
    dense = entry['fastest_step_ms']
    if not moe or not dense:
        return ''
    return (f'The fastest logged training intervals: {moe:.1f} and {dense:.1f} ms '
            f'({dense / moe:.3f}x).')


def budget_cells(b):
    """tokens | epochs | training FLOPs | training time, for a row of the budget table."""
    epochs = '-' if b['epochs'] is None else f'{b["epochs"]:.2f}'
    return (f'{b["tokens"] / 1e6:.2f}M | {epochs} | {b["flops"]:.3g} | '
            f'{b["train_seconds"]:.0f} s')


def end_text(b):
    """Seeds whose best evaluation is their last, and the mean rise of the last over the best."""
    return f'{b["best_is_last"]} of {b["n"]} (+{b["rise_after_best"]:.4f})'


def routing_lines(diagnostics):
    lines = [
        '', '## Routing at the best checkpoint', '',
        'Mean over MoE layers, on the validation set; mean ± std over seeds. busiest_frac is the '
        'largest expert share (1/n_experts = perfect balance, 1.0 = collapsed); router_entropy in '
        'nats; load is the share of assignments per expert.', '',
        '| config | ' + ' | '.join(ROUTING) + ' | load |',
        '|---|' + '---|' * (len(ROUTING) + 1),
    ]
    for name, d in diagnostics.items():
        stats = ' | '.join(mean_pm_std(d[k]['mean'], d[k]['std']) for k in ROUTING)
        load = ', '.join(f'{e["mean"]:.3f}' for e in d['load'])
        lines.append(f'| {name} | ' + stats + ' | ' + load + ' |')
    return lines


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
                     f'{per_seed} | {vs_dense_text(d["vs_dense_total"])} | '
                     f'{vs_dense_text(d["vs_dense_active"])} |')
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
    if summary['diagnostics']:
        lines += routing_lines(summary['diagnostics'])
    if summary['scan']:
        lines += scan_lines(summary['scan'])
    if summary['variants']:
        lines += variant_lines(summary['variants'], summary['variant_curves'])
    if summary['compute']:
        lines += compute_lines(summary['compute'])
        lines += break_even_lines(summary['break_even'])
    if summary['step_time_ratio']:
        lines += ratio_lines(summary['step_time_ratio'], summary['break_even'])
    if plots:
        lines += ['', '## Plots', ''] + [f'![{p}]({p})' for p in plots]
    if warnings:
        lines += ['', '## Missing or incomplete', ''] + [f'- {w}' for w in warnings]
    return '\n'.join(lines) + '\n'


# ----------------------------------------------------------------------------- plots
def plot(summary, runs, out_dir):
    """PNG files next to report.md: val loss vs tokens, both gaps vs tokens, expert load over
    training."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    written = []
    for family, fam in summary['families'].items():
        tag = family.rstrip('_') or 'paper'
        written.append(plot_val_loss(plt, fam, runs, out_dir, tag, 'tokens'))
        written.append(plot_val_loss(plt, fam, runs, out_dir, tag, 'flops'))
        if fam['gap_vs_tokens']['tokens']:
            written.append(plot_gaps(plt, fam['gap_vs_tokens'], out_dir, tag))
    if summary['scan']:
        written.append(plot_scan(plt, summary['scan'], out_dir))
    if summary['variants']:
        written.append(plot_variant_routing(plt, summary['variant_curves'], out_dir))
    if summary['diagnostics']:
        written.append(plot_expert_load(plt, list(summary['diagnostics']), runs, out_dir))
    for name, entry in summary['compute'].items():
        written.append(plot_budgets(plt, name, entry, runs, out_dir))
    if summary['compute']:
        written.append(plot_who_wins(plt, summary['compute'], out_dir))
    if any(summary['break_even'].values()):
        written.append(plot_break_even(plt, summary['break_even'], summary['step_time_ratio'],
                                       out_dir))
    return written


# how the break-even plot draws each setting's step-time ratio r; sparse dots for any other
RATIO_LINESTYLES = {'alone': ':', 'side_by_side': '--', 'whole_runs': '-.'}
OTHER_RATIO_LINESTYLE = (0, (1, 4))


def ratios_with_k_star(ratios, names):
    """(name, row) for each step-time ratio measured for an MoE whose k* goes by a name among
    names: a ratio with no k* has nothing to be set against on the plot (the table keeps it)."""
    pairs = []
    for row in ratios:
        name = break_even_name(row['config'], names)
        if name is not None:
            pairs.append((name, row))
    return pairs


def plot_break_even(plt, break_even, ratios, out_dir):
    """Each MoE's gap to its dense_total against k: the seed mean as a line with its standard
    error as a band, each seed as a dot, k*'s 90% interval as a bar on the zero line, and each
    step-time ratio r measured for an MoE with a k* as a vertical line in its MoE's colour, a line
    style per setting (its quartiles shaded)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {}
    measured = {name: b for name, b in break_even.items() if b}
    for i, (name, b) in enumerate(measured.items()):
        colors[name] = f'C{i}'
        ks = [g['k'] for g in b['per_k']]
        means = [g['mean'] for g in b['per_k']]
        se = [g['std'] / math.sqrt(g['n']) for g in b['per_k']]
        ax.plot(ks, means, '-o', color=colors[name], ms=4,
                label=f'{name}: k* {k_text(b["k_star"])}')
        ax.fill_between(ks, [m - e for m, e in zip(means, se)],
                        [m + e for m, e in zip(means, se)], color=colors[name], alpha=0.2)
        for g in b['per_k']:
            ax.plot([g['k']] * len(g['per_seed']), list(g['per_seed'].values()), '.',
                    color=colors[name], ms=3)
        ax.plot(interval_within_trained(b), [0, 0], color=colors[name], lw=5, alpha=0.5)
    styles = {}  # setting -> line style, in the order the settings first appear
    for name, row in ratios_with_k_star(ratios, colors):
        style = RATIO_LINESTYLES.get(row['setting'], OTHER_RATIO_LINESTYLE)
        styles[row['setting']] = style
        ax.axvline(row['median'], color=colors[name], ls=style, lw=1.2)
        ax.axvspan(row['q1'], row['q3'], color=colors[name], alpha=0.08)
    # one legend entry per setting: the colour already says which MoE an r belongs to
    for setting, style in styles.items():
        ax.plot([], [], color='gray', ls=style, lw=1.2, label=f'r, {setting}')
    ax.axhline(0, color='gray', lw=0.8)
    ax.set(xlabel='k: the MoE\'s training tokens / dense_total\'s',
           ylabel='MoE - dense_total, best val loss',
           title='Break-even: the MoE wins on time where r > k*')
    ax.legend(fontsize=7)
    return save(fig, out_dir, 'break_even.png')


def plot_budgets(plt, name, entry, runs, out_dir):
    """An MoE's runs at each budget and their dense_total, validation loss against training
    FLOPs (mean over seeds)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines = [(entry['dense_total'], entry['dense_total'])]
    for budget, b in entry['budgets'].items():
        run_name = name if budget == 'tokens' else f'{budget}_{name}'
        lines.append((run_name, f'{name}, {budget_label(budget, b)}'))
    for run_name, label in lines:
        points, curves = trained_val_curves(runs[run_name], 'flops')
        ax.plot(points, pointwise_mean(curves), label=f'{label} ({len(runs[run_name])} seeds)')
    low = min(line.get_ydata().min() for line in ax.get_lines())
    ax.set_ylim(top=1.5 * low)  # early losses would squash the interesting end
    ax.set(xlabel='training FLOPs', ylabel='validation loss',
           title=f'{name} at equal tokens, FLOPs and time against {entry["dense_total"]}')
    ax.legend()
    return save(fig, out_dir, f'{name}_budgets.png')


def plot_who_wins(plt, compute, out_dir):
    """Each MoE's difference from its dense_total at each budget: the seed mean as a bar, the
    standard error as its whisker, each seed as a dot."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / len(compute)
    for i, (name, entry) in enumerate(compute.items()):
        for j, budget in enumerate(BUDGETS):
            g = entry['budgets'].get(budget, {}).get('vs_dense_total', NO_GAP)
            if not g['n']:
                continue
            x = j + (i - (len(compute) - 1) / 2) * width
            ax.bar(x, g['mean'], width, yerr=g['se'], color=f'C{i}', capsize=3,
                   label=name if j == 0 else None)
            ax.plot([x] * g['n'], list(g['per_seed'].values()), 'k.', ms=3)
    ax.axhline(0, color='gray', lw=0.8)
    ax.set_xticks(range(len(BUDGETS)), [BUDGET_LABELS[b] for b in BUDGETS])
    ax.set(ylabel='MoE - dense_total, best val loss',
           title='Who wins under which budget (below 0: the MoE)')
    ax.legend()
    return save(fig, out_dir, 'who_wins.png')


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
        ax.plot(points, pointwise_mean(curves), label=f'{name} ({len(curves)} seeds)')
        low = [min(v) for v in zip(*curves)]
        high = [max(v) for v in zip(*curves)]
        ax.fill_between(points, low, high, alpha=0.25)
    xlabel = 'training FLOPs' if x == 'flops' else 'training tokens'
    ax.set(xlabel=xlabel, ylabel='validation loss',
           title=f'{tag}: validation loss (band: min-max over seeds)')
    low = min((line.get_ydata().min() for line in ax.get_lines()), default=None)
    # early losses would squash the interesting end
    if low is not None and math.isfinite(low):
        ax.set_ylim(top=min(ax.get_ylim()[1], 1.5 * low))
    ax.legend()
    suffix = '_flops' if x == 'flops' else ''
    return save(fig, out_dir, f'{tag}_val_loss{suffix}.png')


def plot_gaps(plt, curve, out_dir, tag):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for gap, label in GAP_LABELS.items():
        if curve[gap]:
            ax.plot(curve['tokens'], curve[gap], marker='o', label=f'{gap} gap: {label}')
    ax.axhline(0, color='gray', lw=0.8)
    ax.set(xlabel='training tokens', ylabel='val loss difference',
           title=f'{tag}: gaps over training (mean over seeds)')
    ax.legend()
    return save(fig, out_dir, f'{tag}_gaps.png')


def plot_scan(plt, points, out_dir):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for gap, label in GAP_LABELS.items():
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
    return save(fig, out_dir, 'scan_gaps.png')


def plot_variant_routing(plt, variant_curves, out_dir):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key in zip(axes, ('busiest_frac', 'log_z')):
        for name, c in variant_curves[key].items():
            ax.plot(c['tokens'], c['mean'], marker='.', label=name)
        ax.set(xlabel='training tokens', ylabel=key,
               title=f'{key} on the validation set (mean over seeds)')
        ax.legend(fontsize=8)
    return save(fig, out_dir, 'variants_routing.png')


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


def read_bench_folder(folder):
    """{MoE config: its step times} from the <config>.txt files that make compute writes."""
    paths = glob.glob(os.path.join(folder, '*.txt'))
    if not paths:
        raise UserError(f'no bench.py outputs (<config>.txt) in {folder}; give the folder make '
                        'compute writes them to, e.g. --bench results/cpu/compute/bench')
    return {os.path.basename(p)[:-len('.txt')]: bench.read_step_times(p) for p in paths}


def read_ratio_folder(folder):
    """make ratio's rows, from <folder>/<setting>/<MoE config>.txt: what measured each, and
    dense_total's step time over the MoE's over the rounds (median, q1, q3, rounds)."""
    paths = sorted(glob.glob(os.path.join(folder, '*', '*.txt')))
    if not paths:
        raise UserError(f'no bench.py outputs (<setting>/<config>.txt) in {folder}; make them '
                        'with: make ratio')
    rows = []
    for path in paths:
        setting = os.path.basename(os.path.dirname(path))
        config = os.path.basename(path)[:-len('.txt')]
        result = bench.read_result(path)
        if 'dense_total_over_moe_rounds' not in result:
            raise UserError(f'{path} has no step-time ratio per round (a bench.py older than '
                            'its rounds); measure it again with: make ratio')
        rows.append({'config': config, 'setting': setting, 'hardware': result.get('hardware'),
                     'torch': result.get('torch'), **result['dense_total_over_moe_rounds']})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('runs', nargs='+', help='run folders or globs (e.g. out/cpu_*)')
    p.add_argument('--out', default='.', help='folder for report.md, report.json and the plots')
    p.add_argument('--bench', help='a folder of bench.py outputs, <MoE config>.txt, whose step '
                   'times set the equal-time budgets (make compute)')
    p.add_argument('--ratio', help='a folder of make ratio\'s step-time ratios, '
                   '<setting>/<MoE config>.txt, to set against k*')
    args = p.parse_args(argv)
    warnings = []
    # a pattern that matches nothing stands for itself (a folder named as given, or a warning)
    paths = sorted({path for pattern in args.runs for path in (glob.glob(pattern) or [pattern])})
    runs = load_runs([p for p in paths if os.path.isdir(p)], warnings.append)
    warnings += [f'skipped {p}: not a folder' for p in paths if not os.path.isdir(p)]
    if not runs:
        raise UserError('no runs found in ' + ' '.join(args.runs) + '; give run folders (each '
                        'with a config.json and a log.jsonl) or globs that match them')
    os.makedirs(args.out, exist_ok=True)
    step_times = read_bench_folder(args.bench) if args.bench else None
    ratios = read_ratio_folder(args.ratio) if args.ratio else ()
    summary = summarise(runs, warnings.append, step_times, ratios)
    plots = plot(summary, runs, args.out)
    text = markdown(summary, runs, warnings, plots)
    with open(os.path.join(args.out, 'report.md'), 'w') as f:
        f.write(text)
    with open(os.path.join(args.out, 'report.json'), 'w') as f:
        json.dump(finite_or_none(summary), f, indent=2)
    print(text)


if __name__ == '__main__':
    with one_line_errors('report.py'):
        main(sys.argv[1:])
