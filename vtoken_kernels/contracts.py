"""Argument contracts of the kernels, one section per op.

Each ``check_*`` / ``validate_*`` function raises the typed errors of
:mod:`vtoken_kernels.errors` ("<arg>: expected X, got Y") before anything is
written. The op boundary (``vtoken.device.ops``) calls it once per call; the Triton
launchers and the torch references take validated arguments and do not check
them again. Checks that read tensor contents are a host sync on a GPU, so they
run for CPU tensors, when asked for, or under ``VTOKEN_DEBUG_INVARIANTS=1``,
and never while a CUDA graph is being captured.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from vtoken_kernels.errors import InvalidArgumentError, InvalidTypeError, check_tensor, debug_checks_enabled
from vtoken_kernels.layout import KVLayout

# --- shared ---------------------------------------------------------------------

ALIVE_DTYPES = (torch.int8, torch.bool)
INT32_LIMIT = 2**31 - 1


def capturing(device: torch.device) -> bool:
    """True while a CUDA graph is being captured on ``device`` (no host sync allowed)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_1d(arg: str, t, dtype, device) -> None:
    """A 1-D contiguous tensor of ``dtype`` on ``device`` with int32-addressable length."""
    check_tensor(arg, t, dtype=dtype, ndim=1, device=device)
    if not t.is_contiguous():
        raise InvalidArgumentError(f"{arg}: expected a contiguous tensor, got strides {tuple(t.stride())}")
    if t.numel() > INT32_LIMIT:
        raise InvalidArgumentError(f"{arg}: expected fewer than 2**31 elements, got {t.numel()}")


def check_slots_alive(slots, alive) -> torch.device:
    """The token mirror's ``slots`` (int32) and ``alive`` (int8 / bool): 1-D, contiguous, same length and device."""
    check_tensor("slots", slots, dtype=torch.int32, ndim=1)
    device = slots.device
    check_1d("slots", slots, torch.int32, device)
    check_1d("alive", alive, ALIVE_DTYPES, device)
    if alive.numel() != slots.numel():
        raise InvalidTypeError(f"alive: expected shape ({slots.numel()},) like slots, got {tuple(alive.shape)}")
    return device


def layout_extent(layout: KVLayout) -> int:
    """One past the farthest element (from the tensor's start) that ``layout`` addresses."""
    return 1 + (
        (layout.num_blocks - 1) * layout.stride_block
        + (layout.block_size - 1) * layout.stride_offset
        + (layout.num_kv - 1) * layout.stride_kv
        + (layout.num_heads - 1) * layout.stride_head
        + layout.head_dim
        - 1
    )


def check_layout_matches(layout: KVLayout, t: torch.Tensor) -> None:
    """Raise naming ``layout`` unless it describes the dims of the cache tensor ``t``.

    Every dim of ``t`` (of size > 1) must be one dim of the layout, same size
    and stride, or adjacent layout dims merged (``vllm_fused``'s last dim
    ``(2*D, stride 1)`` is kv ``(2, D)`` and dim ``(D, 1)``), and every layout
    dim must be used. NOTE: bounds alone are not enough: an ``hnd`` layout on
    an ``nhd`` cache of the same size addresses exactly the cache's elements,
    in another order, so kernels would read and move the wrong rows. Two dims
    of equal size (e.g. ``block_size == num_heads``) that swap roles leave the
    shape and strides unchanged: no tensor metadata can tell those apart.
    """
    strides = (layout.stride_block, layout.stride_offset, layout.stride_kv, layout.stride_head)
    if min(strides) < 0:
        raise InvalidArgumentError(f"layout: expected non-negative strides, got {strides}")
    if not _layout_dims_match(layout, tuple(t.shape), tuple(t.stride())):
        raise InvalidArgumentError(
            f"layout: expected a layout that addresses the cache tensor of shape {tuple(t.shape)} "
            f"strides {tuple(t.stride())} dim for dim, got {layout}"
        )


