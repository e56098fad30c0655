"""
Look inside a trained MoE's routers: which experts each token goes to, layer by layer, what each
expert takes, and when the routing settles during training.

    python route.py --out_dir out/cpu_moe-s1 --start "once upon a time"  # the text, coloured
    python route.py --out_dir out/cpu_moe-s1                  # on a story it generates first
    python route.py --out_dir out/cpu_moe-s1 --stats          # statistics on the validation split
    python route.py --out_dir out/cpu_moe-s1 --settle         # needs --keep_checkpoints=True runs

The text goes to the terminal (one coloured band per layer; on a pipe, a file or with NO_COLOR
set, each layer's experts as characters under the text), route.html (hover a token for its
top-k experts and weights) and route.png; --stats writes stats.json and stats.md, --settle
settle.json and settle.png, all in <out_dir>/route/. docs/reference.md defines each statistic.
"""
import argparse
import glob
import html
import json
import os
import re
import string
import sys

import numpy as np
import torch

from errors import UserError, one_line_errors
from report import pyplot
from sample import generate, load_model, read_start
from train import MoE

# an expert's colour in the terminal, HTML and PNG (light, under black text); past 16 they repeat
COLOURS = ('#8dd3c7', '#ffffb3', '#bebada', '#fb8072', '#80b1d3', '#fdb462', '#b3de69', '#fccde5',
           '#d9d9d9', '#bc80bd', '#ccebc5', '#ffed6f', '#a6cee3', '#b2df8a', '#fdbf6f', '#cab2d6')
# an expert's mark under the text where the output takes no colour; past 36 experts they repeat
MARKS = string.digits + string.ascii_lowercase
# what token_texts' symbols stand for, in the bands' legends
SYMBOLS = '↵ is a newline, ¶ the end of a text (EOT)'
# the byte classes of a bytes-tokenizer run, for the token-class statistics
BYTE_CLASSES = ('letter', 'digit', 'space', 'newline', 'punctuation', 'other')
# --settle reads this many windows, spread evenly over the split: ~16K tokens at the CPU recipe,
# enough for a share's standard error under 0.004, at a twelfth of the whole split's time
SETTLE_WINDOWS = 64
MIN_COUNT = 50  # a token is ranked for an expert (tokens_above_base_rate) from this many on
TOP_TOKENS = 5  # tokens listed per expert


def colour(expert):
    return COLOURS[expert % len(COLOURS)]


# ----------------------------------------------------------------------------- the routers' choices
def load_moe(out_dir, device, name):
    """A run's checkpoint as load_model gives it, refused in one line if the model has no router."""
    model, tok = load_model(out_dir, device, name)
    if not isinstance(model.blocks[0].ffn, MoE):
        raise UserError(f'{out_dir} is a dense run: it has no router to look at; route.py reads '
                        'MoE runs (e.g. out/cpu_moe-s1)')
    return model, tok


@torch.no_grad()
def routing(model, idx):
    """Each token's experts and routing weights in every layer, for windows idx (B, T). -> experts,
    weights: numpy arrays (n_layer, B, T, top_k), first choice first."""
    experts, weights = [], []

    def keeping(route):
        """route, also keeping what it chose; it returns them choice-major, (k * N,)."""
        def route_and_keep(x):
            probs, log_z, w, e = route(x)
            k = e.numel() // x.shape[0]
            experts.append(e.view(k, -1).t().cpu())  # (N, k): token n's choices in a row
            weights.append(w.view(k, -1).t().float().cpu())
            return probs, log_z, w, e
        return route_and_keep

    layers = [block.ffn for block in model.blocks]
    for ffn in layers:
        ffn.route = keeping(ffn.route)  # an instance attribute: found before MoE.route
    try:
        model(idx)
    finally:
        for ffn in layers:
            del ffn.route  # MoE.route again
    shape = (len(layers), *idx.shape, -1)
    return torch.stack(experts).view(shape).numpy(), torch.stack(weights).view(shape).numpy()


