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
* ``score_out`` (float32 ``[mirror_size]``, with int64 ``mirror_starts
  [>= num_reqs]`` and int32 ``kv_pos [nnz_max]``): for every scored entry
  ``j`` of request ``r`` (listed, slot in ``[0, num_slots)``; PAD is not scored),
  ``key_scores[j].sum()`` (all query heads, all the step's queries) is ADDED to
  ``score_out[mirror_starts[r] + kv_pos[j]]``; the destinations are unique and
  every other entry is left untouched. Calls over the layers of a step
  accumulate the step's per-token mass in place.

Non-finite inputs (NaN propagation; every backend does the same, so a NaN is
never turned into a finite result):

* Output row ``(i, h)`` (query ``i``, query head ``h``, kv head
  ``g = h // group``) is NaN in every element when ``q[i, h]`` holds a NaN,
  when a key it attends (listed, not PAD, allowed by the causal rule) holds a
  NaN in its K row of kv head ``g``, or a NaN or +-Inf in its V row of kv head
  ``g``. Rows that do not attend that key are unaffected.
* A NaN score (from ``q`` or K) makes ``key_scores[j, g]`` NaN for every key
  ``j`` the row attends. V never enters the key scores.
* A query row with no attendable key outputs zeros whatever ``q`` holds (it
  reads nothing). +-Inf in ``q`` or K go through the scores by IEEE rules.

Arguments are checked once, by
:func:`vtoken_kernels.contracts.validate_token_attention_args`, at the op
boundary (:func:`vtoken.device.ops.token_attention`); this reference does not check
them again.
"""
from __future__ import annotations

import torch

from vtoken.errors import InvalidArgumentError, InvalidTypeError
from vtoken.layout import KVLayout
from vtoken_kernels.contracts import token_attention_sizes


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
    score_out: torch.Tensor | None = None,
    mirror_starts: torch.Tensor | None = None,
    kv_pos: torch.Tensor | None = None,
):
    """Reference token-indexed attention (a per-request host loop; see module docstring).

    Takes arguments that passed the contract (see module docstring); only
    ``compute_dtype``, the reference's own argument, is checked here.

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
        score_out: float32 ``[mirror_size]`` added into in place (module
            docstring), with int64 ``mirror_starts`` and int32 ``kv_pos``.

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
    if compute_dtype not in (torch.float32, torch.float64):
        raise InvalidTypeError(f"compute_dtype: expected torch.float32 or torch.float64, got {compute_dtype}")
    if compute_dtype == torch.float64 and out is not None:
        raise InvalidArgumentError("out: expected None with compute_dtype=torch.float64 (the oracle returns float64)")
    a = token_attention_sizes(q, layout, kv_indices, kv_indptr, q_indptr, scale)
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
        # A row with no attendable key has max -inf: shift by 0 so it gets p = 0. A NaN max stays
        # NaN, so a NaN score makes the whole row NaN (module docstring).
        row_max = s.amax(dim=-1, keepdim=True)
        row_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
        e = torch.exp(s - row_max)
        denom = e.sum(dim=-1, keepdim=True)
        p = e / torch.where(denom == 0, torch.ones_like(denom), denom)
        p = torch.where(allowed, p, torch.zeros_like(p))  # a NaN row still gives its unattended keys 0
        # NOTE: 0 * NaN = NaN would carry a non-finite V into rows that do not attend its key:
        # zero those elements for P @ V, then set the rows that do attend the key to NaN.
        v_finite = torch.isfinite(v)
        bad_key = ~v_finite.all(dim=-1)  # [n_live, Hkv]
        o = torch.einsum("kgij,jkd->ikgd", p, torch.where(v_finite, v, 0))  # [n_new, Hkv, G, D]
        reads_bad_v = (allowed[:, :, None] & bad_key[None, :, :]).any(dim=1)  # [n_new, Hkv]
        o = torch.where(reads_bad_v[:, :, None, None], float("nan"), o)
        result[q0:q1] = o.reshape(n_new, a.num_q_heads, -1)
        # Sum over the group's query heads and the request's queries, per kv head.
        scores[k0:k1] = p.sum(dim=(1, 2)).T
        if score_out is not None:
            scored = valid & (slots < layout.num_slots)
            dst = int(mirror_starts[r]) + kv_pos[k0:k1].to(torch.int64)
            mass = scores[k0:k1].sum(dim=1).to(score_out.dtype)
            score_out[dst[scored]] += mass[scored]
    if compute_dtype == torch.float64:
        out = result
    else:
        if out is None:
            out = torch.empty_like(q)
        out.copy_(result)
    if return_key_scores:
        return out, scores
    return out


class TokenAttentionReferencePlan:
    """The torch backend's plan: keeps the step's arguments, ``run`` calls :func:`token_attention`.

    Same interface as :class:`vtoken_kernels.token_attention.TokenAttentionPlan`
    (built by :func:`vtoken.device.ops.plan_token_attention`); validation happened there.
    """

    def __init__(self, layout, kv_indices, kv_indptr, q_indptr=None, *, scale=None, mirror_starts=None, kv_pos=None):
        self.layout, self.kv_indices, self.kv_indptr, self.q_indptr = layout, kv_indices, kv_indptr, q_indptr
        self.scale, self.mirror_starts, self.kv_pos = scale, mirror_starts, kv_pos

    def run(self, q, kv_cache, *, out=None, return_key_scores=False, score_out=None):
        """One layer: ``out`` or ``(out, key_scores)``; adds into ``score_out`` when given."""
        return token_attention(q, kv_cache, self.layout, self.kv_indices, self.kv_indptr, self.q_indptr,
                               scale=self.scale, return_key_scores=return_key_scores, out=out,
                               score_out=score_out, mirror_starts=self.mirror_starts, kv_pos=self.kv_pos)
