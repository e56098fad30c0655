"""Behaviour tests for train.py and sample.py. Every test makes its own small data; CPU only."""
import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import train

REPO = os.path.dirname(os.path.abspath(__file__))


def config(**overrides):
    """A resolved config through the real configurator, tiny by default."""
    tiny = dict(vocab_size=257, block_size=16, n_layer=2, n_head=2, d_model=16, moe_hidden=24, ffn='moe')
    return train.configure([f'--{k}={v!r}' for k, v in {**tiny, **overrides}.items()])


def run(*args, cwd=REPO):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def write_stories(path, n, seed=0):
    """Synthetic stories in the TinyStories release format: a story, then a line <|endoftext|>."""
    rng = random.Random(seed)
    names, animals = ['lily', 'tom', 'mia', 'ben', 'sue'], ['cat', 'dog', 'bird', 'fox']
    places, verbs = ['park', 'garden', 'house', 'forest'], ['play', 'run', 'sing', 'jump']
    with open(path, 'w', encoding='utf-8') as f:
        for _ in range(n):
            name, animal, place, verb = (rng.choice(x) for x in (names, animals, places, verbs))
            f.write(f'once upon a time, {name} had a {animal}. they liked to {verb} in the {place}.\n\n'
                    f'one day, the {animal} said, "let us {verb}!" {name} was happy.\n<|endoftext|>\n')


# ----------------------------------------------------------------------------- MoE layer
def expert_output(moe, i, v):
    """Expert i's SwiGLU on one token's vector v."""
    return (F.silu(v @ moe.gate[i]) * (v @ moe.up[i])) @ moe.down[i]


