"""vLLM's ``BlockPool`` behind vtoken's allocator protocol (:class:`vtoken.bookkeeping.pool.BlockAllocator`).

In vLLM the scheduler's ``KVCacheManager`` allocates every block a request
gets; vtoken's ledger only *mirrors* those allocations. The adapter therefore
has three ways to hand out or take back blocks:

- **mirroring** (:meth:`VLLMBlockAllocator.mirroring`): the ids vLLM just gave
  a request are queued, and the table's next ``allocate`` calls claim them in
  order; ``incref`` of prefix-cache hits is a no-op (vLLM's ``touch`` counted
  them already);
- **reclaimer allocations** (outside mirroring): relocation destinations come
  from a *headroom stash*, blocks physically taken out of vLLM's free queue so
  that vLLM's own admission (which reads ``get_num_free_blocks()``) cannot
  hand them out; past the stash they come from the pool;
- **frees**: vtoken-initiated frees (Naive-Evict releases, relocation sources)
  drop the block's prefix-cache hash when its last reference goes, then return
  it with ``BlockPool.free_blocks``; inside :meth:`VLLMBlockAllocator.detached`
  (a request vLLM itself is about to free, or has freed) frees of the blocks
  vLLM owns are skipped.

``num_free`` counts vLLM's free queue, the queued mirror ids and the stash, so
the ledger's conservation ``free + owned + shared + inflight == usable`` holds
whenever the mirror is in sync (after every connector call).
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import numpy as np

from vtoken.errors import InvalidArgumentError, InvariantViolation, as_index_array, check_int
from vtoken.bookkeeping.pool import NULL_BLOCK


class VLLMBlockAllocator:
    """:class:`vtoken.bookkeeping.pool.BlockAllocator` over a ``vllm.v1.core.block_pool.BlockPool``.

    Args:
        block_pool: vLLM's block pool (``KVCacheManager.block_pool``).
        headroom: blocks to hold back from vLLM as relocation destinations.

    Example (needs vllm)::

        >>> from vllm.v1.core.block_pool import BlockPool
        >>> alloc = VLLMBlockAllocator(BlockPool(16, True, 16), headroom=2)
        >>> alloc.num_free, alloc.held
        (15, 2)
    """

    def __init__(self, block_pool, *, headroom: int = 0):
        check_int("headroom", headroom)
        if block_pool.null_block.block_id != NULL_BLOCK:
            raise InvalidArgumentError(
                f"block_pool: expected the null block to be block {NULL_BLOCK}, got {block_pool.null_block.block_id}"
            )
        self.pool = block_pool
        self.headroom = int(headroom)
        self._pending: list[int] = []
        self._mirroring = False
        self._stash: list = []  # KVCacheBlock objects held out of vLLM's free queue
        self._vllm_frees: Optional[set] = None
        self.hashes_dropped = 0
        self.top_up()

    # ------------------------------------------------------------- protocol
    @property
    def num_blocks(self) -> int:
        return int(self.pool.num_gpu_blocks)

    @property
    def num_free(self) -> int:
        return int(self.pool.get_num_free_blocks()) + len(self._pending) + len(self._stash)

    @property
    def held(self) -> int:
        """Blocks currently held in the headroom stash."""
        return len(self._stash)

    def allocate(self, n: int) -> Optional[np.ndarray]:
        n = check_int("n", n)
        if self._mirroring:
            if n > len(self._pending):
                raise InvariantViolation(
                    f"mirror: the table asked for {n} blocks but vLLM allocated {len(self._pending)} for the step"
                )
            ids = self._pending[:n]
            del self._pending[:n]
            return np.asarray(ids, dtype=np.int32)
        if n > self.num_free:
            return None
        k = min(n, len(self._stash))
        blocks = self._stash[len(self._stash) - k :]
        del self._stash[len(self._stash) - k :]
        if n > k:
            # get_new_blocks drops any stale prefix-cache hash and sets ref_cnt = 1.
            blocks = blocks + self.pool.get_new_blocks(n - k)
        return np.fromiter((b.block_id for b in blocks), dtype=np.int32, count=n)

    def _blocks(self, arg: str, ids) -> tuple[np.ndarray, list]:
        ids = as_index_array(arg, ids)
        if ids.size and (ids.min() < 1 or ids.max() >= self.num_blocks):
            bad = ids[(ids < 1) | (ids >= self.num_blocks)]
            raise InvalidArgumentError(f"{arg}: expected block ids in [1, {self.num_blocks}), got {bad[:8].tolist()}")
        return ids, [self.pool.blocks[i] for i in ids.tolist()]

    def free(self, ids) -> None:
        ids, blocks = self._blocks("ids", ids)
        if self._vllm_frees is not None:
            keep = [i for i, b in enumerate(ids.tolist()) if b not in self._vllm_frees]
            ids, blocks = ids[keep], [blocks[i] for i in keep]
        if not blocks:
            return
        uniq, counts = np.unique(ids, return_counts=True)
        refs = np.fromiter((self.pool.blocks[i].ref_cnt for i in uniq.tolist()), dtype=np.int64, count=len(uniq))
        if (counts > refs).any():
            raise InvalidArgumentError(
                f"ids: expected allocated blocks (ref >= times freed), got double free of {uniq[counts > refs][:8].tolist()}"
            )
        # NOTE: a block vtoken frees mid-request is a Naive-Evict release or a
        # relocation source. Its bytes are intact, but dropping the hash when
        # the last reference goes keeps every later prefix-cache hit a run of
        # blocks that live requests hold unchanged (or that a finished request
        # freed), which is what the mirror can express (docs/vllm.md).
        last = {int(b) for b, c, r in zip(uniq.tolist(), counts.tolist(), refs.tolist()) if c == r}
        if last:
            self.hashes_dropped += drop_hashes(self.pool, last)
        self.pool.free_blocks(blocks)

    def incref(self, ids) -> None:
        ids, blocks = self._blocks("ids", ids)
        if self._mirroring:
            return  # a prefix-cache hit: vLLM's touch() already took the reference
        if any(b.ref_cnt <= 0 for b in blocks):
            raise InvalidArgumentError(f"ids: expected allocated blocks, got free blocks in {ids[:8].tolist()}")
        self.pool.touch(blocks)

    decref = free

    def ref_count(self, ids) -> np.ndarray:
        ids, blocks = self._blocks("ids", ids)
        return np.fromiter((b.ref_cnt for b in blocks), dtype=np.int32, count=len(blocks))

    # ----------------------------------------------------------- mirroring
    @contextlib.contextmanager
    def mirroring(self, new_ids: Iterable[int]):
        """Queue the ids vLLM just allocated; the table's allocations inside claim them in order."""
        if self._mirroring:
            raise InvariantViolation("mirror: nested mirroring")
        self._pending = [int(i) for i in new_ids]
        self._mirroring = True
        ok = False
        try:
            yield
            ok = True
        finally:
            left = len(self._pending)
            self._pending = []
            self._mirroring = False
            if ok and left:
                raise InvariantViolation(f"mirror: {left} blocks vLLM allocated were not claimed by the table")

    @contextlib.contextmanager
    def detached(self, vllm_frees: Iterable[int]):
        """Skip frees of ``vllm_frees``: vLLM frees (or freed) those blocks itself."""
        if self._vllm_frees is not None:
            raise InvariantViolation("allocator: nested detached()")
        self._vllm_frees = {int(i) for i in vllm_frees}
        try:
            yield
        finally:
            self._vllm_frees = None

    # --------------------------------------------------------------- stash
    def top_up(self) -> int:
        """Refill the headroom stash from vLLM's free queue; return the blocks taken."""
        want = min(self.headroom - len(self._stash), int(self.pool.get_num_free_blocks()))
        if want <= 0:
            return 0
        self._stash.extend(self.pool.get_new_blocks(want))
        return want

    def release_stash(self) -> int:
        """Give every stashed block back to vLLM (shutdown); return how many."""
        n = len(self._stash)
        if n:
            self.pool.free_blocks(self._stash)
            self._stash = []
        return n


def drop_hashes(block_pool, block_ids: Iterable[int]) -> int:
    """Drop the prefix-cache hashes of ``block_ids`` (held or free); return how many had one."""
    ids = [int(b) for b in block_ids if int(b) != NULL_BLOCK]
    had = sum(1 for b in ids if block_pool.blocks[b].block_hash is not None)
    if ids:
        block_pool.evict_blocks(set(ids))
    return had
