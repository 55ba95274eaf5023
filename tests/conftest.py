"""Test setup: Triton runs in its interpreter on machines without CUDA.

NOTE: TRITON_INTERPRET must be set before any ``@triton.jit`` module is
imported, which is why it happens here, at conftest import time.

The debug checks (``VTOKEN_DEBUG_INVARIANTS``) are on for the whole suite
unless the environment says otherwise: ``.ci/run``'s production lane runs the
engine, reclaim and vLLM tests again with ``VTOKEN_DEBUG_INVARIANTS=0`` and
``-m "not debug_checks"``, leaving out the tests that assert a check fires.
"""
import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("VTOKEN_DEBUG_INVARIANTS", "1")

import triton_launches  # noqa: E402  (the compile lane's recorder, on when VTOKEN_TRITON_LAUNCH_LOG is set)

triton_launches.install()

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "slow: long-running; deselect with -m 'not slow'")
    config.addinivalue_line("markers", "vllm: needs vllm installed; skipped without it")
    config.addinivalue_line(
        "markers", "debug_checks: asserts that a VTOKEN_DEBUG_INVARIANTS check fires; the production lane deselects it")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
