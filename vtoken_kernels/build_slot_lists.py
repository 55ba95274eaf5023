"""Triton ``build_slot_lists``: a batch's slot lists from the device mirror, in place.

Semantics: :mod:`vtoken.reference.build_slot_lists`; argument contract:
:mod:`vtoken_kernels.contracts`. This launcher does not validate
(:func:`vtoken.device.ops.build_slot_lists` does, once). It is free of host syncs (no
``.item()``), so it can be captured in a CUDA graph; its small workspace comes
from the caching allocator (the graph's private pool during capture).

Request ``r`` of the batch owns the mirror range ``[start_r, start_r + n_r)``;
the ranges may come in any order with gaps between them, so the batch's
tokens are not one contiguous range of the mirror. The kernels work over the
*virtual concatenation* of the ranges in batch order instead: virtual position
``v`` in ``[vstart_r, vstart_r + n_r)`` (``vstart`` = exclusive prefix of the
``n_r``) is mirror position ``start_r + (v - vstart_r)``, and ``v - vstart_r``
is the token's logical position (``kv_pos``). In virtual order the live tokens
are already in output order, so ``kv_indices`` is one stream compaction of
``[0, L)``, ``L = sum(n_r)``, cut into equal spans whatever the request
lengths: a long request is spread over many programs.

Three launches
    1. ``_batch_prefix_kernel`` (one program): clamps every range into the
       mirror (as the reference does) and writes ``start``, ``vstart[n+1]``
       and ``kstart[n+1]`` (exclusive prefix of the new-token counts) to the
       workspace, ``RBLOCK`` requests per step with a carried ``tl.cumsum``.
    2. ``_span_count_kernel``: live tokens per span. Virtual ``[0, T)``
       (``T = len(slots) >= L`` under the contract, so the grid is fixed
       without reading ``L``) is cut into ``num_spans <= 1024`` spans of
       ``tiles_per_span`` tiles of ``BLOCK`` positions.
    3. ``_build_slot_lists_kernel``, three roles by program id:
       * span programs: exclusive prefix of the span counts (one <= 1024-wide
         load), then per tile a ``tl.cumsum`` packs the live slots (and their
         ``kv_pos``); the running count is carried from tile to tile;
       * request programs (``max_reqs + 1``): ``kv_indptr[r]`` = live tokens
         before ``vstart[r]`` = span prefix + the partial span (at most one
         span re-read, L2-hot), saturated at ``nnz_max``; request
         ``r < num_reqs`` copies its new tokens' slots to ``slot_mapping`` at
         ``kstart[r]``;
       * PAD programs: fill the tails of ``kv_indices``, ``kv_pos`` and
         ``slot_mapping``.

Virtual to mirror
    A tile first locates the requests of its first and last positions (two
    scalar binary searches over ``vstart``). When they are the same request
    (tiles inside a long request: the bulk of the bytes) every position maps
    by one subtraction; otherwise each position runs a vector binary search
    restricted to those requests (``ceil(log2(num_reqs + 1))`` steps of
    L1-resident gathers).

Traffic: alive is read twice (1 B/token each) and slots once (4 B/token) over
the batch's tokens only (gaps and left-out requests are not read), 4 B written
per live token (8 B with ``kv_pos``), plus one span per request program and
the PAD tails. The workspace is ``3 * num_reqs + num_spans`` int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096
"""Virtual positions per tile (16 per thread at 8 warps). Not yet tuned on a GPU."""
MAX_SPANS = 1024
"""At most this many span programs, so a span prefix is one RBLOCK-wide load."""
RBLOCK = 1024
"""Width of the loads that sum span counts and scan per-request counts."""
PAD_BLOCK = 16384
"""Elements of the PAD tails each PAD program covers."""
NUM_WARPS = 8

_PAD = tl.constexpr(-1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan_spans(mirror_len: int) -> tuple[int, int]:
    """``(num_spans, tiles_per_span)`` covering ``mirror_len`` virtual positions."""
    num_tiles = _cdiv(mirror_len, BLOCK)
    if num_tiles == 0:
        return 0, 1
    tiles_per_span = _cdiv(num_tiles, MAX_SPANS)
    return _cdiv(num_tiles, tiles_per_span), tiles_per_span


def build_slot_lists(
    slots: torch.Tensor,
    alive: torch.Tensor,
    mirror_starts: torch.Tensor,
    num_tokens: torch.Tensor,
    new_token_counts: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_pos: torch.Tensor | None = None,
    num_reqs: int | None = None,
) -> None:
    """Rebuild ``kv_indices`` / ``kv_indptr`` / ``slot_mapping`` (and ``kv_pos``) in place (Triton).

    Shapes and dtypes: :mod:`vtoken.reference.build_slot_lists`. Arguments
    are not validated here (see the module docstring).
    """
    n = mirror_starts.numel() if num_reqs is None else num_reqs
    dev = slots.device
    mirror_len = slots.numel()
    num_spans, tiles_per_span = plan_spans(mirror_len)
    ws = torch.empty(max(n, 1) + 2 * (n + 1) + max(num_spans, 1), dtype=torch.int64, device=dev)
    ws_start = ws[: max(n, 1)]
    ws_vstart = ws[max(n, 1) : max(n, 1) + n + 1]
    ws_kstart = ws[max(n, 1) + n + 1 : max(n, 1) + 2 * (n + 1)]
    span_counts = ws[max(n, 1) + 2 * (n + 1) :]
    # Steps of a binary search over [0, n): enough to shrink n candidates to one.
    search_iters = max(n, 1).bit_length()
    _batch_prefix_kernel[(1,)](
        mirror_starts, num_tokens, new_token_counts, ws_start, ws_vstart, ws_kstart,
        mirror_len, n, RBLOCK=RBLOCK, num_warps=4,
    )
    alive8 = alive.view(torch.int8)
    if num_spans:
        _span_count_kernel[(num_spans,)](
            alive8, ws_start, ws_vstart, span_counts,
            n, tiles_per_span, search_iters,
            BLOCK=BLOCK, num_warps=NUM_WARPS,
        )
    max_reqs = kv_indptr.numel() - 1
    nnz_max, max_tokens = kv_indices.numel(), slot_mapping.numel()
    num_pad = _cdiv(max(nnz_max, max_tokens), PAD_BLOCK)
    has_pos = kv_pos is not None
    _build_slot_lists_kernel[(num_spans + max_reqs + 1 + num_pad,)](
        slots, alive8, ws_start, ws_vstart, ws_kstart, span_counts,
        kv_indices, kv_indptr, slot_mapping, kv_pos if has_pos else kv_indices,
        n, max_reqs, nnz_max, max_tokens, num_spans, tiles_per_span, search_iters,
        HAS_POS=has_pos, BLOCK=BLOCK, RBLOCK=RBLOCK, PAD_BLOCK=PAD_BLOCK, num_warps=NUM_WARPS,
    )


# --- device helpers -------------------------------------------------------------


@triton.jit
def _sum_prefix(ptr, n, RBLOCK: tl.constexpr):
    """sum(ptr[0:n]) as int64 (n is small: at most MAX_SPANS span counts)."""
    acc = tl.zeros([RBLOCK], dtype=tl.int64)
    for c in range(0, n, RBLOCK):
        i = c + tl.arange(0, RBLOCK)
        acc += tl.load(ptr + i, mask=i < n, other=0).to(tl.int64)
    return tl.sum(acc, axis=0)


@triton.jit
def _locate(vstart_ptr, v, lo, hi, iters):
    """Per element: the largest ``r`` in ``[lo, hi)`` with ``vstart[r] <= v``.

    Needs ``vstart`` non-decreasing, ``vstart[lo] <= v`` and ``iters >=
    log2(hi - lo)``. Works on scalars and on vectors alike.
    """
    for _ in range(iters):
        active = hi - lo > 1
        mid = (lo + hi) // 2
        right = tl.load(vstart_ptr + mid, mask=active, other=0) <= v
        lo = tl.where(active & right, mid, lo)
        hi = tl.where(active & (right == 0), mid, hi)
    return lo


@triton.jit
def _tile_to_mirror(start_ptr, vstart_ptr, v0, v_end, num_reqs, search_iters, BLOCK: tl.constexpr):
    """``(mirror position, logical position, mask)`` of virtual positions ``v0 + [0, BLOCK)`` below ``v_end``."""
    v = v0 + tl.arange(0, BLOCK).to(tl.int64)
    m = v < v_end
    zero = v0 * 0
    r_first = _locate(vstart_ptr, v0, zero, zero + num_reqs, search_iters)
    last = tl.maximum(tl.minimum(v0 + BLOCK, v_end) - 1, v0)
    r_last = _locate(vstart_ptr, last, r_first, zero + num_reqs, search_iters)
    # NOTE: a tile inside one request (r_first == r_last) skips the vector search.
    iters = tl.where(r_last > r_first, search_iters, 0)
    lo = tl.zeros([BLOCK], dtype=tl.int64) + r_first
    r = _locate(vstart_ptr, v, lo, lo - r_first + r_last + 1, iters)
    logical = v - tl.load(vstart_ptr + r, mask=m, other=0)
    return tl.load(start_ptr + r, mask=m, other=0) + logical, logical, m


@triton.jit
def _copy_new_slots(slots_ptr, slot_mapping_ptr, src0, base, k, max_tokens, BLOCK: tl.constexpr):
    """slot_mapping[base + j] = slots[src0 + j] for j < k (dropped past max_tokens)."""
    for j0 in range(0, k, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        dst = base + j
        m = (j < k) & (dst < max_tokens)
        v = tl.load(slots_ptr + src0 + j, mask=m, other=_PAD)
        tl.store(slot_mapping_ptr + dst, v, mask=m)


@triton.jit
def _fill_pad(ptr, begin, end, start, BLOCK: tl.constexpr, PAD_BLOCK: tl.constexpr):
    """ptr[i] = PAD for i in [start, start + PAD_BLOCK) ∩ [begin, end)."""
    pad = tl.full([BLOCK], _PAD, dtype=tl.int32)
    for t in range(0, PAD_BLOCK, BLOCK):
        idx = start + t + tl.arange(0, BLOCK)
        tl.store(ptr + idx, pad, mask=(idx >= begin) & (idx < end))


# --- kernels (the op's own kernel last) ----------------------------------------


@triton.jit
def _batch_prefix_kernel(
    # Inputs
    starts_ptr,  # [>= num_reqs] int64
    num_tokens_ptr,  # [>= num_reqs] int32 | int64
    new_counts_ptr,  # [>= num_reqs] int32 | int64
    # Outputs
    ws_start_ptr,  # [num_reqs] int64: starts clamped into [0, mirror_len]
    ws_vstart_ptr,  # [num_reqs + 1] int64: exclusive prefix of the clamped token counts
    ws_kstart_ptr,  # [num_reqs + 1] int64: exclusive prefix of the clamped new-token counts
    # Constants
    mirror_len,
    num_reqs,
    RBLOCK: tl.constexpr,
):
    # Grid: (1,)
    carry_v = tl.full([], 0, tl.int64)
    carry_k = tl.full([], 0, tl.int64)
    tl.store(ws_vstart_ptr, carry_v)
    tl.store(ws_kstart_ptr, carry_k)
    for c in range(0, num_reqs, RBLOCK):
        i = c + tl.arange(0, RBLOCK)
        m = i < num_reqs
        s = tl.load(starts_ptr + i, mask=m, other=0).to(tl.int64)
        s = tl.minimum(tl.maximum(s, 0), mirror_len)
        n = tl.load(num_tokens_ptr + i, mask=m, other=0).to(tl.int64)
        n = tl.minimum(tl.maximum(n, 0), mirror_len - s)
        k = tl.load(new_counts_ptr + i, mask=m, other=0).to(tl.int64)
        k = tl.minimum(tl.maximum(k, 0), n)
        tl.store(ws_start_ptr + i, s, mask=m)
        tl.store(ws_vstart_ptr + i + 1, carry_v + tl.cumsum(n, axis=0), mask=m)
        tl.store(ws_kstart_ptr + i + 1, carry_k + tl.cumsum(k, axis=0), mask=m)
        carry_v += tl.sum(n, axis=0)
        carry_k += tl.sum(k, axis=0)


@triton.jit
def _span_count_kernel(
    # Inputs
    alive_ptr,  # [mirror_len] int8
    start_ptr,  # [num_reqs] int64 (from _batch_prefix_kernel)
    vstart_ptr,  # [num_reqs + 1] int64 (from _batch_prefix_kernel)
    # Outputs
    span_counts_ptr,  # [num_spans] int64
    # Constants
    num_reqs,
    tiles_per_span,
    search_iters,
    BLOCK: tl.constexpr,
):
    # Grid: (num_spans,)
    pid = tl.program_id(0)
    v_end = tl.load(vstart_ptr + num_reqs)
    span0 = pid.to(tl.int64) * tiles_per_span * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for t in range(tiles_per_span):
        mpos, logical, m = _tile_to_mirror(start_ptr, vstart_ptr, span0 + t * BLOCK, v_end, num_reqs,
                                           search_iters, BLOCK)
        acc += (tl.load(alive_ptr + mpos, mask=m, other=0) != 0).to(tl.int32)
    tl.store(span_counts_ptr + pid, tl.sum(acc, axis=0).to(tl.int64))


@triton.jit
def _build_slot_lists_kernel(
    # Inputs
    slots_ptr,  # [mirror_len] int32
    alive_ptr,  # [mirror_len] int8
    start_ptr,  # [num_reqs] int64 (from _batch_prefix_kernel)
    vstart_ptr,  # [num_reqs + 1] int64 (from _batch_prefix_kernel)
    kstart_ptr,  # [num_reqs + 1] int64 (from _batch_prefix_kernel)
    span_counts_ptr,  # [num_spans] int64 (from _span_count_kernel)
    # Outputs
    kv_indices_ptr,  # [nnz_max] int32
    kv_indptr_ptr,  # [max_reqs + 1] int32
    slot_mapping_ptr,  # [max_tokens] int32
    kv_pos_ptr,  # [nnz_max] int32 (unused unless HAS_POS)
    # Constants
    num_reqs,
    max_reqs,
    nnz_max,
    max_tokens,
    num_spans,
    tiles_per_span,
    search_iters,
    HAS_POS: tl.constexpr,
    BLOCK: tl.constexpr,
    RBLOCK: tl.constexpr,
    PAD_BLOCK: tl.constexpr,
):
    # Grid: (num_spans + max_reqs + 1 + cdiv(max(nnz_max, max_tokens), PAD_BLOCK),)
    pid = tl.program_id(0)
    # NOTE: tl.cast, not tiles_per_span.to(): on a GPU the JIT turns an int
    # argument equal to 1 (a mirror of at most MAX_SPANS * BLOCK positions)
    # into a Python constant, which has no .to() (tests/compile_lane.py).
    span_tokens = tl.cast(tiles_per_span, tl.int64) * BLOCK
    v_end = tl.load(vstart_ptr + num_reqs)
    if pid < num_spans:
        # Span program: pack the span's live slots after those of earlier spans.
        base = _sum_prefix(span_counts_ptr, pid, RBLOCK)
        span0 = pid.to(tl.int64) * span_tokens
        for t in range(tiles_per_span):
            mpos, logical, m = _tile_to_mirror(start_ptr, vstart_ptr, span0 + t * BLOCK, v_end, num_reqs,
                                               search_iters, BLOCK)
            live = (tl.load(alive_ptr + mpos, mask=m, other=0) != 0).to(tl.int32)
            dst = base + tl.cumsum(live, axis=0) - live
            keep = (live != 0) & (dst < nnz_max)
            tl.store(kv_indices_ptr + dst, tl.load(slots_ptr + mpos, mask=keep, other=_PAD), mask=keep)
            if HAS_POS:
                tl.store(kv_pos_ptr + dst, logical.to(tl.int32), mask=keep)
            base += tl.sum(live, axis=0)
    elif pid <= num_spans + max_reqs:
        # Request program: kv_indptr[r], then request r's new slots.
        r = pid - num_spans
        # NOTE: clamped to the spans' coverage: only overlapping ranges (a
        # contract violation) make the batch longer than the mirror.
        v = tl.minimum(tl.load(vstart_ptr + tl.minimum(r, num_reqs)), num_spans * span_tokens)
        span = v // span_tokens
        live_before = _sum_prefix(span_counts_ptr, span, RBLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for t in range(tiles_per_span):
            mpos, logical, m = _tile_to_mirror(start_ptr, vstart_ptr, span * span_tokens + t * BLOCK, v, num_reqs,
                                               search_iters, BLOCK)
            acc += (tl.load(alive_ptr + mpos, mask=m, other=0) != 0).to(tl.int32)
        live_before += tl.sum(acc, axis=0)
        tl.store(kv_indptr_ptr + r, tl.minimum(live_before, nnz_max).to(tl.int32))
        if r < num_reqs:
            k0 = tl.load(kstart_ptr + r)
            k = tl.load(kstart_ptr + r + 1) - k0
            end = tl.load(start_ptr + r) + tl.load(vstart_ptr + r + 1) - tl.load(vstart_ptr + r)
            _copy_new_slots(slots_ptr, slot_mapping_ptr, end - k, k0, k, max_tokens, BLOCK)
    else:
        # PAD program: the unused tails.
        start = (pid - num_spans - max_reqs - 1).to(tl.int64) * PAD_BLOCK
        total = tl.minimum(_sum_prefix(span_counts_ptr, num_spans, RBLOCK), nnz_max)
        _fill_pad(kv_indices_ptr, total, nnz_max, start, BLOCK, PAD_BLOCK)
        if HAS_POS:
            _fill_pad(kv_pos_ptr, total, nnz_max, start, BLOCK, PAD_BLOCK)
        total_new = tl.minimum(tl.load(kstart_ptr + num_reqs), max_tokens)
        _fill_pad(slot_mapping_ptr, total_new, max_tokens, start, BLOCK, PAD_BLOCK)
