"""Torch reference of ``token_attention``: attention that reads K/V through slots.

Semantics (shared by every backend; the Triton kernel must match within the
per-dtype tolerance stated in ``tests/test_token_attention.py``):

* Request ``r`` attends to the slots ``kv_indices[kv_indptr[r]:kv_indptr[r+1]]``
  (its live tokens, in logical order). A slot ``s`` names block ``s // S`` and
  offset ``s % S`` of ``kv_cache``, addressed through ``layout``'s strides. K is
  ``kv = 0``, V is ``kv = 1``. Slots that are not listed are never read.
* A PAD entry (``-1``) inside a request's range is masked (it receives zero
  probability and contributes nothing). Entries past ``kv_indptr[-1]`` are
  never read.
* Decode (``q_indptr is None``): query ``r`` attends to every listed key of
  request ``r``.
* Varlen prefill: request ``r``'s queries are ``q[q_indptr[r]:q_indptr[r+1]]``
  (``n_new`` of them). Their own K/V are the last ``n_new`` list entries. New
  query ``i`` attends list entries ``[0, n_live - n_new + i]`` (causal within the
  chunk, every live past token before it).
* GQA: query head ``h`` reads kv head ``h // (num_q_heads // num_kv_heads)``.
* A query row with no attendable key outputs zeros.
* ``key_scores[j, g]`` (float32, ``[nnz_max, num_kv_heads]``) is, for list entry
  ``j`` of request ``r``, the sum over ``r``'s queries and over the query heads
  of kv head ``g``'s group of the softmax probability given to key ``j``. Rows
  that belong to no request are 0. H2O / TOVA-style policies accumulate it.

The validation here is shared with the Triton launcher
(:func:`validate_token_attention_args`), so both raise the same typed errors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vtoken.errors import InvalidArgumentError, InvalidTypeError, check_tensor, debug_checks_enabled
from vtoken.layout import KVLayout

ATTN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class TokenAttentionArgs:
    """Sizes derived from validated ``token_attention`` arguments (no device sync)."""

    num_reqs: int
    num_q_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    group: int
    nnz_max: int
    scale: float
    decode: bool


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
    content_checks: bool | None = None,
) -> TokenAttentionArgs:
    """Validate ``token_attention``'s arguments; raise typed errors naming the argument.

    Shape, dtype and device checks never touch tensor contents. Content checks
    (indptr monotonicity and bounds, slot range, ``n_new <= n_live``) read the
    index tensors, so they run only when those tensors live on the CPU (no
    device sync), or when ``content_checks=True`` / ``VTOKEN_DEBUG_INVARIANTS=1``.
    """
    check_tensor("q", q, dtype=ATTN_DTYPES, ndim=3)
    if q.stride(2) != 1:
        raise InvalidArgumentError(f"q: expected a contiguous last dim (stride 1), got strides {tuple(q.stride())}")
    num_q_tokens, num_q_heads, head_dim = q.shape
    if not isinstance(layout, KVLayout):
        raise InvalidTypeError(f"layout: expected a vtoken.layout.KVLayout, got {type(layout).__name__}")
    if layout.num_kv != 2:
        raise InvalidArgumentError(
            f"layout: expected num_kv == 2 (K and V in one tensor), got {layout.num_kv} (layout {layout.name!r})"
        )
    check_tensor("kv_cache", kv_cache, dtype=q.dtype, device=q.device)
    if head_dim != layout.head_dim:
        raise InvalidArgumentError(f"q: expected head_dim == layout.head_dim ({layout.head_dim}), got {head_dim}")
    if head_dim > MAX_HEAD_DIM:
        raise InvalidArgumentError(f"q: expected head_dim <= {MAX_HEAD_DIM}, got {head_dim}")
    if kv_cache.stride(-1) != 1:
        raise InvalidArgumentError("kv_cache: expected a contiguous last dim (stride 1)")
    # The farthest element the layout can address must lie inside kv_cache.
    span = 1 + sum((s - 1) * st for s, st in zip(kv_cache.shape, kv_cache.stride()))
    far = (
        (layout.num_blocks - 1) * layout.stride_block
        + (layout.block_size - 1) * layout.stride_offset
        + (layout.num_kv - 1) * layout.stride_kv
        + (layout.num_heads - 1) * layout.stride_head
        + layout.head_dim
        - 1
    )
    if kv_cache.numel() == 0 or far >= span:
        raise InvalidArgumentError(
            f"kv_cache: expected a tensor spanning layout {layout.name!r} ({far + 1} elements), "
            f"got shape {tuple(kv_cache.shape)} strides {tuple(kv_cache.stride())}"
        )
    num_kv_heads = layout.num_heads
    if num_q_heads % num_kv_heads != 0:
        raise InvalidArgumentError(
            f"q: expected num_q_heads divisible by num_kv_heads ({num_kv_heads}) for GQA, got {num_q_heads}"
        )
    check_tensor("kv_indices", kv_indices, dtype=torch.int32, ndim=1, device=q.device)
    check_tensor("kv_indptr", kv_indptr, dtype=torch.int32, ndim=1, device=q.device)
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
        check_tensor("q_indptr", q_indptr, dtype=torch.int32, ndim=1, device=q.device)
        if q_indptr.numel() != kv_indptr.numel():
            raise InvalidTypeError(
                f"q_indptr: expected len(kv_indptr) == {kv_indptr.numel()} entries, got {q_indptr.numel()}"
            )
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise InvalidArgumentError(f"scale: expected a finite float > 0, got {scale!r}")
    if out is not None:
        check_tensor("out", out, dtype=q.dtype, shape=tuple(q.shape), device=q.device)
        if out.stride(2) != 1:
            raise InvalidArgumentError(
                f"out: expected a contiguous last dim (stride 1), got strides {tuple(out.stride())}"
            )
    nnz_max = kv_indices.numel()

    if content_checks is None:
        content_checks = q.device.type == "cpu" or debug_checks_enabled()
        # NOTE: reading indices syncs the host; never do it while a CUDA graph is being captured.
        if q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            content_checks = False
    if content_checks:
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
        scale=float(scale),
        decode=decode,
    )


def token_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: KVLayout,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    q_indptr: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    return_key_scores: bool = False,
    out: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
):
    """Reference token-indexed attention (a per-request host loop; see module docstring).

    Args:
        q: ``[num_q_tokens, num_q_heads, head_dim]`` fp16 / bf16 / fp32.
        kv_cache: one layer's cache, described by ``layout`` (``num_kv == 2``).
        layout: :class:`vtoken.layout.KVLayout` of ``kv_cache``.
        kv_indices: int32 ``[nnz_max]``; slots, PAD (-1) past ``kv_indptr[-1]``.
        kv_indptr: int32 ``[num_reqs + 1]``.
        q_indptr: int32 ``[num_reqs + 1]`` for varlen prefill, ``None`` for decode.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        return_key_scores: also return float32 ``[nnz_max, num_kv_heads]`` key scores.
        out: optional preallocated output (shape and dtype of ``q``).
        compute_dtype: float32 (default) or float64. float64 is the test oracle:
            it returns the output and key scores in float64 (``out`` must be None).

    Returns:
        ``out`` (dtype of ``q``), or ``(out, key_scores)``.

    Example::

        >>> import torch
        >>> from vtoken.layout import KVLayout, kv_cache_shape
        >>> cache = torch.randn(kv_cache_shape("nhd", 4, 16, 2, 64))
        >>> lay = KVLayout.from_tensor(cache, "nhd")
        >>> q = torch.randn(1, 4, 64)
        >>> o, ks = token_attention(q, cache, lay, torch.tensor([3, 17, 40], dtype=torch.int32),
        ...                         torch.tensor([0, 3], dtype=torch.int32), return_key_scores=True)
        >>> o.shape, ks.shape
        (torch.Size([1, 4, 64]), torch.Size([3, 2]))
    """
    a = validate_token_attention_args(
        q, kv_cache, layout, kv_indices, kv_indptr, q_indptr, scale=scale, out=out, content_checks=True
    )
    if compute_dtype not in (torch.float32, torch.float64):
        raise InvalidTypeError(f"compute_dtype: expected torch.float32 or torch.float64, got {compute_dtype}")
    if compute_dtype == torch.float64 and out is not None:
        raise InvalidArgumentError("out: expected None with compute_dtype=torch.float64 (the oracle returns float64)")
    view = layout.canonical_view(kv_cache)
    kv_ptr = kv_indptr.to("cpu", torch.int64).tolist()
    q_ptr = list(range(a.num_reqs + 1)) if a.decode else q_indptr.to("cpu", torch.int64).tolist()
    result = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    scores = torch.zeros(a.nnz_max, a.num_kv_heads, dtype=compute_dtype, device=q.device)
    for r in range(a.num_reqs):
        k0, k1 = kv_ptr[r], kv_ptr[r + 1]
        q0, q1 = q_ptr[r], q_ptr[r + 1]
        n_live, n_new = k1 - k0, q1 - q0
        if n_live == 0 or n_new == 0:
            continue
        slots = kv_indices[k0:k1].to(torch.int64)
        valid = slots >= 0  # PAD inside a request's range is masked
        safe = torch.where(valid, slots, torch.zeros_like(slots))
        blk, off = safe // layout.block_size, safe % layout.block_size
        k = view[blk, off, 0].to(compute_dtype)  # [n_live, Hkv, D]
        v = view[blk, off, 1].to(compute_dtype)
        # NOTE: zero the masked rows so a NaN/Inf in the (unread) slot 0 cannot leak through 0 * NaN.
        k = torch.where(valid[:, None, None], k, 0)
        v = torch.where(valid[:, None, None], v, 0)
        qr = q[q0:q1].to(compute_dtype).reshape(n_new, a.num_kv_heads, a.group, -1)  # [n_new, Hkv, G, D]
        s = torch.einsum("ikgd,jkd->kgij", qr, k) * a.scale  # [Hkv, G, n_new, n_live]
        i = torch.arange(n_new, device=q.device)[:, None]
        j = torch.arange(n_live, device=q.device)[None, :]
        allowed = (j <= n_live - n_new + i) & valid[None, :]  # [n_new, n_live]
        s = s.masked_fill(~allowed, float("-inf"))
        row_max = s.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        e = torch.exp(s - row_max)
        denom = e.sum(dim=-1, keepdim=True)
        p = torch.where(denom > 0, e / torch.where(denom > 0, denom, 1), torch.zeros_like(e))
        result[q0:q1] = torch.einsum("kgij,jkd->ikgd", p, v).reshape(n_new, a.num_q_heads, -1)
        # Sum over the group's query heads and the request's queries, per kv head.
        scores[k0:k1] = p.sum(dim=(1, 2)).T
    if compute_dtype == torch.float64:
        out = result
    else:
        if out is None:
            out = torch.empty_like(q)
        out.copy_(result)
    if return_key_scores:
        return out, scores
    return out
