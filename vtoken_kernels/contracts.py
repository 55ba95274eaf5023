"""Argument contracts of the kernels: typed "expected X, got Y" errors, raised before any write.

Every launcher in :mod:`vtoken.ops` validates here once, then dispatches to a
backend that does not validate again. Checks of dtype, shape, device and
contiguity never read tensor contents. Content checks do (a device sync on a
GPU), so they run when the tensors are on the CPU, or under
``VTOKEN_DEBUG_INVARIANTS=1``, and never during CUDA-graph capture.

``vtoken_kernels`` imports nothing from ``vtoken``.
"""
from __future__ import annotations

import torch

from vtoken_kernels.errors import InvalidArgumentError, InvalidTypeError, check_tensor, debug_checks_enabled

# --- build_slot_lists ---
#
# Inputs
#   slots[T] int32, alive[T] int8/bool: the device mirror arena.
#   mirror_starts[>= num_reqs] int64: request r's tokens begin at mirror_starts[r].
#   num_tokens[>= num_reqs] int32/int64: request r's token count n_r; its tokens
#       are slots/alive[start_r : start_r + n_r], in logical order.
#   new_token_counts[>= num_reqs] int32/int64: request r's last k_r tokens are new.
# Outputs (overwritten in place)
#   kv_indices[nnz_max] int32, kv_indptr[>= num_reqs + 1] int32,
#   slot_mapping[max_tokens] int32, kv_pos[nnz_max] int32 or None.
# Contract (the caller's)
#   * 0 <= start_r, 0 <= n_r, start_r + n_r <= T; 0 <= k_r <= n_r;
#   * the ranges of different requests never overlap (batch order is free,
#     gaps between ranges are allowed);
#   * an alive token carries a real slot (>= 0);
#   * capacity: the batch's live tokens <= nnz_max, its new tokens <= max_tokens.
# NOTE: capacity needs the totals on the host (a device sync), so the kernels
# never check it: past it they drop entries and saturate kv_indptr at nnz_max,
# never writing out of bounds. On a violated range contract they clamp every
# range into [0, T) and never write out of bounds either; the result is then
# unspecified.

SLOT_LIST_ALIVE_DTYPES = (torch.int8, torch.bool)
SLOT_LIST_COUNT_DTYPES = (torch.int32, torch.int64)
INT32_LIMIT = 2**31 - 1


def capturing(device: torch.device) -> bool:
    """True while ``device``'s current stream is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_1d(arg: str, t, dtype, device) -> None:
    """A contiguous 1-D tensor of ``dtype`` (or one of a tuple) on ``device``, with < 2**31 elements."""
    check_tensor(arg, t, dtype=dtype, ndim=1, device=device)
    if not t.is_contiguous():
        raise InvalidArgumentError(f"{arg}: expected a contiguous tensor, got strides {tuple(t.stride())}")
    if t.numel() > INT32_LIMIT:
        raise InvalidArgumentError(f"{arg}: expected fewer than 2**31 elements, got {t.numel()}")


def check_slots_alive(slots, alive) -> torch.device:
    """The mirror's ``slots`` (int32) and ``alive`` (int8 / bool): 1-D, contiguous, same length and device."""
    check_tensor("slots", slots, dtype=torch.int32, ndim=1)
    device = slots.device
    check_1d("slots", slots, torch.int32, device)
    check_1d("alive", alive, SLOT_LIST_ALIVE_DTYPES, device)
    if alive.numel() != slots.numel():
        raise InvalidTypeError(f"alive: expected shape ({slots.numel()},) like slots, got {tuple(alive.shape)}")
    return device


