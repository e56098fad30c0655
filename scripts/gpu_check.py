"""
The prepared GPU check: what training costs on a real accelerator, in one command of a few
minutes.

    bash scripts/gpu_check.sh                        # on a CUDA machine: installs, then runs this
    python scripts/gpu_check.py --device=cpu --tiny  # the same logic at toy shapes, on a CPU

It writes a synthetic token memmap (random ids, the paper's GPT-2 vocabulary), then trains the
paper-scale moe and dense_active configs for --steps steps each with train.py itself (bf16
autocast, torch.compile and fused AdamW, as on any GPU), and reports the steady-state tokens/s
(median over log lines after the first, which holds the compilation), the model FLOP utilisation
against the GPU's bf16 dense peak, and the MoE's step-time ratio over dense_active. The numbers go
to --out as JSON, and the last printed line is that JSON.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import gpu_profile  # noqa: E402
import plumbing  # noqa: E402
import train  # noqa: E402
from plumbing import UserError  # noqa: E402

TINY = ['--d_model=32', '--n_head=2', '--moe_hidden=32', '--ffn_multiple_of=8',
        '--block_size=64', '--batch_size=4', '--eval_tokens=512']


def write_synthetic_data(data_dir, vocab_size, n_train, n_val, seed=0):
    """Random token ids in prepare.py's format: train.bin and val.bin (uint16) and meta.json."""
    rng = np.random.default_rng(seed)
    os.makedirs(data_dir, exist_ok=True)
    for split, n in (('train', n_train), ('val', n_val)):
        tokens = rng.integers(0, vocab_size, n, dtype=np.uint16)
        tokens.tofile(os.path.join(data_dir, f'{split}.bin'))
    with open(os.path.join(data_dir, 'meta.json'), 'w') as f:
        json.dump({'tokenizer': 'synthetic', 'vocab_size': vocab_size, 'eot_id': vocab_size - 1,
                   'train_tokens': n_train, 'val_tokens': n_val, 'train_stories': 0,
                   'val_stories': 0}, f)


def steady_tokens_per_s(log_path):
    """Median tok_per_s of the training log lines after the first (the first one includes
    compilation)."""
    rates = [r['tok_per_s'] for r in map(json.loads, open(log_path)) if 'tok_per_s' in r]
    if len(rates) < 2:
        raise UserError(f'{log_path}: fewer than two throughput lines; raise --steps')
    return statistics.median(rates[1:])


def train_args(steps, tiny):
    """train.py arguments shared by both models: about ten log lines, one evaluation and one
    checkpoint, at the end."""
    log_interval = max(1, steps // 10)
    args = [f'--max_iters={steps}', f'--eval_interval={steps}', f'--log_interval={log_interval}',
            f'--ckpt_interval={log_interval * steps}']
    if tiny:
        return args + TINY
    return args + ['--eval_tokens=65536']


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--device', default='cuda', help="cuda (default) or cpu")
    p.add_argument('--tiny', action='store_true',
                   help='toy shapes, a few steps: checks the logic, not the speed')
    p.add_argument('--steps', type=int, default=None,
                   help='training steps per model (default 300, tiny 8)')
    p.add_argument('--peak_flops', type=float, default=plumbing.PEAK_FLOPS['NVIDIA H200'],
                   help='for the MFU (default: H200 bf16)')
    p.add_argument('--out', default=os.path.join(REPO, 'results', 'gpu', 'gpu_check.json'))
    args = p.parse_args(argv)
    on_gpu = args.device.startswith('cuda')
    if on_gpu and not torch.cuda.is_available():
        raise UserError('no CUDA device visible to torch; on a CPU run: python '
                        'scripts/gpu_check.py --device=cpu --tiny')
    steps = args.steps or (8 if args.tiny else 300)
    common = [f'--device={args.device!r}'] + train_args(steps, args.tiny)

    t_start = time.time()
    hardware = plumbing.hardware_name(torch.device(args.device))
    result = {'device': args.device, 'hardware': hardware, 'torch': torch.__version__,
              'tiny': args.tiny, 'steps': steps, 'peak_flops': args.peak_flops, 'models': {}}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = os.path.join(tmp, 'data')
        c = train.configure([os.path.join(REPO, 'config', 'moe.py')] + common)
        n_train, n_val = (20_000, 2_000) if args.tiny else (2_000_000, 200_000)
        write_synthetic_data(data_dir, c.vocab_size, n_train, n_val)
        for name in ('moe', 'dense_active'):
            argv_model = [os.path.join(REPO, 'config', f'{name}.py'), f'--data_dir={data_dir!r}',
                          f'--out_dir={os.path.join(tmp, name)!r}'] + common
            t0 = time.time()
            out = subprocess.run([sys.executable, os.path.join(REPO, 'train.py')] + argv_model,
                                 capture_output=True, text=True)
            if out.returncode != 0:  # a bug, not a user error: show what train.py printed
                raise SystemExit(f'train.py {name} failed:\n{out.stdout[-2000:]}\n'
                                 f'{out.stderr[-4000:]}')
            cfg = train.configure(argv_model)
            tok_s = steady_tokens_per_s(os.path.join(tmp, name, 'log.jsonl'))
            run_cfg = json.load(open(os.path.join(tmp, name, 'config.json')))
            flops = train.flops_per_token(cfg)
            result['models'][name] = {
                'params': train.count_params(cfg), 'tokens_per_s': tok_s,
                'ms_per_step': 1e3 * run_cfg['tokens_per_iter'] / tok_s,
                'flops_per_token': flops, 'mfu': gpu_profile.mfu(tok_s, flops, args.peak_flops),
                'compile': run_cfg['compile_used'], 'wall_s': time.time() - t0}
    models = result['models']
    moe_ms, dense_ms = models['moe']['ms_per_step'], models['dense_active']['ms_per_step']
    result['moe_over_dense_active'] = moe_ms / dense_ms
    result['wall_s'] = time.time() - t_start

    print(f'{"model":<13} {"tokens/s":>12} {"ms/step":>9} {"MFU":>7} {"wall s":>7}')
    for name, m in models.items():
        print(f'{name:<13} {m["tokens_per_s"]:>12,.0f} {m["ms_per_step"]:>9.2f} '
              f'{100 * m["mfu"]:>6.2f}% {m["wall_s"]:>7.0f}')
    print(f'moe / dense_active step time: {result["moe_over_dense_active"]:.3f}')
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    plumbing.save(args.out, result)  # a kill mid-write leaves the last version
    print(json.dumps(result))


if __name__ == '__main__':
    with plumbing.one_line_errors('gpu_check.py'):
        main(sys.argv[1:])
