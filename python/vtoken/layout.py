"""KVLayout: where a token's K/V rows live inside a paged KV cache tensor.

A kernel-argument description, so it lives with the kernels in
:mod:`vtoken_kernels.layout` (which imports nothing from ``vtoken``); this
module re-exports it for the runtime, so ``from vtoken.layout import KVLayout,
kv_cache_shape`` keeps working.

Example::

    >>> import torch
    >>> from vtoken.layout import KVLayout, kv_cache_shape
    >>> cache = torch.zeros(kv_cache_shape("nhd", 4, 16, 2, 64))
    >>> lay = KVLayout.from_tensor(cache, "nhd")
    >>> lay.num_slots, lay.rows_per_token, lay.stride_offset
    (64, 4, 128)
"""
from __future__ import annotations

from vtoken_kernels.layout import LAYOUT_NAMES, KVLayout, kv_cache_shape  # noqa: F401

__all__ = ["KVLayout", "LAYOUT_NAMES", "kv_cache_shape"]
