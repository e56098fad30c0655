"""
The real-text GPU check: the project on one GPU with the committed study's data, in one command
of under 6.5 minutes. Where the data is, scripts/gpu_carry.sh puts what it needs into gpu_carry/;
on the GPU machine, bash scripts/gpu_real_text.sh OUT runs this script under a hard time limit.
It writes five JSON files into --out, each rewritten as its part goes on:

  real_text.json        1. the CPU recipe on the GPU: cpu_moe, cpu_dense_active, cpu_dense_total,
                           seeds 1-5 in order, fp32 and bf16, --slots train.py processes side by
                           side; each seed's best val loss next to the committed CPU run's
                           (results/cpu/warmup/runs: the recipe's warmup), a paired t; the runs
                           killed or never started
  paper_real_text.json  2. the paper configs on GPT-2 tokens of the same stories, compiled, bf16,
                           100 steps: the losses; moe stopped halfway and resumed, against a
                           straight run; sample.py; export_hf.py and transformers' logits
  summary.json          3. python -m pytest -m gpu tests: passed, failed, skipped (under parts);
                           and the machine, the packages, the time plan, each part's time and error
  profile.json          4. where an eager step's time goes, moe and dense_active (gpu_profile.py)
  nanogpt.json          5. nanoGPT's model at our shapes beside dense_active: MFU by two rules

Everything else goes into --logs: each process's console, a copy of each run's log.jsonl,
pytest's and sample.py's output. gpu_real_text.sh packs that folder into OUT/logs.tar.gz, since
the GPU tool returns at most 8 files (OUT: the five JSON files, console.txt, logs.tar.gz). Run
folders and checkpoints (250 MB each for the paper runs) go to --work.

The time plan, in seconds from the start, with --budget_s (default 330):
  0 to budget - 145   parts 1, 2 and 3 side by side: part 1's train.py processes, part 2's (from a
                      thread) and pytest share the GPU, and what still runs at the end is killed.
                      Part 1 goes seed by seed, so whole seeds finish first, and starts no run in
                      its last 45 s
  to budget - 50      part 5: dense_active and nanoGPT compiled, then moe if time is left
  to budget           part 4: the eager profiles, moe then dense_active
Parts 5 and 4 time steps, so they come last, on an otherwise idle GPU, the compiled timings first;
each starts a model only if the seconds it needs are left. Each part runs in its own try: a failure
is recorded and the next part runs.

The GPU session that runs it has 15 minutes of device time, the machine's start-up (1-2 minutes)
included (results/bench/README.md). Call 1: bash scripts/gpu_real_text.sh "$OUT" with carry
["gpu_carry"] and timeout_s 390 (budget 330 s, the .sh's hard limit 370 s, then the packing);
call 2, at once while the machine is warm: scripts/gpu_levers.py (its docstring); then give the
machine back.

    bash scripts/gpu_real_text.sh OUT               # on a CUDA GPU, with gpu_carry/ in place
    python scripts/gpu_real_text.py --out OUT --tiny --cpu_data DIR --paper_data DIR   # CPU, toy
"""
import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections import namedtuple

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, 'scripts')]
import gpu_profile  # noqa: E402
import plumbing  # noqa: E402
import report  # noqa: E402
import train  # noqa: E402
from plumbing import UserError  # noqa: E402

CARRY = os.path.join(REPO, 'gpu_carry')
CPU_CONFIGS = ('cpu_moe', 'cpu_dense_active', 'cpu_dense_total')
PAPER_CONFIGS = ('moe', 'dense_active', 'dense_total')
DTYPES = ('float32', 'bfloat16')
# the committed CPU study's data: prepare.py --input tinystories_train_head.txt --tokenizer bytes
COMMITTED_DATA = {'train_tokens': 4003496, 'val_tokens': 187689}
# --tiny: a few steps of each CPU-recipe run, and a small validation set
TINY_CPU = ['--max_iters=4', '--eval_interval=2', '--log_interval=2', '--ckpt_interval=4',
            '--eval_tokens=1024']
# --tiny: the paper configs at toy width; ffn_multiple_of 1 lets dense_active match the MoE
TINY_PAPER = ['--d_model=32', '--n_head=2', '--moe_hidden=32', '--ffn_multiple_of=1',
              '--block_size=64', '--batch_size=4', '--eval_tokens=512']
# The time plan (the module docstring): seconds kept at the end of --budget_s for part 5 (two or
# three compiles; results/gpu/gpu_check.json's runs compiled dense_active and moe in about 30 and
# 45 s) and for part 4 (two eager models, profiled). Parts 1, 2 and 3 get the rest
PART5_S, PART4_S = 95, 50
# part 1 starts no run this close to its end: a run is 1,120 eager steps of a tiny model, about
# 20 s alone (an estimate) and longer beside the others (real_text.json has each run's seconds)
PART1_LAST_START_S = 45
# part 5 starts a model only with COMPILED_MODEL_S left before its end (a compile and 20 timed
# steps), part 4 only with EAGER_MODEL_S (a few eager steps and their profile)
COMPILED_MODEL_S, EAGER_MODEL_S = 40, 20
# the resumed run evaluates the stopped run's last weights (latest.pt) again, in a new process
# that may pick other kernel configurations: the same val loss up to the order of some sums
SAME_WEIGHTS_TOLERANCE = 1e-4
# after the stop, the resumed run's lines may differ from the straight run's up to this many
# times as much as the stopped run's lines did before it: two runs that were never stopped drift
# apart by themselves (bf16 compiled kernels are not bit-reproducible), more as training goes on
NOISE_FACTOR = 3
# transformers' model of an export, in fp32 on the CPU, against ours: relative to the largest logit
PARITY_TOLERANCE = 1e-4
# two-sided 5% critical values of Student's t by degrees of freedom (paired seeds - 1)
T_CRITICAL_5PCT = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365,
                   8: 2.306, 9: 2.262}
