"""The model and its config: the MoE against references, aux losses, RoPE, causality, parameter
counts and the matcher, the configurator's errors, data windows."""
import ast
import json
import math
import os
import types

import pytest
import torch
import torch.nn.functional as F

import runs
import train
from conftest import REPO, config, reference_moe, run, write_stories
from errors import UserError


def reference_dispatch(moe, x, weights, experts):
    """The plain dropless dispatch, as DeepSeek-V3's model.py writes it: for each expert with
    tokens, the rows routed to it, its SwiGLU on them, the outputs added back times their routing
    weights. The oracle for MoE.dispatch, which computes the same grouped (assignment a: token
    a % N)."""
    N = x.shape[0]
    y = torch.zeros_like(x)
    counts = torch.bincount(experts, minlength=moe.n_experts)
    for e in range(moe.n_experts):
        if counts[e] == 0:
            continue
        assignments = torch.where(experts == e)[0]
        tokens = assignments % N
        h = F.silu(x[tokens] @ moe.gate[e]) * (x[tokens] @ moe.up[e])
        y.index_add_(0, tokens, weights[assignments, None] * (h @ moe.down[e]))
    return y, counts


MOE_VARIANTS = [(1, {}), (2, {}), (2, {'shared_hidden': 8}), (2, {'bias_rate': 0.1}),
                (3, {'shared_hidden': 8, 'bias_rate': 0.1})]


@pytest.mark.parametrize('top_k,variant', MOE_VARIANTS)
def test_moe_matches_per_token_reference(top_k, variant):
    torch.manual_seed(0)
    moe = train.MoE(config(top_k=top_k, **variant), resid_std=0.02)
    # larger weights than init, so routing and outputs are far from trivial
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_()
        if moe.bias is not None:  # a bias large enough to change some selections
            moe.bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    x = torch.randn(3, 7, 16, requires_grad=True)
    y, aux = moe(x)
    assert y.shape == x.shape
    y_ref = reference_moe(moe, x.view(-1, 16))
    torch.testing.assert_close(y.view(-1, 16), y_ref, rtol=1e-4, atol=1e-4)
    load, _, _ = train.unpack_routing(aux['routing'])
    assert load.sum().item() == pytest.approx(1.0)
    # and the gradients (through dispatch, experts, routing weights, router) equal the reference's
    probe = torch.randn_like(y_ref)
    inputs = [x] + list(moe.parameters())
    grads = torch.autograd.grad((y.view(-1, 16) * probe).sum(), inputs)
    grads_ref = torch.autograd.grad((y_ref * probe).sum(), inputs)
    for grad, grad_ref in zip(grads, grads_ref):
        torch.testing.assert_close(grad, grad_ref, rtol=1e-4, atol=1e-4)


def idle_expert_assignments(N):
    """Hand-made top-2 assignments of N tokens: first choices expert 0 or 3, every second choice
    expert 1, expert 2 idle."""
    first = torch.tensor([0, 3])[torch.randint(0, 2, (N,))]
    return torch.cat([first, torch.ones(N, dtype=torch.long)])


@pytest.mark.parametrize('top_k,idle', [(1, False), (2, False), (2, True), (3, False)])
def test_dispatch_equals_the_plain_loop_over_experts(top_k, idle):
    """dispatch(): outputs, counts and every gradient against reference_dispatch, on the router's
    own assignments or on hand-made ones that leave an expert without tokens."""
    torch.manual_seed(0)
    moe = train.MoE(config(n_experts=4, top_k=top_k), resid_std=0.02)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_()
    N = 10
    x = torch.randn(N, 16, requires_grad=True)
    if idle:
        experts = idle_expert_assignments(N)
        weights = torch.rand(2 * N, requires_grad=True)
    else:
        _, _, weights, experts = moe.route(x)
    y, counts = moe.dispatch(x, weights, experts)
    y_ref, counts_ref = reference_dispatch(moe, x, weights, experts)
    assert torch.equal(counts, counts_ref) and counts.sum() == top_k * N
    if idle:
        assert counts[2] == 0
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    probe = torch.randn_like(y)
    inputs = [x, moe.gate, moe.up, moe.down, weights if idle else moe.router.weight]
    # retain_graph: y and y_ref share the routing's graph
    grads = torch.autograd.grad((y * probe).sum(), inputs, retain_graph=True)
    for grad, grad_ref in zip(grads, torch.autograd.grad((y_ref * probe).sum(), inputs)):
        torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-5)


