"""The embedded engine's paged KV cache: allocation and the slot-mapped write.

One tensor per layer, in a named :mod:`vtoken.layout` layout that carries K and
V in the same tensor (``vllm_flash``, ``vllm_fused``, ``nhd``, ``hnd``: the
layouts ``token_attention`` and ``compact_kv`` read). Attention reads it through
the token-indexed slot lists; new tokens' K/V are written through a slot
mapping with vLLM's ``reshape_and_cache`` contract (slot = ``block * S +
offset``, PAD ``-1`` rows are padding).
"""
from __future__ import annotations

import torch

from vtoken.errors import InvalidArgumentError, check_tensor
from vtoken.layout import KVLayout, kv_cache_shape
from vtoken.bookkeeping.pool import NULL_BLOCK

KV_LAYOUTS = ("vllm_flash", "vllm_fused", "nhd", "hnd")
"""Layouts the engine can run on (K and V in one tensor per layer)."""


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    layout: str = "nhd",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[list[torch.Tensor], KVLayout]:
    """Allocate one zeroed cache tensor per layer; return them with their (shared) layout.

    Block 0 is the null block (never handed out by the allocator): the write
    helper sends padding rows there, so its contents are undefined by contract.

    Example:
        >>> caches, lay = allocate_kv_caches(2, num_blocks=8, block_size=16, num_kv_heads=2, head_dim=16)
        >>> len(caches), tuple(caches[0].shape), lay.name
        (2, (8, 2, 16, 2, 16), 'nhd')
    """
    if layout not in KV_LAYOUTS:
        raise InvalidArgumentError(f"layout: expected one of {KV_LAYOUTS} (K and V in one tensor), got {layout!r}")
    if num_layers < 1:
        raise InvalidArgumentError(f"num_layers: expected >= 1, got {num_layers}")
    if num_blocks < 2:
        raise InvalidArgumentError(f"num_blocks: expected >= 2 (block 0 is the null block), got {num_blocks}")
    shape = kv_cache_shape(layout, num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    return caches, KVLayout.from_tensor(caches[0], layout)


def write_kv(
    kv_cache: torch.Tensor,
    layout: KVLayout,
    slot_mapping: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """Store new tokens' K/V at their slots (vLLM ``reshape_and_cache`` contract).

    Args:
        kv_cache: one layer's cache, described by ``layout`` (``num_kv == 2``).
        layout: its :class:`~vtoken.layout.KVLayout`.
        slot_mapping: int32 or int64 ``[T]``: row ``t`` goes to slot
            ``slot_mapping[t]``; ``-1`` (PAD) marks a padding row.
        key, value: ``[T, num_kv_heads, head_dim]``, dtype of ``kv_cache``.

    NOTE: to stay free of host syncs and of data-dependent shapes (so a CUDA
    graph can capture it), PAD rows are not filtered out: they are redirected
    to slot 0, which lies in the null block (block 0). The allocator never hands
    that block out and no slot list names it, so nothing ever reads what lands
    there. Real rows must therefore never target block 0.

    Example:
        >>> caches, lay = allocate_kv_caches(1, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=2)
        >>> k = torch.ones(2, 1, 2); v = 2 * torch.ones(2, 1, 2)
        >>> write_kv(caches[0], lay, torch.tensor([5, -1], dtype=torch.int32), k, v)
        >>> caches[0][1, :, 1].flatten().tolist()
        [1.0, 1.0, 2.0, 2.0]
    """
    num_tokens = slot_mapping.shape[0]
    shape = (num_tokens, layout.num_heads, layout.head_dim)
    check_tensor("key", key, dtype=kv_cache.dtype, shape=shape, device=kv_cache.device)
    check_tensor("value", value, dtype=kv_cache.dtype, shape=shape, device=kv_cache.device)
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), ndim=1, device=kv_cache.device)
    if layout.num_kv != 2:
        raise InvalidArgumentError(f"layout: expected num_kv == 2 (K and V in one tensor), got {layout.num_kv}")
    if num_tokens == 0:
        return
    slots = slot_mapping.to(torch.int64)
    slots = torch.where(slots >= 0, slots, torch.full_like(slots, NULL_BLOCK * layout.block_size))
    view = layout.canonical_view(kv_cache)
    rows = torch.stack((key, value), dim=1)  # [T, 2, H, D]
    view.index_put_((slots // layout.block_size, slots % layout.block_size), rows)
