"""
Does tinymoe work on your CUDA GPU, and how fast? One command, under 10 minutes on an H100:

    make gpu_check                     # installs, prepares the data (the hub), then runs this
    TINYSTORIES=FILE make gpu_check    # the stories from a local file in the release format
    python gpu_check.py --size=toy     # the same check at toy sizes: a few minutes on a CPU

It writes out/gpu_check/report.md and report.json, a line per part: passed, failed (why) or
skipped (why). Each process's console goes to out/gpu_check/logs/, its run to out/gpu_check/runs/
(both emptied first: the check trains from scratch). It exits 1 if a part failed.

  tests       python -m pytest -m gpu tests: the GPU's own kernels against the CPU's
  cpu_recipe  the CPU recipe's three configs, seeds 1-3, on the GPU in fp32 and in bf16, eager as
              the committed CPU runs trained: each best val loss beside theirs
  paper       the paper's configs on GPT-2 tokens, compiled, bf16, 200 steps: the loss falls, a
              run stopped halfway and resumed ends as the straight run, sample.py writes text,
              and transformers' model of export_hf.py's export gives our logits
  speed       bench.py on the paper's configs, compiled: tokens/s, MFU, the MoE's step-time ratios

tests, cpu_recipe and paper run side by side, each train.py a process of its own (small models
leave a GPU mostly idle); speed runs last, alone on the GPU, as timing wants. The toy size (smaller
models, fewer steps, one seed) is what make test runs on the CPU (tests/test_gpu_check.py): its
CPU recipe meets the committed runs at iter 0 alone, a dry run of the full size's comparison.
"""
import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import torch

import bench
import hardware
import runs
import sample
import train
from errors import UserError, one_line_errors

REPO = os.path.dirname(os.path.abspath(__file__))
PARTS = ('tests', 'cpu_recipe', 'paper', 'speed')
CPU_CONFIGS = ('cpu_moe', 'cpu_dense_active', 'cpu_dense_total')
PAPER_CONFIGS = ('moe', 'dense_active', 'dense_total')
# the paper's models shrunk for the toy size; ffn_multiple_of 1 lets dense_active match the MoE
TOY_WIDTH = ['--d_model=32', '--n_head=2', '--moe_hidden=32', '--ffn_multiple_of=1',
             '--block_size=64', '--batch_size=4']
# A size is all that differs between the check on a GPU and its toy run on a CPU
SIZES = {
    'full': {'seeds': (1, 2, 3),
             'cpu_recipe': [],  # the recipe as committed: 1,120 steps
             # each step's 128 windows in 4 micro-batches of 32: the same step in a quarter of the
             # memory, so that four runs fit on one GPU side by side; 64 validation windows, in
             # batches of 32 like the training ones (one shape to compile)
             'paper': ['--batch_size=32', '--grad_accum=4', '--eval_tokens=32768'],
             'paper_steps': 200,
             'bench': ['--steps=10', '--rounds=3']},
    'toy': {'seeds': (1,),
            'cpu_recipe': ['--max_iters=4', '--eval_interval=2', '--log_interval=2',
                           '--eval_tokens=1024'],
            'paper': [*TOY_WIDTH, '--grad_accum=2', '--eval_tokens=512'],
            'paper_steps': 8,
            'bench': [*TOY_WIDTH, '--steps=2', '--rounds=1']},
}
# The CPU recipe on the GPU against the committed CPU runs: the mean best val loss over the seeds,
# relative to the CPU's. Another machine sums in another order (a GPU's fp32 matmuls use TF32),
# and after a few hundred steps a run goes where another seed might: the committed seeds spread
# by 0.8% (std 0.010 at 1.20), so a mean of three lands within 0.65% (1 std) of another, and 2%
# is 3 std. bf16 rounds every matmul's inputs to 8 bits too: 3%. A wrong kernel moves far more
TOLERANCE = {'float32': 0.02, 'bfloat16': 0.03}
# the committed runs' data, checked first: cpu_moe seed 1's val loss at iter 0 (its initial
# weights on this data, as train.py computes it on the CPU). Another CPU or thread count moves it
# by rounding alone, if at all; other stories move it by far more
SAME_START = 1e-4
# A resumed run recompiles its kernels, which may round otherwise: after the stop its lines may
# differ from the straight run's by NOISE_FACTOR times what the stopped run's did before it (bf16
# compiled kernels need not be bit-reproducible, and runs drift apart as they train), plus
# RESUME_TOLERANCE. A resume that lost the optimizer's state or the data order moves far more
NOISE_FACTOR, RESUME_TOLERANCE = 3, 1e-3
# transformers' model of the export, fp32 on the CPU, against ours: the same sums in another
# order, about 1e-6 of the largest logit; a misplaced weight moves them by whole percents
PARITY_TOLERANCE = 1e-4


