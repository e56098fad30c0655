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
    except (RuntimeError, KeyError, TypeError, EOFError, OSError) as e:
        die(f'{path} is not a usable tinymoe checkpoint for this code ({type(e).__name__}: {str(e)[:200]})')
    return model.to(device).eval(), get_tokenizer(ckpt['meta']['tokenizer'])


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
        print(tok.decode(out[0, 1:].tolist()))
        print('---------------')


if __name__ == '__main__':
    main()
