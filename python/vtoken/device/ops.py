"""The one dispatch point for vtoken's kernels.

Order of preference: the compiled extension ``vtoken._C`` (CUDA kernels on GPU
tensors, C++ kernels on CPU tensors) > Triton (on CUDA, or on CPU under
``TRITON_INTERPRET=1``) > the torch reference in :mod:`vtoken.reference`.
When the extension cannot run on a GPU (no kernel image for it, or the CUDA
runtime's query fails, e.g. a CUDA 13 runtime under an older driver), one
warning per device names the cause and its ops fall back to Triton.
``VTOKEN_BACKEND=cuda|triton|torch`` forces one; a forced backend that is not
available raises :class:`~vtoken.errors.BackendUnavailableError` naming the
cause instead of silently falling back. Supported versions: :mod:`vtoken.versions`.

Runtime modules call these functions, never a backend directly. Each op
checks its argument contract (:mod:`vtoken_kernels.contracts`) once, then
dispatches; the backends take validated arguments and do not check again.
"""
from __future__ import annotations

import functools
import importlib
import os
import warnings

import torch

from vtoken import versions
from vtoken.errors import BackendUnavailableError, InvalidArgumentError, check_int, check_tensor
from vtoken_kernels import contracts

versions.check_torch(torch.__version__)

BACKENDS = ("cuda", "triton", "torch")


@functools.lru_cache(maxsize=1)
def extension_loaded() -> bool:
    """True when ``vtoken._C`` was built and registered its ``torch.ops.vtoken`` ops."""
    try:
        importlib.import_module("vtoken._C")
    except ImportError:
        return False
    return True


def has_extension_op(name: str) -> bool:
    return extension_loaded() and hasattr(torch.ops.vtoken, name)


def extension_runs_on(device: torch.device) -> bool:
    """Whether ``vtoken._C``'s ops can run on ``device``: always on CPU; on a GPU, when it holds code for it."""
    return _extension_cause(device) is None


