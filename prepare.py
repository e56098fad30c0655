"""Tokenise TinyStories into flat uint16 token files for train.py.

    python prepare.py                             # HF hub: roneneldan/TinyStories, gpt2 BPE
    python prepare.py --hf_stories 5510 --tokenizer bytes --out_dir data/tinystories_bytes
    python prepare.py --input stories.txt --tokenizer bytes --out_dir data/ts_bytes

--hf_stories N streams N stories, split as a local file of N stories would be (the CPU route's
data, from the hub, without the 2 GB download): N - n_val train stories from the head of the hub's
train split and n_val val stories from the head of its validation split (a local file gives its
last n_val stories to val).

Writes <out_dir>/train.bin and val.bin (np.uint16, every story followed by the EOT id) and
meta.json (tokenizer, vocab_size, eot_id, counts, and the arguments that produced them).
A complete meta.json means a complete dataset: it is written last, and rerunning with the same
arguments is a no-op unless --force. sample.py uses get_tokenizer() from here.
"""
import argparse
import itertools
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing import Pool

import numpy as np

from errors import UserError, one_line_errors

HF_DATASET = "roneneldan/TinyStories"
# in the release text format, a story ends with a line that is exactly this (CRLF tolerated)
STORY_END = re.compile(r"^<\|endoftext\|>\r?$", re.MULTILINE)


# ----------------------------------------------------------------------------- tokenizers

@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus one EOT id. Needs no files at all."""
    name: str = "bytes"
    vocab_size: int = 257
    eot_id: int = 256

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i for i in ids if i != self.eot_id).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """tiktoken's GPT-2 BPE; encode_ordinary so '<|endoftext|>' inside a story stays plain text."""
    name = "gpt2"

    def __init__(self):
        import tiktoken  # may need the BPE files: from the web or TIKTOKEN_CACHE_DIR
        self.enc = tiktoken.get_encoding("gpt2")
        self.vocab_size = self.enc.n_vocab  # 50257
        self.eot_id = self.enc.eot_token    # 50256

    def encode(self, text):
        return self.enc.encode_ordinary(text)

    def decode(self, ids):
        return self.enc.decode(list(ids))


TOKENIZERS = {"gpt2": GPT2Tokenizer, "bytes": ByteTokenizer}


def get_tokenizer(name):
    if name not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {name!r}; valid: {', '.join(TOKENIZERS)}")
    return TOKENIZERS[name]()


# ----------------------------------------------------------------------------- helpers

def split_stories(text):
    """Release format -> list of stories: split on the end lines, strip, drop empty ones."""
    return [s for s in (p.strip() for p in STORY_END.split(text)) if s]


def read_stories(path):
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:  # missing, a directory, unreadable...
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not valid UTF-8 (byte offset {e.start})") from None
    del raw
    stories = split_stories(text)
    if not stories:
        raise UserError(f"no stories found in {path}")
    return stories


def val_count(n, val_fraction):
    """How many of n stories become val: at least one in each split."""
    return min(n - 1, max(1, round(n * val_fraction)))


def file_key(path):
    """What identifies an input file for the skip check: absolute path, size, mtime."""
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime": st.st_mtime}


# ----------------------------------------------------------------------------- tokenising

_tok = None  # the tokenizer of this (worker) process


def _set_tokenizer(name):
    global _tok
    _tok = get_tokenizer(name)


def _init_worker(name):
    # Ctrl-C goes to the whole process group; let only the parent handle it (it then
    # terminates the pool) instead of every worker printing its own traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _set_tokenizer(name)


def tokenize_chunk(texts):
    """Stories -> (number of stories, uint16 array of their tokens, each followed by EOT)."""
    ids, n = [], 0
    for text in texts:
        text = text.strip()
        if text:
            ids.extend(_tok.encode(text))
            ids.append(_tok.eot_id)
            n += 1
    return n, np.array(ids, dtype=np.uint16)


def write_split(f, stories, args, desc):
    """Tokenise stories in parallel, in chunks, and append the tokens to f in input order."""
    # imported here, where it is used: train.py imports this file and needs no tqdm
    from tqdm import tqdm
    chunks = (stories[i:i + args.chunk_size] for i in range(0, len(stories), args.chunk_size))
    n_tokens = n_stories = 0
    with tqdm(total=len(stories), desc=desc, unit="stories") as bar:
        if args.num_proc == 1:
            results = map(tokenize_chunk, chunks)  # _tok is set in this process by prepare()
        else:
            pool = Pool(args.num_proc, initializer=_init_worker, initargs=(args.tokenizer,))
            results = pool.imap(tokenize_chunk, chunks)  # imap keeps the input order
        try:
            for n, arr in results:
                f.write(arr.tobytes())
                n_tokens += len(arr)
                n_stories += n
                bar.update(n)
        finally:
            if args.num_proc > 1:
                pool.terminate()  # also on errors/Ctrl-C: don't leave workers running
    return n_tokens, n_stories


