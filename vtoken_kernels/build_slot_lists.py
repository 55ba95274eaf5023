"""Triton ``build_slot_lists`` / ``append_slot_lists``: the batch's slot lists, in place.

Semantics, contract and argument shapes: :mod:`vtoken.reference.build_slot_lists`.
Both launchers are free of host syncs (no ``.item()``), so they can be
captured in a CUDA graph; the small workspaces they allocate come from the
caching allocator (the graph's private pool during capture).

Full rebuild (two launches)
    The batch's tokens ``[offsets[0], offsets[num_reqs])`` are contiguous in the
    mirror and already in output order, so ``kv_indices`` is a stream compaction
    of the whole range, independent of where requests start and end. The range
    is cut into ``num_spans <= 1024`` spans of ``tiles_per_span`` tiles of
    ``BLOCK`` tokens (so a long request is spread over many programs).

    1. ``_span_count_kernel``: live tokens per span.
    2. ``_build_slot_lists_kernel``, three roles by program id:
       * span programs: exclusive prefix of the span counts (one <=1024-wide
         load), then per tile a ``tl.cumsum`` gives each live token its packed
         position; the running count is carried from tile to tile;
       * request programs (``max_reqs + 1``): ``kv_indptr[r]`` = live tokens
         before ``offsets[r]`` = span prefix + the live tokens of the partial
         span (at most one span re-read, L2-hot), saturated at ``nnz_max``;
         request ``r < num_reqs`` also copies its new tokens' slots to
         ``slot_mapping`` at ``sum(new_token_counts[:r])``;
       * PAD programs: fill ``kv_indices[total:]`` and ``slot_mapping[total_new:]``.

    Traffic: alive is read twice (1 B/token each), slots once (4 B/token),
    4 B written per live token, plus one span of alive per request and the
    PAD tails. Each request program sums ``<= max_reqs`` counts: O(R^2)
    L2-resident reads in total, 1 MiB at R = 512.

Append-only fast path (two launches)
    Request ``r``'s old segment ``[o_r, o_{r+1})`` (old ``kv_indptr``) moves
    right by ``s_r`` = live tokens appended by requests before ``r``, and its
    own appended live slots land at ``o_{r+1} + s_r``. Moving in place in
    parallel has one hazard: a request's writes end before
    ``o_{r+1} + s_{r+1}``, which can overwrite the first ``s_q`` old entries of
    a later request ``q`` before ``q`` read them. So:

    1. ``_append_stage_kernel`` (one program per request): counts the live
       appended tokens, snapshots the old ``kv_indptr`` and copies each
       segment's first ``min(S_r, len_r)`` entries to a workspace, where
       ``S_r = sum(new_token_counts[:r]) >= s_r``.
    2. ``_append_place_kernel``: each request moves its segment's remaining
       entries in place, last tile first with a CTA barrier between a tile's
       load and its store (a right shift never overwrites an unread lower
       tile), then its staged head, then appends; writes ``kv_indptr`` and
       ``slot_mapping``.

    Cost: O(appended + R) when no segment has to move (only the last requests
    appended); otherwise every live entry behind the first appending request
    is read and written once (8 B), plus ``sum_r min(S_r, len_r)`` staged
    entries (about R^2/2 in decode, where every request appends one token).
    NOTE: in decode every segment but the first moves, so the append path
    moves about as many bytes as a rebuild writes; it saves reading the mirror
    (5 B per token, dead tokens included) and the count pass.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from vtoken.reference.build_slot_lists import validate_slot_list_args

BLOCK = 4096
"""Tokens per tile (16 per thread at 8 warps). Not yet tuned on a GPU."""
MAX_SPANS = 1024
"""At most this many span programs, so a span prefix is one RBLOCK-wide load."""
RBLOCK = 1024
"""Width of the loads that sum span / request counts."""
PAD_BLOCK = 16384
"""Elements of the PAD tails each PAD program covers."""
NUM_WARPS = 8

_PAD = tl.constexpr(-1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan_spans(num_tokens: int) -> tuple[int, int]:
    """``(num_spans, tiles_per_span)`` for a mirror of ``num_tokens`` tokens."""
    num_tiles = _cdiv(num_tokens, BLOCK)
    if num_tiles == 0:
        return 0, 1
    tiles_per_span = _cdiv(num_tiles, MAX_SPANS)
    return _cdiv(num_tiles, tiles_per_span), tiles_per_span


def build_slot_lists(
    slots: torch.Tensor,
    alive: torch.Tensor,
    mirror_offsets: torch.Tensor,
    new_token_counts: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_reqs: int | None = None,
    *,
    content_checks: bool | None = None,
) -> None:
    """Rebuild ``kv_indices`` / ``kv_indptr`` / ``slot_mapping`` in place (Triton).

    Shapes and dtypes: see :mod:`vtoken.reference.build_slot_lists`.
    """
    n = validate_slot_list_args(
        slots, alive, mirror_offsets, new_token_counts, kv_indices, kv_indptr, slot_mapping, num_reqs,
        content_checks=content_checks,
    )
    num_tokens = slots.numel()
    alive8 = alive.view(torch.int8)
    num_spans, tiles_per_span = plan_spans(num_tokens)
    span_counts = torch.empty(max(num_spans, 1), dtype=torch.int32, device=slots.device)
    if num_spans:
        _span_count_kernel[(num_spans,)](
            alive8, mirror_offsets, span_counts, num_tokens, n, tiles_per_span,
            BLOCK=BLOCK, num_warps=NUM_WARPS,
        )
    max_reqs = kv_indptr.numel() - 1
    nnz_max, max_tokens = kv_indices.numel(), slot_mapping.numel()
    num_pad = _cdiv(max(nnz_max, max_tokens), PAD_BLOCK)
    grid = (num_spans + max_reqs + 1 + num_pad,)
    _build_slot_lists_kernel[grid](
        slots, alive8, mirror_offsets, new_token_counts, span_counts,
        kv_indices, kv_indptr, slot_mapping,
        num_tokens, n, max_reqs, nnz_max, max_tokens, num_spans, tiles_per_span,
        BLOCK=BLOCK, RBLOCK=RBLOCK, PAD_BLOCK=PAD_BLOCK, num_warps=NUM_WARPS,
    )


def append_slot_lists(
    slots: torch.Tensor,
    alive: torch.Tensor,
    mirror_offsets: torch.Tensor,
    new_token_counts: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_reqs: int | None = None,
    *,
    content_checks: bool | None = None,
) -> None:
    """Append-only update of the buffers in place (Triton); equals a full rebuild.

    Precondition and cost: module docstring and :mod:`vtoken.reference.build_slot_lists`.
    """
    n = validate_slot_list_args(
        slots, alive, mirror_offsets, new_token_counts, kv_indices, kv_indptr, slot_mapping, num_reqs,
        content_checks=content_checks,
    )
    dev = slots.device
    num_tokens = slots.numel()
    alive8 = alive.view(torch.int8)
    max_reqs = kv_indptr.numel() - 1
    nnz_max, max_tokens = kv_indices.numel(), slot_mapping.numel()
    ws_counts = torch.empty(max(n, 1), dtype=torch.int32, device=dev)
    ws_indptr = torch.empty(n + 1, dtype=torch.int32, device=dev)
    ws_stage = torch.empty(max(nnz_max, 1), dtype=torch.int32, device=dev)
    _append_stage_kernel[(n + 1,)](
        alive8, mirror_offsets, new_token_counts, kv_indices, kv_indptr,
        ws_counts, ws_indptr, ws_stage,
        num_tokens, n, nnz_max,
        BLOCK=BLOCK, RBLOCK=RBLOCK, num_warps=NUM_WARPS,
    )
    grid = (max_reqs + 1 + _cdiv(max_tokens, PAD_BLOCK),)
    _append_place_kernel[grid](
        slots, alive8, mirror_offsets, new_token_counts, ws_counts, ws_indptr, ws_stage,
        kv_indices, kv_indptr, slot_mapping,
        num_tokens, n, max_reqs, nnz_max, max_tokens,
        BLOCK=BLOCK, RBLOCK=RBLOCK, PAD_BLOCK=PAD_BLOCK, num_warps=NUM_WARPS,
    )


# --- device helpers -------------------------------------------------------------


@triton.jit
def _sum_prefix(ptr, n, RBLOCK: tl.constexpr):
    """sum(max(ptr[0:n], 0)) as int64 (n is small: span or request counts)."""
    acc = tl.zeros([RBLOCK], dtype=tl.int64)
    for c in range(0, n, RBLOCK):
        i = c + tl.arange(0, RBLOCK)
        v = tl.load(ptr + i, mask=i < n, other=0).to(tl.int64)
        acc += tl.maximum(v, 0)
    return tl.sum(acc, axis=0)


@triton.jit
def _batch_bounds(offsets_ptr, num_reqs, num_tokens):
    """[lo, hi): the batch's tokens in the mirror, clamped to [0, num_tokens]."""
    lo = tl.load(offsets_ptr).to(tl.int64)
    lo = tl.minimum(tl.maximum(lo, 0), num_tokens)
    hi = tl.load(offsets_ptr + num_reqs).to(tl.int64)
    hi = tl.minimum(tl.maximum(hi, lo), num_tokens)
    return lo, hi


