"""study/same_log.py: did a rerun reproduce a run?"""
import json
import subprocess
import sys

from tests.conftest import REPO


def test_same_log_accepts_a_rerun_and_names_what_differs(tmp_path):
    lines = [{'iter': 0, 'val_loss': 5.5, 'best_val': 5.5},
             {'iter': 10, 'loss': 3.25, 'tok_per_s': 1000.0}]
    for name, tok_per_s, val_loss in (('a', 1000.0, 5.5), ('b', 2000.0, 5.5), ('c', 1000.0, 5.25)):
        (tmp_path / name).mkdir()
        (lines[0]['val_loss'], lines[0]['best_val'],
         lines[1]['tok_per_s']) = val_loss, val_loss, tok_per_s
        (tmp_path / name / 'log.jsonl').write_text(
            ''.join(json.dumps(line) + '\n' for line in lines))

    def same(x, y):
        return subprocess.run(
            [sys.executable, '-m', 'study.same_log', str(tmp_path / x), str(tmp_path / y)],
            cwd=REPO, capture_output=True, text=True, timeout=60)
    out = same('a', 'b')  # only the throughput differs
    assert out.returncode == 0 and 'the same: 2 log lines' in out.stdout
    out = same('a', 'c')
    assert out.returncode == 1 and 'line 1: val_loss 5.5 != 5.25' in out.stdout
    assert out.stdout.splitlines()[-1] == 'best val loss: 5.5000 -> 5.2500 (-0.2500)'
    # a field one log never has (written before train.py logged it) is named, not compared
    old = [{k: v for k, v in line.items() if k != 'loss'} for line in lines]
    (tmp_path / 'old').mkdir()
    (tmp_path / 'old' / 'log.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in old))
    out = same('c', 'old')
    assert out.returncode == 0 and out.stdout.startswith('not compared, in one log only: loss\n')
    out = same('a', 'missing')
    assert out.returncode == 1 and 'missing' in out.stderr and 'log.jsonl' in out.stderr
