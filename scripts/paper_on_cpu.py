"""
The paper's configs as a GPU trains them, on a CPU: config/moe.py and config/dense_total.py through
train.py, compiled (torch.compile) in bf16 autocast, on GPT-2 tokens of TinyStories, for a few
steps of 4 windows. Each run's training loss must fall; the script says how long each run took,
its first step (with the compilation, from scratch: each run gets an empty compile cache) and its
later steps, on which CPU and how busy the CPU was (the load average before each run: other
processes may share it), and exits 1 if a loss did not fall.

    make paper_on_cpu   # GPT-2 tokens of the sample, then this -> results/bench/paper_on_cpu.txt
    python scripts/paper_on_cpu.py --data_dir data/tinystories_sample_gpt2 [--steps 8]

The last printed line is the results as JSON.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import plumbing  # noqa: E402
from plumbing import UserError  # noqa: E402

CONFIGS = ('moe', 'dense_total')
BATCH_SIZE = 4  # windows of 512 tokens per step


def train_one(name, args, work):
    """train.py on one paper config, compiled in bf16 -> its record: losses, times, load."""
    out_dir = os.path.join(work, name)
    cmd = [sys.executable, 'train.py', f'config/{name}.py', f'--data_dir={args.data_dir!r}',
           f'--out_dir={out_dir!r}', "--device='cpu'", '--compile=True', "--dtype='bfloat16'",
           f'--batch_size={BATCH_SIZE}', f'--max_iters={args.steps}',
           f'--eval_interval={args.steps}', '--log_interval=1', '--eval_tokens=4096']
    env = {**os.environ, 'TORCHINDUCTOR_CACHE_DIR': os.path.join(work, f'{name}_compile_cache')}
    load_before = os.getloadavg()[0]
    t0 = time.time()
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    wall = time.time() - t0
    if out.returncode != 0:  # a bug, not a user error: show what train.py printed
        raise SystemExit(f'train.py {name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}')
    lines = [json.loads(line) for line in open(os.path.join(out_dir, 'log.jsonl'))]
    steps = [r for r in lines if 'loss' in r]
    run_config = json.load(open(os.path.join(out_dir, 'config.json')))
    # each training line's seconds, from its throughput (evaluation is not counted in it)
    seconds = [run_config['tokens_per_iter'] / r['tok_per_s'] for r in steps]
    return {'params': run_config['params'], 'losses': [r['loss'] for r in steps],
            'first_step_s': seconds[0], 'later_step_s': statistics.median(seconds[1:]),
            'wall_s': wall, 'load_average_before': load_before,
            'compile_used': run_config['compile_used'], 'dtype_used': run_config['dtype_used']}


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--data_dir', required=True, help='GPT-2 tokens from prepare.py')
    p.add_argument('--steps', type=int, default=8, help='training steps per config (default 8)')
    args = p.parse_args(argv)
    if args.steps < 2:
        raise UserError(f'--steps must be at least 2 (a first step and a later one), got '
                        f'{args.steps}')
    args.data_dir = os.path.abspath(args.data_dir)
    result = {'cpu': plumbing.cpu_name(), 'cores': os.cpu_count(), 'torch': torch.__version__,
              'steps': args.steps, 'tokens_per_step': BATCH_SIZE * 512, 'configs': {}}
    with tempfile.TemporaryDirectory() as work:
        for name in CONFIGS:
            result['configs'][name] = train_one(name, args, work)
    print(f'the paper configs on a CPU, compiled, bf16: {args.steps} steps of {BATCH_SIZE} x 512 '
          f'GPT-2 tokens; {result["cpu"]}, {result["cores"]} cores, torch {result["torch"]}')
    print(f'{"config":<12} {"active/total M":>15} {"loss first -> last":>19} '
          f'{"first step s":>13} {"later s/step":>13} {"wall s":>7} {"load before":>12}')
    for name, r in result['configs'].items():
        sizes = f'{r["params"]["active"] / 1e6:.2f}/{r["params"]["total"] / 1e6:.2f}'
        losses = f'{r["losses"][0]:.3f} -> {r["losses"][-1]:.3f}'
        print(f'{name:<12} {sizes:>15} {losses:>19} {r["first_step_s"]:>13.1f} '
              f'{r["later_step_s"]:>13.1f} {r["wall_s"]:>7.0f} {r["load_average_before"]:>12.2f}')
    print(json.dumps(result))
    not_falling = [name for name, r in result['configs'].items()
                   if not r['losses'][-1] < r['losses'][0]]
    if not_falling:
        print(f'paper_on_cpu.py: the loss did not fall for {", ".join(not_falling)}',
              file=sys.stderr)
        sys.exit(1)


if __name__ == '__main__':
    with plumbing.one_line_errors('paper_on_cpu.py'):
        main(sys.argv[1:])
