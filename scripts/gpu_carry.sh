#!/usr/bin/env bash
# What the real-text GPU check (scripts/gpu_real_text.sh) needs and a GPU machine without network
# lacks, made here into gpu_carry/ (git-ignored; carry that one folder):
#   tinystories_bytes/  the committed CPU study's data (checked: 4,003,496 / 187,689 tokens)
#   tinystories_gpt2/   GPT-2 tokens of the same stories, for the paper configs
#   tiktoken_cache/     GPT-2's BPE files, for sample.py and export_hf.py offline
#   nanogpt_model.py    nanoGPT's model.py, read at run time, never part of this repository
#                       (and nanogpt_commit.txt, the commit it comes from)
# Settings (environment): STORIES, the TinyStories sample; TIKTOKEN_CACHE_DIR, a folder with the
# GPT-2 BPE files; NANOGPT_GIT, a git directory of karpathy/nanoGPT (a bare mirror will do).
set -euo pipefail
cd "$(dirname "$0")/.."
STORIES=${STORIES:-../shared/data/tinystories_train_head.txt}
TIKTOKEN_CACHE_DIR=$(realpath "${TIKTOKEN_CACHE_DIR:-../shared/tiktoken_cache}")
NANOGPT_GIT=${NANOGPT_GIT:-}
export TIKTOKEN_CACHE_DIR OMP_NUM_THREADS=1
mkdir -p gpu_carry

python prepare.py --input "$STORIES" --tokenizer bytes --out_dir gpu_carry/tinystories_bytes \
    --num_proc 1
python prepare.py --input "$STORIES" --out_dir gpu_carry/tinystories_gpt2 --num_proc 1
# the same bytes as the committed runs' data, if this checkout has that folder too
if [ -f data/tinystories_bytes/train.bin ]; then
    cmp data/tinystories_bytes/train.bin gpu_carry/tinystories_bytes/train.bin
    cmp data/tinystories_bytes/val.bin gpu_carry/tinystories_bytes/val.bin
fi
python - <<'EOF'
import json
meta = json.load(open('gpu_carry/tinystories_bytes/meta.json'))
if (meta['train_tokens'], meta['val_tokens']) != (4003496, 187689):
    raise SystemExit(f'gpu_carry.sh: gpu_carry/tinystories_bytes has {meta["train_tokens"]} / '
                     f'{meta["val_tokens"]} tokens, not the committed runs\' 4003496 / 187689: '
                     'set STORIES to the sample they used')
EOF

# the cache's files may be read-only: copied with ordinary modes, a rerun can replace them
rm -rf gpu_carry/tiktoken_cache
mkdir -p gpu_carry/tiktoken_cache
cp --no-preserve=mode "$TIKTOKEN_CACHE_DIR"/* gpu_carry/tiktoken_cache/

if [ -n "$NANOGPT_GIT" ]; then
    git --git-dir="$NANOGPT_GIT" show HEAD:model.py > gpu_carry/nanogpt_model.py
    git --git-dir="$NANOGPT_GIT" rev-parse HEAD > gpu_carry/nanogpt_commit.txt
elif [ ! -f gpu_carry/nanogpt_model.py ]; then
    echo "gpu_carry.sh: no NANOGPT_GIT and no gpu_carry/nanogpt_model.py: part 5 will fail" >&2
fi

# the GPU tool carries at most 64 MiB
size=$(du -sm gpu_carry | cut -f1)
if [ "$size" -ge 60 ]; then
    echo "gpu_carry.sh: gpu_carry/ is $size MiB, over the 60 MiB allowed" >&2
    exit 1
fi
echo "gpu_carry/: $size MiB"
echo 'carry: ["gpu_carry"]'
