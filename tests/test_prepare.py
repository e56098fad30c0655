"""Tests for prepare.py. Every test writes its own small synthetic stories into tmp_path."""
import json
import os
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import tqdm

import prepare
from conftest import REPO
from errors import UserError

EOT = "<|endoftext|>"


def make_stories(n, name="Story"):
    """n distinct stories with paragraphs, non-ASCII text and an inline (not own-line) EOT
    string."""
    return [f"{name} {i}: Tom met Lily. Café ✓ 🐉\n\nThey said \"{EOT}\" and played {i} times."
            for i in range(n)]


def write_release(path, stories, noise=True):
    """Write stories in the TinyStories release format; noise adds whitespace and empty stories."""
    with open(path, "w", encoding="utf-8") as f:
        if noise:
            f.write(f"\n{EOT}\n")  # an empty story: dropped
        for s in stories:
            f.write(f"  {s}\n\n{EOT}\n" if noise else f"{s}\n{EOT}\n")
    return str(path)


def expected_bytes_tokens(stories):
    return [t for s in stories for t in list(s.encode("utf-8")) + [256]]


def run(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "prepare.py", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def read_bin(path):
    return np.fromfile(path, dtype=np.uint16).tolist()


def snapshot(out_dir):
    """Name -> (bytes, mtime_ns) of every file in out_dir."""
    files = {}
    for name in sorted(os.listdir(out_dir)):
        path = os.path.join(out_dir, name)
        files[name] = (open(path, "rb").read(), os.stat(path).st_mtime_ns)
    return files


def assert_one_error_line(res):
    """A user error through the entry point: exit status 1 and one line on stderr."""
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prepare.py: error:"), res.stderr
    return lines[0]


@pytest.fixture(scope="module")
def good_dataset(tmp_path_factory):
    """A prepared bytes dataset to copy into out_dirs that later, failing runs must not touch."""
    d = tmp_path_factory.mktemp("good")
    inp = write_release(d / "good.txt", make_stories(4))
    res = run("--input", inp, "--tokenizer", "bytes", "--out_dir", str(d / "out"),
              "--num_proc", "1")
    assert res.returncode == 0, res.stderr
    return d / "out"


# ----------------------------------------------------------------------------- tokenizers

def test_bytes_tokenizer():
    tok = prepare.get_tokenizer("bytes")
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("bytes", 257, 256)
    text = "héllo ✓ 🐉\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and len(ids) == 16
    assert tok.decode(ids + [256]) == text  # EOT is skipped
    assert tok.decode([104, 0xFF, 105]) == "h\ufffdi"  # invalid UTF-8 is replaced, not raised


def test_unknown_tokenizer_names_valid_ones():
    with pytest.raises(ValueError, match="gpt2, bytes"):
        prepare.get_tokenizer("llama")


def test_split_stories():
    text = (f"a\n\nb\n{EOT}\n\n  \n{EOT}\r\nc {EOT} d\n {EOT}\ne\n{EOT}\nf without end\n")
    assert prepare.split_stories(text) == ["a\n\nb", f"c {EOT} d\n {EOT}\ne", "f without end"]


# ----------------------------------------------------------------------------- the CLI, bytes

@pytest.mark.parametrize("num_proc", [1, 2])
def test_bytes_end_to_end(tmp_path, num_proc):
    stories = make_stories(20)
    inp = write_release(tmp_path / "in.txt", stories)
    out = tmp_path / "out"
    # chunk_size 3 -> many chunks, so a wrong order across processes would show
    res = run("--input", inp, "--tokenizer", "bytes", "--out_dir", str(out),
              "--val_fraction", "0.1", "--num_proc", str(num_proc), "--chunk_size", "3")
    assert res.returncode == 0, res.stderr
    train, val = read_bin(out / "train.bin"), read_bin(out / "val.bin")
    assert train == expected_bytes_tokens(stories[:18])
    assert val == expected_bytes_tokens(stories[18:])
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]
    meta = json.loads((out / "meta.json").read_text())
    assert {k: meta[k] for k in ("tokenizer", "vocab_size", "eot_id", "train_tokens", "val_tokens",
                                 "train_stories", "val_stories")} == {
        "tokenizer": "bytes", "vocab_size": 257, "eot_id": 256,
        "train_tokens": sum(len(s.encode()) + 1 for s in stories[:18]),
        "val_tokens": sum(len(s.encode()) + 1 for s in stories[18:]),
        "train_stories": 18, "val_stories": 2}
    assert inp in meta["source"]
    st = os.stat(inp)
    assert meta["args"] == {"tokenizer": "bytes", "val_input": None, "val_fraction": 0.1,
                            "hf_stories": None,
                            "input": {"path": inp, "size": st.st_size, "mtime": st.st_mtime}}
    assert f"train: {meta['train_tokens']:,} tokens, 18 stories" in res.stdout
    assert "tokens/s" in res.stdout


