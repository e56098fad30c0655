"""The tokens an MoE trains for to cost what cpu_dense_total costs at the recipe's token budget: in
training FLOPs, or in time on this machine (from bench.py's step times, measured with the configs in
one process, one thread, interleaved). Prints one integer, the --max_tokens for train.py.

    python -m study.compute_budget flops config/cpu_moe.py
    python -m study.compute_budget time config/cpu_moe.py results/cpu/compute/bench/cpu_moe.txt
    python -m study.compute_budget tokens time_cpu_moe   # what make compute trains: below

A bench file is what `OMP_NUM_THREADS=1 python bench.py CONFIG` printed: its last line is JSON with
ms_per_step for moe (the config) and dense_total (matched to the config's total params). The budget
is the recipe's max_tokens times the ratio; train.py rounds each run up to whole steps, so the two
budgets agree to within one step.

`tokens NAME` (flops_<config> or time_<config>) reads the budget from BUDGETS, the tokens each of
make compute's budget runs was planned with. A budget not in it yet is planned now (time: from
BENCH/<config>.txt) and written in, so that a budget is planned once: a bench file measured again
later (step times move with the machine's load) does not change the tokens of runs already trained,
and make compute can retrain them exactly.
"""
import fcntl
import json
import os
import sys

import bench
import train
from errors import UserError, one_line_errors

DENSE_TOTAL = 'config/cpu_dense_total.py'
BUDGETS = 'results/cpu/compute/budgets.json'
BENCH = 'results/cpu/compute/bench'


def flops_ratio(config):
    """cpu_dense_total's training FLOPs per token over the config's."""
    dense = train.flops_per_token(train.configure([DENSE_TOTAL]))
    return dense / train.flops_per_token(train.configure([config]))


def time_ratio(bench_file):
    """dense_total's step time over the MoE's, from a bench.py output file."""
    ms = bench.read_step_times(bench_file)
    return ms['dense_total'] / ms['moe']


def plan(kind, config, bench_file=None):
    """The recipe's tokens times the ratio of the budget kind ('flops' or 'time')."""
    recipe_tokens = train.configure([config]).max_tokens
    if kind == 'flops':
        ratio = flops_ratio(config)
    else:
        ratio = time_ratio(bench_file)
    return round(recipe_tokens * ratio)


def read_budgets(path):
    """The planned budgets, {} before the first; a file that is not a JSON object is an error,
    not an empty plan: planning again from today's bench files is what the file prevents."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            budgets = json.load(f)
    except ValueError as e:
        raise UserError(f'{path} is not valid JSON ({e}); restore it from git: git checkout '
                        f'{path}') from None
    if not isinstance(budgets, dict):
        raise UserError(f'{path} is not a JSON object; restore it from git: git checkout {path}')
    return budgets


def config_file(name):
    """A config's file, as make finds it: config/<name>.py, else the study's own."""
    path = f'config/{name}.py'
    return path if os.path.exists(path) else f'study/config/{name}.py'


def planned_tokens(name, budgets=BUDGETS, bench_folder=BENCH):
    """The tokens of budget run `name` from the budgets file; planned and written in if absent.
    A lock file keeps two plans from writing at once (make -j2 may start two seeds of a new
    budget together); the file is replaced whole, never left half written."""
    kind, _, config = name.partition('_')
    if kind not in ('flops', 'time') or not config:
        raise UserError(f'{name} is not a budget run\'s name; give flops_<config> or '
                        'time_<config>, e.g. time_cpu_moe')
    with open(budgets + '.lock', 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        tokens = read_budgets(budgets)
        if name not in tokens:
            bench_file = os.path.join(bench_folder, f'{config}.txt')
            tokens[name] = plan(kind, config_file(config), bench_file)
            with open(budgets + '.tmp', 'w') as f:
                json.dump(dict(sorted(tokens.items())), f, indent=1)
                f.write('\n')
            os.replace(budgets + '.tmp', budgets)
    return tokens[name]


USAGE = ('usage: compute_budget.py flops CONFIG | time CONFIG BENCH_FILE | '
         'tokens NAME [BUDGETS [BENCH_FOLDER]]')


def main(argv):
    arity = {'flops': (2, 2), 'time': (3, 3), 'tokens': (2, 4)}
    if not argv or argv[0] not in arity:
        raise UserError(USAGE)
    least, most = arity[argv[0]]
    if not least <= len(argv) <= most:
        raise UserError(USAGE)
    if argv[0] == 'tokens':
        print(planned_tokens(*argv[1:]))
    else:
        print(plan(*argv))


if __name__ == '__main__':
    with one_line_errors('compute_budget.py'):
        main(sys.argv[1:])
