"""route.py on models whose routers are set by hand, so that every statistic has a value known in
advance; and train.py --keep_checkpoints, which --settle reads."""
import json
import re
import sys

import numpy as np
import pytest
import torch

import route
import train
from conftest import TINY, config, read_log, run
from errors import UserError
from prepare import ByteTokenizer

SPACE, A, B = ord(' '), ord('a'), ord('b')
# the windows the statistics below are computed by hand on: "a b " and "  ab"
WINDOWS = np.array([[A, SPACE, B, SPACE], [SPACE, SPACE, A, B]])


def hand_routed(space_first=0, other_first=1, n_layer=2):
    """A bytes model whose every MoE layer sends a space first to expert space_first, any other
    byte first to other_first, and every byte second to expert 2. Attention and the experts
    output zero, so each router sees the byte's embedding alone: e0 for a space, e1 for the rest.
    -> (config, model)."""
    c = config(n_experts=4, top_k=2, n_layer=n_layer, block_size=16)
    model = train.Transformer(c)
    with torch.no_grad():
        model.embed.weight.zero_()
        model.embed.weight[:, 1] = 1.0
        model.embed.weight[SPACE] = torch.eye(c.d_model)[0]
        for block in model.blocks:
            block.attn.proj.weight.zero_()
            block.ffn.down.zero_()
            router = block.ffn.router.weight
            router.zero_()
            router[space_first, 0] = router[other_first, 1] = 10.0
            router[2, 0] = router[2, 1] = 5.0  # second for every byte
    return c, model.eval()


def save_run(folder, name, c, model):
    """A checkpoint as route.py reads it: weights, config, the tokenizer's name."""
    folder.mkdir(exist_ok=True)
    torch.save({'model': model.state_dict(), 'config': vars(c), 'meta': {'tokenizer': 'bytes'}},
               folder / name)


def test_each_statistic_equals_its_hand_computed_value(monkeypatch):
    """First choices 1 0 1 0 and 0 0 1 1; second choice always expert 2."""
    monkeypatch.setattr(route, 'MIN_COUNT', 1)
    _, model = hand_routed()
    s = route.routing_stats(model, ByteTokenizer(), WINDOWS, 'cpu')
    assert s['tokens'] == 8 and (s['n_experts'], s['top_k']) == (4, 2) and len(s['layers']) == 2
    layer = s['layers'][1]
    assert layer['first_load'] == [0.5, 0.5, 0, 0]
    assert layer['load'] == [0.25, 0.25, 0.5, 0]  # 16 assignments, 8 of them to expert 2
    # consecutive pairs: (1,0) (0,1) (1,0) in the first window, (0,0) (0,1) (1,1) in the second
    assert layer['repeat'] == pytest.approx(2 / 6) and layer['repeat_chance'] == 0.5
    assert layer['any_shared'] == 1 and layer['any_shared_chance'] == 1  # expert 2 every time
    # the byte decides the first choice, and so does its class (space or letter): U = 1
    assert layer['h_expert_bits'] == pytest.approx(1)
    assert layer['mi_token_bits'] == pytest.approx(1) and layer['u_token'] == pytest.approx(1)
    assert layer['mi_class_bits'] == pytest.approx(1) and layer['u_class'] == pytest.approx(1)
    assert s['u_token'] == pytest.approx(1) and s['repeat'] == pytest.approx(2 / 6)
    # lift P(e | x) / P(e): 1 / 0.5 for the space at expert 0 and a and b at expert 1
    assert layer['tokens_above_base_rate'] == [
        [{'token': ' ', 'lift': 2.0, 'count': 4}],
        [{'token': 'a', 'lift': 2.0, 'count': 2}, {'token': 'b', 'lift': 2.0, 'count': 2}],
        [], []]
    assert layer['coactivation'] == [[0, 0, 0.5, 0], [0, 0, 0.5, 0], [0.5, 0.5, 0, 0],
                                     [0, 0, 0, 0]]


