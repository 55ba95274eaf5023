"""No host sync on the decode path: the CPU guard, and the GPU test under sync debug mode.

CPU guard. The aten ops that sync on CUDA without a Python-level read
(``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``,
``repeat_interleave`` without ``output_size``, ``item``) are watched by a
dispatch mode, and every way torch reads a tensor's contents back into
Python is patched and counted: ``Tensor.item``, ``.tolist``, ``.cpu``, ``.numpy``, ``__array__``,
``__bool__``, ``__int__``, ``__float__``, ``__index__``. On a GPU each of
them on a device tensor is a device-to-host copy and a sync. On the CPU every
tensor is a host tensor, so the guard is STRICTER than the GPU: it flags
every read of any tensor, except at the sites that are not device reads:

* the CPU stand-ins of device kernels (``vtoken/reference``, ``vtoken_kernels``,
  Triton's interpreter): on a GPU they are kernel launches;
* host-to-device staging (``ModelRunner._stage_tokens``, ``DeltaShipper``): on
  a GPU they write pinned host buffers, which an async copy then ships;
* ``VictimRing._decode`` / ``release``: the decision ring's pinned host copy,
  read after its event completed (the one allowed device-to-host transfer);
* ``StepResult.next_tokens``: sampling (the greedy token of each request goes
  back to the scheduler, 8 bytes per request; vLLM's async scheduling
  overlaps this, the embedded engine waits for it).

Debug checks (``VTOKEN_DEBUG_INVARIANTS``) are off inside the guard: they
read the device on purpose.
"""
from __future__ import annotations

import contextlib
import os
import sys

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine_helpers import TINY, EAGER_RECLAIM
from vtoken.engine.model import LlamaModel, ModelConfig
from vtoken.engine.scheduler import Engine, EngineConfig


_READS = ("item", "tolist", "cpu", "numpy", "__array__", "__bool__", "__int__", "__float__", "__index__")
_KERNEL_STANDINS = (os.sep + os.path.join("vtoken", "reference") + os.sep, os.sep + "vtoken_kernels" + os.sep,
                    os.sep + "triton" + os.sep)
_ALLOWED_FUNCS = {("runner.py", "_stage_tokens"), ("buffers.py", "flush"), ("buffers.py", "to_device"),
                  ("victim_ring.py", "_decode"), ("victim_ring.py", "release"), ("runner.py", "next_tokens")}


def _allowed(frame) -> bool:
    while frame is not None:
        path = frame.f_code.co_filename
        if any(s in path for s in _KERNEL_STANDINS):
            return True
        if (os.path.basename(path), frame.f_code.co_name) in _ALLOWED_FUNCS:
            return True
        frame = frame.f_back
    return False


# aten ops that read a device tensor back on CUDA even without a Python-level read: data-dependent
# output shapes (nonzero, boolean-mask indexing, masked_select, unique, repeat_interleave without
# output_size) and scalar results (item, is_nonzero, equal).
_SYNCING_OPS = {"aten::nonzero", "aten::_local_scalar_dense", "aten::masked_select", "aten::_unique2",
                "aten::unique_consecutive", "aten::unique_dim", "aten::is_nonzero", "aten::equal"}


class _SyncingOps(TorchDispatchMode):
    def __init__(self, reads):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        syncs = name in _SYNCING_OPS
        if name == "aten::index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                         for i in (args[1] if len(args) > 1 else ()) if i is not None):
            syncs = True
        if name == "aten::repeat_interleave" and (kwargs or {}).get("output_size") is None:
            syncs = True
        if syncs:
            caller = sys._getframe(1)
            if not _allowed(caller):
                self.reads.append((name, "aten"))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_device_reads():
    """Patch the tensor read methods and watch syncing aten ops; yields the reads outside the allowed sites."""
    reads: list = []
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def wrap(name, fn):
        def guarded(self, *args, **kwargs):
            caller = sys._getframe(1)
            if not _allowed(caller):
                reads.append((name, f"{caller.f_code.co_filename}:{caller.f_lineno} {caller.f_code.co_name}"))
            return fn(self, *args, **kwargs)
        return guarded

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        with _SyncingOps(reads):
            yield reads
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def test_the_guard_sees_a_host_read():
    t = torch.arange(4)
    with count_device_reads() as reads:
        if t.sum() > 2:  # __bool__ on a tensor: a sync on a GPU
            pass
        t.tolist()
        t[t > 1]  # boolean-mask indexing: a data-dependent shape
        torch.nonzero(t)
    names = [r[0] for r in reads]
    assert {"__bool__", "tolist", "aten::_local_scalar_dense", "aten::nonzero", "aten::index"} <= set(names)