@functools.lru_cache(maxsize=256)
def _layout_dims_match(layout: KVLayout, shape: tuple, strides: tuple) -> bool:
    # Cached: checked on every call of the decode and reclamation hot paths.
    def dims(pairs):  # size > 1 only, innermost (smallest stride) first
        return sorted(((n, s) for n, s in pairs if n > 1), key=lambda d: (d[1], d[0]))

    lay = dims([
        (layout.num_blocks, layout.stride_block),
        (layout.block_size, layout.stride_offset),
        (layout.num_kv, layout.stride_kv),
        (layout.num_heads, layout.stride_head),
        (layout.head_dim, 1),
    ])
    j = 0
    for n, s in dims(zip(shape, strides)):
        if j == len(lay) or lay[j][1] != s:
            return False
        size = lay[j][0]
        j += 1
        while size < n and j < len(lay) and lay[j][1] == s * size:
            size *= lay[j][0]
            j += 1
        if size != n:
            return False
    return j == len(lay)


# --- compact_kv -----------------------------------------------------------------
# Slot contract (the rest are structural checks that always run):
#   * src_slots / dst_slots are int32 [M]; a move with a PAD (-1) side is skipped;
#   * the destinations of the other moves are unique and disjoint from their
#     sources (backends copy moves in parallel);
#   * slots are in [-1, num_blocks * block_size).

COMPACT_KV_DTYPES = tuple(
    dt
    for dt in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        getattr(torch, "float8_e4m3fn", None),
        getattr(torch, "float8_e5m2", None),
        torch.uint8,  # vLLM stores fp8 caches as uint8
        torch.int8,
    )
    if dt is not None
)

# Integer dtype of the same element size: the copy moves bit patterns.
INT_VIEW_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def cache_device(kv_caches) -> torch.device:
    """Device of the caches, after checking ``kv_caches`` is a non-empty tensor list."""
    if not isinstance(kv_caches, (list, tuple)):
        raise InvalidTypeError(f"kv_caches: expected a list of tensors (one per layer), got {type(kv_caches).__name__}")
    if len(kv_caches) == 0:
        raise InvalidArgumentError("kv_caches: expected at least one layer, got an empty list")
    return check_tensor("kv_caches[0]", kv_caches[0]).device


def layout_op_args(layout: KVLayout) -> tuple:
    """The layout's ints in the order of the ``vtoken::compact_kv`` / ``vtoken::token_attention`` schemas."""
    return (
        layout.num_blocks,
        layout.block_size,
        layout.num_kv,
        layout.num_heads,
        layout.head_dim,
        layout.stride_block,
        layout.stride_offset,
        layout.stride_kv,
        layout.stride_head,
    )


def token_rows(layout: KVLayout) -> tuple:
    """A token's elements as ``(rows, n_inner, stride_outer, stride_inner, row_len)``.

    Row ``r`` starts ``(r // n_inner) * stride_outer + (r % n_inner) * stride_inner``
    elements after the slot's start and holds ``row_len`` contiguous elements.
    Contiguous (kv, head) dims are merged into the row; this mirrors
    ``compact_kv_rows`` in ``csrc/compact_kv_params.h``.
    """
    dims = []
    if layout.num_kv > 1:
        dims.append((layout.num_kv, layout.stride_kv))
    if layout.num_heads > 1:
        dims.append((layout.num_heads, layout.stride_head))
    dims.sort(key=lambda d: -d[1])  # outer (largest stride) first
    row = layout.head_dim
    while dims and dims[-1][1] == row:
        row *= dims.pop()[0]
    if len(dims) == 2 and dims[0][1] == dims[1][0] * dims[1][1]:
        dims = [(dims[0][0] * dims[1][0], dims[1][1])]
    if not dims:
        return 1, 1, 0, 0, row
    if len(dims) == 1:
        return dims[0][0], dims[0][0], 0, dims[0][1], row
    return dims[0][0] * dims[1][0], dims[1][0], dims[0][1], dims[1][1], row