@triton.jit
def _request_range(offsets_ptr, new_counts_ptr, r, lo, hi):
    """(end, k): request r ends at ``end`` and its last ``k`` tokens are new (clamped)."""
    end = tl.load(offsets_ptr + r + 1).to(tl.int64)
    end = tl.minimum(tl.maximum(end, lo), hi)
    beg = tl.load(offsets_ptr + r).to(tl.int64)
    beg = tl.minimum(tl.maximum(beg, lo), end)
    k = tl.load(new_counts_ptr + r).to(tl.int64)
    k = tl.minimum(tl.maximum(k, 0), end - beg)
    return end, k


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
def _span_count_kernel(
    # Inputs
    alive_ptr,  # [num_tokens] int8
    offsets_ptr,  # [>= num_reqs + 1] int32 | int64
    # Outputs
    span_counts_ptr,  # [num_spans] int32
    # Constants
    num_tokens,
    num_reqs,
    tiles_per_span,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    lo, hi = _batch_bounds(offsets_ptr, num_reqs, num_tokens)
    start = pid.to(tl.int64) * tiles_per_span * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for t in range(tiles_per_span):
        idx = start + t * BLOCK + tl.arange(0, BLOCK)
        m = (idx >= lo) & (idx < hi)
        acc += (tl.load(alive_ptr + idx, mask=m, other=0) != 0).to(tl.int32)
    tl.store(span_counts_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def _append_stage_kernel(
    # Inputs
    alive_ptr,  # [num_tokens] int8
    offsets_ptr,  # [>= num_reqs + 1] int32 | int64
    new_counts_ptr,  # [>= num_reqs] int32 | int64
    kv_indices_ptr,  # [nnz_max] int32 (previous build)
    kv_indptr_ptr,  # [max_reqs + 1] int32 (previous build)
    # Outputs
    ws_counts_ptr,  # [num_reqs] int32: live appended tokens per request
    ws_indptr_ptr,  # [num_reqs + 1] int32: snapshot of the old kv_indptr
    ws_stage_ptr,  # [nnz_max] int32: staged segment heads, at their old positions
    # Constants
    num_tokens,
    num_reqs,
    nnz_max,
    BLOCK: tl.constexpr,
    RBLOCK: tl.constexpr,
):
    # Grid: (num_reqs + 1,)
    r = tl.program_id(0)
    o_r = tl.load(kv_indptr_ptr + r).to(tl.int64)
    o_r = tl.minimum(tl.maximum(o_r, 0), nnz_max)
    tl.store(ws_indptr_ptr + r, o_r.to(tl.int32))
    if r < num_reqs:
        lo, hi = _batch_bounds(offsets_ptr, num_reqs, num_tokens)
        end, k = _request_range(offsets_ptr, new_counts_ptr, r, lo, hi)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for j0 in range(0, k, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            acc += (tl.load(alive_ptr + end - k + j, mask=j < k, other=0) != 0).to(tl.int32)
        tl.store(ws_counts_ptr + r, tl.sum(acc, axis=0))
        # NOTE: S_r >= s_r (the real shift) because it also counts dead appended
        # tokens; staging the first S_r entries covers every entry an earlier
        # request can overwrite (see the module docstring).
        upper_shift = _sum_prefix(new_counts_ptr, r, RBLOCK)
        o_next = tl.load(kv_indptr_ptr + r + 1).to(tl.int64)
        o_next = tl.minimum(tl.maximum(o_next, o_r), nnz_max)
        stage = tl.minimum(upper_shift, o_next - o_r)
        for j0 in range(0, stage, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            m = j < stage
            v = tl.load(kv_indices_ptr + o_r + j, mask=m, other=_PAD)
            tl.store(ws_stage_ptr + o_r + j, v, mask=m)


@triton.jit
def _append_place_kernel(
    # Inputs
    slots_ptr,  # [num_tokens] int32
    alive_ptr,  # [num_tokens] int8
    offsets_ptr,  # [>= num_reqs + 1] int32 | int64
    new_counts_ptr,  # [>= num_reqs] int32 | int64
    ws_counts_ptr,  # [num_reqs] int32 (from _append_stage_kernel)
    ws_indptr_ptr,  # [num_reqs + 1] int32 (from _append_stage_kernel)
    ws_stage_ptr,  # [nnz_max] int32 (from _append_stage_kernel)
    # Outputs
    kv_indices_ptr,  # [nnz_max] int32, updated in place
    kv_indptr_ptr,  # [max_reqs + 1] int32
    slot_mapping_ptr,  # [max_tokens] int32
    # Constants
    num_tokens,
    num_reqs,
    max_reqs,
    nnz_max,
    max_tokens,
    BLOCK: tl.constexpr,
    RBLOCK: tl.constexpr,
    PAD_BLOCK: tl.constexpr,
):
    # Grid: (max_reqs + 1 + cdiv(max_tokens, PAD_BLOCK),)
    pid = tl.program_id(0)
    if pid <= max_reqs:
        r = pid
        rr = tl.minimum(r, num_reqs)
        shift = _sum_prefix(ws_counts_ptr, rr, RBLOCK)
        o_r = tl.load(ws_indptr_ptr + rr).to(tl.int64)
        tl.store(kv_indptr_ptr + r, tl.minimum(o_r + shift, nnz_max).to(tl.int32))
        if r < num_reqs:
            o_next = tl.maximum(tl.load(ws_indptr_ptr + r + 1).to(tl.int64), o_r)
            upper_shift = _sum_prefix(new_counts_ptr, r, RBLOCK)
            stage = tl.minimum(upper_shift, o_next - o_r)
            if shift > 0:
                # Unstaged part [o_r + stage, o_next): in place, last tile first.
                for t in range(0, o_next - o_r - stage, BLOCK):
                    idx = o_next - t - BLOCK + tl.arange(0, BLOCK)
                    m = idx >= o_r + stage
                    v = tl.load(kv_indices_ptr + idx, mask=m, other=_PAD)
                    # NOTE: within a tile, a thread's store can land on an
                    # element another warp has not loaded yet (shift < BLOCK).
                    tl.debug_barrier()
                    dst = idx + shift
                    tl.store(kv_indices_ptr + dst, v, mask=m & (dst < nnz_max))
                # Staged head [o_r, o_r + stage).
                for j0 in range(0, stage, BLOCK):
                    j = j0 + tl.arange(0, BLOCK)
                    m = j < stage
                    v = tl.load(ws_stage_ptr + o_r + j, mask=m, other=_PAD)
                    dst = o_r + j + shift
                    tl.store(kv_indices_ptr + dst, v, mask=m & (dst < nnz_max))
            lo, hi = _batch_bounds(offsets_ptr, num_reqs, num_tokens)
            end, k = _request_range(offsets_ptr, new_counts_ptr, r, lo, hi)
            base = o_next + shift
            for j0 in range(0, k, BLOCK):
                j = j0 + tl.arange(0, BLOCK)
                src = end - k + j
                live = (tl.load(alive_ptr + src, mask=j < k, other=0) != 0).to(tl.int32)
                dst = base + tl.cumsum(live, axis=0) - live
                keep = (live != 0) & (dst < nnz_max)
                tl.store(kv_indices_ptr + dst, tl.load(slots_ptr + src, mask=keep, other=_PAD), mask=keep)
                base += tl.sum(live, axis=0)
            _copy_new_slots(slots_ptr, slot_mapping_ptr, end - k, upper_shift, k, max_tokens, BLOCK)
    else:
        total_new = tl.minimum(_sum_prefix(new_counts_ptr, num_reqs, RBLOCK), max_tokens)
        start = (pid - max_reqs - 1).to(tl.int64) * PAD_BLOCK
        _fill_pad(slot_mapping_ptr, total_new, max_tokens, start, BLOCK, PAD_BLOCK)


@triton.jit
def _build_slot_lists_kernel(
    # Inputs
    slots_ptr,  # [num_tokens] int32
    alive_ptr,  # [num_tokens] int8
    offsets_ptr,  # [>= num_reqs + 1] int32 | int64
    new_counts_ptr,  # [>= num_reqs] int32 | int64
    span_counts_ptr,  # [num_spans] int32 (from _span_count_kernel)
    # Outputs
    kv_indices_ptr,  # [nnz_max] int32
    kv_indptr_ptr,  # [max_reqs + 1] int32
    slot_mapping_ptr,  # [max_tokens] int32
    # Constants
    num_tokens,
    num_reqs,
    max_reqs,
    nnz_max,
    max_tokens,
    num_spans,
    tiles_per_span,
    BLOCK: tl.constexpr,
    RBLOCK: tl.constexpr,
    PAD_BLOCK: tl.constexpr,
):
    # Grid: (num_spans + max_reqs + 1 + cdiv(max(nnz_max, max_tokens), PAD_BLOCK),)
    pid = tl.program_id(0)
    lo, hi = _batch_bounds(offsets_ptr, num_reqs, num_tokens)
    if pid < num_spans:
        # Span program: pack the span's live slots after those of earlier spans.
        base = _sum_prefix(span_counts_ptr, pid, RBLOCK)
        start = pid.to(tl.int64) * tiles_per_span * BLOCK
        for t in range(tiles_per_span):
            idx = start + t * BLOCK + tl.arange(0, BLOCK)
            m = (idx >= lo) & (idx < hi)
            live = (tl.load(alive_ptr + idx, mask=m, other=0) != 0).to(tl.int32)
            dst = base + tl.cumsum(live, axis=0) - live
            keep = (live != 0) & (dst < nnz_max)
            tl.store(kv_indices_ptr + dst, tl.load(slots_ptr + idx, mask=keep, other=_PAD), mask=keep)
            base += tl.sum(live, axis=0)
    elif pid <= num_spans + max_reqs:
        # Request program: kv_indptr[r], then request r's new slots.
        r = pid - num_spans
        p = tl.load(offsets_ptr + tl.minimum(r, num_reqs)).to(tl.int64)
        p = tl.minimum(tl.maximum(p, lo), hi)
        span_tokens = tiles_per_span * BLOCK
        span = p // span_tokens
        live_before = _sum_prefix(span_counts_ptr, span, RBLOCK)
        seg = span * span_tokens
        for t in range(tiles_per_span):
            idx = seg + t * BLOCK + tl.arange(0, BLOCK)
            m = (idx >= lo) & (idx < p)
            live_before += tl.sum((tl.load(alive_ptr + idx, mask=m, other=0) != 0).to(tl.int32), axis=0)
        tl.store(kv_indptr_ptr + r, tl.minimum(live_before, nnz_max).to(tl.int32))
        if r < num_reqs:
            end, k = _request_range(offsets_ptr, new_counts_ptr, r, lo, hi)
            base = _sum_prefix(new_counts_ptr, r, RBLOCK)
            _copy_new_slots(slots_ptr, slot_mapping_ptr, end - k, base, k, max_tokens, BLOCK)
    else:
        # PAD program: the unused tails.
        start = (pid - num_spans - max_reqs - 1).to(tl.int64) * PAD_BLOCK
        total = tl.minimum(_sum_prefix(span_counts_ptr, num_spans, RBLOCK), nnz_max)
        _fill_pad(kv_indices_ptr, total, nnz_max, start, BLOCK, PAD_BLOCK)
        total_new = tl.minimum(_sum_prefix(new_counts_ptr, num_reqs, RBLOCK), max_tokens)
        _fill_pad(slot_mapping_ptr, total_new, max_tokens, start, BLOCK, PAD_BLOCK)
