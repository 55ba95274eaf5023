"""vtoken.ops dispatch on a GPU that vtoken._C has no code for.

The CUDA runtime's answer (``vtoken::has_cuda_kernel_image``) is faked where
no GPU is needed; ``test_gpu_*`` asks the real one.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from vtoken import ops
from vtoken.errors import InvalidArgumentError

HAS_EXT = ops.extension_loaded() and hasattr(torch.ops.vtoken, "has_cuda_kernel_image")
needs_ext = pytest.mark.skipif(not HAS_EXT, reason="vtoken._C is not built")

GPU = torch.device("cuda:0")


@pytest.fixture(autouse=True)
def fresh_dispatch_caches(monkeypatch):
    """Every test starts with no cached device answer and no warning given yet, and leaves none behind."""
    monkeypatch.delenv("VTOKEN_BACKEND", raising=False)
    ops._extension_has_cuda_image.cache_clear()
    ops._warn_no_kernel_image.cache_clear()
    yield
    ops._extension_has_cuda_image.cache_clear()
    ops._warn_no_kernel_image.cache_clear()


def fake_cuda_runtime(monkeypatch, has_image: bool) -> list[int]:
    """CUDA is available and the extension has (or lacks) code for every device; returns the devices asked about."""
    asked = []

    def has_cuda_kernel_image(index):
        asked.append(index)
        return has_image

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.ops.vtoken, "has_cuda_kernel_image", has_cuda_kernel_image)
    return asked


@needs_ext
def test_gpu_without_kernel_image_falls_back_to_triton_with_one_warning_per_op(monkeypatch):
    asked = fake_cuda_runtime(monkeypatch, has_image=False)
    with pytest.warns(RuntimeWarning) as record:
        assert ops.select_backend("compact_kv", GPU) == "triton"
        assert ops.select_backend("compact_kv", GPU) == "triton"
        assert ops.select_backend("block_live_counts", GPU) == "triton"
    assert [str(w.message).split(";")[1].strip() for w in record] == [
        "compact_kv falls back to Triton (rebuild with VTOKEN_NVCC_GENCODE for this GPU)",
        "block_live_counts falls back to Triton (rebuild with VTOKEN_NVCC_GENCODE for this GPU)",
    ]
    assert all("vtoken._C has no kernel image for cuda:0" in str(w.message) for w in record)
    assert asked == [0]  # once per device, not per call or per op
    # CPU tensors still get the extension's C++ kernels, without asking.
    assert ops.select_backend("compact_kv", torch.device("cpu")) == "cuda"
    assert asked == [0]


@needs_ext
def test_gpu_with_kernel_image_dispatches_to_the_extension(monkeypatch):
    asked = fake_cuda_runtime(monkeypatch, has_image=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ops.select_backend("compact_kv", GPU) == "cuda"
        assert ops.select_backend("compact_kv", torch.device("cuda:1")) == "cuda"
        assert ops.select_backend("build_slot_lists", GPU) == "cuda"
    assert asked == [0, 1]


@needs_ext
def test_forced_cuda_on_gpu_without_kernel_image_raises(monkeypatch):
    fake_cuda_runtime(monkeypatch, has_image=False)
    monkeypatch.setenv("VTOKEN_BACKEND", "cuda")
    with pytest.raises(InvalidArgumentError, match=r"VTOKEN_BACKEND=cuda: expected a vtoken._C with code for cuda:0"):
        ops.select_backend("compact_kv", GPU)
    assert ops.select_backend("compact_kv", torch.device("cpu")) == "cuda"


@needs_ext
def test_no_cuda_never_asks_the_runtime(monkeypatch):
    asked = fake_cuda_runtime(monkeypatch, has_image=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not ops.extension_runs_on(GPU)
    assert ops.extension_runs_on(torch.device("cpu"))
    assert asked == []


@needs_ext
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error path of a machine without a GPU")
def test_kernel_image_query_without_gpu_raises_a_runtime_error():
    """The real query reaches the CUDA runtime and reports its error (no GPU or driver here)."""
    with pytest.raises(RuntimeError, match=r"has_cuda_kernel_image: CUDA query on device 0 failed: "):
        torch.ops.vtoken.has_cuda_kernel_image(0)
    with pytest.raises(RuntimeError, match=r"device: expected an index >= 0, got -1"):
        torch.ops.vtoken.has_cuda_kernel_image(-1)


@pytest.mark.gpu
@needs_ext
def test_gpu_default_build_has_code_for_this_gpu():
    """sm_80 / sm_90 SASS plus compute_90 PTX: code for A100, H100/H200 and newer GPUs."""
    index = torch.cuda.current_device()
    if torch.cuda.get_device_capability(index) < (8, 0):
        pytest.skip("the default build targets sm_80 and newer")
    assert torch.ops.vtoken.has_cuda_kernel_image(index), torch.cuda.get_device_name(index)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ops.select_backend("compact_kv", torch.device("cuda", index)) == "cuda"
