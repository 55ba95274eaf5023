"""A counter-based hash that numpy, torch and Python ints compute identically (Random's draw).

The Random policy ranks each unprotected token by ``token_priority(key, id)``
and evicts the lowest, with ``key = request_key(seed, step, request_seed)``.
Every operation here is ``^``, ``>>``, ``&`` and a multiply whose product
stays below 2**63 (a 32-bit value times a constant < 2**31), so the same code
runs on Python ints, numpy int64 arrays and torch int64 tensors on any device
and gives the same bits: the numpy oracle and the device path agree exactly.

Inputs are taken as 64-bit two's complement (Python ints are reduced modulo
2**64 first) and folded to 32 bits; outputs are ints in ``[0, 2**32)``.

>>> token_priority(request_key(0, 3, 7), 5) == token_priority(request_key(0, 3, 7), 5)
True
>>> import numpy as np
>>> int(token_priority(request_key(1, 2, 3), np.array([9]))[0]) == token_priority(request_key(1, 2, 3), 9)
True
"""
from __future__ import annotations

__all__ = ["fold32", "mix32", "request_key", "token_priority"]

MASK32 = 0xFFFFFFFF
# NOTE: both multipliers are odd and below 2**31, so (x < 2**32) * C < 2**63 never overflows int64.
_MUL_A = 0x7FEB352D
_MUL_B = 0x5BD1E995


def fold32(x):
    """A 64-bit value folded to 32 bits (low word XOR high word); Python ints are taken modulo 2**64."""
    if isinstance(x, int):
        x &= (1 << 64) - 1
    return (x & MASK32) ^ ((x >> 32) & MASK32)


def mix32(x):
    """A bijective 32-bit finalizer (xorshift-multiply) of ``x`` in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & MASK32
    return x ^ (x >> 16)


def request_key(seed, step, request_seed):
    """The 32-bit key of one request at one step (each argument an int, array or tensor)."""
    return mix32(fold32(seed) ^ mix32(fold32(step) ^ mix32(fold32(request_seed))))


def token_priority(key, token_ids):
    """The token's 32-bit draw under ``key``: uniform, independent of the other tokens."""
    return mix32(key ^ mix32(fold32(token_ids)))
