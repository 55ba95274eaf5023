"""Torch reference of ``build_slot_lists``: a batch's attention inputs from the device mirror.

The op turns the device mirror of the token tables into the attention inputs
of a batch, written in place into preallocated buffers whose addresses never
change (so a captured CUDA graph replays against them).

Mirror (inputs)
    ``slots[T]`` int32 and ``alive[T]`` int8/bool: the mirror arena. Request
    ``r`` (``0 <= r < num_reqs``, in batch order) owns
    ``[mirror_starts[r], mirror_starts[r] + num_tokens[r])``, its tokens in
    logical order; its last ``new_token_counts[r]`` tokens are new this step.
    Requests may come in any order, with gaps between their ranges (slack,
    removed requests, requests left out of the batch), as with SGLang's
    ``req_to_token`` + ``req_pool_indices``.

Buffers (outputs, overwritten in place)
    ``kv_indices[nnz_max]`` int32: every request's live slots, packed in
    logical order, request after request in batch order; the tail is PAD (-1).
    ``kv_indptr[max_reqs+1]`` int32: exclusive prefix sum of the live counts;
    entries past ``num_reqs`` repeat the total. ``slot_mapping[max_tokens]``
    int32: the new tokens' slots (PAD slots copied as they are), packed request
    after request; the tail is PAD. ``kv_pos[nnz_max]`` int32 (optional): for
    each ``kv_indices`` entry, the token's position within its request (its
    logical token id), PAD in the tail; the token sits at mirror position
    ``mirror_starts[r] + kv_pos[j]``.

Contract and overflow behaviour: :mod:`vtoken_kernels.contracts` (section
``build_slot_lists``). Entries past a buffer's capacity are dropped and
``kv_indptr`` saturates at ``nnz_max``. This reference does not validate (the
caller, :func:`vtoken.device.ops.build_slot_lists`, does); it never syncs with the
host, so it can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch

from vtoken import PAD_SLOT

PAD = PAD_SLOT


def clamped_ranges(mirror_starts, num_tokens, new_token_counts, n: int, T: int):
    """int64 ``(start, length, k)`` of the first ``n`` requests, clamped into ``[0, T)`` like the kernels."""
    start = mirror_starts[:n].to(torch.int64).clamp(0, T)
    length = torch.minimum(num_tokens[:n].to(torch.int64).clamp(min=0), T - start)
    k = torch.minimum(new_token_counts[:n].to(torch.int64).clamp(min=0), length)
    return start, length, k


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x.new_zeros(1), torch.cumsum(x, 0)])


def _scatter(dst: torch.Tensor, where: torch.Tensor, values: torch.Tensor) -> None:
    """``dst[where[i]] = values[i]`` for ``where[i] < len(dst)``, PAD elsewhere (sync-free)."""
    cap = dst.numel()
    out = torch.full((cap + 1,), PAD, dtype=torch.int32, device=dst.device)
    out.scatter_(0, where.clamp(max=cap), values.to(torch.int32))
    dst.copy_(out[:cap])


def build_slot_lists(
    slots, alive, mirror_starts, num_tokens, new_token_counts, kv_indices, kv_indptr, slot_mapping,
    kv_pos=None, num_reqs=None,
) -> None:
    """Rebuild ``kv_indices`` / ``kv_indptr`` / ``slot_mapping`` (and ``kv_pos``) in place (see module docstring)."""
    n = mirror_starts.numel() if num_reqs is None else num_reqs
    T = slots.numel()
    dev = slots.device
    nnz_max = kv_indices.numel()
    start, length, k = clamped_ranges(mirror_starts, num_tokens, new_token_counts, n, T)
    end = start + length
    if n == 0:
        for t in (kv_indices, slot_mapping) + (() if kv_pos is None else (kv_pos,)):
            t.fill_(PAD)
        kv_indptr.zero_()
        return
    # Owner of every mirror position: the last non-empty range starting at or before it
    # (ranges do not overlap); empty ranges sort first (key -1) and own nothing.
    pos = torch.arange(T, device=dev, dtype=torch.int64)
    by_start, order = torch.sort(torch.where(length > 0, start, -1), stable=True)
    r = order[(torch.searchsorted(by_start, pos, right=True) - 1).clamp(min=0)]
    in_batch = (pos >= start[r]) & (pos < end[r])
    live = in_batch & (alive != 0)
    # Live tokens go to indptr[r] + (live tokens of r before them), in batch order.
    live_count = torch.zeros(n, dtype=torch.int64, device=dev).index_add_(0, r, live.to(torch.int64))
    indptr = _exclusive_cumsum(live_count)
    live_before = _exclusive_cumsum(live.to(torch.int64))  # live_before[p] = live positions in [0, p)
    dst = torch.where(live, indptr[r] + live_before[pos] - live_before[start[r]], nnz_max)
    _scatter(kv_indices, dst, slots)
    if kv_pos is not None:
        _scatter(kv_pos, dst, pos - start[r])
    saturated = indptr.clamp(max=nnz_max).to(torch.int32)
    kv_indptr[: n + 1].copy_(saturated)
    kv_indptr[n + 1 :].copy_(saturated[n:].expand(kv_indptr.numel() - n - 1))
    # New tokens: the last k_r of each range, packed in batch order.
    first_new = end[r] - k[r]
    is_new = in_batch & (pos >= first_new)
    _scatter(slot_mapping, torch.where(is_new, _exclusive_cumsum(k)[r] + pos - first_new, slot_mapping.numel()), slots)
