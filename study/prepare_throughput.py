"""
prepare.py's tokenising speed against one tiktoken encode_ordinary_batch call on the same stories,
same run.

    python -m study.prepare_throughput --input FILE [--num_proc 2]

prepare.py's rate covers its tokenise-and-write phase (worker start-up, tokenising, writing
train.bin and val.bin); the reference is tiktoken's own batch API on the same stories (its thread
pool, num_threads=8), timed after a warm-up call. Both are timed --repeats times, alternating, and
the best of each is kept (the thread pool's speed varies a lot from call to call). The last line is
JSON with both rates and their ratio, and the input by its file name (not where it lies).
"""
import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time

import prepare


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[1])
    p.add_argument('--input', required=True, help='TinyStories-format text file')
    p.add_argument('--num_proc', type=int, default=os.cpu_count())
    p.add_argument('--tokenizer', default='gpt2', choices=['gpt2'])
    p.add_argument('--repeats', type=int, default=3)
    args = p.parse_args(argv)

    stories = prepare.read_stories(args.input)
    enc = prepare.get_tokenizer(args.tokenizer).enc
    enc.encode_ordinary_batch(stories[:64])  # warm-up: regex and BPE tables
    batch_rates, prepare_rates = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        # + 1: the EOT after each story
        tokens = sum(len(ids) + 1 for ids in enc.encode_ordinary_batch(stories))
        batch_rates.append(tokens / (time.perf_counter() - t0))
        with tempfile.TemporaryDirectory() as out_dir:
            prep_args = prepare.parse_args(['--input', args.input, '--tokenizer', args.tokenizer,
                                            '--out_dir', out_dir, '--num_proc', str(args.num_proc)])
            # prepare.py's own lines would name the temporary folder
            with contextlib.redirect_stdout(io.StringIO()):
                prep = prepare.prepare(prep_args)
        prepare_rates.append(prep['tokens_per_s'])
    batch_rate, prepare_rate = max(batch_rates), max(prepare_rates)
    result = {'input': os.path.basename(args.input), 'num_proc': args.num_proc,
              'cpu_count': os.cpu_count(),
              'tokens': tokens, 'prepare_tokens': prep['tokens'], 'repeats': args.repeats,
              'prepare_tokens_per_s': prepare_rate,
              'encode_ordinary_batch_tokens_per_s': batch_rate,
              'ratio': prepare_rate / batch_rate}
    print(f'prepare.py ({args.num_proc} processes): {prepare_rate:,.0f} tokens/s; '
          f'one encode_ordinary_batch call: {batch_rate:,.0f} tokens/s; '
          f'ratio {result["ratio"]:.2f}')
    print(json.dumps(result))


if __name__ == '__main__':
    main(sys.argv[1:])