# part 2's thread and the main thread both record their parts in summary.json
SUMMARY_LOCK = threading.Lock()

Job = namedtuple('Job', 'name cmd')


# ----------------------------------------------------------------------------- small helpers
def save(args, name, obj):
    plumbing.save(os.path.join(args.out, name), obj)


def elapsed(args):
    return time.time() - args.t_start


def seconds_until(deadline):
    """A subprocess's timeout that ends it at deadline (at least 5 s, to start at all)."""
    return max(5.0, deadline - time.time())


def describe(error):
    """An error as one line for the JSON; printed as one line if the user can fix it (a missing
    file), else with its traceback."""
    if isinstance(error, UserError):
        print(f'gpu_real_text.py: error: {error}', flush=True)
    else:
        traceback.print_exc()
    return f'{type(error).__name__}: {error}'


def attempt(fn, *fn_args):
    """fn(*fn_args), or {'error': ...} if it raised: one failed piece leaves the others' results."""
    try:
        return fn(*fn_args)
    except Exception as e:
        return {'error': describe(e)}


def read_log(path):
    """A run's log.jsonl records; a torn last line (a killed run, expected here) is skipped
    without a word."""
    with open(path) as lines:
        return report.read_records(path, lines, warn=lambda message: None)


def keep_log(args, run_log, name):
    """A copy of a run's log.jsonl in --logs/runs/ (the run folders stay in --work)."""
    if os.path.isfile(run_log):
        path = os.path.join(args.logs, 'runs', name + '.jsonl')
        os.makedirs(os.path.dirname(path), exist_ok=True)
        shutil.copy(run_log, path)


def read_meta(data_dir):
    path = os.path.join(data_dir, 'meta.json')
    if not os.path.isfile(path):
        raise UserError(f'{path} not found; make gpu_carry/ first: bash scripts/gpu_carry.sh')
    return json.load(open(path))


def package_versions():
    """What the GPU machine has of the packages the check may use (None: not installed)."""
    versions = {}
    for name in ('numpy', 'tqdm', 'tiktoken', 'safetensors', 'tokenizers', 'transformers',
                 'pytest', 'triton'):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


# ----------------------------------------------------------------------------- processes
def start(cmd, log_path, env):
    """cmd in the background from the repository, stdout and stderr into log_path."""
    with open(log_path, 'w') as log:
        return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)


def stop(proc):
    """Kills proc if it still runs, and reaps it."""
    proc.kill()
    proc.wait()


def finish(proc, kill_at):
    """proc's return code, or None if it was still running at kill_at and had to be killed."""
    try:
        return proc.wait(timeout=max(0.0, kill_at - time.time()))
    except subprocess.TimeoutExpired:
        stop(proc)
        return None


def log_path(args, name):
    return os.path.join(args.logs, name.replace('/', '_') + '.txt')


def log_tail(args, name, lines=6):
    """The last lines a job printed: why it failed."""
    return open(log_path(args, name)).read().strip().splitlines()[-lines:]


def run_jobs(args, jobs, slots, launch_until, kill_at, on_end):
    """Runs jobs in order, at most `slots` at a time (several train.py processes share the GPU);
    starts none after launch_until and kills any still running at kill_at. Calls on_end(job,
    returncode, seconds) as each ends; returncode None: killed. -> the jobs never started."""
    waiting, running = list(jobs), {}
    try:
        while running or (waiting and time.time() < launch_until):
            while waiting and len(running) < slots and time.time() < launch_until:
                job = waiting.pop(0)
                running[job.name] = (job, start(job.cmd, log_path(args, job.name), args.env),
                                     time.time())
            for name, (job, proc, t0) in list(running.items()):
                if proc.poll() is None and time.time() < kill_at:
                    continue
                returncode = finish(proc, kill_at)
                del running[name]
                print(f'{elapsed(args):5.0f} s  {name}: return code {returncode}, '
                      f'{time.time() - t0:.0f} s', flush=True)
                on_end(job, returncode, time.time() - t0)
            time.sleep(0.5)
    finally:  # an error above must not leave train.py processes running
        for _, proc, _ in running.values():
            stop(proc)
    for job in waiting:
        print(f'{elapsed(args):5.0f} s  {job.name}: not started, out of time', flush=True)
    return waiting


# ----------------------------------------------------------------------------- part 1
def cpu_recipe_jobs(args):
    """Part 1's train.py runs, seed by seed: stopped early, every config and precision keeps its
    first seeds, and the seeds that finish are whole."""
    jobs = []
    for seed in args.seeds:
        for dtype in DTYPES:
            for config in CPU_CONFIGS:
                name = f'{dtype}/{config}-s{seed}'
                argv = [f'config/{config}.py', f'--seed={seed}', f'--device={args.device!r}',
                        f'--dtype={dtype!r}', '--compile=False',
                        f'--data_dir={args.cpu_data!r}',
                        f'--out_dir={os.path.join(args.work, name)!r}']
                jobs.append(Job(name, [sys.executable, 'train.py', *argv,
                                       *(TINY_CPU if args.tiny else [])]))
    return jobs


