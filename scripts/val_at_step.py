"""A config's val loss at one evaluation step, seed-paired against another config's best val loss:
how a longer run stood when it had seen a shorter budget's tokens.

    python scripts/val_at_step.py --iter 1400 results/cpu/compute/runs/time_cpu_moe-s* \
        --against results/cpu/compute/runs/cpu_dense_total-s*

The equal-time runs train for 1.31x the recipe's tokens (1,471 steps); their evaluation at step
1,400 is what they had at 1.25x, under a learning rate already near its floor, so a run planned for
1.25x would end no worse. Prints each seed's difference and their mean ± std [k of n < 0], t.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import report  # noqa: E402
from plumbing import UserError, one_line_errors  # noqa: E402


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


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('runs', nargs='+', help='run folders of one config')
    p.add_argument('--iter', type=int, required=True, help='the evaluation step to read')
    p.add_argument('--against', nargs='+', required=True,
                   help='run folders of the config whose best val loss is subtracted')
    args = p.parse_args(argv)
    runs = at_step(load(args.runs, 'runs'), args.iter)
    gap = report.paired(runs, load(args.against, '--against'))
    if gap is None:
        raise UserError('the two configs share no seed')
    for seed, value in gap['per_seed'].items():
        print(f'seed {seed}: {value:+.4f}')
    t = report.t_statistic(gap)
    t_text = '-' if t is None else f'{t:.1f}'
    print(f'at step {args.iter}: {report.vs_dense_text(gap)}, t {t_text}')
    return gap


if __name__ == '__main__':
    with one_line_errors('val_at_step.py'):
        main(sys.argv[1:])
