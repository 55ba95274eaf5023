"""Triton ``compact_kv``: copy live tokens' K/V rows of every layer in one launch.

Semantics: :mod:`vtoken.reference.compact_kv`; argument contract:
:func:`vtoken_kernels.contracts.check_compact_kv_args`. Callers normally go
through :func:`vtoken.device.ops.compact_kv`, which checks the contract once; this
launcher takes validated arguments and does not check them again.

One launch covers all layers without a device array of pointers: layer 0's
cache is the base pointer and an int64 tensor holds each layer's element
offset from it, ``(t.data_ptr() - base.data_ptr()) // element_size``. The
caches are viewed as integers of the same element size (fp16/bf16 -> int16,
fp32 -> int32, fp8/uint8 -> uint8), so the copy moves bit patterns exactly and
needs no fp8 support from the target (sm_80 has none).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from vtoken_kernels.contracts import int_view, token_rows
from vtoken_kernels.layout import KVLayout

# Elements per program tile; 4096 keeps a tile at <= 16 KiB (fp32) so a program
# is one (move, layer) pair with a handful of vector loads per thread.
_MAX_TILE = 4096
# Layer-offset tensors kept, least recently used evicted first. An engine
# relocates within one set of caches (vLLM: one per KV cache group), so a few
# entries cover it; tests and benchmarks that build many sets stay bounded.
_OFFSETS_CACHE_SIZE = 8
# NOTE: keyed by (device, the offsets themselves): an offsets tensor holds
# exactly its key's values, so caches at other addresses with the same relative
# layout share it, and a stale entry can never hold wrong offsets.
_OFFSETS_CACHE: "collections.OrderedDict[tuple, _Offsets]" = collections.OrderedDict()
# NOTE: an entry a CUDA graph captured is never evicted: the graph reads its
# tensor at every replay. It moves here (L * 8 bytes per captured set of caches).
_CAPTURED_OFFSETS: "dict[tuple, _Offsets]" = {}
# Pinned staging of evicted entries whose H2D copy may still be in flight: (event, staging).
_RETIRED_STAGING: collections.deque = collections.deque()


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
    (an async H2D copy from pinned memory on the current stream, no host
    sync) and kept in a small LRU cache: call once before capturing a CUDA
    graph so the capture does not allocate it.
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


@dataclass
class _Offsets:
    """A cached layer-offset tensor and what orders its first use after its H2D copy."""

    tensor: torch.Tensor  # int64 [L] on the caches' device
    event: object = None  # CUDA: the H2D copy's completion (None on CPU)
    staging: object = None  # CUDA: the pinned source, alive until ``event`` completed
    streams: set = field(default_factory=set)  # CUDA streams that already wait on ``event``


def _layer_offsets(views) -> torch.Tensor:
    """int64 [L] element offsets of each layer from layer 0 (cached, bounded; no host sync)."""
    esize = views[0].element_size()
    base = views[0].data_ptr()
    device = views[0].device
    values = tuple((v.data_ptr() - base) // esize for v in views)
    key = (device, values)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    entry = _CAPTURED_OFFSETS.get(key) or _OFFSETS_CACHE.get(key)
    if entry is None:
        if capturing:
            raise RuntimeError("compact_kv: expected a call outside CUDA graph capture before capturing these "
                               "caches (it uploads their layer offsets), got the first call inside the capture")
        entry = _upload(values, device)
    if capturing:
        # NOTE: torch.cuda.graph synchronizes before capture, so the upload has completed.
        _OFFSETS_CACHE.pop(key, None)
        _CAPTURED_OFFSETS[key] = entry
    elif key not in _CAPTURED_OFFSETS:
        _OFFSETS_CACHE[key] = entry
        _OFFSETS_CACHE.move_to_end(key)
        while len(_OFFSETS_CACHE) > _OFFSETS_CACHE_SIZE:
            _retire(_OFFSETS_CACHE.popitem(last=False)[1])
        if entry.event is not None:
            _order_after_upload(entry)
    return entry.tensor


def _upload(values: tuple, device: torch.device) -> _Offsets:
    """``values`` as an int64 tensor on ``device``; on CUDA one async copy from pinned memory, current stream."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":  # CPU (Triton interpreter): the host tensor is the device tensor
        return _Offsets(host)
    _poll_retired()
    staging = host.pin_memory()
    stream = torch.cuda.current_stream(device)
    tensor = torch.empty(len(values), dtype=torch.int64, device=device)
    tensor.copy_(staging, non_blocking=True)
    event = torch.cuda.Event()
    event.record(stream)
    return _Offsets(tensor, event, staging, {stream})


def _order_after_upload(entry: _Offsets) -> None:
    """A launch on another stream than the upload's waits for the copy (enqueued once per stream, no host wait)."""
    stream = torch.cuda.current_stream(entry.tensor.device)
    if stream in entry.streams:
        return
    stream.wait_event(entry.event)
    # NOTE: the tensor was allocated on the upload stream; once evicted, the
    # allocator may reuse it there while this stream's launch still reads it.
    entry.tensor.record_stream(stream)
    entry.streams.add(stream)


def _retire(entry: _Offsets) -> None:
    """Drop an evicted entry; its pinned staging stays alive until its copy completed."""
    if entry.staging is not None and not entry.event.query():
        _RETIRED_STAGING.append((entry.event, entry.staging))
    entry.staging = None


def _poll_retired() -> None:
    """Release the retired staging buffers whose copy completed (never waits)."""
    for _ in range(len(_RETIRED_STAGING)):
        event, staging = _RETIRED_STAGING.popleft()
        if not event.query():
            _RETIRED_STAGING.append((event, staging))


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
