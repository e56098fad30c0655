"""The smoke test: prepare -> train -> sample end to end on tiny made-up stories, dense and MoE, and
what a run writes. It makes its own tiny data with the helpers of tests/conftest.py, which the unit
tests use too. CPU only.

    python -m pytest -q test_smoke.py
"""
import json
import math
import os
import shutil

import pytest
import torch

import sample
import train
from tests.conftest import REPO, TINY, prepare_tiny_data, run


@pytest.fixture(scope='module')
def prepared(tmp_path_factory):
    """The tiny data, prepared once for this file's runs."""
    return prepare_tiny_data(tmp_path_factory.mktemp('e2e'))


# (the run's name, its config, overrides): the CPU recipe's MoE and dense model, and the naive
# router, top-1 without load balancing
CASES = [('cpu_moe', 'cpu_moe', ()), ('cpu_dense_active', 'cpu_dense_active', ()),
         ('cpu_moe_top1_nolb', 'cpu_moe', ('--top_k=1', '--aux_loss_coef=0.0'))]


@pytest.mark.parametrize('name,cfg,overrides', CASES)
def test_prepare_train_sample_end_to_end(prepared, name, cfg, overrides):
    out_dir = prepared / name
    args = [f'config/{cfg}.py', *overrides, f'--config_name={name}']
    out = run('train.py', *args, f'--data_dir={prepared / "data"}', f'--out_dir={out_dir}', *TINY)
    assert out.returncode == 0, out.stderr
    log = [json.loads(line) for line in open(out_dir / 'log.jsonl')]
    evals = [r for r in log if 'val_loss' in r]
    assert [r['iter'] for r in evals] == [0, 20, 40]
    # uniform over 257 bytes at init
    assert evals[0]['val_loss'] == pytest.approx(math.log(257), abs=0.1)
    # synthetic stories are easy: it must learn
    assert evals[-1]['val_loss'] < 0.6 * evals[0]['val_loss']
    assert evals[-1]['best_val'] == min(r['val_loss'] for r in evals)
    steps = [r for r in log if 'ce' in r]
    assert [r['iter'] for r in steps] == [10, 20, 30, 40]
    assert all({'iter', 'tokens', 'loss', 'ce', 'lr', 'tok_per_s'} <= r.keys() for r in steps)
    assert all(('lb' in r) == name.startswith('cpu_moe') for r in steps)
    lb_coef = 0.0 if name == 'cpu_moe_top1_nolb' else 0.01
    # the logged training loss is CE plus the weighted aux losses
    for r in steps:
        assert r['loss'] == pytest.approx(
            r['ce'] + lb_coef * r.get('lb', 0) + 0.001 * r.get('z', 0), rel=1e-5)
    routing = ('load', 'busiest_frac', 'usage_var', 'router_entropy', 'log_z', 'dropped_frac',
               'layers')
    # MoE runs log routing health on every eval and training line; dense runs none of it
    for r in log:
        assert all((key in r) == name.startswith('cpu_moe') for key in routing)
        if 'layers' in r:
            assert len(r['layers']) == 2 and sum(r['load']) == pytest.approx(1.0)
            assert (0.25 <= r['busiest_frac'] <= 1.0
                    and 0 <= r['router_entropy'] <= math.log(4) + 1e-6)
    saved = json.load(open(out_dir / 'config.json'))
    assert saved['config_name'] == name and saved['params']['total'] > 0
    # every line holds the training FLOPs so far: tokens x the config's FLOPs per token
    assert saved['flops_per_token'] == train.flops_per_token(train.configure([*args, *TINY]))
    assert all(r['flops'] == r['tokens'] * saved['flops_per_token'] for r in log)
    assert (out_dir / 'best.pt').exists() and (out_dir / 'latest.pt').exists()
    assert not list(out_dir.glob('*.tmp'))

    out = run('sample.py', f'--out_dir={out_dir}', '--start=once upon a time', '--num_samples=2',
              '--max_new_tokens=60', '--temperature=0.5')
    assert out.returncode == 0, out.stderr
    samples = out.stdout.split('---------------')[:2]
    assert len(samples) == 2
    for text in samples:  # the prompt, continued by the model
        assert (text.strip().startswith('once upon a time')
                and len(text.strip()) > len('once upon a time') + 20)

    out = run('train.py', *args, f'--data_dir={prepared / "data"}', f'--out_dir={out_dir}', *TINY)
    # nothing overwritten
    assert out.returncode != 0 and 'already holds a run' in out.stderr


class FixedLogits(torch.nn.Module):
    """A stand-in model whose next-token logits are always [2, 1, 0, -1]."""
    block_size = 8

    def forward(self, idx):
        return torch.tensor([2.0, 1.0, 0.0, -1.0]).expand(*idx.shape, 4), None, {}


