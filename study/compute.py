"""
Who wins under which budget. A run's name says what it trained for: cpu_moe the recipe's tokens,
flops_cpu_moe its dense_total's training FLOPs, time_cpu_moe its dense_total's time on one machine
(study/compute_budget.py plans both), k1.2_w224_cpu_moe 1.2 times the recipe's tokens. Each budget
of an MoE against its dense_total, seed-paired; over an MoE's budgets, k*: the token multiplier at
which it matches dense_total; and each step-time ratio r that a machine measured (make ratio) set
against k*: the MoE wins on time where r > k*. study/report.py puts these into the study's
reports.
"""
import glob
import json
import math
import os
import random
import re
import statistics

import bench
import report
from errors import UserError

# a run named <budget>_<config> trains the config for another budget than the recipe's tokens:
# cpu_dense_total's training FLOPs, or its time (make compute, study/compute_budget.py)
BUDGETS = ('tokens', 'flops', 'time')
BUDGET_LABELS = {'tokens': 'equal tokens', 'flops': 'equal FLOPs', 'time': 'equal time'}
# resamples of the seeds behind break_even's 90% interval
BOOTSTRAP = 2000
# Student's t, 95th percentile, by degrees of freedom: a 90% two-sided t-interval
T_95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833,
        10: 1.812, 11: 1.796, 12: 1.782, 13: 1.771, 14: 1.761, 15: 1.753, 16: 1.746, 17: 1.740,
        18: 1.734, 19: 1.729, 20: 1.725, 21: 1.721, 22: 1.717, 23: 1.714, 24: 1.711, 25: 1.708,
        26: 1.706, 27: 1.703, 28: 1.701, 29: 1.699}


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
    """report.role_of, but a run trained for another budget than its config's (flops_cpu_moe,
    k1.2_cpu_moe) has none: compute_gaps compares it, in no family."""
    if budget_of(name)[0] != 'tokens':
        return None, None
    return report.role_of(name)


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


def data_epochs(config, tokens):
    """Epochs over the training split, from the run's data_dir when it is still there; else
    None."""
    try:
        with open(os.path.join(config['data_dir'], 'meta.json')) as f:
            train_tokens = json.load(f)['train_tokens']
    except (OSError, ValueError, KeyError):
        return None
    return tokens / train_tokens


def budget_summary(seeds):
    """A config's tokens, epochs, training FLOPs and training seconds (means over its seeds), and
    whether more of the data still helped at the end: the seeds whose best evaluation is their
    last, and the mean rise of the last evaluation over the best."""
    out = {key: report.mean_std([r[key] for r in seeds.values()])[0]
           for key in ('tokens', 'flops', 'train_seconds')}
    # each run's wall clock beside its FLOPs: what else ran on the machine shows here
    out['train_seconds_per_seed'] = {str(s): seeds[s]['train_seconds'] for s in sorted(seeds)}
    out['epochs'] = data_epochs(next(iter(seeds.values()))['config'], out['tokens'])
    out['n'] = len(seeds)
    out['best_is_last'] = sum(r['best']['iter'] == r['evals'][-1]['iter'] for r in seeds.values())
    rises = [r['last_val'] - r['best']['val_loss'] for r in seeds.values()]
    out['rise_after_best'] = report.mean_std(rises)[0]
    fastest = [r['fastest_step_ms'] for r in seeds.values() if r['fastest_step_ms']]
    out['fastest_step_ms'] = min(fastest, default=None)
    return out


def t_statistic(gap):
    """The paired t statistic, mean / standard error; None where it is undefined."""
    return gap['mean'] / gap['se'] if gap['se'] else None


def budget_entry(seeds, dense):
    """One budget of an MoE: its summary and its seed-paired gap to its dense_total."""
    gap = report.paired(seeds, dense) or report.NO_GAP
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


def t_interval(values):
    """The 90% t-interval of the mean of values; None if any is infinite or there are fewer than
    two, or more than T_95 covers."""
    if len(values) - 1 not in T_95 or not all(math.isfinite(v) for v in values):
        return None
    half = T_95[len(values) - 1] * statistics.stdev(values) / math.sqrt(len(values))
    return [statistics.mean(values) - half, statistics.mean(values) + half]


def break_even(entry, resamples=BOOTSTRAP):
    """k*: the token multiplier k (the MoE's tokens / its dense_total's, each run with its own
    schedule) at which the seed-mean gap to dense_total reaches 0; an MoE wins on time on a
    machine where dense_total's step takes more than k* times the MoE's. Over the seeds trained
    at every k: k*, each seed's own crossing, and two 90% intervals: one from resampling the seeds,
    the t-interval of the mean of their crossings (which is near k*, not k* itself). 'interval',
    which the verdicts use, spans both, a cautious range rather than a 90% interval of its own:
    with 5 seeds the resampled one alone can be narrower than the seeds' spread says. Without a
    t-interval (a seed that never crosses) it is the resampled one. None with fewer than two k's."""
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
    per_seed = {s: crossing(ks, [p[s] for p in per_k]) for s in seeds}
    t = t_interval(list(per_seed.values()))
    both = interval if t is None else [min(interval[0], t[0]), max(interval[1], t[1])]
    return {'k_star': mean_crossing(seeds), 'interval': both, 'bootstrap_interval': interval,
            't_interval': t, 'seeds': len(seeds), 'per_seed': per_seed, 'per_k': per_k_gaps}