def test_group_by_expert_is_a_stable_argsort_and_a_bincount():
    torch.manual_seed(0)
    for experts in (torch.randint(0, 4, (30,)), idle_expert_assignments(15)):
        order, slot, counts = train.group_by_expert(experts, 4)
        assert torch.equal(order, experts.argsort(stable=True))
        assert torch.equal(counts, experts.bincount(minlength=4))
        assert torch.equal(slot[order], torch.arange(30))  # slot is order's inverse
    assert counts[2] == 0
    # the worked example in its docstring
    order, slot, counts = train.group_by_expert(torch.tensor([2, 0, 2, 1, 2, 0]), 3)
    assert (order.tolist(), slot.tolist(), counts.tolist()) == ([1, 5, 3, 0, 2, 4],
                                                                [3, 0, 4, 2, 5, 1], [2, 1, 3])


def test_selection_bias_changes_which_experts_but_not_their_routing_weights():
    torch.manual_seed(0)
    moe = train.MoE(config(bias_rate=0.1), resid_std=0.02)
    with torch.no_grad():
        moe.router.weight.normal_()
    x = torch.randn(50, 16)
    probs, _, weights, experts = moe.route(x)
    moe.bias.copy_(torch.tensor([0.5, 0.0, 0.0, 0.0]))  # puts expert 0 into every token's pair
    probs_b, _, weights_b, experts_b = moe.route(x)
    torch.testing.assert_close(probs_b, probs)  # the bias is not in the softmax
    chosen = experts_b.view(2, -1)
    assert (chosen == 0).any(dim=0).all() and not torch.equal(experts_b, experts)
    # each token's routing weights: its unbiased probabilities of the chosen pair, renormalised
    picked = probs.gather(0, chosen)
    torch.testing.assert_close(weights_b.view(2, -1), picked / picked.sum(dim=0))
    # the tokens whose pair did not change keep their weights exactly
    same = (experts_b.view(2, -1) == experts.view(2, -1)).all(dim=0)
    assert same.any()
    assert torch.equal(weights_b.view(2, -1)[:, same], weights.view(2, -1)[:, same])


def test_router_settings_leave_every_other_weight_as_the_default_init():
    torch.manual_seed(0)
    default = train.Transformer(config())
    torch.manual_seed(0)
    zero = train.Transformer(config(router_init_std=0))
    for (name, p), q in zip(default.named_parameters(), zero.parameters()):
        if name.endswith('router.weight'):
            assert p.abs().min() > 0 and not q.any()  # a zero router: every expert equally likely
        else:
            assert torch.equal(p, q), name
    groups = train.param_groups(zero, config(router_lr_mult=0.25, router_decay=False))
    ids = [id(p) for g in groups for p in g['params']]
    assert sorted(ids) == sorted(id(p) for p in zero.parameters())  # every parameter exactly once
    routers = [p for name, p in zero.named_parameters() if 'router' in name]
    assert len(routers) == 2 and [id(p) for p in groups[2]['params']] == [id(p) for p in routers]
    assert (groups[2]['lr_mult'], groups[2]['weight_decay']) == (0.25, 0.0)
    assert [(g['lr_mult'], g['weight_decay']) for g in groups[:2]] == [(1.0, 0.1), (1.0, 0.0)]
    assert all(p.dim() >= 2 for p in groups[0]['params'])
    assert all(p.dim() < 2 for p in groups[1]['params'])
    # by default the routers are decayed like every matrix
    assert train.param_groups(zero, config())[2]['weight_decay'] == 0.1


def scattered_bags(n_rows, copies, seed=0):
    """Rows 0 .. n_rows - 1 each copied to `copies` places of n_rows * copies, at random: -> rows
    (the row at each place) and bags (each row's places, a row of bags per row)."""
    place = torch.randperm(n_rows * copies, generator=torch.Generator().manual_seed(seed))
    bags = place.view(n_rows, copies)
    row_of_each = torch.arange(n_rows).repeat_interleave(copies)  # bags' rows, read row by row
    rows = torch.empty_like(place).scatter_(0, place, row_of_each)
    return rows, bags


