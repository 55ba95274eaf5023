"""Hypothesis state machine over the whole reclamation runtime.

Extends the foundation's machine (tests/test_table_statemachine.py: add,
share, append, evict, finish) with the reclaimer's steps: plan, launch (and an
injected copy failure), commit, abort and the pre-forward wait, over REAL KV
tensors and a device mirror (CPU).

Every token gets a unique K/V value when it is appended, recorded in an
independent model (request -> token id -> value, plus the live set). After
every step:

* the table's live ids equal the model's, and every live token's K/V rows
  in every layer hold its value (I1 content, whatever moved and when);
* I2, conservation and live-count recounts (``TokenTable.check_invariants``);
* the device mirror equals the table;
* at most one plan per request is in flight (I4), and nothing stays in flight
  once a step is committed or aborted;

and at teardown every request is finished and the pool is full again: no
block leaked or was freed twice. The manager also runs its own I1/I2/I4
checks (``check_invariants=True``).

Examples: ``VTOKEN_HYPOTHESIS_EXAMPLES`` (default 200 here), e.g.
    VTOKEN_HYPOTHESIS_EXAMPLES=5000 python -m pytest -q tests/test_reclaim_statemachine.py
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vtoken.device.buffers import DeviceMirror
from vtoken.device.copy_engine import CopyEngine
from vtoken.errors import InvalidArgumentError
from vtoken.device.kv_fingerprint import gather_token_rows
from vtoken.layout import KVLayout, kv_cache_shape
from vtoken.bookkeeping.ledger import BlockLedger
from vtoken.bookkeeping.pool import BlockPool
from vtoken.reclamation.manager import ReclaimConfig, ReclamationManager
from vtoken.bookkeeping.table import TokenTable

EXAMPLES = int(os.environ.get("VTOKEN_HYPOTHESIS_EXAMPLES", "200"))
LAYERS = 2


class FlakyCopyEngine(CopyEngine):
    """A copy engine whose next copy can be made to fail (before touching any cache)."""

    fail_next = False

    def _copy(self, src, dst):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected copy failure")
        super()._copy(src, dst)


class ReclaimMachine(RuleBasedStateMachine):
    @initialize(
        S=st.sampled_from([1, 2, 4, 8]),
        num_blocks=st.integers(8, 48),
        headroom=st.integers(0, 4),
        planner=st.sampled_from(["holes", "fresh"]),
        check_interval=st.integers(1, 3),
        max_src=st.integers(2, 8),
        max_moves=st.integers(4, 64),
        layout=st.sampled_from(["nhd", "vllm_flash", "mla"]),
    )
    def setup(self, S, num_blocks, headroom, check_interval, max_src, max_moves, layout, planner):
        self.S = S
        self.ledger = BlockLedger(BlockPool(num_blocks), S)
        self.table = TokenTable(self.ledger, initial_tokens=1)
        shape = kv_cache_shape(layout, num_blocks, S, 1, 4)
        self.caches = [torch.full(shape, -1.0) for _ in range(LAYERS)]
        self.layout = KVLayout.from_tensor(self.caches[0], layout)
        self.mirror = DeviceMirror(self.table, "cpu", initial_tokens=64, min_slack=2)
        if planner == "fresh":
            headroom = max(headroom, 1)  # fresh-block plans need a reserve
        cfg = ReclaimConfig(planner=planner, theta_F=0.0, low_watermark=1.0,
                            headroom_blocks=min(headroom, num_blocks - 1),
                            check_interval=check_interval, max_src_per_plan=max_src,
                            max_moves_per_step=max_moves, check_invariants=True)
        self.engine = FlakyCopyEngine(self.caches, self.layout, max_moves=max_moves)
        self.mgr = ReclamationManager(self.table, cfg, mirror=self.mirror, copy_engine=self.engine)
        self.values: dict = {}  # req -> {token id: value}
        self.live: dict = {}  # req -> set of live ids
        self.ntok: dict = {}
        self.next_id = 0
        self.next_value = 1.0
        self.planned = []  # made by maybe_plan, not launched
        self.launched = []  # launched, not committed

    # ------------------------------------------------------------ helpers
    def _write(self, req, first, slots):
        for i, s in enumerate(np.asarray(slots).tolist()):
            v = self.next_value
            self.next_value += 1.0
            self.values[req][first + i] = v
            self._poke(s, v)

    def _poke(self, slot, v):
        lay, S = self.layout, self.S
        base = (slot // S) * lay.stride_block + (slot % S) * lay.stride_offset
        for li, c in enumerate(self.caches):
            flat = c.view(-1)
            for kv in range(lay.num_kv):
                for h in range(lay.num_heads):
                    o = base + kv * lay.stride_kv + h * lay.stride_head
                    flat[o : o + lay.head_dim] = v + 0.25 * li + 0.125 * kv

    def _reqs(self):
        return sorted(self.live, key=str)

    # -------------------------------------------------------------- rules
    @precondition(lambda self: len(self.live) < 6)
    @rule()
    def add(self):
        r = self.next_id
        self.next_id += 1
        self.table.add_request(r)
        self.values[r], self.live[r], self.ntok[r] = {}, set(), 0

    @precondition(lambda self: 0 < len(self.live) < 6)
    @rule(data=st.data())
    def add_shared(self, data):
        donor = data.draw(st.sampled_from(self._reqs()), label="donor")
        blist = self.table.block_list(donor)
        full = self.ntok[donor] // self.S
        if full == 0:
            return
        k = data.draw(st.integers(1, full), label="k")
        r = self.next_id
        try:
            self.table.add_request(r, blist[:k])
        except InvalidArgumentError:  # not a pristine prefix (relocated or released): rejected, unchanged
            return
        self.next_id += 1
        n = k * self.S
        self.values[r] = {t: self.values[donor][t] for t in range(n)}
        self.live[r], self.ntok[r] = set(range(n)), n

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def append(self, data):
        reqs = data.draw(st.lists(st.sampled_from(self._reqs()), min_size=1, max_size=3, unique=True), label="reqs")
        counts = data.draw(st.lists(st.integers(0, 2 * self.S), min_size=len(reqs), max_size=len(reqs)), label="n")
        slots = self.table.sync_new_tokens_batch(reqs, counts)
        if slots is None:
            return
        off = 0
        for r, n in zip(reqs, counts):
            self._write(r, self.ntok[r], slots[off : off + n])
            self.live[r].update(range(self.ntok[r], self.ntok[r] + n))
            self.ntok[r] += n
            off += n

    @precondition(lambda self: any(self.live.values()))
    @rule(data=st.data())
    def evict(self, data):
        r = data.draw(st.sampled_from([r for r in self._reqs() if self.live[r]]), label="req")
        ids = data.draw(st.lists(st.sampled_from(sorted(self.live[r])), min_size=1, max_size=6, unique=True),
                        label="ids")
        self.table.evict(r, ids)
        self.live[r].difference_update(ids)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def finish(self, data):
        r = data.draw(st.sampled_from(self._reqs()), label="req")
        self.mgr.finish_request(r)
        self.planned = [p for p in self.planned if p.request != r]
        self.launched = [p for p in self.launched if p.request != r]
        del self.values[r], self.live[r], self.ntok[r]

    @precondition(lambda self: not self.planned)
    @rule()
    def plan(self):
        self.planned = self.mgr.maybe_plan()

    @precondition(lambda self: bool(self.planned))
    @rule(fail=st.booleans(), subset=st.booleans())
    def launch(self, fail, subset):
        plans = self.planned[:1] if subset else list(self.planned)
        if fail:
            self.engine.fail_next = True
            with pytest.raises(RuntimeError, match="injected"):
                self.mgr.launch(plans)
            # Every not-yet-launched plan of the step is rolled back; earlier launches stay in flight.
            self.planned = []
            in_flight = sum(len(p.src_blocks) + len(p.dst_blocks) + len(p.fill_blocks) for p in self.launched)
            assert self.ledger.num_inflight == in_flight
        else:
            self.mgr.launch(plans)
            self.planned = self.planned[len(plans):]
            self.launched += plans

    @rule()
    def commit(self):
        self.mgr.commit()  # also rolls back plans made but never launched
        self.planned, self.launched = [], []
        assert self.ledger.num_inflight == 0

    @rule()
    def abort(self):
        self.mgr.abort()
        self.planned, self.launched = [], []
        assert self.ledger.num_inflight == 0

    @rule()
    def before_forward(self):
        self.mgr.before_forward()
        assert self.engine._last_ticket is None

    # --------------------------------------------------------- invariants
    @invariant()
    def table_matches_model_and_kv_holds_every_live_value(self):
        self.table.check_invariants()
        self.mirror.check_against_table()
        for r in self._reqs():
            ids = self.table.live_ids(r)
            assert ids.tolist() == sorted(self.live[r])
            if not len(ids):
                continue
            slots = self.table.live_slots(r)
            want = torch.tensor([self.values[r][t] for t in ids.tolist()], dtype=torch.float32)
            for li, c in enumerate(self.caches):
                rows = gather_token_rows(c, self.layout, slots).view(torch.float32)  # [n, kv, h, d]
                for kv in range(self.layout.num_kv):
                    exp = (want + 0.25 * li + 0.125 * kv)[:, None, None].expand(-1, self.layout.num_heads,
                                                                                 self.layout.head_dim)
                    assert torch.equal(rows[:, kv], exp), f"request {r}: K/V content lost (layer {li}, kv {kv})"

    @invariant()
    def one_plan_per_request(self):
        busy = self.mgr.in_flight()
        assert len(busy) == len(set(busy))
        if not busy:
            assert self.ledger.num_inflight == 0

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        self.mgr.abort()
        for r in self._reqs():
            self.mgr.finish_request(r)
        self.mgr.commit()
        assert self.ledger.num_free == self.ledger.usable_blocks, "a block leaked"
        self.ledger.check_conservation()
        assert self.mirror.tracked() == []


ReclaimMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestReclaimMachine = ReclaimMachine.TestCase