def result(status, why, **details):
    return {'status': status, 'why': why, **details}


def attempt(part):
    """part(), or failed with its error, so the other parts still report (traceback: console)."""
    try:
        return part()
    except Exception as e:
        traceback.print_exc()
        return result('failed', f'{type(e).__name__}: {e}')


def read_log(run_dir):
    with open(os.path.join(run_dir, 'log.jsonl')) as f:
        return [json.loads(line) for line in f]


def read_config(run_dir):
    """config.json: the config a run trained with, and what train.py found (its iters, ...)."""
    with open(os.path.join(run_dir, 'config.json')) as f:
        return json.load(f)


def not_finished(run_dir):
    """Why run_dir holds no finished run with a best val loss, or None: read as report.py does, from
    config and log (the committed runs hold no done.json), finished if its last eval is its end."""
    for name in ('config.json', 'log.jsonl'):
        if not os.path.isfile(os.path.join(run_dir, name)):
            return f'{run_dir} holds no {name}'
    evals = [r for r in read_log(run_dir) if 'val_loss' in r]
    if not any(math.isfinite(r['val_loss']) for r in evals):
        return f'{run_dir} has no finite val loss'
    iters = read_config(run_dir)['iters']
    if evals[-1]['iter'] != iters:
        return (f'{run_dir} has not finished: its last evaluation is at iter '
                f'{evals[-1]["iter"]} of {iters}')
    return None


def val_losses(run_dir):
    """{iter: val loss} of a run's finite evaluations (a diverged one is never the best)."""
    return {r['iter']: r['val_loss'] for r in read_log(run_dir)
            if 'val_loss' in r and math.isfinite(r['val_loss'])}


def best_val(run_dir, iters):
    """A run's best val loss over its evaluations at `iters`."""
    return min(v for it, v in val_losses(run_dir).items() if it in iters)


# ----------------------------------------------------------------------------- the processes
def run_job(job, logs, env):
    """A job's commands one after the other, from the repository, their console into
    logs/<name>.txt. -> (name, return code of the last one run, seconds)."""
    name, commands = job
    t0 = time.time()
    with open(os.path.join(logs, f'{name}.txt'), 'w') as log:
        for cmd in commands:
            returncode = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                        env=env).returncode
            if returncode:
                break
    print(f'  {name}: {"ok" if returncode == 0 else "FAILED"} ({time.time() - t0:.0f} s)',
          flush=True)
    return name, returncode, time.time() - t0


def cpu_recipe_argv(config, seed, dtype, size, data, out_dir):
    """train.py's arguments for one run of the CPU recipe, eager as the committed runs were."""
    return [f'config/{config}.py', f'--seed={seed}', f'--dtype={dtype!r}', '--compile=False',
            f'--data_dir={data!r}', f'--out_dir={out_dir!r}', *SIZES[size]['cpu_recipe']]


def paper_argv(config, size, data, vocab_size, out_dir):
    """train.py's arguments for a paper config on GPT-2 tokens, compiled, bf16: paper_steps steps
    with four evaluations, a tenth of them warmup and latest.pt halfway (where a run stops)."""
    steps = SIZES[size]['paper_steps']
    return [f'config/{config}.py', "--dtype='bfloat16'", '--compile=True', f'--data_dir={data!r}',
            f'--out_dir={out_dir!r}', f'--vocab_size={vocab_size}', f'--max_iters={steps}',
            f'--warmup_iters={steps // 10}', f'--eval_interval={steps // 4}',
            f'--log_interval={max(1, steps // 20)}', f'--ckpt_interval={steps // 2}',
            *SIZES[size]['paper']]


def cpu_runs(size):
    """The CPU recipe's runs, seed by seed: {name: (dtype, config, seed)}."""
    return {f'{dtype}_{config}-s{seed}': (dtype, config, seed) for seed in SIZES[size]['seeds']
            for dtype in TOLERANCE for config in CPU_CONFIGS}


