"""
Export a trained run to a Hugging Face transformers folder: dense runs as LlamaForCausalLM, MoE
runs as MixtralForCausalLM (config.json + model.safetensors), with the run's tokenizer for
AutoTokenizer and a model card (README.md) whose figures come from the run's checkpoint and log.

    python export_hf.py --out_dir out/moe-s1 --to hf/moe-s1
    python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('hf/moe-s1')"

Our layout is already Llama's: RoPE in rotate-half order, RMSNorm, SwiGLU, no biases, an lm_head
tied to the embedding. Export (without transformers) splits the fused qkv into q/k/v, transposes the
stacked expert matrices into Mixtral's per-expert w1 (gate), w3 (up), w2 (down), and writes the
Hub's Mixtral names, which every transformers version and tool reading the format loads. GPT-2 runs
get GPT-2's BPE files (tiktoken's); bytes runs a byte-level tokenizer.json (ids 0-255 the UTF-8
bytes, 256 <|endoftext|>, as in prepare.ByteTokenizer), built by the tokenizers package (imported
for bytes runs only; transformers installs it). router_aux_loss_coef is aux_loss_coef / top_k, to
weigh transformers' load balancing as the run weighed ours; Mixtral has no router z-loss, as the
model card says. Refused, and why: top-1 runs (Mixtral renormalises their routing weight to 1), a
shared expert or a selection bias (Mixtral has neither). sample.py runs any checkpoint.
"""
import argparse
import json
import math
import os
import shutil
import types

from safetensors.torch import save_file

import train
from errors import UserError, one_line_errors
from prepare import HF_DATASET
from runs import load_checkpoint

EOT = '<|endoftext|>'
EXPORTABLE = ('export_hf.py writes dense runs and MoE runs with top_k >= 2, no shared expert and '
              'no bias_rate; sample.py runs any checkpoint')
# config keys that say where the run's files and logs went, not what the model is
NOT_THE_MODEL = ('out_dir', 'config_name', 'data_dir', 'resume', 'print_params', 'wandb_log',
                 'wandb_project', 'wandb_run_name')


def architecture(c):
    """The transformers class a run's config becomes."""
    return 'MixtralForCausalLM' if c['ffn'] == 'moe' else 'LlamaForCausalLM'


def hf_config(c, eot_id):
    """config.json for transformers, from a run's config."""
    moe = c['ffn'] == 'moe'
    config = {
        'architectures': [architecture(c)],
        'model_type': 'mixtral' if moe else 'llama',
        'vocab_size': c['vocab_size'], 'hidden_size': c['d_model'],
        'num_hidden_layers': c['n_layer'], 'num_attention_heads': c['n_head'],
        'num_key_value_heads': c['n_head'], 'head_dim': c['d_model'] // c['n_head'],
        'intermediate_size': c['moe_hidden'] if moe else c['ffn_hidden'],
        'hidden_act': 'silu', 'max_position_embeddings': c['block_size'],
        'rms_norm_eps': c['norm_eps'], 'rope_theta': c['rope_theta'], 'rope_scaling': None,
        'tie_word_embeddings': c['tie_embeddings'],
        'attention_bias': False, 'attention_dropout': 0.0, 'initializer_range': 0.02,
        'bos_token_id': eot_id, 'eos_token_id': eot_id, 'torch_dtype': 'float32', 'use_cache': True,
    }
    if moe:
        config.update(num_local_experts=c['n_experts'], num_experts_per_tok=c['top_k'],
                      sliding_window=None, router_aux_loss_coef=router_aux_loss_coef(c),
                      output_router_logits=False, router_jitter_noise=0.0)
    else:
        config.update(mlp_bias=False)
    return config


def router_aux_loss_coef(c):
    """aux_loss_coef / top_k: transformers' balancing loss is top_k times ours (training_losses)."""
    return c['aux_loss_coef'] / c['top_k']


