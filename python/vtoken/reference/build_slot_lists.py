"""Torch reference of ``build_slot_lists`` and ``append_slot_lists``.

These two ops turn the device mirror of the token tables into the attention
inputs of a batch, written in place into preallocated buffers whose addresses
never change (so a captured CUDA graph replays against them).

Mirror (inputs)
    ``slots[T]`` int32 and ``alive[T]`` int8/bool are the concatenation over
    the batch's requests of each request's per-token slot and alive bit, in
    logical order. ``mirror_offsets[max_reqs'+1]`` (int32/int64) delimits them:
    request ``r`` owns ``[mirror_offsets[r], mirror_offsets[r+1])``; only the
    first ``num_reqs`` requests are used. ``new_token_counts[>= num_reqs]``
    (int32/int64) says how many of each request's last tokens are new this step.

Buffers (outputs, overwritten in place)
    ``kv_indices[nnz_max]`` int32: every request's live slots, packed, in
    logical order, request after request; the unused tail is PAD (-1).
    ``kv_indptr[max_reqs+1]`` int32: exclusive prefix sum of the live counts;
    entries past ``num_reqs`` repeat the total. ``slot_mapping[max_tokens]``
    int32: the new tokens' slots (PAD slots copied as they are), packed request
    after request; the unused tail is PAD.

Contract (what the caller guarantees)
    * offsets are non-decreasing, ``0 <= offsets[0]``, ``offsets[num_reqs] <= T``;
      ``0 <= new_token_counts[r] <= len(r)``; alive tokens carry a real slot.
    * Capacity: total live ``<= nnz_max`` and total new ``<= max_tokens``.
      NOTE: checking capacity needs the totals on the host (a device sync), so
      the kernels never check it. They never write out of bounds: on overflow
      the entries past the capacity are dropped and ``kv_indptr`` saturates at
      ``nnz_max`` (attention then never reads past the buffer, but the batch
      is truncated). :func:`validate_slot_list_args` checks the whole contract
      on the host when the tensors are on the CPU (free) or under
      ``VTOKEN_DEBUG_INVARIANTS=1`` (outside CUDA-graph capture), and raises
      before anything is written.

Append-only fast path (``append_slot_lists``)
    Precondition: the buffers hold the result of a build over the same requests
    (in the same order, possibly followed by new requests) and since then each
    request only appended its last ``new_token_counts[r]`` tokens: no eviction,
    no move, no removed request. The result is bit-identical to a full rebuild.
    Each request's old segment shifts right by the number of live tokens that
    requests before it appended, and its own appended live slots follow it.
    The old tail of ``kv_indices`` is not rewritten: it was PAD and the total
    only grows.
"""
from __future__ import annotations

import torch

from vtoken import PAD_SLOT
from vtoken.errors import InvalidArgumentError, InvalidTypeError, check_tensor, debug_checks_enabled

PAD = PAD_SLOT
ALIVE_DTYPES = (torch.int8, torch.bool)
OFFSET_DTYPES = (torch.int32, torch.int64)
INT32_LIMIT = 2**31 - 1


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_1d(arg: str, t, dtype, device) -> None:
    check_tensor(arg, t, dtype=dtype, ndim=1, device=device)
    if not t.is_contiguous():
        raise InvalidArgumentError(f"{arg}: expected a contiguous tensor, got strides {tuple(t.stride())}")
    if t.numel() > INT32_LIMIT:
        raise InvalidArgumentError(f"{arg}: expected fewer than 2**31 elements, got {t.numel()}")


def _check_slots_alive(slots, alive) -> torch.device:
    """The token mirror's ``slots`` (int32) and ``alive`` (int8 / bool): 1-D, contiguous, same length and device."""
    check_tensor("slots", slots, dtype=torch.int32, ndim=1)
    device = slots.device
    _check_1d("slots", slots, torch.int32, device)
    _check_1d("alive", alive, ALIVE_DTYPES, device)
    if alive.numel() != slots.numel():
        raise InvalidTypeError(f"alive: expected shape ({slots.numel()},) like slots, got {tuple(alive.shape)}")
    return device