@pytest.mark.parametrize('copies', [1, 3])
def test_copy_rows_is_indexing_with_its_gradient(copies):
    """copy_rows(x, rows, bags) is x[rows], gradient included."""
    torch.manual_seed(0)
    x = torch.randn(5, 4, requires_grad=True)
    rows, bags = scattered_bags(5, copies)
    y, y_ref = train.CopyRows.apply(x, rows, bags), x[rows]
    assert torch.equal(y, y_ref)
    probe = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad((y * probe).sum(), x)[0],
                               torch.autograd.grad((y_ref * probe).sum(), x)[0])


@pytest.mark.parametrize('copies', [1, 3])
def test_weighted_sum_is_a_gather_times_weights_with_its_gradients(copies):
    """weighted_sum(ys, weights, bags, rows)[t] = sum_c weights[t, c] * ys[bags[t, c]]."""
    torch.manual_seed(0)
    rows, bags = scattered_bags(5, copies)
    ys = torch.randn(5 * copies, 4, requires_grad=True)
    weights = torch.rand(5, copies, requires_grad=True)
    y = train.WeightedSum.apply(ys, weights, bags, rows)
    y_ref = (ys[bags] * weights[:, :, None]).sum(dim=1)
    torch.testing.assert_close(y, y_ref)
    probe = torch.randn_like(y)
    for got, want in zip(torch.autograd.grad((y * probe).sum(), (ys, weights)),
                         torch.autograd.grad((y_ref * probe).sum(), (ys, weights))):
        torch.testing.assert_close(got, want)


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
    y_dense, no_aux = dense(x)
    torch.testing.assert_close(y, y_dense)
    assert no_aux is None
    assert aux['lb'].item() == pytest.approx(1.0)  # one expert is trivially "balanced"


def routed_moe(n_tokens_per_expert, collapse):
    """A 4-expert top-1 layer with d_model 4 and an identity router, fed one-hot tokens: either
    cycling through the experts (perfect balance) or all pointing at expert 0 (total collapse)."""
    moe = train.MoE(config(d_model=4, n_head=1, n_experts=4, top_k=1), resid_std=0.02)
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(4))
    if collapse:
        experts = torch.zeros(4 * n_tokens_per_expert, dtype=torch.long)
    else:
        experts = torch.arange(4).repeat(n_tokens_per_expert)
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
    # one-hot tokens, each certain of its expert, cycling over all 4
    moe, x = routed_moe(5, collapse=False)
    stats = train.routing_record(moe(x)[1]['routing'][None])  # one layer
    assert stats['load'] == pytest.approx([0.25] * 4)
    assert stats['busiest_frac'] == pytest.approx(0.25)
    assert stats['usage_var'] == pytest.approx(0.0, abs=1e-9)
    assert stats['router_entropy'] == pytest.approx(0.0, abs=1e-6)  # every router is certain
    assert stats['log_z'] == pytest.approx(200.0, abs=1e-4)  # logsumexp(200, 0, 0, 0)
    assert stats['dropped_frac'] == 0.0 and len(stats['layers']) == 1
    moe, x = routed_moe(5, collapse=True)
    stats = train.routing_record(moe(x)[1]['routing'][None])
    assert stats['load'] == pytest.approx([1.0, 0.0, 0.0, 0.0])
    assert stats['busiest_frac'] == pytest.approx(1.0)
    assert stats['usage_var'] == pytest.approx(0.1875)  # mean of (0.75^2, 0.25^2, 0.25^2, 0.25^2)
    # a zero router is maximally unsure: uniform softmax, entropy ln 4, logsumexp(0, 0, 0, 0) = ln 4
    moe.router.weight.data.zero_()
    stats = train.routing_record(moe(x)[1]['routing'][None])
    assert stats['router_entropy'] == pytest.approx(math.log(4))
    assert stats['log_z'] == pytest.approx(math.log(4))


