"""Did a rerun reproduce a run? Compares two runs' log.jsonl line by line, every field but tok_per_s
(the one that depends on the wall clock), exactly: on CPU a run is deterministic, so the numbers
must be equal. A field that one log never has (a log written before train.py logged it, such as
flops) is left out, and named.

    python -m study.same_log out/cpu_moe-s1 results/cpu/warmup/runs/w224_cpu_moe-s1
    python -m study.same_log out/first/cpu_moe-s1 results/cpu/runs/cpu_moe-s1   # 2% warmup

Prints the first differences and how far the best val loss moved, and exits 1 if there are any,
else one line and exit 0.
"""
import json
import os
import sys


def read_log(run_dir):
    """The records of run_dir/log.jsonl, each without tok_per_s."""
    path = os.path.join(run_dir, 'log.jsonl')
    try:
        records = [json.loads(line) for line in open(path)]
    except (OSError, ValueError) as e:
        sys.exit(f'same_log.py: cannot read {path} ({e}); '
                 'give two run folders that hold a log.jsonl')
    return [{k: v for k, v in r.items() if k != 'tok_per_s'} for r in records]


def fields(log):
    """Every field any record of the log has."""
    return set().union(*(r.keys() for r in log))


def differences(log_a, log_b):
    """'line N: key a != b' for every field that differs, and one line if the logs differ in
    length. Only the fields both logs know are compared."""
    shared = fields(log_a) & fields(log_b)
    found = []
    for i, (a, b) in enumerate(zip(log_a, log_b)):
        for key in sorted((a.keys() | b.keys()) & shared):
            if a.get(key) != b.get(key):
                found.append(f'line {i + 1}: {key} {a.get(key)!r:.60} != {b.get(key)!r:.60}')
    if len(log_a) != len(log_b):
        found.append(f'{len(log_a)} lines != {len(log_b)} lines')
    return found


def best_val(log):
    """The last logged best_val: the run's best validation loss (None if it logged none)."""
    return next((r['best_val'] for r in reversed(log) if 'best_val' in r), None)


def main(argv):
    if len(argv) != 2:
        sys.exit('usage: python -m study.same_log RUN_DIR OTHER_RUN_DIR')
    log_a, log_b = read_log(argv[0]), read_log(argv[1])
    only_one = sorted(fields(log_a) ^ fields(log_b))
    if only_one:
        print(f'not compared, in one log only: {", ".join(only_one)}')
    found = differences(log_a, log_b)
    if found:
        print(f'{len(found)} differences, the first:', *found[:10], sep='\n  ')
        a, b = best_val(log_a), best_val(log_b)
        if a is not None and b is not None:
            print(f'best val loss: {a:.4f} -> {b:.4f} ({b - a:+.4f})')
        sys.exit(1)
    print(f'the same: {len(log_a)} log lines, every field but tok_per_s equal')


if __name__ == '__main__':
    main(sys.argv[1:])