def reference_moe(moe, x):
    """The simplest correct MoE: one token at a time, each of its top_k experts, gate-weighted."""
    probs = (x.float() @ moe.router.weight.float().T).softmax(-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        w, e = probs[t].topk(moe.top_k)
        if moe.top_k > 1:  # Mixtral renormalises top-k weights; top-1 keeps its probability (Switch)
            w = w / w.sum()
        for weight, i in zip(w, e.tolist()):
            out[t] += weight * expert_output(moe, i, x[t])
    return out


@pytest.mark.parametrize('top_k', [1, 2])
def test_moe_matches_per_token_reference(top_k):
    torch.manual_seed(0)
    moe = train.MoE(config(top_k=top_k), resid_std=0.02)
    with torch.no_grad():  # larger weights than init, so routing and outputs are far from trivial
        for p in moe.parameters():
            p.normal_()
    x = torch.randn(3, 7, 16, requires_grad=True)
    y, aux = moe(x)
    assert y.shape == x.shape
    y_ref = reference_moe(moe, x.view(-1, 16))
    torch.testing.assert_close(y.view(-1, 16), y_ref, rtol=1e-4, atol=1e-4)
    assert aux['routing'][:4].sum().item() == pytest.approx(1.0)  # the experts' loads
    # and the gradients (through dispatch, experts, gate weights and router) equal the reference's
    probe = torch.randn_like(y_ref)
    inputs = [x] + list(moe.parameters())
    grads = torch.autograd.grad((y.view(-1, 16) * probe).sum(), inputs)
    grads_ref = torch.autograd.grad((y_ref * probe).sum(), inputs)
    for grad, grad_ref in zip(grads, grads_ref):
        torch.testing.assert_close(grad, grad_ref, rtol=1e-4, atol=1e-4)


def test_dispatch_with_an_idle_expert_matches_a_per_assignment_reference():
    """dispatch() on hand-made assignments where expert 2 gets no token and expert 1 gets every token's
    second slot: outputs, counts and all gradients against one assignment at a time."""
    torch.manual_seed(0)
    moe = train.MoE(config(n_experts=4, top_k=2), resid_std=0.02)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_()
    N = 10
    x = torch.randn(N, 16, requires_grad=True)
    experts = torch.cat([torch.tensor([0, 3])[torch.randint(0, 2, (N,))], torch.ones(N, dtype=torch.long)])
    weights = torch.rand(2 * N, requires_grad=True)
    y, counts = moe.dispatch(x, weights, experts)
    assert counts.tolist() == experts.bincount(minlength=4).tolist() and counts[2] == 0
    y_ref = torch.zeros_like(x)
    for a, i in enumerate(experts.tolist()):  # slot-major: assignment a is token a % N
        y_ref = y_ref.index_add(0, torch.tensor([a % N]), (weights[a] * expert_output(moe, i, x[a % N]))[None])
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    probe = torch.randn_like(y)
    inputs = [x, weights, moe.gate, moe.up, moe.down]  # (the router is not used by dispatch)
    for grad, grad_ref in zip(torch.autograd.grad((y * probe).sum(), inputs),
                              torch.autograd.grad((y_ref * probe).sum(), inputs)):
        torch.testing.assert_close(grad, grad_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('copies', [1, 3])
def test_gather_rows_equals_repeat_then_index(copies):
    """gather_rows(x, perm % len(x), inverse) is x.repeat(copies, 1)[perm], gradient included."""
    torch.manual_seed(0)
    x = torch.randn(5, 4, requires_grad=True)
    perm = torch.randperm(5 * copies)
    y = train.gather_rows(x, perm % 5, perm.argsort())
    y_ref = x.repeat(copies, 1)[perm]
    assert torch.equal(y, y_ref)
    probe = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad((y * probe).sum(), x)[0],
                               torch.autograd.grad((y_ref * probe).sum(), x)[0])


def test_one_expert_top1_equals_dense_swiglu():
    torch.manual_seed(0)
    moe = train.MoE(config(n_experts=1, top_k=1), resid_std=0.02)
    dense = train.SwiGLU(16, 24, resid_std=0.02)
    with torch.no_grad():  # nn.Linear stores (out, in); the stacked experts store (in, out)
        dense.gate.weight.copy_(moe.gate[0].T)
        dense.up.weight.copy_(moe.up[0].T)
        dense.down.weight.copy_(moe.down[0].T)
    x = torch.randn(2, 5, 16)
    y, aux = moe(x)
    torch.testing.assert_close(y, dense(x))
    assert aux['lb'].item() == pytest.approx(1.0)  # one expert is trivially "balanced"


def routed_moe(n_tokens_per_expert, collapse):
    """A 4-expert top-1 layer with d_model 4 and an identity router, fed one-hot tokens: either cycling
    through the experts (perfect balance) or all pointing at expert 0 (total collapse)."""
    moe = train.MoE(config(d_model=4, n_head=1, n_experts=4, top_k=1), resid_std=0.02)
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(4))
    experts = torch.zeros(4 * n_tokens_per_expert, dtype=torch.long) if collapse else \
        torch.arange(4).repeat(n_tokens_per_expert)
    x = 200.0 * F.one_hot(experts, 4).float()  # logits 200 vs 0: probability 1 in fp32
    return moe, x.unsqueeze(0)


def test_load_balancing_loss_is_1_when_balanced_and_n_experts_when_collapsed():
    moe, x = routed_moe(5, collapse=False)
    _, aux = moe(x)
    assert aux['lb'].item() == pytest.approx(1.0, abs=1e-6)
    moe, x = routed_moe(5, collapse=True)
    _, aux = moe(x)
    assert aux['lb'].item() == pytest.approx(4.0, abs=1e-6)


def test_routing_diagnostics_at_perfect_balance_and_total_collapse():
    moe, x = routed_moe(5, collapse=False)  # one-hot tokens, each certain of its expert, cycling over all 4
    stats = train.routing_stats(moe(x)[1]['routing'][None])  # one layer
    assert stats['load'] == pytest.approx([0.25] * 4)
    assert stats['busiest_frac'] == pytest.approx(0.25) and stats['usage_var'] == pytest.approx(0.0, abs=1e-9)
    assert stats['router_entropy'] == pytest.approx(0.0, abs=1e-6)  # every router is certain
    assert stats['log_z'] == pytest.approx(200.0, abs=1e-4)  # logsumexp(200, 0, 0, 0)
    assert stats['dropped_frac'] == 0.0 and len(stats['layers']) == 1
    moe, x = routed_moe(5, collapse=True)
    stats = train.routing_stats(moe(x)[1]['routing'][None])
    assert stats['load'] == pytest.approx([1.0, 0.0, 0.0, 0.0])
    assert stats['busiest_frac'] == pytest.approx(1.0)
    assert stats['usage_var'] == pytest.approx(0.1875)  # mean of (0.75^2, 0.25^2, 0.25^2, 0.25^2)
    # a zero router is maximally unsure: uniform softmax, entropy ln 4, logsumexp(0, 0, 0, 0) = ln 4
    moe.router.weight.data.zero_()
    stats = train.routing_stats(moe(x)[1]['routing'][None])
    assert stats['router_entropy'] == pytest.approx(math.log(4)) and stats['log_z'] == pytest.approx(math.log(4))