def routing_of_windows(model, windows, device):
    """routing() over many windows (n, T), a batch at a time: at most about 16M logits a batch,
    since the forward also computes the head's. -> experts, weights (n_layer, n, T, top_k)."""
    n, T = windows.shape
    batch = max(1, min(64, 2**24 // (T * model.lm_head.out_features)))
    parts = [routing(model, torch.from_numpy(windows[i:i + batch]).to(device))
             for i in range(0, n, batch)]
    return (np.concatenate([e for e, _ in parts], axis=1),
            np.concatenate([w for _, w in parts], axis=1))


def validation_windows(out_dir, text_path, tok, block_size):
    """The windows the statistics read: the run's validation split, or a text file tokenised as
    the run's data, in consecutive windows of block_size (a last partial window dropped)."""
    if text_path:
        try:
            tokens = np.array(tok.encode(open(text_path, encoding='utf-8').read()))
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f'cannot read the text file {text_path!r}: {e}') from None
    else:
        config = json.load(open(os.path.join(out_dir, 'config.json')))
        path = os.path.join(config['data_dir'], 'val.bin')
        if not os.path.isfile(path):
            raise UserError(f'{path} not found: prepare the run\'s data first (README: "Run it"), '
                            'or give a text with --stats_on FILE')
        tokens = np.fromfile(path, dtype=np.uint16)
    n = len(tokens) // block_size
    if n == 0:
        raise UserError(f'the text has {len(tokens)} tokens, fewer than one window of {block_size}')
    return tokens[:n * block_size].astype(np.int64).reshape(n, block_size)


# ----------------------------------------------------------------------------- one text, shown
def token_label(tok, i):
    """A token in the statistics: its text, ¶ for EOT, <id> where it is no character alone."""
    if i == tok.eot_id:
        return '¶'
    text = tok.decode([i])
    return f'<{i}>' if '\ufffd' in text else text


def token_texts(tok, ids):
    """How each token shows: its text, a newline as ↵ (so a band stays one line), EOT as ¶."""
    return ['¶' if i == tok.eot_id else tok.decode([i]).replace('\n', '↵') for i in ids]


def background(expert, text):
    """text on the expert's colour in a terminal (24-bit colour), in black."""
    r, g, b = (int(colour(expert)[i:i + 2], 16) for i in (1, 3, 5))
    return f'\x1b[48;2;{r};{g};{b}m\x1b[30m{text}\x1b[0m'


def layer_rows(texts, experts, cell):
    """A row per layer: 'layer i: ', then each token as cell(first choice, text) shows it."""
    return [f'layer {layer}: ' + ''.join(cell(c[0], t) for t, c in zip(texts, choices))
            for layer, choices in enumerate(experts)]


def terminal_bands(texts, experts, n_experts):
    """A legend, then the text once per layer, each token on its first choice's colour."""
    legend = ' '.join(background(e, f' {e} ') for e in range(n_experts))
    return '\n'.join([f'experts: {legend}   {SYMBOLS}'] + layer_rows(texts, experts, background))


def plain_bands(texts, experts, n_experts):
    """terminal_bands in plain text: the text, then under it each layer's first choices as marks."""
    marks = [MARKS[e % len(MARKS)] for e in range(n_experts)]
    lines = [f"under the text, each layer's first choice (experts {' '.join(marks)})   {SYMBOLS}",
             'text:    ' + ''.join(texts)]
    return '\n'.join(lines + layer_rows(texts, experts, lambda e, text: marks[e] * len(text)))


def html_page(texts, experts, weights, n_experts, title):
    """One span per token and layer on its first choice's colour; hovering shows its top-k experts
    and their weights."""
    legend = ' '.join(f'<span class="t" style="background:{colour(e)}">expert {e}</span>'
                      for e in range(n_experts))
    bands = []
    for layer, (choices, ws) in enumerate(zip(experts, weights)):
        spans = []
        for text, c, w in zip(texts, choices, ws):
            hover = ', '.join(f'expert {e} ({x:.2f})' for e, x in zip(c, w))
            spans.append(f'<span class="t" style="background:{colour(c[0])}" '
                         f'title="{html.escape(hover)}">{html.escape(text)}</span>')
        bands.append(f'<h2>layer {layer}</h2>\n<div class="band">{"".join(spans)}</div>')
    style = ('body{font-family:sans-serif;max-width:60em;margin:2em auto}'
             '.band{font-family:monospace;white-space:pre-wrap;line-height:1.6}')
    return (f'<!doctype html>\n<meta charset="utf-8">\n<title>{html.escape(title)}</title>\n'
            f'<style>{style}</style>\n<h1>{html.escape(title)}</h1>\n'
            '<p>Each token on the colour of its first-choice expert; hover for its top-k experts '
            f'and routing weights.</p>\n<p>{legend}</p>\n' + '\n'.join(bands) + '\n')


def words(texts):
    """Token indices grouped into words: a word ends after a space or newline, or before a token
    that starts with a space (GPT-2's " dog")."""
    groups, word = [], []
    for i, text in enumerate(texts):
        if text.startswith(' ') and word:
            groups.append(word)
            word = []
        word.append(i)
        if text.endswith((' ', '↵')):
            groups.append(word)
            word = []
    if word:
        groups.append(word)
    return groups


def wrap(texts, width):
    """Lay tokens out in rows of at most width characters, breaking between words (inside a word
    longer than a row) and after a newline: -> [(row, column, text, token index)]."""
    cells, row, col = [], 0, 0
    for word in words(texts):
        if col + sum(len(texts[i]) for i in word) > width and col > 0:
            row, col = row + 1, 0
        for i in word:
            if col + len(texts[i]) > width and col > 0:
                row, col = row + 1, 0
            cells.append((row, col, texts[i], i))
            col += len(texts[i])
        if texts[word[-1]].endswith('↵'):
            row, col = row + 1, 0
    return cells


def text_figure(texts, experts, n_experts, title, path, width=72):
    """Mixtral's figure (its paper's section 5): the text once per layer, in a monospace grid,
    each token on its first choice's colour."""
    plt = pyplot()
    from matplotlib.patches import Patch, Rectangle
    cells = wrap(texts, width)
    rows = cells[-1][0] + 1
    fig, axes = plt.subplots(len(experts), 1, squeeze=False,
                             figsize=(width * 0.12, len(experts) * (rows * 0.24 + 0.5) + 0.6))
    for layer, ax in enumerate(axes[:, 0]):
        for row, col, text, i in cells:
            ax.add_patch(Rectangle((col, -row - 1), len(text), 1,
                                   color=colour(experts[layer][i][0])))
            for j, char in enumerate(text):  # a character a cell: the grid holds in any font
                ax.text(col + j + 0.5, -row - 0.5, char, ha='center', va='center',
                        family='monospace', fontsize=8)
        ax.set(xlim=(0, width), ylim=(-rows, 0))
        ax.axis('off')
        ax.set_title(f'layer {layer}', loc='left', fontsize=9)
    handles = [Patch(color=colour(e), label=f'expert {e}') for e in range(n_experts)]
    fig.legend(handles=handles, loc='lower center', ncol=min(n_experts, 8), fontsize=8,
               frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ----------------------------------------------------------------------------- statistics
def entropy_bits(counts):
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def mutual_information_bits(x, e, n_experts):
    """I(X; E) in bits, the plug-in estimate from (x, e) pair counts: H(X) + H(E) - H(X, E)."""
    return (entropy_bits(np.unique(x, return_counts=True)[1])
            + entropy_bits(np.bincount(e, minlength=n_experts))
            - entropy_bits(np.unique(x * n_experts + e, return_counts=True)[1]))


def byte_class(byte):
    """The BYTE_CLASSES index of a byte value (256, EOT, and non-ASCII bytes: other)."""
    char = chr(byte) if byte < 128 else ''
    if char.isalpha():
        return 0
    if char.isdigit():
        return 1
    if char == ' ':
        return 2
    if char == '\n':
        return 3
    if char and char in string.punctuation:
        return 4
    return 5


def repeat_rates(experts, n_experts):
    """Consecutive tokens of a window (experts: (n, T, k)): the share whose first choices are the
    same, and whose k experts share any; each beside chance, the same share for independent tokens
    with these frequencies of first choices (or of sets of k experts)."""
    first = experts[..., 0]
    p = np.bincount(first.ravel(), minlength=n_experts) / first.size
    masks = (1 << experts).sum(axis=-1)  # each token's k experts as a bit mask
    sets, counts = np.unique(masks, return_counts=True)
    q = counts / counts.sum()
    overlap = (sets[:, None] & sets[None, :]) != 0
    return {'repeat': float((first[:, 1:] == first[:, :-1]).mean()),
            'repeat_chance': float((p ** 2).sum()),
            'any_shared': float(((masks[:, 1:] & masks[:, :-1]) != 0).mean()),
            'any_shared_chance': float(q @ overlap @ q)}


def tokens_above_base_rate(x, first, n_experts, decode):
    """Per expert, the TOP_TOKENS tokens (of those seen MIN_COUNT times or more) it takes as first
    choice most above its base rate: lift P(e | x) / P(e), with how often it took them."""
    values, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    joint = np.zeros((len(values), n_experts))
    np.add.at(joint, (inverse, first), 1)
    base = np.bincount(first, minlength=n_experts) / len(first)
    ranked = []
    for e in range(n_experts):
        lift = joint[:, e] / counts / max(base[e], 1e-12)
        lift[counts < MIN_COUNT] = -1
        best = [i for i in np.argsort(-lift, kind='stable')[:TOP_TOKENS] if lift[i] > 0]
        ranked.append([{'token': decode(values[i]), 'lift': float(lift[i]),
                        'count': int(joint[i, e])} for i in best])
    return ranked


def coactivation(experts, n_experts):
    """C[i][j], i != j: the share of tokens whose top-k holds both experts i and j (0 at top-1)."""
    flat = experts.reshape(-1, experts.shape[-1])
    c = np.zeros((n_experts, n_experts))
    for a in range(flat.shape[1]):
        for b in range(flat.shape[1]):
            if a != b:
                np.add.at(c, (flat[:, a], flat[:, b]), 1)
    return (c / len(flat)).tolist()


def layer_stats(x, experts, n_experts, decode, classes=None):
    """One layer's statistics (docs/reference.md, "route.py"). x: the tokens (n, T); experts:
    their choices (n, T, k); classes: each token's class (n, T), for a bytes run."""
    first = experts[..., 0].ravel()
    h_expert = entropy_bits(np.bincount(first, minlength=n_experts))
    load = np.bincount(experts.ravel(), minlength=n_experts) / experts.size
    out = {'load': load.tolist(),
           'first_load': (np.bincount(first, minlength=n_experts) / len(first)).tolist(),
           **repeat_rates(experts, n_experts),
           'h_expert_bits': h_expert,
           'mi_token_bits': mutual_information_bits(x.ravel(), first, n_experts)}
    out['u_token'] = out['mi_token_bits'] / h_expert if h_expert else None
    if classes is not None:
        out['mi_class_bits'] = mutual_information_bits(classes.ravel(), first, n_experts)
        out['u_class'] = out['mi_class_bits'] / h_expert if h_expert else None
    out['tokens_above_base_rate'] = tokens_above_base_rate(x.ravel(), first, n_experts, decode)
    out['coactivation'] = coactivation(experts, n_experts)
    return out


def routing_stats(model, tok, windows, device):
    """Every layer's statistics on windows (n, T), and the run's means over the layers."""
    experts, _ = routing_of_windows(model, windows, device)
    n_experts = model.blocks[0].ffn.n_experts
    classes = None
    if tok.name == 'bytes':
        classes = np.vectorize(byte_class)(windows)
    layers = [layer_stats(windows, e, n_experts, lambda i: token_label(tok, i), classes)
              for e in experts]
    out = {'tokens': int(windows.size), 'n_experts': n_experts, 'top_k': experts.shape[-1],
           'layers': layers}
    for key in ('u_token', 'u_class', 'repeat', 'repeat_chance'):
        if key in layers[0]:  # the mean over the layers; None where a layer's is undefined
            values = [layer[key] for layer in layers]
            out[key] = None if None in values else float(np.mean(values))
    return out


def number(x, digits=3):
    """x to `digits` decimals; - for None (U where a layer's first choice never varies)."""
    return '-' if x is None else f'{x:.{digits}f}'


def stats_markdown(s, title):
    lines = [f'# Routing statistics: {title}', '',
             f'{s["tokens"]:,} tokens, {s["n_experts"]} experts, top-{s["top_k"]}; first choices. '
             'U = I(token; expert) / H(expert), the share of the first choice the token alone '
             'determines (docs/reference.md).', '',
             '| layer | first-choice load | repeat (chance) | any of k shared (chance) | '
             'I(token; E) bits | U token | U class |', '|---|---|---|---|---|---|---|']
    for i, layer in enumerate(s['layers']):
        load = ' '.join(f'{x:.2f}' for x in layer['first_load'])
        lines.append(f'| {i} | {load} | {layer["repeat"]:.3f} ({layer["repeat_chance"]:.3f}) | '
                     f'{layer["any_shared"]:.3f} ({layer["any_shared_chance"]:.3f}) | '
                     f'{layer["mi_token_bits"]:.3f} | {number(layer["u_token"])} | '
                     f'{number(layer.get("u_class"))} |')
    lines += ['', 'The tokens each expert takes as first choice most above its base rate (lift). '
              '¶ is the end of a text (EOT); <n> is token n, no character alone (in a bytes run, '
              'byte n: part of a multi-byte UTF-8 character).',
              '', '| layer | expert | tokens (lift) |', '|---|---|---|']
    for i, layer in enumerate(s['layers']):
        for e, ranked in enumerate(layer['tokens_above_base_rate']):
            # each token quoted, a newline as \n, but ¶ and any other character as itself
            shown = ', '.join(f'{json.dumps(r["token"], ensure_ascii=False)} ({r["lift"]:.1f})'
                              for r in ranked)
            lines.append(f'| {i} | {e} | {shown} |')
    return '\n'.join(lines) + '\n'


# ----------------------------------------------------------------------------- settling
def kept_checkpoints(out_dir):
    """A run's ckpt_<step>.pt files (train.py --keep_checkpoints=True), by step."""
    named = [re.fullmatch(r'ckpt_(\d+)\.pt', os.path.basename(p))
             for p in glob.glob(os.path.join(out_dir, 'ckpt_*.pt'))]
    steps = {int(m.group(1)): os.path.join(out_dir, m.group(0)) for m in named if m}
    if len(steps) < 2:
        raise UserError(f'{out_dir} keeps {len(steps)} ckpt_<step>.pt: train the run with '
                        '--keep_checkpoints=True to follow its routing along training')
    return dict(sorted(steps.items()))


def settle(out_dir, windows, device):
    """Per layer, each kept checkpoint's mean over tokens of |its top-k ∩ the final top-k| / k, on
    SETTLE_WINDOWS of the windows: -> {'steps', 'layers', 'mean'}."""
    checkpoints = kept_checkpoints(out_dir)
    if len(windows) > SETTLE_WINDOWS:
        windows = windows[np.linspace(0, len(windows) - 1, SETTLE_WINDOWS).astype(int)]
    chosen = {}
    for step, path in checkpoints.items():
        model, _ = load_moe(out_dir, device, os.path.basename(path))
        chosen[step] = routing_of_windows(model, windows, device)[0]
    final = chosen[max(chosen)]
    shares = []  # per checkpoint, per layer
    for experts in chosen.values():
        # per token: how many of its k experts are among its final k
        kept = (experts[..., :, None] == final[..., None, :]).any(axis=-1).sum(axis=-1)
        shares.append(kept.mean(axis=(1, 2)) / final.shape[-1])
    layers = np.array(shares).T.tolist()  # per layer, per checkpoint
    return {'steps': list(chosen), 'layers': layers, 'mean': np.mean(layers, axis=0).tolist()}


def settle_figure(s, title, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, shares in enumerate(s['layers']):
        ax.plot(s['steps'], shares, lw=1, label=f'layer {i}')
    ax.plot(s['steps'], s['mean'], color='black', lw=2, label='mean')
    ax.set(xlabel='step', ylabel='share of the final top-k choices', ylim=(0, 1.02))
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def show_text(model, tok, args, to, title):
    """The text's routing: in the terminal, route.html and route.png."""
    # EOT first: a story that begins like this
    ids = [tok.eot_id] + tok.encode(read_start(args.start))
    if len(ids) == 1:  # no text given: a story the model writes first
        torch.manual_seed(args.seed)
        prompt = torch.tensor([ids], device=args.device)
        ids = generate(model, prompt, args.max_new_tokens, stop_id=tok.eot_id)[0].tolist()
    if len(ids) > model.block_size:
        print(f'route.py: the text is cut to the first {model.block_size} tokens (the context)',
              file=sys.stderr)
        ids = ids[:model.block_size]
    experts, weights = routing(model, torch.tensor([ids], device=args.device))
    experts, weights = experts[:, 0, 1:], weights[:, 0, 1:]  # one window, without its EOT
    texts = token_texts(tok, ids[1:])
    n_experts = model.blocks[0].ffn.n_experts
    # colour codes on a terminal alone, and not under NO_COLOR (no-color.org), as ls and git decide
    coloured = sys.stdout.isatty() and not os.environ.get('NO_COLOR')
    bands = terminal_bands if coloured else plain_bands
    print(bands(texts, experts, n_experts))
    page, figure = os.path.join(to, 'route.html'), os.path.join(to, 'route.png')
    with open(page, 'w', encoding='utf-8') as f:
        f.write(html_page(texts, experts, weights, n_experts, title))
    text_figure(texts, experts, n_experts, title, figure)
    print(f'route.py: wrote {page} and {figure}', file=sys.stderr)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--out_dir', required=True, help='an MoE run folder')
    p.add_argument('--ckpt', default='latest.pt',
                   help='the checkpoint in out_dir (latest.pt: the model after its last step)')
    p.add_argument('--start', default='', help='the text, or FILE:path; empty: a story the model '
                   'writes first (not shown with --stats or --settle)')
    p.add_argument('--max_new_tokens', type=int, default=300, help='the story\'s length')
    p.add_argument('--seed', type=int, default=1, help='the story\'s random seed')
    p.add_argument('--stats', action='store_true', help='statistics on the validation split')
    p.add_argument('--stats_on', metavar='FILE', help='... or on this text file')
    p.add_argument('--settle', action='store_true',
                   help='the kept checkpoints\' share of the final routing')
    p.add_argument('--to', help='where the files go (default: <out_dir>/route)')
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    args = p.parse_args(argv)
    if args.device.startswith('cuda') and not torch.cuda.is_available():
        raise UserError('--device cuda but torch sees no CUDA GPU; use --device cpu')
    to = args.to or os.path.join(args.out_dir, 'route')
    title = os.path.basename(os.path.normpath(args.out_dir))
    model, tok = load_moe(args.out_dir, args.device, args.ckpt)
    os.makedirs(to, exist_ok=True)
    if args.stats or args.settle:
        windows = validation_windows(args.out_dir, args.stats_on, tok, model.block_size)
    else:
        show_text(model, tok, args, to, title)
    if args.stats:
        s = routing_stats(model, tok, windows, args.device)
        data, table = os.path.join(to, 'stats.json'), os.path.join(to, 'stats.md')
        with open(data, 'w') as f:
            json.dump(s, f, indent=1)
        text = stats_markdown(s, title)
        with open(table, 'w', encoding='utf-8') as f:
            f.write(text)
        print(text)
        print(f'route.py: wrote {data} and {table}', file=sys.stderr)
    if args.settle:
        s = settle(args.out_dir, windows, args.device)
        data, figure = os.path.join(to, 'settle.json'), os.path.join(to, 'settle.png')
        with open(data, 'w') as f:
            json.dump(s, f, indent=1)
        settle_figure(s, title, figure)
        print('step  share of the final top-k choices (mean over layers)')
        for step, share in zip(s['steps'], s['mean']):
            print(f'{step:5d}  {share:.3f}')
        print(f'route.py: wrote {data} and {figure}', file=sys.stderr)


if __name__ == '__main__':
    with one_line_errors('route.py'):
        main()
