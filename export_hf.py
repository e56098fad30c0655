"""
Export a trained run to a Hugging Face transformers folder: dense runs as LlamaForCausalLM, MoE
runs as MixtralForCausalLM (config.json + model.safetensors), with the run's tokenizer for
AutoTokenizer.

    python export_hf.py --out_dir out/moe-s1 --to hf/moe-s1
    python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('hf/moe-s1')"

Our layout is already Llama's: RoPE in rotate-half order, RMSNorm, SwiGLU, no biases, an lm_head
tied to the embedding. Export splits the fused qkv projection into q/k/v, transposes the stacked
expert matrices into Mixtral's per-expert w1 (gate), w3 (up), w2 (down), and writes the Hub's
Mixtral names, which every transformers version and the tools that read the format load.
transformers itself is not needed to export.
The tokenizer: GPT-2 runs get GPT-2's BPE files (tiktoken's); bytes runs a byte-level
tokenizer.json (ids 0-255 are the UTF-8 bytes, 256 is <|endoftext|>, as in prepare.ByteTokenizer),
built with the tokenizers package (imported for bytes runs only; transformers installs it).
Top-1 MoE runs cannot be exported: their gate keeps the raw softmax probability (Switch), while
Mixtral always renormalises the top-k weights, which at top-1 makes every gate 1.
"""
import argparse
import json
import os
import shutil

from safetensors.torch import save_file

from plumbing import UserError, load_checkpoint, one_line_errors


def hf_config(c, eot_id):
    """config.json for transformers, from a run's config."""
    moe = c['ffn'] == 'moe'
    config = {
        'architectures': ['MixtralForCausalLM' if moe else 'LlamaForCausalLM'],
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
                      sliding_window=None, router_aux_loss_coef=c['aux_loss_coef'],
                      output_router_logits=False, router_jitter_noise=0.0)
    else:
        config.update(mlp_bias=False)
    return config


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


EOT = '<|endoftext|>'


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
    # ByteLevel spells byte b as a printable character: itself where printable, else 256, 257, ...
    # in byte order
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
    """-> (config, weights, meta) of a checkpoint that Mixtral or Llama can express."""
    if not os.path.isfile(path):
        raise UserError(f'no checkpoint at {path}; train one first or point --out_dir at a run '
                        'folder')
    ckpt = load_checkpoint(path)
    try:
        c, sd, meta = ckpt['config'], ckpt['model'], ckpt['meta']
    except Exception as e:
        raise UserError(f'{path} is not a usable tinymoe checkpoint ({type(e).__name__})') from None
    if c['ffn'] == 'moe' and c['top_k'] < 2:
        raise UserError('top-1 MoE runs keep the raw gate probability, which Mixtral cannot '
                        'express (it renormalises the top-k weights); only top_k >= 2 runs can be '
                        'exported')
    if c.get('shared_hidden') or c.get('bias_rate'):
        raise UserError('Mixtral has no shared expert and no selection bias: only runs without '
                        'shared_hidden and bias_rate can be exported')
    return c, sd, meta


def export(out_dir, to, ckpt_name='best.pt'):
    path = os.path.join(out_dir, ckpt_name)
    c, sd, meta = load_run(path)
    if os.path.exists(to) and os.listdir(to):
        raise UserError(f'{to} exists and is not empty; choose another --to or remove it')
    tmp = to.rstrip('/') + '.tmp'
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        with open(os.path.join(tmp, 'config.json'), 'w') as f:
            json.dump(hf_config(c, meta['eot_id']), f, indent=2)
        with open(os.path.join(tmp, 'generation_config.json'), 'w') as f:
            json.dump({'bos_token_id': meta['eot_id'], 'eos_token_id': meta['eot_id']}, f, indent=2)
        save_file(hf_state_dict(c, sd), os.path.join(tmp, 'model.safetensors'),
                  metadata={'format': 'pt'})
        if meta['tokenizer'] == 'gpt2':
            write_gpt2_tokenizer(tmp, c['block_size'])
        else:
            write_bytes_tokenizer(tmp, c['block_size'])
        os.makedirs(os.path.dirname(os.path.abspath(to)), exist_ok=True)
        if os.path.exists(to):
            os.rmdir(to)  # empty, checked above
        os.replace(tmp, to)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    arch = 'MixtralForCausalLM' if c['ffn'] == 'moe' else 'LlamaForCausalLM'
    print(f'{path} -> {to} ({arch}, {meta["tokenizer"]} tokenizer)')


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
