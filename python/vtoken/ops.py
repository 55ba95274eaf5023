"""The one dispatch point for vtoken's kernels.

Order of preference: the compiled extension ``vtoken._C`` (CUDA kernels on GPU
tensors, C++ kernels on CPU tensors) > Triton (on CUDA, or on CPU under
``TRITON_INTERPRET=1``) > the torch reference in :mod:`vtoken.reference`.
``VTOKEN_BACKEND=cuda|triton|torch`` forces one; a forced backend that is not
available raises instead of silently falling back.

Runtime modules call these functions, never a backend directly.
"""
from __future__ import annotations

import functools
import importlib
import os

import torch

from vtoken.errors import InvalidArgumentError

BACKENDS = ("cuda", "triton", "torch")


@functools.lru_cache(maxsize=1)
def extension_loaded() -> bool:
    """True when ``vtoken._C`` was built and registered its ``torch.ops.vtoken`` ops."""
    try:
        importlib.import_module("vtoken._C")
    except ImportError:
        return False
    return True


def has_extension_op(name: str) -> bool:
    return extension_loaded() and hasattr(torch.ops.vtoken, name)


def _triton_usable(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


def select_backend(op: str, device: torch.device, *, has_cuda_impl: bool = True) -> str:
    """Pick the backend for ``op`` on ``device`` (see module docstring)."""
    forced = os.environ.get("VTOKEN_BACKEND", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise InvalidArgumentError(f"VTOKEN_BACKEND: expected one of {BACKENDS}, got {forced!r}")
        if forced == "cuda" and not (has_cuda_impl and has_extension_op(op)):
            raise InvalidArgumentError(f"VTOKEN_BACKEND=cuda: the extension op vtoken::{op} is not available")
        if forced == "triton" and not _triton_usable(device):
            raise InvalidArgumentError("VTOKEN_BACKEND=triton: Triton needs CUDA or TRITON_INTERPRET=1")
        return forced
    if has_cuda_impl and has_extension_op(op):
        return "cuda"
    if _triton_usable(device):
        return "triton"
    return "torch"


# --- ops -----------------------------------------------------------------
# Each op below: validate in the reference/launcher, dispatch with select_backend().