def test_routing_stats_average_over_layers():
    rows = torch.tensor([[0.25, 0.25, 0.25, 0.25, 1.0, 2.0],
                         [0.70, 0.10, 0.10, 0.10, 0.5, 4.0]])
    stats = train.routing_record(rows)
    assert stats['load'] == pytest.approx([0.475, 0.175, 0.175, 0.175])
    assert stats['busiest_frac'] == pytest.approx((0.25 + 0.70) / 2)
    # the variance of (0.7, 0.1, 0.1, 0.1) is 0.0675
    assert stats['usage_var'] == pytest.approx((0.0 + 0.0675) / 2)
    assert stats['router_entropy'] == pytest.approx(0.75) and stats['log_z'] == pytest.approx(3.0)
    assert [layer['busiest_frac'] for layer in stats['layers']] == pytest.approx([0.25, 0.70])


def test_load_balancing_uses_the_full_softmax_not_the_top_k_weights():
    # a zero router: every probability is 1/4; top-2 ties pick experts 0 and 1, so
    # f = (1/2, 1/2, 0, 0). Over the full softmax, P = 1/4 each and lb = 4 * (1/2 * 1/4 * 2) = 1.
    # nanoMoE takes P from the renormalised top-k weights, (1/2, 1/2, 0, 0), and would get 2.
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
    expected = ce + 0.5 * lb + 0.25 * z
    assert train.training_loss(ce, aux, c).item() == pytest.approx(expected.item(), rel=1e-6)
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
def counted(model, part, exclude=None):
    """The parameters of the model whose names contain part (and not exclude), counted."""
    names = [name for name, _ in model.named_parameters() if part in name]
    if exclude is not None:
        names = [name for name in names if exclude not in name]
    return sum(model.get_parameter(name).numel() for name in names)


@pytest.mark.parametrize('ffn,tie,shared', [('dense', True, 0), ('dense', False, 0),
                                            ('moe', True, 0), ('moe', False, 0), ('moe', True, 12)])
def test_analytic_param_counts_equal_counted_ones(ffn, tie, shared):
    c = config(ffn=ffn, ffn_hidden=40, tie_embeddings=tie, n_experts=3, top_k=2,
               shared_hidden=shared)
    model = train.Transformer(c)
    n = train.count_params(c)
    assert n['total'] == sum(p.numel() for p in model.parameters())
    assert n['embedding'] == model.embed.weight.numel()
    assert n['attention'] == counted(model, '.attn.')
    assert n['ffn'] == counted(model, '.ffn.', exclude='router')
    if ffn == 'moe':
        assert n['router'] == counted(model, 'router')
        assert n['active'] == n['total'] - 2 * 1 * 3 * 16 * 24  # one of 3 experts unused per layer
        assert counted(model, '.shared.') == 2 * 3 * 16 * shared
    else:
        assert n['active'] == n['total']


def test_count_params_of_a_matched_dense_config_counts_its_moe_too():
    """A dense config holds the sizes of the MoE it is matched to: ffn='moe' counts that MoE."""
    dense = train.configure(['config/cpu_dense_total.py'])
    moe = train.configure(['config/cpu_moe.py'])
    assert train.count_params(dense, ffn='moe') == train.count_params(moe)
    assert train.count_params(moe, ffn='dense')['ffn'] == 0  # an MoE config has no dense width


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
    # a 1-in-a-million tolerance cannot be met with a step of 4,608 params
    with pytest.raises(UserError, match='no dense width matches'):
        config(ffn='dense', match=match, d_model=48, n_layer=4, moe_hidden=96, match_tol=1e-6)


def test_flops_per_token_counts_matmuls_and_causal_attention():
    """The paper's moe, by hand: 6 x (active params - norms; the tied embedding counted once, as
    the output layer) + 6 x n_layer x block_size x d_model. Untied, the lookup adds nothing."""
    c = train.configure(['config/moe.py'])
    by_hand = 6 * (14_721_600 - 9 * 160) + 6 * 4 * 512 * 160
    assert train.flops_per_token(c) == by_hand == 90_287_040
    untied = train.configure(['config/moe.py', '--tie_embeddings=False'])
    assert train.flops_per_token(untied) == by_hand
    # at the CPU recipe dense_total costs 1.51x the MoE a token
    moe, dense_total = (train.flops_per_token(train.configure([f'config/cpu_{name}.py']))
                        for name in ('moe', 'dense_total'))
    assert (moe, dense_total) == (1_085_832, 1_639_176)


