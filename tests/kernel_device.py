"""The device the tests run Triton kernels on: the GPU when there is one, else the CPU.

tests/conftest.py turns on Triton's interpreter (``TRITON_INTERPRET=1``) only
without CUDA. On a GPU machine Triton compiles and takes CUDA tensors only, so
every test that hands tensors to a Triton kernel (a ``vtoken_kernels`` wrapper
directly, or ``vtoken.device.ops`` with ``VTOKEN_BACKEND=triton``) allocates them on
``KERNEL_DEVICE``. The torch reference and vtoken._C's C++ CPU kernels keep
their CPU tensors (``device_for``). tests/test_kernel_device.py checks the test
sources for a hard-coded CPU device on that path.
"""
import pytest
import torch

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def device_for(backend: str) -> str:
    """Where a backend's test tensors live: Triton's on ``KERNEL_DEVICE``, every other backend's on the CPU."""
    return KERNEL_DEVICE if backend == "triton" else "cpu"


# NOTE: for a test whose engine and oracle live on the CPU but that forces the
# Triton backend (to run the engine's control flow through the interpreted
# kernels). On a GPU machine Triton cannot take those CPU tensors; the gpu
# tests run the engine on CUDA instead.
cpu_engine_triton = pytest.mark.skipif(
    torch.cuda.is_available(), reason="forces Triton on a CPU engine; with CUDA, Triton takes CUDA tensors only")


def extension_runs_on_gpu() -> bool:
    """vtoken._C's CUDA kernels can run on this machine's GPU (``False`` without one).

    The gpu tests that call its CUDA kernels directly leave them out otherwise
    (e.g. a CUDA 13 build under an older driver); vtoken.device.ops warns with the cause.
    """
    from vtoken.device import ops

    return torch.cuda.is_available() and ops.extension_loaded() and ops.extension_runs_on(torch.device("cuda"))