def validate_slot_list_args(
    slots, alive, mirror_starts, num_tokens, new_token_counts, kv_indices, kv_indptr, slot_mapping,
    kv_pos=None, num_reqs=None, *, content_checks: bool | None = None,
) -> int:
    """Validate the arguments of ``build_slot_lists``; return ``num_reqs``.

    ``num_reqs`` defaults to ``len(mirror_starts)``. ``content_checks=None``
    checks contents on the CPU or under ``VTOKEN_DEBUG_INVARIANTS=1``;
    ``True`` / ``False`` force them on / off (never during capture).
    """
    device = check_slots_alive(slots, alive)
    check_1d("mirror_starts", mirror_starts, torch.int64, device)
    if num_reqs is None:
        num_reqs = mirror_starts.numel()
    if isinstance(num_reqs, bool) or not isinstance(num_reqs, int):
        raise InvalidTypeError(f"num_reqs: expected an int or None, got {type(num_reqs).__name__}")
    if not 0 <= num_reqs <= mirror_starts.numel():
        raise InvalidArgumentError(
            f"num_reqs: expected 0 <= num_reqs <= len(mirror_starts) ({mirror_starts.numel()}), got {num_reqs}"
        )
    for arg, t in (("num_tokens", num_tokens), ("new_token_counts", new_token_counts)):
        check_1d(arg, t, SLOT_LIST_COUNT_DTYPES, device)
        if t.numel() < num_reqs:
            raise InvalidTypeError(f"{arg}: expected at least num_reqs ({num_reqs}) elements, got {t.numel()}")
    check_1d("kv_indices", kv_indices, torch.int32, device)
    check_1d("kv_indptr", kv_indptr, torch.int32, device)
    if kv_indptr.numel() < num_reqs + 1:
        raise InvalidTypeError(
            f"kv_indptr: expected at least num_reqs + 1 ({num_reqs + 1}) elements, got {kv_indptr.numel()}"
        )
    check_1d("slot_mapping", slot_mapping, torch.int32, device)
    if kv_pos is not None:
        check_1d("kv_pos", kv_pos, torch.int32, device)
        if kv_pos.numel() != kv_indices.numel():
            raise InvalidTypeError(
                f"kv_pos: expected shape ({kv_indices.numel()},) like kv_indices, got {tuple(kv_pos.shape)}"
            )
    if content_checks is None:
        content_checks = device.type == "cpu" or debug_checks_enabled()
    if content_checks and not capturing(device):
        _check_slot_list_contents(slots, alive, mirror_starts, num_tokens, new_token_counts, kv_indices,
                                  slot_mapping, num_reqs)
    return num_reqs


def _check_slot_list_contents(slots, alive, mirror_starts, num_tokens, new_token_counts, kv_indices, slot_mapping,
                              n) -> None:
    """The contract's content checks, on host copies (a device sync on a GPU)."""
    T = slots.numel()
    start = mirror_starts[:n].to("cpu", torch.int64)
    length = num_tokens[:n].to("cpu", torch.int64)
    k = new_token_counts[:n].to("cpu", torch.int64)
    end = start + length
    for bad, msg in (
        (start < 0, lambda r: f"mirror_starts: expected starts >= 0, got {int(start[r])} for request {r}"),
        (length < 0, lambda r: f"num_tokens: expected counts >= 0, got {int(length[r])} for request {r}"),
        (end > T, lambda r: f"mirror_starts: expected start + num_tokens <= len(slots) ({T}), "
                            f"got {int(start[r])} + {int(length[r])} for request {r}"),
        ((k < 0) | (k > length), lambda r: f"new_token_counts: expected 0 <= new_token_counts[r] <= num_tokens[r], "
                                           f"got {int(k[r])} for request {r} of {int(length[r])} tokens"),
    ):
        if bool(bad.any()):
            raise InvalidArgumentError(msg(int(bad.nonzero()[0, 0])))
    # Overlap: sorted by start, each non-empty range must end before the next begins.
    nonempty = (length > 0).nonzero().view(-1)
    order = nonempty[torch.argsort(start[nonempty], stable=True)]
    clash = (end[order[:-1]] > start[order[1:]]).nonzero().view(-1)
    if clash.numel():
        a, b = int(order[clash[0]]), int(order[clash[0] + 1])
        raise InvalidArgumentError(
            f"mirror_starts: expected non-overlapping token ranges, got request {a} at "
            f"[{int(start[a])}, {int(end[a])}) and request {b} at [{int(start[b])}, {int(end[b])})"
        )
    cover = torch.zeros(T + 1, dtype=torch.int64)
    cover.index_add_(0, start, torch.ones(n, dtype=torch.int64))
    cover.index_add_(0, end, torch.full((n,), -1, dtype=torch.int64))
    in_batch = torch.cumsum(cover, 0)[:T] > 0
    live = in_batch & (alive.to("cpu") != 0)
    if bool((slots.to("cpu")[live] < 0).any()):
        raise InvalidArgumentError("slots: expected every alive token of the batch to have a slot >= 0, got PAD/negative")
    total_live = int(live.sum())
    if total_live > kv_indices.numel():
        raise InvalidArgumentError(
            f"kv_indices: expected capacity nnz_max >= the batch's live tokens ({total_live}), got {kv_indices.numel()}"
        )
    total_new = int(k.sum())
    if total_new > slot_mapping.numel():
        raise InvalidArgumentError(
            f"slot_mapping: expected capacity max_tokens >= the batch's new tokens ({total_new}), "
            f"got {slot_mapping.numel()}"
        )
