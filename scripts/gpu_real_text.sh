#!/usr/bin/env bash
# The real-text GPU check (scripts/gpu_real_text.py) in one command, on a CUDA machine with
# gpu_carry/ in place (bash scripts/gpu_carry.sh makes it where the data is). Results go to OUTDIR;
# extra arguments go to the script (e.g. --parts 1,3). Its parts stop at shares of --budget_s
# (420 s); the whole command is stopped at 8 minutes, and what it wrote by then stays.
#   bash scripts/gpu_real_text.sh OUTDIR [--key value ...]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash scripts/gpu_real_text.sh OUTDIR [gpu_real_text.py arguments]}
shift
mkdir -p "$out"
nvidia-smi > "$out/nvidia_smi.txt" 2>&1
# the script keeps to its budget; this limit is the last resort, and the JSON files it has
# written by then stay (summary.json says finished: false)
timeout --kill-after=10 480 \
    python -u scripts/gpu_real_text.py --out "$out" "$@" 2>&1 | tee "$out/console.txt"