def int_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integer dtype of its element size (same strides)."""
    return t.view(INT_VIEW_DTYPE[t.element_size()])


def check_compact_kv_args(kv_caches, layout, src_slots, dst_slots, *, validate=None) -> None:
    """Validate a ``compact_kv`` call; raise before any cache is touched.

    Structural checks (types, dtypes, shapes, devices, layout against the
    tensors) always run; the slot contract (section comment above) runs when
    ``validate`` is True, or ``None`` with ``VTOKEN_DEBUG_INVARIANTS=1``.
    """
    device = cache_device(kv_caches)
    if not isinstance(layout, KVLayout):
        raise InvalidTypeError(f"layout: expected a vtoken.layout.KVLayout, got {type(layout).__name__}")
    t0 = kv_caches[0]
    if t0.dtype not in COMPACT_KV_DTYPES:
        raise InvalidTypeError(f"kv_caches[0]: expected dtype in {list(COMPACT_KV_DTYPES)}, got {t0.dtype}")
    shape, strides, dtype = t0.shape, t0.stride(), t0.dtype
    base, esize = t0.data_ptr(), t0.element_size()
    # NOTE: runs on every call (the reclamation hot path): plain attribute
    # comparisons per layer, the detailed checks only to word an error.
    for i, t in enumerate(kv_caches[1:], start=1):
        if not (isinstance(t, torch.Tensor) and t.dtype == dtype and t.device == device):
            check_tensor(f"kv_caches[{i}]", t, dtype=dtype, device=device)
        if t.shape != shape or t.stride() != strides:
            raise InvalidTypeError(
                f"kv_caches[{i}]: expected shape {tuple(shape)} strides {strides} like layer 0, "
                f"got shape {tuple(t.shape)} strides {t.stride()}"
            )
        if (t.data_ptr() - base) % esize:
            raise InvalidArgumentError(
                f"kv_caches[{i}]: expected an address a whole number of elements from layer 0's"
            )
    if t0.dim() == 0 or strides[-1] != 1:
        raise InvalidArgumentError(f"kv_caches[0]: expected a contiguous last dim (stride 1), got strides {strides}")
    if layout.num_slots > 2**31:
        raise InvalidArgumentError(f"layout: expected num_blocks * block_size <= 2^31 (int32 slots), got {layout.num_slots}")
    check_layout_matches(layout, t0)
    for name, s in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        check_tensor(name, s, dtype=torch.int32, ndim=1, device=device)
    if src_slots.numel() != dst_slots.numel():
        raise InvalidTypeError(
            f"dst_slots: expected {src_slots.numel()} entries like src_slots, got {dst_slots.numel()}"
        )
    if validate is None:
        validate = debug_checks_enabled()
    if validate:
        check_slot_contract(layout, src_slots, dst_slots)


def check_slot_contract(layout: KVLayout, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Ranges, unique destinations, destinations disjoint from sources (syncs)."""
    src = src_slots.detach().cpu().numpy().astype(np.int64)
    dst = dst_slots.detach().cpu().numpy().astype(np.int64)
    n = layout.num_slots
    for name, a in (("src_slots", src), ("dst_slots", dst)):
        bad = np.flatnonzero((a < -1) | (a >= n))
        if bad.size:
            i = int(bad[0])
            raise InvalidArgumentError(
                f"{name}[{i}]: expected -1 (PAD) or a slot in [0, {n}), got {int(a[i])}"
            )
    active = (src >= 0) & (dst >= 0)
    s, d = src[active], dst[active]
    uniq, counts = np.unique(d, return_counts=True)
    if np.any(counts > 1):
        raise InvalidArgumentError(
            f"dst_slots: expected unique destinations, got slot {int(uniq[counts > 1][0])} "
            f"{int(counts[counts > 1][0])} times"
        )
    both = np.intersect1d(s, d)
    if both.size:
        raise InvalidArgumentError(
            f"dst_slots: expected destinations disjoint from the sources, got slot {int(both[0])} in both"
        )


