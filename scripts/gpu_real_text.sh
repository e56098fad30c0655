#!/usr/bin/env bash
# The real-text GPU check (scripts/gpu_real_text.py) in one command, on a CUDA machine with
# gpu_carry/ in place (bash scripts/gpu_carry.sh makes it where the data is). Extra arguments go
# to the script (e.g. --parts 1,3 or --budget_s 300); PYTHON names the interpreter (default python).
#   bash scripts/gpu_real_text.sh OUTDIR [--key value ...]
# OUTDIR gets at most 8 files, as many as the GPU tool returns: the script's five JSON files,
# console.txt and logs.tar.gz, which packs everything else (each process's console, the runs'
# logs, pytest's output, nvidia-smi's). The script keeps to its --budget_s (330 s unless given);
# the hard limit below is 40 s more, so with the packing the command ends within budget + 50 s:
# the GPU session's call gives it timeout_s 390 (the script's docstring has the whole plan).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash scripts/gpu_real_text.sh OUTDIR [gpu_real_text.py arguments]}
shift
# the script's --budget_s, in whole seconds: its default, or the value given (=N or N)
budget=330
previous=''
for arg in "$@"; do
    case $arg in --budget_s=*) budget=${arg#--budget_s=} ;; esac
    if [ "$previous" = --budget_s ]; then budget=$arg; fi
    previous=$arg
done
hard_limit=$(( ${budget%.*} + 40 ))

logs=$(mktemp -d)/logs
mkdir -p "$out" "$logs"
nvidia-smi > "$logs/nvidia_smi.txt" 2>&1
# the hard limit is the last resort: the JSON files written by then stay (summary.json says
# finished: false), and the logs are packed all the same
timeout --kill-after=5 "$hard_limit" "${PYTHON:-python}" -u scripts/gpu_real_text.py \
    --out "$out" --logs "$logs" --budget_s "$budget" "$@" 2>&1 | tee "$out/console.txt"
status=$?
rm -f "$out"/*.tmp  # a JSON file cut off mid-write by the hard limit
tar -czf "$out/logs.tar.gz" -C "$(dirname "$logs")" logs
rm -rf "$(dirname "$logs")"
echo "gpu_real_text.sh: $(ls "$out" | wc -l) files in $out; exit status $status"
exit $status
