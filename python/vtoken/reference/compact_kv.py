"""Torch reference of ``compact_kv``.

``compact_kv`` relocates live tokens inside the paged KV caches of every layer:
for each move ``m`` it copies the rows of slot ``src_slots[m]`` (K and V of
every head, or MLA's latent row) to slot ``dst_slots[m]``, in every layer's
cache tensor. All layers share one :class:`~vtoken.layout.KVLayout` (same
shape, strides and dtype). The copy is bit-exact for every dtype (fp16, bf16,
fp32, fp8, uint8 / int8 fp8 storage): it moves the bit patterns as integers,
NaN payloads included.

Slot contract:

* ``src_slots`` / ``dst_slots`` are int32 ``[M]``. A move whose source or
  destination is PAD (``-1``) is skipped, so a fixed-size buffer padded with
  PAD can be replayed in a CUDA graph.
* The destinations of the non-skipped moves are unique and disjoint from their
  sources (no move reads a slot another move writes). Backends copy moves in
  parallel and rely on this; the result of a violating call is unspecified.
* Slots are in ``[-1, num_blocks * block_size)``.

:func:`vtoken_kernels.contracts.check_compact_kv_args` checks the arguments
once, at the op boundary (:func:`vtoken.device.ops.compact_kv`): the structure
always, the slot contract only with ``validate=True``, or ``validate=None``
and ``VTOKEN_DEBUG_INVARIANTS=1``, because it synchronizes with the device. A
rejected call raises :class:`~vtoken.errors.InvalidArgumentError` before
touching any cache. Without the slot check, every backend skips a move with
an out-of-range slot (it never writes outside the caches) but a contract
violation is not detected. This reference does not check its arguments again.
"""
from __future__ import annotations

import torch

from vtoken.layout import KVLayout
from vtoken_kernels.contracts import int_view


def token_element_offsets(layout: KVLayout, slots: torch.Tensor) -> torch.Tensor:
    """int64 ``[len(slots), rows_per_token * head_dim]``: element offsets of each slot's rows.

    Straight from the KVLayout addressing formula (module docstring of
    :mod:`vtoken_kernels.layout`), with no merging of contiguous dims.
    """
    dev = slots.device
    kv = torch.arange(layout.num_kv, device=dev)[:, None]
    head = torch.arange(layout.num_heads, device=dev)[None, :]
    row_starts = (kv * layout.stride_kv + head * layout.stride_head).reshape(-1)
    elems = (row_starts[:, None] + torch.arange(layout.head_dim, device=dev)[None, :]).reshape(-1)
    block, offset = slots // layout.block_size, slots % layout.block_size
    return (block * layout.stride_block + offset * layout.stride_offset)[:, None] + elems[None, :]


def compact_kv(kv_caches, layout: KVLayout, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Reference ``compact_kv`` (in place): per layer, gather every source row, then scatter.

    Same arguments as :func:`vtoken.device.ops.compact_kv` (without ``validate``),
    already checked by the contract. Works on a flat view of each layer's
    elements with ``index_select`` / ``index_copy_``.
    """
    src, dst = src_slots.long(), dst_slots.long()
    n = layout.num_slots
    keep = (src >= 0) & (dst >= 0) & (src < n) & (dst < n)
    src, dst = src[keep], dst[keep]
    if src.numel() == 0:
        return
    src_idx = token_element_offsets(layout, src).reshape(-1)
    dst_idx = token_element_offsets(layout, dst).reshape(-1)
    span = int(token_element_offsets(layout, torch.tensor([n - 1])).max()) + 1
    for t in kv_caches:
        v = int_view(t)
        flat = v.as_strided((span,), (1,), v.storage_offset())
        flat.index_copy_(0, dst_idx, flat.index_select(0, src_idx))
