"""vtoken.device.ops dispatch on a GPU that vtoken._C has no code for.

The CUDA runtime's answer (``vtoken::kernel_image_status``) is faked where
no GPU is needed; ``test_gpu_*`` asks the real one. The fake returns what the
real query returns: ``(True, "")``, or ``(False, cause)``.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from vtoken.device import ops
from vtoken import versions
from vtoken.errors import BackendUnavailableError, InvalidArgumentError, UnsupportedVersionError

HAS_EXT = ops.extension_loaded() and hasattr(torch.ops.vtoken, "kernel_image_status")
needs_ext = pytest.mark.skipif(not HAS_EXT, reason="vtoken._C is not built")

GPU = torch.device("cuda:0")


@pytest.fixture(autouse=True)
def fresh_dispatch_caches(monkeypatch):
    """Every test starts with no cached device answer and no warning given yet, and leaves none behind."""
    monkeypatch.delenv("VTOKEN_BACKEND", raising=False)
    caches = (ops._extension_cuda_cause, ops._warn_extension_skipped, ops._warn_triton_skipped)
    for c in caches:
        c.cache_clear()
    yield
    for c in caches:
        c.cache_clear()


NO_IMAGE = "vtoken._C has no kernel image for device 0 (rebuild with VTOKEN_NVCC_GENCODE for this GPU)"
OLD_DRIVER = ("CUDA query on device 0 failed: CUDA driver version is insufficient for CUDA runtime version "
              "(cudaErrorInsufficientDriver)")


def fake_cuda_runtime(monkeypatch, has_image: bool, cause: str = NO_IMAGE) -> list[int]:
    """CUDA is available and the extension runs (or not, for ``cause``) on every device; returns the devices asked."""
    asked = []

    def kernel_image_status(index):
        asked.append(index)
        return (True, "") if has_image else (False, cause)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.ops.vtoken, "kernel_image_status", kernel_image_status)
    return asked


@needs_ext
@pytest.mark.parametrize("cause", [NO_IMAGE, OLD_DRIVER], ids=["no-image", "old-driver"])
def test_gpu_extension_unusable_falls_back_to_triton_with_one_warning_naming_the_cause(monkeypatch, cause):
    asked = fake_cuda_runtime(monkeypatch, has_image=False, cause=cause)
    with pytest.warns(RuntimeWarning) as record:
        assert ops.select_backend("compact_kv", GPU) == "triton"
        assert ops.select_backend("compact_kv", GPU) == "triton"
        assert ops.select_backend("block_live_counts", GPU) == "triton"
    assert [str(w.message) for w in record] == [
        f"vtoken: vtoken._C's CUDA kernels cannot run on cuda:0: {cause}; its ops fall back to Triton "
        "(VTOKEN_BACKEND forces a backend)"]
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
@pytest.mark.parametrize("cause", [NO_IMAGE, OLD_DRIVER], ids=["no-image", "old-driver"])
def test_forced_cuda_on_gpu_the_extension_cannot_run_on_raises_naming_the_cause(monkeypatch, cause):
    fake_cuda_runtime(monkeypatch, has_image=False, cause=cause)
    monkeypatch.setenv("VTOKEN_BACKEND", "cuda")
    with pytest.raises(BackendUnavailableError) as info:
        ops.select_backend("compact_kv", GPU)
    assert str(info.value) == f"VTOKEN_BACKEND=cuda: vtoken._C cannot run on cuda:0: {cause}"
    assert isinstance(info.value, InvalidArgumentError)  # VTOKEN_BACKEND is user input
    assert ops.select_backend("compact_kv", torch.device("cpu")) == "cuda"
    # The other forced backends do not ask the extension.
    monkeypatch.setenv("VTOKEN_BACKEND", "triton")
    assert ops.select_backend("compact_kv", GPU) == "triton"
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    assert ops.select_backend("compact_kv", GPU) == "torch"


@needs_ext
def test_no_cuda_never_asks_the_runtime(monkeypatch):
    asked = fake_cuda_runtime(monkeypatch, has_image=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not ops.extension_runs_on(GPU)
    assert ops.extension_runs_on(torch.device("cpu"))
    assert asked == []


@needs_ext
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error path of a machine without a GPU")
def test_kernel_image_query_without_gpu_reports_the_cuda_error():
    """The real query reaches the CUDA runtime and returns its error as the cause, without raising."""
    ok, cause = torch.ops.vtoken.kernel_image_status(0)
    assert not ok
    assert cause.startswith("CUDA query on device 0 failed: ") and "(cudaError" in cause, cause
    with pytest.raises(RuntimeError, match=r"device: expected an index >= 0, got -1"):
        torch.ops.vtoken.kernel_image_status(-1)


@pytest.mark.gpu
@needs_ext
def test_gpu_default_build_has_code_for_this_gpu():
    """sm_80 / sm_90 SASS plus compute_90 PTX: code for A100, H100/H200 and newer GPUs."""
    index = torch.cuda.current_device()
    if torch.cuda.get_device_capability(index) < (8, 0):
        pytest.skip("the default build targets sm_80 and newer")
    ok, cause = torch.ops.vtoken.kernel_image_status(index)
    if cause.startswith("CUDA query"):
        pytest.skip(f"the CUDA runtime cannot be asked here: {cause}")  # e.g. a driver older than the build's CUDA
    assert (ok, cause) == (True, ""), torch.cuda.get_device_name(index)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ops.select_backend("compact_kv", torch.device("cuda", index)) == "cuda"


@needs_ext
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors stand in for a GPU's; a GPU has the real path")
def test_ops_run_on_triton_equal_to_the_reference_when_the_cuda_query_fails(monkeypatch):
    """The probe says the driver is too old: the op warns once, runs Triton (interpreted) and matches the reference.

    CPU tensors stand in for GPU 0's: dispatch is told to ask the (faked) CUDA
    runtime about them as it would about ``cuda:0``.
    """
    import vtoken_kernels.block_live_counts as tk
    from vtoken.reference.block_live_counts import block_live_counts as reference

    fake_cuda_runtime(monkeypatch, has_image=False, cause=OLD_DRIVER)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ops, "_extension_cause", lambda device: ops._extension_cuda_cause(0))
    ran, triton_impl = [], tk.block_live_counts
    monkeypatch.setattr(tk, "block_live_counts", lambda *a: ran.append("triton") or triton_impl(*a))
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(40 * 16, generator=gen)[:300].to(torch.int32)
    slots[::7] = -1
    alive = torch.randint(0, 2, (300,), generator=gen, dtype=torch.int8)
    allocated = torch.rand(40, generator=gen) < 0.7
    with pytest.warns(RuntimeWarning) as record:
        got = [ops.block_live_counts(slots, alive, 40, 16, allocated) for _ in range(2)]
    assert [str(w.message) for w in record] == [
        f"vtoken: vtoken._C's CUDA kernels cannot run on cpu: {OLD_DRIVER}; its ops fall back to Triton "
        "(VTOKEN_BACKEND forces a backend)"]
    assert ran == ["triton", "triton"]
    want_counts, want_f = reference(slots, alive, 40, 16, allocated)
    for counts, f in got:
        assert torch.equal(counts, want_counts)
        assert f.view(torch.int32).item() == want_f.view(torch.int32).item()
    monkeypatch.setenv("VTOKEN_BACKEND", "cuda")
    with pytest.raises(BackendUnavailableError, match="VTOKEN_BACKEND=cuda: vtoken._C cannot run on cpu: CUDA query"):
        ops.block_live_counts(slots, alive, 40, 16, allocated)


def test_forced_triton_without_cuda_or_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("VTOKEN_BACKEND", "triton")
    with pytest.raises(BackendUnavailableError, match=r"VTOKEN_BACKEND=triton: Triton needs CUDA or TRITON_INTERPRET"):
        ops.select_backend("compact_kv", torch.device("cpu"))


@pytest.mark.parametrize("problem", ["Triton is not installed (pip install 'triton>=3.6')",
                                     "Triton: expected >= 3.6, got 3.5.1"])
def test_unusable_triton_dispatches_to_the_reference_and_forcing_it_raises(monkeypatch, problem):
    monkeypatch.setattr(versions, "installed_triton_problem", lambda: problem)
    monkeypatch.setattr(ops, "has_extension_op", lambda name: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ops.select_backend("compact_kv", torch.device("cpu")) == "torch"
    monkeypatch.setattr(ops, "_extension_cause", lambda device: None)
    with pytest.warns(RuntimeWarning, match=r"the Triton backend is unavailable: .*; ops fall back to the torch"):
        assert ops.select_backend("compact_kv", GPU) == "torch"
    monkeypatch.setenv("VTOKEN_BACKEND", "triton")
    with pytest.raises(BackendUnavailableError) as info:
        ops.select_backend("compact_kv", GPU)
    assert str(info.value) == f"VTOKEN_BACKEND=triton: {problem}"


def test_version_checks():
    assert versions.parse_version("2.11.0+cu130") == (2, 11)
    assert versions.parse_version("3.6.0+git1a2b3c") == (3, 6)
    versions.check_torch("2.11.0")
    versions.check_torch("2.13.0+cpu")
    with pytest.raises(UnsupportedVersionError, match=r"torch: expected >= 2.11, got 2.10.1\+cu128"):
        versions.check_torch("2.10.1+cu128")
    with pytest.raises(UnsupportedVersionError, match=r"version: expected 'MAJOR.MINOR...', got 'nightly'"):
        versions.check_torch("nightly")
    assert versions.triton_problem("3.6.0") is None and versions.triton_problem("3.9.0") is None
    assert versions.triton_problem("3.5.1") == "Triton: expected >= 3.6, got 3.5.1"
    assert versions.triton_problem(None) == "Triton is not installed (pip install 'triton>=3.6')"
    # This machine's own versions are supported.
    versions.check_torch(torch.__version__)
    assert versions.installed_triton_problem() is None


@needs_ext
def test_cuda_device_without_an_index_and_without_cuda_is_not_an_error(monkeypatch):
    """``torch.device("cuda")`` on a machine without CUDA: the extension cannot run there; nothing raises."""
    asked = fake_cuda_runtime(monkeypatch, has_image=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not ops.extension_runs_on(torch.device("cuda"))
    monkeypatch.setenv("VTOKEN_BACKEND", "cuda")
    with pytest.raises(BackendUnavailableError, match=r"cannot run on cuda: torch.cuda.is_available\(\) is False"):
        ops.select_backend("compact_kv", torch.device("cuda"))
    assert asked == []


@needs_ext
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error path of a machine without a usable GPU")
def test_real_failed_query_falls_back_to_triton_with_one_warning(monkeypatch):
    """The real CUDA runtime (no GPU or driver here) answers through dispatch: a warning with its error, no raise.

    Only torch's answer is faked, as on a machine whose torch sees a GPU that
    the extension's newer CUDA runtime cannot use (cudaErrorInsufficientDriver).
    """
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.warns(RuntimeWarning) as record:
        assert [ops.select_backend(op, GPU) for op in ("compact_kv", "build_slot_lists")] == ["triton", "triton"]
    assert len(record) == 1
    assert "vtoken._C's CUDA kernels cannot run on cuda:0: CUDA query on device 0 failed: " in str(record[0].message)
    assert "(cudaError" in str(record[0].message)