def break_even_name(config, names):
    """The name an MoE config's k* goes by among names: its own or a warmup study's (cpu_moe ->
    w224_cpu_moe); None if neither is there."""
    return next((name for name in names
                 if name == config or re.fullmatch(rf'w\d+_{re.escape(config)}', name)), None)


def interval_within_trained(entry):
    """k*'s interval (spanning both 90% ones) for the plot, its ends cut to the trained k's: an
    end beyond them (+-inf) says only on which side k* lies."""
    ks = [g['k'] for g in entry['per_k']]
    return [min(max(k, ks[0]), ks[-1]) for k in entry['interval']]


def verdict(ratio, break_even_entry):
    """Where an MoE wins on time on the machine that measured a step-time ratio r: 'wins' if r's
    first quartile lies above k*'s interval (break_even's, spanning both 90% ones), 'loses' if its
    third quartile lies below it, else 'undecided'; None without a k*."""
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


def verdicts(ratios, break_even):
    """Each step-time ratio r with its verdict against its MoE's k*."""
    rows = []
    for row in ratios:
        entry = break_even.get(break_even_name(row['config'], break_even))
        rows.append({**row, 'verdict': verdict(row, entry)})
    return rows


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


# ----------------------------------------------------------------------------- report.md
def vs_dense_text(g):
    """A variant against a dense model: mean ± std [seeds where the variant is better]."""
    if not g['n']:
        return '-'
    better = sum(v < 0 for v in g['per_seed'].values())
    return f'{g["mean"]:+.4f} ± {g["std"]:.4f} [{better} of {g["n"]} < 0]'


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
             'between the trained k\'s. Where the gap falls ever more slowly with k, the line '
             'between two trained k\'s lies above it and k* leans high, against the MoE; each '
             'MoE\'s gaps below show whether it does. Two 90% intervals: one resamples the '
             f'seeds trained at every k ({BOOTSTRAP} times), one is the t-interval of the mean of '
             'their own k*\'s (centred on their mean, near k*); the verdicts below use the range '
             'from the lower of their lows to the higher of their highs, a cautious range rather '
             'than a 90% interval of its own (the resampled one alone where a seed never crosses). '
             'The MoE wins on time on a machine where dense_total\'s step takes more than k* times '
             'the MoE\'s (r > k*).',
             '', '| MoE | seeds | gap at each k | k* | 90%, resampled | 90%, t | each seed\'s k*: '
             'median [min-max] |', '|---|---|---|---|---|---|---|']
    for name, b in break_even.items():
        if b is None:
            continue
        gaps = ', '.join(f'{g["k"]:.3f}: {g["mean"]:+.4f}' for g in b['per_k'])
        seeds = b['per_seed'].values()
        low, high = b['bootstrap_interval']
        t = b['t_interval']
        t_text = f'{k_text(t[0])} - {k_text(t[1])}' if t else '-'
        lines.append(f'| {name} | {b["seeds"]} | {gaps} | {k_text(b["k_star"])} | '
                     f'{k_text(low)} - {k_text(high)} | {t_text} | '
                     f'{k_text(statistics.median(seeds))} '
                     f'[{k_text(min(seeds))} - {k_text(max(seeds))}] |')
    return lines


def ratio_lines(ratios, break_even):
    """The verdict table: each measured r beside its MoE's k*."""
    lines = ['', '## Where an MoE wins on time: r against k*', '',
             'r: cpu_dense_total\'s step time over the MoE\'s, one thread each, median and '
             'quartiles over rounds: bench.py\'s rounds, the models interleaved step by step '
             '(alone, side by side, paper width), or pairs of whole runs started together (whole '
             'runs). The MoE wins on time where r\'s quartiles lie above k*\'s 90% intervals, '
             'loses where they lie below them; undecided where they overlap either.', '',
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


# ----------------------------------------------------------------------------- plots
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
    error as a band, each seed as a dot, k*'s interval (spanning both 90% ones) as a bar on the
    zero line, and each step-time ratio r measured for an MoE with a k* as a vertical line in its
    MoE's colour, a line style per setting (its quartiles shaded)."""
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
    return report.save(fig, out_dir, 'break_even.png')


def plot_budgets(plt, name, entry, runs, out_dir):
    """An MoE's runs at each budget and their dense_total, validation loss against training
    FLOPs (mean over seeds)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines = [(entry['dense_total'], entry['dense_total'])]
    for budget, b in entry['budgets'].items():
        run_name = name if budget == 'tokens' else f'{budget}_{name}'
        lines.append((run_name, f'{name}, {budget_label(budget, b)}'))
    for run_name, label in lines:
        points, curves = report.trained_val_curves(runs[run_name], 'flops')
        ax.plot(points, report.pointwise_mean(curves),
                label=f'{label} ({len(runs[run_name])} seeds)')
    low = min(line.get_ydata().min() for line in ax.get_lines())
    ax.set_ylim(top=1.5 * low)  # early losses would squash the interesting end
    ax.set(xlabel='training FLOPs', ylabel='validation loss',
           title=f'{name} at equal tokens, FLOPs and time against {entry["dense_total"]}')
    ax.legend()
    return report.save(fig, out_dir, f'{name}_budgets.png')


def plot_who_wins(plt, compute, out_dir):
    """Each MoE's difference from its dense_total at each budget: the seed mean as a bar, the
    standard error as its whisker, each seed as a dot."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / len(compute)
    for i, (name, entry) in enumerate(compute.items()):
        for j, budget in enumerate(BUDGETS):
            g = entry['budgets'].get(budget, {}).get('vs_dense_total', report.NO_GAP)
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
    return report.save(fig, out_dir, 'who_wins.png')
