"""The one dispatch point for vtoken's kernels.

Order of preference: the compiled extension ``vtoken._C`` (CUDA kernels on GPU
tensors, C++ kernels on CPU tensors) > Triton (on CUDA, or on CPU under
``TRITON_INTERPRET=1``) > the torch reference in :mod:`vtoken.reference`.
``VTOKEN_BACKEND=cuda|triton|torch`` forces one; a forced backend that is not
available raises instead of silently falling back.

Runtime modules call these functions, never a backend directly.
"""
from __future__ import annotations

import functools
import importlib
import os
import warnings

import torch

from vtoken.errors import InvalidArgumentError

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
    if device.type != "cuda":
        return True
    return _extension_has_cuda_image(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _extension_has_cuda_image(index: int) -> bool:
    """Asks the CUDA runtime once per device (see :func:`extension_runs_on`).

    NOTE: the extension carries SASS for the archs it was built for plus
    compute_90 PTX (csrc/build_ext.py); on a GPU it has no code for, its ops
    load and then fail at launch with "no kernel image", so dispatch asks up
    front. Only with CUDA available; no exception is caught to find out.
    """
    if not has_extension_op("has_cuda_kernel_image"):
        return True  # a vtoken._C built before the query existed: dispatch as it always did
    return torch.cuda.is_available() and bool(torch.ops.vtoken.has_cuda_kernel_image(index))


@functools.lru_cache(maxsize=None)
def _warn_no_kernel_image(op: str, device: str) -> None:
    """One line per (op, device) when dispatch skips the extension op."""
    warnings.warn(f"vtoken: vtoken._C has no kernel image for {device}; {op} falls back to Triton "
                  f"(rebuild with VTOKEN_NVCC_GENCODE for this GPU)", RuntimeWarning, stacklevel=3)


def _triton_usable(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


def select_backend(op: str, device: torch.device, *, has_cuda_impl: bool = True) -> str:
    """Pick the backend for ``op`` on ``device`` (see module docstring)."""
    forced = os.environ.get("VTOKEN_BACKEND", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise InvalidArgumentError(f"VTOKEN_BACKEND: expected one of {BACKENDS}, got {forced!r}")
        if forced == "cuda" and not (has_cuda_impl and has_extension_op(op)):
            raise InvalidArgumentError(f"VTOKEN_BACKEND=cuda: the extension op vtoken::{op} is not available")
        if forced == "cuda" and not extension_runs_on(device):
            raise InvalidArgumentError(f"VTOKEN_BACKEND=cuda: expected a vtoken._C with code for {device}'s GPU, "
                                       "got one with no kernel image for it")
        if forced == "triton" and not _triton_usable(device):
            raise InvalidArgumentError("VTOKEN_BACKEND=triton: Triton needs CUDA or TRITON_INTERPRET=1")
        return forced
    if has_cuda_impl and has_extension_op(op):
        if extension_runs_on(device):
            return "cuda"
        _warn_no_kernel_image(op, str(device))
    if _triton_usable(device):
        return "triton"
    return "torch"


# --- ops -----------------------------------------------------------------
# Each op below: validate in the reference/launcher, dispatch with select_backend().


def token_attention(q, kv_cache, layout, kv_indices, kv_indptr, q_indptr=None, *, scale=None,
                    return_key_scores=False, out=None):
    """Attention that reads K/V through per-token slots (decode, or varlen prefill with ``q_indptr``).

    ``q`` ``[num_q_tokens, num_q_heads, head_dim]`` fp16/bf16/fp32; ``kv_cache`` one
    layer's cache described by ``layout`` (``num_kv == 2``); int32 ``kv_indices
    [nnz_max]`` / ``kv_indptr [num_reqs+1]`` (PAD past ``kv_indptr[-1]``); int32
    ``q_indptr [num_reqs+1]`` or ``None`` (one query per request). Returns ``out``
    (dtype of ``q``) or ``(out, key_scores)`` with float32 ``key_scores [nnz_max,
    num_kv_heads]``. Full semantics: :mod:`vtoken.reference.token_attention`.
    Backends: Triton, else the torch reference (no CUDA C++ implementation).
    """
    from vtoken.errors import check_tensor

    check_tensor("q", q)
    backend = select_backend("token_attention", q.device, has_cuda_impl=False)
    if backend == "triton":
        from vtoken_kernels.token_attention import token_attention as impl
    else:
        from vtoken.reference.token_attention import token_attention as impl
    return impl(q, kv_cache, layout, kv_indices, kv_indptr, q_indptr, scale=scale,
                return_key_scores=return_key_scores, out=out)


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
    >>> from vtoken.ops import compact_kv
    >>> caches = [torch.randn(kv_cache_shape("nhd", 4, 16, 2, 64)) for _ in range(3)]
    >>> layout = KVLayout.from_tensor(caches[0], "nhd")
    >>> src = torch.tensor([17, 40], dtype=torch.int32)
    >>> dst = torch.tensor([0, 1], dtype=torch.int32)
    >>> compact_kv(caches, layout, src, dst)
    >>> bool(torch.equal(caches[2][0, :, 1], caches[2][2, :, 8]))
    True

    Backends: ``torch.ops.vtoken.compact_kv`` (CUDA kernel, or the C++ kernel
    on CPU tensors) > Triton > :mod:`vtoken.reference.compact_kv`.
    """
    from vtoken.reference import compact_kv as ref

    backend = select_backend("compact_kv", ref.cache_device(kv_caches))
    if backend == "cuda":
        ref.check_compact_kv_args(kv_caches, layout, src_slots, dst_slots, validate=validate)
        torch.ops.vtoken.compact_kv(
            list(kv_caches), src_slots.contiguous(), dst_slots.contiguous(), *ref.layout_op_args(layout)
        )
    elif backend == "triton":
        from vtoken_kernels.compact_kv import compact_kv as impl

        impl(kv_caches, layout, src_slots, dst_slots, validate=validate)
    else:
        ref.compact_kv(kv_caches, layout, src_slots, dst_slots, validate=validate)


# --- build_slot_lists / append_slot_lists / block_live_counts ----------------


def build_slot_lists(slots, alive, mirror_offsets, new_token_counts, kv_indices, kv_indptr, slot_mapping,
                     num_reqs=None) -> None:
    """Rebuild a batch's attention inputs from the device mirror, in place (no host sync).

    Inputs: int32 ``slots[T]`` and int8/bool ``alive[T]`` (the batch's requests'
    tokens, concatenated in logical order), int32/int64 ``mirror_offsets[>=
    num_reqs+1]`` (request ``r`` is ``[offsets[r], offsets[r+1])``), int32/int64
    ``new_token_counts[>= num_reqs]`` (each request's last tokens that are new).
    Outputs, overwritten at fixed addresses: int32 ``kv_indices[nnz_max]`` (live
    slots, packed per request, PAD tail), int32 ``kv_indptr[max_reqs+1]``
    (exclusive prefix of live counts, the total repeated past ``num_reqs``),
    int32 ``slot_mapping[max_tokens]`` (new tokens' slots, PAD tail).
    ``num_reqs`` defaults to ``len(mirror_offsets) - 1``. Contract (capacity
    included) and overflow behaviour: :mod:`vtoken.reference.build_slot_lists`;
    checked on the host for CPU tensors or under ``VTOKEN_DEBUG_INVARIANTS=1``.

    Example
    -------
    >>> import torch
    >>> from vtoken.ops import build_slot_lists
    >>> slots = torch.tensor([5, 6, 7, 20, 21], dtype=torch.int32)
    >>> alive = torch.tensor([1, 0, 1, 1, 1], dtype=torch.int8)
    >>> offsets = torch.tensor([0, 3, 5])
    >>> new = torch.tensor([1, 1])
    >>> idx, ip, sm = (torch.empty(6, dtype=torch.int32), torch.empty(4, dtype=torch.int32),
    ...                torch.empty(3, dtype=torch.int32))
    >>> build_slot_lists(slots, alive, offsets, new, idx, ip, sm)
    >>> idx.tolist(), ip.tolist(), sm.tolist()
    ([5, 7, 20, 21, -1, -1], [0, 2, 4, 4], [7, 21, -1])

    Backends: ``torch.ops.vtoken.build_slot_lists`` (CUDA, or C++ on CPU
    tensors) > Triton > :mod:`vtoken.reference.build_slot_lists`.
    """
    _slot_lists("build_slot_lists", slots, alive, mirror_offsets, new_token_counts, kv_indices, kv_indptr,
                slot_mapping, num_reqs)


def append_slot_lists(slots, alive, mirror_offsets, new_token_counts, kv_indices, kv_indptr, slot_mapping,
                      num_reqs=None) -> None:
    """Append-only fast path of :func:`build_slot_lists`; same arguments, same result.

    Precondition: the buffers hold a build over the same requests (new ones may
    follow at the end) and since then request ``r`` only appended its last
    ``new_token_counts[r]`` tokens (no eviction, no move, no removal).
    ``mirror_offsets`` / ``new_token_counts`` describe the mirror after the
    appends. Cost: O(appended + requests) when no segment has to shift, else one
    read + write of every entry behind the first appending request (see
    :mod:`vtoken_kernels.build_slot_lists`). Under ``VTOKEN_DEBUG_INVARIANTS=1``
    the precondition is verified on the host first (a sync).
    """
    _slot_lists("append_slot_lists", slots, alive, mirror_offsets, new_token_counts, kv_indices, kv_indptr,
                slot_mapping, num_reqs)


def _slot_lists(op, slots, alive, mirror_offsets, new_token_counts, kv_indices, kv_indptr, slot_mapping, num_reqs):
    from vtoken.reference import build_slot_lists as ref

    args = (slots, alive, mirror_offsets, new_token_counts, kv_indices, kv_indptr, slot_mapping)
    n = ref.validate_slot_list_args(*args, num_reqs)
    if op == "append_slot_lists" and ref.debug_checks_enabled() and not ref._capturing(slots.device):
        ref.validate_append_precondition(slots, alive, mirror_offsets, new_token_counts, kv_indices, kv_indptr, n)
    backend = select_backend(op, slots.device)
    if backend == "cuda":
        getattr(torch.ops.vtoken, op)(*args, n)
    elif backend == "triton":
        import vtoken_kernels.build_slot_lists as impl

        getattr(impl, op)(*args, n, content_checks=False)
    else:
        getattr(ref, op)(*args, n, content_checks=False)


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
    >>> from vtoken.ops import block_live_counts
    >>> slots = torch.tensor([0, 1, 17, -1], dtype=torch.int32)
    >>> alive = torch.tensor([True, False, True, True])
    >>> counts, f = block_live_counts(slots, alive, num_blocks=2, block_size=16)
    >>> counts.tolist(), round(float(f), 4)
    ([1, 1], 0.9375)

    Backends: ``torch.ops.vtoken.block_live_counts`` > Triton > reference.
    """
    from vtoken.reference import block_live_counts as ref

    ref.validate_block_live_counts_args(slots, alive, num_blocks, block_size, allocated)
    backend = select_backend("block_live_counts", slots.device)
    if backend == "cuda":
        counts, f = torch.ops.vtoken.block_live_counts(slots, alive, allocated, num_blocks, block_size)
        return counts, f
    if backend == "triton":
        from vtoken_kernels.block_live_counts import block_live_counts as impl
    else:
        impl = ref.block_live_counts
    return impl(slots, alive, num_blocks, block_size, allocated, content_checks=False)