# --- token_attention ------------------------------------------------------------

ATTN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class TokenAttentionArgs:
    """Sizes derived from ``token_attention``'s arguments (no device sync)."""

    num_reqs: int
    num_q_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    group: int
    nnz_max: int
    scale: float
    decode: bool


def token_attention_sizes(q, layout: KVLayout, kv_indices, kv_indptr, q_indptr=None, scale=None) -> TokenAttentionArgs:
    """The sizes the backends need, read from arguments that passed :func:`validate_token_attention_args`."""
    num_q_tokens, num_q_heads, head_dim = q.shape
    return TokenAttentionArgs(
        num_reqs=kv_indptr.numel() - 1,
        num_q_tokens=num_q_tokens,
        num_q_heads=num_q_heads,
        num_kv_heads=layout.num_heads,
        head_dim=head_dim,
        group=num_q_heads // layout.num_heads,
        nnz_max=kv_indices.numel(),
        scale=1.0 / math.sqrt(head_dim) if scale is None else float(scale),
        decode=q_indptr is None,
    )


def _check_indptr(arg: str, indptr: torch.Tensor, limit: int, limit_desc: str) -> None:
    """Host-side content checks of an indptr (only called where no sync is needed)."""
    v = indptr.to(torch.int64)
    if v.numel() and int(v[0]) < 0:
        raise InvalidArgumentError(f"{arg}: expected a first entry >= 0, got {int(v[0])}")
    if v.numel() > 1 and bool((v[1:] < v[:-1]).any()):
        raise InvalidArgumentError(f"{arg}: expected a non-decreasing array, got {v.tolist()[:16]}...")
    if v.numel() and int(v[-1]) > limit:
        raise InvalidArgumentError(f"{arg}: expected a last entry <= {limit_desc} ({limit}), got {int(v[-1])}")


def validate_token_attention_args(
    q, kv_cache, layout, kv_indices, kv_indptr, q_indptr=None, *, scale=None, out=None,
    mirror_starts=None, kv_pos=None, score_out=None, content_checks: bool | None = None,
) -> TokenAttentionArgs:
    """Validate ``token_attention``'s arguments; raise typed errors naming the argument.

    The one-shot form of :func:`validate_token_attention_step_args` (once per
    step: the slot lists) followed by :func:`validate_token_attention_layer_args`
    (once per layer: ``q``, ``kv_cache``, ``out``, ``score_out``; O(1)).
    """
    check_tensor("q", q, dtype=ATTN_DTYPES, ndim=3)
    if not isinstance(layout, KVLayout):
        raise InvalidTypeError(f"layout: expected a vtoken.layout.KVLayout, got {type(layout).__name__}")
    a = validate_token_attention_step_args(
        layout, kv_indices, kv_indptr, q_indptr, num_q_tokens=q.shape[0], num_q_heads=q.shape[1],
        head_dim=q.shape[2], device=q.device, scale=scale, mirror_starts=mirror_starts, kv_pos=kv_pos,
        content_checks=content_checks,
    )
    validate_token_attention_layer_args(a, layout, q, kv_cache, out=out, score_out=score_out,
                                        scored=mirror_starts is not None)
    if score_out is not None and _content_checks(q.device, content_checks):
        check_score_destinations(kv_indices, kv_indptr, layout.num_slots, mirror_starts, kv_pos, score_out.numel())
    return a


def _content_checks(device: torch.device, content_checks: bool | None) -> bool:
    # NOTE: reading indices syncs the host; never do it while a CUDA graph is being captured.
    if content_checks is None:
        content_checks = device.type == "cpu" or debug_checks_enabled()
    return content_checks and not capturing(device)


