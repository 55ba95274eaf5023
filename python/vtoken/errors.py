"""Typed errors and the one validation helper.

User input gets ``ValueError`` / ``TypeError`` subclasses with messages of the
form "<arg>: expected X, got Y". ``assert`` is only for internal invariants.
"""
from __future__ import annotations

import numpy as np

# NOTE: the base classes, debug_checks_enabled and check_tensor live with the kernel
# contracts (vtoken_kernels never imports vtoken); re-exported here for the runtime.
from vtoken_kernels.errors import (  # noqa: F401
    InvalidArgumentError,
    InvalidTypeError,
    VTokenError,
    check_tensor,
    debug_checks_enabled,
)


class UnknownRequestError(VTokenError, KeyError):
    """A request id that is not registered."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "unknown request"


class InvariantViolation(VTokenError, AssertionError):
    """An internal invariant (I1, I2, I4, conservation) does not hold."""


_INT64_MAX = np.iinfo(np.int64).max


def as_index_array(arg: str, value, *, allow_empty: bool = True) -> np.ndarray:
    """Return ``value`` as a 1-D int64 numpy array, or raise naming ``arg``.

    Accepts Python ints sequences and integer numpy arrays; rejects floats,
    bools, multi-dimensional input and unsigned values >= 2**63 so that a
    silent cast never hides a bug.
    """
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        value = [int(value)]
    # NOTE: np.asarray turns a bytearray or memoryview into uint8 "ids" silently: text in the wrong type
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidTypeError(f"{arg}: expected integer ids (or, with a tokenizer, a str), got "
                               f"{type(value).__name__} (decode bytes to str first)")
    arr = np.asarray(value)
    if arr.size == 0:
        if not allow_empty:
            raise InvalidArgumentError(f"{arg}: expected a non-empty array, got an empty one")
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise InvalidTypeError(f"{arg}: expected an integer array, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise InvalidTypeError(f"{arg}: expected a 1-D array, got shape {tuple(arr.shape)}")
    # NOTE: a uint64 above int64's max would wrap to a negative id in the cast below, and
    # the caller's range check would then report the wrapped value instead of the real one.
    if arr.dtype == np.uint64 and arr.max() > _INT64_MAX:
        raise InvalidArgumentError(f"{arg}: expected ids < 2**63, got {arr[arr > _INT64_MAX][:8].tolist()}")
    return arr.astype(np.int64, copy=False)


def is_int(value) -> bool:
    """A Python or numpy integer, and not a bool (``True`` is never a count)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(arg: str, value, *, min_value: int = 0, max_value=None) -> int:
    """Return ``value`` as an int in ``[min_value, max_value]``, or raise naming ``arg``.

    Bools and floats are rejected with :class:`InvalidTypeError`; an int out of
    range with :class:`InvalidArgumentError`.
    """
    if not is_int(value):
        raise InvalidTypeError(f"{arg}: expected an int >= {min_value}, got {type(value).__name__} {value!r}")
    if value < min_value or (max_value is not None and value > max_value):
        bound = f"in [{min_value}, {max_value}]" if max_value is not None else f">= {min_value}"
        raise InvalidArgumentError(f"{arg}: expected an int {bound}, got {int(value)}")
    return int(value)


def _equal_to_itself(value) -> bool:
    # NOTE: tuple equality compares items by identity first, so (nan,) == (nan,) holds for one
    # object while a dict lookup with an equal-looking copy misses; look inside containers.
    if isinstance(value, (tuple, frozenset)):
        return all(_equal_to_itself(v) for v in value)
    try:
        return bool(value == value)
    except Exception:  # an __eq__ that raises (e.g. a signaling Decimal NaN) is no usable key either
        return False


def check_request_id(arg: str, value):
    """Return ``value`` if it can key a request: hashable and equal to itself (no NaN, also
    inside a tuple); raise naming ``arg`` otherwise."""
    try:
        hash(value)
    except TypeError:
        raise InvalidArgumentError(f"{arg}: expected a hashable request id, got {type(value).__name__}") from None
    if not _equal_to_itself(value):
        raise InvalidArgumentError(f"{arg}: expected an id equal to itself (no NaN), got {value!r}")
    return value


def has_duplicates(a: np.ndarray) -> bool:
    """Whether ``a`` repeats a value.

    NOTE: np.unique is hash-based in numpy 2.x and several times slower than a
    sort on the small arrays of a decode step; strictly increasing input (the
    common case) costs a single comparison pass.
    """
    if len(a) < 2 or (a[1:] > a[:-1]).all():
        return False
    s = np.sort(a)
    return bool((s[1:] == s[:-1]).any())


class BackendUnavailableError(InvalidArgumentError):
    """``VTOKEN_BACKEND`` forces a backend this machine cannot run; the message names the cause."""


class UnsupportedVersionError(VTokenError, ImportError):
    """An installed dependency (torch, Triton) is older than vtoken supports (:mod:`vtoken.versions`)."""
