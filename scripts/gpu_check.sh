#!/usr/bin/env bash
# Device checks of the GPU work, in one call, from anywhere in the repository (docs/gpu.md says
# what the machine must have):
#
#   scripts/gpu_check.sh [WHEELS]
#
# WHEELS (or $FNGATE_WHEELS; default .whl, used when it holds wheels): wheels of what the machine
# lacks, installed with `pip --no-index --no-deps --target` into a folder put first on PYTHONPATH,
# so that everything the machine's Python already has stays visible. $PYTHON (default python3)
# runs everything; $OUT (default gpu-results) receives summary.md (the one to quote), results.json
# and log.txt, written after every step. $GPU_CHECK_BUDGET_S (default 480) bounds the whole run:
# each step gets the smaller of its own limit and what is left, and is stopped (its processes
# too) when it overruns. Exit status: 0 when every step passed, 2 when no GPU is visible, else 1.
set -uo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
out="${OUT:-gpu-results}"
wheels="${1:-${FNGATE_WHEELS:-.whl}}"

if ! command -v "$python" >/dev/null; then
  echo "missing: $python (Python 3.11 or later; set PYTHON to another one)" >&2
  exit 1
fi
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "missing: Python 3.11 or later ($python is $("$python" --version 2>&1))" >&2
  exit 1
fi
mkdir -p "$out"
exec "$python" scripts/gpu_check.py all --out "$out" --wheels "$wheels" --budget-s "${GPU_CHECK_BUDGET_S:-480}"