def test_routing_stats_average_over_layers():
    rows = torch.tensor([[0.25, 0.25, 0.25, 0.25, 1.0, 2.0],
                         [0.70, 0.10, 0.10, 0.10, 0.5, 4.0]])
    stats = train.routing_stats(rows)
    assert stats['load'] == pytest.approx([0.475, 0.175, 0.175, 0.175])
    assert stats['busiest_frac'] == pytest.approx((0.25 + 0.70) / 2)
    assert stats['usage_var'] == pytest.approx((0.0 + 0.0675) / 2)  # var of (0.7, 0.1, 0.1, 0.1) = 0.0675
    assert stats['router_entropy'] == pytest.approx(0.75) and stats['log_z'] == pytest.approx(3.0)
    assert [layer['busiest_frac'] for layer in stats['layers']] == pytest.approx([0.25, 0.70])


def test_load_balancing_uses_the_full_softmax_not_the_top_k_weights():
    # a zero router: every probability is 1/4; top-2 ties pick experts 0 and 1, so f = (1/2, 1/2, 0, 0).
    # Over the full softmax, P = 1/4 each and lb = 4 * (1/2 * 1/4 * 2) = 1. nanoMoE takes P from the
    # renormalised top-k weights, (1/2, 1/2, 0, 0), and would get 2.
    moe = train.MoE(config(n_experts=4, top_k=2), resid_std=0.02)
    with torch.no_grad():
        moe.router.weight.zero_()
    _, aux = moe(torch.randn(1, 10, 16))
    assert aux['lb'].item() == pytest.approx(1.0, abs=1e-6)
    # and for random routing, the same formula computed directly
    torch.manual_seed(3)
    moe = train.MoE(config(n_experts=4, top_k=2), resid_std=1.0)
    x = torch.randn(1, 50, 16)
    _, aux = moe(x)
    probs = (x[0] @ moe.router.weight.T).softmax(-1)
    chosen = probs.topk(2, dim=-1).indices.flatten()
    f = torch.bincount(chosen, minlength=4).float() / chosen.numel()
    assert aux['lb'].item() == pytest.approx((4 * (f * probs.mean(0)).sum()).item(), rel=1e-6)


def test_top1_router_learns_from_the_lm_loss():
    # Renormalising a single weight would make it exactly 1 and leave the router without gradient.
    torch.manual_seed(0)
    moe = train.MoE(config(top_k=1), resid_std=0.02)
    y, _ = moe(torch.randn(1, 20, 16))
    y.square().sum().backward()
    assert moe.router.weight.grad.abs().max().item() > 1e-6


def test_z_loss_matches_its_formula():
    torch.manual_seed(1)
    moe = train.MoE(config(), resid_std=0.02)
    x = torch.randn(2, 9, 16)
    _, aux = moe(x)
    logits = x.view(-1, 16) @ moe.router.weight.T
    expected = (torch.log(torch.exp(logits).sum(-1)) ** 2).mean()
    assert aux['z'].item() == pytest.approx(expected.item(), rel=1e-5)