def hf_state_dict(c, sd):
    """Our parameter names and shapes -> transformers' (nn.Linear weights are (out, in) in both)."""
    out = {'model.embed_tokens.weight': sd['embed.weight'], 'model.norm.weight': sd['norm.weight']}
    if not c['tie_embeddings']:
        out['lm_head.weight'] = sd['lm_head.weight']
    d = c['d_model']
    for i in range(c['n_layer']):
        ours, hf = f'blocks.{i}.', f'model.layers.{i}.'
        q, k, v = sd[ours + 'attn.qkv.weight'].split(d)  # rows: all q heads, then k, then v
        out.update({hf + 'self_attn.q_proj.weight': q, hf + 'self_attn.k_proj.weight': k,
                    hf + 'self_attn.v_proj.weight': v,
                    hf + 'self_attn.o_proj.weight': sd[ours + 'attn.proj.weight'],
                    hf + 'input_layernorm.weight': sd[ours + 'attn_norm.weight'],
                    hf + 'post_attention_layernorm.weight': sd[ours + 'ffn_norm.weight']})
        if c['ffn'] == 'moe':
            moe = hf + 'block_sparse_moe.'
            out[moe + 'gate.weight'] = sd[ours + 'ffn.router.weight']
            # ours: (E, in, out) stacks used as x @ W; Mixtral: a Linear per expert, (out, in)
            for e in range(c['n_experts']):
                for name, ours_name in (('w1', 'gate'), ('w3', 'up'), ('w2', 'down')):
                    out[f'{moe}experts.{e}.{name}.weight'] = sd[f'{ours}ffn.{ours_name}'][e].t()
        else:
            for name in ('gate', 'up', 'down'):
                out[f'{hf}mlp.{name}_proj.weight'] = sd[f'{ours}ffn.{name}.weight']
    return {name: t.detach().float().contiguous().clone() for name, t in out.items()}


def write_gpt2_tokenizer(folder, block_size):
    """The GPT-2 tokenizer from the same BPE files tiktoken uses (its cache, or the web):
    encoder.json is transformers' vocab.json, vocab.bpe its merges.txt."""
    from tiktoken.load import read_file_cached
    base = 'https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/'
    try:
        files = {'vocab.json': read_file_cached(base + 'encoder.json'),
                 'merges.txt': read_file_cached(base + 'vocab.bpe')}
    except Exception as e:
        raise UserError(f'cannot read the GPT-2 BPE files ({type(e).__name__}); set '
                        'TIKTOKEN_CACHE_DIR to a folder with them') from None
    for name, data in files.items():
        with open(os.path.join(folder, name), 'wb') as f:
            f.write(data)
    with open(os.path.join(folder, 'tokenizer_config.json'), 'w') as f:
        json.dump({'tokenizer_class': 'GPT2Tokenizer', 'model_max_length': block_size,
                   'bos_token': EOT, 'eos_token': EOT, 'unk_token': EOT,
                   'add_prefix_space': False}, f, indent=2)


def write_bytes_tokenizer(folder, block_size):
    """prepare.ByteTokenizer for transformers: a byte-level BPE without merges or prefix space, so
    token b is byte b and the ids are exactly text.encode(); EOT (256) is <|endoftext|>."""
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise UserError('bytes runs export their tokenizer with the tokenizers package; '
                        'pip install tokenizers (or transformers)') from None
    # ByteLevel spells byte b as itself where printable, else as chr(256), chr(257), ... in order
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    others = iter(range(256, 512))
    vocab = {chr(b) if b in printable else chr(next(others)): b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOT, special=True, normalized=False)])
    tok.save(os.path.join(folder, 'tokenizer.json'))
    # no clean_up_tokenization_spaces: it would drop the space in ' .'
    with open(os.path.join(folder, 'tokenizer_config.json'), 'w') as f:
        json.dump({'tokenizer_class': 'PreTrainedTokenizerFast', 'model_max_length': block_size,
                   'bos_token': EOT, 'eos_token': EOT, 'pad_token': EOT,
                   'clean_up_tokenization_spaces': False}, f, indent=2)


