"""Triton ``compact_kv``: copy live tokens' K/V rows of every layer in one launch.

Semantics: :mod:`vtoken.reference.compact_kv`; argument contract:
:func:`vtoken_kernels.contracts.check_compact_kv_args`. Callers normally go
through :func:`vtoken.ops.compact_kv`, which checks the contract once; this
launcher takes validated arguments and does not check them again.

One launch covers all layers without a device array of pointers: layer 0's
cache is the base pointer and an int64 tensor holds each layer's element
offset from it, ``(t.data_ptr() - base.data_ptr()) // element_size``. The
caches are viewed as integers of the same element size (fp16/bf16 -> int16,
fp32 -> int32, fp8/uint8 -> uint8), so the copy moves bit patterns exactly and
needs no fp8 support from the target (sm_80 has none).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vtoken_kernels.contracts import int_view, token_rows
from vtoken_kernels.layout import KVLayout

# Elements per program tile; 4096 keeps a tile at <= 16 KiB (fp32) so a program
# is one (move, layer) pair with a handful of vector loads per thread.
_MAX_TILE = 4096
# NOTE: entries are never evicted. A CUDA graph that captured a launch reads
# its offsets tensor at every replay, so freeing it would corrupt the replay;
# an entry is L * 8 bytes per distinct set of cache addresses.
_OFFSETS_CACHE: dict = {}


def compact_kv(kv_caches, layout: KVLayout, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Relocate tokens ``src_slots[m] -> dst_slots[m]`` in every layer's cache, in place.

    Parameters
    ----------
    kv_caches : list[torch.Tensor]
        One cache tensor per layer, all with the same shape, strides and dtype,
        described by ``layout``.
    layout : vtoken_kernels.layout.KVLayout
        Where a slot's rows live in each tensor.
    src_slots, dst_slots : torch.Tensor
        int32 ``[M]`` on the caches' device; PAD (-1) skips a move, and so
        does an out-of-range slot (never a write outside the caches).

    NOTE: the layer-offset tensor is built once per set of cache addresses
    (an H2D copy) and kept: call once before capturing a CUDA graph so the
    capture does not allocate it.
    """
    num_moves = src_slots.numel()
    if num_moves == 0:
        return
    args, constexprs, options = _launch_args(kv_caches, layout, src_slots.contiguous(), dst_slots.contiguous())
    grid = (num_moves, len(kv_caches))
    _compact_kv_kernel[grid](*args, **constexprs, **options)


def _launch_args(kv_caches, layout: KVLayout, src_slots: torch.Tensor, dst_slots: torch.Tensor):
    """Positional args, constexprs and options of ``_compact_kv_kernel`` (the AOT test compiles these)."""
    views = [int_view(t) for t in kv_caches]
    rows, n_inner, stride_outer, stride_inner, row_len = token_rows(layout)
    block_d = min(triton.next_power_of_2(row_len), _MAX_TILE)
    block_r = max(1, min(triton.next_power_of_2(rows), _MAX_TILE // block_d))
    args = (
        src_slots,
        dst_slots,
        _layer_offsets(views),
        views[0],
        layout.num_slots,
        layout.block_size,
        layout.stride_block,
        layout.stride_offset,
        stride_outer,
        stride_inner,
    )
    constexprs = dict(
        ROWS=rows,
        N_INNER=n_inner,
        ROW_LEN=row_len,
        ALIGN=_common_alignment(views, layout, (stride_outer, stride_inner, row_len)),
        BLOCK_R=block_r,
        BLOCK_D=block_d,
    )
    # One 16-byte vector per thread per tile: with more threads than that,
    # Triton splits a row into narrower accesses (a 2 x 128 int16 tile on 4
    # warps compiles to 4-byte loads, on 1 warp to 16-byte loads).
    vectors = block_r * block_d * views[0].element_size() // 16
    options = {"num_warps": max(1, min(8, vectors // 32))}
    return args, constexprs, options


def _layer_offsets(views) -> torch.Tensor:
    """int64 [L] element offsets of each layer from layer 0 (cached per set of addresses)."""
    esize = views[0].element_size()
    base = views[0].data_ptr()
    key = (views[0].device, esize, tuple(v.data_ptr() for v in views))
    offsets = _OFFSETS_CACHE.get(key)
    if offsets is None:
        offsets = torch.tensor([(v.data_ptr() - base) // esize for v in views], dtype=torch.int64, device=views[0].device)
        _OFFSETS_CACHE[key] = offsets
    return offsets


def _common_alignment(views, layout: KVLayout, extra) -> int:
    """Largest power of two (elements, <= 16 bytes) dividing every row start and row length."""
    esize = views[0].element_size()
    base = views[0].data_ptr()
    values = [layout.stride_block, layout.stride_offset, *extra]
    values += [(v.data_ptr() - base) // esize for v in views]
    align = max(1, 16 // esize)
    while align > 1 and any(x % align for x in values):
        align //= 2
    return align


@triton.jit
def _compact_kv_kernel(
    # Inputs
    src_slots_ptr,  # [M] int32, PAD = -1
    dst_slots_ptr,  # [M] int32, PAD = -1
    layer_offsets_ptr,  # [L] int64, element offset of layer l's cache from cache_ptr
    # Outputs
    cache_ptr,  # layer 0's cache (same-size int view); every layer is addressed from it
    # Constants
    num_slots,  # num_blocks * block_size
    block_size,
    stride_block,  # elements
    stride_offset,  # elements
    stride_outer,  # elements, row r // N_INNER
    stride_inner,  # elements, row r % N_INNER
    ROWS: tl.constexpr,  # rows per token
    N_INNER: tl.constexpr,
    ROW_LEN: tl.constexpr,  # contiguous elements per row
    ALIGN: tl.constexpr,  # every row start is a multiple of ALIGN elements
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Grid: (M, L). Program (m, l) copies move m's token rows in layer l.
    m = tl.program_id(0)
    layer = tl.program_id(1)
    s = tl.load(src_slots_ptr + m).to(tl.int64)
    d = tl.load(dst_slots_ptr + m).to(tl.int64)
    # NOTE: a PAD / out-of-range move masks every access (zero rows) instead
    # of returning early, so a padded buffer costs no memory traffic.
    valid = (s >= 0) & (d >= 0) & (s < num_slots) & (d < num_slots)
    s = tl.where(valid, s, 0)
    d = tl.where(valid, d, 0)
    num_rows = tl.where(valid, ROWS, 0)
    layer_off = tl.load(layer_offsets_ptr + layer)
    src_base = layer_off + (s // block_size) * stride_block + (s % block_size) * stride_offset
    dst_base = layer_off + (d // block_size) * stride_block + (d % block_size) * stride_offset
    for r0 in range(0, ROWS, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_off = (rows // N_INNER).to(tl.int64) * stride_outer + (rows % N_INNER).to(tl.int64) * stride_inner
        src_row = tl.multiple_of(src_base + row_off, ALIGN)
        dst_row = tl.multiple_of(dst_base + row_off, ALIGN)
        for c0 in range(0, ROW_LEN, BLOCK_D):
            cols = c0 + tl.arange(0, BLOCK_D)
            mask = (rows < num_rows)[:, None] & (cols < ROW_LEN)[None, :]
            x = tl.load(cache_ptr + src_row[:, None] + cols[None, :], mask=mask)
            tl.store(cache_ptr + dst_row[:, None] + cols[None, :], x, mask=mask)
