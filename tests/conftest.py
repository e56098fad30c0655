"""Helpers and fixtures shared by test_smoke.py (at the top of the repository) and the tests in this
folder. Every test makes its own small data; CPU only."""
import json
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # train.py & co.
import train  # noqa: E402


def config(**overrides):
    """A resolved config through the real configurator, tiny by default."""
    tiny = dict(vocab_size=257, block_size=16, n_layer=2, n_head=2, d_model=16, moe_hidden=24,
                ffn='moe')
    return train.configure([f'--{k}={v!r}' for k, v in {**tiny, **overrides}.items()])


def run(*args, cwd=REPO):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def read_log(run_dir):
    """A run's log.jsonl records without tok_per_s, the one field that depends on the clock."""
    records = [json.loads(line) for line in open(os.path.join(run_dir, 'log.jsonl'))]
    return [{k: v for k, v in r.items() if k != 'tok_per_s'} for r in records]


def write_stories(path, n, seed=0):
    """Synthetic stories in the TinyStories release format: a story, then a line <|endoftext|>."""
    rng = random.Random(seed)
    names, animals = ['lily', 'tom', 'mia', 'ben', 'sue'], ['cat', 'dog', 'bird', 'fox']
    places, verbs = ['park', 'garden', 'house', 'forest'], ['play', 'run', 'sing', 'jump']
    with open(path, 'w', encoding='utf-8') as f:
        for _ in range(n):
            name, animal, place, verb = (rng.choice(x) for x in (names, animals, places, verbs))
            f.write(f'once upon a time, {name} had a {animal}. they liked to {verb} in the '
                    f'{place}.\n\n'
                    f'one day, the {animal} said, "let us {verb}!" {name} was happy.\n'
                    '<|endoftext|>\n')


# ----------------------------------------------------------------------------- MoE layer
def expert_output(moe, i, v):
    """Expert i's SwiGLU on one token's vector v."""
    return (F.silu(v @ moe.gate[i]) * (v @ moe.up[i])) @ moe.down[i]


def reference_moe(moe, x):
    """The simplest correct MoE: one token at a time, each of its top_k experts (chosen by
    probability plus the selection bias, if any), weighted by probability alone; plus the shared
    expert's SwiGLU, if any."""
    probs = (x.float() @ moe.router.weight.float().T).softmax(-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        e = (probs[t] if moe.bias is None else probs[t] + moe.bias).topk(moe.top_k).indices
        w = probs[t][e]
        # Mixtral renormalises top-k weights; top-1 keeps its probability (Switch)
        if moe.top_k > 1:
            w = w / w.sum()
        for weight, i in zip(w, e.tolist()):
            out[t] += weight * expert_output(moe, i, x[t])
        if moe.shared is not None:
            s = moe.shared
            out[t] += (F.silu(x[t] @ s.gate.weight.T) * (x[t] @ s.up.weight.T)) @ s.down.weight.T
    return out


# ----------------------------------------------------------------------------- end to end
def interrupt_training(monkeypatch, argv, at_call):
    """train.main(argv) stopped by a KeyboardInterrupt in its at_call-th training loss, as a Ctrl-C
    would: its out_dir keeps what was saved before (latest.pt, log.jsonl)."""
    real_loss, calls = train.training_loss, []

    def loss_then_interrupt(ce, aux, c):
        calls.append(1)
        if len(calls) == at_call:
            raise KeyboardInterrupt
        return real_loss(ce, aux, c)
    monkeypatch.setattr(train, 'training_loss', loss_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        train.main(argv)
    monkeypatch.setattr(train, 'training_loss', real_loss)


# a run of 40 steps: the warmup 2% of them (one step), not the CPU recipe's 224 steps
TINY = ['--d_model=32', '--n_layer=2', '--n_head=2', '--moe_hidden=32', '--block_size=32',
        '--batch_size=8', '--max_iters=40', '--eval_interval=20', '--log_interval=10',
        '--learning_rate=0.01', '--min_lr=0.001', '--warmup_iters=0']


def prepare_tiny_data(root):
    """300 made-up stories prepared as bytes into root/data, as make cpu prepares the real ones."""
    pytest.importorskip('tqdm', reason="prepare.py's progress bar needs tqdm")
    write_stories(root / 'stories.txt', 300)
    out = run('prepare.py', '--input', str(root / 'stories.txt'), '--tokenizer', 'bytes',
              '--out_dir', str(root / 'data'))
    assert out.returncode == 0, out.stderr
    return root


@pytest.fixture(scope='module')
def prepared(tmp_path_factory):
    return prepare_tiny_data(tmp_path_factory.mktemp('e2e'))
