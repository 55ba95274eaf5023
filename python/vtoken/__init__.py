"""vtoken: token-level KV virtualization for paged LLM serving.

The CPU bookkeeping (``vtoken.bookkeeping.pool``, ``vtoken.bookkeeping.ledger``, ``vtoken.bookkeeping.table``) is
importable without any GPU; kernels live behind ``vtoken.device.ops``.
"""

__version__ = "0.1.0"

PAD_SLOT = -1
"""Slot sentinel meaning "no slot". Every kernel skips it."""


def cdiv(a, b):
    """Ceiling division for ints and integer numpy arrays (``-(-a // b)``)."""
    return -(-a // b)
