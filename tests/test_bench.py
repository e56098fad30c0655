"""bench.py: its naive reference is a correct MoE, and its last line is the promised JSON."""
import json
import math
import subprocess
import sys

import pytest
import torch

import bench
import errors
import hardware
import train
from conftest import REPO, config, reference_moe


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
        torch.testing.assert_close(y_naive.view(-1, 16), reference_moe(moe, x.view(-1, 16)),
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(aux_naive['lb'], aux['lb'])


def test_bench_prints_a_table_and_ends_with_the_json_line():
    out = subprocess.run([sys.executable, 'bench.py', 'config/cpu_moe.py', '--steps=2',
                          '--rounds=1', '--d_model=16', '--moe_hidden=16', '--block_size=32',
                          '--batch_size=4', '--ffn_multiple_of=1', '--profile=True',
                          '--levers=bf16_ce,padded_vocab,expert_loop'],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith('naive_moe') for line in lines)

    def numbers_after(heading):
        """The first numbers of the 15 lines after the heading: '   +1.23  aten::mm'."""
        top = lines.index(next(line for line in lines if line.startswith(heading)))
        return [float(line.split()[0].rstrip('%')) for line in lines[top + 1:top + 16]]
    shares = numbers_after("where the MoE's step goes")
    assert len(shares) == 15 and shares == sorted(shares, reverse=True) and sum(shares) <= 100.05
    extra = numbers_after('where the MoE spends more')
    assert len(extra) == 15 and extra == sorted(extra, reverse=True)
    result = json.loads(lines[-1])
    assert set(result['tokens_per_s']) == {'moe', 'dense_active', 'dense_total', 'naive_moe',
                                           'bf16_ce', 'padded_vocab', 'expert_loop'}
    # in fp32 on a CPU, bf16_ce and expert_loop compute what the MoE does: the same first loss.
    # padded_vocab's softmax has 320 - 257 more classes, which at init add about ln(320 / 257)
    levers = result['levers']
    assert levers['bf16_ce']['first_loss_minus_moe'] == 0.0
    assert levers['expert_loop']['first_loss_minus_moe'] == 0.0
    assert abs(levers['padded_vocab']['first_loss_minus_moe'] - math.log(320 / 257)) < 0.01
    assert levers['bf16_ce']['over_moe'] == ms_ratio(result, 'bf16_ce', 'moe')
    assert result['mfu'] is None and result['peak_flops'] is None  # no known peak for a CPU
    ms = result['ms_per_step']
    assert result['moe_over_dense_active'] == ms['moe'] / ms['dense_active']
    low, high = result['moe_over_dense_active_quartiles']
    assert f'middle half of the per-step ratios: {low:.3f} to {high:.3f}' in out.stdout
    assert result['naive_over_moe'] == ms['naive_moe'] / ms['moe'] and result['compile'] is False
    # one round: its ratio of medians is the whole run's
    rounds = result['dense_total_over_moe_rounds']
    assert rounds['rounds'] == [ms['dense_total'] / ms['moe']] == [rounds['q1']]
    # which machine and torch measured it: a step time means little without them
    assert result['hardware'] == hardware.cpu_name() and result['torch'] == torch.__version__


def ms_ratio(result, name, reference):
    return result['ms_per_step'][name] / result['ms_per_step'][reference]


def test_levers_compute_what_they_are_named(monkeypatch):
    """expert_loop is the MoE's loop over the experts where grouped_mm would run (grouped_mm in
    fp32 on a CPU: the same sums, other order); bf16_ce takes the cross-entropy of the bf16
    logits, a bf16 number within a few bf16 roundings (2^-8 each) of the fp32 copy's."""
    torch.manual_seed(0)
    c = config(n_experts=4, top_k=2)
    x = torch.randn(3, 11, 16)
    moe = train.MoE(c, resid_std=0.02)
    loop = train.MoE(c, resid_std=0.02)
    loop.load_state_dict(moe.state_dict())
    loop.__class__ = bench.ExpertLoopMoE
    monkeypatch.setattr(train, 'grouped_mm_ok', lambda xs, hidden: True)
    torch.testing.assert_close(loop(x)[0], moe(x)[0], rtol=1e-5, atol=1e-6)
    idx = torch.randint(0, c.vocab_size, (3, c.block_size + 1))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        _, fp32, _ = bench.make_model('moe', c)(idx[:, :-1], idx[:, 1:])
        _, bf16, _ = bench.make_model('bf16_ce', c)(idx[:, :-1], idx[:, 1:])
    assert bf16 == bf16.bfloat16().float() and fp32 != fp32.bfloat16().float()
    assert abs(bf16 - fp32) <= 0.02 * fp32
    assert bench.build(['--vocab_size=257'], ['padded_vocab'])['padded_vocab'].vocab_size == 320


@pytest.mark.parametrize('argv, message', [
    (['--levers=fast'], "no lever 'fast'; --levers takes a comma-separated list of bf16_ce"),
    (['--levers=reduce_overhead'], '--levers: reduce_overhead, max_autotune are ways of compiling; '
                                   'add --compile=True')])
def test_a_lever_bench_cannot_time_is_one_line_naming_the_fix(argv, message):
    out = subprocess.run([sys.executable, 'bench.py', 'config/cpu_moe.py', *argv], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and len(out.stderr.splitlines()) == 1
    assert out.stderr.startswith(f'bench.py: error: {message}')


def test_bench_gives_the_mfu_where_the_peak_is_known(monkeypatch, capsys):
    """A CPU given a made-up peak of 1 GFLOP/s: each model's MFU is its tokens/s times its FLOPs a
    token over the peak, in the JSON and in the table's last column."""
    monkeypatch.setattr(hardware, 'peak_flops', lambda device: 1e9)
    model = ['config/cpu_moe.py', '--d_model=16', '--moe_hidden=16', '--block_size=32',
             '--batch_size=4', '--ffn_multiple_of=1']
    bench.main(model + ['--steps=2', '--rounds=1'])
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    for name, cfg in bench.build(model).items():
        mfu = result['tokens_per_s'][name] * train.flops_per_token(cfg) / 1e9
        assert result['mfu'][name] == mfu
        assert next(line for line in lines if line.startswith(name + ' ')).endswith(f'{mfu:.1%}')


def test_paired_ratio_quartiles_pair_each_step_with_the_reference_step():
    # ratios 1, 2, 3, 4, 5 step by step (sorting either list alone would pair them differently)
    assert bench.paired_ratio_quartiles([5.0, 2.0, 6.0, 12.0, 10.0],
                                        [5.0, 1.0, 2.0, 3.0, 2.0]) == (1.5, 4.5)


def test_round_ratios_take_each_rounds_medians():
    # 2 rounds of 3 steps: the model's medians 2 and 4, the reference's 3 and 10 -> 1.5 and 2.5
    ratios = bench.round_ratios([1.0, 2.0, 9.0, 4.0, 4.0, 5.0], [3.0, 3.0, 3.0, 10.0, 1.0, 11.0], 2)
    assert ratios == {'median': 2.0, 'q1': 1.75, 'q3': 2.25, 'rounds': [1.5, 2.5]}
    assert bench.round_ratios([2.0, 4.0], [3.0, 6.0], 1) == {'median': 1.5, 'q1': 1.5, 'q3': 1.5,
                                                             'rounds': [1.5]}


def test_bench_refuses_fewer_than_two_timed_steps():
    out = subprocess.run([sys.executable, 'bench.py', 'config/cpu_moe.py', '--steps=1',
                          '--rounds=1'],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and 'at least 2 steps' in out.stderr and out.stdout == ''


def test_naive_moe_compiles_without_graph_breaks():
    """Timed compiled, the reference must be one graph too, or the bench would time dynamo's
    breaks."""
    torch._dynamo.reset()
    naive = train.MoE(config(top_k=2), resid_std=0.02)
    naive.__class__ = bench.NaiveMoE
    explained = torch._dynamo.explain(naive)(torch.randn(2, 9, 16))
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_grouped_mm_path_equals_the_expert_loop(monkeypatch):
    """The GPU path (one grouped_mm per matrix for all experts) against the CPU loop over experts:
    same outputs and gradients. F.grouped_mm also runs on a CPU in fp32, slowly, so the path is
    tested here."""
    torch.manual_seed(0)
    moe = train.MoE(config(n_experts=4, top_k=2), resid_std=0.02)
    x = torch.randn(3, 11, 16)
    results = []
    for grouped in (False, True):
        monkeypatch.setattr(train, 'grouped_mm_ok', lambda xs, hidden: grouped)
        moe.zero_grad()
        xg = x.clone().requires_grad_()
        y, aux = moe(xg)
        (y.square().sum() + aux['lb'] + aux['z']).backward()
        results.append([y, xg.grad] + [p.grad for p in moe.parameters()])
    for loop, grouped in zip(*results):
        torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-6)


def test_compiled_moe_training_compiles_once_while_the_routing_changes():
    """30 compiled training steps at a high learning rate: the tokens per expert change from step to
    step, yet torch.compile captures one graph and never recompiles (dynamo's counters). aot_eager
    traces forward and backward as inductor would, without its slow C++ codegen."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    c = config(n_layer=2)
    model = train.Transformer(c)
    compiled = torch.compile(model, backend='aot_eager')
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    loads = set()
    for step in range(30):
        idx = torch.randint(0, c.vocab_size, (4, c.block_size + 1))
        _, ce, aux = compiled(idx[:, :-1], idx[:, 1:])
        train.training_loss(ce, aux, c).backward()
        opt.step()
        opt.zero_grad()
        load, _, _ = train.unpack_routing(aux['routing'][0])
        loads.add(tuple(load.tolist()))
    assert len(loads) > 20  # the routing really did change
    assert counters['stats']['unique_graphs'] == 1 and sum(counters['graph_break'].values()) == 0
    assert counters['stats']['calls_captured'] > 0


def test_what_a_gpu_machine_runs_imports_with_nothing_but_torch_and_numpy():
    """A GPU machine may have nothing else: train.py, sample.py, bench.py and gpu_check.py import
    with the other packages blocked, as if not installed (export_hf.py needs safetensors, by
    design; gpu_check.py imports transformers only to compare the export's logits)."""
    blocked = ['tqdm', 'tiktoken', 'datasets', 'matplotlib', 'safetensors', 'transformers']
    code = ['import sys', *[f'sys.modules[{name!r}] = None' for name in blocked],
            'import train, sample, bench, gpu_check']
    out = subprocess.run([sys.executable, '-c', '\n'.join(code)], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_grouped_mm_is_only_used_where_its_kernels_run():
    bf16 = torch.zeros(4, 16, dtype=torch.bfloat16)
    assert not train.grouped_mm_ok(bf16, 32)  # on the CPU: the loop
    assert not train.grouped_mm_ok(torch.zeros(4, 44), 88)  # fp32
    if torch.cuda.is_available():
        assert (train.grouped_mm_ok(bf16.cuda(), 32)
                and not train.grouped_mm_ok(bf16[:, :12].cuda(), 32))


def test_layer_times_the_moe_in_parts_that_add_up_to_it():
    """--layer: the dense SwiGLU, the MoE layer and its routing, dispatch and expert matmuls, each
    a forward and backward; the shares in the JSON are of the MoE layer's median."""
    out = subprocess.run([sys.executable, 'bench.py', 'config/cpu_moe.py', '--layer=True',
                          '--rounds=1', '--d_model=16', '--moe_hidden=16', '--block_size=32',
                          '--batch_size=4', '--ffn_multiple_of=1'],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    ms, shares = result['layer_ms'], result['layer_shares']
    assert list(ms) == ['dense_active', 'moe', 'routing', 'dispatch', 'experts', 'remainder']
    assert ms['remainder'] == ms['moe'] - ms['routing'] - ms['dispatch'] - ms['experts']
    assert shares['routing'] == ms['routing'] / ms['moe']
    assert shares['not_experts'] == 1 - ms['experts'] / ms['moe']
    assert result['hardware'] == hardware.cpu_name()
    refused = subprocess.run([sys.executable, 'bench.py', 'config/cpu_moe.py', '--layer=True',
                              '--compile=True'], cwd=REPO, capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode != 0 and 'leave out' in refused.stderr.splitlines()[-1]


def test_the_dispatch_part_passes_each_row_through_times_its_weights():
    """NoExperts' dispatch returns each token's row times the sum of its routing weights: the row
    itself at top-2, whose weights are renormalised to sum to 1."""
    torch.manual_seed(0)
    c = config(n_experts=3, top_k=2)
    x = torch.randn(7, 16)
    weights, experts = train.MoE(c, resid_std=0.02).route(x)[2:]
    y, counts = bench.NoExperts(c, resid_std=0.02).dispatch(x, weights, experts)
    torch.testing.assert_close(y, x)
    assert counts.tolist() == experts.bincount(minlength=3).tolist()


def test_bench_times_a_variant_against_dense_models_matched_to_it():
    """The dense models take the variant's sizes but none of its MoE-only settings (the selection
    bias)."""
    # the aux-loss-free variant: the selection bias instead of the Switch loss
    variant = ['config/cpu_moe.py', '--bias_rate=1e-3', '--aux_loss_coef=0.0']
    out = subprocess.run([sys.executable, 'bench.py', *variant, '--steps=1',
                          '--rounds=2', '--d_model=16', '--moe_hidden=16', '--block_size=32',
                          '--batch_size=4', '--ffn_multiple_of=1'],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result['ms_per_step']) == {'moe', 'dense_active', 'dense_total', 'naive_moe'}


def test_a_bench_file_without_the_json_line_is_one_clear_error(tmp_path):
    bench_file = tmp_path / 'cpu_moe.txt'
    bench_file.write_text('the table, cut off before the JSON line\n')
    with pytest.raises(errors.UserError, match='make it with: OMP_NUM_THREADS=1 python bench'):
        bench.read_step_times(bench_file)
