"""export_hf.py: tiny random dense and MoE runs exported and loaded by transformers give our logits
and our greedy generations, the exported tokenizers encode and decode like ours, and the model card
gives a real run's own figures. transformers is a test-only dependency (installed by make test)."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import export_hf
import prepare
import runs
import sample
import train
from conftest import REPO, TINY, config

transformers = pytest.importorskip('transformers')


def fake_run(tmp_path, **overrides):
    """A run folder holding a best.pt of a tiny model whose every weight is random and large
    (std 0.5; norm gains in 0.5-1.5), not at init scale: then a mix-up of any two weights moves the
    logits far beyond the tolerance. Its log.jsonl has the one evaluation that made it best.pt."""
    torch.manual_seed(0)
    c = config(block_size=32, n_layer=2, **overrides)
    model = train.Transformer(c)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if 'norm' in name else p.normal_(0, 0.5)
    run_dir = tmp_path / 'run'
    run_dir.mkdir()
    runs.save(str(run_dir / 'best.pt'),
               {'model': model.state_dict(), 'config': vars(c), 'iter': 10, 'tokens': 2560,
                'best_val': 5.0, 'meta': {'tokenizer': 'bytes', 'vocab_size': 257, 'eot_id': 256}})
    (run_dir / 'log.jsonl').write_text(json.dumps({'iter': 10, 'val_loss': 5.0}) + '\n')
    return model.eval(), run_dir


def card_rows(folder):
    """The model card's table as {row name: text}."""
    card = (folder / 'README.md').read_text()
    return dict(re.findall(r'^\| (.+?) \| (.+) \|$', card, re.MULTILINE))


