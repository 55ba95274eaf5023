#!/usr/bin/env bash
# One-shot GPU check for an H200 machine (torch 2.11 + triton 3.6 + nvcc 13.0, no network):
# builds csrc, runs the GPU tests, runs every benchmark, prints a short table last.
# Budget: <= 8 minutes. Results land in bench/results/*.json (and $OUT when set).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LOG=${OUT:-bench/results}
mkdir -p bench/results "$LOG"
status=()

step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name ==="
  if timeout "$limit" "$@" 2>&1 | tee "$LOG/$name.log"; then
    status+=("$name: ok ($((SECONDS - t0)) s)")
  else
    status+=("$name: FAILED rc=${PIPESTATUS[0]} ($((SECONDS - t0)) s)")
  fi
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"

# 1. Build vtoken._C in place (no network: no deps, no build isolation).
step build 240 env VTOKEN_BUILD_CUDA=1 $PY setup.py -q build_ext --inplace
export PYTHONPATH="$PWD/python:$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PY -c "import vtoken.ops as o; print('extension loaded:', o.extension_loaded())"

# 2. GPU tests.
step pytest_gpu 150 $PY -m pytest -q -m gpu -x tests

# 3. Benchmarks (each writes bench/results/<name>.json).
for b in compact_kv build_slot_lists block_live_counts token_attention reclaim engine; do
  [ -f "bench/bench_$b.py" ] && step "bench_$b" 90 $PY "bench/bench_$b.py"
done

# 4. Short table.
echo; echo "=== summary ==="
printf '%s\n' "${status[@]}"
$PY bench/summarize.py bench/results
[ -n "${OUT:-}" ] && cp bench/results/*.json "$OUT"/ 2>/dev/null
exit 0
