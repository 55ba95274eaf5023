"""Typed errors and the one validation helper.

User input gets ``ValueError`` / ``TypeError`` subclasses with messages of the
form "<arg>: expected X, got Y". ``assert`` is only for internal invariants.
"""
from __future__ import annotations

import os

import numpy as np


class VTokenError(Exception):
    """Base class of every error vtoken raises on purpose."""


class UnknownRequestError(VTokenError, KeyError):
    """A request id that is not registered."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "unknown request"


class InvalidArgumentError(VTokenError, ValueError):
    """A value outside its contract (range, uniqueness, liveness, ownership)."""


class InvalidTypeError(VTokenError, TypeError):
    """A wrong dtype, shape or Python type."""


class InvariantViolation(VTokenError, AssertionError):
    """An internal invariant (I1, I2, I4, conservation) does not hold."""


def debug_checks_enabled() -> bool:
    """True when ``VTOKEN_DEBUG_INVARIANTS`` is set to anything but empty or ``0``.

    The one switch for the expensive checks: kernel-argument content checks and
    the runtime invariants (I1, I2, I4). They read tensor contents, which is a
    host sync on a GPU, so they are off by default (the test suite turns them on).
    """
    return os.environ.get("VTOKEN_DEBUG_INVARIANTS", "") not in ("", "0")


def as_index_array(arg: str, value, *, allow_empty: bool = True) -> np.ndarray:
    """Return ``value`` as a 1-D int64 numpy array, or raise naming ``arg``.

    Accepts Python ints sequences and integer numpy arrays; rejects floats,
    bools and multi-dimensional input so that a silent cast never hides a bug.
    """
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        value = [int(value)]
    arr = np.asarray(value)
    if arr.size == 0:
        if not allow_empty:
            raise InvalidArgumentError(f"{arg}: expected a non-empty array, got an empty one")
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise InvalidTypeError(f"{arg}: expected an integer array, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise InvalidTypeError(f"{arg}: expected a 1-D array, got shape {tuple(arr.shape)}")
    return arr.astype(np.int64, copy=False)


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
