"""A config's val loss at one evaluation step, seed-paired against another config's best val loss:
how a longer run stood when it had seen a shorter budget's tokens.

    python -m study.val_at_step --iter 1400 results/cpu/compute/runs/time_cpu_moe-s* \
        --against results/cpu/compute/runs/cpu_dense_total-s*

This is an optimistic reading of what a run planned for the shorter budget would reach: at a
given step the longer run's learning rate is still higher, yet in the logs of make compute the run
planned shorter ended worse than the longer run at the same tokens in most pairs. --bias measures
that over every pair of runs of one MoE and seed planned for different budgets:

    python -m study.val_at_step --bias results/cpu/compute/runs/*

Prints each seed's difference and their mean ± std [k of n < 0], t (or, with --bias, each pair's
difference: the shorter run's best minus the longer run's val loss at the shorter's tokens, linear
between its evaluations either side, which leans high for a convex curve).
"""
import argparse
import sys

import report
from errors import UserError, one_line_errors
from study import compute


def load(paths, what):
    """{seed: run} of the one config in paths (report.load_runs' runs)."""
    runs = report.load_runs(paths, lambda message: print('note:', message))
    if len(runs) != 1:
        raise UserError(f'{what}: give the runs of one config (found {len(runs)}: '
                        f'{", ".join(sorted(runs)) or "none"})')
    return next(iter(runs.values()))


def at_step(seeds, step):
    """Each run as if its evaluation at `step` were its best (what report.paired compares)."""
    out = {}
    for seed, run in seeds.items():
        evals = {r['iter']: r for r in run['evals']}
        if step not in evals:
            raise UserError(f'{run["path"]} has no evaluation at step {step}; pick one of '
                            f'{sorted(evals)}')
        out[seed] = {**run, 'best': evals[step]}
    return out


def interpolated_val(run, tokens):
    """A run's val loss at `tokens`, linear between its evaluations either side; None outside."""
    evals = [(r['tokens'], r['val_loss']) for r in run['evals']]
    for (t0, v0), (t1, v1) in zip(evals, evals[1:]):
        if t0 <= tokens <= t1:
            return v0 + (v1 - v0) * (tokens - t0) / (t1 - t0)
    return None


def planning_bias(runs):
    """[(config, seed, shorter budget, longer budget, difference)]: for every two runs of one
    config and seed planned for different budgets (cpu_moe, time_cpu_moe, flops_cpu_moe), the
    shorter run's best val loss minus the longer run's val loss at the shorter run's tokens."""
    by_config = {}
    for name, seeds in runs.items():
        budget, config = compute.budget_of(name)
        for seed, run in seeds.items():
            by_config.setdefault((config, seed), []).append((run['tokens'], budget, run))
    pairs = []
    for (config, seed), planned in sorted(by_config.items()):
        planned.sort(key=lambda p: p[0])
        for i, (tokens, short, run) in enumerate(planned):
            for _, long, longer in planned[i + 1:]:
                diff = run['best']['val_loss'] - interpolated_val(longer, tokens)
                pairs.append((config, seed, short, long, diff))
    return pairs


def print_bias(paths):
    runs = report.load_runs(paths, lambda message: print('note:', message))
    pairs = planning_bias(runs)
    if not pairs:
        raise UserError('no config has runs planned for two budgets (e.g. cpu_moe and '
                        'time_cpu_moe of one seed) among the runs given')
    for config, seed, short, long, diff in pairs:
        print(f'{config} seed {seed}: planned for {short}, minus {long} at its tokens: '
              f'{diff:+.4f}')
    diffs = [p[-1] for p in pairs]
    mean, std = report.mean_std(diffs)
    worse = sum(d > 0 for d in diffs)
    print(f'the run planned shorter ended worse in {worse} of {len(diffs)} pairs: '
          f'{mean:+.4f} ± {std:.4f}')
    return pairs


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('runs', nargs='+', help='run folders of one config (with --bias: any runs)')
    p.add_argument('--iter', type=int, help='the evaluation step to read')
    p.add_argument('--against', nargs='+',
                   help='run folders of the config whose best val loss is subtracted')
    p.add_argument('--bias', action='store_true',
                   help='measure how a shorter plan ends against a longer run at its tokens')
    args = p.parse_args(argv)
    if args.bias:
        return print_bias(args.runs)
    if args.iter is None or not args.against:
        p.error('give --iter and --against (or --bias)')
    runs = at_step(load(args.runs, 'runs'), args.iter)
    gap = report.paired(runs, load(args.against, '--against'))
    if gap is None:
        raise UserError('the two configs share no seed')
    for seed, value in gap['per_seed'].items():
        print(f'seed {seed}: {value:+.4f}')
    t = compute.t_statistic(gap)
    t_text = '-' if t is None else f'{t:.1f}'
    print(f'at step {args.iter}: {compute.vs_dense_text(gap)}, t {t_text}')
    return gap


if __name__ == '__main__':
    with one_line_errors('val_at_step.py'):
        main(sys.argv[1:])