def test_print_params_ends_with_one_json_line():
    out = run('train.py', 'config/cpu_dense_active.py', '--print_params=True',
              '--data_dir=/nonexistent')
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ('total', 'active', 'embedding', 'attention', 'ffn', 'router', 'ffn_hidden',
                'flops_per_token'):
        assert key in summary
    assert summary['total'] == summary['active']
    assert abs(summary['match_error']) <= 0.01
    # an MoE's width is its experts', under its own name
    out = run('train.py', 'config/cpu_moe.py', '--print_params=True', '--data_dir=/nonexistent')
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary['moe_hidden'] == 88 and 'ffn_hidden' not in summary


# docs/reference.md's table: (total, active, FFN hidden) of every shipped config, --print_params
SHIPPED = {'moe': (20_988_480, 14_721_600, 1632), 'dense_active': (14_719_040, 14_719_040, 3264),
           'dense_total': (20_985_920, 20_985_920, 6528), 'cpu_moe': (229_240, 136_312, 88),
           'cpu_dense_active': (135_608, 135_608, 176),
           'cpu_dense_total': (228_536, 228_536, 352)}


@pytest.mark.parametrize('name', SHIPPED)
def test_shipped_configs_have_the_readme_counts(name):
    c = train.configure([f'config/{name}.py'])
    n = train.count_params(c)
    hidden = c.moe_hidden if c.ffn == 'moe' else c.ffn_hidden
    assert (n['total'], n['active'], hidden) == SHIPPED[name]
    if name == 'moe':  # the paper: 14.77M active, 21.06M total
        assert abs(n['active'] / 14.77e6 - 1) <= 0.004
        assert abs(n['total'] / 21.06e6 - 1) <= 0.004


# every expert layout of the CPU recipe a reader might try, as --key=value overrides
LAYOUTS = {'8 x 44 top-1': ('--n_experts=8', '--moe_hidden=44', '--top_k=1'),
           '8 x 44 top-2': ('--n_experts=8', '--moe_hidden=44', '--top_k=2'),
           '8 x 44 top-4': ('--n_experts=8', '--moe_hidden=44', '--top_k=4'),
           '16 x 22 top-2': ('--n_experts=16', '--moe_hidden=22', '--top_k=2'),
           'shared 88 + 6 x 44 top-2': ('--n_experts=6', '--moe_hidden=44', '--shared_hidden=88')}


@pytest.mark.parametrize('match', ['active', 'total'])
@pytest.mark.parametrize('layout', LAYOUTS)
def test_the_recipes_dense_configs_match_any_layout_within_1_percent(layout, match):
    c = train.configure([f'config/cpu_dense_{match}.py', *LAYOUTS[layout]])
    target = train.count_params(c, ffn='moe')[match]
    assert c.match_tol == 0.01
    assert abs(train.count_params(c)['total'] / target - 1) <= 0.01


def test_a_width_off_the_multiple_is_taken_only_when_no_multiple_is_within_match_tol():
    # 8 x 44 top-1: 48 (a multiple of 8) is 1.05% over its 67,320 active params, 47 is 0.26% over
    c = train.configure(['config/cpu_dense_active.py', *LAYOUTS['8 x 44 top-1']])
    assert c.ffn_hidden == 47
    loose = train.configure(['config/cpu_dense_active.py', *LAYOUTS['8 x 44 top-1'],
                             '--match_tol=0.02'])
    assert loose.ffn_hidden == 48


def header_facts(c, iters):
    """The facts train.py gives runs.start_run, for a CPU run of `iters` steps."""
    return {'params': train.count_params(c), 'iters': iters, 'tokens_per_iter': 4096,
            'device_used': 'cpu', 'dtype_used': 'float32', 'compile_used': False, 'world_size': 1}


def test_a_matched_run_names_the_moe_it_was_matched_to(capsys):
    c = train.configure(['config/cpu_dense_total.py', *LAYOUTS['8 x 44 top-2']])
    runs.print_run_header(c, header_facts(c, 1120), None, train.moe_layout(c))
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == ('  ffn_hidden 352: matched to the total params of the MoE 8 experts x 44, '
                        'top-2 (its config\'s MoE keys; README: "Add an expert layout")')