def validate_token_attention_step_args(
    layout, kv_indices, kv_indptr, q_indptr=None, *, num_q_tokens: int, num_q_heads: int, head_dim: int,
    device, scale=None, mirror_starts=None, kv_pos=None, content_checks: bool | None = None,
) -> TokenAttentionArgs:
    """The per-step half of the contract: the slot lists and the score destinations.

    Shape, dtype and device checks never touch tensor contents. Content checks
    (indptr monotonicity and bounds, slot range, ``n_new <= n_live``) read the
    index tensors, so they run only when those tensors live on the CPU (no
    device sync), or when ``content_checks=True`` / ``VTOKEN_DEBUG_INVARIANTS=1``.
    """
    device = torch.device(device)
    if not isinstance(layout, KVLayout):
        raise InvalidTypeError(f"layout: expected a vtoken.layout.KVLayout, got {type(layout).__name__}")
    if layout.num_kv != 2:
        raise InvalidArgumentError(
            f"layout: expected num_kv == 2 (K and V in one tensor), got {layout.num_kv} (layout {layout.name!r})"
        )
    if head_dim != layout.head_dim:
        raise InvalidArgumentError(f"q: expected head_dim == layout.head_dim ({layout.head_dim}), got {head_dim}")
    if head_dim > MAX_HEAD_DIM:
        raise InvalidArgumentError(f"q: expected head_dim <= {MAX_HEAD_DIM}, got {head_dim}")
    num_kv_heads = layout.num_heads
    if num_q_heads % num_kv_heads != 0:
        raise InvalidArgumentError(
            f"q: expected num_q_heads divisible by num_kv_heads ({num_kv_heads}) for GQA, got {num_q_heads}"
        )
    check_tensor("kv_indices", kv_indices, dtype=torch.int32, ndim=1, device=device)
    check_tensor("kv_indptr", kv_indptr, dtype=torch.int32, ndim=1, device=device)
    if kv_indptr.numel() < 1:
        raise InvalidTypeError("kv_indptr: expected num_reqs + 1 >= 1 entries, got 0")
    num_reqs = kv_indptr.numel() - 1
    decode = q_indptr is None
    if decode:
        if num_q_tokens != num_reqs:
            raise InvalidTypeError(
                f"q: expected one query per request in decode mode (q.shape[0] == len(kv_indptr) - 1 == "
                f"{num_reqs}), got {num_q_tokens}"
            )
    else:
        check_tensor("q_indptr", q_indptr, dtype=torch.int32, ndim=1, device=device)
        if q_indptr.numel() != kv_indptr.numel():
            raise InvalidTypeError(
                f"q_indptr: expected len(kv_indptr) == {kv_indptr.numel()} entries, got {q_indptr.numel()}"
            )
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0
    ):
        raise InvalidArgumentError(f"scale: expected a finite float > 0, got {scale!r}")
    nnz_max = kv_indices.numel()
    if (mirror_starts is None) != (kv_pos is None):
        raise InvalidArgumentError(
            f"mirror_starts: expected mirror_starts and kv_pos both given or both None, got "
            f"mirror_starts {'None' if mirror_starts is None else 'a tensor'} and "
            f"kv_pos {'None' if kv_pos is None else 'a tensor'}"
        )
    if mirror_starts is not None:
        check_1d("mirror_starts", mirror_starts, torch.int64, device)
        if mirror_starts.numel() < num_reqs:
            raise InvalidTypeError(
                f"mirror_starts: expected >= num_reqs ({num_reqs}) entries, got {mirror_starts.numel()}"
            )
        check_1d("kv_pos", kv_pos, torch.int32, device)
        if kv_pos.numel() != nnz_max:
            raise InvalidTypeError(f"kv_pos: expected shape ({nnz_max},) like kv_indices, got {tuple(kv_pos.shape)}")

    if _content_checks(device, content_checks):
        _check_indptr("kv_indptr", kv_indptr, nnz_max, "len(kv_indices)")
        if not decode:
            _check_indptr("q_indptr", q_indptr, num_q_tokens, "q.shape[0]")
            n_new = (q_indptr[1:] - q_indptr[:-1]).to(torch.int64)
            n_live = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
            bad = torch.nonzero(n_new > n_live).flatten()
            if bad.numel():
                r = int(bad[0])
                raise InvalidArgumentError(
                    f"q_indptr: expected request {r}'s new queries ({int(n_new[r])}) <= its listed slots "
                    f"({int(n_live[r])}); the new tokens' own K/V must be in its slot list"
                )
        if num_reqs:
            listed = kv_indices[int(kv_indptr[0]) : int(kv_indptr[-1])].to(torch.int64)
            oob = listed[(listed < -1) | (listed >= layout.num_slots)]
            if oob.numel():
                raise InvalidArgumentError(
                    f"kv_indices: expected slots in [0, {layout.num_slots}) or PAD (-1), got {int(oob[0])}"
                )
    return TokenAttentionArgs(
        num_reqs=num_reqs,
        num_q_tokens=num_q_tokens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        group=num_q_heads // num_kv_heads,
        nnz_max=nnz_max,
        scale=1.0 / math.sqrt(head_dim) if scale is None else float(scale),
        decode=decode,
    )