def validate_slot_list_args(
    slots, alive, mirror_offsets, new_token_counts, kv_indices, kv_indptr, slot_mapping,
    num_reqs=None, *, content_checks: bool | None = None,
) -> int:
    """Validate the arguments of ``build_slot_lists`` / ``append_slot_lists``; return ``num_reqs``.

    Dtype, shape, device and contiguity checks never read tensor contents.
    Content checks (see the module's *Contract*) read the mirror, so they run
    when it lives on the CPU (no device sync), or when ``content_checks=True``
    or ``VTOKEN_DEBUG_INVARIANTS=1``; never during CUDA-graph capture.
    ``content_checks=False`` skips them (the kernels' saturating behaviour).
    """
    device = _check_slots_alive(slots, alive)
    _check_1d("mirror_offsets", mirror_offsets, OFFSET_DTYPES, device)
    if mirror_offsets.numel() < 1:
        raise InvalidTypeError("mirror_offsets: expected at least 1 element (num_reqs + 1), got 0")
    if num_reqs is None:
        num_reqs = mirror_offsets.numel() - 1
    if isinstance(num_reqs, bool) or not isinstance(num_reqs, int):
        raise InvalidTypeError(f"num_reqs: expected an int or None, got {type(num_reqs).__name__}")
    if not 0 <= num_reqs <= mirror_offsets.numel() - 1:
        raise InvalidArgumentError(
            f"num_reqs: expected 0 <= num_reqs <= len(mirror_offsets) - 1 ({mirror_offsets.numel() - 1}), got {num_reqs}"
        )
    _check_1d("new_token_counts", new_token_counts, OFFSET_DTYPES, device)
    if new_token_counts.numel() < num_reqs:
        raise InvalidTypeError(
            f"new_token_counts: expected at least num_reqs ({num_reqs}) elements, got {new_token_counts.numel()}"
        )
    _check_1d("kv_indices", kv_indices, torch.int32, device)
    _check_1d("kv_indptr", kv_indptr, torch.int32, device)
    if kv_indptr.numel() < num_reqs + 1:
        raise InvalidTypeError(
            f"kv_indptr: expected at least num_reqs + 1 ({num_reqs + 1}) elements, got {kv_indptr.numel()}"
        )
    _check_1d("slot_mapping", slot_mapping, torch.int32, device)
    if content_checks is None:
        content_checks = device.type == "cpu" or debug_checks_enabled()
    if content_checks and not _capturing(device):
        _check_contents(slots, alive, mirror_offsets, new_token_counts, kv_indices, slot_mapping, num_reqs)
    return num_reqs


def _check_contents(slots, alive, mirror_offsets, new_token_counts, kv_indices, slot_mapping, n) -> None:
    """Host-side content checks (a device sync when the tensors are on a GPU)."""
    T = slots.numel()
    off = mirror_offsets[: n + 1].to("cpu", torch.int64)
    if int(off[0]) < 0:
        raise InvalidArgumentError(f"mirror_offsets: expected a first entry >= 0, got {int(off[0])}")
    if n and bool((off[1:] < off[:-1]).any()):
        raise InvalidArgumentError(f"mirror_offsets: expected a non-decreasing array, got {off.tolist()[:16]}")
    if int(off[n]) > T:
        raise InvalidArgumentError(f"mirror_offsets: expected a last entry <= len(slots) ({T}), got {int(off[n])}")
    k = new_token_counts[:n].to("cpu", torch.int64)
    lens = off[1:] - off[:-1]
    bad = (k < 0) | (k > lens)
    if bool(bad.any()):
        r = int(bad.nonzero()[0, 0])
        raise InvalidArgumentError(
            f"new_token_counts: expected 0 <= new_token_counts[r] <= the request's length, "
            f"got {int(k[r])} for request {r} of length {int(lens[r])}"
        )
    lo, hi = int(off[0]), int(off[n])
    live = alive[lo:hi].to("cpu") != 0
    live_slots = slots[lo:hi].to("cpu")[live]
    if bool((live_slots < 0).any()):
        raise InvalidArgumentError("slots: expected every alive token to have a slot >= 0, got PAD/negative slots")
    total = int(live.sum())
    if total > kv_indices.numel():
        raise InvalidArgumentError(
            f"kv_indices: expected capacity nnz_max >= the batch's live tokens ({total}), got {kv_indices.numel()}"
        )
    if int(k.sum()) > slot_mapping.numel():
        raise InvalidArgumentError(
            f"slot_mapping: expected capacity max_tokens >= the batch's new tokens ({int(k.sum())}), "
            f"got {slot_mapping.numel()}"
        )