def test_a_warmup_longer_than_the_run_is_said(capsys):
    c = train.configure(['config/cpu_moe.py', '--max_iters=50'])
    runs.print_run_header(c, header_facts(c, 50), None, train.moe_layout(c))
    assert capsys.readouterr().out.splitlines()[1] == (
        '  warmup_iters 224 >= 50 iters: the learning rate never leaves its warmup; set '
        '--warmup_iters (README: "Short experiments")')


def test_a_match_beyond_match_tol_names_the_closest_width_and_the_fix():
    message = config_error('config/cpu_dense_total.py', '--match_tol=0.0001')
    assert message == ('no dense width matches the MoE total params (229,240) within '
                       'match_tol=0.0001: the closest, ffn_hidden=353, is off by -0.08%; raise '
                       'match_tol')


# ----------------------------------------------------------------------------- configurator
def config_error(*argv):
    """configure() must refuse argv with a UserError of one line; returns its message."""
    with pytest.raises(UserError) as e:
        train.configure(list(argv))
    message = str(e.value)
    assert len(message.splitlines()) == 1
    return message


def test_config_errors_are_one_clear_line(tmp_path):
    err = config_error('config/cpu_moe.py', '--learning_rat=0.1')
    assert "unknown config key 'learning_rat'" in err and 'learning_rate' in err
    bad = tmp_path / 'bad.py'
    bad.write_text('n_layers = 3\n')
    err = config_error(str(bad))
    assert "'n_layers'" in err and 'n_layer' in err and str(bad) in err
    bad.write_text("learning_rate = '3e-4'\n")  # a string in a config file
    assert 'learning_rate must be float' in config_error(str(bad))
    assert 'n_layer must be int' in config_error('--n_layer=2.5')
    assert 'not found' in config_error('config/nope.py')
    assert 'n_head must be positive' in config_error('--n_head=0')
    assert 'data_seed must be >= 0' in config_error('--data_seed=-1')
    assert 'nothing to train' in config_error('--max_tokens=0')
    assert config_error('--max_iters=-2') == config_error('--max_tokens=0')
    assert 'must look like --key=value' in config_error('--seed')
    assert "ffn must be one of" in config_error("--ffn='sparse'")
    # match is for dense configs
    assert 'match' in config_error('config/moe.py', "--match='active'")
    assert 'device' in config_error("--device='gpu'")
    assert 'router_lr_mult must be >= 0' in config_error('--router_lr_mult=-1.0')
    assert 'warmup_iters must be >= 0' in config_error('--warmup_iters=-5')
    assert 'use it with ffn = moe' in config_error('config/cpu_dense_total.py', '--bias_rate=0.001')
    # and as a user sees it: exit code 1, one line naming the script, no traceback
    out = run('train.py', 'config/cpu_moe.py', '--n_layers=2')
    assert out.returncode == 1 and out.stderr.count('\n') == 1
    assert out.stderr.startswith("train.py: error: unknown config key 'n_layers'")


def test_config_types_and_resolution():
    # an int where a float is expected is fine
    c = config(learning_rate=1, compile=True, device='cpu')
    assert c.learning_rate == 1.0 and type(c.learning_rate) is float
    assert c.compile is True and c.device == 'cpu'
    c = train.configure(['config/cpu_dense_total.py', '--seed=3'])
    assert c.config_name == 'cpu_dense_total'
    assert c.out_dir == os.path.join('out', 'cpu_dense_total-s3')
    assert c.ffn == 'dense' and c.match == 'total' and c.ffn_hidden > 0
    c = train.configure(['config/cpu_moe.py', '--seed=3', '--data_seed=2'])  # never seed 3's folder
    assert c.out_dir == os.path.join('out', 'cpu_moe-s3-d2')
    with pytest.raises(UserError, match='compile must be True, False or None'):
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
    # data_seed moves the data order alone: seed 2 with seed 1's data order sees seed 1's
    # batches, and back
    seed2_order1 = config(data_dir=str(data), seed=2, data_seed=1)
    seed1_order2 = config(data_dir=str(data), seed=1, data_seed=2)
    assert torch.equal(train.get_batch(seed2_order1, 7, cpu)[0], x1)
    assert torch.equal(train.get_batch(seed1_order2, 7, cpu)[0], x3)


