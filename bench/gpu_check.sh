#!/usr/bin/env bash
# The one GPU check, for an H200 machine (torch 2.11 + Triton 3.6 + nvcc 13.0, 16 cores, no network):
# build, the whole test suite, the GPU tests, compute-sanitizer over every kernel, the kernel
# benchmarks and the SmolLM2 demo, in at most 6 minutes, so that a rerun fits in 15 minutes of
# GPU time. Writes ONE JSON (bench/results/gpu_check/gpu_check.json: commit, GPU, driver, nvcc,
# torch, Triton, every step's status and seconds, every test count, every figure) and prints a
# short table last.
#
#   bash bench/gpu_check.sh            the check (needs CUDA)
#   bash bench/gpu_check.sh --dry-run  its plumbing on a CPU machine (CI runs it; VTOKEN_GPU_CHECK_DRY=1
#                                      means the same): every step in a CPU or --quick variant, or
#                                      skipped with its reason where only a GPU can run it
#
# Steps, in order, with the estimated wall time on an H200 (ESTIMATES from the sizes, not measured:
# no GPU has run this script yet) and each step's cap; they share one budget,
# VTOKEN_GPU_CHECK_BUDGET_S (default 360 s). A step runs under min(its cap, the time left after
# reserving the minimum of every later step), so a slow step shortens the later ones; a step with
# no time left is reported over_budget (a failure).
#   step                estimate  cap   what
#   build                  60 s   150   vtoken._C with nvcc for the local arch only (sm_90 on an H200), MAX_JOBS=nproc
#   pytest_suite          140 s   160   the whole suite as a GPU user runs it (CUDA visible, no interpreter: every
#                                       Triton test compiles for this GPU; -m "not gpu", the next step has those),
#                                       pytest-xdist -n 9, IN THE BACKGROUND of the next three steps
#   pytest_gpu             70 s   120   -m gpu: the kernels vs their oracles on CUDA tensors (token attention's
#                                       decode / prefill matrices too), CUDA graphs, tests/test_no_host_sync.py
#                                       under sync debug mode "error", tests/test_device_policies.py's cuda
#                                       cases vs the numpy oracles; -n 6
#   sanitize_memcheck      45 s    90   compute-sanitizer memcheck over bench/sanitize_kernels.py (every CUDA and
#                                       Triton kernel once at small sizes, each checked against its reference)
#   sanitize_racecheck     45 s    90   the same under racecheck, IN THE BACKGROUND of memcheck
#   bench_compact_kv       25 s    45   GB/s as a fraction of a D2D copy measured in the same run
#   bench_build_slot_lists 15 s    30   256 requests x 4K tokens (goal <= 10 us)
#   bench_token_attention  25 s    45   --scores-only: key scores on / off, time ratio
#   bench_decision_loop    40 s    60   --sizes 4096,16384: eager and CUDA-graph decision loop
#   demo                   30 s    60   SmolLM2-135M on the GPU, naive == vtoken token for token (see below)
#   report                  5 s         the JSON, its validation, the table
#   total                 ~345 s        5 s of machine info + build + max(suite 140, 70 + 45) + the rest
#
# The demo needs the SmolLM2 checkpoint offline (the GPU machine has no network, and the 93 MB
# package is too large to travel with the working tree): $VTOKEN_GPU_CHECK_MODEL (a Hugging Face
# directory or a .gguf file, the latter needing the gguf package), else vtoken's cached export
# (${VTOKEN_CACHE:-~/.cache/vtoken}/models/smollm2/hf), else the cached .gguf. Without one the
# step is SKIPPED with the reason, never passed.
#
# Give the call a wall-clock limit of at least 400 s: the budget, Python's start and the report.
#
# Commit: `git rev-parse HEAD` (-dirty when tracked files differ); a copy without .git takes
# $VTOKEN_GPU_CHECK_COMMIT. Logs, pytest counts and the benchmarks' JSON go to
# ${VTOKEN_GPU_CHECK_WORK:-bench/results/gpu_check}/ (a former run's files removed first); when
# $OUT names a folder, gpu_check.json, summary.txt and logs.tar.gz (every log, count and benchmark
# JSON of the run) are copied there.
#
# Exit status: 0 when no step failed, timed out or ran out of budget (skipped steps state why).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=${VTOKEN_GPU_CHECK_DRY:-0}
for arg in "$@"; do
  case $arg in
    --dry-run) DRY=1 ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $arg (expected --dry-run)" >&2; exit 2 ;;
  esac