def max_logit_difference(model, folder):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    idx = torch.randint(0, 257, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(idx)[0], hf(idx).logits
    # relative to the largest logit
    return (ours - theirs).abs().max().item() / ours.abs().max().item(), hf


@pytest.mark.parametrize('ffn, arch',
                         [('dense', 'LlamaForCausalLM'), ('moe', 'MixtralForCausalLM')])
def test_exported_model_and_tokenizer_give_our_logits_and_greedy_stories(tmp_path, ffn, arch,
                                                                         monkeypatch):
    extra = {'ffn_hidden': 40} if ffn == 'dense' else {'n_experts': 4, 'top_k': 2}
    model, run_dir = fake_run(tmp_path, ffn=ffn, **extra)
    export_hf.export(str(run_dir), str(tmp_path / 'hf'))
    diff, hf = max_logit_difference(model, tmp_path / 'hf')
    print(f'{arch}: max logit difference {diff:.1e} of the largest logit')
    assert type(hf).__name__ == arch and diff <= 1e-5
    # the card names the class and counts the weights the folder holds (a tied lm_head once)
    rows = card_rows(tmp_path / 'hf')
    total = sum(t.numel() for t in load_file(tmp_path / 'hf' / 'model.safetensors').values())
    assert rows['architecture'].startswith(arch + ': 2 layers, d_model 16, 2 heads, ')
    assert rows['parameters'].startswith(f'{total:,} total, ')
    # the negative control: gate (w1) and up (w3) swapped in the export must fail the same
    # check, by far
    real = export_hf.hf_state_dict
    swap = {'w1': 'w3', 'w3': 'w1', 'gate_proj': 'up_proj', 'up_proj': 'gate_proj'}
    monkeypatch.setattr(export_hf, 'hf_state_dict', lambda c, sd: {
        '.'.join(swap.get(part, part) for part in name.split('.')): t
        for name, t in real(c, sd).items()})
    export_hf.export(str(run_dir), str(tmp_path / 'swapped'))
    assert max_logit_difference(model, tmp_path / 'swapped')[0] > 1000 * 1e-5
    # sample.py's greedy story, EOT + the prompt's bytes (10 tokens: 30 in all fit block_size 32,
    # no cropping)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / 'hf'))
    ref = prepare.ByteTokenizer()
    mine = sample.generate(model, torch.tensor([[ref.eot_id] + ref.encode('Zoë 🐱')]), 20,
                           temperature=0)
    prompt = torch.tensor([[tok.eos_token_id]
                           + tok('Zoë 🐱', add_special_tokens=False).input_ids])
    # 20 tokens, through any EOT, as generate() without stop_id does
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        hf_tokens = hf.generate(prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(hf_tokens, mine)
    assert (tok.decode(hf_tokens[0, 1:], skip_special_tokens=True)
            == ref.decode(mine[0, 1:].tolist()))


@pytest.mark.parametrize('top_k', [2, 3])
def test_transformers_balancing_loss_weighs_as_the_runs(tmp_path, top_k):
    """Fine-tuned in transformers with output_router_logits=True, the exported model's
    aux_loss * router_aux_loss_coef is the run's aux_loss_coef * lb on the same batch."""
    model, run_dir = fake_run(tmp_path, ffn='moe', n_experts=4, top_k=top_k, aux_loss_coef=0.02,
                              z_loss_coef=0.003)
    export_hf.export(str(run_dir), str(tmp_path / 'hf'))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / 'hf')).eval()
    idx = torch.randint(0, 257, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        aux = model(idx)[2]
        out = hf(idx, output_router_logits=True)
    # layer by layer, transformers' loss is ours times top_k: it counts each of the k choices in
    # full, where our f_i is a share of all k * N assignments
    balancing = transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func
    for ours, logits in zip(aux['layers'], out.router_logits, strict=True):
        assert balancing((logits,), 4, top_k).item() == pytest.approx(top_k * ours['lb'].item())
    # all layers: transformers pools their counts and probabilities, we average each layer's loss.
    # On this model and batch the two differ by 3.6% at top-2 and 1.5% at top-3 (the layers route
    # unlike each other); 5% holds that, where aux_loss_coef not divided by top_k gives 1.9x, 3x
    theirs = out.aux_loss.item() * hf.config.router_aux_loss_coef
    print(f'top-{top_k}: transformers {theirs:.5f}, the run {0.02 * aux["lb"].item():.5f}')
    assert theirs == pytest.approx(0.02 * aux['lb'].item(), rel=0.05)
    # the card gives the run's losses and what transformers keeps of them
    card = (tmp_path / 'hf' / 'README.md').read_text()
    assert 'cross-entropy + 0.02 × load balancing + 0.003 × router z-loss' in card
    assert f'router_aux_loss_coef is 0.02 / {top_k} = {0.02 / top_k:g}:' in card
    assert 'transformers has no router z-loss' in card


def test_every_exported_file_gets_the_mode_the_umask_gives(tmp_path):
    """Weights included: a folder copied or served to others is readable as a whole."""
    _, run_dir = fake_run(tmp_path, ffn='moe', n_experts=4, top_k=2)
    umask = os.umask(0o002)
    try:
        export_hf.export(str(run_dir), str(tmp_path / 'hf'))
    finally:
        os.umask(umask)
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in (tmp_path / 'hf').iterdir()}
    assert modes == dict.fromkeys(modes, oct(0o664))