def validate_token_attention_layer_args(
    a: TokenAttentionArgs, layout: KVLayout, q, kv_cache, *, out=None, score_out=None, scored: bool = False,
) -> None:
    """The per-layer half of the contract (O(1): metadata only, never tensor contents).

    ``a`` comes from :func:`validate_token_attention_step_args`; ``scored``
    says whether the step was given ``mirror_starts`` / ``kv_pos``, which
    ``score_out`` needs.
    """
    check_tensor("q", q, dtype=ATTN_DTYPES, ndim=3)
    if q.stride(2) != 1:
        raise InvalidArgumentError(f"q: expected a contiguous last dim (stride 1), got strides {tuple(q.stride())}")
    if q.shape[2] != a.head_dim:
        raise InvalidArgumentError(f"q: expected head_dim == layout.head_dim ({a.head_dim}), got {q.shape[2]}")
    if (q.shape[0], q.shape[1]) != (a.num_q_tokens, a.num_q_heads):
        raise InvalidTypeError(
            f"q: expected shape ({a.num_q_tokens}, {a.num_q_heads}, {a.head_dim}) as planned, got {tuple(q.shape)}"
        )
    check_tensor("kv_cache", kv_cache, dtype=q.dtype, device=q.device)
    if kv_cache.stride(-1) != 1:
        raise InvalidArgumentError("kv_cache: expected a contiguous last dim (stride 1)")
    # The farthest element the layout can address must lie inside kv_cache.
    span = 1 + sum((s - 1) * st for s, st in zip(kv_cache.shape, kv_cache.stride()))
    far = layout_extent(layout) - 1
    if kv_cache.numel() == 0 or far >= span:
        raise InvalidArgumentError(
            f"kv_cache: expected a tensor spanning layout {layout.name!r} ({far + 1} elements), "
            f"got shape {tuple(kv_cache.shape)} strides {tuple(kv_cache.stride())}"
        )
    check_layout_matches(layout, kv_cache)
    if out is not None:
        check_tensor("out", out, dtype=q.dtype, shape=tuple(q.shape), device=q.device)
        if out.stride(2) != 1:
            raise InvalidArgumentError(
                f"out: expected a contiguous last dim (stride 1), got strides {tuple(out.stride())}"
            )
    if score_out is not None:
        if not scored:
            raise InvalidArgumentError(
                "score_out: expected mirror_starts and kv_pos (where each key's score goes), got neither"
            )
        check_1d("score_out", score_out, torch.float32, q.device)


