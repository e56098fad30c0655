"""What the routers do while a run sits on the early plateau (training CE near 3.0, the unigram
loss): per run, the logged training lines up to --until steps, with CE and the router's health on
that step's batch (mean over layers).

    python -m study.plateau results/cpu/runs/cpu_moe-s* [--until 300] [--out plateau.md]

busiest_frac 0.5 with top-2 of 4 experts means one expert gets every token; router_entropy near
ln 4 = 1.386 a router that is still uniform over experts per token. Each run's exit step is the
first logged step with CE < 2.5 (as study/seed_noise.py counts it).
"""
import argparse
import json
import os

from errors import UserError, one_line_errors

KEYS = ('ce', 'busiest_frac', 'router_entropy', 'log_z')
EXIT_CE = 2.5
# Three decimals: readers compare these values with thresholds (CE with 2.5, busiest_frac with
# 0.40), and two decimals would show a busiest_frac of 0.399 as 0.40.
DIGITS = 3


def read(run_dir, until):
    """-> (run name, [training lines up to `until`], exit step or None)."""
    path = os.path.join(run_dir, 'log.jsonl')
    try:
        with open(path) as f:
            lines = [json.loads(line) for line in f]
    except (OSError, ValueError) as e:
        raise UserError(f'cannot read {path} ({e}); give run folders that hold a log.jsonl')
    train = [r for r in lines if 'ce' in r]
    exit_step = next((r['iter'] for r in train if r['ce'] < EXIT_CE), None)
    shown = [r for r in train if r['iter'] <= until]
    name = os.path.basename(os.path.normpath(run_dir))
    return name, shown, exit_step


def cell(line, key):
    """One table cell: the value of `key` on this logged line, or blank if it has none."""
    if line is None or key not in line:
        return ''
    return f'{line[key]:.{DIGITS}f}'


def table(runs):
    """Markdown: one row per run and key, one column per logged step."""
    steps = sorted({r['iter'] for _, lines, _ in runs for r in lines})
    header = '| run | exit | value | ' + ' | '.join(map(str, steps)) + ' |'
    rule = '|---|---|---|' + '---|' * len(steps)
    out = [header, rule]
    for name, lines, exit_step in runs:
        at = {r['iter']: r for r in lines}
        exit_text = '-' if exit_step is None else str(exit_step)
        for key in KEYS:
            if not any(key in r for r in lines):
                continue
            cells = [cell(at.get(s), key) for s in steps]
            out.append(f'| {name} | {exit_text} | {key} | ' + ' | '.join(cells) + ' |')
    return '\n'.join(out)


def main(argv=None):
    # the docstring's first paragraph; argparse rewraps it
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('runs', nargs='+', help='run folders holding a log.jsonl')
    p.add_argument('--until', type=int, default=300, help='last step shown')
    p.add_argument('--out', help='also write the table to this markdown file')
    args = p.parse_args(argv)
    text = table([read(run, args.until) for run in args.runs])
    print(text)
    if args.out:
        with open(args.out, 'w') as f:
            f.write(text + '\n')


if __name__ == '__main__':
    with one_line_errors('plateau.py'):
        main()
