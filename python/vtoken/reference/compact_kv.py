"""Torch reference of ``compact_kv``, and the argument contract every backend shares.

``compact_kv`` relocates live tokens inside the paged KV caches of every layer:
for each move ``m`` it copies the rows of slot ``src_slots[m]`` (K and V of
every head, or MLA's latent row) to slot ``dst_slots[m]``, in every layer's
cache tensor. All layers share one :class:`~vtoken.layout.KVLayout` (same
shape, strides and dtype). The copy is bit-exact for every dtype (fp16, bf16,
fp32, fp8, uint8 / int8 fp8 storage): it moves the bit patterns as integers,
NaN payloads included.

Slot contract:

* ``src_slots`` / ``dst_slots`` are int32 ``[M]``. A move whose source or
  destination is PAD (``-1``) is skipped, so a fixed-size buffer padded with
  PAD can be replayed in a CUDA graph.
* The destinations of the non-skipped moves are unique and disjoint from their
  sources (no move reads a slot another move writes). Backends copy moves in
  parallel and rely on this; the result of a violating call is unspecified.
* Slots are in ``[-1, num_blocks * block_size)``.

The contract is checked only when ``validate=True`` is passed, or when
``validate`` is ``None`` and ``VTOKEN_DEBUG_INVARIANTS=1`` is set, because the
check synchronizes with the device. A rejected call raises
:class:`~vtoken.errors.InvalidArgumentError` before touching any cache. With
validation off, every backend skips a move with an out-of-range slot (it never
writes outside the caches) but a contract violation is not detected.
"""
from __future__ import annotations

import numpy as np
import torch

from vtoken.errors import InvalidArgumentError, InvalidTypeError, check_tensor, debug_checks_enabled
from vtoken.layout import KVLayout

SUPPORTED_DTYPES = tuple(
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
    """The layout's ints in the order of the ``vtoken::compact_kv`` schema."""
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


def check_compact_kv_args(kv_caches, layout, src_slots, dst_slots, *, validate=None) -> None:
    """Validate a ``compact_kv`` call; raise before any cache is touched.

    Structural checks (types, dtypes, shapes, devices, layout fit) always run;
    the slot contract (module docstring) runs when ``validate`` is True, or
    ``None`` with ``VTOKEN_DEBUG_INVARIANTS=1``.
    """
    device = cache_device(kv_caches)
    if not isinstance(layout, KVLayout):
        raise InvalidTypeError(f"layout: expected a vtoken.layout.KVLayout, got {type(layout).__name__}")
    t0 = kv_caches[0]
    if t0.dtype not in SUPPORTED_DTYPES:
        raise InvalidTypeError(f"kv_caches[0]: expected dtype in {list(SUPPORTED_DTYPES)}, got {t0.dtype}")
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
    _check_layout_fits(layout, t0)
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


def _check_layout_fits(layout: KVLayout, t: torch.Tensor) -> None:
    strides = (layout.stride_block, layout.stride_offset, layout.stride_kv, layout.stride_head)
    if min(strides) < 0:
        raise InvalidArgumentError(f"layout: expected non-negative strides, got {strides}")
    if layout.num_slots > 2**31:
        raise InvalidArgumentError(f"layout: expected num_blocks * block_size <= 2^31 (int32 slots), got {layout.num_slots}")
    numel = layout.num_slots * layout.rows_per_token * layout.head_dim
    last = (
        (layout.num_blocks - 1) * layout.stride_block
        + (layout.block_size - 1) * layout.stride_offset
        + (layout.num_kv - 1) * layout.stride_kv
        + (layout.num_heads - 1) * layout.stride_head
        + layout.head_dim
        - 1
    )
    tensor_last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    if t.numel() != numel or last > tensor_last:
        raise InvalidArgumentError(
            f"layout: expected a layout that addresses the cache tensor of shape {tuple(t.shape)} "
            f"strides {t.stride()}, got {layout}"
        )


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


def int_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integer dtype of its element size (same strides)."""
    return t.view(INT_VIEW_DTYPE[t.element_size()])


def token_element_offsets(layout: KVLayout, slots: torch.Tensor) -> torch.Tensor:
    """int64 ``[len(slots), rows_per_token * head_dim]``: element offsets of each slot's rows.

    Straight from the KVLayout addressing formula (module docstring of
    :mod:`vtoken.layout`), with no merging of contiguous dims.
    """
    dev = slots.device
    kv = torch.arange(layout.num_kv, device=dev)[:, None]
    head = torch.arange(layout.num_heads, device=dev)[None, :]
    row_starts = (kv * layout.stride_kv + head * layout.stride_head).reshape(-1)
    elems = (row_starts[:, None] + torch.arange(layout.head_dim, device=dev)[None, :]).reshape(-1)
    block, offset = slots // layout.block_size, slots % layout.block_size
    return (block * layout.stride_block + offset * layout.stride_offset)[:, None] + elems[None, :]


def compact_kv(kv_caches, layout: KVLayout, src_slots: torch.Tensor, dst_slots: torch.Tensor, *, validate=None) -> None:
    """Reference ``compact_kv`` (in place): per layer, gather every source row, then scatter.

    Same arguments as :func:`vtoken.ops.compact_kv`. Works on a flat view of
    each layer's elements with ``index_select`` / ``index_copy_``.
    """
    check_compact_kv_args(kv_caches, layout, src_slots, dst_slots, validate=validate)
    src, dst = src_slots.long(), dst_slots.long()
    n = layout.num_slots
    keep = (src >= 0) & (dst >= 0) & (src < n) & (dst < n)
    src, dst = src[keep], dst[keep]
    if src.numel() == 0:
        return
    src_idx = token_element_offsets(layout, src).reshape(-1)
    dst_idx = token_element_offsets(layout, dst).reshape(-1)
    span = int(token_element_offsets(layout, torch.tensor([n - 1])).max()) + 1
    for t in kv_caches:
        v = int_view(t)
        flat = v.as_strided((span,), (1,), v.storage_offset())
        flat.index_copy_(0, dst_idx, flat.index_select(0, src_idx))
