"""The dependency versions vtoken supports, checked at run time.

torch >= 2.11 is required: :mod:`vtoken.device.ops` checks it when imported and
raises :class:`~vtoken.errors.UnsupportedVersionError` otherwise. Triton >= 3.6
is optional (CPU torch wheels do not pull it in): without it, or with an older
one, the Triton backend is unavailable and :mod:`vtoken.device.ops` dispatches to the
extension or the torch reference instead, saying why once.
"""
from __future__ import annotations

import functools
import importlib.util
import re

from vtoken.errors import UnsupportedVersionError

MIN_TORCH = (2, 11)
MIN_TRITON = (3, 6)


def parse_version(version: str) -> tuple[int, int]:
    """``"2.11.0+cu130"`` -> ``(2, 11)``: the release's major and minor numbers."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise UnsupportedVersionError(f"version: expected 'MAJOR.MINOR...', got {version!r}")
    return int(m.group(1)), int(m.group(2))


def _dotted(v: tuple[int, int]) -> str:
    return ".".join(map(str, v))


def check_torch(version: str) -> None:
    """Raise :class:`UnsupportedVersionError` when torch ``version`` is older than :data:`MIN_TORCH`."""
    if parse_version(version) < MIN_TORCH:
        raise UnsupportedVersionError(f"torch: expected >= {_dotted(MIN_TORCH)}, got {version}")


def triton_problem(version: str | None) -> str | None:
    """Why Triton ``version`` (``None``: not installed) cannot serve as a backend, or ``None`` when it can."""
    if version is None:
        return "Triton is not installed (pip install 'triton>=3.6')"
    if parse_version(version) < MIN_TRITON:
        return f"Triton: expected >= {_dotted(MIN_TRITON)}, got {version}"
    return None


@functools.lru_cache(maxsize=1)
def installed_triton_problem() -> str | None:
    """:func:`triton_problem` of the installed Triton (imported once, only if present)."""
    if importlib.util.find_spec("triton") is None:
        return triton_problem(None)
    import triton

    return triton_problem(triton.__version__)