def load_run(path):
    """A checkpoint (config, weights, meta, iter, tokens) that Mixtral or Llama can express."""
    if not os.path.isfile(path):
        raise UserError(f'no checkpoint at {path}; train one first or point --out_dir at a run '
                        'folder')
    ckpt = load_checkpoint(path)
    try:
        c = ckpt['config']
        missing = ', '.join(sorted({'model', 'meta', 'iter', 'tokens', 'best_val'} - set(ckpt)))
    except Exception as e:
        raise UserError(f'{path} is not a usable tinymoe checkpoint ({type(e).__name__})') from None
    if missing:
        raise UserError(f'{path} is not a usable tinymoe checkpoint (no {missing})')
    why_not = not_mixtral(c)
    if why_not:
        raise UserError(f'{path} cannot be exported: {why_not}. {EXPORTABLE}')
    return ckpt


def not_mixtral(c):
    """Why an MoE run's layout is not Mixtral's, or None where it is (or the run is dense)."""
    if c['ffn'] != 'moe':
        return None
    if c['top_k'] < 2:
        return 'a top-1 run keeps the raw routing probability, which Mixtral renormalises to 1'
    if c.get('shared_hidden'):
        return 'Mixtral has no shared expert'
    if c.get('bias_rate'):
        return 'Mixtral has no selection bias'
    return None


def best_eval(out_dir, until):
    """The run's best validation loss up to step `until`, and its step, from its log.jsonl; None
    without the log (a checkpoint copied out of its run folder)."""
    path = os.path.join(out_dir, 'log.jsonl')
    if not os.path.isfile(path):
        return None
    evals = []
    for line in open(path).read().splitlines():
        try:
            r = json.loads(line)
        except ValueError:  # a line torn by a kill mid-write
            continue
        if 'val_loss' in r and r['iter'] <= until and math.isfinite(r['val_loss']):
            evals.append(r)
    if not evals:
        raise UserError(f'{path} has no evaluation up to iter {until} for the model card')
    best = min(evals, key=lambda r: r['val_loss'])  # the first of equals, as train.py keeps it
    return best['val_loss'], best['iter']


def training_losses(c):
    """The model card's section on an MoE run's losses and what transformers keeps of them."""
    a, z, k = c['aux_loss_coef'], c['z_loss_coef'], c['top_k']
    return f"""## Training loss

The run minimised cross-entropy + {a:g} × load balancing + {z:g} × router z-loss, the last two
averaged over the MoE layers. Load balancing is Switch Transformer's E · Σ_i f_i · P_i per layer
(E experts; f_i: the share of the layer's top-{k} assignments that went to expert i; P_i: its mean
router probability), 1 when balanced. The z-loss is the mean square of the log of each token's
softmax denominator over the router logits, which keeps them small.

With `output_router_logits=True`, transformers adds `router_aux_loss_coef * aux_loss` to the loss.
Its aux_loss counts each of the top-{k} choices in full ({k} when balanced) and pools the layers'
tokens, so config.json's router_aux_loss_coef is {a:g} / {k} = {router_aux_loss_coef(c):g}: then
`router_aux_loss_coef * aux_loss` is about {a:g} × our load balancing (they differ by as much as
the layers' routing differs), and a fine-tune balances the experts as hard as this run did.
transformers has no router z-loss: a fine-tune there goes without it.

"""


