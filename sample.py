"""
Sample stories from a trained checkpoint (dense or MoE).

    python sample.py                                  # the default run: out/moe-s1 (config/moe.py, seed 1)
    python sample.py --out_dir out/cpu_moe-s1 --start "once upon a time" --num_samples 3
    python sample.py --start FILE:prompt.txt --temperature 0   # greedy
"""
import argparse
import os
import sys
import types

import torch

from prepare import get_tokenizer
from train import Transformer


def die(msg):
    print(f'sample.py: error: {msg}', file=sys.stderr)
    sys.exit(1)


def load_model(out_dir, device):
    """The best checkpoint of a run, rebuilt from the config stored inside it, and its tokenizer."""
    path = os.path.join(out_dir, 'best.pt')
    if not os.path.isfile(path):
        die(f'no checkpoint at {path}; train one first (e.g. python train.py config/cpu_moe.py --seed=1) '
            'or point --out_dir at a run folder')
    try:
        ckpt = torch.load(path, map_location=device, weights_only=False)
        model = Transformer(types.SimpleNamespace(**ckpt['config']))
        model.load_state_dict(ckpt['model'])
        name = ckpt['meta']['tokenizer']
    except Exception as e:  # whatever is wrong with the file, the fix is the same: another checkpoint
        die(f'{path} is not a usable tinymoe checkpoint for this code ({type(e).__name__}: '
            f'{" ".join(str(e).split())[:200]})')  # one line, however long the error
    try:
        tok = get_tokenizer(name)
    except (OSError, ValueError) as e:  # tiktoken could not fetch its BPE files
        die(f'cannot load the {name!r} tokenizer of this run ({type(e).__name__}); for gpt2 offline, set '
            'TIKTOKEN_CACHE_DIR to a folder with the BPE files')
    return model.to(device).eval(), tok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--out_dir', default='out/moe-s1', help='run folder holding best.pt')
    p.add_argument('--start', default='', help='prompt text, or FILE:path; empty starts a fresh story')
    p.add_argument('--num_samples', type=int, default=2)
    p.add_argument('--max_new_tokens', type=int, default=500)
    p.add_argument('--temperature', type=float, default=0.8, help='0 = greedy')
    p.add_argument('--top_k', type=int, default=200, help='sample among the top_k most likely tokens')
    p.add_argument('--seed', type=int, default=1)
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    args = p.parse_args(argv)
    if args.device.startswith('cuda') and not torch.cuda.is_available():
        die('--device cuda but torch sees no CUDA GPU; use --device cpu')

    start = args.start
    if start.startswith('FILE:'):
        try:
            start = open(start[5:], encoding='utf-8').read()
        except (OSError, UnicodeDecodeError) as e:
            die(f'cannot read the prompt file {start[5:]!r}: {e}')
    torch.manual_seed(args.seed)
    model, tok = load_model(args.out_dir, args.device)
    # stories are separated by EOT in training, so EOT + prompt means "a story that begins like this"
    prompt = torch.tensor([[tok.eot_id] + tok.encode(start)], device=args.device)
    for _ in range(args.num_samples):
        out = model.generate(prompt, args.max_new_tokens, args.temperature, args.top_k, stop_id=tok.eot_id)
        print(tok.decode([i for i in out[0, 1:].tolist() if i != tok.eot_id]))
        print('---------------')


if __name__ == '__main__':
    main()