done
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY=${PYTHON:-python3}
BUDGET=${VTOKEN_GPU_CHECK_BUDGET_S:-360}
WORK=${VTOKEN_GPU_CHECK_WORK:-bench/results/gpu_check}
TAIL_S=10 # kept for the report
NPROC=$(nproc 2>/dev/null || echo 4)
if [ -e "$WORK" ] && [ -n "$(ls -A "$WORK")" ] && [ ! -f "$WORK/steps.jsonl" ]; then
  echo "gpu_check.sh: $WORK holds files that are not a former run's; not removing them" >&2
  exit 2
fi
rm -rf "$WORK"
WORK=$(mkdir -p "$WORK" && cd "$WORK" && pwd)
export VTOKEN_BENCH_RESULTS="$WORK" VTOKEN_GPU_CHECK_ACTIVE=1 # the suite's test of this script skips itself
export PYTHONPATH="$PWD/python:$PWD:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}"
T0=$SECONDS

# Minimum seconds of each foreground step, in order: a step reserves the minimums of the steps after it.
ORDER=(build:40 pytest_gpu:30 sanitize_memcheck:20 bench_compact_kv:15
       bench_build_slot_lists:10 bench_token_attention:15 bench_decision_loop:20 demo:20)
reserve_after() { # reserve_after NAME: the minimums of the foreground steps after NAME
  local s=0 seen=0 e
  for e in "${ORDER[@]}"; do
    ((seen)) && s=$((s + ${e##*:}))
    [ "${e%%:*}" = "$1" ] && seen=1
  done
  echo "$s"
}
jstr() { local s=${1//\\/\\\\}; s=${s//\"/\\\"}; printf '"%s"' "$s"; }
record() { # record NAME STATUS SECONDS LIMIT RC REASON MODE
  printf '{"name": %s, "status": "%s", "seconds": %s, "limit_s": %s, "rc": %s, "reason": %s, "mode": %s}\n' \
    "$(jstr "$1")" "$2" "$3" "${4:-null}" "${5:-null}" "$([ -n "$6" ] && jstr "$6" || echo null)" "$(jstr "$7")" \
    >>"$WORK/steps.jsonl"
  echo "=== $1: $2 ($3 s)${6:+: $6}"
}
skip() { record "$1" skipped 0 "" "" "$2" "${3:-}"; } # skip NAME REASON [MODE]
limit_for() { # limit_for CAP RESERVE: the step's time limit (< 10: no time left)
  local left=$((BUDGET - (SECONDS - T0) - $2 - TAIL_S))
  echo $(($1 < left ? $1 : left))
}
finish() { # finish NAME RC LIMIT T_START MODE
  local name=$1 rc=$2 limit=$3 dt=$((SECONDS - $4))
  if ((rc == 0)); then
    record "$name" passed "$dt" "$limit" "$rc" "" "$5"
  elif ((rc == 124 || rc == 137)); then
    record "$name" timed_out "$dt" "$limit" "$rc" "stopped at its limit of ${limit} s (see $name.log)" "$5"
  else
    record "$name" failed "$dt" "$limit" "$rc" "exit status $rc (see $name.log)" "$5"
  fi
}
step() { # step NAME CAP MODE CMD...: run CMD in the foreground under its limit, log to $WORK/NAME.log
  local name=$1 cap=$2 mode=$3 limit t rc
  shift 3
  limit=$(limit_for "$cap" "$(reserve_after "$name")")
  if ((limit < 10)); then
    record "$name" over_budget 0 "$limit" "" "the shared budget of ${BUDGET} s was spent before this step" "$mode"
    return 1
  fi
  echo "=== $name (limit ${limit} s${mode:+; $mode}) ==="
  t=$SECONDS
  timeout -k 5 "$limit" "$@" > >(tee "$WORK/$name.log") 2>&1
  rc=$?
  finish "$name" "$rc" "$limit" "$t" "$mode"
  return "$rc"
}
declare -A BG_PID BG_T BG_LIMIT BG_MODE
bg_start() { # bg_start NAME CAP RESERVE MODE CMD...: run CMD in the background under its limit, log to $WORK/NAME.log
  local name=$1 cap=$2 mode=$4 limit
  limit=$(limit_for "$cap" "$3")
  shift 4
  if ((limit < 10)); then
    record "$name" over_budget 0 "$limit" "" "the shared budget of ${BUDGET} s was spent before this step" "$mode"
    return 1
  fi
  echo "=== $name (background, limit ${limit} s${mode:+; $mode}) ==="
  BG_T[$name]=$SECONDS BG_LIMIT[$name]=$limit BG_MODE[$name]=$mode
  timeout -k 5 "$limit" "$@" >"$WORK/$name.log" 2>&1 &
  BG_PID[$name]=$!
}
bg_join() { # bg_join NAME: wait for a background step and record it
  [ -n "${BG_PID[$1]:-}" ] || return 0
  wait "${BG_PID[$1]}"
  finish "$1" $? "${BG_LIMIT[$1]}" "${BG_T[$1]}" "${BG_MODE[$1]}"
}
pytest_args=(-q -rfE -p no:cacheprovider -p pytest_counts)
XDIST=0
"$PY" -c "import xdist" 2>/dev/null && XDIST=1

# 0. The machine (the report reads it again; printed here for the log).
echo "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ), budget ${BUDGET} s$( ((DRY)) && echo ', DRY RUN (CPU variants)')"
((DRY)) || timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader
timeout 60 "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"
if ((!DRY)) && ! timeout 60 "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check.sh: no CUDA device here; use --dry-run on a CPU machine" >&2
  exit 2
fi

# 1. Build vtoken._C in place (no network: no build isolation), for this GPU's arch only.
if ((DRY)); then
  step build 150 "dry run: VTOKEN_BUILD_CUDA=0, nothing compiled" env VTOKEN_BUILD_CUDA=0 "$PY" setup.py -q build_ext --inplace
else
  ARCH=$("$PY" -c "import torch; print('%d%d' % torch.cuda.get_device_capability())")
  step build 150 "nvcc sm_$ARCH only, MAX_JOBS=$NPROC" env VTOKEN_BUILD_CUDA=1 MAX_JOBS="$NPROC" \
    VTOKEN_NVCC_GENCODE="-gencode arch=compute_$ARCH,code=sm_$ARCH" "$PY" setup.py -q build_ext --inplace
fi
timeout 60 "$PY" -c "
import importlib, vtoken.device.ops as o
print('vtoken._C:', importlib.import_module('vtoken._C').__file__ if o.extension_loaded() else 'NOT LOADED (Triton / torch fallbacks)')"

# 2. The whole suite as the README's command runs it on a GPU machine (CUDA visible, Triton compiled, the
# kernel tests on CUDA tensors: tests/kernel_device.py), in the background of steps 3-4.
# Background steps end before the timed benchmarks (their load would skew them): they reserve the
# minimums of the steps after sanitize_memcheck.
BG_RESERVE=$(reserve_after sanitize_memcheck)
if ((DRY)); then
  SUITE_MODE="dry run: collected and counted, not run (--collect-only)"
  suite_cmd=(--collect-only tests)
else
  SUITE_MODE="CUDA visible, Triton compiled, -m 'not gpu'$( ((XDIST)) && echo ', xdist -n 9' || echo ', serial (no pytest-xdist)')"
  suite_cmd=(-m "not gpu" tests)
  ((XDIST)) && suite_cmd=(-n 9 "${suite_cmd[@]}")
fi
bg_start pytest_suite 160 "$BG_RESERVE" "$SUITE_MODE" env \
  VTOKEN_PYTEST_COUNTS="$WORK/counts_pytest_suite.jsonl" "$PY" -m pytest "${pytest_args[@]}" "${suite_cmd[@]}"

# 3. GPU tests: every gpu-marked test (the token-attention matrices and the device policies' cuda
# cases too), against their oracles on CUDA tensors.
GPU_MODE="-m gpu$( ((XDIST && !DRY)) && echo ', xdist -n 6')"
((DRY)) && GPU_MODE="$GPU_MODE; dry run: the gpu tests skip without CUDA"
gpu_sel=(-m gpu tests)
((XDIST && !DRY)) && gpu_sel=(-n 6 "${gpu_sel[@]}")
step pytest_gpu 120 "$GPU_MODE" env VTOKEN_PYTEST_COUNTS="$WORK/counts_pytest_gpu.jsonl" \
  "$PY" -m pytest "${pytest_args[@]}" "${gpu_sel[@]}"

# 4. compute-sanitizer over every kernel at small sizes: racecheck in the background of memcheck.
SAN=$(command -v compute-sanitizer || ls "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" 2>/dev/null || true)
if ((DRY)); then
  step sanitize_memcheck 60 "dry run: the driver alone (CPU ops, Triton interpreter), no compute-sanitizer" \
    "$PY" bench/sanitize_kernels.py
  skip sanitize_racecheck "dry run: compute-sanitizer needs a GPU"
elif [ -z "$SAN" ]; then
  record sanitize_memcheck failed 0 "" "" "compute-sanitizer not found on PATH or in \$CUDA_HOME/bin" ""
  record sanitize_racecheck failed 0 "" "" "compute-sanitizer not found on PATH or in \$CUDA_HOME/bin" ""
else
  # NOTE: without the caching allocator every tensor is its own allocation, so memcheck sees its bounds.
  san() { echo env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SAN" --tool "$1" --target-processes all --error-exitcode 3; }
  bg_start sanitize_racecheck 90 "$BG_RESERVE" "$SAN --tool racecheck --target-processes all" \
    $(san racecheck) "$PY" bench/sanitize_kernels.py
  step sanitize_memcheck 90 "$SAN --tool memcheck --target-processes all" $(san memcheck) "$PY" bench/sanitize_kernels.py
  bg_join sanitize_racecheck
fi
bg_join pytest_suite
[ -f "$WORK/pytest_suite.log" ] && tail -n 3 "$WORK/pytest_suite.log"

# 5. Benchmarks (each writes $WORK/<name>.json).
quick=()
((DRY)) && quick=(--quick)
BMODE=$( ((DRY)) && echo "dry run: --quick (CPU sizes)")
step bench_compact_kv 45 "$BMODE" "$PY" bench/bench_compact_kv.py "${quick[@]}"
step bench_build_slot_lists 30 "$BMODE" "$PY" bench/bench_build_slot_lists.py "${quick[@]}"
step bench_token_attention 45 "${BMODE:---scores-only}" "$PY" bench/bench_token_attention.py "${quick[@]}" \
  $( ((DRY)) || echo --scores-only)
if ((DRY)); then
  step bench_decision_loop 60 "$BMODE" "$PY" bench/bench_decision_loop.py --quick
else
  step bench_decision_loop 60 "--sizes 4096,16384" "$PY" bench/bench_decision_loop.py --sizes 4096,16384
fi

# 6. The SmolLM2 demo on the GPU: naive and vtoken greedy outputs identical.
demo_check='import json, sys; r = json.load(open(sys.argv[1])); print("outputs identical:", r["outputs_identical"]); sys.exit(0 if r["outputs_identical"] else 1)'
run_demo() { # run_demo MODE ARGS...: the demo's JSON to $WORK/demo.json, then the check
  local mode=$1
  shift
  step demo 60 "$mode" bash -c '"$0" -m vtoken.cli demo --json "${@:3}" >"$1" && "$0" -c "$2" "$1"' \
    "$PY" "$WORK/demo.json" "$demo_check" "$@"
}
if ((DRY)); then
  run_demo "dry run: the tiny random model on the CPU, 2 x (32 + 8) tokens" --model-preset tiny --device cpu \
    --requests 2 --prompt-len 32 --output-len 8
else
  CACHE=${VTOKEN_CACHE:-$HOME/.cache/vtoken}/models/smollm2
  MODEL=${VTOKEN_GPU_CHECK_MODEL:-}
  if [ -z "$MODEL" ] && [ -f "$CACHE/hf/vtoken-export.json" ]; then MODEL=$CACHE/hf; fi
  if [ -z "$MODEL" ] && [ -f "$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then MODEL=$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf; fi
  if [ -z "$MODEL" ]; then
    skip demo "SmolLM2 checkpoint not on this machine (no network to fetch it): set VTOKEN_GPU_CHECK_MODEL or fill $CACHE"
  elif [ ! -e "$MODEL" ]; then
    skip demo "VTOKEN_GPU_CHECK_MODEL=$MODEL does not exist"
  elif [[ $MODEL == *.gguf ]] && ! "$PY" -c "import gguf" 2>/dev/null; then
    skip demo "$MODEL is a .gguf and the gguf package is not installed here"
  else
    run_demo "SmolLM2 from $MODEL, cuda" --model-path "$MODEL" --device cuda
  fi
fi

# 7. The one JSON, validated, and the table.
"$PY" bench/gpu_check_report.py "$WORK" --budget "$BUDGET" --wall $((SECONDS - T0)) \
  $( ((DRY)) && echo --dry-run) 2>&1 | tee "$WORK/summary.txt"
rc=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then
  cp "$WORK/gpu_check.json" "$WORK/summary.txt" "$OUT"/ 2>/dev/null
  tar -czf "$OUT/logs.tar.gz" -C "$WORK" . 2>/dev/null
fi
((rc == 0)) || exit 1
"$PY" -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))['ok'] else 1)" "$WORK/gpu_check.json"
