"""r for whole runs: cpu_dense_total and an MoE trained side by side, started together, one thread
each (make ratio's pairs, out/pairs/<config>-s<seed>/{dense_total,moe}). Per pair, r is
dense_total's training time over the MoE's, from their logs (evaluation excluded, as report.py
counts it); over the pairs, its median and quartiles. Prints bench.py's form (a line, then the JSON
line), so that report.py --ratio reads it beside the step-time ratios.

    python -m study.pair_ratio out/pairs/cpu_moe-s1 out/pairs/cpu_moe-s2 out/pairs/cpu_moe-s3
"""
import json
import os
import statistics
import sys

import bench
import report
from errors import UserError, one_line_errors


def warn(message):
    """To stderr: stdout is the result file."""
    print(message, file=sys.stderr)


def step_ms(run_dir):
    """A finished run's training time per step in ms, and its config."""
    if not os.path.exists(os.path.join(run_dir, 'done.json')):
        raise UserError(f'{run_dir} is not a finished run; train the pair with: make ratio')
    with open(os.path.join(run_dir, 'config.json')) as f:
        config = json.load(f)
    with open(os.path.join(run_dir, 'log.jsonl')) as f:
        records = report.read_records(run_dir, f.read().splitlines(), warn)
    return 1e3 * report.train_seconds(records) / config['iters'], config


def pair_ratios(pairs):
    """bench.py's JSON fields for the pairs: the median step times, what trained them, and
    dense_total's step time over the MoE's per pair (median, q1, q3, rounds)."""
    ratios, moe_ms, dense_ms, machines = [], [], [], set()
    for pair in pairs:
        moe, config = step_ms(os.path.join(pair, 'moe'))
        dense, _ = step_ms(os.path.join(pair, 'dense_total'))
        ratios.append(dense / moe)
        moe_ms.append(moe)
        dense_ms.append(dense)
        machines.add((config.get('cpu'), config.get('torch')))
    if len(machines) > 1:
        raise UserError(f'the pairs ran on {len(machines)} machines or torch versions: '
                        f'{sorted(machines, key=str)}; give the pairs of one machine')
    return {'ms_per_step': {'moe': statistics.median(moe_ms),
                            'dense_total': statistics.median(dense_ms)},
            'hardware': config.get('cpu'), 'torch': config.get('torch'),
            'dense_total_over_moe_rounds': bench.spread(ratios)}


def main(argv):
    if not argv:
        raise UserError('give the pair folders, e.g. out/pairs/cpu_moe-s1 out/pairs/cpu_moe-s2')
    result = pair_ratios(argv)
    r = result['dense_total_over_moe_rounds']
    print(f'whole runs side by side, {len(argv)} pairs: dense_total / moe {r["median"]:.3f} '
          f'(quartiles {r["q1"]:.3f} to {r["q3"]:.3f})')
    print(json.dumps(result))


if __name__ == '__main__':
    with one_line_errors('pair_ratio.py'):
        main(sys.argv[1:])
