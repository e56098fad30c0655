#!/usr/bin/env bash
# The GPU check from a fresh checkout: install what is missing (keeps an installed CUDA torch),
# then run it. Writes results/gpu/gpu_check.json; takes a few minutes on an H200 (two
# compilations, 2 x 300 steps).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -r requirements.txt || echo "gpu_check: pip install failed (offline?); using what is installed"
python scripts/gpu_check.py "$@"
# the GPU-only tests (grouped_mm against the expert loop, compiled against eager, bf16 against fp32)
python -m pytest -q -m gpu tests 2>&1 | tee results/gpu/gpu_tests.txt