def test_a_router_that_never_varies_has_no_u_and_a_rare_token_is_not_ranked():
    """Every byte to the same two experts: H(E) = 0, U undefined (None, - in stats.md); MIN_COUNT
    keeps 8 tokens out of the ranking."""
    _, model = hand_routed(space_first=1, other_first=1)
    s = route.routing_stats(model, ByteTokenizer(), WINDOWS, 'cpu')
    layer = s['layers'][0]
    assert layer['mi_token_bits'] == 0 and layer['u_token'] is None and s['u_token'] is None
    assert layer['repeat'] == 1 and layer['tokens_above_base_rate'] == [[], [], [], []]
    assert '| 0.000 | - | - |' in route.stats_markdown(s, 'never varies')


@pytest.mark.parametrize('experts, u', [
    ([0, 1, 0, 1], 0.0),   # each byte half to each expert: blind to the byte, H(E) 1 bit
    ([0, 1, 2, 3], 0.5),   # each byte split over 2 of 4 experts: H(E) 2, H(E | X) 1
    ([0, 0, 1, 1], 1.0)])  # each byte to its own expert
def test_u_is_the_share_of_the_first_choice_the_token_determines(experts, u):
    x = np.array([[A, A, B, B]])
    layer = route.layer_stats(x, np.array(experts)[None, :, None], 4, chr)
    assert layer['u_token'] == pytest.approx(u)


def test_a_random_routers_repeat_rate_matches_chance_within_its_error():
    """Random router weights on independent random bytes: consecutive tokens choose independently,
    so each repeat rate is its chance value, within 4 standard errors of a share of 24,000 pairs."""
    torch.manual_seed(0)
    c = config(n_experts=4, top_k=2, n_layer=1, block_size=16)
    model = train.Transformer(c).eval()
    with torch.no_grad():
        model.blocks[0].attn.proj.weight.zero_()  # a token's routing depends on the token alone
        model.embed.weight.normal_()
        model.blocks[0].ffn.router.weight.normal_()
    windows = np.random.default_rng(0).integers(0, 256, size=(1600, 16))
    layer = route.routing_stats(model, ByteTokenizer(), windows, 'cpu')['layers'][0]
    pairs = 1600 * 15
    for rate, chance in (('repeat', 'repeat_chance'), ('any_shared', 'any_shared_chance')):
        p = layer[chance]
        assert 0.1 < p < 0.95  # a real test: neither rate is pinned at 0 or 1
        assert abs(layer[rate] - p) < 4 * (p * (1 - p) / pairs) ** 0.5, (rate, layer[rate], p)


def test_the_html_has_one_span_per_token_and_layer_and_the_top_k_on_hover():
    c, model = hand_routed(n_layer=3)
    ids = [A, SPACE, B]
    experts, weights = route.routing(model, torch.tensor([ids]))
    texts = route.token_texts(ByteTokenizer(), ids)
    page = route.html_page(texts, experts[:, 0], weights[:, 0], 4, 'hand')
    spans = re.findall(r'<span class="t" style="background:(#\w+)" title="([^"]*)">(.)</span>',
                       page)
    assert len(spans) == 3 * 3  # tokens x layers
    assert spans[:3] == [(route.colour(1), 'expert 1 (1.00), expert 2 (0.00)', 'a'),
                         (route.colour(0), 'expert 0 (1.00), expert 2 (0.00)', ' '),
                         (route.colour(1), 'expert 1 (1.00), expert 2 (0.00)', 'b')]


