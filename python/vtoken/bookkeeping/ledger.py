"""BlockLedger: per-physical-block live counts, ownership and state.

The ledger wraps an allocator (:class:`vtoken.bookkeeping.pool.BlockAllocator`) and keeps,
for every block id ``b``:

- ``live[b]``: live tokens stored in ``b`` (``n_b`` in the waste ratio). For a
  shared block it is the union over its holders: an offset counts while any
  holder still has that token alive;
- ``owner[b]``: the owning request row, ``SHARED_OWNER`` for shared blocks,
  ``NO_OWNER`` when free;
- ``pos[b]``: the block's position in its owner's block list (shared prefix
  blocks sit at the same position in every holder's list);
- ``state[b]``: FREE / OWNED / SHARED / SRC_INFLIGHT / DST_INFLIGHT.

Running sums make ``waste_ratio`` and the counts O(1) to read. Conservation
holds after every operation: ``free + owned + shared + inflight == usable``
(usable = every block but the null block).

A soft *reserve* of ``reserved`` blocks is held back from every allocation but
the reclaimer's (destination headroom, docs/architecture.md): admission sees
``num_free - reserved``.

Ownership: the ledger alone assigns its arrays and counters. ``live``,
``owner``, ``pos`` and ``state`` are read-only views; the token table changes
them through the mutation methods below (the reclaimer through the table).
It never imports torch.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from vtoken.errors import InvalidArgumentError, InvariantViolation, check_int
from vtoken.bookkeeping.pool import NULL_BLOCK, BlockAllocator

FREE, OWNED, SHARED, SRC_INFLIGHT, DST_INFLIGHT = 0, 1, 2, 3, 4
STATE_NAMES = ("FREE", "OWNED", "SHARED", "SRC_INFLIGHT", "DST_INFLIGHT")
NO_OWNER = -1
SHARED_OWNER = -2
# NOTE: ufunc.at on an int32 array with a Python-int operand takes numpy's slow
# casting path (227 us vs 3.6 us for 2048 indices, numpy 2.4): always pass _ONE.
_ONE = np.int32(1)


def _read_only(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


class BlockLedger:
    """Global per-block bookkeeping over an allocator. See module docstring."""

    def __init__(self, allocator: BlockAllocator, block_size: int):
        check_int("block_size", block_size, min_value=1)
        if not isinstance(allocator, BlockAllocator):
            raise InvalidArgumentError(
                f"allocator: expected a BlockAllocator (allocate/free/incref/num_free/num_blocks), "
                f"got {type(allocator).__name__}"
            )
        self.allocator = allocator
        self.block_size = int(block_size)
        nb = allocator.num_blocks
        self.num_blocks = nb
        self._live = np.zeros(nb, dtype=np.int32)
        self._owner = np.full(nb, NO_OWNER, dtype=np.int32)
        self._pos = np.full(nb, -1, dtype=np.int32)
        self._state = np.zeros(nb, dtype=np.uint8)
        self._expose()
        self._holders: dict[int, set[int]] = {}  # shared block -> rows holding it
        self._count = np.zeros(len(STATE_NAMES), dtype=np.int64)
        self._count[FREE] = allocator.num_free
        self.total_live = 0  # sum of live[b] over allocated blocks
        self.reserved = 0
        if allocator.num_free != nb - 1:
            raise InvalidArgumentError(
                f"allocator: expected an empty allocator ({nb - 1} free blocks), got {allocator.num_free} free"
            )

    def _expose(self) -> None:
        """The public read-only views of the arrays (rebuilt after a copy or unpickling)."""
        self.live, self.owner, self.pos, self.state = map(_read_only, (self._live, self._owner, self._pos, self._state))

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for name in ("live", "owner", "pos", "state"):
            del state[name]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._expose()

    # --- O(1) reads -------------------------------------------------------
    @property
    def holders(self) -> dict:
        """Shared block -> the set of rows holding it (read it, never change it)."""
        return self._holders

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_owned(self) -> int:
        return int(self._count[OWNED])

    @property
    def num_shared(self) -> int:
        return int(self._count[SHARED])

    @property
    def num_inflight(self) -> int:
        return int(self._count[SRC_INFLIGHT] + self._count[DST_INFLIGHT])

    @property
    def num_allocated(self) -> int:
        return self.usable_blocks - self.num_free

    def count(self, state: int) -> int:
        return int(self._count[state])

    @property
    def waste_ratio(self) -> float:
        """F = 1 - live / (allocated * S); 0.0 when nothing is allocated."""
        allocated = self.num_allocated
        if allocated == 0:
            return 0.0
        return 1.0 - self.total_live / (allocated * self.block_size)

    def frac_blocks_at_most(self, utilization: float) -> float:
        """Fraction of allocated blocks with live/S <= ``utilization`` (O(blocks))."""
        allocated = self.state != FREE
        allocated[NULL_BLOCK] = False
        n = int(allocated.sum())
        if n == 0:
            return 0.0
        return float((allocated & (self.live <= utilization * self.block_size)).sum()) / n

    def set_reserve(self, n: int) -> None:
        """Hold ``n`` free blocks back from every allocation but the reclaimer's."""
        self.reserved = check_int("n", n, min_value=0)

    @property
    def admission_free(self) -> int:
        """Free blocks visible to admission and growth: free minus the reserve."""
        return max(0, self.num_free - self.reserved)

    def blocks_of(self, row: int) -> tuple[np.ndarray, np.ndarray, list]:
        """``row``'s blocks: (listed private ones in list order, in-flight destinations by id, shared ones
        in list order). The listed private and shared ones are the non-null entries of its block list. O(blocks)."""
        own = np.flatnonzero(self._owner == row)
        inflight = self._state[own] == DST_INFLIGHT
        listed = own[~inflight]
        listed = listed[np.argsort(self._pos[listed], kind="stable")]
        shared = sorted((b for b, h in self._holders.items() if row in h), key=lambda b: int(self._pos[b]))
        return listed, own[inflight], shared

    def inflight_destinations_of(self, row: int) -> np.ndarray:
        """``row``'s in-flight relocation destinations by id (int64; O(blocks) only while any is in flight)."""
        if not self._count[DST_INFLIGHT]:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero((self._state == DST_INFLIGHT) & (self._owner == row))

    def listed_blocks(self, row: int) -> np.ndarray:
        """The non-null entries of ``row``'s block list, in list order (int64), without reading the list."""
        listed, _, shared = self.blocks_of(row)
        both = np.concatenate([listed, np.asarray(shared, dtype=np.int64)])
        return both[np.argsort(self._pos[both], kind="stable")]

    # --- mutations (called by the table) ---------------------------------
    def set_state(self, ids: np.ndarray, new_state: int) -> None:
        """Move allocated blocks ``ids`` to ``new_state`` (counts kept)."""
        if ids.size == 0:
            return
        old = np.bincount(self._state[ids], minlength=len(STATE_NAMES))
        self._count -= old
        self._count[new_state] += ids.size
        self._state[ids] = new_state

    def add_live(self, blocks: np.ndarray) -> None:
        """One more live token in each entry of ``blocks`` (repeats add up)."""
        np.add.at(self._live, blocks, _ONE)
        self.total_live += len(blocks)

    def remove_live(self, blocks: np.ndarray) -> None:
        """One live token fewer in each entry of ``blocks`` (repeats add up)."""
        np.subtract.at(self._live, blocks, _ONE)
        self.total_live -= len(blocks)

    def set_live(self, block: int, n: int) -> None:
        """``block`` now holds ``n`` live tokens (a shared block's union count)."""
        self.total_live += int(n) - int(self._live[block])
        self._live[block] = n

    def place(self, ids: np.ndarray, positions) -> None:
        """Record the block-list positions of ``ids``."""
        self._pos[ids] = positions

    def add_holder(self, block: int, row: int) -> None:
        """``row`` holds shared ``block`` too (the caller has incref'd it)."""
        self._holders[block].add(row)

    def allocate(self, n: int, owner_rows, positions, *, state: int = OWNED,
                 use_reserve: bool = False) -> Optional[np.ndarray]:
        """Allocate ``n`` blocks owned by ``owner_rows`` at ``positions``; None if short."""
        if n == 0:
            return np.zeros(0, dtype=np.int32)
        available = self.num_free if use_reserve else self.admission_free
        if n > available:
            return None
        ids = self.allocator.allocate(n)
        if ids is None:
            return None
        ids = np.asarray(ids, dtype=np.int32)
        self._count[FREE] -= n
        self._count[state] += n
        self._state[ids] = state
        self._owner[ids] = owner_rows
        self._pos[ids] = positions
        self._live[ids] = 0
        return ids

    def release(self, ids: np.ndarray) -> None:
        """Return private blocks to the allocator (their live tokens are gone)."""
        if ids.size == 0:
            return
        self.total_live -= int(self._live[ids].sum())
        self.set_state(ids, FREE)
        self._live[ids] = 0
        self._owner[ids] = NO_OWNER
        self._pos[ids] = -1
        self.allocator.free(ids)

    def share(self, block: int, rows: set[int]) -> None:
        """Mark ``block`` SHARED by ``rows`` (the caller has incref'd it)."""
        self.set_state(np.array([block], dtype=np.int64), SHARED)
        self._owner[block] = SHARED_OWNER
        self._holders[block] = set(rows)

    def unshare(self, block: int, row: int) -> None:
        """Drop ``row``'s reference to shared ``block``; one holder left makes it OWNED."""
        holders = self._holders[block]
        holders.discard(row)
        if len(holders) == 1:
            (last,) = holders
            del self._holders[block]
            self.set_state(np.array([block], dtype=np.int64), OWNED)
            self._owner[block] = last
        self.allocator.free(np.array([block], dtype=np.int64))

    # --- checks ------------------------------------------------------------
    def check_conservation(self) -> None:
        counts = np.bincount(self.state[1:], minlength=len(STATE_NAMES))
        if not np.array_equal(counts[1:], self._count[1:]):
            raise InvariantViolation(f"ledger state counts {self._count.tolist()} != recount {counts.tolist()}")
        if counts[FREE] != self.allocator.num_free:
            raise InvariantViolation(f"FREE blocks {counts[FREE]} != allocator.num_free {self.allocator.num_free}")
        total = counts.sum()
        if total != self.usable_blocks:
            raise InvariantViolation(f"free+owned+shared+inflight = {total} != usable {self.usable_blocks}")
        recount_live = int(self.live[self.state != FREE].sum())
        if recount_live != self.total_live:
            raise InvariantViolation(f"total_live {self.total_live} != sum(live) {recount_live}")
        if (self.live[self.state == FREE] != 0).any():
            raise InvariantViolation("a FREE block has live tokens")

    def snapshot(self) -> dict:
        return {
            "live": self.live.copy(), "owner": self.owner.copy(), "pos": self.pos.copy(),
            "state": self.state.copy(), "holders": {b: set(h) for b, h in self.holders.items()},
            "count": self._count.copy(), "total_live": self.total_live, "reserved": self.reserved,
            "num_free": self.num_free,
        }