# (stories, --val_fraction, val stories): the same split for an --input file and for --hf_stories
VAL_SPLITS = [(20, 0.05, 1), (20, 0.25, 5), (10, 0.01, 1), (3, 0.9, 2), (2, 0.5, 1),
              (5510, 0.05, 276)]


@pytest.mark.parametrize("n, frac, n_val", VAL_SPLITS)
def test_val_fraction_split(tmp_path, n, frac, n_val):
    stories = make_stories(n)
    inp = write_release(tmp_path / "in.txt", stories)
    res = run("--input", inp, "--tokenizer", "bytes", "--out_dir", str(tmp_path / "o"),
              "--val_fraction", str(frac), "--num_proc", "1")
    assert res.returncode == 0, res.stderr
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert (meta["train_stories"], meta["val_stories"]) == (n - n_val, n_val)
    assert read_bin(tmp_path / "o" / "val.bin") == expected_bytes_tokens(stories[n - n_val:])


def test_val_input(tmp_path):
    train_s, val_s = make_stories(5), ["Only one val story.", "And a second."]
    inp = write_release(tmp_path / "train.txt", train_s, noise=False)
    vinp = write_release(tmp_path / "val.txt", val_s)
    res = run("--input", inp, "--val_input", vinp, "--tokenizer", "bytes",
              "--out_dir", str(tmp_path / "o"), "--num_proc", "2")
    assert res.returncode == 0, res.stderr
    assert read_bin(tmp_path / "o" / "train.bin") == expected_bytes_tokens(train_s)
    assert read_bin(tmp_path / "o" / "val.bin") == expected_bytes_tokens(val_s)
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert (meta["train_stories"], meta["val_stories"]) == (5, 2)
    assert inp in meta["source"] and vinp in meta["source"]
    assert meta["args"]["val_input"]["path"] == vinp and meta["args"]["val_fraction"] is None


def test_rerun_skips_force_redoes_and_changes_redo(tmp_path):
    inp = write_release(tmp_path / "in.txt", make_stories(5))
    out = tmp_path / "o"
    args = ["--input", inp, "--tokenizer", "bytes", "--out_dir", str(out), "--num_proc", "1"]
    assert run(*args).returncode == 0
    old = 1_000_000_000 * 10**9  # set an old mtime, so any rewrite shows
    os.utime(out / "train.bin", ns=(old, old))

    res = run(*args)
    assert res.returncode == 0 and res.stderr == ""
    assert res.stdout.strip().splitlines() == [
        f"{out} is already prepared with these arguments (pass --force to redo)"]
    assert os.stat(out / "train.bin").st_mtime_ns == old

    res = run(*args, "--force")
    assert res.returncode == 0 and "already prepared" not in res.stdout
    assert os.stat(out / "train.bin").st_mtime_ns != old

    # a different val_fraction, or a changed input file, is redone without --force
    os.utime(out / "train.bin", ns=(old, old))
    assert "already prepared" not in run(*args, "--val_fraction", "0.5").stdout
    assert json.loads((out / "meta.json").read_text())["val_stories"] == 2
    write_release(inp, make_stories(6))
    assert "already prepared" not in run(*args).stdout
    assert json.loads((out / "meta.json").read_text())["train_stories"] == 5


