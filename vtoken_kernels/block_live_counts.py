"""Triton ``block_live_counts``: live tokens per physical block, and F, without a host sync.

Semantics: :mod:`vtoken.reference.block_live_counts`; argument contract:
:func:`vtoken_kernels.contracts.validate_block_live_counts_args`, checked once
by :func:`vtoken.device.ops.block_live_counts` (this launcher does not check again).

One histogram launch, one finalize launch:

* ``_block_live_counts_kernel`` (one program per ``BLOCK`` tokens, and per
  ``BLOCK`` blocks of the ``allocated`` mask): ``tl.atomic_add(counts + b, 1)``
  for every live token in range. Integer atomics make the counts exact and
  independent of the order. A token also adds 1 to ``acc[0]`` when its block
  is allocated (a gather from the 1-byte mask), so F needs no second pass over
  the counts; the block part adds the number of allocated blocks to ``acc[1]``.
* ``_waste_ratio_kernel`` (one program): ``F = 1 - acc[0] / (acc[1] * S)`` in
  float64, rounded once to float32.

NOTE: F is computed in a second launch rather than by the last program of the
first (an atomic ticket) because a Triton scalar atomic runs on one thread and
gives no CTA-wide ordering guarantee with the other scalar atomics.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096
"""Tokens (and mask entries) per program. Not yet tuned on a GPU."""
NUM_WARPS = 8


def block_live_counts(
    slots: torch.Tensor,
    alive: torch.Tensor,
    num_blocks: int,
    block_size: int,
    allocated: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(counts[num_blocks] int32, F 0-dim float32)`` (Triton); PAD and out-of-range slots count nowhere."""
    dev = slots.device
    counts = torch.zeros(num_blocks, dtype=torch.int32, device=dev)
    acc = torch.zeros(2, dtype=torch.int64, device=dev)
    f = torch.empty((), dtype=torch.float32, device=dev)
    num_tokens = slots.numel()
    grid = (max(triton.cdiv(num_tokens, BLOCK), triton.cdiv(num_blocks, BLOCK), 1),)
    has_alloc = allocated is not None
    alloc8 = allocated.view(torch.int8) if has_alloc else alive.view(torch.int8)  # dummy when absent
    _block_live_counts_kernel[grid](
        slots, alive.view(torch.int8), alloc8, counts, acc,
        num_tokens, num_blocks, block_size,
        HAS_ALLOC=has_alloc, BLOCK=BLOCK, num_warps=NUM_WARPS,
    )
    _waste_ratio_kernel[(1,)](acc, f, block_size)
    return counts, f


@triton.jit
def _waste_ratio_kernel(
    # Inputs
    acc_ptr,  # [2] int64: live tokens in allocated blocks, allocated blocks
    # Outputs
    f_ptr,  # [] float32
    # Constants
    block_size,
):
    # Grid: (1,)
    live = tl.load(acc_ptr).to(tl.float64)
    n = tl.load(acc_ptr + 1)
    denom = tl.maximum(n * block_size, 1).to(tl.float64)
    f = tl.where(n > 0, 1.0 - live / denom, 0.0)
    tl.store(f_ptr, f.to(tl.float32))


@triton.jit
def _block_live_counts_kernel(
    # Inputs
    slots_ptr,  # [num_tokens] int32
    alive_ptr,  # [num_tokens] int8
    allocated_ptr,  # [num_blocks] int8 (read only when HAS_ALLOC)
    # Outputs
    counts_ptr,  # [num_blocks] int32, zeroed by the launcher
    acc_ptr,  # [2] int64, zeroed: live in allocated blocks, allocated blocks
    # Constants
    num_tokens,
    num_blocks,
    block_size,
    HAS_ALLOC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Grid: (max(cdiv(num_tokens, BLOCK), cdiv(num_blocks, BLOCK), 1),)
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < num_tokens
    s = tl.load(slots_ptr + offs, mask=m, other=-1)
    a = tl.load(alive_ptr + offs, mask=m, other=0)
    valid = (a != 0) & (s >= 0) & (s.to(tl.int64) < num_blocks * block_size)
    b = tl.where(valid, s // block_size, 0)
    # NOTE: relaxed: nothing in this launch reads the counters; the next
    # launch (or the caller) sees them after the kernel boundary.
    tl.atomic_add(counts_ptr + b, tl.full([BLOCK], 1, tl.int32), mask=valid, sem="relaxed")
    if HAS_ALLOC:
        in_alloc = valid & (tl.load(allocated_ptr + b, mask=valid, other=0) != 0)
        nb = tl.load(allocated_ptr + offs, mask=offs < num_blocks, other=0) != 0
    else:
        in_alloc = valid
        nb = offs < num_blocks
    live = tl.sum(in_alloc.to(tl.int64), axis=0)
    tl.atomic_add(acc_ptr, live, sem="relaxed")
    tl.atomic_add(acc_ptr + 1, tl.sum(nb.to(tl.int64), axis=0), sem="relaxed")