def test_top1_moe_variants_and_a_used_folder_are_refused(tmp_path):
    def export(run_dir, to):
        return subprocess.run(
            [sys.executable, 'export_hf.py', '--out_dir', str(run_dir), '--to', str(to)],
            cwd=REPO, capture_output=True, text=True)

    (tmp_path / 'top1').mkdir()
    _, top1 = fake_run(tmp_path / 'top1', ffn='moe', top_k=1)
    out = export(top1, tmp_path / 'hf')
    assert out.returncode != 0 and 'top-1 run' in out.stderr and not (tmp_path / 'hf').exists()
    # the error says what can be exported, whatever the refusal
    assert out.stderr.strip().splitlines()[-1].endswith(export_hf.EXPORTABLE)
    refusals = {'shared_hidden': 'no shared expert', 'bias_rate': 'no selection bias'}
    for key, why in refusals.items():  # no Mixtral weights for them
        (tmp_path / 'variant').mkdir()
        _, run_dir = fake_run(tmp_path / 'variant', ffn='moe', **{key: 8})
        out = export(run_dir, tmp_path / 'hf')
        assert (out.returncode != 0 and f'Mixtral has {why}' in out.stderr
                and not (tmp_path / 'hf').exists())
        shutil.rmtree(tmp_path / 'variant')
    (tmp_path / 'top2').mkdir()
    _, top2 = fake_run(tmp_path / 'top2', ffn='moe', top_k=2)
    (tmp_path / 'used').mkdir()
    (tmp_path / 'used' / 'keep.txt').write_text('x')
    out = export(top2, tmp_path / 'used')
    assert (out.returncode != 0 and 'not empty' in out.stderr
            and os.listdir(tmp_path / 'used') == ['keep.txt'])
    out = export(tmp_path, tmp_path / 'hf')
    assert (out.returncode != 0 and 'no checkpoint' in out.stderr
            and out.stderr.count('\n') == 1)
    # a checkpoint without the log of its run: the card gives the checkpoint's own best so far
    (top2 / 'log.jsonl').unlink()
    out = export(top2, tmp_path / 'hf')
    assert out.returncode == 0
    assert card_rows(tmp_path / 'hf')['best val loss'] == ('5.0000, the best up to step 10 '
                                                           '(cross-entropy per token, nats)')


def test_the_model_card_gives_the_runs_own_figures(prepared, tmp_path):
    """A real tiny MoE run, exported: README.md's metadata block reads as the hub reads it, and
    every figure in its table equals the run's own, from its other files: the params config.json
    counted (the total also as model.safetensors holds it), the tokens and step of best.pt, the
    best val loss of log.jsonl and its step, the config keys set away from the defaults. Its code
    loads the folder and generates."""
    huggingface_hub = pytest.importorskip('huggingface_hub')  # installed with transformers
    run_dir = tmp_path / 'cpu_moe-s1'
    train.main(['config/cpu_moe.py', f'--data_dir={prepared / "data"}', *TINY, '--max_iters=30',
                '--eval_interval=10', f'--out_dir={run_dir}'])
    export_hf.export(str(run_dir), str(tmp_path / 'hf'))
    metadata = huggingface_hub.metadata_load(tmp_path / 'hf' / 'README.md')
    assert (metadata['library_name'] == 'transformers' and metadata['language'] == ['en']
            and metadata['pipeline_tag'] == 'text-generation'
            and metadata['datasets'] == ['roneneldan/TinyStories']
            and {'mixtral', 'mixture-of-experts', 'tinystories'} <= set(metadata['tags']))
    rows = card_rows(tmp_path / 'hf')
    saved = json.load(open(run_dir / 'config.json'))
    total = sum(t.numel() for t in load_file(tmp_path / 'hf' / 'model.safetensors').values())
    assert total == saved['params']['total'] < 2 * saved['params']['active']
    assert rows['parameters'] == f'{total:,} total, {saved["params"]["active"]:,} active per token'
    ckpt = runs.load_checkpoint(str(run_dir / 'best.pt'))
    evals = [json.loads(line) for line in open(run_dir / 'log.jsonl') if 'val_loss' in line]
    best = min(evals, key=lambda r: r['val_loss'])
    assert len(evals) == 4 and best['iter'] == ckpt['iter'] and best['tokens'] == ckpt['tokens']
    assert rows['trained'] == f'{best["tokens"]:,} tokens in {best["iter"]} steps'
    assert rows['best val loss'] == (f'{best["val_loss"]:.4f} at step {best["iter"]} '
                                     '(cross-entropy per token, nats)')
    assert rows['context'] == '32 tokens' and rows['tokenizer'].endswith('256 is <|endoftext|>')
    assert rows['architecture'] == ('MixtralForCausalLM: 2 layers, d_model 32, 2 heads, '
                                    '4 SwiGLU experts of width 32, top-2')
    overrides = {f'`{k}={v!r}`' for k, v in saved.items()
                 if k in train.DEFAULTS and v != train.DEFAULTS[k]}
    listed = set(rows["config beyond tinymoe's defaults"].split(', '))
    assert {'`d_model=32`', '`max_iters=30`', '`learning_rate=0.01`'} <= listed
    assert listed == overrides - {f'`out_dir={str(run_dir)!r}`', "`config_name='cpu_moe'`",
                                  f'`data_dir={str(prepared / "data")!r}`'}
    # the card's code, as a reader would paste it: EOT, the prompt's bytes, then the story
    code = re.search(r'```python\n(.*?)```', (tmp_path / 'hf' / 'README.md').read_text(), re.S)
    namespace = {}
    torch.manual_seed(0)
    exec(code.group(1), namespace)
    assert namespace['ids'][0, :17].tolist() == [256] + list(b'Once upon a time')
    assert namespace['ids'].shape[1] > 17


