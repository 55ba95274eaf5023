"""Torch reference of ``block_live_counts``: live tokens per physical block, and F.

Inputs
    ``slots[T]`` int32 and ``alive[T]`` int8/bool: any set of tokens (usually the
    device mirror of the token tables). ``num_blocks`` / ``block_size`` describe
    the cache: slot ``s`` lives in block ``s // block_size``.
    ``allocated[num_blocks]`` bool/int8 (optional): the blocks the allocator has
    handed out; ``None`` means every block.

Outputs
    ``counts[num_blocks]`` int32: ``counts[b]`` = alive tokens whose slot is in
    block ``b`` (exact). PAD (-1) and out-of-range slots are skipped.
    ``F`` 0-dim float32 on the input's device: the waste ratio over the
    allocated blocks, ``1 - sum_{b allocated} counts[b] / (N * block_size)``
    with ``N`` allocated blocks, evaluated in float64 and rounded once to
    float32 (so every backend returns the same bits); 0 when ``N == 0``.
    Live tokens in unallocated blocks are counted but do not enter F.

No backend syncs the host, so F can feed a GPU-side reclamation trigger.
The arguments are checked once, at the op boundary
(:func:`vtoken.device.ops.block_live_counts`), by
:func:`vtoken_kernels.contracts.validate_block_live_counts_args`: its content
checks (a live token with a slot outside ``[0, num_blocks * block_size)``
other than PAD) run when the tensors are on the CPU or under
``VTOKEN_DEBUG_INVARIANTS=1``, and raise before anything is computed. This
reference does not check its arguments again.
"""
from __future__ import annotations

import torch


def waste_ratio(live_in_allocated: torch.Tensor, num_allocated: torch.Tensor, block_size: int) -> torch.Tensor:
    """F as a 0-dim float32: ``1 - live / (N * S)`` in float64, 0 when N == 0."""
    denom = (num_allocated.to(torch.int64) * block_size).to(torch.float64)
    f = 1.0 - live_in_allocated.to(torch.float64) / denom.clamp(min=1.0)
    return torch.where(num_allocated > 0, f, torch.zeros_like(f)).to(torch.float32)


def block_live_counts(
    slots, alive, num_blocks: int, block_size: int, allocated=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(counts[num_blocks] int32, F 0-dim float32)`` (see module docstring)."""
    s = slots.to(torch.int64)
    valid = (alive != 0) & (s >= 0) & (s < num_blocks * block_size)
    blk = torch.where(valid, s // block_size, num_blocks)  # invalid tokens go to a dummy bin
    counts = torch.zeros(num_blocks + 1, dtype=torch.int64, device=slots.device)
    counts.index_add_(0, blk, torch.ones_like(blk))
    counts = counts[:num_blocks]
    if allocated is None:
        alloc = torch.ones(num_blocks, dtype=torch.bool, device=slots.device)
    else:
        alloc = allocated != 0
    live = (counts * alloc).sum()
    return counts.to(torch.int32), waste_ratio(live, alloc.sum(), block_size)