def test_input_path_never_imports_datasets(tmp_path):
    inp = write_release(tmp_path / "in.txt", make_stories(3))
    code = ("import sys, prepare; assert 'datasets' not in sys.modules; "
            f"prepare.main(['--input', {inp!r}, '--tokenizer', 'bytes', '--out_dir', "
            f"{str(tmp_path / 'o')!r}, '--num_proc', '1']); print('datasets' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "False"


# ----------------------------------------------------------------------------- errors

def _bad_utf8(tmp_path):
    p = tmp_path / "bad.txt"
    p.write_bytes(f"ok story\n{EOT}\n".encode() + b"caf\xe9\n" + f"{EOT}\n".encode())
    return ["--input", str(p)], "not valid UTF-8 (byte offset 26)"


def _text(tmp_path, content):
    (tmp_path / "in.txt").write_text(content)
    return ["--input", str(tmp_path / "in.txt")]


ERROR_CASES = {
    "missing input": lambda t: (["--input", str(t / "nope.txt")], "not found"),
    "input is a directory": lambda t: (["--input", str(t)], "is a directory"),
    "missing val_input": lambda t: (["--input", write_release(t / "a.txt", make_stories(3)),
                                     "--val_input", str(t / "nope.txt")], "not found"),
    "empty input": lambda t: (_text(t, ""), "no stories found"),
    "only separators": lambda t: (_text(t, f"\n{EOT}\n  \n{EOT}\n"), "no stories found"),
    "one story, nothing for train": lambda t: (_text(t, f"just one\n{EOT}\n"), "need at least 2"),
    "non-UTF-8 input": _bad_utf8,
    "val_fraction 0": lambda t: (["--val_fraction", "0"], "--val_fraction must be in (0, 1)"),
    "val_fraction 1": lambda t: (["--val_fraction", "1"], "--val_fraction must be in (0, 1)"),
    "val_fraction -0.5": lambda t: (["--val_fraction=-0.5"], "--val_fraction must be in (0, 1)"),
}


@pytest.mark.parametrize("case", ERROR_CASES)
def test_user_errors_leave_good_dataset_untouched(tmp_path, good_dataset, case):
    args, message = ERROR_CASES[case](tmp_path)
    if "--input" not in args:
        args += ["--input", write_release(tmp_path / "ok.txt", make_stories(3))]
    out = tmp_path / "out"
    shutil.copytree(good_dataset, out)
    before = snapshot(out)
    res = run(*args, "--tokenizer", "bytes", "--out_dir", str(out), "--num_proc", "1", "--force")
    assert message in assert_one_error_line(res)
    assert snapshot(out) == before  # includes: no *.tmp left


@pytest.mark.parametrize("where", ["file", "under_file"])
def test_out_dir_is_a_file(tmp_path, where):
    inp = write_release(tmp_path / "in.txt", make_stories(3))
    (tmp_path / "f").write_text("x")
    out = tmp_path / "f" if where == "file" else tmp_path / "f" / "sub"
    res = run("--input", inp, "--tokenizer", "bytes", "--out_dir", str(out), "--num_proc", "1")
    assert "cannot create --out_dir" in assert_one_error_line(res)
    assert sorted(os.listdir(tmp_path)) == ["f", "in.txt"] and (tmp_path / "f").read_text() == "x"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root can write anywhere")
def test_out_dir_unwritable(tmp_path):
    inp = write_release(tmp_path / "in.txt", make_stories(3))
    out = tmp_path / "ro"
    out.mkdir(mode=0o500)
    try:
        res = run("--input", inp, "--tokenizer", "bytes", "--out_dir", str(out), "--num_proc", "1")
        assert "not writable" in assert_one_error_line(res)
        assert os.listdir(out) == []
    finally:
        out.chmod(0o700)


HUB_FIX = ("; connect to the internet, or use a local TinyStories file: --input FILE "
           "(make: TINYSTORIES=FILE)")


@pytest.mark.parametrize("route", [[], ["--hf_stories", "10"]], ids=["whole", "hf_stories"])
def test_hf_unreachable_is_one_quick_clear_error(tmp_path, route):
    # offline mode makes datasets fail at once, the same way an unreachable hub does
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf"))
    out = tmp_path / "out"
    t0 = time.time()
    res = run(*route, "--tokenizer", "bytes", "--out_dir", str(out), env=env, timeout=60)
    assert time.time() - t0 < 30
    line = assert_one_error_line(res)
    assert "could not load roneneldan/TinyStories from the Hugging Face hub (" in line
    assert line.endswith(")" + HUB_FIX)
    assert not out.exists()


# ----------------------------------------------------------------------------- --hf_stories

@pytest.fixture
def fake_hub(monkeypatch):
    """Stands in for the hub: synthetic splits, streamed one row at a time; records what is asked
    and read."""
    import datasets
    import huggingface_hub
    splits = {"train": make_stories(6000, "Train"), "validation": make_stories(300, "Val")}
    hub = SimpleNamespace(splits=splits, calls=[], served={}, fail=None)

    def stream(split):
        for text in hub.splits[split]:
            if hub.fail == "mid-stream" and hub.served.get(split) == 1:
                raise ConnectionError("connection reset\nby peer")
            hub.served[split] = hub.served.get(split, 0) + 1
            yield {"text": text}

    def load_dataset(path, split=None, streaming=False):
        hub.calls.append((path, split, streaming))
        if hub.fail == "load_dataset":
            raise ConnectionError("Couldn't reach the hub\nsecond line")
        return stream(split)

    def dataset_info(repo_id, timeout=None):
        if hub.fail == "dataset_info":
            raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(huggingface_hub, "dataset_info", dataset_info)
    return hub


def hf_args(out, n, *more):
    return ["--hf_stories", str(n), "--tokenizer", "bytes", "--out_dir", str(out),
            "--num_proc", "1", *more]


def main_error(argv, capsys):
    """prepare.main(argv) in-process -> the message of the UserError it raises, checking that
    nothing else was printed: the entry point prints that message as the one line the user sees."""
    with pytest.raises(UserError) as e:
        prepare.main(argv)
    assert capsys.readouterr().err == ""
    return str(e.value)


@pytest.mark.parametrize("n, frac, n_val", VAL_SPLITS)
def test_hf_stories_take_the_head_of_each_split(tmp_path, fake_hub, n, frac, n_val):
    out = tmp_path / "o"
    prepare.main(hf_args(out, n, "--val_fraction", str(frac)))
    assert fake_hub.calls == [("roneneldan/TinyStories", "train", True),
                              ("roneneldan/TinyStories", "validation", True)]
    # read no further than needed
    assert fake_hub.served == {"train": n - n_val, "validation": n_val}
    assert read_bin(out / "train.bin") == expected_bytes_tokens(make_stories(n - n_val, "Train"))
    assert read_bin(out / "val.bin") == expected_bytes_tokens(make_stories(n_val, "Val"))
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["train_stories"], meta["val_stories"]) == (n - n_val, n_val)
    assert meta["source"] == ("huggingface:roneneldan/TinyStories "
                              f"(first {n - n_val} train stories, "
                              f"first {n_val} validation stories)")
    assert meta["args"] == {"tokenizer": "bytes", "input": None, "val_input": None,
                            "hf_stories": n, "val_fraction": frac}