@pytest.mark.parametrize("policy", ("h2o", "streamingllm", "scissorhands"))
def test_decode_steps_with_eviction_and_relocation_read_nothing_back(policy, monkeypatch):
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    monkeypatch.setenv("VTOKEN_DEBUG_INVARIANTS", "0")
    model = LlamaModel(ModelConfig(**TINY))
    eng = Engine(model, EngineConfig(num_blocks=96, block_size=4, max_num_reqs=4, max_num_tokens=256,
                                     mode="vtoken", policy=policy, reclaim=EAGER_RECLAIM,
                                     policy_config=dict(budget=0.5, window=4, sink=2)))
    rng = np.random.default_rng(0)
    for n in (20, 27, 33, 14):
        eng.add_request(rng.integers(0, 160, n), 24)
    eng.step()  # the prefill (admission and prompt staging happen here, outside the guard)
    with count_device_reads() as reads:
        for _ in range(12):
            eng.step()
    assert reads == []
    assert sum(s.evicted for s in eng.stats) > 0  # the guarded steps did evict ...
    assert eng.reclaimer.metrics.summary().get("moves", 0) > 0  # ... and relocate


def test_snapkv_window_prefill_and_decodes_read_nothing_back(monkeypatch):
    """SnapKV under chunked prefill: the guarded steps complete prompts (the observation window's queries, its
    votes, the device decisions) and decode; nothing is read back."""
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    monkeypatch.setenv("VTOKEN_DEBUG_INVARIANTS", "0")
    eng = _snapkv_engine(LlamaModel(ModelConfig(**TINY)))
    eng.step()  # admission and the first prompt chunks, outside the guard
    with count_device_reads() as reads:
        for _ in range(8):
            eng.step()
    assert reads == []
    assert sum(s.evicted for s in eng.stats[1:]) > 0  # the guarded steps did decide from the window votes


def _snapkv_engine(model):
    eng = Engine(model, EngineConfig(num_blocks=96, block_size=4, max_num_reqs=4, max_num_tokens=32,
                                     chunked_prefill=True, mode="vtoken", policy="snapkv", reclaim=EAGER_RECLAIM,
                                     policy_config=dict(budget=0.5, window=4, sink=2)))
    rng = np.random.default_rng(0)
    for n in (20, 27, 33, 14):
        eng.add_request(rng.integers(0, 160, n), 24)
    return eng


def _lift_sync_debug_for_sampling(monkeypatch):
    """``StepResult.next_tokens`` (the embedded engine's one read: the greedy tokens) runs with the mode lifted."""
    from vtoken.engine.runner import StepResult

    sample = StepResult.next_tokens

    def sampled(self):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return sample(self)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(StepResult, "next_tokens", sampled)


@pytest.mark.gpu
def test_cuda_snapkv_window_prefill_under_sync_debug_mode(monkeypatch):
    """The SnapKV window path on CUDA (window rows staged with the tokens, votes from device buffers) and the
    decodes after it, with torch's sync debug mode set to error."""
    monkeypatch.setenv("VTOKEN_DEBUG_INVARIANTS", "0")
    eng = _snapkv_engine(LlamaModel(ModelConfig(**TINY), device="cuda"))
    captures = eng.runner.num_graph_captures
    eng.step()  # admission and the first prompt chunks
    _lift_sync_debug_for_sampling(monkeypatch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert sum(s.evicted for s in eng.stats[1:]) > 0
    assert eng.runner.num_graph_replays > 0 and eng.runner.num_graph_captures == captures  # none while serving


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", (False, True), ids=["eager", "graphed"])
@pytest.mark.parametrize("policy", ("h2o", "streamingllm"))
def test_cuda_decode_steps_with_eviction_and_relocation_under_sync_debug_mode(policy, graphed, monkeypatch):
    """N decode steps on CUDA (graphs, device decisions, relocation) with torch's sync debug mode set to error.

    Sampling is the one exception (the embedded engine reads each step's
    greedy tokens): ``StepResult.next_tokens`` runs with the mode lifted.
    """
    monkeypatch.setenv("VTOKEN_DEBUG_INVARIANTS", "0")
    model = LlamaModel(ModelConfig(**TINY), device="cuda")
    eng = Engine(model, EngineConfig(num_blocks=96, block_size=4, max_num_reqs=4, max_num_tokens=256,
                                     mode="vtoken", policy=policy, reclaim=EAGER_RECLAIM, decision_graph=graphed,
                                     policy_config=dict(budget=0.5, window=4, sink=2)))
    rng = np.random.default_rng(0)
    for n in (20, 27, 33, 14):
        eng.add_request(rng.integers(0, 160, n), 24)
    captures = eng.runner.num_graph_captures  # every padded size, at the engine's warm-up
    for _ in range(4):  # prefill, then the first decodes grow the caches
        eng.step()
    _lift_sync_debug_for_sampling(monkeypatch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(12):
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert sum(s.evicted for s in eng.stats) > 0
    assert eng.reclaimer.metrics.summary().get("moves", 0) > 0
    assert eng.runner.num_graph_replays > 0 and eng.runner.num_graph_captures == captures  # none while serving
