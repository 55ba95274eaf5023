"""Block-list stores: where the token table reads and writes each request's block list.

Position ``p`` of a request's block list holds the block of its logical
tokens ``[p*S, (p+1)*S)`` at allocation time, or the null block once that
block was released; the table keeps ``ceil(num_tokens / S)`` positions. The
table reaches the list only through a store, so an engine that keeps block
lists of its own (vLLM's ``req_to_blocks``) lends the table those, and no
second copy exists (:mod:`vtoken.integrations.vllm.block_lists`).

A store's operations (``rows``, ``pos``: int arrays of equal length):

- ``open(row, req)`` / ``close(row)``: a request row starts / ends;
- ``read(rows, pos)``: the block ids at those positions (int64);
- ``write(rows, pos, ids)``: the table's changes of listed positions
  (releases to the null block, relocation destinations); never a reference
  count change: the allocator already did it;
- ``claim(rows, pos, ids)``: blocks the table just allocated take new
  positions (appends, prefix blocks);
- ``row(row, n)``: the first ``n`` positions of a row's list (int32; a
  read-only use: it may be a view);
- ``readable_at_finish``: the row's list can still be read when the table
  finishes the request (the table then frees from it, in O(its blocks); else
  it asks the ledger, in O(blocks)).

:class:`ArenaBlockLists`, the embedded engine's store, keeps the lists in the
:class:`vtoken.bookkeeping.arena.SegmentArena`'s ``blocks`` array, beside the
row's slots (position ``p`` of row ``r`` at ``base[r] // S + p``).
"""
from __future__ import annotations

import numpy as np

from vtoken.bookkeeping.arena import SegmentArena
from vtoken.bookkeeping.ledger import SHARED, BlockLedger
from vtoken.bookkeeping.pool import NULL_BLOCK
from vtoken.errors import InvalidArgumentError


def leaving_blocks(store, ledger: BlockLedger, row: int, n: int) -> tuple:
    """A finishing row's blocks: (listed private ids in list order, in-flight destinations, shared ids in list order).

    From the row's ``n``-position list, O(its blocks), when ``store`` can still
    read it; else from the ledger, O(blocks) (vLLM drops a preempted request's
    list before the table hears of it). Both give the same ids in the same order.
    """
    if not store.readable_at_finish:
        return ledger.blocks_of(row)
    blist = store.row(row, n)
    held = blist[blist != NULL_BLOCK].astype(np.int64)
    is_shared = ledger.state[held] == SHARED
    return held[~is_shared], ledger.inflight_destinations_of(row), held[is_shared].tolist()


class ArenaBlockLists:
    """Block lists stored in a :class:`SegmentArena` (the arena moves them with the row's segment)."""

    def __init__(self, arena: SegmentArena):
        if arena.blocks is None:
            raise InvalidArgumentError("arena: expected an arena that stores block lists (block_lists=True)")
        self.arena = arena
        self.S = arena.S

    readable_at_finish = True

    def open(self, row: int, req) -> None:
        return  # the arena opened the row's segment, lists included

    def close(self, row: int) -> None:
        return

    def read(self, rows, pos) -> np.ndarray:
        return self.arena.blocks[self.arena.base[rows] // self.S + pos]

    def write(self, rows, pos, ids) -> None:
        self.arena.blocks[self.arena.base[rows] // self.S + pos] = ids

    claim = write

    def row(self, row: int, n: int) -> np.ndarray:
        b0 = int(self.arena.base[row]) // self.S
        return self.arena.blocks[b0 : b0 + n]