def test_hf_stories_rerun_skips_and_another_n_redoes(tmp_path, fake_hub, capsys):
    out = tmp_path / "o"
    prepare.main(hf_args(out, 20))
    old = 1_000_000_000 * 10**9  # set an old mtime, so any rewrite shows
    os.utime(out / "train.bin", ns=(old, old))
    fake_hub.calls.clear()
    capsys.readouterr()

    prepare.main(hf_args(out, 20))
    assert fake_hub.calls == [] and os.stat(out / "train.bin").st_mtime_ns == old
    assert capsys.readouterr().out == (
        f"{out} is already prepared with these arguments (pass --force to redo)\n")

    prepare.main(hf_args(out, 40))
    assert len(fake_hub.calls) == 2 and os.stat(out / "train.bin").st_mtime_ns != old
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["train_stories"], meta["val_stories"], meta["args"]["hf_stories"]) == (38, 2, 40)
    assert read_bin(out / "val.bin") == expected_bytes_tokens(make_stories(2, "Val"))


@pytest.mark.parametrize("fail, reason", [
    ("dataset_info", "OSError: [Errno -2] Name or service not known"),
    ("load_dataset", "ConnectionError: Couldn't reach the hub"),
    ("mid-stream", "ConnectionError: connection reset"),
], ids=["dataset_info", "load_dataset", "mid-stream"])
def test_hf_stories_hub_failure_is_one_line_and_writes_nothing(tmp_path, fake_hub, capsys,
                                                               fail, reason):
    fake_hub.fail = fail
    out = tmp_path / "o"
    assert main_error(hf_args(out, 20), capsys) == (
        f"could not load roneneldan/TinyStories from the Hugging Face hub ({reason}){HUB_FIX}")
    assert os.listdir(tmp_path) == []