def best_val(run_dir):
    """The lowest finite val_loss in run_dir/log.jsonl, or None."""
    path = os.path.join(run_dir, 'log.jsonl')
    if not os.path.isfile(path):
        return None
    losses = [r['val_loss'] for r in read_log(path) if math.isfinite(r.get('val_loss', math.nan))]
    return min(losses, default=None)


def finished_best_val(run_dir):
    """best_val of a run that finished (done.json); None for one killed or never started."""
    return best_val(run_dir) if os.path.isfile(os.path.join(run_dir, 'done.json')) else None


def mean_std(values):
    if not values:
        return None
    std = statistics.stdev(values) if len(values) > 1 else None
    return {'mean': statistics.mean(values), 'std': std, 'n': len(values)}


def compare(gpu, cpu):
    """{seed: best val loss} on the GPU and on the CPU -> each seed's pair and, over the seeds
    with both: the means, the difference of the means, a paired t (the mean per-seed difference
    over its standard error) with its degrees of freedom and two-sided 5% critical value, and
    within_seed_spread (|difference| < the CPU seeds' sample std over the same seeds: a loose
    check, since the std of a few values is itself noisy; cpu.n says how few)."""
    seeds = [s for s in gpu if gpu[s] is not None and cpu.get(s) is not None]
    result = {'seeds': {s: {'gpu': gpu[s], 'cpu': cpu.get(s)} for s in gpu},
              'paired_seeds': len(seeds)}
    if len(seeds) < 2:
        return result
    on_gpu, on_cpu = [gpu[s] for s in seeds], [cpu[s] for s in seeds]
    differences = [g - c for g, c in zip(on_gpu, on_cpu)]
    diff = statistics.mean(differences)  # = the difference of the means
    cpu_std, diff_std = statistics.stdev(on_cpu), statistics.stdev(differences)
    t = diff / (diff_std / math.sqrt(len(seeds))) if diff_std else None
    df = len(seeds) - 1
    critical = T_CRITICAL_5PCT.get(df)
    significant = abs(t) > critical if t is not None and critical is not None else None
    return {**result, 'gpu': mean_std(on_gpu), 'cpu': mean_std(on_cpu), 'diff_of_means': diff,
            'within_seed_spread': abs(diff) < cpu_std, 'paired_t': t, 't_df': df,
            't_critical_5pct': critical, 'significant_at_5pct': significant}


def gaps(best):
    """{config: {seed: best val}} -> the study's seed-paired gaps over the seeds that have all
    three configs: active = dense_active - moe, total = moe - dense_total."""
    moe, active, total = (best[c] for c in CPU_CONFIGS)
    seeds = [s for s in moe if None not in (moe[s], active.get(s), total.get(s))]
    return {'seeds': seeds, 'active_gap': mean_std([active[s] - moe[s] for s in seeds]),
            'total_gap': mean_std([moe[s] - total[s] for s in seeds])}


def check_cpu_data(args):
    """The CPU recipe's data must be the committed runs' data, or the comparison means nothing."""
    meta = read_meta(args.cpu_data)
    same = all(meta.get(key) == value for key, value in COMMITTED_DATA.items())
    if not same and not args.tiny:
        raise UserError(f'{args.cpu_data} has {meta.get("train_tokens")} / '
                        f'{meta.get("val_tokens")} train / val tokens, not the committed runs\' '
                        f'{COMMITTED_DATA}; remake it: bash scripts/gpu_carry.sh')
    return {'dir': args.cpu_data, 'train_tokens': meta.get('train_tokens'),
            'val_tokens': meta.get('val_tokens'), 'same_as_committed_runs': same}


def committed_cpu_run(config, seed):
    """The committed CPU run of a config under the recipe's warmup: make warmup's w<steps>_ runs."""
    warmup = train.configure([f'config/{config}.py']).warmup_iters
    return os.path.join(REPO, 'results', 'cpu', 'warmup', 'runs', f'w{warmup}_{config}-s{seed}')


def cpu_recipe_on_gpu(args):
    """Part 1 -> real_text.json, rewritten as each run ends."""
    on_cpu = {config: {s: best_val(committed_cpu_run(config, s)) for s in args.seeds}
              for config in CPU_CONFIGS}
    result = {
        'device': args.device, 'hardware': args.hardware, 'torch': torch.__version__,
        'tiny': args.tiny, 'seeds': args.seeds, 'slots': args.slots, 'compile': False,
        'compile_why': 'the committed CPU runs were eager, so eager on the GPU changes only '
                       'the device and the precision; compiling would also cost each of the 30 '
                       'processes tens of seconds',
        'data': check_cpu_data(args),
        'float32_note': 'fp32 weights and activations; on CUDA train.py lets matmuls use TF32 '
                        '(plumbing.setup_device), as the CPU does not',
        'spread_rule': 'over the seeds with a finished GPU run and a committed CPU run (n). '
                       'paired_t: the mean of the per-seed differences over its standard error, '
                       'with t_df = n - 1 degrees of freedom; |t| > t_critical_5pct is a '
                       'difference at the 5% level (two-sided). within_seed_spread: |GPU mean - '
                       'CPU mean| < the sample std of the CPU best val losses over the same '
                       'seeds, a loose check: with n of 2 to 5 that std is itself noisy',
        'committed_runs_missing': [f'{config}-s{s}' for config in CPU_CONFIGS
                                   for s in args.seeds if on_cpu[config][s] is None],
        'runs': {}, 'not_started': []}
    save(args, 'real_text.json', result)

    def on_end(job, returncode, seconds):
        result['runs'][job.name] = {'returncode': returncode, 'seconds': seconds}
        if returncode != 0:
            result['runs'][job.name]['error'] = log_tail(args, job.name)
        keep_log(args, os.path.join(args.work, job.name, 'log.jsonl'), job.name)
        on_gpu = {dtype: {config: {s: finished_best_val(os.path.join(args.work, dtype,
                                                                    f'{config}-s{s}'))
                                   for s in args.seeds} for config in CPU_CONFIGS}
                  for dtype in DTYPES}
        result['compare'] = {dtype: {config: compare(on_gpu[dtype][config], on_cpu[config])
                                     for config in CPU_CONFIGS} for dtype in DTYPES}
        result['gaps'] = {'cpu': gaps(on_cpu), **{dtype: gaps(on_gpu[dtype]) for dtype in DTYPES}}
        save(args, 'real_text.json', result)
    not_started = run_jobs(args, cpu_recipe_jobs(args), args.slots,
                           args.side_by_side_end - PART1_LAST_START_S, args.side_by_side_end,
                           on_end)
    result['not_started'] = [job.name for job in not_started]
    save(args, 'real_text.json', result)


