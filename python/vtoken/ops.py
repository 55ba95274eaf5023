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