def test_hf_stories_more_than_the_hub_has(tmp_path, fake_hub, capsys):
    fake_hub.splits["validation"] = make_stories(3, "Val")
    assert main_error(hf_args(tmp_path / "o", 20, "--val_fraction", "0.25"), capsys) == (
        "--hf_stories 20 needs 15 train and 5 validation stories, roneneldan/TinyStories "
        "gave 15 and 3; pass a smaller --hf_stories or --val_fraction")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("more, message", [
    (["--input", "in.txt"],
     "--hf_stories takes the stories from the hub, --input from a file; pass only one"),
    (["--hf_stories", "1"], "--hf_stories must be at least 2 (a train and a val story), got 1"),
    (["--hf_stories", "0"], "--hf_stories must be at least 2 (a train and a val story), got 0"),
], ids=["and_input", "n=1", "n=0"])
def test_hf_stories_usage_errors(tmp_path, fake_hub, capsys, more, message):
    write_release(tmp_path / "in.txt", make_stories(3))
    more = [str(tmp_path / m) if m == "in.txt" else m for m in more]
    assert main_error(hf_args(tmp_path / "o", 20, *more), capsys) == message
    assert fake_hub.calls == [] and os.listdir(tmp_path) == ["in.txt"]


class _InterruptingBar:
    """Stands in for tqdm: raises `exc` on the second progress update, i.e. mid-write."""
    exc = KeyboardInterrupt

    def __init__(self, *a, **k):
        self.calls = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n):
        self.calls += 1
        if self.calls == 2:
            raise self.exc()


@pytest.mark.parametrize("num_proc", [1, 2])
@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_interrupt_mid_write_leaves_nothing(tmp_path, good_dataset, monkeypatch, capsys,
                                            num_proc, exc):
    inp = write_release(tmp_path / "in.txt", make_stories(10))
    out = tmp_path / "out"
    shutil.copytree(good_dataset, out)
    before = snapshot(out)
    monkeypatch.setattr(tqdm, "tqdm", type("Bar", (_InterruptingBar,), {"exc": exc}))
    argv = ["--input", inp, "--tokenizer", "bytes", "--out_dir", str(out), "--force",
            "--num_proc", str(num_proc), "--chunk_size", "2"]
    if exc is KeyboardInterrupt:  # reported as one line, exit code 130
        with pytest.raises(SystemExit) as e:
            prepare.main(argv)
        assert e.value.code == 130
        err = capsys.readouterr().err
        assert err == "prepare.py: error: interrupted (temporary files removed)\n"
    else:  # a bug: the traceback is kept, but the temp files are still removed
        with pytest.raises(RuntimeError):
            prepare.main(argv)
    assert snapshot(out) == before


# ----------------------------------------------------------------------------- gpt2

def gpt2_encoding():
    """tiktoken's GPT-2 encoding: downloaded once, or from TIKTOKEN_CACHE_DIR offline."""
    try:
        import tiktoken
        enc = tiktoken.get_encoding("gpt2")
    except Exception as e:  # no network and no cache: nothing to test against
        pytest.skip(f"GPT-2 BPE files not available ({type(e).__name__})")
    return enc


@pytest.fixture
def gpt2_env():
    return gpt2_encoding()


def test_gpt2_end_to_end(tmp_path, gpt2_env):
    enc = gpt2_env
    tok = prepare.get_tokenizer("gpt2")
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("gpt2", 50257, 50256)
    stories = make_stories(6)
    for s in stories:
        assert tok.encode(s) == enc.encode_ordinary(s)  # the inline EOT string is plain text
        assert tok.decode(tok.encode(s)) == s
    inp = write_release(tmp_path / "in.txt", stories)
    res = run("--input", inp, "--out_dir", str(tmp_path / "o"), "--val_fraction", "0.34",
              "--num_proc", "2", "--chunk_size", "1", env=dict(os.environ))
    assert res.returncode == 0, res.stderr

    def expect(stories):
        return [t for s in stories for t in enc.encode_ordinary(s) + [50256]]

    assert read_bin(tmp_path / "o" / "train.bin") == expect(stories[:4])
    assert read_bin(tmp_path / "o" / "val.bin") == expect(stories[4:])
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot_id"]) == ("gpt2", 50257, 50256)
    assert meta["train_tokens"] == len(expect(stories[:4])) and meta["val_stories"] == 2