# ----------------------------------------------------------------------------- part 2
def paper_argv(args, name, out_dir, vocab_size):
    """train.py arguments of a paper config on the GPT-2 data: the recipe as it is, but
    --paper_steps steps with four evaluations and a checkpoint halfway. Each step's 128 sequences
    go in four micro-batches of 32: the same step, a quarter of the activation memory, so that
    the runs fit on the GPU side by side. 64 validation windows of the split's 91: evaluation
    batches of 32 like the training ones, so torch.compile sees one batch shape."""
    n = args.paper_steps
    argv = [f'config/{name}.py', '--seed=1', f'--device={args.device!r}', "--dtype='bfloat16'",
            f'--compile={not args.tiny}', f'--data_dir={args.paper_data!r}',
            f'--out_dir={out_dir!r}', f'--vocab_size={vocab_size}', '--batch_size=32',
            '--grad_accum=4', f'--max_iters={n}', f'--eval_interval={n // 4}',
            f'--log_interval={args.log_interval}', f'--ckpt_interval={n // 2}',
            '--eval_tokens=32768']
    return argv + (TINY_PAPER if args.tiny else [])


def loss_summary(run_dir, steps):
    """A paper run's losses. That the training loss falls is a sanity check only: from 10.8 at
    iter 0 any working run's does. The runs see the ~1M-token split several times (epochs in
    paper_real_text.json), so the val losses say whether they overfit by the end: the last one
    against the lowest and against the one halfway."""
    log = read_log(os.path.join(run_dir, 'log.jsonl'))
    lines = [r for r in log if 'loss' in r]
    vals = {r['iter']: r['val_loss'] for r in log if 'val_loss' in r}
    best, last, halfway = min(vals, key=vals.get), max(vals), vals.get(steps // 2)
    config = json.load(open(os.path.join(run_dir, 'config.json')))
    return {'first_loss': lines[0]['loss'], 'last_loss': lines[-1]['loss'],
            'loss_falls': lines[-1]['loss'] < lines[0]['loss'],
            'val_losses': [[it, val] for it, val in vals.items()],
            'best_val': [best, vals[best]], 'last_val_minus_best': vals[last] - vals[best],
            'last_val_minus_halfway': vals[last] - halfway if halfway is not None else None,
            # the first line holds the compilation; the GPU was shared with the other runs
            'median_tok_per_s': statistics.median(r['tok_per_s'] for r in lines[1:] or lines),
            'compile_used': config['compile_used'], 'dtype_used': config['dtype_used'],
            'finished': os.path.isfile(os.path.join(run_dir, 'done.json'))}


def log_values(path):
    """{(iter, is an eval line): the line's loss} of a log.jsonl."""
    return {(r['iter'], 'val_loss' in r): r.get('val_loss', r.get('loss')) for r in read_log(path)}


def resume_check(straight_log, stopped_log, resumed_log, stop, console):
    """The run stopped at `stop` and resumed, against the straight run of the same seed (their
    log.jsonl; stopped_log copied before the resume rewrote it from `stop` on):
    - does it resume at `stop`, and does its evaluation there, of the stopped run's last weights
      (latest.pt), give the stopped run's val loss within SAME_WEIGHTS_TOLERANCE?
    - noise_floor: the largest difference between the stopped run's lines and the straight run's,
      up to the stop: two runs that were never stopped. Are the resumed run's lines after the stop
      within NOISE_FACTOR times that of the straight run's (plus SAME_WEIGHTS_TOLERANCE)?"""
    found = re.search(r'resumed at iter (\d+)', open(console).read())
    resumed_at = int(found.group(1)) if found else None
    straight, stopped, resumed = (log_values(p) for p in (straight_log, stopped_log, resumed_log))
    at_stop = (stop, True)  # the evaluation at the stop: the stopped run's last line
    same_weights = (abs(resumed[at_stop] - stopped[at_stop])
                    if at_stop in resumed and at_stop in stopped else None)
    noise = max((abs(stopped[k] - straight[k]) for k in stopped if k in straight), default=None)
    after = [abs(resumed[k] - straight[k]) for k in straight if k[0] > stop and k in resumed]
    expected = sum(1 for k in straight if k[0] > stop)
    allowed = NOISE_FACTOR * noise + SAME_WEIGHTS_TOLERANCE if noise is not None else None
    return {'stopped_at': stop, 'resumed_at': resumed_at, 'same_step': resumed_at == stop,
            'val_at_stop_diff': same_weights, 'same_weights_tolerance': SAME_WEIGHTS_TOLERANCE,
            'noise_floor': noise, 'lines_after': len(after), 'lines_expected_after': expected,
            'max_abs_diff_after': max(after, default=None), 'allowed_after': allowed,
            'close': (resumed_at == stop and same_weights is not None
                      and same_weights <= SAME_WEIGHTS_TOLERANCE
                      and len(after) == expected > 0 and max(after) <= allowed)}


def sample_story(args, run_dir):
    """sample.py from a paper run: a few tokens on the GPU (GPT-2 needs tiktoken's files)."""
    out = subprocess.run([sys.executable, 'sample.py', '--out_dir', run_dir, '--start',
                          'once upon a time', '--num_samples', '1', '--max_new_tokens', '40',
                          '--device', args.device],
                         cwd=REPO, env=args.env, capture_output=True, text=True,
                         timeout=seconds_until(args.side_by_side_end))
    with open(os.path.join(args.logs, 'sample.txt'), 'w') as f:
        f.write(out.stdout + out.stderr)
    return {'returncode': out.returncode, 'text': out.stdout[-1500:],
            'stderr': out.stderr[-1500:]}


def logits_parity(run_dir, hf_dir):
    """Our best.pt and transformers' model of its export, fp32 on the CPU, on the same tokens."""
    import transformers
    ckpt = plumbing.load_checkpoint(os.path.join(run_dir, 'best.pt'))
    c = types.SimpleNamespace(**{**train.DEFAULTS, **ckpt['config']})
    ours = train.Transformer(c)
    ours.load_state_dict(ckpt['model'])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    idx = torch.randint(0, c.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, hf_logits = ours.eval()(idx)[0], theirs.eval()(idx).logits
    diff = ((logits - hf_logits).abs().max() / logits.abs().max()).item()
    return {'transformers': transformers.__version__, 'hf_class': type(theirs).__name__,
            'max_logit_diff_relative': diff, 'parity_tolerance': PARITY_TOLERANCE,
            'parity_ok': diff <= PARITY_TOLERANCE}


def export_and_compare(args, run_dir):
    """export_hf.py of a paper run, then transformers' logits against ours (skipped, and said so,
    where transformers is not installed). The export's return code and output stay in the
    result whatever the comparison does."""
    hf_dir = os.path.join(args.work, 'hf_moe')
    out = subprocess.run([sys.executable, 'export_hf.py', '--out_dir', run_dir, '--to', hf_dir],
                         cwd=REPO, env=args.env, capture_output=True, text=True,
                         timeout=seconds_until(args.side_by_side_end))
    result = {'returncode': out.returncode, 'output': (out.stdout + out.stderr)[-1500:]}
    if out.returncode != 0:
        return result
    if importlib.util.find_spec('transformers') is None:
        return {**result, 'parity': 'skipped: transformers is not installed'}
    return {**result, **attempt(logits_parity, run_dir, hf_dir)}


def paper_configs(args):
    """Part 2 -> paper_real_text.json, rewritten as each piece ends. It runs in a thread beside
    part 1, and kills what still runs at the end of their shared time."""
    meta = read_meta(args.paper_data)
    if meta.get('tokenizer') != 'gpt2' and not args.tiny:
        raise UserError(f'{args.paper_data} holds {meta.get("tokenizer")} tokens, not GPT-2 '
                        'ones; remake it: bash scripts/gpu_carry.sh')
    n, kill_at = args.paper_steps, args.side_by_side_end
    run_dir = {name: os.path.join(args.work, 'paper', name)
               for name in (*PAPER_CONFIGS, 'moe_resumed')}
    argv = {name: paper_argv(args, name, run_dir[name], meta['vocab_size'])
            for name in PAPER_CONFIGS}
    # the run stopped halfway and resumed: moe's arguments, another out_dir
    resumed_argv = paper_argv(args, 'moe', run_dir['moe_resumed'], meta['vocab_size'])
    stopped_log = os.path.join(args.work, 'paper', 'moe_stopped.jsonl')
    c = train.configure(argv['moe'])
    tokens_per_step = c.batch_size * c.grad_accum * c.block_size
    result = {'data': {'dir': args.paper_data, **{key: meta.get(key) for key in (
                  'tokenizer', 'vocab_size', 'train_tokens', 'val_tokens')}},
              'steps': n, 'tokens_per_step': tokens_per_step,
              'epochs': n * tokens_per_step / meta['train_tokens'],
              'argv': argv['moe'], 'runs': {}}
    save(args, 'paper_real_text.json', result)

    # the stopped run goes first, and its resume starts as soon as it ends, beside the others
    stopped = Job('paper/moe_stopped', [sys.executable, 'scripts/train_until.py', str(n // 2),
                                        *resumed_argv])
    jobs = [stopped] + [Job(f'paper/{name}', [sys.executable, 'train.py', *argv[name]])
                        for name in PAPER_CONFIGS]
    resumed = []

    def on_end(job, returncode, seconds):
        name = job.name.split('/')[1]
        result['runs'][name] = {'returncode': returncode, 'seconds': seconds}
        if returncode != 0:
            result['runs'][name]['error'] = log_tail(args, job.name)
        elif job is stopped:
            # the resume cuts log.jsonl back to the stop (plumbing.open_log): keep the stopped
            # run's, with its evaluation at the stop
            shutil.copy(os.path.join(run_dir['moe_resumed'], 'log.jsonl'), stopped_log)
            resumed.append(start([sys.executable, 'train.py', *resumed_argv, '--resume=True'],
                                 log_path(args, 'paper/moe_resumed'), args.env))
        else:
            result['runs'][name].update(attempt(loss_summary, run_dir[name], n))
        save(args, 'paper_real_text.json', result)
    try:
        run_jobs(args, jobs, len(jobs), kill_at, kill_at, on_end)
        # sample and export the straight moe run while the resumed one may still train
        if result['runs'].get('moe', {}).get('returncode') == 0:
            result['sample'] = attempt(sample_story, args, run_dir['moe'])
            save(args, 'paper_real_text.json', result)
            result['export'] = attempt(export_and_compare, args, run_dir['moe'])
            save(args, 'paper_real_text.json', result)
        if not resumed:
            result['resume'] = {'error': 'the stopped run did not end as planned: '
                                         'see runs.moe_stopped'}
        else:
            returncode = finish(resumed[0], kill_at)
            print(f'{elapsed(args):5.0f} s  paper/moe_resumed: return code {returncode}',
                  flush=True)
            result['resume'] = {'returncode': returncode, **attempt(
                resume_check, os.path.join(run_dir['moe'], 'log.jsonl'), stopped_log,
                os.path.join(run_dir['moe_resumed'], 'log.jsonl'), n // 2,
                log_path(args, 'paper/moe_resumed'))}
    finally:  # an error above must not leave the resumed run training
        for proc in resumed:
            stop(proc)
    for name in (*PAPER_CONFIGS, 'moe_resumed'):
        keep_log(args, os.path.join(run_dir[name], 'log.jsonl'), f'paper/{name}')
    keep_log(args, stopped_log, 'paper/moe_stopped')
    save(args, 'paper_real_text.json', result)


# ----------------------------------------------------------------------------- part 3
def start_gpu_tests(args):
    """pytest -m gpu in the background. A test file that cannot be imported here (a package the
    machine lacks) must not stop the GPU tests: --continue-on-collection-errors."""
    cmd = [sys.executable, '-m', 'pytest', '-q', '-m', 'gpu', '--continue-on-collection-errors',
           'tests']
    return start(cmd, os.path.join(args.logs, 'gpu_tests.txt'), args.env)


def pytest_counts(line):
    """pytest's summary line -> {'passed': 3, 'deselected': 250, 'error': 1, ...}; '1 error' and
    '2 errors' both count under 'error'."""
    return {word.rstrip('s'): int(n) for n, word in re.findall(r'(\d+) (\w+)', line)}


def gpu_tests(args, proc):
    """Part 3: the GPU tests' counts from pytest's summary line, killed at the end of the time
    they share with parts 1 and 2. Not ok if a test failed or, on a GPU, none passed. Its exit
    code alone would not do: a test file that needs a package the machine lacks cannot be
    collected, and pytest then exits with 1 even when every GPU test passed."""
    returncode = finish(proc, args.side_by_side_end)
    lines = open(os.path.join(args.logs, 'gpu_tests.txt')).read().strip().splitlines()
    last = lines[-1] if lines else ''
    counts = pytest_counts(last) if returncode is not None else {}
    ok = (returncode is not None and not counts.get('failed')
          and (args.device != 'cuda' or counts.get('passed', 0) > 0))
    return {'ok': ok, 'returncode': returncode, 'last_line': last, 'counts': counts,
            'collection_errors': [line for line in lines if line.startswith('ERROR ')],
            'since_start_s': elapsed(args)}


# ----------------------------------------------------------------------------- parts 4 and 5
def paper_config(args, name):
    """A paper config (toy sized with --tiny) for parts 4 and 5, which train on random tokens."""
    tiny = [*TINY_PAPER, '--vocab_size=257'] if args.tiny else []
    return train.configure([f'config/{name}.py', f'--device={args.device}', *tiny])


def free_gpu_memory():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def where_the_time_goes(args):
    """Part 4 -> profile.json. It runs last, until the end of --budget_s."""
    result = {'device': args.device, 'hardware': args.hardware, 'torch': torch.__version__,
              'how': 'eager bf16 steps on random tokens; the time of each kernel goes to the '
                     'innermost profiler range around the op that launched it: ranges added by '
                     'scripts/gpu_profile.py around module forwards and, through identity ops '
                     'on their inputs and outputs, their backwards (compiled code drops '
                     'ranges: for the compiled step see nanogpt.json)',
              'models': {}}
    steps = 2 if args.tiny else 5
    for name in ('moe', 'dense_active'):
        if args.part4_end - time.time() < EAGER_MODEL_S:
            result['models'][name] = {'skipped': 'out of time'}
            continue
        result['models'][name] = attempt(gpu_profile.where_the_time_goes,
                                         paper_config(args, name), args.device_obj, steps)
        free_gpu_memory()
        save(args, 'profile.json', result)
    save(args, 'profile.json', result)


def nanogpt_at_our_shapes(args, c):
    """nanoGPT's model from --nanogpt (never a file of this repository) at c's shapes."""
    if not os.path.isfile(args.nanogpt):
        raise UserError(f'{args.nanogpt} not found; make gpu_carry/ first: '
                        'bash scripts/gpu_carry.sh')
    module = gpu_profile.load_nanogpt(args.nanogpt)
    return gpu_profile.nanogpt_at_our_shapes(module, c, args.device_obj)


def mfu_ratio(a, b, rule):
    """Model a's MFU over model b's, both counted by `rule` (a flops_per_token key): the ratio of
    the FLOP/s each did, in which the GPU's peak cancels."""
    return a['tokens_per_s'] * a[rule] / (b['tokens_per_s'] * b[rule])


def nanogpt_beside_ours(args):
    """Part 5 -> nanogpt.json: our dense_active, nanoGPT's model at its shapes, then our moe if
    there is time, compiled, bf16, fused AdamW, random tokens. It runs before part 4, until 50 s
    before the end of --budget_s."""
    commit_file = os.path.join(os.path.dirname(args.nanogpt), 'nanogpt_commit.txt')
    dense, moe = paper_config(args, 'dense_active'), paper_config(args, 'moe')
    peak = plumbing.peak_flops(args.device_obj)
    result = {'hardware': args.hardware, 'torch': torch.__version__, 'nanogpt': args.nanogpt,
              'nanogpt_commit': (open(commit_file).read().strip()
                                 if os.path.isfile(commit_file) else None),
              'shapes': {key: getattr(dense, key) for key in (
                  'd_model', 'n_layer', 'n_head', 'vocab_size', 'block_size', 'batch_size')},
              'peak_flops': peak,
              'flops_rules': 'each model is counted by both rules. flops_per_token (ours, as '
                             'train.flops_per_token): 6 x matmul params (every matmul weight, '
                             'the output layer included, the embedding lookup not; the active '
                             'experts for the MoE) + causal attention 6 x n_layer x block_size x '
                             'd_model. flops_per_token_nanogpt_rule (nanoGPT\'s estimate_mfu): '
                             '6 x params (all but the position embedding; active ones for the '
                             'MoE) + 12 x n_layer x block_size x d_model. mfu and '
                             'mfu_nanogpt_rule: tokens/s x each, over the peak',
              'comparison': 'the shapes match in width, depth, heads, vocabulary and context '
                            'only: nanoGPT\'s MLP is two matrices 4 x d_model wide with GELU, '
                            'dense_active\'s SwiGLU three of ffn_hidden, matched to the MoE\'s '
                            'active params, so nanoGPT has fewer matmul params and more tokens/s '
                            'by construction. nanogpt_over_ours_mfu compares the FLOP/s done, '
                            'each model counted by the same rule',
              'models': {}}
    steps = 2 if args.tiny else 20
    builds = (('dense_active', dense, gpu_profile.ours_at_our_shapes, (dense, args.device_obj)),
              ('nanogpt', dense, nanogpt_at_our_shapes, (args, dense)),
              ('moe', moe, gpu_profile.ours_at_our_shapes, (moe, args.device_obj)))

    def timed(c, build, build_args):
        return gpu_profile.timed_compiled(build(*build_args), c, args.device_obj, steps, peak)
    for name, c, build, build_args in builds:
        if args.part5_end - time.time() < COMPILED_MODEL_S:
            result['models'][name] = {'skipped': 'out of time'}
            continue
        result['models'][name] = attempt(timed, c, build, build_args)
        free_gpu_memory()
        save(args, 'nanogpt.json', result)
    nanogpt, ours = result['models']['nanogpt'], result['models']['dense_active']
    if 'tokens_per_s' in nanogpt and 'tokens_per_s' in ours:
        result['nanogpt_over_ours_mfu'] = mfu_ratio(nanogpt, ours, 'flops_per_token')
        result['nanogpt_over_ours_mfu_nanogpt_rule'] = mfu_ratio(
            nanogpt, ours, 'flops_per_token_nanogpt_rule')
    save(args, 'nanogpt.json', result)


# ----------------------------------------------------------------------------- main
def run_part(args, summary, name, fn, *fn_args):
    """One part, timed; an exception is recorded in summary.json and the check goes on. A part
    may return ok: False itself (part 3, when a test failed)."""
    print(f'{elapsed(args):5.0f} s  == part {name}', flush=True)
    t0 = time.time()
    try:
        part = {'ok': True, **(fn(*fn_args) or {})}
    except Exception as e:
        part = {'ok': False, 'error': describe(e)}
    part['seconds'] = time.time() - t0
    with SUMMARY_LOCK:
        summary['parts'][name] = part
        save(args, 'summary.json', summary)
    print(f'{elapsed(args):5.0f} s  == part {name}: {"ok" if part["ok"] else "FAILED"}, '
          f'{part["seconds"]:.0f} s', flush=True)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--out', required=True, help='folder for the JSON results (made if missing)')
    p.add_argument('--logs', help='folder for everything else (default: OUT/logs)')
    p.add_argument('--work', help='folder for run folders and checkpoints (default: a new '
                   'temporary folder)')
    p.add_argument('--tiny', action='store_true',
                   help='on the CPU, toy sizes and a few steps: checks the logic, not the GPU')
    p.add_argument('--parts', default='1,2,3,4,5', help='which parts to run (default all)')
    p.add_argument('--seeds', help='part 1 seeds (default 1,2,3,4,5; tiny 1)')
    p.add_argument('--slots', type=int, default=12,
                   help='part 1: train.py processes side by side (default 12: with part 2\'s '
                        'runs and pytest, about one process per CPU core of the H200 machine\'s '
                        '16)')
    p.add_argument('--paper_steps', type=int, help='part 2 steps per run (default 100; tiny 8)')
    p.add_argument('--budget_s', type=float, default=330,
                   help='seconds for the whole check (default 330); the parts end at fixed '
                        'times in it (the time plan above)')
    p.add_argument('--cpu_data', default=os.path.join(CARRY, 'tinystories_bytes'),
                   help="the committed CPU runs' bytes data (default gpu_carry/...)")
    p.add_argument('--paper_data', default=os.path.join(CARRY, 'tinystories_gpt2'),
                   help='GPT-2 tokens of the same stories (default gpu_carry/...)')
    p.add_argument('--tiktoken_cache', default=os.path.join(CARRY, 'tiktoken_cache'),
                   help="GPT-2's BPE files, for sample.py and export_hf.py offline")
    p.add_argument('--nanogpt', default=os.path.join(CARRY, 'nanogpt_model.py'),
                   help="nanoGPT's model.py, read from outside this repository")
    args = p.parse_args(argv)
    args.parts = {int(part) for part in args.parts.split(',')}
    args.seeds = [int(s) for s in (args.seeds or ('1' if args.tiny else '1,2,3,4,5')).split(',')]
    args.paper_steps = args.paper_steps or (8 if args.tiny else 100)
    args.log_interval = 2 if args.tiny else 10
    args.device = 'cpu' if args.tiny else 'cuda'
    args.logs = args.logs or os.path.join(args.out, 'logs')
    # four evaluations and a checkpoint halfway, each on a log line
    if args.paper_steps % 4 or (args.paper_steps // 2) % args.log_interval:
        raise UserError(f'--paper_steps must be a multiple of 4 whose half is a multiple of '
                        f'{args.log_interval}, such as 100; got {args.paper_steps}')
    least = PART5_S + PART4_S + PART1_LAST_START_S
    if args.budget_s <= least:
        raise UserError(f'--budget_s must be over {least}: parts 5 and 4 keep {PART5_S} and '
                        f'{PART4_S} s at its end, and part 1 starts no run in its last '
                        f'{PART1_LAST_START_S} s; got {args.budget_s:g}')
    return args


def main(argv):
    args = parse_args(argv)
    args.t_start = time.time()
    # the time plan: when parts 1-3, 5 and 4 must end
    args.part4_end = args.t_start + args.budget_s
    args.part5_end = args.part4_end - PART4_S
    args.side_by_side_end = args.part5_end - PART5_S
    for key in ('out', 'logs', 'work', 'cpu_data', 'paper_data', 'tiktoken_cache', 'nanogpt'):
        if getattr(args, key):
            setattr(args, key, os.path.abspath(getattr(args, key)))
    os.chdir(REPO)  # train.py, config/ and tests/ are named from here, as in the subprocesses
    if not args.tiny and not torch.cuda.is_available():
        raise UserError('torch sees no CUDA GPU; on a CPU, try the logic at toy size with --tiny '
                        '(and --cpu_data, --paper_data)')
    args.device_obj = torch.device(args.device)
    args.hardware = plumbing.hardware_name(args.device_obj)
    args.work = args.work or tempfile.mkdtemp(prefix='gpu_real_text_')
    for folder in (args.out, args.logs, args.work):
        os.makedirs(folder, exist_ok=True)
    # one thread per process: a dozen and more processes share the CPUs that feed the GPU
    args.env = {**os.environ, 'OMP_NUM_THREADS': '1',
                'TIKTOKEN_CACHE_DIR': os.path.abspath(args.tiktoken_cache)}
    summary = {'argv': argv, 'device': args.device, 'hardware': args.hardware,
               'torch': torch.__version__, 'cuda': torch.version.cuda,
               'python': platform.python_version(), 'packages': package_versions(),
               'work': args.work, 'budget_s': args.budget_s,
               'time_plan_s': {'parts_1_2_3_end': args.side_by_side_end - args.t_start,
                               'part_5_end': args.part5_end - args.t_start,
                               'part_4_end': args.budget_s},
               # finished stays False if the shell's time limit stops the check first
               'parts': {}, 'finished': False}
    save(args, 'summary.json', summary)
    print(f'gpu_real_text: {args.hardware}, torch {torch.__version__}; results -> {args.out}, '
          f'logs -> {args.logs}, runs -> {args.work}', flush=True)

    tests = start_gpu_tests(args) if 3 in args.parts else None
    # part 2 from a thread beside part 1: both mostly wait for their train.py processes
    paper = threading.Thread(target=run_part, args=(args, summary, '2 paper configs on real text',
                                                    paper_configs, args))
    if 2 in args.parts:
        paper.start()
    if 1 in args.parts:
        run_part(args, summary, '1 cpu recipe on the gpu', cpu_recipe_on_gpu, args)
    if 2 in args.parts:
        paper.join()
    if 3 in args.parts:
        run_part(args, summary, '3 gpu tests', gpu_tests, args, tests)
    # timings, on an otherwise idle GPU: the compiled models first, then the eager profiles
    if 5 in args.parts:
        run_part(args, summary, '5 nanogpt beside ours', nanogpt_beside_ours, args)
    if 4 in args.parts:
        run_part(args, summary, '4 where the time goes', where_the_time_goes, args)
    summary['finished'], summary['seconds'] = True, elapsed(args)
    save(args, 'summary.json', summary)
    print(f'\n{"part":<32} {"ok":<4} {"seconds":>8}')
    for name, part in summary['parts'].items():
        print(f'{name:<32} {"yes" if part["ok"] else "NO":<4} {part["seconds"]:>8.0f}')
    print(f'{"all":<32} {"":<4} {summary["seconds"]:>8.0f}')


if __name__ == '__main__':
    with plumbing.one_line_errors('gpu_real_text.py'):
        main(sys.argv[1:])
