"""vLLM's block lists as the token table's block-list store (:mod:`vtoken.bookkeeping.block_lists`).

vLLM sizes every allocation from the *length* of a request's block list
(``cdiv(num_tokens, block_size) - len(req_to_blocks[req])``, see
docs/vllm.md). The table keeps the same length and puts the null block (id 0)
at every position whose block it released, exactly like vLLM's sliding-window
managers (``_remove_blocks_in_range``); a relocation's destinations take the
first positions its sources freed. :class:`VLLMBlockLists` makes vLLM's
``req_to_blocks[req]`` the table's block list: the table's reads and writes go
to it directly, so the vLLM side keeps one list per request and nothing to
sync. A write never changes a reference count: the allocator adapter already
freed (or allocated) the blocks involved. The table's appends are vLLM's own
allocations, already in vLLM's list: a claim checks them. A request vLLM
frees (or freed: a preempted one's list is gone before the connector hears of
it) is :meth:`VLLMBlockLists.release`d first: the table's last writes to its
list, nulling blocks vLLM frees itself, are dropped, so vLLM frees each of
them once.
"""
from __future__ import annotations

import numpy as np

from vtoken.errors import InvariantViolation
from vtoken.bookkeeping.pool import NULL_BLOCK


def block_ids(manager, req_id) -> np.ndarray:
    """The ids of ``req_id``'s vLLM block list (int32; 0 = null block)."""
    blocks = manager.req_to_blocks.get(req_id, ())
    return np.fromiter((b.block_id for b in blocks), dtype=np.int32, count=len(blocks))


class VLLMBlockLists:
    """The block-list store over a ``SingleTypeKVCacheManager``'s ``req_to_blocks`` and its ``BlockPool``.

    The table's row ``r`` is request ``request_of(r)`` (the table's own
    row map, :class:`~vtoken.bookkeeping.request_rows.RequestRows`); its list is
    ``manager.req_to_blocks[req]``, block ids translated to vLLM's
    ``KVCacheBlock`` objects (the null block to ``block_pool.null_block``).
    """

    # NOTE: vLLM pops a preempted request's list before the connector hears of it.
    readable_at_finish = False

    def __init__(self, manager, block_pool, request_of):
        self.manager = manager
        self.pool = block_pool
        self.request_of = request_of  # table row -> vLLM request id (the key of its list)
        self.released: set = set()  # rows whose list vLLM frees (or freed) itself

    def open(self, row: int, req) -> None:
        return  # vLLM made the list when it allocated the request's blocks

    def close(self, row: int) -> None:
        self.released.discard(int(row))

    def release(self, row: int) -> None:
        """vLLM frees (or freed) ``row``'s list: from now on the table may only null its entries, which is dropped."""
        self.released.add(int(row))

    def _list(self, row: int, need: int) -> list:
        """Row ``row``'s vLLM list, which must have more than ``need`` entries."""
        req = self.request_of(row)
        blocks = self.manager.req_to_blocks.get(req)
        if blocks is None or len(blocks) <= need:
            raise InvariantViolation(
                f"block lists: vLLM's block list of {req!r} has {0 if blocks is None else len(blocks)} entries, "
                f"position {need} used"
            )
        return blocks

    def read(self, rows, pos) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        pos = np.asarray(pos, dtype=np.int64)
        if rows.size == 0:
            return np.zeros(0, dtype=np.int64)
        # A prefill reads one position per token: look each (row, position) up once.
        keys, inverse = np.unique((rows << 32) | pos, return_inverse=True)
        out = np.empty(len(keys), dtype=np.int64)
        for i, k in enumerate(keys.tolist()):
            p = k & 0xFFFFFFFF
            out[i] = self._list(k >> 32, p)[p].block_id
        return out[inverse]

    def write(self, rows, pos, ids) -> None:
        rows, pos = np.asarray(rows, dtype=np.int64), np.asarray(pos, dtype=np.int64)
        ids = np.broadcast_to(np.asarray(ids, dtype=np.int64), rows.shape)
        null, pool = self.pool.null_block, self.pool.blocks
        for r, p, b in zip(rows.tolist(), pos.tolist(), ids.tolist()):
            if r in self.released:
                # NOTE: a released row's block is in the list vLLM frees, and the allocator
                # skips vtoken's free of it (detached): nulling it here would leak it.
                if b != NULL_BLOCK:
                    raise InvariantViolation(f"block lists: block {b} placed in the released list of {self.request_of(r)!r}")
                continue
            self._list(r, p)[p] = null if b == NULL_BLOCK else pool[b]

    def claim(self, rows, pos, ids) -> None:
        """The table's new blocks are vLLM's own allocations: check they sit where vLLM put them."""
        rows, pos = np.asarray(rows, dtype=np.int64), np.asarray(pos, dtype=np.int64)
        for r, p, b in zip(rows.tolist(), pos.tolist(), np.asarray(ids).tolist()):
            got = self._list(r, p)[p].block_id
            if got != b:
                raise InvariantViolation(
                    f"mirror: the table placed block {b} at position {p} of {self.request_of(r)!r}, vLLM lists {got}"
                )

    def row(self, row: int, n: int) -> np.ndarray:
        if n == 0:
            return np.zeros(0, dtype=np.int32)
        blocks = self._list(int(row), n - 1)
        return np.fromiter((blocks[p].block_id for p in range(n)), dtype=np.int32, count=n)
