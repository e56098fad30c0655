"""
Sample stories from a trained checkpoint (dense or MoE), each printed as it is written.

    python sample.py                                  # the most recently finished run in out/
    python sample.py --out_dir out/cpu_moe-s1 --start "once upon a time" --num_samples 3
    python sample.py --start FILE:prompt.txt --temperature 0   # greedy
"""
import argparse
import glob
import itertools
import os
import sys
import types

import torch

from errors import UserError, one_line_errors
from prepare import get_tokenizer
from runs import load_checkpoint
from train import DEFAULTS, Transformer


def newest_run():
    """The run in out/ with a best.pt whose done.json (written when training ends) is newest."""
    finished = [p for p in glob.glob(os.path.join('out', '*', 'done.json'))
                if os.path.isfile(os.path.join(os.path.dirname(p), 'best.pt'))]
    if not finished:
        raise UserError('no finished run in out/; train one first: make cpu (or python train.py '
                        'config/cpu_moe.py --seed=1), or pass --out_dir RUN')
    return os.path.dirname(max(finished, key=os.path.getmtime))


def load_model(out_dir, device, name='best.pt'):
    """A run's checkpoint (best.pt by default), rebuilt from its own config, and its tokenizer."""
    path = os.path.join(out_dir, name)
    if not os.path.isfile(path):
        raise UserError(f'no checkpoint at {path}; train one first (e.g. python train.py '
                        'config/cpu_moe.py --seed=1) or point --out_dir at a run folder')
    ckpt = load_checkpoint(path)
    try:
        # keys newer than the checkpoint take their defaults
        model = Transformer(types.SimpleNamespace(**{**DEFAULTS, **ckpt['config']}))
        model.load_state_dict(ckpt['model'])
        name = ckpt['meta']['tokenizer']
    except Exception as e:  # whatever is wrong with the file, the fix is the same: another one
        reason = ' '.join(str(e).split())[:200]  # one line, however long the error
        raise UserError(f'{path} is not a usable tinymoe checkpoint for this code '
                        f'({type(e).__name__}: {reason})') from None
    try:
        tok = get_tokenizer(name)
    except (OSError, ValueError) as e:  # tiktoken could not fetch its BPE files
        raise UserError(f'cannot load the run\'s {name!r} tokenizer ({type(e).__name__}); for gpt2 '
                        'offline, set TIKTOKEN_CACHE_DIR to a folder with its BPE files') from None
    return model.to(device).eval(), tok


def read_start(start):
    """--start as given: the text itself, or the contents of the file FILE:path names."""
    if not start.startswith('FILE:'):
        return start
    try:
        return open(start[5:], encoding='utf-8').read()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f'cannot read the prompt file {start[5:]!r}: {e}') from None


@torch.no_grad()
def next_tokens(model, idx, max_new_tokens, temperature=1.0, top_k=None, stop_id=None):
    """Extend idx (B, T) token by token, yielding each new column (B, 1) once chosen. temperature 0
    is greedy; top_k keeps the k most likely tokens; stops after emitting stop_id (B = 1)."""
    for _ in range(max_new_tokens):
        logits = model(idx[:, -model.block_size:])[0][:, -1, :].float()
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, -float('inf'))
            nxt = torch.multinomial(logits.softmax(dim=-1), 1)
        yield nxt
        idx = torch.cat([idx, nxt], dim=1)
        if stop_id is not None and nxt.item() == stop_id:
            break


def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, stop_id=None):
    """idx (B, T) extended by next_tokens, all at once: -> (B, T + the new tokens)."""
    new = next_tokens(model, idx, max_new_tokens, temperature, top_k, stop_id)
    return torch.cat([idx, *new], dim=1)


def print_streaming(tok, prompt, tokens):
    """Print the text of the ids prompt, then of each id tokens yields, as it comes (a sample takes
    minutes on a slow CPU), EOT left out: in all, print(tok.decode(all the ids))."""
    ids, shown = [], ''
    for i in itertools.chain(prompt, tokens):
        if i == tok.eot_id:
            continue
        ids.append(i)
        # up to a character whose last byte is yet to come: it decodes as \ufffd until then
        text = tok.decode(ids).rstrip('\ufffd')
        print(text[len(shown):], end='', flush=True)
        shown = text
    print(tok.decode(ids)[len(shown):], flush=True)  # a last character cut short, as \ufffd


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--out_dir', help='a run folder (default: the newest finished run in out/)')
    p.add_argument('--start', default='', help='the prompt, or FILE:path; empty: a new story')
    p.add_argument('--num_samples', type=int, default=2)
    p.add_argument('--max_new_tokens', type=int, default=500)
    p.add_argument('--temperature', type=float, default=0.8, help='0 = greedy')
    p.add_argument('--top_k', type=int, default=200, help='sample among the k likeliest tokens')
    p.add_argument('--seed', type=int, default=1)
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    args = p.parse_args(argv)
    if args.device.startswith('cuda') and not torch.cuda.is_available():
        raise UserError('--device cuda but torch sees no CUDA GPU; use --device cpu')
    if args.out_dir is None:
        args.out_dir = newest_run()
        print(f'sample.py: sampling from {args.out_dir} (the most recently finished run in out/)',
              file=sys.stderr)
    start = read_start(args.start)
    torch.manual_seed(args.seed)
    model, tok = load_model(args.out_dir, args.device)
    # stories are separated by EOT in training: EOT + prompt means "a story that begins like this"
    prompt = torch.tensor([[tok.eot_id] + tok.encode(start)], device=args.device)
    for _ in range(args.num_samples):
        new = next_tokens(model, prompt, args.max_new_tokens, args.temperature, args.top_k,
                          stop_id=tok.eot_id)
        print_streaming(tok, prompt[0].tolist(), (nxt.item() for nxt in new))
        print('---------------')


if __name__ == '__main__':
    with one_line_errors('sample.py'):
        main()