def test_training_loss_combines_ce_and_mean_aux_over_layers():
    torch.manual_seed(0)
    c = config(n_layer=3, aux_loss_coef=0.5, z_loss_coef=0.25)
    model = train.Transformer(c)
    idx = torch.randint(0, 257, (2, 16))
    _, ce, aux = model(idx, idx)
    layers = aux['layers']
    assert len(layers) == 3
    lb = sum(a['lb'] for a in layers) / 3
    z = sum(a['z'] for a in layers) / 3
    assert train.training_loss(ce, aux, c).item() == pytest.approx((ce + 0.5 * lb + 0.25 * z).item(), rel=1e-6)
    c_off = config(aux_loss_coef=0.0, z_loss_coef=0.0)
    assert train.training_loss(ce, aux, c_off).item() == pytest.approx(ce.item())


# ----------------------------------------------------------------------------- model
def test_rope_rotate_half_is_a_rotation_with_relative_positions():
    cos, sin = train.rope_cache(8, 32, 10000.0)
    q, k = torch.randn(8), torch.randn(8)
    rq = train.apply_rope(q.expand(32, 8), cos, sin)
    rk = train.apply_rope(k.expand(32, 8), cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(32))  # norm preserved
    # the attention score depends only on the distance between positions
    assert (rq[5] @ rk[2]).item() == pytest.approx((rq[20] @ rk[17]).item(), rel=1e-4)
    # rotate-half layout (Hugging Face Llama's): dimension i pairs with i + head_dim/2 and turns at
    # angle position * theta^(-2i/head_dim); e_i goes to cos * e_i + sin * e_(i+4)
    for i in range(4):
        x = torch.zeros(8)
        x[i] = 1.0
        angle = 3 * 10000.0 ** (-2 * i / 8)
        expected = torch.zeros(8)
        expected[i], expected[i + 4] = math.cos(angle), math.sin(angle)
        torch.testing.assert_close(train.apply_rope(x.expand(32, 8), cos, sin)[3], expected)


