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
        if forced == "triton" and not _triton_usable(device):
            raise InvalidArgumentError("VTOKEN_BACKEND=triton: Triton needs CUDA or TRITON_INTERPRET=1")
        return forced
    if has_cuda_impl and has_extension_op(op):
        return "cuda"
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
