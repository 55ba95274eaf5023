"""Hypothesis state machine over the token table, the block ledger and the pool.

Random sequences of add (fresh, or sharing a live request's full pristine
leading blocks), append, evict, finish, reserve changes and apply_moves (into
fresh DST_INFLIGHT blocks, or into empty slots of the request's own blocks),
plus rejected calls. After every step the real objects are compared with an
independent pure-Python model (per request: a list of (alive, slot) per token
and a block list) and ``check_invariants()`` runs.

The model's Naive-Evict rule is stated once, globally: a request drops every
non-tail block of its block list in which it has no live token; a block that
no request holds (and that is not a pending relocation destination) is free.

Examples: ``VTOKEN_HYPOTHESIS_EXAMPLES`` (default 2000), e.g.
    VTOKEN_HYPOTHESIS_EXAMPLES=100000 python -m pytest -q tests/test_table_statemachine.py
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from table_helpers import assert_same
from vtoken.errors import InvalidArgumentError, InvalidTypeError, UnknownRequestError
from vtoken.bookkeeping.ledger import DST_INFLIGHT, FREE, NO_OWNER, OWNED, SHARED, SHARED_OWNER, BlockLedger
from vtoken.bookkeeping.pool import BlockPool
from vtoken.bookkeeping.table import TokenTable

EXAMPLES = int(os.environ.get("VTOKEN_HYPOTHESIS_EXAMPLES", "2000"))


class Model:
    """Independent reference: lists and sets only, no numpy, no ledger arithmetic."""

    def __init__(self, num_blocks: int, S: int):
        self.nb, self.S = num_blocks, S
        self.reqs: dict[int, dict] = {}  # req -> {"alive": [bool], "slot": [int], "blist": [int]}
        self.pending: dict[int, list[int]] = {}  # req -> DST_INFLIGHT blocks not yet committed
        self.dirty: set[int] = set()  # blocks that received moved tokens since allocation
        self.reserve = 0

    # derived views
    def holders(self, b: int) -> list[int]:
        return [r for r, m in self.reqs.items() if b in m["blist"]]

    def allocated(self) -> set[int]:
        out = {b for m in self.reqs.values() for b in m["blist"] if b}
        for blocks in self.pending.values():
            out.update(blocks)
        return out

    def num_free(self) -> int:
        return self.nb - 1 - len(self.allocated())

    def admission_free(self) -> int:
        return max(0, self.num_free() - self.reserve)

    def live_slots_in(self, b: int) -> set[int]:
        S = self.S
        return {s for m in self.reqs.values() for a, s in zip(m["alive"], m["slot"]) if a and s // S == b}

    def req_live_in(self, r: int, b: int) -> int:
        m = self.reqs[r]
        return sum(1 for a, s in zip(m["alive"], m["slot"]) if a and s // self.S == b)

    def tail_pos(self, r: int) -> int:
        return len(self.reqs[r]["blist"]) - 1

    def private_nontail(self, r: int) -> list[int]:
        m = self.reqs[r]
        return [b for p, b in enumerate(m["blist"]) if b and p != self.tail_pos(r) and len(self.holders(b)) == 1]

    def pristine_at(self, r: int, i: int) -> bool:
        """Block ``i`` of ``r`` is full, holds tokens i*S.. in order, and never received a move."""
        m, S = self.reqs[r], self.S
        b = m["blist"][i] if i < len(m["blist"]) else 0
        return (bool(b) and b not in self.dirty and len(m["alive"]) >= (i + 1) * S
                and m["slot"][i * S : (i + 1) * S] == [b * S + o for o in range(S)])

    def pristine_prefix(self, r: int) -> list[int]:
        """Leading blocks of ``r`` the table must accept as shared prefix blocks."""
        out = []
        while self.pristine_at(r, len(out)):
            out.append(self.reqs[r]["blist"][len(out)])
        return out

    def naive_release(self) -> None:
        for r, m in self.reqs.items():
            for p, b in enumerate(m["blist"]):
                if b and p != self.tail_pos(r) and self.req_live_in(r, b) == 0:
                    m["blist"][p] = 0
        self.dirty &= self.allocated()


class TableMachine(RuleBasedStateMachine):
    @initialize(S=st.integers(1, 16), num_blocks=st.integers(2, 40), grow=st.booleans())
    def setup(self, S, num_blocks, grow):
        self.S = S
        self.pool = BlockPool(num_blocks)
        self.ledger = BlockLedger(self.pool, S)
        # A tiny initial arena forces segment moves, arena growth and compaction.
        self.table = TokenTable(self.ledger, initial_tokens=1 if grow else 1 << 12)
        self.model = Model(num_blocks, S)
        self.next_id = 0

    # ------------------------------------------------------------ helpers
    def _pick_req(self, data):
        return data.draw(st.sampled_from(sorted(self.model.reqs)), label="req")

    def _expect_rejected(self, exc, fn, *args):
        before = self.table.snapshot()
        with pytest.raises(exc):
            fn(*args)
        assert_same(before, self.table.snapshot())

    # -------------------------------------------------------------- rules
    @rule()
    def add(self):
        r = self.next_id
        self.next_id += 1
        self.table.add_request(r)
        self.model.reqs[r] = {"alive": [], "slot": [], "blist": []}

    @precondition(lambda self: any(self.model.pristine_prefix(r) for r in self.model.reqs))
    @rule(data=st.data())
    def add_with_prefix(self, data):
        donors = sorted(r for r in self.model.reqs if self.model.pristine_prefix(r))
        donor = data.draw(st.sampled_from(donors), label="donor")
        pre = self.model.pristine_prefix(donor)
        k = data.draw(st.integers(1, len(pre)), label="k")
        r = self.next_id
        self.next_id += 1
        self.table.add_request(r, np.array(pre[:k], dtype=np.int32))
        S = self.S
        self.model.reqs[r] = {
            "alive": [True] * (k * S),
            "slot": [b * S + o for b in pre[:k] for o in range(S)],
            "blist": list(pre[:k]),
        }

    @precondition(lambda self: bool(self.model.reqs))
    @rule(data=st.data())
    def add_with_bad_prefix(self, data):
        """Blocks that are not a pristine, position-aligned prefix are rejected."""
        m = self.model
        cand = sorted(m.allocated() | {0, m.nb})
        blocks = data.draw(st.lists(st.sampled_from(cand), min_size=1, max_size=3), label="blocks")
        ok = len(set(blocks)) == len(blocks)
        for i, b in enumerate(blocks):
            ok = ok and any(m.pristine_at(r, i) and m.reqs[r]["blist"][i] == b for r in m.reqs)
        if ok:  # happens to be valid: leave it to add_with_prefix
            return
        self._expect_rejected(InvalidArgumentError, self.table.add_request, self.next_id, blocks)

    @precondition(lambda self: bool(self.model.reqs))
    @rule(data=st.data())
    def append(self, data):
        m = self.model
        reqs = data.draw(st.lists(st.sampled_from(sorted(m.reqs)), min_size=1, max_size=4, unique=True), label="reqs")
        if data.draw(st.booleans(), label="decode_step"):  # one token per request: the decode fast path
            counts = [1] * len(reqs)
        else:
            counts = data.draw(st.lists(st.integers(0, 3 * self.S), min_size=len(reqs), max_size=len(reqs)), label="n")
        S = self.S
        need = sum(math.ceil((len(m.reqs[r]["alive"]) + n) / S) - math.ceil(len(m.reqs[r]["alive"]) / S)
                   for r, n in zip(reqs, counts))
        free_before = set(range(1, m.nb)) - m.allocated()
        if len(reqs) == 1 and data.draw(st.booleans(), label="single"):
            out = self.table.sync_new_tokens(reqs[0], counts[0])
        else:
            out = self.table.sync_new_tokens_batch(reqs, np.array(counts, dtype=np.int64))
        if need > m.admission_free():
            assert out is None
            return
        assert out is not None and out.dtype == np.int32 and len(out) == sum(counts)
        got = iter(out.tolist())
        new_blocks = []
        for r, n in zip(reqs, counts):
            mr = m.reqs[r]
            for _ in range(n):
                t = len(mr["alive"])
                s = next(got)
                if t % S == 0:  # opens a block
                    b = s // S
                    assert b in free_before and b not in new_blocks, f"block {b} was not free"
                    new_blocks.append(b)
                    mr["blist"].append(b)
                assert s == mr["blist"][t // S] * S + t % S
                mr["alive"].append(True)
                mr["slot"].append(s)
        assert len(new_blocks) == need
        m.naive_release()

    @precondition(lambda self: any(any(m["alive"]) for m in self.model.reqs.values()))
    @rule(data=st.data())
    def evict(self, data):
        m = self.model
        reqs = sorted(r for r in m.reqs if any(m.reqs[r]["alive"]))
        chosen = data.draw(st.lists(st.sampled_from(reqs), min_size=1, max_size=3, unique=True), label="reqs")
        per = []
        for r in chosen:
            live = [t for t, a in enumerate(m.reqs[r]["alive"]) if a]
            ids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=min(len(live), 2 * self.S), unique=True), label="ids")
            if data.draw(st.booleans(), label="ascending"):  # the grouped fast path of evict
                ids.sort()
            per.append(ids)
        form = data.draw(st.sampled_from(["single", "batch", "batch_lists", "flat"]), label="form")
        if form == "single" and len(chosen) == 1:
            self.table.evict(chosen[0], np.array(per[0], dtype=np.int32))
        elif form == "batch_lists":
            self.table.evict_batch(chosen, per)
        elif form == "flat":
            self.table.evict_flat(chosen, np.array([t for p in per for t in p], dtype=np.int64), [len(p) for p in per])
        else:
            self.table.evict_batch(chosen, [np.array(p, dtype=np.int64) for p in per])
        for r, ids in zip(chosen, per):
            for t in ids:
                m.reqs[r]["alive"][t] = False
        m.naive_release()

    @precondition(lambda self: bool(self.model.reqs))
    @rule(data=st.data())
    def finish(self, data):
        r = self._pick_req(data)
        self.table.finish(r)
        del self.model.reqs[r]
        self.model.pending.pop(r, None)
        self.model.naive_release()

    @rule(n=st.integers(0, 4))
    def set_reserve(self, n):
        self.ledger.set_reserve(n)
        self.model.reserve = n

    @precondition(lambda self: any(self.model.private_nontail(r) for r in self.model.reqs))
    @rule(data=st.data())
    def move_to_fresh_blocks(self, data):
        """The reclaimer's plan: empty some private non-tail blocks into ceil(T/S) DST blocks."""
        m, S = self.model, self.S
        r = data.draw(st.sampled_from(sorted(x for x in m.reqs if m.private_nontail(x))), label="req")
        cands = m.private_nontail(r)
        cands.sort(key=lambda b: (m.req_live_in(r, b), b))  # sparsest first
        k = data.draw(st.integers(1, len(cands)), label="k")
        srcs = set(cands[:k])
        mr = m.reqs[r]
        toks = [t for t, (a, s) in enumerate(zip(mr["alive"], mr["slot"])) if a and s // S in srcs]
        n_dst = math.ceil(len(toks) / S)
        extra = data.draw(st.integers(0, 1), label="extra")  # an unused destination stays DST_INFLIGHT
        if n_dst + extra > m.num_free():
            assert self.ledger.allocate(n_dst + extra, self.table.row_of(r), -1, state=DST_INFLIGHT, use_reserve=True) is None
            return
        dst = self.ledger.allocate(n_dst + extra, self.table.row_of(r), -1, state=DST_INFLIGHT, use_reserve=True)
        assert dst is not None and len(set(dst.tolist()) & m.allocated()) == 0
        dst = dst.tolist()
        m.pending.setdefault(r, []).extend(dst)
        new = [dst[j // S] * S + j % S for j in range(len(toks))]
        order = data.draw(st.permutations(range(len(toks))), label="order")
        released = self.table.relocation.apply_moves(r, np.array([toks[i] for i in order]), np.array([new[i] for i in order]))
        # Model: emptied sources free their positions; destinations take the first ones in order.
        positions = sorted(p for p, b in enumerate(mr["blist"]) if b in srcs)
        assert sorted(released.tolist()) == sorted(srcs)
        for t, s in zip(toks, new):
            mr["slot"][t] = s
        for p in positions:
            mr["blist"][p] = 0
        for p, b in zip(positions, dst[:n_dst]):
            mr["blist"][p] = b
            m.pending[r].remove(b)
        m.dirty.update(dst[:n_dst])
        m.naive_release()

    @precondition(lambda self: any(any(m["alive"]) for m in self.model.reqs.values()))
    @rule(data=st.data())
    def move_within_own_blocks(self, data):
        """Move live tokens of private blocks into empty slots of the request's own blocks."""
        m, S = self.model, self.S
        r = self._pick_req(data)
        mr = m.reqs[r]
        n = len(mr["alive"])
        private = [b for b in mr["blist"] if b and len(m.holders(b)) == 1]
        occupied = {s for a, s in zip(mr["alive"], mr["slot"]) if a}
        tail = mr["blist"][-1] if mr["blist"] else 0
        empty = [b * S + o for b in private for o in range(S)
                 if b * S + o not in occupied and not (b == tail and o >= n - (len(mr["blist"]) - 1) * S)]
        movable = [t for t, (a, s) in enumerate(zip(mr["alive"], mr["slot"])) if a and s // S in private]
        if not empty or not movable:
            return
        k = data.draw(st.integers(1, min(len(empty), len(movable))), label="k")
        toks = data.draw(st.lists(st.sampled_from(movable), min_size=k, max_size=k, unique=True), label="toks")
        dst = data.draw(st.lists(st.sampled_from(empty), min_size=k, max_size=k, unique=True), label="dst")
        before = {b for b in mr["blist"] if b}
        released = self.table.relocation.apply_moves(r, np.array(toks, dtype=np.int32), np.array(dst, dtype=np.int64))
        for t, s in zip(toks, dst):
            mr["slot"][t] = s
        m.dirty.update(s // S for s in dst)
        m.naive_release()
        assert sorted(released.tolist()) == sorted(before - {b for b in mr["blist"] if b})

    @precondition(lambda self: bool(self.model.reqs))
    @rule(data=st.data())
    def rejected_call(self, data):
        """A bad call of each kind raises its typed error and changes nothing."""
        m, S, t = self.model, self.S, self.table
        r = self._pick_req(data)
        mr = m.reqs[r]
        n = len(mr["alive"])
        live = [i for i, a in enumerate(mr["alive"]) if a]
        dead = [i for i, a in enumerate(mr["alive"]) if not a]
        kind = data.draw(st.sampled_from([
            "unknown", "out_of_range", "double_evict", "duplicate", "float", "2d",
            "append_negative", "move_foreign", "move_occupied", "move_dead", "move_shared", "move_future_tail",
        ]), label="kind")
        if kind == "unknown":
            self._expect_rejected(UnknownRequestError, t.evict, "nope", [0])
        elif kind == "out_of_range":
            self._expect_rejected(InvalidArgumentError, t.evict, r, live[:1] + [n + data.draw(st.integers(0, 5))])
        elif kind == "double_evict" and dead:
            self._expect_rejected(InvalidArgumentError, t.evict, r, live[:1] + dead[:1])
        elif kind == "duplicate" and live:
            self._expect_rejected(InvalidArgumentError, t.evict, r, [live[0], live[0]])
        elif kind == "float":
            self._expect_rejected(InvalidTypeError, t.evict, r, np.array([0.0]))
        elif kind == "2d" and live:
            self._expect_rejected(InvalidTypeError, t.evict, r, np.array([[live[0]]]))
        elif kind == "append_negative":
            self._expect_rejected(InvalidArgumentError, t.sync_new_tokens_batch, [r], [-1])
        elif kind.startswith("move") and live:
            tok = live[0]
            if kind == "move_foreign":
                foreign = [b for b in range(1, m.nb) if r not in m.holders(b) and b not in m.pending.get(r, [])]
                if foreign:
                    b = data.draw(st.sampled_from(foreign))
                    self._expect_rejected(InvalidArgumentError, t.relocation.apply_moves, r, [tok], [b * S])
            elif kind == "move_occupied" and len(live) >= 2:
                self._expect_rejected(InvalidArgumentError, t.relocation.apply_moves, r, [tok], [mr["slot"][live[1]]])
            elif kind == "move_dead" and dead and mr["blist"]:
                self._expect_rejected(InvalidArgumentError, t.relocation.apply_moves, r, [dead[0]], [mr["blist"][-1] * S])
            elif kind == "move_shared":
                shared = [i for i in live if len(m.holders(mr["slot"][i] // S)) > 1]
                private = [b for b in mr["blist"] if b and len(m.holders(b)) == 1]
                if shared and private:
                    self._expect_rejected(InvalidArgumentError, t.relocation.apply_moves, r, [shared[0]], [private[0] * S])
            elif kind == "move_future_tail" and n % S:
                self._expect_rejected(InvalidArgumentError, t.relocation.apply_moves, r, [tok], [mr["blist"][-1] * S + S - 1])

    # ---------------------------------------------------------- invariants
    @invariant()
    def matches_model(self):
        if not hasattr(self, "model"):
            return
        m, t, led, S = self.model, self.table, self.ledger, self.S
        t.check_invariants()
        assert sorted(t.requests()) == sorted(m.reqs)
        for r, mr in m.reqs.items():
            alive = np.array(mr["alive"], dtype=bool)
            slots = np.array(mr["slot"], dtype=np.int32)
            assert t.num_tokens(r) == len(alive)
            assert t.live_count(r) == int(alive.sum())
            assert np.array_equal(t.slots(r), slots)
            assert np.array_equal(t.live_mask(r), alive)
            assert np.array_equal(t.live_ids(r), np.nonzero(alive)[0])
            assert np.array_equal(t.live_slots(r), slots[alive])
            assert t.block_list(r).tolist() == mr["blist"]
            assert t.held_blocks(r) == sum(1 for b in mr["blist"] if b)
        # Per-block views of the model, built in one pass each.
        holders: dict[int, list] = {}
        for r, mr in m.reqs.items():
            for b in mr["blist"]:
                if b:
                    holders.setdefault(b, []).append(r)
        live_slots: dict[int, set] = {}
        for mr in m.reqs.values():
            for a, s in zip(mr["alive"], mr["slot"]):
                if a:
                    live_slots.setdefault(s // S, set()).add(s)
        pending = {b: r for r, bl in m.pending.items() for b in bl}
        state, owner, pos = led.state.tolist(), led.owner.tolist(), led.pos.tolist()
        refs = [0] + self.pool.ref_count(np.arange(1, m.nb)).tolist()
        ledger_live = led.live.tolist()
        total_live = 0
        low = 0
        for b in range(1, m.nb):
            h = holders.get(b, [])
            live = len(live_slots.get(b, ()))
            if b in pending:
                exp_state, exp_owner, exp_ref, exp_pos = DST_INFLIGHT, t.row_of(pending[b]), 1, -1
            elif len(h) >= 2:
                exp_state, exp_owner, exp_ref = SHARED, SHARED_OWNER, len(h)
                exp_pos = m.reqs[h[0]]["blist"].index(b)
            elif len(h) == 1:
                exp_state, exp_owner, exp_ref = OWNED, t.row_of(h[0]), 1
                exp_pos = m.reqs[h[0]]["blist"].index(b)
            else:
                exp_state, exp_owner, exp_ref, exp_pos = FREE, NO_OWNER, 0, -1
            assert (state[b], owner[b], pos[b]) == (exp_state, exp_owner, exp_pos), f"block {b}"
            assert refs[b] == exp_ref, f"block {b} ref"
            assert ledger_live[b] == live, f"block {b} live"
            if exp_state == SHARED:
                assert led.holders[b] == {t.row_of(x) for x in h}
            if exp_state != FREE:
                total_live += live
                low += live <= 0.5 * S
        alloc = m.nb - 1 - m.num_free()
        assert led.num_free == self.pool.num_free == m.num_free()
        assert led.admission_free == m.admission_free()
        assert led.total_live == total_live
        if alloc:
            assert led.waste_ratio == pytest.approx(1 - total_live / (alloc * S), abs=1e-12)
            assert led.frac_blocks_at_most(0.5) == pytest.approx(low / alloc, abs=1e-12)
        else:
            assert led.waste_ratio == 0.0 and led.frac_blocks_at_most(0.5) == 0.0


TableMachine.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
test_table_state_machine = TableMachine.TestCase