@pytest.mark.parametrize('temperature, top_k',
                         [(0, None), (1.0, 1), (1.0, 2), (0.5, None), (2.0, None), (2.0, 3)])
def test_sampling_follows_temperature_and_top_k(temperature, top_k):
    """20,000 one-token samples: the frequencies are softmax(logits / temperature) over the top_k
    logits."""
    torch.manual_seed(0)
    out = sample.generate(FixedLogits(), torch.zeros(20_000, 1, dtype=torch.long), 1,
                          temperature, top_k)[:, -1]
    freq = torch.bincount(out, minlength=4).float() / len(out)
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    if temperature == 0:
        expected = torch.tensor([1.0, 0, 0, 0])
    else:
        expected = torch.cat([(logits[:top_k or 4] / temperature).softmax(0),
                              torch.zeros(4 - (top_k or 4))])
    assert torch.equal(freq == 0, expected == 0)  # nothing outside the top_k, ever
    torch.testing.assert_close(freq, expected, rtol=0, atol=0.015)  # 4 standard errors at most


def test_greedy_sampling_is_deterministic(prepared):
    out_dir = prepared / 'cpu_moe'
    if not (out_dir / 'best.pt').exists():
        pytest.skip('needs the end-to-end MoE run')
    a = run('sample.py', f'--out_dir={out_dir}', '--temperature=0', '--max_new_tokens=40',
            '--num_samples=1', '--seed=1')
    b = run('sample.py', f'--out_dir={out_dir}', '--temperature=0', '--max_new_tokens=40',
            '--num_samples=1', '--seed=9')
    assert a.returncode == 0 and a.stdout == b.stdout


def test_sample_defaults_to_the_newest_finished_run(prepared, tmp_path):
    """No --out_dir: the run in out/ with the newest done.json and a best.pt, named on stderr."""
    if not all((prepared / cfg / 'done.json').exists() for cfg in ('cpu_moe', 'cpu_dense_active')):
        pytest.skip('needs the end-to-end MoE and dense runs')
    sample = (os.path.join(REPO, 'sample.py'), '--temperature=0', '--max_new_tokens=40',
              '--num_samples=1')
    out_root = tmp_path / 'out'
    # decoys, made the newest below: no done.json, no best.pt
    (out_root / 'unfinished').mkdir(parents=True)
    (out_root / 'no_best').mkdir()
    (out_root / 'no_best' / 'done.json').write_text('{}')
    shutil.copy(prepared / 'cpu_moe' / 'best.pt', out_root / 'unfinished')
    out = run(*sample, cwd=tmp_path)
    assert out.returncode != 0 and out.stdout == '' and out.stderr.count('\n') == 1
    assert ('no finished run in out/' in out.stderr and 'make cpu' in out.stderr
            and '--out_dir' in out.stderr)

    for cfg in ('cpu_moe', 'cpu_dense_active'):
        shutil.copytree(prepared / cfg, out_root / f'{cfg}-s1')
    stories = {}
    for newest, older in (('cpu_dense_active', 'cpu_moe'), ('cpu_moe', 'cpu_dense_active')):
        for t, done in enumerate((f'{older}-s1/done.json', f'{newest}-s1/done.json',
                                  'no_best/done.json')):
            os.utime(out_root / done, (1e9 + t, 1e9 + t))
        os.utime(out_root / 'unfinished' / 'best.pt', (2e9, 2e9))
        out = run(*sample, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert (f'sample.py: sampling from out/{newest}-s1 '
                '(the most recently finished run in out/)\n' in out.stderr)
        stories[newest] = out.stdout
    # each default sampled its own checkpoint
    assert stories['cpu_moe'] != stories['cpu_dense_active']
    out = run(*sample, f'--out_dir={out_root / "cpu_moe-s1"}', cwd=tmp_path)
    assert out.stdout == stories['cpu_moe'] and 'sampling from' not in out.stderr


def test_missing_data_and_checkpoint_errors(tmp_path):
    out = run('train.py', 'config/cpu_moe.py', f'--data_dir={tmp_path}',
              f'--out_dir={tmp_path / "o"}')
    assert out.returncode != 0 and 'prepare.py' in out.stderr and 'Traceback' not in out.stderr
    assert not (tmp_path / 'o').exists()
    out = run('sample.py', f'--out_dir={tmp_path}')
    assert out.returncode != 0 and 'no checkpoint' in out.stderr and 'Traceback' not in out.stderr
    (tmp_path / 'best.pt').write_bytes(b'not a checkpoint')
    out = run('sample.py', f'--out_dir={tmp_path}')
    assert (out.returncode != 0 and 'is not a plain checkpoint (damaged' in out.stderr
            and out.stderr.count('\n') == 1)
