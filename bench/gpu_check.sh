#!/usr/bin/env bash
# One-shot GPU check for an H200 machine (torch 2.11 + triton 3.6 + nvcc 13.0, no network):
# builds csrc, runs the GPU tests, runs every GPU benchmark, prints a short table last.
#
# Budget: 8 minutes in all. The steps share VTOKEN_GPU_CHECK_BUDGET_S (default 460 s): each
# runs under min(its own cap, the time left after reserving the minimum of every step after
# it), so a slow step shortens the later ones instead of overrunning; a benchmark whose time
# is gone is reported SKIPPED. Results land in bench/results/*.json; when $OUT is set, the
# logs (<step>.log, summary.txt) and this run's JSON files go there too.
#
# VTOKEN_GPU_CHECK_DRY=1: a dry run on a machine without a GPU, to check this script: the
# build runs with VTOKEN_BUILD_CUDA=0 (compiles nothing), the GPU tests are collected and
# skipped, and every benchmark runs with --quick (CPU sizes).
#
# Exit status: 0 when every step passed, 1 otherwise (the table says which).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DRY=${VTOKEN_GPU_CHECK_DRY:-0}
LOG=${OUT:-bench/results}
BUDGET=${VTOKEN_GPU_CHECK_BUDGET_S:-460}
mkdir -p bench/results "$LOG"
T0=$SECONDS
MARK=$(mktemp)  # JSON files newer than this were written by this run
trap 'rm -f "$MARK"' EXIT
status=()
failed=0
TAIL_S=10  # kept for the summary

# Benchmarks in priority order (a tight budget cuts the last ones first): name:cap_s:min_s.
# cost_model: the calibration of vtoken sla --cost-model h200 (the real engine vs the H200 roofline, measured / modeled).
BENCHES=(engine:90:50 decision_loop:90:30 reclaim:60:30 token_attention:60:20 compact_kv:60:20 build_slot_lists:45:15
         block_live_counts:45:15 cost_model:60:20)
PYTEST_CAP=150
PYTEST_MIN=60
BUILD_CAP=200

bench_min_sum() {  # sum of the min_s of BENCHES[$1..]
  local s=0 i
  for ((i = $1; i < ${#BENCHES[@]}; i++)); do s=$((s + ${BENCHES[$i]##*:})); done
  echo "$s"
}

step() {  # step NAME CAP RESERVE CMD...: run CMD under min(CAP, budget left - RESERVE), log to $LOG/NAME.log
  local name=$1 cap=$2 reserve=$3
  shift 3
  local left=$((BUDGET - (SECONDS - T0) - reserve - TAIL_S))
  local limit=$((cap < left ? cap : left))
  if ((limit < 10)); then
    echo "=== $name: skipped (time budget spent) ==="
    status+=("$name: SKIPPED (time budget spent)")
    failed=$((failed + 1))
    return 1
  fi
  echo "=== $name (limit ${limit} s) ==="
  local t=$SECONDS rc
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$LOG/$name.log"
  rc=${PIPESTATUS[0]}
  if ((rc == 0)); then
    status+=("$name: ok ($((SECONDS - t)) s)")
  elif ((rc == 124 || rc == 137)); then
    status+=("$name: TIMED OUT at ${limit} s")
    failed=$((failed + 1))
  else
    status+=("$name: FAILED rc=$rc ($((SECONDS - t)) s)")
    failed=$((failed + 1))
  fi
  return "$rc"
}

echo "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ), budget ${BUDGET} s$([ "$DRY" = 1 ] && echo ', DRY RUN (CPU, no GPU steps)')"
if [ "$DRY" = 1 ]; then
  echo "dry run: nvidia-smi skipped"
else
  timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,mig.mode.current --format=csv,noheader ||
    timeout 30 nvidia-smi -L || true
fi
timeout 60 "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"

# 1. Build vtoken._C in place (no network: no deps, no build isolation).
if [ "$DRY" = 1 ]; then build_env=(VTOKEN_BUILD_CUDA=0); else build_env=(VTOKEN_BUILD_CUDA=1); fi
step build "$BUILD_CAP" $((PYTEST_MIN + $(bench_min_sum 0))) env "${build_env[@]}" "$PY" setup.py -q build_ext --inplace
export PYTHONPATH="$PWD/python:$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 60 "$PY" -c "
import importlib, vtoken, vtoken.ops as o
ext = importlib.import_module('vtoken._C').__file__ if o.extension_loaded() else 'NOT LOADED (Triton / torch fallbacks)'
print('vtoken from', vtoken.__file__, '| vtoken._C:', ext)"

# 2. GPU tests (every one, no -x: one run should show every failure).
step pytest_gpu "$PYTEST_CAP" "$(bench_min_sum 0)" "$PY" -m pytest -q -m gpu -rfE --durations=10 -p no:cacheprovider tests

# 3. Benchmarks (each writes bench/results/<name>.json).
bench_args=()
[ "$DRY" = 1 ] && bench_args=(--quick)
for i in "${!BENCHES[@]}"; do
  IFS=: read -r b cap _ <<<"${BENCHES[$i]}"
  if [ ! -f "bench/bench_$b.py" ]; then
    status+=("bench_$b: MISSING bench/bench_$b.py")
    failed=$((failed + 1))
    continue
  fi
  step "bench_$b" "$cap" "$(bench_min_sum $((i + 1)))" "$PY" "bench/bench_$b.py" ${bench_args[@]+"${bench_args[@]}"}
done

# 4. Short table, last.
json=()
for entry in "${BENCHES[@]}"; do
  f="bench/results/${entry%%:*}.json"
  [ "$f" -nt "$MARK" ] && json+=("$f")
done
if [ -n "${OUT:-}" ] && [ "$LOG" != bench/results ] && ((${#json[@]})); then cp "${json[@]}" "$OUT"/; fi
{
  echo
  echo "=== summary: $((SECONDS - T0)) s of ${BUDGET} s$([ "$DRY" = 1 ] && echo ' (DRY RUN: CPU, --quick)') ==="
  printf '%s\n' "${status[@]}"
  if ((${#json[@]})); then
    "$PY" bench/summarize.py "${json[@]}"
  else
    echo "(no benchmark results from this run)"
  fi
} 2>&1 | tee "$LOG/summary.txt"
exit $((failed > 0))
