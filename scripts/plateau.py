"""What the routers do while a run sits on the early plateau (training CE near 3.0, the unigram loss): per run, the
logged training lines up to --until steps, with CE and the router's health on that step's batch (mean over layers).

    python scripts/plateau.py results/cpu/runs/cpu_moe-s* [--until 300] [--out results/cpu/plateau.md]

busiest_frac 0.5 with top-2 of 4 experts means one expert gets every token; router_entropy near ln 4 = 1.386 a
router that is still uniform over experts per token. Each run's exit step is the first logged step with CE < 2.5
(as scripts/seed_noise.py counts it).
"""
import argparse
import json
import os
import sys

KEYS = ('ce', 'busiest_frac', 'router_entropy', 'log_z')


def read(run_dir, until):
    """-> (run name, [training lines up to `until`], exit step or None)."""
    try:
        lines = [json.loads(line) for line in open(os.path.join(run_dir, 'log.jsonl'))]
    except (OSError, ValueError) as e:
        sys.exit(f'plateau.py: cannot read {run_dir}/log.jsonl ({e})')
    train = [r for r in lines if 'ce' in r]
    exit_step = next((r['iter'] for r in train if r['ce'] < 2.5), None)
    return os.path.basename(os.path.normpath(run_dir)), [r for r in train if r['iter'] <= until], exit_step


def table(runs):
    """Markdown: one row per run and key, one column per logged step."""
    steps = sorted({r['iter'] for _, lines, _ in runs for r in lines})
    out = ['| run | exit | value | ' + ' | '.join(map(str, steps)) + ' |', '|---|---|---|' + '---|' * len(steps)]
    for name, lines, exit_step in runs:
        at = {r['iter']: r for r in lines}
        for key in KEYS:
            if any(key in r for r in lines):
                cells = [f'{at[s][key]:.2f}' if s in at and key in at[s] else '' for s in steps]
                out.append(f'| {name} | {exit_step if exit_step is not None else "-"} | {key} | ' + ' | '.join(cells) + ' |')
    return '\n'.join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
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
    main()