def test_the_terminal_bands_carry_each_first_choices_colour():
    _, model = hand_routed(n_layer=1)
    experts, _ = route.routing(model, torch.tensor([[A, SPACE, ord('\n')]]))
    texts = route.token_texts(ByteTokenizer(), [A, SPACE, ord('\n')])
    lines = route.terminal_bands(texts, experts[:, 0], 4).splitlines()
    # expert 1 is #ffffb3 (255, 255, 179), expert 0 #8dd3c7 (141, 211, 199); black text on both
    assert lines[1] == ('layer 0: \x1b[48;2;255;255;179m\x1b[30ma\x1b[0m'
                        '\x1b[48;2;141;211;199m\x1b[30m \x1b[0m'
                        '\x1b[48;2;255;255;179m\x1b[30m↵\x1b[0m')
    assert lines[0].count('\x1b[48;2;') == 4  # the legend: one swatch an expert


def test_a_pipe_gets_the_bands_without_colour_each_layers_experts_under_the_text(tmp_path):
    _, model = hand_routed()  # a space first to expert 0, a or b to 1, in both layers
    save_run(tmp_path, 'latest.pt', config(n_experts=4, top_k=2, block_size=16), model)
    out = run('route.py', '--out_dir', str(tmp_path), '--start', 'a b', '--device', 'cpu')
    assert out.returncode == 0, out.stderr
    assert '\x1b[' not in out.stdout + out.stderr
    assert out.stdout.splitlines() == [
        f"under the text, each layer's first choice (experts 0 1 2 3)   {route.SYMBOLS}",
        'text:    a b', 'layer 0: 101', 'layer 1: 101']


@pytest.mark.parametrize('no_color, coloured', [(None, True), ('', True), ('1', False)])
def test_colour_codes_go_to_a_terminal_without_no_color_alone(tmp_path, monkeypatch, capsys,
                                                             no_color, coloured):
    """NO_COLOR set to anything but the empty string turns the colour off (no-color.org)."""
    c, model = hand_routed()
    save_run(tmp_path, 'latest.pt', c, model)
    monkeypatch.setattr(sys.stdout, 'isatty', lambda: True)
    if no_color is None:
        monkeypatch.delenv('NO_COLOR', raising=False)
    else:
        monkeypatch.setenv('NO_COLOR', no_color)
    route.main(['--out_dir', str(tmp_path), '--start', 'a b', '--device', 'cpu'])
    out = capsys.readouterr().out
    assert ('\x1b[48;2;' in out) == coloured and ('\x1b[' in out) == coloured
    assert out.count('layer ') == 2


def test_stats_name_their_files_and_say_what_their_symbols_stand_for(tmp_path, monkeypatch,
                                                                     capsys):
    """é is 2 bytes, each no character alone: <195> and <169> in the ranking, as the legend
    says."""
    monkeypatch.setattr(route, 'MIN_COUNT', 1)
    c, model = hand_routed()
    save_run(tmp_path, 'latest.pt', c, model)
    (tmp_path / 'text.txt').write_text('a é b ' * 8, encoding='utf-8')
    route.main(['--out_dir', str(tmp_path), '--stats', '--stats_on', str(tmp_path / 'text.txt'),
                '--device', 'cpu'])
    out, err = capsys.readouterr()
    to = tmp_path / 'route'
    assert err == f'route.py: wrote {to / "stats.json"} and {to / "stats.md"}\n'
    legend = ('¶ is the end of a text (EOT); <n> is token n, no character alone (in a bytes run, '
              'byte n: part of a multi-byte UTF-8 character).')
    table = (to / 'stats.md').read_text(encoding='utf-8')
    assert out == table + '\n' and table.count(legend) == 1
    # 4 bytes in 7 are no space, and all of them go first to expert 1: lift about 7 / 4
    assert '| 0 | 1 | "a" (1.7), "b" (1.7), "<169>" (1.7), "<195>" (1.7) |' in table


def test_the_routing_settles_as_the_kept_checkpoints_say(tmp_path):
    """Step 10 swaps the first choices of the final routing (top-2 sets {1, 2} against {0, 2}:
    half of each token's choices kept), step 20 has it already, 30 is the last."""
    for step, (space_first, other_first) in ((10, (1, 0)), (20, (0, 1)), (30, (0, 1))):
        c, model = hand_routed(space_first, other_first)
        save_run(tmp_path, f'ckpt_{step}.pt', c, model)
    s = route.settle(str(tmp_path), WINDOWS, 'cpu')
    assert s['steps'] == [10, 20, 30]
    assert s['layers'] == [[0.5, 1.0, 1.0]] * 2 and s['mean'] == [0.5, 1.0, 1.0]


