"""bench.py: its naive reference is a correct MoE, and its last line is the promised JSON."""
import json
import subprocess
import sys

import torch

import bench
import train
from test_smoke import REPO, config, reference_moe


def test_naive_moe_equals_the_routed_moe_and_the_per_token_reference():
    torch.manual_seed(0)
    for top_k in (1, 2):
        moe = train.MoE(config(top_k=top_k), resid_std=0.02)
        with torch.no_grad():
            for p in moe.parameters():
                p.normal_()
        naive = train.MoE(config(top_k=top_k), resid_std=0.02)
        naive.load_state_dict(moe.state_dict())
        naive.__class__ = bench.NaiveMoE
        x = torch.randn(2, 9, 16)
        (y, aux), (y_naive, aux_naive) = moe(x), naive(x)
        torch.testing.assert_close(y_naive, y, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(y_naive.view(-1, 16), reference_moe(moe, x.view(-1, 16)), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(aux_naive['lb'], aux['lb'])


def test_bench_prints_a_table_and_ends_with_the_json_line():
    out = subprocess.run([sys.executable, 'bench.py', 'config/cpu_moe.py', '--steps=2', '--rounds=1',
                          '--d_model=16', '--moe_hidden=16', '--block_size=32', '--batch_size=4', '--ffn_multiple_of=1'],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith('naive_moe') for line in lines)
    result = json.loads(lines[-1])
    assert set(result['tokens_per_s']) == {'moe', 'dense_active', 'dense_total', 'naive_moe'}
    ms = result['ms_per_step']
    assert result['moe_over_dense_active'] == ms['moe'] / ms['dense_active']
    assert result['naive_over_moe'] == ms['naive_moe'] / ms['moe'] and result['compile'] is False
