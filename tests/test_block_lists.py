"""The token table reaches block lists only through a block-list store (vtoken.bookkeeping.block_lists).

An engine that keeps its own lists (vLLM) lends them to the table: the table
then keeps none, and its reads and writes land in the engine's lists at once.
Here a store of plain Python lists, keyed by request like an engine's, runs
the same workload (appends, evictions, relocations, finishes) as the arena's
store, and must end every step with the same lists and the same ledger.
"""
from __future__ import annotations

import numpy as np

from vtoken.bookkeeping.block_lists import ArenaBlockLists
from vtoken.bookkeeping.ledger import BlockLedger
from vtoken.bookkeeping.pool import BlockPool
from vtoken.bookkeeping.table import TokenTable
from vtoken.reclamation.config import ReclaimConfig
from vtoken.reclamation.manager import ReclamationManager

S = 8


class EngineLists:
    """An engine's own block lists (request -> list of ids), lent to the table."""

    # like vLLM's: the table finishes a request from the ledger, so the freed ids below compare the ledger's
    # path with the arena store's list path
    readable_at_finish = False

    def __init__(self):
        self.lists, self.req_of = {}, {}

    def open(self, row, req):
        self.req_of[row] = req
        self.lists[req] = []

    def close(self, row):
        del self.lists[self.req_of.pop(row)]

    def read(self, rows, pos):
        return np.array([self.lists[self.req_of[r]][p] for r, p in zip(np.asarray(rows).tolist(),
                                                                        np.asarray(pos).tolist())], dtype=np.int64)

    def write(self, rows, pos, ids):
        rows = np.asarray(rows)
        for r, p, b in zip(rows.tolist(), np.asarray(pos).tolist(), np.broadcast_to(ids, rows.shape).tolist()):
            self.lists[self.req_of[r]][p] = b

    def claim(self, rows, pos, ids):  # the engine allocated them: its lists grow at the end
        for r, p, b in zip(np.asarray(rows).tolist(), np.asarray(pos).tolist(), np.asarray(ids).tolist()):
            lst = self.lists[self.req_of[r]]
            assert p == len(lst)
            lst.append(b)

    def row(self, row, n):
        return np.array(self.lists[self.req_of[row]][:n], dtype=np.int32)


def make(store=None):
    table = TokenTable(BlockLedger(BlockPool(160), block_size=S), block_lists=store)
    cfg = ReclaimConfig(low_watermark=1.0, headroom_blocks=8, theta_F=0.1, check_interval=1)
    return table, ReclamationManager(table, cfg)


def test_an_engines_lists_are_the_tables_only_block_lists():
    own, own_mgr = make()
    lent, lent_mgr = make(EngineLists())
    assert type(own.lists) is ArenaBlockLists and own.arena.blocks is not None
    assert lent.arena.blocks is None  # no block-list array of its own
    rng = np.random.default_rng(0)
    reqs = ["a", "b", "c", "d"]
    freed, moves = [], 0
    for t in (own, lent):
        for r in reqs:
            t.add_request(r)
    for step in range(40):
        counts = rng.integers(1, 12, len(reqs)).tolist()
        victims = []
        for r in reqs:
            live = own.live_ids(r)[:-4]
            victims.append(np.sort(rng.choice(live, size=len(live) // 4, replace=False)) if len(live) > 8 else
                           np.zeros(0, np.int64))
        for t, mgr in ((own, own_mgr), (lent, lent_mgr)):
            t.sync_new_tokens_batch(reqs, counts)
            t.evict_flat(reqs, np.concatenate(victims), [len(v) for v in victims])
            mgr.before_forward()
            plans = mgr.maybe_plan()
            mgr.launch(plans)
            mgr.commit()
            moves += sum(p.num_moves for p in plans) if t is own else 0
            t.check_invariants()
        for r in reqs:
            assert own.block_list(r).tolist() == lent.block_list(r).tolist() == lent.lists.lists[r]
            listed = own.block_list(r)
            assert own.ledger.listed_blocks(own.row_of(r)).tolist() == listed[listed != 0].tolist()
        if step in (15, 30):  # a request leaves, a new one comes
            gone, new = reqs.pop(0), f"n{step}"
            freed.append((own_mgr.finish_request(gone).tolist(), lent_mgr.finish_request(gone).tolist()))
            assert gone not in lent.lists.lists
            for t in (own, lent):
                t.add_request(new)
            reqs.append(new)
    assert moves > 0  # relocations wrote the lists too
    assert all(a == b and a for a, b in freed)
    assert own.ledger.snapshot()["state"].tolist() == lent.ledger.snapshot()["state"].tolist()