def test_settle_without_kept_checkpoints_names_the_flag(tmp_path):
    with pytest.raises(UserError, match='--keep_checkpoints=True'):
        route.kept_checkpoints(str(tmp_path))


def test_a_dense_run_and_a_file_that_is_no_checkpoint_are_one_line(tmp_path):
    dense = config(ffn='dense', ffn_hidden=32)
    save_run(tmp_path / 'dense', 'latest.pt', dense, train.Transformer(dense))
    (tmp_path / 'junk').mkdir()
    (tmp_path / 'junk' / 'latest.pt').write_text('not a checkpoint')
    for folder, says in (('dense', 'is a dense run: it has no router to look at'),
                         ('junk', 'is not a plain checkpoint (damaged')):
        out = run('route.py', '--out_dir', str(tmp_path / folder), '--device', 'cpu')
        assert out.returncode == 1 and out.stderr.count('\n') == 1, out.stderr
        assert says in out.stderr and 'Traceback' not in out.stderr


def test_route_py_on_a_trained_run_writes_its_files(prepared):
    """A tiny cpu_moe run that keeps its checkpoints (whose log equals the same run's without
    them), then route.py on a text, --stats and --settle, as a user runs it."""
    args = ['train.py', 'config/cpu_moe.py', f'--data_dir={prepared / "data"}', *TINY]
    kept, plain = prepared / 'kept', prepared / 'plain'  # plain: latest.pt at the end alone
    out = run(*args, f'--out_dir={kept}', '--keep_checkpoints=True', '--ckpt_interval=10')
    assert out.returncode == 0, out.stderr
    assert run(*args, f'--out_dir={plain}').returncode == 0
    assert read_log(kept) == read_log(plain)
    assert sorted(p.name for p in kept.glob('ckpt_*.pt')) == [
        'ckpt_10.pt', 'ckpt_20.pt', 'ckpt_30.pt', 'ckpt_40.pt']
    out = run('route.py', '--out_dir', str(kept), '--start', 'once upon a time', '--device', 'cpu')
    assert out.returncode == 0, out.stderr
    assert out.stdout.count('layer ') == 2 and '\x1b[' not in out.stdout  # a pipe: plain text
    out = run('route.py', '--out_dir', str(kept), '--stats', '--settle', '--device', 'cpu')
    assert out.returncode == 0, out.stderr
    to = kept / 'route'
    assert f'route.py: wrote {to / "stats.json"} and {to / "stats.md"}\n' in out.stderr
    assert f'route.py: wrote {to / "settle.json"} and {to / "settle.png"}\n' in out.stderr
    stats = json.loads((kept / 'route' / 'stats.json').read_text())
    settle = json.loads((kept / 'route' / 'settle.json').read_text())
    assert stats['tokens'] % 32 == 0 and len(stats['layers']) == 2
    assert settle['steps'] == [10, 20, 30, 40] and settle['mean'][-1] == 1
    assert {p.name for p in (kept / 'route').iterdir()} == {
        'route.html', 'route.png', 'stats.json', 'stats.md', 'settle.json', 'settle.png'}


def test_the_figure_wraps_between_words_inside_a_long_word_and_after_a_newline():
    texts = [*'ab cd', '↵', *'efghi']
    rows = {}
    for row, col, text, _ in route.wrap(texts, 4):
        rows[row] = rows.get(row, '') + text
    assert rows == {0: 'ab ', 1: 'cd↵', 2: 'efgh', 3: 'i'}
    assert [w for w in route.words([' once', ' upon', ',']) if w] == [[0], [1, 2]]  # GPT-2's