def load_hub(args):
    """-> (train, val, source) from HF_DATASET: all of it, or with --hf_stories N the split sizes a
    local file of N stories would give, from the head of the hub's train and validation splits."""
    import datasets
    import huggingface_hub
    # its retry warnings would bury our one-line error
    huggingface_hub.utils.logging.set_verbosity_error()
    if args.hf_stories is None:
        ds = datasets.load_dataset(HF_DATASET)
        # ds["text"] is a lazy column (datasets>=3): chunks are read from the Arrow file as needed
        return ds["train"]["text"], ds["validation"]["text"], f"huggingface:{HF_DATASET}"
    # streaming needs the hub anyway: fail after one quick try, not after load_dataset's retries
    # (~25 s when huggingface.co does not resolve, minutes when connections hang)
    huggingface_hub.dataset_info(HF_DATASET, timeout=10)

    def head(split, n):
        """The first n stories of a split, streamed: only these n are downloaded."""
        stream = datasets.load_dataset(HF_DATASET, split=split, streaming=True)
        return [row["text"] for row in itertools.islice(stream, n)]

    n_val = val_count(args.hf_stories, args.val_fraction)
    n_train = args.hf_stories - n_val
    train, val = head("train", n_train), head("validation", n_val)
    if (len(train), len(val)) != (n_train, n_val):
        raise UserError(f"--hf_stories {args.hf_stories} needs {n_train} train and {n_val} "
                        f"validation stories, {HF_DATASET} gave {len(train)} and {len(val)}; "
                        "pass a smaller --hf_stories or --val_fraction")
    return train, val, (f"huggingface:{HF_DATASET} (first {len(train)} train stories, "
                        f"first {len(val)} validation stories)")


def load_splits(args):
    """-> (train, val, source): two sequences of story texts and a description of where from."""
    if args.input is None:
        try:
            return load_hub(args)
        except UserError:
            raise
        except Exception as e:  # anything else here means we could not get the data
            reason = f"{type(e).__name__}: {str(e).strip()}".splitlines()[0][:200]
            raise UserError(f"could not load {HF_DATASET} from the Hugging Face hub ({reason}); "
                            "connect to the internet, or use a local TinyStories file: "
                            "--input FILE (make: TINYSTORIES=FILE)") from None
    stories = read_stories(args.input)
    if args.val_input is not None:
        source = f"{args.input} (train), {args.val_input} (val)"
        return stories, read_stories(args.val_input), source
    if len(stories) < 2:
        raise UserError(f"{args.input} has {len(stories)} story; need at least 2 to split off "
                        "a validation set (or pass --val_input)")
    n_val = val_count(len(stories), args.val_fraction)  # the last ones, deterministically
    return (stories[:-n_val], stories[-n_val:],
            f"{args.input} (last {n_val} of {len(stories)} stories are val)")


# ----------------------------------------------------------------------------- main

def already_prepared(out_dir, run_args):
    try:
        with open(os.path.join(out_dir, "meta.json")) as f:
            meta = json.load(f)
        return (meta["args"] == run_args
                and os.path.getsize(os.path.join(out_dir, "train.bin")) == 2 * meta["train_tokens"]
                and os.path.getsize(os.path.join(out_dir, "val.bin")) == 2 * meta["val_tokens"])
    except (OSError, ValueError, KeyError, TypeError):  # absent, unreadable or not our format
        return False


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input",
                   help="local TinyStories-format text file (default: the HF hub dataset)")
    p.add_argument("--val_input",
                   help="validation text file (with --input; else split off the tail)")
    p.add_argument("--hf_stories", type=int, metavar="N",
                   help="from the HF hub, only what a local file of N stories would give "
                        "(streamed)")
    p.add_argument("--val_fraction", type=float, default=0.05,
                   help="fraction of --input (or --hf_stories) stories used as val: the last ones "
                        "of the file, the first of the hub's validation split (default 0.05)")
    p.add_argument("--tokenizer", default="gpt2", choices=list(TOKENIZERS))
    p.add_argument("--out_dir", default="data/tinystories")
    p.add_argument("--num_proc", type=int, default=os.cpu_count(), help="tokenising processes")
    p.add_argument("--chunk_size", type=int, default=1024, help="stories per process task")
    p.add_argument("--force", action="store_true", help="redo even if already prepared")
    return p.parse_args(argv)


def main(argv=None):
    """The command line. A UserError passes through to the entry point, which prints it as one line;
    Ctrl-C becomes one line here, and exit status 130 (128 + SIGINT), as shells report it."""
    args = parse_args(argv)
    try:
        prepare(args)
    except KeyboardInterrupt:
        # prepare() has removed its temporary files on the way out
        print("prepare.py: error: interrupted (temporary files removed)", file=sys.stderr)
        sys.exit(130)


