"""The block allocator protocol and vtoken's built-in ``BlockPool``.

The ledger only talks to an allocator through :class:`BlockAllocator`, so the
built-in pool and vLLM's ``BlockPool`` (through an adapter) are interchangeable.

Conventions shared with vLLM:
- block 0 is the reserved *null block*: never handed out, used to fill the
  freed positions of a request's block list so block arithmetic still holds;
- an allocation that cannot be satisfied in full returns ``None`` and changes
  nothing (never a partial allocation), so the caller can back off;
- ``free`` is a batched decref: a block returns to the free list when its
  reference count reaches zero.
"""
from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import numpy as np

from vtoken.errors import InvalidArgumentError, as_index_array, check_int

NULL_BLOCK = 0


@runtime_checkable
class BlockAllocator(Protocol):
    """What the ledger needs from an allocator."""

    @property
    def num_blocks(self) -> int:
        """Total block ids, the null block included (ids are 0..num_blocks-1)."""

    @property
    def num_free(self) -> int:
        """Blocks that ``allocate`` can hand out right now."""

    def allocate(self, n: int) -> Optional[np.ndarray]:
        """``n`` fresh block ids (ref count 1) as int32, or ``None`` if fewer are free."""

    def free(self, ids) -> None:
        """Decrement the ref count of each id; blocks reaching 0 become free."""

    def incref(self, ids) -> None:
        """Increment the ref count of each (allocated) id: the block is shared."""


class BlockPool:
    """A LIFO free-list allocator with reference counts, all numpy.

    Example:
        >>> pool = BlockPool(8)
        >>> ids = pool.allocate(3); pool.num_free
        4
        >>> freed = pool.free(ids); pool.num_free
        7
    """

    def __init__(self, num_blocks: int):
        self._num_blocks = check_int("num_blocks", num_blocks, min_value=2)  # block 0 is the null block
        self._ref = np.zeros(self._num_blocks, dtype=np.int32)
        self._ref[NULL_BLOCK] = 1  # pinned forever
        # Stack of free ids; the top is at the end so low ids are handed out first.
        self._stack = np.arange(self._num_blocks - 1, 0, -1, dtype=np.int32)
        self._top = self._num_blocks - 1

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        return self._top

    def allocate(self, n: int) -> Optional[np.ndarray]:
        n = check_int("n", n)
        if n > self._top:
            return None
        ids = self._stack[self._top - n : self._top][::-1].copy()
        self._top -= n
        self._ref[ids] = 1
        return ids

    def _validated(self, arg: str, ids) -> np.ndarray:
        ids = as_index_array(arg, ids)
        if ids.size and (ids.min() < 1 or ids.max() >= self._num_blocks):
            bad = ids[(ids < 1) | (ids >= self._num_blocks)]
            raise InvalidArgumentError(
                f"{arg}: expected block ids in [1, {self._num_blocks}), got {bad[:8].tolist()}"
            )
        return ids

    def free(self, ids) -> np.ndarray:
        """Batched decref; returns the ids that became free (int32)."""
        ids = self._validated("ids", ids)
        if ids.size == 0:
            return np.zeros(0, dtype=np.int32)
        srt = np.sort(ids)
        if (srt[1:] != srt[:-1]).all():  # distinct ids (the common case): no np.unique
            ref = self._ref[srt]
            if (ref < 1).any():
                raise InvalidArgumentError(
                    f"ids: expected allocated blocks (ref >= times freed), got double free of {srt[ref < 1][:8].tolist()}"
                )
            ref -= 1
            self._ref[srt] = ref
            freed = srt[ref == 0].astype(np.int32)
            self._stack[self._top : self._top + freed.size] = freed
            self._top += freed.size
            return freed
        uniq, counts = np.unique(ids, return_counts=True)
        over = counts > self._ref[uniq]
        if over.any():
            raise InvalidArgumentError(
                f"ids: expected allocated blocks (ref >= times freed), got double free of {uniq[over][:8].tolist()}"
            )
        self._ref[uniq] -= counts.astype(np.int32)
        freed = uniq[self._ref[uniq] == 0].astype(np.int32)
        self._stack[self._top : self._top + freed.size] = freed
        self._top += freed.size
        return freed

    def incref(self, ids) -> None:
        ids = self._validated("ids", ids)
        if ids.size and (self._ref[ids] <= 0).any():
            raise InvalidArgumentError(
                f"ids: expected allocated blocks, got free blocks {ids[self._ref[ids] <= 0][:8].tolist()}"
            )
        np.add.at(self._ref, ids, 1)

    decref = free

    def ref_count(self, ids) -> np.ndarray:
        return self._ref[self._validated("ids", ids)].copy()

    def free_ids(self) -> np.ndarray:
        """The ids currently free (for invariant checks)."""
        return self._stack[: self._top].copy()
