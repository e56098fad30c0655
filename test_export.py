"""export_hf.py: tiny random dense and MoE runs exported and loaded by transformers give our logits and our
greedy generations. transformers is a test-only dependency (installed by make test)."""
import json
import os
import subprocess
import sys

import pytest
import torch

import export_hf
import train
from test_smoke import REPO, config

transformers = pytest.importorskip('transformers')


def fake_run(tmp_path, **overrides):
    """A run folder holding a best.pt of a random tiny model (norm gains randomised too, so that a mix-up of
    any two weights would show)."""
    torch.manual_seed(0)
    c = config(block_size=32, n_layer=2, **overrides)
    model = train.Transformer(c)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if 'norm' in name:
                p.uniform_(0.5, 1.5)
    run_dir = tmp_path / 'run'
    run_dir.mkdir()
    train.save_checkpoint(str(run_dir / 'best.pt'), {'model': model.state_dict(), 'config': vars(c),
                                                     'meta': {'tokenizer': 'bytes', 'vocab_size': 257, 'eot_id': 256}})
    return model.eval(), run_dir


@pytest.mark.parametrize('ffn, arch', [('dense', 'LlamaForCausalLM'), ('moe', 'MixtralForCausalLM')])
def test_exported_model_gives_our_logits_and_greedy_tokens(tmp_path, ffn, arch):
    extra = {'ffn_hidden': 40} if ffn == 'dense' else {'n_experts': 4, 'top_k': 2}
    model, run_dir = fake_run(tmp_path, ffn=ffn, **extra)
    export_hf.export(str(run_dir), str(tmp_path / 'hf'))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / 'hf')).eval()
    assert type(hf).__name__ == arch
    idx = torch.randint(0, 257, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(idx)[0], hf(idx).logits
    diff = (ours - theirs).abs().max().item()
    print(f'{arch}: max abs logit difference {diff:.2e}')
    assert diff <= 1e-4
    prompt = idx[:1, :6]
    mine = model.generate(prompt, 20, temperature=0)
    with torch.no_grad():
        hf_tokens = hf.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert torch.equal(hf_tokens, mine)


def test_top1_moe_and_a_used_folder_are_refused(tmp_path):
    def export(run_dir, to):
        return subprocess.run([sys.executable, 'export_hf.py', '--out_dir', str(run_dir), '--to', str(to)],
                              cwd=REPO, capture_output=True, text=True)

    (tmp_path / 'top1').mkdir()
    _, top1 = fake_run(tmp_path / 'top1', ffn='moe', top_k=1)
    out = export(top1, tmp_path / 'hf')
    assert out.returncode != 0 and 'top_k >= 2' in out.stderr and not (tmp_path / 'hf').exists()
    (tmp_path / 'top2').mkdir()
    _, top2 = fake_run(tmp_path / 'top2', ffn='moe', top_k=2)
    (tmp_path / 'used').mkdir()
    (tmp_path / 'used' / 'keep.txt').write_text('x')
    out = export(top2, tmp_path / 'used')
    assert out.returncode != 0 and 'not empty' in out.stderr and os.listdir(tmp_path / 'used') == ['keep.txt']
    out = export(tmp_path, tmp_path / 'hf')
    assert out.returncode != 0 and 'no checkpoint' in out.stderr and out.stderr.count('\n') == 1


def test_gpt2_tokenizer_is_written_from_tiktokens_files(tmp_path, monkeypatch):
    cache = os.path.join(REPO, '..', 'shared', 'tiktoken_cache')
    if os.path.isdir(cache):
        monkeypatch.setenv('TIKTOKEN_CACHE_DIR', os.path.abspath(cache))
    try:
        import tiktoken
        enc = tiktoken.get_encoding('gpt2')
    except Exception as e:
        pytest.skip(f'GPT-2 BPE files not available ({type(e).__name__})')
    export_hf.write_gpt2_tokenizer(str(tmp_path), 512)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = 'once upon a time, lily saw a big dog.<|endoftext|> "Hi!" said Tom, 3 times.'
    assert tok(text)['input_ids'] == enc.encode(text, allowed_special='all')
    assert tok.decode(enc.encode_ordinary(text)) == text and tok.eos_token_id == 50256
