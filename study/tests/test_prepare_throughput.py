"""study/prepare_throughput.py: prepare.py and tiktoken's batch call count the same tokens."""
import json
import os
import subprocess
import sys

from tests.conftest import REPO
from tests.test_prepare import gpt2_encoding, make_stories, write_release


def test_prepare_throughput_counts_the_same_tokens_both_ways(tmp_path):
    enc = gpt2_encoding()
    inp = write_release(tmp_path / "in.txt", make_stories(40))
    out = subprocess.run([sys.executable, '-m', 'study.prepare_throughput', '--input', inp,
                          '--num_proc', '2'], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ), timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    expected = sum(len(enc.encode_ordinary(s)) + 1 for s in make_stories(40))
    assert r["tokens"] == r["prepare_tokens"] == expected
    assert r["ratio"] == r["prepare_tokens_per_s"] / r["encode_ordinary_batch_tokens_per_s"]