def jobs(args, vocab_size, start_problem):
    """The check's processes, the longest first: [(name, [command, ...])]."""
    py, work, steps = sys.executable, args.work, SIZES[args.size]['paper_steps']
    todo = []
    if 'tests' in args.parts:
        todo.append(('tests', [[py, '-m', 'pytest', '-q', '-m', 'gpu', 'tests']]))
    if 'paper' in args.parts:
        for config in PAPER_CONFIGS:
            argv = paper_argv(config, args.size, args.paper_data, vocab_size, f'{work}/{config}')
            todo.append((config, [[py, 'train.py', *argv]]))
        # moe stopped after half its steps, as a Ctrl-C would stop it, then resumed
        argv = paper_argv('moe', args.size, args.paper_data, vocab_size, f'{work}/moe_resumed')
        todo.append(('moe_resumed', [[py, 'tests/train_until.py', str(steps // 2), *argv],
                                     [py, 'train.py', *argv, '--resume=True']]))
    if 'cpu_recipe' in args.parts and not start_problem:
        for name, (dtype, config, seed) in cpu_runs(args.size).items():
            argv = cpu_recipe_argv(config, seed, dtype, args.size, args.cpu_data, f'{work}/{name}')
            todo.append((name, [[py, 'train.py', *argv]]))
    return todo


# ----------------------------------------------------------------------------- tests
def gpu_tests(returncode, logs, on_gpu):
    """Part tests, from pytest's summary line."""
    with open(os.path.join(logs, 'tests.txt')) as f:
        summary = f.read().strip().splitlines()[-1]
    if returncode != 0:
        return result('failed', f'{summary} (logs/tests.txt)')
    if not on_gpu:
        return result('skipped', f'no CUDA GPU, so the GPU tests skip themselves: {summary}')
    return result('passed', summary)


# ----------------------------------------------------------------------------- cpu_recipe
def committed_run(reference, config, seed):
    """The committed CPU run of a config and seed: results/cpu/warmup/runs/w224_cpu_moe-s1 ..."""
    warmup = train.configure([f'config/{config}.py']).warmup_iters
    return os.path.join(reference, f'w{warmup}_{config}-s{seed}')


def start_problem(args):
    """Why the CPU recipe's runs here cannot be set beside the committed ones, or None: each of
    theirs must have finished, and the data must be theirs (SAME_START)."""
    unusable = [not_finished(committed_run(args.reference, config, seed))
                for config in CPU_CONFIGS for seed in SIZES[args.size]['seeds']]
    if any(unusable):
        return f'no committed run to compare with: {"; ".join(filter(None, unusable))}'
    c = train.configure(cpu_recipe_argv('cpu_moe', 1, 'float32', args.size, args.cpu_data, ''))
    _, windows = train.load_data(c)
    torch.manual_seed(c.seed)  # the initial weights, as train.build makes them
    here, _ = train.evaluate(train.Transformer(c), windows, c, torch.device('cpu'),
                             contextlib.nullcontext())
    there = read_log(committed_run(args.reference, 'cpu_moe', 1))[0]['val_loss']
    if abs(here - there) <= SAME_START:
        return None
    return (f'cpu_moe seed 1 starts at val loss {here:.4f} on {args.cpu_data} at size '
            f'{args.size}, the committed run at {there:.4f}: other stories (the committed runs '
            'used a lowercased copy of the first 5,510 train stories: TINYSTORIES=FILE)')


def cpu_recipe(args, done):
    """Part cpu_recipe: per config and precision, the mean best val loss over the seeds on this
    device against the committed runs' (TOLERANCE), which start_problem found finished."""
    seeds = SIZES[args.size]['seeds']
    failed = [name for name in cpu_runs(args.size) if done[name]]
    if failed:
        return result('failed', f'train.py failed: {", ".join(failed)} (logs/)')
    short = [not_finished(f'{args.work}/{name}') for name in cpu_runs(args.size)]
    if any(short):
        return result('failed', f'train.py ended, but {"; ".join(filter(None, short))}')
    dirs = {(config, seed): {'committed': committed_run(args.reference, config, seed),
                             **{dtype: f'{args.work}/{dtype}_{config}-s{seed}'
                                for dtype in TOLERANCE}}
            for config in CPU_CONFIGS for seed in seeds}
    lengths = {read_config(d)['iters'] for run in dirs.values() for d in run.values()}
    # runs as long as the committed ones are compared whole; shorter ones (the toy size's) at
    # iter 0, before training: the same model, data and evaluation on another machine
    shared = {0}
    if len(lengths) == 1:
        shared = set.intersection(*(set(val_losses(d)) for run in dirs.values()
                                    for d in run.values()))
    best = {key: {name: best_val(d, shared) for name, d in run.items()}
            for key, run in dirs.items()}
    gaps = {dtype: {config: statistics.mean(best[config, s][dtype] for s in seeds)
                    / statistics.mean(best[config, s]['committed'] for s in seeds) - 1
                    for config in CPU_CONFIGS} for dtype in TOLERANCE}
    over = [f'{dtype} {config} {gap:+.2%}' for dtype, by_config in gaps.items()
            for config, gap in by_config.items() if abs(gap) > TOLERANCE[dtype]]
    worst = {dtype: max(by_config.values(), key=abs) for dtype, by_config in gaps.items()}
    within = ', '.join(f'{dtype} within {worst[dtype]:+.2%} (allowed {TOLERANCE[dtype]:.0%})'
                       for dtype in TOLERANCE)
    compared = f'{len(shared)} evaluations' if len(shared) > 1 else 'iter 0'
    why = (f'mean best val loss over seeds {", ".join(map(str, seeds))} ({compared}) against the '
           f'committed CPU runs: {within}')
    table = [{'config': config, 'seed': seed, **values} for (config, seed), values in best.items()]
    if over:
        return result('failed', f'{why}; over: {", ".join(over)}', gaps=gaps, runs=table)
    return result('passed', why, gaps=gaps, runs=table)


# ----------------------------------------------------------------------------- paper
def trained(run_dir):
    """A paper run trained as asked, compiled and in bf16 (config.json says what it used), and
    its loss fell: the last training loss below the first, the best val loss below iter 0's."""
    used = read_config(run_dir)
    log = read_log(run_dir)
    losses = [r['loss'] for r in log if 'loss' in r]
    vals = [r['val_loss'] for r in log if 'val_loss' in r]
    how = f'{"compiled" if used["compile_used"] else "NOT compiled"} {used["dtype_used"]}'
    ok = (used['compile_used'] and used['dtype_used'] == 'bfloat16' and losses[-1] < losses[0]
          and min(vals) < vals[0])
    return ok, (f'{how}, loss {losses[0]:.2f} -> {losses[-1]:.2f}, val {vals[0]:.2f} -> '
                f'{min(vals):.2f}')


def resume_check(straight_dir, resumed_dir, stop, console):
    """The run stopped at `stop` and resumed against the straight run, line by line: its lines up
    to the stop set the noise floor (NOISE_FACTOR), the resumed process's must stay within it."""
    def lines(run_dir):
        return {(r['iter'], 'val_loss' in r): r.get('val_loss', r.get('loss'))
                for r in read_log(run_dir)}
    straight, resumed = lines(straight_dir), lines(resumed_dir)
    with open(console) as f:
        said = f.read()
    if f'resumed at iter {stop}' not in said or resumed.keys() != straight.keys():
        return False, f'did not resume at iter {stop} with every line of the straight run'
    diff = {key: abs(resumed[key] - straight[key]) for key in straight}
    # (iter, is an evaluation): the evaluation at the stop is the resumed process's first line
    noise = max(d for (it, is_eval), d in diff.items() if it < stop or (it == stop and not is_eval))
    after = max(d for (it, is_eval), d in diff.items() if it > stop or (it == stop and is_eval))
    allowed = NOISE_FACTOR * noise + RESUME_TOLERANCE
    return after <= allowed, (f'resumed at {stop}: after it within {after:.1e} of the straight '
                              f'run (allowed {allowed:.1e}, noise {noise:.1e})')


def sample_text(run_dir, logs, env):
    """sample.py from a run: it must continue the prompt."""
    prompt = 'once upon a time'
    _, returncode, _ = run_job(('sample', [[sys.executable, 'sample.py', '--out_dir', run_dir,
                                            '--start', prompt, '--num_samples', '1',
                                            '--max_new_tokens', '40']]), logs, env)
    with open(os.path.join(logs, 'sample.txt')) as f:
        text = ' '.join(f.read().split('\n---')[0].split())
    return returncode == 0 and text.startswith(prompt), f'sample.py: "{text[:60]}..."'


def export_parity(run_dir, hf_dir, logs, env):
    """A run's export_hf.py export in transformers against ours, fp32 on CPU (PARITY_TOLERANCE)."""
    _, returncode, _ = run_job(('export', [[sys.executable, 'export_hf.py', '--out_dir', run_dir,
                                            '--to', hf_dir]]), logs, env)
    if returncode:
        return False, 'export_hf.py failed (logs/export.txt)'
    import transformers  # a test dependency: make gpu_check installs it, as make test does
    ours, _ = sample.load_model(run_dir, 'cpu')
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    idx = torch.randint(0, ours.lm_head.out_features, (2, 64),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, hf_logits = ours(idx)[0], theirs(idx).logits
    diff = ((logits - hf_logits).abs().max() / logits.abs().max()).item()
    return diff <= PARITY_TOLERANCE, f'{type(theirs).__name__} logits within {diff:.1e} of ours'


def paper(args, done, env):
    """Part paper: each of its checks a (passed?, what it found) pair."""
    failed = [name for name in (*PAPER_CONFIGS, 'moe_resumed') if done[name]]
    if failed:
        return result('failed', f'train.py failed: {", ".join(failed)} (logs/)')
    work, logs, steps = args.work, args.logs, SIZES[args.size]['paper_steps']
    checks = {config: trained(f'{work}/{config}') for config in PAPER_CONFIGS}
    checks['resume'] = resume_check(f'{work}/moe', f'{work}/moe_resumed', steps // 2,
                                    f'{logs}/moe_resumed.txt')
    checks['sample'] = sample_text(f'{work}/moe', logs, env)
    checks['export'] = export_parity(f'{work}/moe', f'{work}/hf_moe', logs, env)
    found = {name: text for name, (_, text) in checks.items()}
    why = '; '.join(f'{name}: {text}' for name, text in found.items())
    bad = [name for name, (ok, _) in checks.items() if not ok]
    if bad:
        return result('failed', f'{", ".join(bad)} failed; {why}', checks=found)
    return result('passed', why, checks=found)


# ----------------------------------------------------------------------------- speed
def speed(args, vocab_size, env):
    """Part speed: bench.py on the paper's configs, compiled, on random tokens, from its JSON."""
    cmd = [sys.executable, 'bench.py', 'config/moe.py', '--compile=True', "--dtype='bfloat16'",
           f'--vocab_size={vocab_size}', *SIZES[args.size]['bench']]
    _, returncode, _ = run_job(('speed', [cmd]), args.logs, env)
    if returncode:
        return result('failed', 'bench.py failed (logs/speed.txt)')
    timed = bench.read_result(os.path.join(args.logs, 'speed.txt'))
    mfu = timed['mfu'] or {}
    rates = ', '.join(f'{name} {timed["tokens_per_s"][name]:,.0f} tokens/s'
                      + (f' (MFU {mfu[name]:.1%})' if mfu else '') for name in PAPER_CONFIGS)
    no_peak = '' if mfu else '; no MFU: hardware.PEAK_FLOPS has no peak for this device'
    return result('passed', f'{rates}; step time moe / dense_active '
                            f'{timed["moe_over_dense_active"]:.3f}, dense_total / moe '
                            f'{timed["dense_total_over_moe"]:.3f}{no_peak}', bench=timed)


# ----------------------------------------------------------------------------- the report
def write_report(args, report):
    """report.json, and report.md: a line per part, then the CPU recipe's runs seed by seed."""
    runs.save(os.path.join(args.out, 'report.json'), report)
    lines = [f'# tinymoe GPU check: {report["hardware"]}', '',
             f'torch {report["torch"]} (CUDA {report["cuda"]}), size {report["size"]}, '
             f'{report["seconds"] / 60:.1f} minutes', '']
    lines += [f'- {name}: {part["status"]}: {part["why"]}'
              for name, part in report['parts'].items()]
    recipe_runs = report['parts']['cpu_recipe'].get('runs')
    if recipe_runs:
        lines += ['', '| config | seed | committed CPU | fp32 here | bf16 here |',
                  '|---|---|---|---|---|']
        lines += [f'| {r["config"]} | {r["seed"]} | {r["committed"]:.4f} | {r["float32"]:.4f} | '
                  f'{r["bfloat16"]:.4f} |' for r in recipe_runs]
    with open(os.path.join(args.out, 'report.md'), 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument('--size', choices=SIZES, default='full',
                   help='full (default; needs a CUDA GPU) or toy: smaller models, fewer steps')
    p.add_argument('--parts', default=','.join(PARTS),
                   help=f'which parts to run, comma-separated (default all: {",".join(PARTS)})')
    p.add_argument('--cpu_data', default='data/tinystories_bytes',
                   help="the CPU recipe's bytes data (make gpu_check prepares it)")
    p.add_argument('--paper_data', default='data/tinystories_sample_gpt2',
                   help='GPT-2 tokens of the same stories (make gpu_check prepares them)')
    p.add_argument('--reference', default='results/cpu/warmup/runs',
                   help="the committed CPU runs the cpu_recipe part compares with")
    p.add_argument('--slots', type=int, default=os.cpu_count(), help='processes side by side '
                   '(default: one per CPU core); fewer on a GPU with little memory')
    p.add_argument('--out', default='out/gpu_check', help='the report, logs/ and runs/')
    args = p.parse_args(argv)
    args.parts = args.parts.split(',')
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        raise UserError(f'--parts: no part {unknown.pop()!r}; choose from {", ".join(PARTS)}')
    if args.size == 'full' and not torch.cuda.is_available():
        raise UserError('torch sees no CUDA GPU; on a CPU, check the logic at toy sizes: '
                        'python gpu_check.py --size=toy')
    for folder in (args.cpu_data, args.paper_data):
        if not os.path.isfile(os.path.join(folder, 'meta.json')):
            raise UserError(f'no data in {folder}: make gpu_check prepares it (TINYSTORIES=FILE '
                            'for a local TinyStories file, else from the Hugging Face hub)')
    # absolute: the processes run from the repository
    for key in ('cpu_data', 'paper_data', 'reference', 'out'):
        setattr(args, key, os.path.abspath(getattr(args, key)))
    args.work, args.logs = os.path.join(args.out, 'runs'), os.path.join(args.out, 'logs')
    return args


def main(argv):
    args = parse_args(argv)
    os.chdir(REPO)  # config/ and tests/ are named from here, as in the processes
    t0 = time.time()
    for folder in (args.work, args.logs):
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
    with open(os.path.join(args.paper_data, 'meta.json')) as f:
        vocab_size = json.load(f)['vocab_size']
    problem = start_problem(args) if 'cpu_recipe' in args.parts else None
    # one thread per process: a dozen and more processes share the CPU cores
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    todo = jobs(args, vocab_size, problem)
    print(f'gpu_check: {len(todo)} processes, {args.slots} at a time; their consoles: {args.logs}',
          flush=True)
    with ThreadPoolExecutor(max(1, min(args.slots, len(todo)))) as pool:
        ran = list(pool.map(lambda job: run_job(job, args.logs, env), todo))
    done = {name: returncode for name, returncode, _ in ran}
    checks = {'tests': lambda: gpu_tests(done['tests'], args.logs, torch.cuda.is_available()),
              'cpu_recipe': lambda: (result('skipped', problem) if problem
                                     else cpu_recipe(args, done)),
              'paper': lambda: paper(args, done, env),
              'speed': lambda: speed(args, vocab_size, env)}  # last, alone on the GPU
    parts = {name: attempt(checks[name]) if name in args.parts
             else result('skipped', 'not asked for (--parts)') for name in PARTS}
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    report = {'hardware': hardware.hardware_name(device), 'torch': torch.__version__,
              'cuda': torch.version.cuda, 'size': args.size, 'seconds': time.time() - t0,
              'parts': parts, 'processes': {name: {'returncode': returncode, 'seconds': seconds}
                                            for name, returncode, seconds in ran}}
    write_report(args, report)
    if any(part['status'] == 'failed' for part in parts.values()):
        sys.exit(1)


if __name__ == '__main__':
    with one_line_errors('gpu_check.py'):
        main(sys.argv[1:])
