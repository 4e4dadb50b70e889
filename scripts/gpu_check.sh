#!/usr/bin/env bash
# Device checks of the GPU work (docs/gpu.md), on a machine with an NVIDIA GPU and no network, run
# from anywhere in the repository:
#
#   scripts/gpu_check.sh [WHEELS]        WHEELS: a folder of wheels (or $FNGATE_WHEELS; default .whl)
#
# 1. nvidia-smi must see a GPU; if it does not, the script stops at once (exit 2).
# 2. A virtual environment of its own, on top of the machine's packages, gets fngate's dependencies,
#    its gpu extra and the test tools from WHEELS only (pip --no-index): see docs/gpu.md for the
#    `pip download` that prepares them.
# 3. pytest -m gpu with REQUIRE_GPU=1: a missing GPU fails instead of skipping.
# 4. scripts/gpu_check.py: the wide benchmark model on CPU, CUDA and TensorRT fp16 (onnxruntime) and
#    as a native fp16 .plan, batch 1 and 32; cold starts without and with a stored engine cache.
#
# Everything lands in $OUT (default ./gpu-results): summary.md (the one to quote), timing.md and
# timing.json, pytest.txt, environment.txt, gpu_check.log. Every step has a timeout; together they
# stay under 8 minutes (7 min 40 s of steps, 5 s grace each). Exit status 0 only when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."

out="${OUT:-gpu-results}"
wheels="${1:-${FNGATE_WHEELS:-.whl}}"
python="${PYTHON:-python3}"
scratch="${GPU_CHECK_DIR:-${TMPDIR:-/tmp}/fngate-gpu-check}"
venv="$scratch/venv"
mkdir -p "$out" "$scratch"
exec > >(tee -a "$out/gpu_check.log") 2>&1

rows=()
failed=0
# step NAME LIMIT_S LOG|- COMMAND...: run COMMAND under a timeout, print and record its outcome.
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  echo "== $name (at most ${limit} s)"
  local started=$SECONDS code
  if [ "$log" = - ]; then
    timeout --kill-after=5 "$limit" "$@"
    code=$?
  else
    timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$log"
    code=${PIPESTATUS[0]}
  fi
  local outcome=PASS
  if [ "$code" != 0 ]; then
    failed=1
    outcome="FAIL (exit $code$([ "$code" = 124 ] && echo ', timed out'))"
  fi
  rows+=("| $name | $outcome | $((SECONDS - started)) s |")
  echo "== $name: $outcome"
  return "$code"
}

summarize() {
  {
    echo "# fngate GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    echo "GPU: ${gpu_line:-none visible}. Wheels: \`$wheels\`. Python: \`$($python --version 2>&1)\`."
    echo
    echo "| step | outcome | took |"
    echo "|---|---|---|"
    printf '%s\n' "${rows[@]}"
    if [ -f "$out/pytest.txt" ]; then
      echo
      echo "pytest -m gpu: \`$(grep -E '(passed|failed|error|skipped)' "$out/pytest.txt" | tail -1)\`"
    fi
    if [ -f "$out/timing.md" ]; then
      echo
      cat "$out/timing.md"
    fi
  } >"$out/summary.md"
  echo "== summary: $out/summary.md"
  cat "$out/summary.md"
}

if ! step "a GPU is visible (nvidia-smi)" 15 - nvidia-smi; then
  echo "gpu_check: no NVIDIA GPU is visible; nothing else is worth running" >&2
  summarize
  exit 2
fi
gpu_line=$(nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader | head -1)

"$python" - "$scratch" <<'EOF'
# From pyproject.toml: fngate's dependencies with the test tools (base.txt), its gpu extra (gpu.txt).
import pathlib, sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
tools = ["pytest>=8.2", "pytest-asyncio>=0.24", "pytest-timeout>=2.3", "onnx>=1.16"]
folder = pathlib.Path(sys.argv[1])
(folder / "base.txt").write_text("\n".join(project["dependencies"] + tools) + "\n")
(folder / "gpu.txt").write_text("\n".join(project["optional-dependencies"]["gpu"]) + "\n")
EOF
# pip, from the wheels folder only (the machine has no network).
pip_install=("$venv/bin/python" -m pip install -q --no-index --disable-pip-version-check --find-links "$wheels")

if [ ! -d "$wheels" ]; then
  rows+=("| install from \`$wheels\` | FAIL (no such folder) | 0 s |")
  failed=1
  echo "gpu_check: no wheels folder $wheels (docs/gpu.md says how to prepare one)" >&2
elif step "virtual environment" 30 - "$python" -m venv --system-site-packages "$venv" &&
  step "install fngate's dependencies and test tools" 60 - "${pip_install[@]}" -r "$scratch/base.txt"; then
  # Without the gpu extra the steps below still run: their failures then say what is missing.
  step "install the gpu extra" 60 - "${pip_install[@]}" -r "$scratch/gpu.txt"
  step "environment" 30 "$out/environment.txt" "$venv/bin/python" scripts/gpu_check.py environment
  # --noconftest: the GPU tests need no shared fixture, so neither Redis nor moto.
  step "pytest -m gpu" 110 "$out/pytest.txt" env REQUIRE_GPU=1 "$venv/bin/python" -m pytest \
    --noconftest -p no:cacheprovider -m gpu -q -rA \
    tests/runner/test_gpu_backends.py tests/runner/test_gpu_memory.py
  step "timing" 140 - "$venv/bin/python" scripts/gpu_check.py timing --out "$out" --work "$scratch/work"
fi
summarize
exit "$failed"