def validate_append_precondition(slots, alive, mirror_offsets, new_token_counts, kv_indices, kv_indptr, num_reqs):
    """Check that the buffers hold a build of the mirror minus the appended tokens.

    A full host-side rebuild of the old state (a device sync and O(T) work):
    only for tests and ``VTOKEN_DEBUG_INVARIANTS=1``.
    """
    n = num_reqs
    pos, in_batch, req, is_new = _token_roles(slots, mirror_offsets, new_token_counts, n)
    old_live = (alive != 0) & in_batch & ~is_new
    prefix = torch.cat([old_live.new_zeros(1, dtype=torch.int64), torch.cumsum(old_live.to(torch.int64), 0)])
    off = mirror_offsets[: n + 1].to(torch.int64).clamp(0, slots.numel())
    want_ip = prefix[off].cpu()
    got_ip = kv_indptr[: n + 1].to("cpu", torch.int64)
    if not torch.equal(want_ip, got_ip):
        raise InvalidArgumentError(
            "kv_indptr: expected the indptr of the mirror without its appended tokens "
            f"(append precondition), got {got_ip.tolist()[:16]} instead of {want_ip.tolist()[:16]}"
        )
    want = slots[old_live].cpu()
    got = kv_indices[: want.numel()].cpu()
    if not torch.equal(want, got):
        raise InvalidArgumentError(
            "kv_indices: expected the live slots of the mirror without its appended tokens "
            "(append precondition: no eviction or move since the last build)"
        )


# --- semantics ----------------------------------------------------------------


def _token_roles(slots, mirror_offsets, new_token_counts, n):
    """Per token: position, in-batch flag, request index (clamped), is-new flag."""
    T = slots.numel()
    dev = slots.device
    pos = torch.arange(T, device=dev, dtype=torch.int64)
    off = mirror_offsets[: n + 1].to(torch.int64).clamp(0, T)
    in_batch = (pos >= off[0]) & (pos < off[n])
    if n == 0:
        return pos, in_batch, torch.zeros_like(pos), torch.zeros_like(in_batch)
    # req(i) = the r with off[r] <= i < off[r+1]
    req = torch.searchsorted(off[1:].contiguous(), pos, right=True).clamp(max=n - 1)
    lens = off[1:] - off[:-1]
    k = torch.minimum(new_token_counts[:n].to(torch.int64).clamp(min=0), lens)
    new_start = off[1:] - k
    is_new = in_batch & (pos >= new_start[req])
    return pos, in_batch, req, is_new