def check_score_destinations(kv_indices, kv_indptr, num_slots: int, mirror_starts, kv_pos, score_size: int) -> None:
    """Content check: every scored key's ``mirror_starts[r] + kv_pos[j]`` is in ``[0, score_size)`` and unique.

    Scored keys are the listed entries with a slot in ``[0, num_slots)``. A host
    sync on a GPU: callers run it under the same rule as the other content checks.
    """
    dst = score_destinations(kv_indices, kv_indptr, num_slots, mirror_starts, kv_pos)
    if dst.numel() == 0:
        return
    bad = dst[(dst < 0) | (dst >= score_size)]
    if bad.numel():
        raise InvalidArgumentError(
            f"kv_pos: expected mirror_starts[r] + kv_pos[j] in [0, len(score_out) = {score_size}), got {int(bad[0])}"
        )
    uniq, counts = torch.unique(dst, return_counts=True)
    if bool((counts > 1).any()):
        raise InvalidArgumentError(
            f"kv_pos: expected unique destinations mirror_starts[r] + kv_pos[j], got {int(uniq[counts > 1][0])} "
            f"{int(counts[counts > 1][0])} times"
        )


def score_destinations(kv_indices, kv_indptr, num_slots: int, mirror_starts, kv_pos) -> torch.Tensor:
    """int64 ``mirror_starts[r] + kv_pos[j]`` of every scored key (listed, slot in range), in list order."""
    ptr = kv_indptr.to(torch.int64)
    num_reqs = ptr.numel() - 1
    j = torch.arange(kv_indices.numel(), device=kv_indices.device)
    req = torch.searchsorted(ptr[1:], j, right=True)  # request of entry j; num_reqs past the end
    slot = kv_indices.to(torch.int64)
    scored = (req < num_reqs) & (j >= ptr[0]) & (slot >= 0) & (slot < num_slots)
    starts = mirror_starts[:num_reqs][req.clamp(max=max(num_reqs - 1, 0))] if num_reqs else torch.zeros_like(j)
    return (starts + kv_pos.to(torch.int64))[scored]


# --- block_live_counts ----------------------------------------------------------

ALLOCATED_DTYPES = (torch.bool, torch.int8)


def validate_block_live_counts_args(
    slots, alive, num_blocks, block_size, allocated=None, *, content_checks: bool | None = None,
) -> None:
    """Validate ``block_live_counts``'s arguments (typed "expected X, got Y" errors).

    Content checks (a live token with a slot outside ``[0, num_blocks *
    block_size)`` other than PAD) read the tensors, so they run for CPU tensors,
    with ``content_checks=True`` or under ``VTOKEN_DEBUG_INVARIANTS=1``.
    """
    device = check_slots_alive(slots, alive)
    for arg, v in (("num_blocks", num_blocks), ("block_size", block_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidTypeError(f"{arg}: expected an int, got {type(v).__name__}")
    if num_blocks < 0:
        raise InvalidArgumentError(f"num_blocks: expected >= 0, got {num_blocks}")
    if block_size < 1:
        raise InvalidArgumentError(f"block_size: expected >= 1, got {block_size}")
    if num_blocks * block_size > 2**31:
        raise InvalidArgumentError(
            f"num_blocks * block_size: expected <= 2**31 (int32 slots), got {num_blocks * block_size}"
        )
    if allocated is not None:
        check_1d("allocated", allocated, ALLOCATED_DTYPES, device)
        if allocated.numel() != num_blocks:
            raise InvalidTypeError(f"allocated: expected shape ({num_blocks},), got {tuple(allocated.shape)}")
    if content_checks is None:
        content_checks = device.type == "cpu" or debug_checks_enabled()
    if content_checks and not capturing(device):
        s = slots[alive.to(torch.bool)].to("cpu", torch.int64)
        bad = (s != -1) & ((s < 0) | (s >= num_blocks * block_size))
        if bool(bad.any()):
            raise InvalidArgumentError(
                f"slots: expected alive slots in [0, num_blocks * block_size = {num_blocks * block_size}) or PAD, "
                f"got {int(s[bad][0])}"
            )


# --- build_slot_lists -----------------------------------------------------------
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

SLOT_LIST_COUNT_DTYPES = (torch.int32, torch.int64)


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