# ----------------------------------------------------------------------- learning rate, grouped_mm
def test_lr_schedule_warms_up_peaks_and_ends_at_min_lr():
    c = types.SimpleNamespace(learning_rate=3e-3, min_lr=3e-4, warmup_frac=0.02, warmup_iters=0)
    iters = 1120  # the first protocol's CPU recipe: 2% warmup, round(22.4) = 22 steps
    lrs = [train.lr_at(it, c, iters) for it in range(iters)]
    assert lrs[0] == pytest.approx(3e-3 / 22) and lrs[10] == pytest.approx(3e-3 * 11 / 22)
    # the peak at the last warmup step and again at the first cosine step (progress 0)
    assert lrs[21] == lrs[22] == pytest.approx(3e-3) and max(lrs) == lrs[21]
    assert lrs[-1] == pytest.approx(3e-4)  # min_lr at the last step
    mid = 22 + (iters - 1 - 22) / 2  # half way through the cosine: the mean of peak and min_lr
    assert train.lr_at(mid, c, iters) == pytest.approx((3e-3 + 3e-4) / 2)
    assert all(a >= b for a, b in zip(lrs[22:], lrs[23:]))


def test_warmup_iters_fixes_the_warmup_in_steps_whatever_the_run_length():
    c = types.SimpleNamespace(learning_rate=3e-3, min_lr=3e-4, warmup_frac=0.02, warmup_iters=112)
    for iters in (280, 1120, 2240):  # a quarter of the CPU recipe's steps, all of them, twice
        lrs = [train.lr_at(it, c, iters) for it in range(iters)]
        assert lrs[0] == pytest.approx(3e-3 / 112) and lrs[55] == pytest.approx(3e-3 * 56 / 112)
        assert lrs[111] == lrs[112] == pytest.approx(3e-3) and max(lrs) == lrs[111]
        assert lrs[-1] == pytest.approx(3e-4)


@pytest.mark.parametrize('cuda, on_cpu, dtype, width, hidden, has_op, ok', [
    (True, False, torch.bfloat16, 16, 24, True, True),
    (False, False, torch.bfloat16, 16, 24, True, False),
    (False, True, torch.bfloat16, 16, 24, True, True),  # the CPU, forced (GROUPED_MM_ON_CPU)
    (False, True, torch.float32, 16, 24, True, False),
    (True, False, torch.float32, 16, 24, True, False),
    (True, False, torch.float16, 16, 24, True, False),
    (True, False, torch.bfloat16, 12, 24, True, False),
    (False, True, torch.bfloat16, 16, 20, True, False),
    (True, False, torch.bfloat16, 16, 24, False, False)])
def test_grouped_mm_only_for_bf16_aligned_tensors_on_cuda_or_a_forced_cpu(
        cuda, on_cpu, dtype, width, hidden, has_op, ok, monkeypatch):
    if not has_op:
        monkeypatch.delattr(F, 'grouped_mm', raising=False)
    monkeypatch.setattr(train, 'GROUPED_MM_ON_CPU', on_cpu)
    x = types.SimpleNamespace(is_cuda=cuda, is_cpu=not cuda, dtype=dtype, shape=(5, width))
    assert train.grouped_mm_ok(x, hidden) is ok


def test_train_py_holds_the_method_and_imports_only_the_runs_bookkeeping():
    """A reader follows the method in train.py alone: of this project it imports the
    configurator, the error type and runs.py (files, checkpoints, processes), and it defines the
    dispatch's autograd functions, the routing statistics, the parameter table, the data check
    and the precision choice."""
    with open(os.path.join(REPO, 'train.py')) as f:
        tree = ast.parse(f.read())
    imported = {alias.name.split('.')[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split('.')[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)}
    project = {os.path.splitext(name)[0] for name in os.listdir(REPO) if name.endswith('.py')}
    assert imported & project == {'configurator', 'errors', 'runs'}
    defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    assert {'CopyRows', 'WeightedSum', 'routing_row', 'routing_record', 'print_param_table',
            'check_prepared', 'pick_dtype', 'setup_device', 'Meter'} <= defined