@pytest.mark.parametrize('ffn', ['dense', 'moe'])
def test_model_is_causal(ffn):
    torch.manual_seed(0)
    model = train.Transformer(config(ffn=ffn, ffn_hidden=32))
    idx = torch.randint(0, 257, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 257
    a, _, _ = model(idx)
    b, _, _ = model(changed)
    torch.testing.assert_close(a[0, :10], b[0, :10])
    assert not torch.allclose(a[0, 10:], b[0, 10:])


# ----------------------------------------------------------------------------- parameter accounting
@pytest.mark.parametrize('ffn,tie', [('dense', True), ('dense', False), ('moe', True), ('moe', False)])
def test_analytic_param_counts_equal_counted_ones(ffn, tie):
    c = config(ffn=ffn, ffn_hidden=40, tie_embeddings=tie, n_experts=3, top_k=2)
    model = train.Transformer(c)
    n = train.count_params(c)
    assert n['total'] == sum(p.numel() for p in model.parameters())
    assert n['embedding'] == model.embed.weight.numel()
    assert n['attention'] == sum(p.numel() for name, p in model.named_parameters() if '.attn.' in name)
    ffn_params = sum(p.numel() for name, p in model.named_parameters() if '.ffn.' in name and 'router' not in name)
    assert n['ffn'] == ffn_params
    if ffn == 'moe':
        assert n['router'] == sum(model.blocks[i].ffn.router.weight.numel() for i in range(2))
        assert n['active'] == n['total'] - 2 * 1 * 3 * 16 * 24  # one of three experts unused per layer
    else:
        assert n['active'] == n['total']


@pytest.mark.parametrize('match', ['active', 'total'])
def test_matcher_lands_within_tolerance_and_refuses_beyond(match):
    c = config(ffn='dense', match=match, d_model=48, n_layer=4, moe_hidden=96, ffn_multiple_of=8)
    target = train.count_params(config(d_model=48, n_layer=4, moe_hidden=96))[match]
    got = train.count_params(c)['total']
    assert c.ffn_hidden % 8 == 0
    assert abs(got - target) / target <= 0.01
    # the closest multiple: one step either way is no closer
    per_step = 3 * 48 * 4 * 8
    assert abs(got - target) <= per_step / 2
    with pytest.raises(SystemExit):  # a 1-in-a-million tolerance cannot be met with a step of 4,608 params
        config(ffn='dense', match=match, d_model=48, n_layer=4, moe_hidden=96, match_tol=1e-6)


def test_print_params_ends_with_one_json_line():
    out = run('train.py', 'config/cpu_dense_active.py', '--print_params=True', '--data_dir=/nonexistent')
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ('total', 'active', 'embedding', 'attention', 'ffn', 'router', 'ffn_hidden'):
        assert key in summary
    assert summary['total'] == summary['active']
    assert abs(summary['match_error']) <= 0.01


@pytest.mark.parametrize('name,role', [('moe', None), ('dense_active', 'active'), ('dense_total', 'total'),
                                       ('cpu_moe', None), ('cpu_dense_active', 'active'),
                                       ('cpu_dense_total', 'total')])
def test_shipped_configs_meet_the_paper_tolerances(name, role):
    c = train.configure([f'config/{name}.py'])
    n = train.count_params(c)
    moe = train.count_params(train.configure([f'config/{"cpu_" if name.startswith("cpu") else ""}moe.py']))
    if name == 'moe':  # the paper: 14.77M active, 21.06M total
        assert abs(n['active'] / 14.77e6 - 1) <= 0.02 and abs(n['total'] / 21.06e6 - 1) <= 0.02
    if role:
        assert abs(n['total'] / moe[role] - 1) <= 0.01


# ----------------------------------------------------------------------------- configurator
def config_error(capsys, *argv):
    """configure() must stop with exit code != 0 and one line on stderr; returns that line."""
    with pytest.raises(SystemExit) as e:
        train.configure(list(argv))
    assert e.value.code != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'error:' in err
    return err


def test_config_errors_are_one_clear_line(tmp_path, capsys):
    err = config_error(capsys, 'config/cpu_moe.py', '--learning_rat=0.1')
    assert "unknown config key 'learning_rat'" in err and 'learning_rate' in err
    bad = tmp_path / 'bad.py'
    bad.write_text('n_layers = 3\n')
    err = config_error(capsys, str(bad))
    assert "'n_layers'" in err and 'n_layer' in err and str(bad) in err
    bad.write_text("learning_rate = '3e-4'\n")  # a string in a config file
    assert 'learning_rate must be float' in config_error(capsys, str(bad))
    assert 'n_layer must be int' in config_error(capsys, '--n_layer=2.5')
    assert 'not found' in config_error(capsys, 'config/nope.py')
    assert 'n_head must be positive' in config_error(capsys, '--n_head=0')
    assert 'data_seed must be >= 0' in config_error(capsys, '--data_seed=-1')
    assert 'must look like --key=value' in config_error(capsys, '--seed')
    assert "ffn must be one of" in config_error(capsys, "--ffn='sparse'")
    assert 'match' in config_error(capsys, 'config/moe.py', "--match='active'")  # match is for dense configs
    assert 'device' in config_error(capsys, "--device='gpu'")
    # and as a user sees it: exit code != 0, one line, no traceback
    out = run('train.py', 'config/cpu_moe.py', '--n_layers=2')
    assert out.returncode != 0 and out.stderr.count('\n') == 1 and 'Traceback' not in out.stderr


def test_config_types_and_resolution():
    c = config(learning_rate=1, compile=True, device='cpu')  # an int where a float is expected is fine
    assert c.learning_rate == 1.0 and type(c.learning_rate) is float
    assert c.compile is True and c.device == 'cpu'
    c = train.configure(['config/cpu_dense_total.py', '--seed=3'])
    assert c.config_name == 'cpu_dense_total' and c.out_dir == os.path.join('out', 'cpu_dense_total-s3')
    assert c.ffn == 'dense' and c.match == 'total' and c.ffn_hidden > 0
    c = train.configure(['config/cpu_moe.py', '--seed=3', '--data_seed=2'])  # never seed 3's folder
    assert c.out_dir == os.path.join('out', 'cpu_moe-s3-d2')
    with pytest.raises(SystemExit):
        config(compile='yes')


# ----------------------------------------------------------------------------- data
def test_eval_windows_are_fixed_and_batches_depend_only_on_data_seed_and_step(tmp_path):
    data = tmp_path / 'data'
    write_stories(tmp_path / 'stories.txt', 200)
    assert run('prepare.py', '--input', str(tmp_path / 'stories.txt'), '--tokenizer', 'bytes',
               '--out_dir', str(data)).returncode == 0
    a = config(data_dir=str(data), seed=1, eval_tokens=1000)
    b = config(data_dir=str(data), seed=2, eval_tokens=1000, ffn='dense', ffn_hidden=32)
    _, val_a = train.load_data(a)
    _, val_b = train.load_data(b)
    assert torch.equal(val_a, val_b) and val_a.shape == (1000 // 16, 17)
    cpu = torch.device('cpu')
    x1, y1 = train.get_batch(a, 7, cpu)
    x2, _ = train.get_batch(a, 7, cpu)
    x3, _ = train.get_batch(b, 7, cpu)
    assert torch.equal(x1, x2) and not torch.equal(x1, x3)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one
    # data_seed moves the data order alone: seed 2 with seed 1's data order sees seed 1's batches, and back
    assert torch.equal(train.get_batch(config(data_dir=str(data), seed=2, data_seed=1), 7, cpu)[0], x1)
    assert torch.equal(train.get_batch(config(data_dir=str(data), seed=1, data_seed=2), 7, cpu)[0], x3)


# ----------------------------------------------------------------------------- end to end
TINY = ['--d_model=32', '--n_layer=2', '--n_head=2', '--moe_hidden=32', '--block_size=32', '--batch_size=8',
        '--max_iters=40', '--eval_interval=20', '--log_interval=10', '--learning_rate=0.01', '--min_lr=0.001']


@pytest.fixture(scope='module')
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp('e2e')
    write_stories(root / 'stories.txt', 300)
    out = run('prepare.py', '--input', str(root / 'stories.txt'), '--tokenizer', 'bytes', '--out_dir', str(root / 'data'))
    assert out.returncode == 0, out.stderr
    return root


@pytest.mark.parametrize('cfg', ['cpu_moe', 'cpu_dense_active', 'cpu_moe_top1_nolb'])
def test_prepare_train_sample_end_to_end(prepared, cfg):
    out_dir = prepared / cfg
    out = run('train.py', f'config/{cfg}.py', f'--data_dir={prepared / "data"}', f'--out_dir={out_dir}', *TINY)
    assert out.returncode == 0, out.stderr
    log = [json.loads(line) for line in open(out_dir / 'log.jsonl')]
    evals = [r for r in log if 'val_loss' in r]
    assert [r['iter'] for r in evals] == [0, 20, 40]
    assert evals[0]['val_loss'] == pytest.approx(math.log(257), abs=0.1)  # uniform over 257 bytes at init
    assert evals[-1]['val_loss'] < 0.6 * evals[0]['val_loss']  # synthetic stories are easy: it must learn
    assert evals[-1]['best_val'] == min(r['val_loss'] for r in evals)
    steps = [r for r in log if 'ce' in r]
    assert [r['iter'] for r in steps] == [10, 20, 30, 40]
    assert all({'iter', 'tokens', 'loss', 'ce', 'lr', 'tok_per_s'} <= r.keys() for r in steps)
    assert all(('lb' in r) == cfg.startswith('cpu_moe') for r in steps)
    lb_coef = 0.0 if cfg == 'cpu_moe_top1_nolb' else 0.01
    for r in steps:  # the logged training loss is CE plus the weighted aux losses
        assert r['loss'] == pytest.approx(r['ce'] + lb_coef * r.get('lb', 0) + 0.001 * r.get('z', 0), rel=1e-5)
    routing = ('load', 'busiest_frac', 'usage_var', 'router_entropy', 'log_z', 'dropped_frac', 'layers')
    for r in log:  # MoE runs log routing health on every eval and training line; dense runs none of it
        assert all((key in r) == cfg.startswith('cpu_moe') for key in routing)
        if 'layers' in r:
            assert len(r['layers']) == 2 and sum(r['load']) == pytest.approx(1.0)
            assert 0.25 <= r['busiest_frac'] <= 1.0 and 0 <= r['router_entropy'] <= math.log(4) + 1e-6
    saved = json.load(open(out_dir / 'config.json'))
    assert saved['config_name'] == cfg and saved['params']['total'] > 0
    assert (out_dir / 'best.pt').exists() and (out_dir / 'latest.pt').exists()
    assert not list(out_dir.glob('*.tmp'))

    out = run('sample.py', f'--out_dir={out_dir}', '--start=once upon a time', '--num_samples=2',
              '--max_new_tokens=60', '--temperature=0.5')
    assert out.returncode == 0, out.stderr
    samples = out.stdout.split('---------------')[:2]
    assert len(samples) == 2
    for text in samples:  # the prompt, continued by the model
        assert text.strip().startswith('once upon a time') and len(text.strip()) > len('once upon a time') + 20

    out = run('train.py', f'config/{cfg}.py', f'--data_dir={prepared / "data"}', f'--out_dir={out_dir}', *TINY)
    assert out.returncode != 0 and 'already holds a run' in out.stderr  # nothing overwritten


def test_seed_noise_window_losses_average_to_the_logged_val_loss(prepared):
    """scripts/seed_noise.py's validation-set standard error rests on per-window losses of best.pt: their mean
    is the best val_loss train.py logged, and they differ from window to window."""
    out_dir = prepared / 'cpu_moe'
    if not (out_dir / 'done.json').exists():
        assert run('train.py', 'config/cpu_moe.py', f'--data_dir={prepared / "data"}', f'--out_dir={out_dir}',
                   *TINY).returncode == 0
    spec = importlib.util.spec_from_file_location('seed_noise', os.path.join(REPO, 'scripts', 'seed_noise.py'))
    seed_noise = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seed_noise)
    losses = seed_noise.window_losses(str(out_dir))
    logged = json.load(open(out_dir / 'done.json'))['best_val']
    assert losses.mean().item() == pytest.approx(logged, abs=1e-5) and losses.std() > 0

    # its table: each group's runs, and the active gap as dense_active - moe, run by run
    rng = random.Random(0)
    best = {(cfg, i, d): 1 + rng.random() for cfg in seed_noise.CONFIGS for i in range(1, 6) for d in range(1, 6)}
    rows = seed_noise.noise_table(best)
    init = rows['init varies (data order of seed 1)']
    assert init['cpu_moe'] == pytest.approx(statistics.stdev(best[('cpu_moe', i, 1)] for i in (1, 2, 3)))
    data_gaps = [best[('cpu_dense_active', 1, d)] - best[('cpu_moe', 1, d)] for d in (1, 2, 3)]
    data = rows['data order varies (init of seed 1)']
    assert data['active_gap'] == pytest.approx(statistics.stdev(data_gaps))
    assert data['active_gap_mean'] == pytest.approx(statistics.mean(data_gaps))
    assert rows['both vary (seeds 1-5)']['runs'] == 5

    # leaving the plateau: the first logged step with training CE below the threshold, beside the best val
    ces = [json.loads(line) for line in open(out_dir / 'log.jsonl') if '"ce"' in line]
    threshold = (ces[0]['ce'] + ces[1]['ce']) / 2  # the run learns: the second log line is below it
    assert ces[1]['ce'] < threshold
    assert (ces[1]['iter'], logged) in seed_noise.plateau_escapes(str(prepared), threshold)['cpu_moe']
    assert (None, logged) in seed_noise.plateau_escapes(str(prepared), 0.0)['cpu_moe']  # never below 0


def test_greedy_sampling_is_deterministic(prepared):
    out_dir = prepared / 'cpu_moe'
    if not (out_dir / 'best.pt').exists():
        pytest.skip('needs the end-to-end MoE run')
    a = run('sample.py', f'--out_dir={out_dir}', '--temperature=0', '--max_new_tokens=40', '--num_samples=1', '--seed=1')
    b = run('sample.py', f'--out_dir={out_dir}', '--temperature=0', '--max_new_tokens=40', '--num_samples=1', '--seed=9')
    assert a.returncode == 0 and a.stdout == b.stdout


def test_compiled_training_runs_and_matches_eager(prepared):
    torch.manual_seed(0)
    c = config(ffn='moe')
    model = train.Transformer(c)
    idx = torch.randint(0, 257, (2, 16))
    eager = model(idx)[0]
    compiled = torch.compile(model)(idx)[0]
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    out = run('train.py', 'config/cpu_moe.py', f'--data_dir={prepared / "data"}', f'--out_dir={prepared / "compiled"}',
              *TINY, '--n_layer=1', '--max_iters=6', '--eval_interval=3', '--compile=True')
    assert out.returncode == 0, out.stderr
    assert json.load(open(prepared / 'compiled' / 'config.json'))['compile_used'] is True


def test_missing_data_and_checkpoint_errors(tmp_path):
    out = run('train.py', 'config/cpu_moe.py', f'--data_dir={tmp_path}', f'--out_dir={tmp_path / "o"}')
    assert out.returncode != 0 and 'prepare.py' in out.stderr and 'Traceback' not in out.stderr
    assert not (tmp_path / 'o').exists()
    out = run('sample.py', f'--out_dir={tmp_path}')
    assert out.returncode != 0 and 'no checkpoint' in out.stderr and 'Traceback' not in out.stderr
    (tmp_path / 'best.pt').write_bytes(b'not a checkpoint')
    out = run('sample.py', f'--out_dir={tmp_path}')
    assert out.returncode != 0 and 'not a usable tinymoe checkpoint' in out.stderr and 'Traceback' not in out.stderr


def test_grad_accumulation_equals_one_big_batch(prepared):
    # dense: CE is a per-token mean, so two half-batches average to the full one exactly. (An MoE's
    # load-balancing loss is a product of batch statistics and is, as usual, taken per micro-batch.)
    logs = []
    for batch, accum in ((8, 1), (4, 2)):  # the same 8 windows per step, in one or two micro-batches
        out_dir = prepared / f'accum{accum}'
        out = run('train.py', 'config/cpu_dense_active.py', f'--data_dir={prepared / "data"}', f'--out_dir={out_dir}',
                  *TINY, '--max_iters=4', '--eval_interval=4', '--log_interval=1', f'--batch_size={batch}',
                  f'--grad_accum={accum}')
        assert out.returncode == 0, out.stderr
        logs.append([json.loads(line) for line in open(out_dir / 'log.jsonl')])
    for one, two in zip(*logs):
        assert one.keys() == two.keys()
        for key in ('loss', 'ce', 'val_loss'):
            if key in one:
                assert one[key] == pytest.approx(two[key], rel=1e-4)


def test_data_of_another_vocabulary_is_refused(prepared):
    out = run('train.py', 'config/moe.py', f'--data_dir={prepared / "data"}', f'--out_dir={prepared / "wrong_vocab"}')
    assert out.returncode != 0 and 'vocab_size 257' in out.stderr and 'Traceback' not in out.stderr
    assert not (prepared / 'wrong_vocab').exists()


def test_eval_routing_statistics_do_not_depend_on_the_eval_batch_size(prepared):
    from contextlib import nullcontext
    torch.manual_seed(0)
    c = config(data_dir=str(prepared / 'data'), eval_tokens=16 * 10)  # 10 windows: batches 3,3,3,1 vs 10
    model = train.Transformer(c)
    _, windows = train.load_data(c)
    cpu = torch.device('cpu')
    loss_a, a = train.evaluate(model, windows, config(batch_size=3), cpu, nullcontext())
    loss_b, b = train.evaluate(model, windows, config(batch_size=10), cpu, nullcontext())
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    for key in ('load', 'busiest_frac', 'usage_var', 'router_entropy', 'log_z'):
        assert a[key] == pytest.approx(b[key], rel=1e-5)
    # and they are the statistics of all windows at once: the load counts every token's top_k choices
    _, _, aux = model(windows[:, :-1], windows[:, 1:])
    assert a['load'] == pytest.approx(train.routing_stats(aux['routing'])['load'], rel=1e-5)
