#!/usr/bin/env bash
# The GPU check from a fresh checkout: install what is missing (keeps an installed CUDA torch),
# then run it and the GPU tests. Writes OUT/gpu_check.json and OUT/gpu_tests.txt (OUT: results/gpu
# unless given); takes a few minutes on an H200 (two compilations, 2 x 300 steps).
#   bash scripts/gpu_check.sh [OUT] [gpu_check.py arguments]
#   bash scripts/gpu_check.sh /tmp/gpu_dry_run --device=cpu --tiny   # the dry run, on any machine
# It needs nothing but torch and numpy (and pytest for the tests). Whatever else it cannot install
# (offline) costs one line each, never the check: each missing package, each test file pytest
# could not import. It exits 1 if gpu_check.py or a test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
out=results/gpu
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then
    out=$1
    shift
fi
mkdir -p "$out"
status=0

# offline, pip fails after one quick try; its messages go to a file
if ! "$PYTHON" -m pip install -q --retries 0 --timeout 10 -r requirements.txt pytest \
        > "$out/pip_install.txt" 2>&1; then
    echo "gpu_check: pip install failed (offline?), so the check uses what is installed;" \
         "pip's output: $out/pip_install.txt"
fi
"$PYTHON" - <<'EOF'
import importlib.util

for line in open('requirements.txt'):
    requirement, _, why = line.partition('#')
    name = requirement.split('>')[0].split('=')[0].strip()
    if not name:
        continue
    try:
        found = importlib.util.find_spec(name) is not None
    except ImportError:
        found = False
    if not found:
        print(f'gpu_check: {name} is not installed: {why.strip() or "see requirements.txt"}')
EOF

"$PYTHON" scripts/gpu_check.py --out "$out/gpu_check.json" "$@" || status=1

# the tests marked gpu: the CUDA variants of tests/test_gpu.py (all skipped without a GPU)
if ! "$PYTHON" -c 'import pytest' 2> /dev/null; then
    echo 'gpu_check: pytest is not installed, so the GPU tests cannot run'
    exit $status
fi
"$PYTHON" -m pytest -q -m gpu --continue-on-collection-errors tests > "$out/gpu_tests.txt" 2>&1
# each test file pytest could not import, with its error's last line (a missing package)
"$PYTHON" - "$out/gpu_tests.txt" <<'EOF'
import re
import sys

log = open(sys.argv[1]).read()
for path, body in re.findall(r'_ ERROR collecting (\S+) _+\n(.*?)(?=\n_+ |\n=+ )', log, re.S):
    errors = [line[1:].strip() for line in body.splitlines() if line.startswith('E ')]
    print(f'gpu_check: could not collect {path}: {errors[-1] if errors else "see the log"}')
EOF
echo "gpu_check: GPU tests: $(tail -n 1 "$out/gpu_tests.txt") (all of it in $out/gpu_tests.txt)"
if grep -qE '^(FAILED|ERROR) tests/.*::' "$out/gpu_tests.txt"; then
    status=1
fi
exit $status
