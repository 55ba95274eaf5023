"""Error types and the one tensor-validation helper of the kernel contracts.

``vtoken_kernels`` imports nothing from ``vtoken``; ``vtoken.errors`` re-exports
these classes, so an error raised by a kernel contract is the same type the
rest of vtoken raises. Messages read "<arg>: expected X, got Y".
"""
from __future__ import annotations

import os


class VTokenError(Exception):
    """Base class of every error vtoken raises on purpose."""


class InvalidArgumentError(VTokenError, ValueError):
    """A value outside its contract (range, uniqueness, liveness, ownership)."""


class InvalidTypeError(VTokenError, TypeError):
    """A wrong dtype, shape or Python type."""


def debug_checks_enabled() -> bool:
    """True when ``VTOKEN_DEBUG_INVARIANTS`` is set to anything but empty or ``0``.

    The one switch for the expensive checks: kernel-argument content checks and
    the runtime invariants (I1, I2, I4). They read tensor contents, which is a
    host sync on a GPU, so they are off by default (the test suite turns them on).
    """
    return os.environ.get("VTOKEN_DEBUG_INVARIANTS", "") not in ("", "0")


def check_tensor(arg: str, t, *, dtype=None, ndim=None, shape=None, device=None):
    """Validate a torch tensor: "expected X, got Y" errors naming ``arg``."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"{arg}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, (tuple, list)) else (dtype,)
        if t.dtype not in allowed:
            raise InvalidTypeError(f"{arg}: expected dtype in {list(allowed)}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise InvalidTypeError(f"{arg}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        if len(shape) != t.dim() or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            raise InvalidTypeError(f"{arg}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if device is not None and t.device != torch.device(device):
        raise InvalidArgumentError(f"{arg}: expected device {device}, got {t.device}")
    return t
