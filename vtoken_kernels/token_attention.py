"""Triton token-indexed attention: decode and varlen prefill over per-token slots.

Every key/value row is read through ``kv_indices[kv_indptr[r]:kv_indptr[r+1]]``
(request ``r``'s live slots, in logical order), so a dead token that still
sits in a live block is never read. Semantics, shapes, the causal rule and NaN
propagation are those of :mod:`vtoken.reference.token_attention`. The argument
contract is :func:`vtoken_kernels.contracts.validate_token_attention_args`,
checked once by :func:`vtoken.device.ops.token_attention`; the launcher takes
validated arguments and does not check them again.

Kernels (launched by :func:`token_attention`):

* ``_token_attention_kernel``: one program per (query tile, kv head, kv split).
  The query heads of a kv head's GQA group are folded into the tile's rows, so
  each K/V row is loaded once per group. Online softmax in fp32 (base 2).

  - Decode: one query per request, tile = request. With ``num_splits > 1`` the
    request's keys are cut into ``num_splits`` contiguous chunks, one program
    each (flash-decoding); every chunk writes a normalized partial output and its
    log-sum-exp, and ``_token_attention_reduce_kernel`` merges them.
  - Varlen prefill: tiles of ``BLOCK_Q`` new queries of one request. The tile to
    request map is built on the device from ``q_indptr`` (no host sync).
Key scores (``return_key_scores=True`` and / or ``score_out``) use the FINAL
per-row log-sum-exp, so the probability sums are exact up to float rounding
(not an online approximation):

* Decode: the main kernel also stores every key's fp32 score ``q.k * scale *
  log2(e)`` (``[num_q_heads, nnz_max]``), and
  ``_token_attention_logit_scores_kernel`` turns them into ``exp2(s - lse)``
  summed over each GQA group. K is read once: per key and kv head that pass
  moves ``4 * group`` bytes written + read instead of ``2 * head_dim`` bytes of K.
* Varlen prefill: ``_token_attention_key_scores_kernel`` recomputes q.k, reading
  K once per request and kv head (never V). The main pass reads K and V once per
  query tile, so that is ``1 / (2 * tiles)`` more KV traffic; keeping the scores
  instead would cost ``4 * n_new * group`` bytes per key (quadratic in the chunk).
* Both score kernels loop over the kv heads inside one program per (request,
  split): each ``score_out`` entry has one writer, added with a plain
  load + store (no atomics, deterministic). NOTE: that needs the destinations
  ``mirror_starts[r] + kv_pos[j]`` unique, part of the contract.

:class:`TokenAttentionPlan` holds one step's decisions (splits, tiles, the
prefill tile map) and workspaces; its ``run`` is the per-layer launch.

When the split is used (decode only): ``num_splits`` is chosen from shapes
alone (never a host sync), so a CUDA graph replays it unchanged. On CUDA the
kernel fills about two waves of SMs: ``splits = min(ceil(2 * SMs /
(num_reqs * num_kv_heads)), nnz_max / num_reqs / 256, 32)``; large batches
(e.g. 64 requests x 8 kv heads on 132 SMs) get no split, few long requests get
up to 32. Under the interpreter (CPU) it is 1 unless ``num_splits`` is given.
The prefill score pass splits each request's keys too, without the cap of 32
(no reduce pass; each split owns whole key tiles, so the scores are the same
bits for any split count): ``min(ceil(2 * SMs / num_reqs), nnz_max / num_reqs /
BLOCK_N)`` programs per request (see ``score_splits_for``).

NOTE: tile sizes (BLOCK_N 64, or 32 at head_dim 256; 64 query rows per prefill
tile, 32 at head_dim 256) are conventional flash-attention choices, not yet
tuned by measurement on a GPU.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from vtoken_kernels.contracts import token_attention_sizes
from vtoken_kernels.errors import InvalidArgumentError

LOG2E = 1.4426950408889634
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 32


def token_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layout,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    q_indptr: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    return_key_scores: bool = False,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    score_out: torch.Tensor | None = None,
    mirror_starts: torch.Tensor | None = None,
    kv_pos: torch.Tensor | None = None,
):
    """Attention over token-indexed K/V (Triton): a one-shot :class:`TokenAttentionPlan` and its ``run``.

    Args:
        q: ``[num_q_tokens, num_q_heads, head_dim]`` fp16 / bf16 / fp32
            (last dim contiguous; other strides free).
        kv_cache: one layer's cache tensor, same dtype and device as ``q``.
        layout: :class:`vtoken_kernels.layout.KVLayout` of ``kv_cache`` with ``num_kv == 2``.
        kv_indices: int32 ``[nnz_max]`` slots; PAD (-1) entries are skipped.
        kv_indptr: int32 ``[num_reqs + 1]``.
        q_indptr: int32 ``[num_reqs + 1]`` (varlen prefill) or ``None`` (decode,
            ``q.shape[0] == num_reqs``).
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        return_key_scores: also return float32 ``[nnz_max, num_kv_heads]``
            per-key probability sums (see the reference module).
        out: optional output, shape and dtype of ``q``.
        num_splits: decode only: force the number of kv splits (flash-decoding);
            ``None`` picks it from the shapes.
        score_out: optional float32 ``[mirror_size]``: each scored key's mass,
            summed over all query heads and the step's queries, is ADDED to
            ``score_out[mirror_starts[r] + kv_pos[j]]`` (in place; other entries
            untouched). Needs ``mirror_starts`` (int64 ``[>= num_reqs]``) and
            ``kv_pos`` (int32 ``[nnz_max]``).

    Returns:
        ``out``, or ``(out, key_scores)``.

    Example::

        >>> import torch
        >>> from vtoken_kernels.layout import KVLayout, kv_cache_shape
        >>> dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU needs TRITON_INTERPRET=1
        >>> cache = torch.randn(kv_cache_shape("vllm_flash", 8, 16, 2, 64), device=dev, dtype=torch.float16)
        >>> lay = KVLayout.from_tensor(cache, "vllm_flash")
        >>> q = torch.randn(2, 8, 64, device=dev, dtype=torch.float16)
        >>> idx = torch.tensor([5, 9, 33, 34, 70, -1, -1], dtype=torch.int32, device=dev)
        >>> ptr = torch.tensor([0, 3, 5], dtype=torch.int32, device=dev)
        >>> o, ks = token_attention(q, cache, lay, idx, ptr, return_key_scores=True)
        >>> o.shape, ks.shape
        (torch.Size([2, 8, 64]), torch.Size([7, 2]))
    """
    a = token_attention_sizes(q, layout, kv_indices, kv_indptr, q_indptr, scale)
    plan = TokenAttentionPlan(
        a, layout, kv_indices, kv_indptr, q_indptr, dtype=q.dtype, device=q.device, num_splits=num_splits,
        scores=return_key_scores or score_out is not None, mirror_starts=mirror_starts, kv_pos=kv_pos,
    )
    return plan.run(q, kv_cache, out=out, return_key_scores=return_key_scores, score_out=score_out)


class TokenAttentionPlan:
    """One step's launch plan: built once from the step's slot lists, run once per layer.

    Takes sizes that passed the contract
    (:func:`vtoken_kernels.contracts.validate_token_attention_step_args`; the
    public entry point is :func:`vtoken.device.ops.plan_token_attention`). Construction
    picks the splits and tile sizes, builds the prefill tile map on the device
    and allocates every workspace; :meth:`run` launches the kernels and, given
    ``out``, allocates nothing (``return_key_scores`` allocates its result), so
    it can be captured in a CUDA graph. The plan keeps references to the index
    tensors: overwrite them in place (same shapes) and run again, as a graph
    replay does (NOTE: a prefill plan lays out its query tiles from ``q_indptr``
    at construction: plan again when it changes); the workspaces are reused by every run, so runs of one plan
    must be stream-ordered.

    Args:
        a: :class:`vtoken_kernels.contracts.TokenAttentionArgs` of the step.
        layout: the KV layout every layer's cache shares.
        kv_indices, kv_indptr, q_indptr: the step's slot lists (see :func:`token_attention`).
        dtype, device: of ``q`` and the caches.
        num_splits: decode kv splits, ``None`` to pick from the shapes.
        scores: allocate the score workspaces (needed by ``return_key_scores`` or ``score_out``).
        mirror_starts, kv_pos: where ``score_out`` entries go (see :func:`token_attention`).
        workspace: float32 ``[>= workspace_numel(...)]`` on ``device``, or None: the float
            workspaces are carved from it instead of allocated (a caller that plans every
            step preallocates once; :func:`workspace_numel` bounds what a plan takes).

    Example::

        >>> plan = TokenAttentionPlan(a, lay, idx, ptr, dtype=q.dtype, device=q.device,  # doctest: +SKIP
        ...                           scores=True, mirror_starts=starts, kv_pos=pos)
        >>> for layer in range(num_layers):  # doctest: +SKIP
        ...     plan.run(q[layer], caches[layer], out=outs[layer], score_out=token_scores)
    """

    def __init__(self, a, layout, kv_indices, kv_indptr, q_indptr=None, *, dtype, device, num_splits=None,
                 scores=False, mirror_starts=None, kv_pos=None, workspace=None):
        if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
            raise InvalidArgumentError(f"num_splits: expected an int >= 1 or None, got {num_splits!r}")
        device = torch.device(device)
        self.a, self.layout = a, layout
        self.kv_indices, self.kv_indptr, self.q_indptr = kv_indices, kv_indptr, q_indptr
        self.mirror_starts, self.kv_pos = mirror_starts, kv_pos
        self.dtype, self.device, self.scores = dtype, device, bool(scores)
        self.empty = a.num_q_tokens == 0 or a.num_reqs == 0
        cfg = self.cfg = _config(a)
        self.splits = 1
        if a.decode:
            self.splits = num_splits if num_splits is not None else _auto_splits(device, a.num_reqs, a.num_kv_heads, a.nnz_max)
        take = _Carver(workspace, device)
        # Dummy pointers for arguments a constexpr switches off; never dereferenced.
        dummy = self._dummy = take(1)
        self.lse = take(a.num_q_tokens, a.num_q_heads) if self.scores else dummy
        if self.splits > 1:
            self.mid_o = take(a.num_q_tokens, a.num_q_heads, self.splits, cfg["BLOCK_D"])
            self.mid_lse = take(a.num_q_tokens, a.num_q_heads, self.splits)
        else:
            self.mid_o = self.mid_lse = dummy
        # Decode with scores: the main pass writes every key's fp32 q.k (one K read); see the module docstring.
        self.logits = take(a.num_q_heads, a.nnz_max) if (self.scores and a.decode) else dummy
        if a.decode or self.empty:
            self.grid_t = a.num_reqs
            self.tile_req = self.tile_q0 = self.q_ptr_arg = kv_indptr  # unused (IS_DECODE=True)
        else:
            self.tile_req, self.tile_q0 = _prefill_tiles(q_indptr, a.num_q_tokens, cfg["BLOCK_Q"])
            self.grid_t = self.tile_req.numel()
            self.q_ptr_arg = q_indptr
        # Score passes loop over the kv heads inside a program (one writer per score_out entry,
        # no atomics), so their grid fills the GPU with requests x splits only.
        if a.decode or self.empty:
            self.score_splits = _auto_splits(device, a.num_reqs, 1, a.nnz_max)
        else:
            self.score_splits = _prefill_score_splits(device, a.num_reqs, a.nnz_max, cfg["BLOCK_N"])
        self.qk_scale = a.scale * LOG2E
        self.dot_precision = "ieee" if dtype == torch.float32 else "tf32"
        # NOTE: the Triton interpreter multiplies bf16 bit patterns in tl.dot
        # (triton-lang/triton#11584, "not supported yet"). Under the interpreter,
        # bf16 operands are widened to fp32 first, with P still rounded to bf16, so
        # the CPU numerics match the GPU path (bf16 products are exact in fp32).
        self.upcast = dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
        if self.upcast:
            self.dot_precision = "ieee"
        self.common = dict(
            HEAD_DIM=a.head_dim, GROUP=a.group, GROUP_P=cfg["GROUP_P"], BLOCK_Q=cfg["BLOCK_Q"],
            BLOCK_N=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_D"], BLOCK_SIZE=layout.block_size,
            IS_DECODE=a.decode, DOT_PRECISION=self.dot_precision, DOT_UPCAST=self.upcast,
        )

    def run(self, q, kv_cache, *, out=None, return_key_scores=False, score_out=None):
        """Attention of one layer: ``out``, or ``(out, key_scores)``; adds into ``score_out`` when given.

        ``q`` and ``kv_cache`` must match the plan (shape, dtype, layout); the
        op boundary checks that in O(1) per layer. See :func:`token_attention`.
        """
        a, layout, cfg = self.a, self.layout, self.cfg
        scored = return_key_scores or score_out is not None  # the op boundary checked the plan allows it
        if out is None:
            out = torch.empty_like(q)
        key_scores = (
            torch.zeros(a.nnz_max, a.num_kv_heads, dtype=torch.float32, device=q.device) if return_key_scores else None
        )
        if self.empty:
            return (out, key_scores) if return_key_scores else out
        split = self.splits > 1
        write_logits = scored and a.decode
        _token_attention_kernel[(self.grid_t, a.num_kv_heads, self.splits)](
            q, kv_cache, self.kv_indices, self.kv_indptr, self.q_ptr_arg, self.tile_req, self.tile_q0,
            out, self.lse, self.mid_o, self.mid_lse, self.logits,
            a.num_reqs, a.num_q_tokens, a.num_q_heads, a.nnz_max, layout.num_slots, self.qk_scale, self.splits,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            layout.stride_block, layout.stride_offset, layout.stride_kv, layout.stride_head,
            SPLIT=split, WRITE_LSE=scored, WRITE_LOGITS=write_logits,
            num_warps=cfg["num_warps"],
            **self.common,
        )
        if split:
            _token_attention_reduce_kernel[(a.num_q_tokens, a.num_q_heads)](
                self.mid_o, self.mid_lse, out, self.lse,
                a.num_q_heads, self.splits, out.stride(0), out.stride(1),
                HEAD_DIM=a.head_dim, BLOCK_D=cfg["BLOCK_D"], SPLITS_P=triton.next_power_of_2(self.splits),
                WRITE_LSE=scored,
                num_warps=4,
            )
        if not scored:
            return out
        ks_arg = key_scores if return_key_scores else self._dummy
        so_arg = score_out if score_out is not None else self._dummy
        starts_arg = self.mirror_starts if score_out is not None else self.kv_indptr
        pos_arg = self.kv_pos if score_out is not None else self.kv_indptr
        flags = dict(KEY_SCORES=return_key_scores, SCORE_OUT=score_out is not None)
        if a.decode:
            _token_attention_logit_scores_kernel[(a.num_reqs, self.score_splits)](
                self.logits, self.lse, self.kv_indices, self.kv_indptr, starts_arg, pos_arg,
                ks_arg, so_arg,
                a.num_q_heads, a.num_kv_heads, a.nnz_max, layout.num_slots, self.score_splits,
                GROUP=a.group, GROUP_P=triton.next_power_of_2(a.group), BLOCK_N=cfg["BLOCK_N"],
                num_warps=4, **flags,
            )
        else:
            _token_attention_key_scores_kernel[(a.num_reqs, self.score_splits)](
                q, kv_cache, self.kv_indices, self.kv_indptr, self.q_ptr_arg, self.lse, starts_arg, pos_arg,
                ks_arg, so_arg,
                a.num_q_tokens, a.num_q_heads, a.num_kv_heads, a.nnz_max, layout.num_slots, self.qk_scale,
                self.score_splits, q.stride(0), q.stride(1),
                layout.stride_block, layout.stride_offset, layout.stride_head,
                num_warps=cfg["num_warps"],
                **self.common, **flags,
            )
        return (out, key_scores) if return_key_scores else out


def workspace_numel(*, num_q_tokens: int, num_q_heads: int, nnz_max: int, head_dim: int, max_reqs: int,
                    scores: bool, device) -> int:
    """float32 elements a :class:`TokenAttentionPlan` on ``device`` takes from its ``workspace``, at most.

    For any step with at most ``num_q_tokens`` query rows, ``max_reqs`` requests and
    ``nnz_max`` listed keys: the dummy pointer, ``lse`` ``[T, Hq]`` (scores), the
    decode split partials ``[R, Hq, splits, BLOCK_D + 1]`` (CUDA only; ``R x splits
    <= R + 2 x SMs`` from :func:`_auto_splits`) and the decode logits ``[Hq, nnz_max]``
    (scores).
    """
    device = torch.device(device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    n = 1
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        rows = min(max_reqs * MAX_SPLITS, max_reqs + 2 * _sm_count(idx))
        n += rows * num_q_heads * (block_d + 1)
    if scores:
        n += num_q_tokens * num_q_heads + num_q_heads * nnz_max
    return n


class _Carver:
    """float32 views carved one after another from a preallocated workspace, or fresh tensors without one."""

    def __init__(self, workspace, device):
        if workspace is not None and (workspace.dtype != torch.float32 or workspace.dim() != 1
                                      or workspace.device.type != device.type):
            raise InvalidArgumentError(f"workspace: expected a 1-D float32 tensor on {device}, got "
                                       f"{workspace.dtype} {tuple(workspace.shape)} on {workspace.device}")
        self.workspace, self.device, self.used = workspace, device, 0

    def __call__(self, *shape):
        if self.workspace is None:
            return torch.empty(*shape, dtype=torch.float32, device=self.device)
        n = 1
        for d in shape:
            n *= d
        if self.used + n > self.workspace.numel():
            raise InvalidArgumentError(f"workspace: expected at least {self.used + n} float32 elements, "
                                       f"got {self.workspace.numel()}")
        out = self.workspace[self.used: self.used + n].view(*shape)
        self.used += n
        return out


def _config(a) -> dict:
    """Tile sizes for the given problem (see the module NOTE on tuning)."""
    block_d = max(16, triton.next_power_of_2(a.head_dim))
    group_p = triton.next_power_of_2(a.group)
    rows_target = 64 if block_d <= 128 else 32
    if a.decode:
        # tl.dot needs >= 16 rows: pad the group (masked rows cost compute, not bandwidth).
        group_p, block_q = max(16, group_p), 1
    else:
        block_q = max(1, rows_target // group_p)
        block_q = max(block_q, 16 // min(group_p, 16))
    return {
        "BLOCK_D": block_d,
        "GROUP_P": group_p,
        "BLOCK_Q": block_q,
        "BLOCK_N": 64 if block_d <= 128 else 32,
        "num_warps": 8 if (block_d > 128 and not a.decode) else 4,
    }


@functools.lru_cache(maxsize=16)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _auto_splits(device: torch.device, num_reqs: int, num_kv_heads: int, nnz_max: int) -> int:
    """Decode kv splits from shapes only (see module docstring); 1 off CUDA."""
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    programs = max(1, num_reqs * num_kv_heads)
    fill = triton.cdiv(2 * _sm_count(idx), programs)
    by_len = max(1, (nnz_max // max(1, num_reqs)) // MIN_KEYS_PER_SPLIT)
    return max(1, min(fill, by_len, MAX_SPLITS))


def _prefill_score_splits(device: torch.device, num_reqs: int, nnz_max: int, block_n: int) -> int:
    """Prefill key-score splits from shapes only; 1 off CUDA (the interpreter)."""
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return score_splits_for(_sm_count(idx), num_reqs, nnz_max, block_n)


def score_splits_for(sm_count: int, num_reqs: int, nnz_max: int, block_n: int) -> int:
    """Key splits per request for the prefill score pass: about two waves of SMs, >= one key tile each.

    NOTE: no MAX_SPLITS cap here (it bounds the decode reduce, which this pass
    does not have): each split owns a disjoint run of whole BLOCK_N key tiles
    and writes its keys alone, so any split count gives bit-identical scores.
    A split's work is O(its keys x the prompt's queries), so one key tile per
    split is worth a program: one 32k-token prompt on 132 SMs gets 264.
    """
    fill = triton.cdiv(2 * sm_count, max(1, num_reqs))
    by_len = max(1, (nnz_max // max(1, num_reqs)) // block_n)
    return max(1, min(fill, by_len))


def _prefill_tiles(q_indptr: torch.Tensor, num_q_tokens: int, block_q: int):
    """Device-side map: tile -> (request, first query token). No host sync.

    The grid is sized by an upper bound on the tile count
    (``ceil(num_q_tokens / BLOCK_Q) + num_reqs``); tiles past the real count get
    request ``num_reqs`` and do nothing.
    """
    num_reqs = q_indptr.numel() - 1
    starts = q_indptr[:-1].to(torch.int64)
    n_new = q_indptr[1:].to(torch.int64) - starts
    tiles = torch.clamp((n_new + block_q - 1) // block_q, min=0)
    cum = torch.cumsum(tiles, 0)
    bound = triton.cdiv(num_q_tokens, block_q) + num_reqs
    pid = torch.arange(bound, device=q_indptr.device, dtype=torch.int64)
    req = torch.searchsorted(cum, pid, right=True)
    req_c = torch.clamp(req, max=num_reqs - 1)
    q0 = starts[req_c] + (pid - (cum - tiles)[req_c]) * block_q
    return req.to(torch.int32), q0.to(torch.int32)


@triton.jit
def _token_attention_reduce_kernel(
    # Inputs
    mid_o_ptr,  # [num_q_tokens, num_q_heads, num_splits, BLOCK_D] fp32, normalized partial outputs
    mid_lse_ptr,  # [num_q_tokens, num_q_heads, num_splits] fp32, base-2 log-sum-exp (-inf: empty split)
    # Outputs
    out_ptr,  # [num_q_tokens, num_q_heads, HEAD_DIM] q dtype (strides stride_ot, stride_oh, 1)
    lse_ptr,  # [num_q_tokens, num_q_heads] fp32 base-2 log-sum-exp (WRITE_LSE)
    # Constants
    num_q_heads,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_P: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """Merge flash-decoding partials. Grid: (num_q_tokens, num_q_heads)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_P)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    row = (t * num_q_heads + h) * num_splits
    lse_s = tl.load(mid_lse_ptr + row + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse_s - m_safe)
    w_sum = tl.sum(w, 0)
    o_s = tl.load(mid_o_ptr + (row + s)[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)
    # w_sum is 0 (no split saw a key), > 0, or NaN (a NaN score): NaN stays NaN in out and lse.
    empty = w_sum == 0
    w_safe = tl.where(empty, 1.0, w_sum)
    o = tl.sum(w[:, None] * o_s, 0) / w_safe
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
    if WRITE_LSE:
        lse = tl.where(empty, float("-inf"), m_safe + tl.log2(w_safe))
        tl.store(lse_ptr + t * num_q_heads + h, lse)


@triton.jit
def _add_scores(
    score_out_ptr, mirror_starts_ptr, kv_pos_ptr, req, kv_start, j, ok, total,
):
    """score_out[mirror_starts[req] + kv_pos[kv_start + j]] += total where ok (one writer per entry)."""
    start = tl.load(mirror_starts_ptr + req)
    pos = tl.load(kv_pos_ptr + kv_start + j, mask=ok, other=0)
    dst = start + pos.to(tl.int64)
    old = tl.load(score_out_ptr + dst, mask=ok, other=0.0)
    tl.store(score_out_ptr + dst, old + total, mask=ok)


@triton.jit
def _token_attention_logit_scores_kernel(
    # Inputs
    logits_ptr,  # [num_q_heads, nnz_max] fp32 base-2 scores written by the main kernel (decode)
    lse_ptr,  # [num_reqs, num_q_heads] fp32 final base-2 log-sum-exp (decode: query r is request r)
    kv_indices_ptr,  # [nnz_max] int32 slots, PAD -1
    kv_indptr_ptr,  # [num_reqs + 1] int32
    mirror_starts_ptr,  # [>= num_reqs] int64 (SCORE_OUT)
    kv_pos_ptr,  # [nnz_max] int32 (SCORE_OUT)
    # Outputs
    key_scores_ptr,  # [nnz_max, num_kv_heads] fp32, pre-zeroed (KEY_SCORES)
    score_out_ptr,  # [mirror_size] fp32, added into (SCORE_OUT)
    # Constants
    num_q_heads,
    num_kv_heads,
    nnz_max,
    num_slots,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KEY_SCORES: tl.constexpr,
    SCORE_OUT: tl.constexpr,
):
    """Decode key scores from stored logits: p = exp2(s - lse), summed over each group's heads.

    Reads 4 * num_q_heads bytes per key instead of K. Grid: (num_reqs, num_splits).
    """
    req = tl.program_id(0)
    split = tl.program_id(1)
    kv_start = tl.load(kv_indptr_ptr + req)
    kv_end = tl.minimum(tl.load(kv_indptr_ptr + req + 1), nnz_max)
    n_live = tl.maximum(kv_end - kv_start, 0)
    chunk = tl.cdiv(tl.cdiv(n_live, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_live)
    r_h = tl.arange(0, GROUP_P)
    h_ok = r_h < GROUP
    for n0 in range(lo, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        in_range = j < hi
        slot = tl.load(kv_indices_ptr + kv_start + j, mask=in_range, other=-1)
        ok = in_range & (slot >= 0) & (slot < num_slots)
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for g in range(0, num_kv_heads):
            head = g * GROUP + r_h
            lse = tl.load(lse_ptr + req.to(tl.int64) * num_q_heads + head, mask=h_ok, other=float("-inf"))
            lse_safe = tl.where(lse == float("-inf"), 0.0, lse)
            mask = h_ok[:, None] & ok[None, :]
            s = tl.load(logits_ptr + head.to(tl.int64)[:, None] * nnz_max + (kv_start + j)[None, :], mask=mask,
                        other=float("-inf"))
            # A NaN lse (a NaN score in the row) passes, so its keys score NaN, as in the reference.
            allowed = mask & (lse[:, None] != float("-inf"))
            ks = tl.sum(tl.where(allowed, tl.exp2(s - lse_safe[:, None]), 0.0), 0)
            if KEY_SCORES:
                tl.store(key_scores_ptr + (kv_start + j).to(tl.int64) * num_kv_heads + g, ks, mask=in_range)
            total += ks
        if SCORE_OUT:
            _add_scores(score_out_ptr, mirror_starts_ptr, kv_pos_ptr, req, kv_start, j, ok, total)


@triton.jit
def _token_attention_key_scores_kernel(
    # Inputs
    q_ptr,  # [num_q_tokens, num_q_heads, HEAD_DIM] (strides stride_qt, stride_qh, 1)
    kv_ptr,  # one layer's cache; (slot, head, d) of K at block*stride_block + off*stride_offset + head*stride_head + d
    kv_indices_ptr,  # [nnz_max] int32 slots, PAD -1
    kv_indptr_ptr,  # [num_reqs + 1] int32
    q_indptr_ptr,  # [num_reqs + 1] int32 (prefill; unused when IS_DECODE)
    lse_ptr,  # [num_q_tokens, num_q_heads] fp32 final base-2 log-sum-exp per query row
    mirror_starts_ptr,  # [>= num_reqs] int64 (SCORE_OUT)
    kv_pos_ptr,  # [nnz_max] int32 (SCORE_OUT)
    # Outputs
    key_scores_ptr,  # [nnz_max, num_kv_heads] fp32, pre-zeroed (KEY_SCORES)
    score_out_ptr,  # [mirror_size] fp32, added into (SCORE_OUT)
    # Constants
    num_q_tokens,
    num_q_heads,
    num_kv_heads,
    nnz_max,
    num_slots,
    qk_scale,  # softmax scale * log2(e)
    num_splits,
    stride_qt,
    stride_qh,
    stride_block,
    stride_offset,
    stride_head,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_DECODE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    KEY_SCORES: tl.constexpr,
    SCORE_OUT: tl.constexpr,
):
    """Prefill key scores: recompute q.k and sum exp2(s - lse) over the request's query rows.

    Reads K once per request (the main pass reads it once per query tile); see
    the module docstring. Grid: (num_reqs, num_splits); kv heads loop inside.
    """
    req = tl.program_id(0)
    split = tl.program_id(1)
    kv_start = tl.load(kv_indptr_ptr + req)
    kv_end = tl.minimum(tl.load(kv_indptr_ptr + req + 1), nnz_max)
    n_live = tl.maximum(kv_end - kv_start, 0)
    if IS_DECODE:
        q_start = req
        q_end = req + 1
    else:
        q_start = tl.load(q_indptr_ptr + req)
        q_end = tl.minimum(tl.load(q_indptr_ptr + req + 1), num_q_tokens)
    n_new = q_end - q_start
    chunk = tl.cdiv(tl.cdiv(n_live, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_live)

    rows = tl.arange(0, BLOCK_Q * GROUP_P)
    r_q = rows // GROUP_P
    r_h = rows % GROUP_P
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    for n0 in range(lo, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        in_range = j < hi
        slot = tl.load(kv_indices_ptr + kv_start + j, mask=in_range, other=-1)
        ok = in_range & (slot >= 0) & (slot < num_slots)
        slot = tl.where(ok, slot, 0)
        base_g0 = (slot // BLOCK_SIZE).to(tl.int64) * stride_block + (slot % BLOCK_SIZE).to(tl.int64) * stride_offset
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        # Query i (0-based in the chunk) sees key j iff j <= n_live - n_new + i.
        first_q = tl.maximum(n0 - (n_live - n_new), 0)
        base = base_g0  # int64 offsets of kv head g's K rows, advanced per head
        for g in range(0, num_kv_heads):
            head = g * GROUP + r_h
            k = tl.load(kv_ptr + base[:, None] + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
            if DOT_UPCAST:
                k = k.to(tl.float32)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for qi0 in range(q_start + first_q, q_end, BLOCK_Q):
                q_tok = qi0 + r_q
                row_ok = (r_h < GROUP) & (q_tok < q_end)
                q_off = q_tok.to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
                qv = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
                if DOT_UPCAST:
                    qv = qv.to(tl.float32)
                lse = tl.load(lse_ptr + q_tok.to(tl.int64) * num_q_heads + head, mask=row_ok, other=float("-inf"))
                lse_safe = tl.where(lse == float("-inf"), 0.0, lse)
                s = tl.dot(qv, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
                lim = n_live - n_new + (q_tok - q_start)
                # A NaN lse (a NaN score in the row) passes, so its keys score NaN, as in the reference.
                allowed = row_ok[:, None] & ok[None, :] & (j[None, :] <= lim[:, None]) & (lse[:, None] != float("-inf"))
                p = tl.where(allowed, tl.exp2(s - lse_safe[:, None]), 0.0)
                acc += tl.sum(p, 0)
            if KEY_SCORES:
                tl.store(key_scores_ptr + (kv_start + j).to(tl.int64) * num_kv_heads + g, acc, mask=in_range)
            total += acc
            base += stride_head
        if SCORE_OUT:
            _add_scores(score_out_ptr, mirror_starts_ptr, kv_pos_ptr, req, kv_start, j, ok, total)


@triton.jit
def _token_attention_kernel(
    # Inputs
    q_ptr,  # [num_q_tokens, num_q_heads, HEAD_DIM] (strides stride_qt, stride_qh, 1)
    kv_ptr,  # one layer's cache: (slot, kv, head, d) at block*stride_block + off*stride_offset
    #          + kv*stride_kv + head*stride_head + d  (block, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE)
    kv_indices_ptr,  # [nnz_max] int32 slots, PAD -1
    kv_indptr_ptr,  # [num_reqs + 1] int32
    q_indptr_ptr,  # [num_reqs + 1] int32 (prefill; unused when IS_DECODE)
    tile_req_ptr,  # [num_tiles_max] int32 request of each query tile, >= num_reqs: empty (prefill)
    tile_q0_ptr,  # [num_tiles_max] int32 first query token of each tile (prefill)
    # Outputs
    out_ptr,  # [num_q_tokens, num_q_heads, HEAD_DIM] q dtype (strides stride_ot, stride_oh, 1); when not SPLIT
    lse_ptr,  # [num_q_tokens, num_q_heads] fp32 base-2 log-sum-exp; when WRITE_LSE and not SPLIT
    mid_o_ptr,  # [num_q_tokens, num_q_heads, num_splits, BLOCK_D] fp32; when SPLIT
    mid_lse_ptr,  # [num_q_tokens, num_q_heads, num_splits] fp32; when SPLIT
    logits_ptr,  # [num_q_heads, nnz_max] fp32 base-2 scores q.k * qk_scale of every key read; when WRITE_LOGITS
    # Constants
    num_reqs,
    num_q_tokens,
    num_q_heads,
    nnz_max,
    num_slots,
    qk_scale,  # softmax scale * log2(e)
    num_splits,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_block,
    stride_offset,
    stride_kv,
    stride_head,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_DECODE: tl.constexpr,
    SPLIT: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    WRITE_LOGITS: tl.constexpr,  # decode only (one query per request: a key's scores are one per q head)
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    """Flash attention over slot-indexed K/V. Grid: (num_tiles, num_kv_heads, num_splits)."""
    pid_t = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    if IS_DECODE:
        req = pid_t
        q_start = req
        q_end = req + 1
        q0 = req
    else:
        tile_req = tl.load(tile_req_ptr + pid_t)
        live_tile = tile_req < num_reqs
        req = tl.where(live_tile, tile_req, 0)
        q0 = tl.load(tile_q0_ptr + pid_t)
        q_start = tl.load(q_indptr_ptr + req)
        # An empty tile gets q_end == q0: no rows, no keys, no stores.
        q_end = tl.where(live_tile, tl.minimum(tl.load(q_indptr_ptr + req + 1), num_q_tokens), q0)
    kv_start = tl.load(kv_indptr_ptr + req)
    kv_end = tl.minimum(tl.load(kv_indptr_ptr + req + 1), nnz_max)
    n_live = tl.maximum(kv_end - kv_start, 0)
    n_new = q_end - q_start
    # Keys the tile's last query may see (causal): list entries [0, n_live - n_new + i_last].
    q_last = tl.minimum(q0 + BLOCK_Q, q_end) - 1
    kv_hi = tl.maximum(tl.minimum(n_live, n_live - n_new + (q_last - q_start) + 1), 0)
    kv_hi = tl.where(q0 < q_end, kv_hi, 0)
    chunk = tl.cdiv(tl.cdiv(kv_hi, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_hi)

    rows = tl.arange(0, BLOCK_Q * GROUP_P)
    r_q = rows // GROUP_P
    r_h = rows % GROUP_P
    q_tok = q0 + r_q
    head = g * GROUP + r_h
    row_ok = (r_h < GROUP) & (q_tok < q_end)
    lim = n_live - n_new + (q_tok - q_start)  # last list entry each row may see
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_off = q_tok.to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    qv = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_UPCAST:
        qv = qv.to(tl.float32)

    m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, BLOCK_D], dtype=tl.float32)
    reads_bad_v = tl.zeros([BLOCK_Q * GROUP_P], dtype=tl.int32)  # 1: the row attends a key with a non-finite V
    for n0 in range(lo, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        in_range = j < hi
        slot = tl.load(kv_indices_ptr + kv_start + j, mask=in_range, other=-1)
        # NOTE: PAD and out-of-range slots are masked, never dereferenced.
        ok = in_range & (slot >= 0) & (slot < num_slots)
        slot = tl.where(ok, slot, 0)
        base = (slot // BLOCK_SIZE).to(tl.int64) * stride_block + (slot % BLOCK_SIZE).to(tl.int64) * stride_offset
        base += g.to(tl.int64) * stride_head
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(kv_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(kv_ptr + stride_kv + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        p_dtype = v.dtype  # P is rounded to the K/V dtype before P @ V, as in flash attention
        if DOT_UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(qv, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if WRITE_LOGITS:
            # The key-score pass normalises these with the final lse instead of reading K again.
            lg_off = head.to(tl.int64)[:, None] * nnz_max + (kv_start + j)[None, :]
            tl.store(logits_ptr + lg_off, s, mask=row_ok[:, None] & in_range[None, :])
        allowed = ok[None, :] & (j[None, :] <= lim[:, None])
        s = tl.where(allowed, s, float("-inf"))
        # NOTE: in P @ V a NaN/Inf in the V of a key that a row may not attend (p = 0) would still
        # give that row 0 * NaN = NaN. Non-finite V elements are zeroed and the rows that do attend
        # such a key are set to NaN after the loop (the reference's semantics). Cost: a compare and
        # a select per V element, on data already in registers (not yet measured on a GPU).
        v_bad = (v != v) | (tl.abs(v) == float("inf"))
        v = tl.where(v_bad, tl.zeros_like(v), v)
        key_bad = tl.max(v_bad.to(tl.int32), 1)  # [BLOCK_N]
        reads_bad_v = tl.maximum(reads_bad_v, tl.max(tl.where(allowed, key_bad[None, :], 0), 1))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no allowed key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(p_dtype).to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # l_i is 0 (no attendable key: zeros, lse -inf), > 0, or NaN (a NaN score: NaN out and lse).
    empty = l_i == 0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    o = tl.where(reads_bad_v[:, None] > 0, float("nan"), o)
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
    row_head = q_tok.to(tl.int64) * num_q_heads + head
    if SPLIT:
        mid_row = row_head * num_splits + split
        tl.store(mid_o_ptr + mid_row[:, None] * BLOCK_D + d[None, :], o, mask=row_ok[:, None])
        tl.store(mid_lse_ptr + mid_row, lse, mask=row_ok)
    else:
        o_off = q_tok.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
        tl.store(
            out_ptr + o_off[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :]
        )
        if WRITE_LSE:
            tl.store(lse_ptr + row_head, lse, mask=row_ok)
