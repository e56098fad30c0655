"""The tokens an MoE trains for to cost what cpu_dense_total costs at the recipe's token budget: in
training FLOPs, or in time on this machine (from bench.py's step times, measured with the configs in
one process, one thread, interleaved). Prints one integer, the --max_tokens for train.py.

    python scripts/compute_budget.py flops config/cpu_moe.py
    python scripts/compute_budget.py time config/cpu_moe.py results/cpu/compute/bench/cpu_moe.txt

A bench file is what `OMP_NUM_THREADS=1 python bench.py CONFIG` printed: its last line is JSON with
ms_per_step for moe (the config) and dense_total (matched to the config's total params). The budget
is the recipe's max_tokens times the ratio; train.py rounds each run up to whole steps, so the two
budgets agree to within one step.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import train  # noqa: E402
from plumbing import UserError, one_line_errors  # noqa: E402

DENSE_TOTAL = 'config/cpu_dense_total.py'


def flops_ratio(config):
    """cpu_dense_total's training FLOPs per token over the config's."""
    dense = train.flops_per_token(train.configure([DENSE_TOTAL]))
    return dense / train.flops_per_token(train.configure([config]))


def time_ratio(bench_file):
    """dense_total's step time over the MoE's, from a bench.py output file."""
    ms = bench.read_step_times(bench_file)
    return ms['dense_total'] / ms['moe']


USAGE = 'usage: compute_budget.py flops CONFIG | time CONFIG BENCH_FILE'


def main(argv):
    if argv[:1] == ['flops'] and len(argv) != 2:
        raise UserError(USAGE)
    if argv[:1] == ['time'] and len(argv) != 3:
        raise UserError(USAGE)
    if argv[:1] not in (['flops'], ['time']):
        raise UserError(USAGE)
    recipe_tokens = train.configure([argv[1]]).max_tokens
    if argv[0] == 'flops':
        ratio = flops_ratio(argv[1])
    else:
        ratio = time_ratio(argv[2])
    print(round(recipe_tokens * ratio))


if __name__ == '__main__':
    with one_line_errors('compute_budget.py'):
        main(sys.argv[1:])