def _scatter_packed(dst: torch.Tensor, values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Write ``values[keep]`` packed (in order) into ``dst``, PAD after; drop past capacity.

    Sync-free: positions come from a cumsum; dropped entries go to a dummy
    element past the end. Returns the (untruncated) number kept, as a tensor.
    """
    cap = dst.numel()
    incl = torch.cumsum(keep.to(torch.int64), 0)
    where = torch.where(keep, incl - 1, cap).clamp(max=cap)
    out = torch.full((cap + 1,), PAD, dtype=torch.int32, device=dst.device)
    out.scatter_(0, where, values)
    dst.copy_(out[:cap])
    return incl


def _write_indptr(kv_indptr: torch.Tensor, values: torch.Tensor, nnz_max: int, n: int) -> None:
    values = values.clamp(max=nnz_max).to(torch.int32)
    kv_indptr[: n + 1].copy_(values)
    rest = kv_indptr.numel() - (n + 1)
    if rest:
        kv_indptr[n + 1 :].copy_(values[n:].expand(rest))


def build_slot_lists(
    slots, alive, mirror_offsets, new_token_counts, kv_indices, kv_indptr, slot_mapping,
    num_reqs=None, *, content_checks: bool | None = None,
) -> None:
    """Full rebuild of ``kv_indices`` / ``kv_indptr`` / ``slot_mapping`` (see module docstring)."""
    n = validate_slot_list_args(
        slots, alive, mirror_offsets, new_token_counts, kv_indices, kv_indptr, slot_mapping, num_reqs,
        content_checks=content_checks,
    )
    pos, in_batch, req, is_new = _token_roles(slots, mirror_offsets, new_token_counts, n)
    live = (alive != 0) & in_batch
    incl = _scatter_packed(kv_indices, slots, live)
    prefix = torch.cat([incl.new_zeros(1), incl])  # prefix[p] = live tokens in [0, p)
    off = mirror_offsets[: n + 1].to(torch.int64).clamp(0, slots.numel())
    _write_indptr(kv_indptr, prefix[off], kv_indices.numel(), n)
    _scatter_packed(slot_mapping, slots, is_new)


def append_slot_lists(
    slots, alive, mirror_offsets, new_token_counts, kv_indices, kv_indptr, slot_mapping,
    num_reqs=None, *, content_checks: bool | None = None,
) -> None:
    """Append-only update of the buffers (precondition in the module docstring).

    Same arguments as :func:`build_slot_lists`, with ``mirror_offsets`` /
    ``new_token_counts`` describing the mirror after the appends; the result
    equals a full rebuild. This reference moves through a temporary; the
    kernels move in place.
    """
    n = validate_slot_list_args(
        slots, alive, mirror_offsets, new_token_counts, kv_indices, kv_indptr, slot_mapping, num_reqs,
        content_checks=content_checks,
    )
    nnz_max = kv_indices.numel()
    pos, in_batch, req, is_new = _token_roles(slots, mirror_offsets, new_token_counts, n)
    app_live = is_new & (alive != 0)
    old_ip = kv_indptr[: n + 1].to(torch.int64).clamp(0, nnz_max)
    if n == 0:
        _write_indptr(kv_indptr, old_ip, nnz_max, n)
        _scatter_packed(slot_mapping, slots, is_new)
        return
    # a[r]: live appended tokens of r; shift[r] = sum(a[:r])
    a = torch.zeros(n, dtype=torch.int64, device=slots.device).index_add_(0, req, app_live.to(torch.int64))
    shift = torch.cat([a.new_zeros(1), torch.cumsum(a, 0)])
    new_ip = old_ip + shift
    out = torch.full((nnz_max + 1,), PAD, dtype=torch.int32, device=slots.device)
    # old entries j of request q move to j + shift[q]
    j = torch.arange(nnz_max, device=slots.device, dtype=torch.int64)
    q = torch.searchsorted(old_ip[1:].contiguous(), j, right=True).clamp(max=n - 1)
    in_old = (j >= old_ip[0]) & (j < old_ip[n])
    out.scatter_(0, torch.where(in_old, j + shift[q], nnz_max).clamp(max=nnz_max), kv_indices)
    # appended live token i of request r goes to old_ip[r+1] + shift[r] + (rank among r's appended live)
    incl = torch.cumsum(app_live.to(torch.int64), 0)
    prefix = torch.cat([incl.new_zeros(1), incl])
    off = mirror_offsets[: n + 1].to(torch.int64).clamp(0, slots.numel())
    k = torch.minimum(new_token_counts[:n].to(torch.int64).clamp(min=0), off[1:] - off[:-1])
    first_new = prefix[off[1:] - k]  # appended-live tokens before r's appended range
    rank = incl - 1 - first_new[req]
    dst = torch.where(app_live, old_ip[req + 1] + shift[req] + rank, nnz_max).clamp(max=nnz_max)
    out.scatter_(0, dst, slots)
    kv_indices.copy_(out[:nnz_max])
    _write_indptr(kv_indptr, new_ip, nnz_max, n)
    _scatter_packed(slot_mapping, slots, is_new)