def prepare(args):
    if not 0 < args.val_fraction < 1:
        raise UserError(f"--val_fraction must be in (0, 1), got {args.val_fraction}")
    if args.num_proc < 1 or args.chunk_size < 1:
        raise UserError("--num_proc and --chunk_size must be at least 1")
    if args.val_input is not None and args.input is None:
        raise UserError("--val_input needs --input")
    if args.hf_stories is not None and args.input is not None:
        raise UserError("--hf_stories takes the stories from the hub, --input from a file; "
                        "pass only one")
    if args.hf_stories is not None and args.hf_stories < 2:
        raise UserError("--hf_stories must be at least 2 (a train and a val story), "
                        f"got {args.hf_stories}")
    for path in filter(None, (args.input, args.val_input)):
        if os.path.isdir(path):
            raise UserError(f"{path} is a directory; --input/--val_input take a text file")
        if not os.path.isfile(path):
            raise UserError(f"input file {path} not found")

    # everything that determines the output; val_fraction only matters when it is used
    uses_val_fraction = (args.input or args.hf_stories) and not args.val_input
    run_args = {
        "tokenizer": args.tokenizer,
        "input": file_key(args.input) if args.input else None,
        "val_input": file_key(args.val_input) if args.val_input else None,
        "hf_stories": args.hf_stories,
        "val_fraction": args.val_fraction if uses_val_fraction else None,
    }
    if not args.force and already_prepared(args.out_dir, run_args):
        print(f"{args.out_dir} is already prepared with these arguments (pass --force to redo)")
        return

    try:
        _set_tokenizer(args.tokenizer)  # fail early (and the num_proc=1 path uses it)
    except (OSError, ValueError) as e:  # tiktoken could not fetch/verify its BPE files
        raise UserError(f"could not load the {args.tokenizer} tokenizer ({type(e).__name__}); "
                        "set TIKTOKEN_CACHE_DIR to a folder with the BPE files, "
                        "or use --tokenizer bytes") from None
    tok = _tok
    assert tok.vocab_size < 2**16, "token ids must fit in np.uint16"

    train, val, source = load_splits(args)  # before creating out_dir: bad input leaves no trace
    try:
        os.makedirs(args.out_dir, exist_ok=True)
    except OSError as e:  # a file is in the way, or no permission
        raise UserError(f"cannot create --out_dir {args.out_dir}: {e.strerror}") from None
    if not os.access(args.out_dir, os.W_OK):
        raise UserError(f"--out_dir {args.out_dir} is not writable")

    names = ("train.bin", "val.bin", "meta.json")
    final = {name: os.path.join(args.out_dir, name) for name in names}
    tmp = {name: path + ".tmp" for name, path in final.items()}
    t0 = time.time()
    try:
        counts = {}
        for split, stories in (("train", train), ("val", val)):
            try:
                with open(tmp[f"{split}.bin"], "wb") as f:
                    counts[split] = write_split(f, stories, args, split)
            except OSError as e:  # disk full, permissions changed under us...
                raise UserError(f"cannot write {tmp[f'{split}.bin']}: {e.strerror}") from None
        seconds = time.time() - t0
        meta = {
            "tokenizer": tok.name, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id,
            "train_tokens": counts["train"][0], "val_tokens": counts["val"][0],
            "train_stories": counts["train"][1], "val_stories": counts["val"][1],
            "source": source, "args": run_args,
        }
        with open(tmp["meta.json"], "w") as f:
            json.dump(meta, f, indent=2)
        # Remove the old meta.json first: between the renames below, the .bin files may be new
        # while meta.json would still describe the old ones. No meta.json = not prepared.
        if os.path.exists(final["meta.json"]):
            os.remove(final["meta.json"])
        for name in names:
            os.replace(tmp[name], final[name])
    finally:  # on success nothing is left to remove; on any error or Ctrl-C, no partial files
        for path in tmp.values():
            if os.path.exists(path):
                os.remove(path)

    total = meta["train_tokens"] + meta["val_tokens"]
    print(f"train: {meta['train_tokens']:,} tokens, {meta['train_stories']:,} stories")
    print(f"val:   {meta['val_tokens']:,} tokens, {meta['val_stories']:,} stories")
    rate = total / max(seconds, 1e-9)
    wrote = ", ".join(final.values())
    print(f"{tok.name}: {rate:,.0f} tokens/s with {args.num_proc} processes; wrote {wrote}")
    return {"tokens": total, "tokens_per_s": rate}


if __name__ == "__main__":
    with one_line_errors("prepare.py"):
        main()