def model_card(name, ckpt, best, to):
    """README.md: the hub's metadata, what the model is, its figures from the run's files (ckpt;
    best: (val loss, step) from its log, or None) and how to load it and generate."""
    c, meta = ckpt['config'], ckpt['meta']
    moe = c['ffn'] == 'moe'
    params = train.count_params(types.SimpleNamespace(**{**train.DEFAULTS, **c}))
    changed = [f'`{k}={v!r}`' for k, v in c.items()
               if k in train.DEFAULTS and k not in NOT_THE_MODEL and v != train.DEFAULTS[k]]
    shape = f'{c["n_layer"]} layers, d_model {c["d_model"]}, {c["n_head"]} heads'
    ffn = f'a SwiGLU of width {c["ffn_hidden"]}'
    if moe:
        ffn = f'{c["n_experts"]} SwiGLU experts of width {c["moe_hidden"]}, top-{c["top_k"]}'
    tokenizer = f'bytes: ids 0-255 are the UTF-8 bytes, {meta["eot_id"]} is {EOT}'
    if meta['tokenizer'] == 'gpt2':
        tokenizer = f'GPT-2 BPE, {meta["vocab_size"]:,} ids; {meta["eot_id"]} is {EOT}'
    kind = 'Mixtral-style mixture-of-experts' if moe else 'LLaMA-style dense'
    if best is None:  # no log: the checkpoint's own best so far, whose step only the log knows
        best_text = f'{ckpt["best_val"]:.4f}, the best up to step {ckpt["iter"]:,}'
    else:
        best_text = f'{best[0]:.4f} at step {best[1]:,}'
    return f"""---
library_name: transformers
pipeline_tag: text-generation
language:
- en
datasets:
- {HF_DATASET}
tags:
- tinymoe
- {'mixtral' if moe else 'llama'}
- {'mixture-of-experts' if moe else 'dense'}
- tinystories
---

# {name}

A tiny research model: a {kind} decoder trained from scratch by tinymoe on TinyStories (short
stories in simple English) to compare dense and sparse pretraining at a small scale. It goes on
with such stories and is not for use beyond that research.

| | |
|---|---|
| architecture | {architecture(c)}: {shape}, {ffn} |
| parameters | {params['total']:,} total, {params['active']:,} active per token |
| context | {c['block_size']} tokens |
| tokenizer | {tokenizer} |
| trained | {ckpt['tokens']:,} tokens in {ckpt['iter']:,} steps |
| best val loss | {best_text} (cross-entropy per token, nats) |
| config beyond tinymoe's defaults | {', '.join(changed) or 'none'} |

{training_losses(c) if moe else ''}## Use

```python
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

path = {to!r}  # this folder, or the model's id on the hub
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)
# <|endoftext|> ends each story in training: after it, a story that begins like the prompt
prompt = tok('Once upon a time', add_special_tokens=False).input_ids
ids = model.generate(torch.tensor([[tok.eos_token_id] + prompt]), do_sample=True,
                     max_new_tokens={c['block_size'] // 2}, temperature=0.8, top_k=200)
print(tok.decode(ids[0], skip_special_tokens=True))
```
"""


def export(out_dir, to, ckpt_name='best.pt'):
    path = os.path.join(out_dir, ckpt_name)
    ckpt = load_run(path)
    c, sd, meta = ckpt['config'], ckpt['model'], ckpt['meta']
    if os.path.exists(to) and os.listdir(to):
        raise UserError(f'{to} exists and is not empty; choose another --to or remove it')
    name = os.path.basename(os.path.normpath(out_dir))
    card = model_card(name, ckpt, best_eval(out_dir, ckpt['iter']), to)
    tmp = to.rstrip('/') + '.tmp'
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        with open(os.path.join(tmp, 'config.json'), 'w') as f:
            json.dump(hf_config(c, meta['eot_id']), f, indent=2)
        with open(os.path.join(tmp, 'generation_config.json'), 'w') as f:
            json.dump({'bos_token_id': meta['eot_id'], 'eos_token_id': meta['eot_id']}, f, indent=2)
        weights = os.path.join(tmp, 'model.safetensors')
        save_file(hf_state_dict(c, sd), weights, metadata={'format': 'pt'})
        # safetensors writes 0600: config.json's mode (0666 less the umask) lets others read it
        shutil.copymode(os.path.join(tmp, 'config.json'), weights)
        if meta['tokenizer'] == 'gpt2':
            write_gpt2_tokenizer(tmp, c['block_size'])
        else:
            write_bytes_tokenizer(tmp, c['block_size'])
        with open(os.path.join(tmp, 'README.md'), 'w') as f:
            f.write(card)
        os.makedirs(os.path.dirname(os.path.abspath(to)), exist_ok=True)
        if os.path.exists(to):
            os.rmdir(to)  # empty, checked above
        os.replace(tmp, to)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f'{path} -> {to} ({architecture(c)}, {meta["tokenizer"]} tokenizer, README.md)')


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--out_dir', required=True, help='run folder holding best.pt')
    p.add_argument('--to', required=True, help='new folder for the transformers model')
    p.add_argument('--ckpt', default='best.pt', help='best.pt (default) or latest.pt')
    args = p.parse_args(argv)
    export(args.out_dir, args.to, args.ckpt)


if __name__ == '__main__':
    with one_line_errors('export_hf.py'):
        main()
