"""The GPU-faithful compile lane (tests/compile_lane.py, tests/triton_launches.py) itself.

Specializations are computed and compiled in fresh processes without
TRITON_INTERPRET (tests/aot_helpers.py says why), by Triton's own binder.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import compile_lane
import triton_launches
from kernel_device import cpu_engine_triton
import vtoken_kernels.build_slot_lists as tk
from lane_fixture_kernels import _scale_kernel, _widen_kernel
from test_build_slot_lists import Batch, as_lists, new_counts_for, oracle, poisoned_buffers, random_requests, sizes

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="records interpreted launches; a GPU runs the JIT itself")


@pytest.fixture
def launch_log(tmp_path, monkeypatch):
    """Record this test's launches into a fresh log (restoring whatever log the suite itself records into)."""
    log = str(tmp_path / "launches.jsonl")
    monkeypatch.setenv(triton_launches.LOG_ENV, log)
    assert triton_launches.install()
    return log


def _lane(log: str, archs: str = "90") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(TESTS_DIR, "compile_lane.py"), log, "--archs", archs],
                          capture_output=True, text=True, timeout=600)


def test_recorder_writes_one_line_per_distinct_launch(launch_log):
    x = torch.arange(40, dtype=torch.float32)
    y = torch.full_like(x, -1.0)
    _scale_kernel[(3,)](x, y, 40, BLOCK=16)
    _scale_kernel[(3,)](x, y, 40, BLOCK=16)
    assert torch.equal(y, x * 2)
    assert compile_lane.read_log(launch_log) == [
        {"module": "lane_fixture_kernels", "qualname": "_scale_kernel",
         "args": [{"tensor": "float32", "data_ptr": x.data_ptr()}, {"tensor": "float32", "data_ptr": y.data_ptr()}, 40],
         "kwargs": {"BLOCK": 16}}]


def test_key_is_tritons_own_specialization():
    # The lane's key (Triton's binder) next to Triton's specialize function, in a fresh process.
    code = """
import json, torch, compile_lane
from triton.backends.compiler import BaseBackend
from triton.runtime.driver import driver
from triton._C.libtriton import native_specialize_impl
from lane_fixture_kernels import _scale_kernel
driver.set_active(compile_lane._StandInDriver(90))
T = compile_lane._RecordedTensor
out = {}
for name, (xp, yp, n) in {"ones": (64, 1040, 1), "aligned": (64, 1040, 32), "odd": (68, 1040, 33)}.items():
    args = (T(torch.float32, xp), T(torch.float32, yp), n)
    _, spec, _ = _scale_kernel.device_caches[0][4](*args, BLOCK=16)
    direct = [list(native_specialize_impl(BaseBackend, a, False, True, True)) for a in args]
    out[name] = {"spec": [list(s) for s in spec], "direct": direct}
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", triton_launches.LOG_ENV)}
    env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR] + [p for p in sys.path if p])
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in out.items():
        assert r["spec"][:3] == r["direct"], name
    assert out["ones"]["spec"] == [["*fp32", "D"], ["*fp32", "D"], ["constexpr", 1], ["constexpr", 16]]
    assert out["aligned"]["spec"][2] == ["i32", "D"]
    assert out["odd"]["spec"][:3] == [["*fp32", ""], ["*fp32", "D"], ["i32", ""]]


@pytest.mark.parametrize("n", [1, 7])
def test_lane_catches_to_on_an_int_arg_equal_to_one(launch_log, n):
    out = torch.full((1,), -1, dtype=torch.int64)
    _widen_kernel[(1,)](out, n)
    assert out.item() == n  # the interpreter runs it either way
    lane = _lane(launch_log)
    assert lane.returncode == 1, lane.stdout
    assert "'int' object has no attribute 'to'" in lane.stdout and "('constexpr', 1)" in lane.stdout
    if n == 1:
        assert "sm_90: 1 distinct specializations, 0 compiled, 1 failed" in lane.stdout
    else:
        # n=7 compiles; the lane's all-ones variant of the kernel is what fails.
        assert "sm_90: 2 distinct specializations, 1 compiled, 1 failed" in lane.stdout


def test_lane_fails_when_nothing_was_recorded(tmp_path):
    lane = _lane(str(tmp_path / "missing.jsonl"))
    assert lane.returncode == 1 and "no launch recorded" in lane.stderr


@cpu_engine_triton  # the lane records interpreted launches: with CUDA the suite runs Triton's JIT itself
def test_build_slot_lists_compiles_with_one_tile_per_span(launch_log):
    # Regression: a mirror of at most MAX_SPANS * BLOCK positions has
    # tiles_per_span == 1, which the GPU JIT compiles as a constant.
    reqs = random_requests([5, 1, 9], 0.5, seed=3)
    k = new_counts_for(reqs, 3)
    slots, alive, starts, lens = Batch(reqs, gap=6, left_out=5, seed=3).tensors(
        lens_dtype=torch.int64, alive_dtype=torch.int8)
    assert tk.plan_spans(slots.numel())[1] == 1
    nnz_max, max_reqs, max_tokens = sizes(reqs, k)
    bufs = poisoned_buffers(nnz_max, max_reqs, max_tokens)
    tk.build_slot_lists(slots, alive, starts, lens, torch.tensor(k), *bufs[:3], bufs[3], len(reqs))
    assert as_lists(bufs) == oracle(reqs, k, nnz_max, max_reqs, max_tokens)
    lane = _lane(launch_log)
    assert lane.returncode == 0, lane.stdout + lane.stderr
    assert "3 kernels" in lane.stdout and " 0 failed" in lane.stdout
