#!/usr/bin/env bash
# The device run of the GPU work (docs/gpu.md, "Checking on a GPU machine"), the same command in
# every call, from anywhere in the repository:
#
#   scripts/gpu_check.sh
#
# Each call carries what `python scripts/gpu_check.py pack` wrote into .gpu/calls.json. Call 1
# (fngate's wheels and redis-server) runs the serving stage at once: the GPU Python functions
# through the runner and under `fngate up`, the Python GPU tests. The next calls each keep a part
# of onnxruntime-gpu and say which are still to come; the one that brings the last puts the wheel
# together, installs every wheel beside the machine's own packages and runs the ONNX stage. Each
# stage's steps run under $GPU_CHECK_BUDGET_S (default 200 s for call 1, 240 s for the last). $PYTHON (default python3) runs
# everything; $OUT (default gpu-results) receives summary.md (the one to quote), results.json and
# log.txt.
# Exit status: 0 when every step passed, 2 when no GPU is visible, 3 when parts an earlier call
# carried are gone (the machine was handed back: start again from call 1), else 1.
set -uo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
out="${OUT:-gpu-results}"

if ! command -v "$python" >/dev/null; then
  echo "missing: $python (Python 3.11 or later; set PYTHON to another one)" >&2
  exit 1
fi
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "missing: Python 3.11 or later ($python is $("$python" --version 2>&1))" >&2
  exit 1
fi
mkdir -p "$out"
exec "$python" scripts/gpu_check.py device --out "$out"
