"""I1 (content): a request's live tokens keep their K/V bytes across a relocation.

Per request, a hash of the ordered live token ids plus their K/V bytes in
every layer is the same before and after a relocation. The rows are read from
the caches on the host (a device sync on GPU), so only debug checks call
this: :class:`vtoken.reclamation.checks.ReclaimChecks` and the vLLM worker's
copy check. The host-only invariants (I2, I4) are in
:mod:`vtoken.bookkeeping.invariants`.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np
import torch

from vtoken.layout import KVLayout

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def gather_token_rows(cache: torch.Tensor, layout: KVLayout, slots) -> torch.Tensor:
    """The raw K/V elements of ``slots`` in one layer, ``[n, num_kv, num_heads, head_dim]``.

    Addressed through ``layout``'s strides, so every layout works; returned as
    a same-width integer view so that the comparison is bitwise (NaN payloads
    and fp8 included).
    """
    raw = cache.view(_INT_OF_SIZE[cache.element_size()])
    s = torch.as_tensor(np.asarray(slots, dtype=np.int64), device=cache.device)
    S = layout.block_size
    base = (s // S) * layout.stride_block + (s % S) * layout.stride_offset
    dev = cache.device
    kv = torch.arange(layout.num_kv, device=dev) * layout.stride_kv
    h = torch.arange(layout.num_heads, device=dev) * layout.stride_head
    d = torch.arange(layout.head_dim, device=dev)
    idx = base[:, None, None, None] + kv[None, :, None, None] + h[None, None, :, None] + d
    extent = 1 + sum((n - 1) * st for n, st in zip(raw.shape, raw.stride()))
    flat = raw.as_strided((extent,), (1,), raw.storage_offset())
    return flat[idx]


def fingerprint_rows(token_ids, rows: Sequence[torch.Tensor]) -> str:
    """I1 hash of ordered token ids plus, per layer, their gathered K/V rows."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    for r in rows:
        h.update(r.cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