def test_bytes_tokenizer_encodes_and_decodes_like_prepares(tmp_path):
    export_hf.write_bytes_tokenizer(str(tmp_path), 32)
    tok, ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path)), prepare.ByteTokenizer()
    # the sentence, then every character of 1 and 2 bytes in UTF-8
    # (bytes 0x00-0x7f, 0x80-0xbf and 0xc2-0xdf)
    text = 'once upon a time, Zoë saw a 🐱.\n\nThe end. ' + ''.join(map(chr, range(0x800)))
    assert tok(text, add_special_tokens=False).input_ids == list(text.encode())
    # nothing added around a prompt
    assert tok('a 猫.').input_ids == [97, 32, 0xe7, 0x8c, 0xab, 46]
    # EOT between the two bytes of 'é' is dropped before decoding;
    # 0xff and a lone 0x80 are no UTF-8
    ids = [256, *ref.encode('Zoë saw a 🐱 .'), 0xc3, 256, 0xa9, 0xff, 0x80, 256]
    assert (tok.decode(ids, skip_special_tokens=True) == ref.decode(ids)
            == 'Zoë saw a 🐱 .é\ufffd\ufffd')
    assert ([tok.decode([b]) for b in range(256)]
            == [bytes([b]).decode('utf-8', 'replace') for b in range(256)])
    assert tok.convert_ids_to_tokens(256) == '<|endoftext|>'
    assert tok.bos_token_id == tok.eos_token_id == tok.pad_token_id == 256 == ref.eot_id


def test_gpt2_tokenizer_is_written_from_tiktokens_files(tmp_path):
    try:  # tiktoken's files: downloaded once, or found in TIKTOKEN_CACHE_DIR offline
        import tiktoken
        enc = tiktoken.get_encoding('gpt2')
    except Exception as e:
        pytest.skip(f'GPT-2 BPE files not available ({type(e).__name__})')
    export_hf.write_gpt2_tokenizer(str(tmp_path), 512)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = 'once upon a time, lily saw a big dog.<|endoftext|> "Hi!" said Tom, 3 times.'
    assert tok(text)['input_ids'] == enc.encode(text, allowed_special='all')
    assert tok.decode(enc.encode_ordinary(text)) == text and tok.eos_token_id == 50256


def test_the_cards_best_val_loss_is_the_logs_first_lowest_up_to_the_checkpoint(tmp_path):
    """Its step is that of the first of equal losses (best.pt's: train.py keeps the first); an
    evaluation after the exported checkpoint does not count, nor a non-finite one, nor a torn
    line."""
    lines = [json.dumps({'iter': it, 'val_loss': loss})
             for it, loss in ((0, 3.0), (10, 2.0), (20, float('nan')), (30, 2.0), (40, 1.0))]
    lines.insert(2, json.dumps({'iter': 15, 'loss': 0.5}))  # a training line
    (tmp_path / 'log.jsonl').write_text('\n'.join(lines) + '\n{"iter": 50, "val_lo')
    assert export_hf.best_eval(str(tmp_path), 30) == (2.0, 10)
    assert export_hf.best_eval(str(tmp_path), 40) == (1.0, 40)
    assert export_hf.best_eval(str(tmp_path), 5) == (3.0, 0)