def _extension_cause(device: torch.device) -> str | None:
    """Why ``vtoken._C``'s ops cannot run on ``device``, or ``None`` when they can."""
    if device.type != "cuda" or not has_extension_op("kernel_image_status"):
        return None  # the CPU; or a vtoken._C built before the query existed: dispatch as it always did
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    return _extension_cuda_cause(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _extension_cuda_cause(index: int) -> str | None:
    """Asks the CUDA runtime once per device (see :func:`extension_runs_on`).

    NOTE: the extension carries SASS for the archs it was built for plus
    compute_90 PTX (csrc/build_ext.py); on a GPU it has no code for, its ops
    load and then fail at launch with "no kernel image", and under a driver
    older than its CUDA runtime every CUDA call fails, so dispatch asks up
    front. ``vtoken::kernel_image_status`` reports either as a cause string
    instead of raising: no exception is caught to find out.
    """
    ok, cause = torch.ops.vtoken.kernel_image_status(index)
    return None if ok else cause


@functools.lru_cache(maxsize=None)
def _warn_extension_skipped(device: str, cause: str) -> None:
    """One warning per device (and cause) when dispatch skips the extension's CUDA kernels."""
    warnings.warn(f"vtoken: vtoken._C's CUDA kernels cannot run on {device}: {cause}; its ops fall back to "
                  "Triton (VTOKEN_BACKEND forces a backend)", RuntimeWarning, stacklevel=3)


def _triton_cause(device: torch.device) -> str | None:
    """Why Triton cannot run on ``device``, or ``None`` when it can."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton needs CUDA or TRITON_INTERPRET=1"
    return versions.installed_triton_problem()


@functools.lru_cache(maxsize=None)
def _warn_triton_skipped(cause: str) -> None:
    """One warning when a GPU op skips Triton for the torch reference (a CPU tensor without interpreter is routine)."""
    warnings.warn(f"vtoken: the Triton backend is unavailable: {cause}; ops fall back to the torch reference",
                  RuntimeWarning, stacklevel=3)


def select_backend(op: str, device: torch.device, *, has_cuda_impl: bool = True) -> str:
    """Pick the backend for ``op`` on ``device`` (see module docstring)."""
    forced = os.environ.get("VTOKEN_BACKEND", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise InvalidArgumentError(f"VTOKEN_BACKEND: expected one of {BACKENDS}, got {forced!r}")
        if forced == "cuda" and not (has_cuda_impl and has_extension_op(op)):
            raise BackendUnavailableError(f"VTOKEN_BACKEND=cuda: the extension op vtoken::{op} is not available")
        if forced == "cuda" and (cause := _extension_cause(device)) is not None:
            raise BackendUnavailableError(f"VTOKEN_BACKEND=cuda: vtoken._C cannot run on {device}: {cause}")
        if forced == "triton" and (cause := _triton_cause(device)) is not None:
            raise BackendUnavailableError(f"VTOKEN_BACKEND=triton: {cause}")
        return forced
    if has_cuda_impl and has_extension_op(op):
        cause = _extension_cause(device)
        if cause is None:
            return "cuda"
        _warn_extension_skipped(str(device), cause)
    cause = _triton_cause(device)
    if cause is None:
        return "triton"
    if device.type == "cuda":
        _warn_triton_skipped(cause)
    return "torch"


# --- ops -----------------------------------------------------------------
# Each op below: validate with its contract, then dispatch with select_backend().


def token_attention(q, kv_cache, layout, kv_indices, kv_indptr, q_indptr=None, *, scale=None,
                    return_key_scores=False, out=None, score_out=None, mirror_starts=None, kv_pos=None):
    """Attention that reads K/V through per-token slots (decode, or varlen prefill with ``q_indptr``).

    ``q`` ``[num_q_tokens, num_q_heads, head_dim]`` fp16/bf16/fp32; ``kv_cache`` one
    layer's cache described by ``layout`` (``num_kv == 2``); int32 ``kv_indices
    [nnz_max]`` / ``kv_indptr [num_reqs+1]`` (PAD past ``kv_indptr[-1]``); int32
    ``q_indptr [num_reqs+1]`` or ``None`` (one query per request). Returns ``out``
    (dtype of ``q``) or ``(out, key_scores)`` with float32 ``key_scores [nnz_max,
    num_kv_heads]``. With float32 ``score_out [mirror_size]``, int64
    ``mirror_starts [>= num_reqs]`` and int32 ``kv_pos [nnz_max]``, each key's
    probability mass (all query heads, all the step's queries) is added into
    ``score_out[mirror_starts[r] + kv_pos[j]]`` in place. Full semantics, NaN
    propagation included: :mod:`vtoken.reference.token_attention`. Contract:
    :func:`vtoken_kernels.contracts.validate_token_attention_args`.
    Backends: on CPU tensors the C++ kernel ``torch.ops.vtoken.token_attention``
    (``vtoken._C``), on GPUs Triton (there is no CUDA C++ implementation), else the
    torch reference. A one-shot :func:`plan_token_attention` + ``run``; a caller with many layers
    plans once per step instead.
    """
    check_tensor("q", q)
    backend = select_backend("token_attention", q.device, has_cuda_impl=_attention_ext_runs_on(q.device))
    # The reference reads the index tensors on the host anyway: its content checks cost no extra sync.
    a = contracts.validate_token_attention_args(
        q, kv_cache, layout, kv_indices, kv_indptr, q_indptr, scale=scale, out=out, mirror_starts=mirror_starts,
        kv_pos=kv_pos, score_out=score_out, content_checks=True if backend == "torch" else None)
    plan = _make_plan(backend, a, layout, kv_indices, kv_indptr, q_indptr, q.dtype, q.device, scale,
                      return_key_scores or score_out is not None, mirror_starts, kv_pos)
    return plan.run(q, kv_cache, out=out, return_key_scores=return_key_scores, score_out=score_out)


class TokenAttentionStep:
    """``token_attention`` planned once per step (FlashInfer's plan/run): :meth:`run` once per layer.

    Built by :func:`plan_token_attention`, which checked the step's half of the
    contract; :meth:`run` checks the layer's half, O(1) (tensor metadata only),
    then launches. See :func:`plan_token_attention`.
    """

    def __init__(self, plan, a, layout, dtype, scores: bool, scored: bool):
        self.plan, self.args, self.layout, self.dtype = plan, a, layout, dtype
        self._scores, self._scored = scores, scored

    def run(self, q, kv_cache, *, out=None, return_key_scores=False, score_out=None):
        """One layer's attention: ``out`` or ``(out, key_scores)``; adds into ``score_out`` when given.

        ``q`` ``[num_q_tokens, num_q_heads, head_dim]`` (as planned), ``kv_cache``
        this layer's cache (the planned layout), ``out`` optional (shape and dtype
        of ``q``), ``score_out`` optional float32 ``[mirror_size]`` (needs a plan
        with ``mirror_starts`` / ``kv_pos``).
        """
        contracts.validate_token_attention_layer_args(self.args, self.layout, q, kv_cache, out=out,
                                                      score_out=score_out, scored=self._scored)
        if q.dtype != self.dtype:
            raise InvalidArgumentError(f"q: expected dtype {self.dtype} as planned, got {q.dtype}")
        if (return_key_scores or score_out is not None) and not self._scores:
            raise InvalidArgumentError("return_key_scores: expected a plan built with scores=True, got scores=False")
        if score_out is not None and contracts._content_checks(q.device, None):
            # Same rule as the one-shot op: on CPU tensors or under VTOKEN_DEBUG_INVARIANTS=1.
            kv_indices, kv_indptr, mirror_starts, kv_pos = self.index_tensors
            contracts.check_score_destinations(kv_indices, kv_indptr, self.layout.num_slots, mirror_starts, kv_pos,
                                               score_out.numel())
        return self.plan.run(q, kv_cache, out=out, return_key_scores=return_key_scores, score_out=score_out)


def plan_token_attention(layout, kv_indices, kv_indptr, q_indptr=None, *, num_q_heads, dtype, num_q_tokens=None,
                         scale=None, scores=False, mirror_starts=None, kv_pos=None, workspace=None):
    """Plan one step of :func:`token_attention` over the step's fixed-address slot lists.

    Validates the step's half of the contract once (slot lists, ``mirror_starts``
    / ``kv_pos``; content checks under the usual rule), picks splits and tiles and
    allocates the workspaces. The returned :class:`TokenAttentionStep`'s ``run(q,
    kv_cache, out=..., score_out=...)`` is called once per layer, does O(1)
    checks and, given ``out``, allocates nothing (CUDA-graph capturable).
    ``kv_indices`` / ``kv_indptr`` / ``mirror_starts`` / ``kv_pos`` may be
    overwritten in place (same shapes) between runs. NOTE: a prefill plan reads
    ``q_indptr`` once, to lay out its query tiles: plan again when it changes.

    Args:
        layout: :class:`vtoken.layout.KVLayout` shared by every layer's cache.
        kv_indices: int32 ``[nnz_max]``; kv_indptr: int32 ``[num_reqs + 1]``;
            q_indptr: int32 ``[num_reqs + 1]`` (varlen prefill) or ``None`` (decode).
        num_q_heads: query heads; ``dtype``: of ``q`` and the caches (device: ``kv_indices``'s).
        num_q_tokens: rows of every layer's ``q``; required with ``q_indptr`` (reading
            ``q_indptr[-1]`` would be a host sync), ``num_reqs`` in decode.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        scores: allocate the score workspaces (``return_key_scores`` / ``score_out`` need them).
        mirror_starts: int64 ``[>= num_reqs]``; kv_pos: int32 ``[nnz_max]``: where
            each key's mass goes in ``score_out`` (``mirror_starts[r] + kv_pos[j]``).
        workspace: float32 ``[n]`` or None: the Triton plan carves its float workspaces
            from it rather than allocating them (n from
            :func:`vtoken_kernels.token_attention.workspace_numel`); the torch
            reference allocates its own.

    Example::

        >>> import torch
        >>> from vtoken.device import ops
        >>> from vtoken.layout import KVLayout, kv_cache_shape
        >>> caches = [torch.randn(kv_cache_shape("nhd", 4, 16, 2, 64)) for _ in range(2)]
        >>> lay = KVLayout.from_tensor(caches[0], "nhd")
        >>> idx, ptr = torch.tensor([3, 17, 40], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
        >>> step = ops.plan_token_attention(lay, idx, ptr, num_q_heads=4, dtype=torch.float32, scores=True,
        ...     mirror_starts=torch.zeros(1, dtype=torch.int64), kv_pos=torch.tensor([0, 1, 2], dtype=torch.int32))
        >>> token_scores = torch.zeros(3)
        >>> for cache in caches:
        ...     o = step.run(torch.randn(1, 4, 64), cache, score_out=token_scores)
        >>> round(float(token_scores.sum()), 4)  # 2 layers x 4 query heads x 1 query
        8.0
    """
    check_tensor("kv_indices", kv_indices)
    check_tensor("kv_indptr", kv_indptr)
    device = kv_indices.device
    if dtype not in contracts.ATTN_DTYPES:
        raise InvalidArgumentError(f"dtype: expected one of {list(contracts.ATTN_DTYPES)}, got {dtype}")
    if num_q_tokens is None:
        if q_indptr is not None:
            raise InvalidArgumentError("num_q_tokens: expected an int with q_indptr (prefill), got None")
        num_q_tokens = kv_indptr.numel() - 1
    num_q_tokens = check_int("num_q_tokens", num_q_tokens, min_value=0)
    num_q_heads = check_int("num_q_heads", num_q_heads, min_value=1)
    backend = select_backend("token_attention", device, has_cuda_impl=_attention_ext_runs_on(device))
    a = contracts.validate_token_attention_step_args(
        layout, kv_indices, kv_indptr, q_indptr, num_q_tokens=num_q_tokens, num_q_heads=num_q_heads,
        head_dim=getattr(layout, "head_dim", 0), device=device, scale=scale, mirror_starts=mirror_starts,
        kv_pos=kv_pos, content_checks=True if backend == "torch" else None)
    plan = _make_plan(backend, a, layout, kv_indices, kv_indptr, q_indptr, dtype, device, scale, scores,
                      mirror_starts, kv_pos, workspace)
    step = TokenAttentionStep(plan, a, layout, dtype, bool(scores), mirror_starts is not None)
    step.index_tensors = (kv_indices, kv_indptr, mirror_starts, kv_pos)
    return step


def _attention_ext_runs_on(device: torch.device) -> bool:
    # NOTE: vtoken::token_attention is registered for CPU tensors only; GPUs take Triton.
    return torch.device(device).type == "cpu"


class TokenAttentionExtensionPlan:
    """The extension backend's plan (CPU): ``run`` calls ``torch.ops.vtoken.token_attention``.

    Same interface as :class:`vtoken_kernels.token_attention.TokenAttentionPlan`;
    validation happened in :func:`plan_token_attention` / :func:`token_attention`.
    With ``scores``, a ``[nnz_max, num_kv_heads]`` float32 workspace is kept for
    ``score_out`` runs that do not return the key scores.
    """

    def __init__(self, a, layout, kv_indices, kv_indptr, q_indptr, *, scores, mirror_starts, kv_pos,
                 workspace=None):
        self.a, self.kv_indices, self.kv_indptr, self.q_indptr = a, kv_indices, kv_indptr, q_indptr
        self.mirror_starts, self.kv_pos = mirror_starts, kv_pos
        self.layout_args = contracts.layout_op_args(layout)
        self.workspace = None
        if scores:  # a caller's preallocated float32 workspace serves, as it does the Triton plan
            need = a.nnz_max * a.num_kv_heads
            if workspace is not None and (workspace.dtype != torch.float32 or workspace.dim() != 1
                                          or workspace.device != kv_indices.device):
                raise InvalidArgumentError(f"workspace: expected a 1-D float32 tensor on {kv_indices.device}, got "
                                           f"{workspace.dtype} {tuple(workspace.shape)} on {workspace.device}")
            # NOTE: slot lists grown past the caller's workspace (shared prefixes in vLLM) get a buffer of
            # their own: the CPU captures no graph, so an allocation here costs time, not correctness.
            if workspace is not None and workspace.numel() >= need:
                self.workspace = workspace[:need].view(a.nnz_max, a.num_kv_heads)
            else:
                self.workspace = torch.empty(a.nnz_max, a.num_kv_heads, dtype=torch.float32, device=kv_indices.device)

    def run(self, q, kv_cache, *, out=None, return_key_scores=False, score_out=None):
        """One layer: ``out`` or ``(out, key_scores)``; adds into ``score_out`` when given."""
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        ks = None
        if return_key_scores:
            ks = torch.empty(self.a.nnz_max, self.a.num_kv_heads, dtype=torch.float32, device=q.device)
        elif score_out is not None:
            ks = self.workspace
        scored = score_out is not None
        torch.ops.vtoken.token_attention(
            q, kv_cache, self.kv_indices, self.kv_indptr, self.q_indptr, out, ks, score_out,
            self.mirror_starts if scored else None, self.kv_pos if scored else None, self.a.scale,
            *self.layout_args)
        return (out, ks) if return_key_scores else out


def _make_plan(backend, a, layout, kv_indices, kv_indptr, q_indptr, dtype, device, scale, scores,
               mirror_starts, kv_pos, workspace=None):
    if backend == "cuda":
        return TokenAttentionExtensionPlan(a, layout, kv_indices, kv_indptr, q_indptr, scores=scores,
                                           mirror_starts=mirror_starts, kv_pos=kv_pos, workspace=workspace)
    if backend == "triton":
        from vtoken_kernels.token_attention import TokenAttentionPlan

        return TokenAttentionPlan(a, layout, kv_indices, kv_indptr, q_indptr, dtype=dtype, device=device,
                                  scores=scores, mirror_starts=mirror_starts, kv_pos=kv_pos, workspace=workspace)
    from vtoken.reference.token_attention import TokenAttentionReferencePlan

    return TokenAttentionReferencePlan(layout, kv_indices, kv_indptr, q_indptr, scale=scale,
                                       mirror_starts=mirror_starts, kv_pos=kv_pos)


# --- compact_kv ------------------------------------------------------------


def compact_kv(kv_caches, layout, src_slots, dst_slots, *, validate=None) -> None:
    """Relocate live tokens in the KV caches of every layer, in one launch (in place).

    For each move ``m`` whose slots are not PAD, copies the rows of slot
    ``src_slots[m]`` (K and V of every head, or the MLA latent) to slot
    ``dst_slots[m]`` in every layer's cache, bit-exactly for any dtype.

    Parameters
    ----------
    kv_caches : list[torch.Tensor]
        One cache per layer, all with the same shape, strides, dtype (fp16,
        bf16, fp32, fp8 e4m3/e5m2, uint8/int8) and device, e.g. vLLM's
        ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``. K and V kept
        in separate tensors are passed as separate list entries with a
        ``num_kv=1`` layout.
    layout : vtoken.layout.KVLayout
        Describes each tensor (``KVLayout.from_tensor(kv_caches[0], name)``).
    src_slots, dst_slots : torch.Tensor
        int32 ``[M]`` on the caches' device, slots ``block * block_size + offset``.
        A pair with a PAD (-1) side is skipped, so a fixed-size PAD-filled buffer
        can be replayed in a CUDA graph.
    validate : bool | None
        Check the contract before copying: slots in ``[-1, num_slots)``,
        destinations unique and disjoint from the sources. It syncs with the
        device, so it is off unless ``True`` or ``VTOKEN_DEBUG_INVARIANTS=1``.
        Violations raise ``InvalidArgumentError`` with every cache untouched.
        Without validation, out-of-range moves are skipped and a contract
        violation gives an unspecified result.

    Example
    -------
    >>> import torch
    >>> from vtoken.layout import KVLayout, kv_cache_shape
    >>> from vtoken.device.ops import compact_kv
    >>> caches = [torch.randn(kv_cache_shape("nhd", 4, 16, 2, 64)) for _ in range(3)]
    >>> layout = KVLayout.from_tensor(caches[0], "nhd")
    >>> src = torch.tensor([17, 40], dtype=torch.int32)
    >>> dst = torch.tensor([0, 1], dtype=torch.int32)
    >>> compact_kv(caches, layout, src, dst)
    >>> bool(torch.equal(caches[2][0, :, 1], caches[2][2, :, 8]))
    True

    Backends: ``torch.ops.vtoken.compact_kv`` (CUDA kernel, or the C++ kernel
    on CPU tensors) > Triton > :mod:`vtoken.reference.compact_kv`. Contract:
    :func:`vtoken_kernels.contracts.check_compact_kv_args` (the layout is
    checked against the caches' shape and strides, dim for dim).
    """
    contracts.check_compact_kv_args(kv_caches, layout, src_slots, dst_slots, validate=validate)
    backend = select_backend("compact_kv", kv_caches[0].device)
    if backend == "cuda":
        torch.ops.vtoken.compact_kv(
            list(kv_caches), src_slots.contiguous(), dst_slots.contiguous(), *contracts.layout_op_args(layout)
        )
    elif backend == "triton":
        from vtoken_kernels.compact_kv import compact_kv as impl

        impl(kv_caches, layout, src_slots, dst_slots)
    else:
        from vtoken.reference.compact_kv import compact_kv as impl

        impl(kv_caches, layout, src_slots, dst_slots)


# --- build_slot_lists / block_live_counts ------------------------------------


def build_slot_lists(slots, alive, mirror_starts, num_tokens, new_token_counts, kv_indices, kv_indptr, slot_mapping,
                     kv_pos=None, num_reqs=None) -> None:
    """Rebuild a batch's attention inputs from the device mirror, in place (no host sync).

    Request ``r`` of the batch (``0 <= r < num_reqs``, in batch order) owns the
    mirror positions ``[mirror_starts[r], mirror_starts[r] + num_tokens[r])``,
    its tokens in logical order; its last ``new_token_counts[r]`` tokens are
    new. Requests may come in any order and with gaps between their ranges,
    which must not overlap.

    Parameters
    ----------
    slots : torch.Tensor
        int32 ``[T]``, the mirror's per-token slots.
    alive : torch.Tensor
        int8 or bool ``[T]``, the mirror's alive bits.
    mirror_starts : torch.Tensor
        int64 ``[>= num_reqs]``: where each request's tokens begin.
    num_tokens : torch.Tensor
        int32 or int64 ``[>= num_reqs]``: each request's token count.
    new_token_counts : torch.Tensor
        int32 or int64 ``[>= num_reqs]``: each request's new tokens (its last ones).
    kv_indices : torch.Tensor
        int32 ``[nnz_max]``, output: live slots packed per request in batch order, PAD tail.
    kv_indptr : torch.Tensor
        int32 ``[max_reqs + 1]``, output: exclusive prefix of the live counts, the
        total repeated past ``num_reqs``.
    slot_mapping : torch.Tensor
        int32 ``[max_tokens]``, output: the new tokens' slots packed per request, PAD tail.
    kv_pos : torch.Tensor | None
        int32 ``[nnz_max]``, optional output: each ``kv_indices`` entry's position in its
        request (its logical token id, so its mirror position is ``mirror_starts[r] +
        kv_pos[j]``), PAD tail.
    num_reqs : int | None
        Requests in the batch; defaults to ``len(mirror_starts)``.

    Contract (capacity included) and overflow behaviour:
    :mod:`vtoken_kernels.contracts`; contents are checked on the host for CPU
    tensors or under ``VTOKEN_DEBUG_INVARIANTS=1``, before anything is written.

    Example
    -------
    >>> import torch
    >>> from vtoken.device.ops import build_slot_lists
    >>> slots = torch.tensor([20, 21, -1, 5, 6, 7], dtype=torch.int32)
    >>> alive = torch.tensor([1, 1, 0, 1, 0, 1], dtype=torch.int8)
    >>> starts = torch.tensor([3, 0])  # request 0 at [3, 6), request 1 at [0, 2)
    >>> n, new = torch.tensor([3, 2]), torch.tensor([1, 1])
    >>> idx, ip, sm, pos = (torch.empty(6, dtype=torch.int32), torch.empty(4, dtype=torch.int32),
    ...                     torch.empty(3, dtype=torch.int32), torch.empty(6, dtype=torch.int32))
    >>> build_slot_lists(slots, alive, starts, n, new, idx, ip, sm, kv_pos=pos)
    >>> idx.tolist(), ip.tolist(), sm.tolist(), pos.tolist()
    ([5, 7, 20, 21, -1, -1], [0, 2, 4, 4], [7, 21, -1], [0, 2, 0, 1, -1, -1])

    Backends: ``torch.ops.vtoken.build_slot_lists`` (CUDA, or C++ on CPU
    tensors) > Triton > :mod:`vtoken.reference.build_slot_lists`.
    """
    args = (slots, alive, mirror_starts, num_tokens, new_token_counts, kv_indices, kv_indptr, slot_mapping, kv_pos)
    n = contracts.validate_slot_list_args(*args, num_reqs)
    backend = select_backend("build_slot_lists", slots.device)
    if backend == "cuda":
        torch.ops.vtoken.build_slot_lists(*args, n)
    else:
        if backend == "triton":
            from vtoken_kernels.build_slot_lists import build_slot_lists as impl
        else:
            from vtoken.reference.build_slot_lists import build_slot_lists as impl
        impl(*args, n)


def block_live_counts(slots, alive, num_blocks: int, block_size: int, allocated=None):
    """Live tokens per physical block and the waste ratio F, without a host sync.

    ``slots[T]`` int32, ``alive[T]`` int8/bool; ``allocated[num_blocks]``
    bool/int8 or ``None`` (every block). Returns ``(counts, F)``: int32
    ``counts[num_blocks]`` (PAD and out-of-range slots skipped) and a 0-dim
    float32 ``F = 1 - sum(counts[allocated]) / (num_allocated * block_size)``
    on the input's device. Semantics: :mod:`vtoken.reference.block_live_counts`.

    Example
    -------
    >>> import torch
    >>> from vtoken.device.ops import block_live_counts
    >>> slots = torch.tensor([0, 1, 17, -1], dtype=torch.int32)
    >>> alive = torch.tensor([True, False, True, True])
    >>> counts, f = block_live_counts(slots, alive, num_blocks=2, block_size=16)
    >>> counts.tolist(), round(float(f), 4)
    ([1, 1], 0.9375)

    Backends: ``torch.ops.vtoken.block_live_counts`` > Triton > reference.
    Contract: :func:`vtoken_kernels.contracts.validate_block_live_counts_args`.
    """
    contracts.validate_block_live_counts_args(slots, alive, num_blocks, block_size, allocated)
    backend = select_backend("block_live_counts", slots.device)
    if backend == "cuda":
        counts, f = torch.ops.vtoken.block_live_counts(slots, alive, allocated, num_blocks, block_size)
        return counts, f
    if backend == "triton":
        from vtoken_kernels.block_live_counts import block_live_counts as impl
    else:
        from vtoken.reference.block_live_counts import block_live_counts as impl
    return impl(slots, alive, num_blocks, block_size, allocated)
