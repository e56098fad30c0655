"""bench.py: its naive reference is a correct MoE, and its last line is the promised JSON."""
import json
import subprocess
import sys

import pytest
import torch

import bench
import plumbing
import train
from conftest import REPO, config, expert_output, reference_moe


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
                          '--stages=True'],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith('naive_moe') for line in lines)
    top = lines.index(next(line for line in lines
                           if line.startswith('where the MoE spends more')))
    # '   +1.23  aten::mm' lines
    extra = [float(line.split()[0]) for line in lines[top + 1:top + 16]]
    assert len(extra) == 15 and extra == sorted(extra, reverse=True)
    result = json.loads(lines[-1])
    assert set(result['tokens_per_s']) == {'moe', 'dense_active', 'dense_total', 'naive_moe',
                                           'experts_only', 'routed'}
    ms = result['ms_per_step']
    assert result['moe_over_dense_active'] == ms['moe'] / ms['dense_active']
    low, high = result['moe_over_dense_active_quartiles']
    assert f'middle half of the per-step ratios: {low:.3f} to {high:.3f}' in out.stdout
    assert result['naive_over_moe'] == ms['naive_moe'] / ms['moe'] and result['compile'] is False
    # one round: its ratio of medians is the whole run's
    rounds = result['dense_total_over_moe_rounds']
    assert rounds['rounds'] == [ms['dense_total'] / ms['moe']] == [rounds['q1']]
    # which machine and torch measured it: a step time means little without them
    assert result['hardware'] == plumbing.cpu_name() and result['torch'] == torch.__version__
    stages = result['stages_over_dense_active']
    assert (list(stages) == ['experts_only', 'routed', 'moe']
            and stages['moe'] == result['moe_over_dense_active'])
    assert f'+ router and grouping {stages["routed"]:.3f}' in out.stdout


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


def test_gpu_check_dry_run_on_cpu(tmp_path):
    """scripts/gpu_check.py --device=cpu --tiny: the GPU check's own logic (synthetic memmap, both
    trainings through train.py, steady-state throughput, MFU, ratio, the JSON file) at toy
    shapes."""
    out_file = tmp_path / 'gpu' / 'check.json'
    out = subprocess.run([sys.executable, 'scripts/gpu_check.py', '--device=cpu', '--tiny',
                          '--steps=6', f'--out={out_file}'],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.load(open(out_file))
    assert r == json.loads(out.stdout.strip().splitlines()[-1])
    assert r['hardware'] == plumbing.cpu_name() and r['torch'] == torch.__version__
    moe, dense = r['models']['moe'], r['models']['dense_active']
    assert r['moe_over_dense_active'] == moe['ms_per_step'] / dense['ms_per_step']
    for m in (moe, dense):
        assert (m['tokens_per_s'] > 0
                and m['mfu'] == m['flops_per_token'] * m['tokens_per_s'] / r['peak_flops'])
    assert (moe['params']['total'] > moe['params']['active']
            and abs(moe['params']['active'] / dense['params']['active'] - 1) < 0.01)


def test_what_a_gpu_machine_runs_imports_with_nothing_but_torch_and_numpy():
    """The GPU machine may have nothing else: train.py, sample.py and the GPU scripts import with
    the other packages blocked, as if not installed (export_hf.py needs safetensors, by design)."""
    blocked = ['tqdm', 'tiktoken', 'datasets', 'matplotlib', 'safetensors', 'transformers']
    code = ['import sys', "sys.path.insert(0, 'scripts')",
            *[f'sys.modules[{name!r}] = None' for name in blocked],
            'import train, sample, gpu_check, gpu_real_text, gpu_levers, paper_on_cpu']
    out = subprocess.run([sys.executable, '-c', '\n'.join(code)], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason='this machine has a GPU')
def test_gpu_check_refuses_cuda_without_a_gpu():
    out = subprocess.run([sys.executable, 'scripts/gpu_check.py'], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and '--device=cpu --tiny' in out.stderr


def test_grouped_mm_is_only_used_where_its_kernels_run():
    bf16 = torch.zeros(4, 16, dtype=torch.bfloat16)
    assert not train.grouped_mm_ok(bf16, 32)  # on the CPU: the loop
    assert not train.grouped_mm_ok(torch.zeros(4, 44), 88)  # fp32
    if torch.cuda.is_available():
        assert (train.grouped_mm_ok(bf16.cuda(), 32)
                and not train.grouped_mm_ok(bf16[:, :12].cuda(), 32))


def test_gpu_check_default_settings_are_a_valid_config():
    """The default (paper-scale, 300 steps) arguments go through train.py's configurator without
    error."""
    import gpu_check  # scripts/, on the path through conftest
    for tiny in (False, True):
        steps = 8 if tiny else 300
        c = train.configure(['config/moe.py'] + gpu_check.train_args(steps, tiny))
        assert c.max_iters == steps and c.ckpt_interval % c.log_interval == 0


def test_stages_compute_what_they_are_named():
    """experts_only runs expert e on the e-th near-equal slice of the tokens' k copies and sums the
    copies; routed is the MoE layer's output, router gradient included, without the aux losses;
    bench times each as its own class."""
    torch.manual_seed(0)
    moe = train.MoE(config(n_experts=3, top_k=2), resid_std=0.02)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_()
    experts_only, routed = (train.MoE(config(n_experts=3, top_k=2), resid_std=0.02)
                            for _ in range(2))
    for stage, cls in ((experts_only, bench.ExpertsOnlyMoE), (routed, bench.RoutedMoE)):
        stage.load_state_dict(moe.state_dict())
        stage.__class__ = cls
    x = torch.randn(5, 16)
    # 10 rows over 3 experts: 3, 3, 4
    rows, owner = x.repeat(2, 1), [0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    expected = torch.stack([expert_output(moe, owner[r], rows[r])
                            for r in range(10)]).view(2, 5, 16).sum(dim=0)
    y, aux = experts_only(x)
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
    assert aux['lb'].item() == aux['z'].item() == 0 and aux['routing'].shape == (5,)
    y, aux = routed(x)
    assert torch.equal(y, moe(x)[0]) and aux['lb'].item() == 0
    y.sum().backward()
    assert routed.router.weight.grad is not None
    c = config(n_experts=3, top_k=2)
    for name, cls in (('moe', train.MoE), ('naive_moe', bench.NaiveMoE),
                      ('experts_only', bench.ExpertsOnlyMoE), ('routed', bench.RoutedMoE)):
        assert all(type(block.ffn) is cls for block in bench.make_model(name, c).blocks)


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
    with pytest.raises(plumbing.UserError, match='make it with: OMP_NUM_THREADS=1 python bench'):
        bench.read_step_times(bench_file)
