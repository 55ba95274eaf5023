"""Reclamation runtime: planner, manager (trigger, headroom, backpressure, commit, rollback),
copy-engine protocol, invariants, prefix sharing and metrics.

CPU by default with real KV tensors (the compiled C++ ``compact_kv`` or its
fallbacks through ``vtoken.device.ops``) and ``token_attention`` through ``vtoken.device.ops``
(Triton interpreter on CPU). Every invariant (I1, I2, I4, conservation) runs
after every step: ``VTOKEN_DEBUG_INVARIANTS=1`` is set by conftest.
GPU tests are marked and skipped without CUDA.
"""
from __future__ import annotations

import csv
import io
import itertools
import json
import math

import numpy as np
import pytest
import torch

from reclaim_helpers import Runtime, assert_same
from vtoken.bookkeeping import invariants
from vtoken.device import ops
from vtoken.device.copy_engine import CopyEngine
from vtoken.errors import InvalidArgumentError, InvalidTypeError, InvariantViolation, UnknownRequestError
from vtoken.bookkeeping.ledger import DST_INFLIGHT, SHARED, SRC_INFLIGHT, BlockLedger
from vtoken.metrics import FIELDS
from vtoken.bookkeeping.pool import BlockPool
from vtoken.reclamation.planner import collect_moves, select_sources
from vtoken.reclamation.manager import MAX_MOVES_PER_STEP, ReclaimConfig, ReclamationManager
from vtoken.reclamation.config import auto_headroom
from vtoken.bookkeeping.table import TokenTable

SEEDS = (0, 1, 2)
BLOCK_SIZES = (1, 3, 4, 16)
LAYOUTS = ("nhd", "vllm_flash", "hnd", "vllm_fused")
DTYPES = (torch.float32, torch.bfloat16)


# ----------------------------------------------------------------- planner
def _best_gain_over_subsets(live, S, max_src, max_moves, max_dst):
    """Independent optimum: the best gain over EVERY subset of the candidates."""
    best = 0
    n = len(live)
    for k in range(1, min(n, max_src) + 1):
        for sub in itertools.combinations(range(n), k):
            tot = sum(live[i] for i in sub)
            nd = math.ceil(tot / S)
            if tot <= max_moves and nd <= max_dst:
                best = max(best, k - nd)
    return best


@pytest.mark.parametrize("S", BLOCK_SIZES)
@pytest.mark.parametrize("seed", SEEDS)
def test_select_sources_is_optimal_and_gated(S, seed):
    rng = np.random.default_rng(seed)
    for _ in range(40):
        n = int(rng.integers(0, 8))
        blocks = rng.permutation(np.arange(1, 50))[:n].astype(np.int32)
        live = rng.integers(1, S + 1, size=n).astype(np.int32)
        max_src = int(rng.integers(2, 9))
        max_moves = int(rng.integers(1, 8 * S + 1))
        max_dst = int(rng.integers(1, 6))
        c = select_sources(blocks, live, block_size=S, max_src=max_src, max_moves=max_moves, max_dst=max_dst)
        best = _best_gain_over_subsets(live.tolist(), S, max_src, max_moves, max_dst)
        if best < 1:
            assert c is None
            continue
        assert c is not None and c.gain == best
        # The gate, the budgets, sparsest first, no full block.
        assert len(c.src_blocks) > c.num_dst == math.ceil(c.num_moves / S)
        assert len(c.src_blocks) <= max_src and c.num_moves <= max_moves and c.num_dst <= max_dst
        sorter = np.argsort(blocks)
        chosen = live[sorter[np.searchsorted(blocks[sorter], c.src_blocks)]]
        assert int(chosen.sum()) == c.num_moves and (chosen < S).all()
        assert (np.diff(chosen) >= 0).all(), "sources are taken sparsest first"
        others = live[~np.isin(blocks, c.src_blocks) & (live < S)]
        if len(others):
            assert chosen.max() <= others.min(), "no sparser candidate was skipped"


def test_select_sources_edge_cases():
    # No gain possible: two blocks of 3 at S=4 need two destinations.
    assert select_sources(np.array([1, 2]), np.array([3, 3]), block_size=4) is None
    # Full blocks are never sources; ties go to the earlier block-list position.
    c = select_sources(np.array([7, 5, 9, 4]), np.array([4, 1, 1, 1]), block_size=4)
    assert c.src_blocks.tolist() == [5, 9, 4] and c.num_dst == 1 and c.gain == 2
    # The smallest prefix with the best gain (fewest moves).
    c = select_sources(np.array([1, 2, 3]), np.array([1, 1, 3]), block_size=4)  # gains 0, 1, 1
    assert c.src_blocks.tolist() == [1, 2] and c.gain == 1
    assert select_sources(np.zeros(0, np.int32), np.zeros(0, np.int32), block_size=4) is None
    with pytest.raises(InvalidArgumentError, match="live"):
        select_sources(np.array([1, 2]), np.array([1]), block_size=4)


def test_collect_moves_logical_order_and_stale_slots():
    S = 4
    # tokens 0..9; blocks: token t sits in slot given below. Source blocks 3 and 5.
    slots = np.array([12, 13, 20, 21, 14, 8, 9, 22, 15, 40], dtype=np.int32)
    alive = np.array([1, 0, 1, 1, 1, 1, 0, 1, 1, 1], dtype=bool)
    # token 1 is dead but its stale slot 13 is in source block 3: never moved.
    tids, src, dst = collect_moves(slots, alive, np.array([3, 5]), np.array([7, 6]), block_size=S, num_blocks=12)
    assert tids.dtype == src.dtype == dst.dtype == np.int32
    assert tids.tolist() == [0, 2, 3, 4, 7, 8]
    assert src.tolist() == [12, 20, 21, 14, 22, 15]
    assert dst.tolist() == [28, 29, 30, 31, 24, 25]  # dst block 7 filled completely first
    with pytest.raises(InvalidArgumentError, match="room"):
        collect_moves(slots, alive, np.array([3, 5]), np.array([7]), block_size=S, num_blocks=12)


# ------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(mode="eager"), InvalidArgumentError, "mode"),
        (dict(theta_F=1.0), InvalidArgumentError, "theta_F"),
        (dict(theta_F=-0.1), InvalidArgumentError, "theta_F"),
        (dict(theta_F="0.2"), InvalidTypeError, "theta_F"),
        (dict(low_watermark=-1), InvalidArgumentError, "low_watermark"),
        (dict(low_watermark=1.5), InvalidArgumentError, "low_watermark"),
        (dict(headroom_blocks="4"), InvalidTypeError, "headroom_blocks"),
        (dict(check_interval=0), InvalidArgumentError, "check_interval"),
        (dict(check_interval=True), InvalidTypeError, "check_interval"),
        (dict(max_src_per_plan=1), InvalidArgumentError, "max_src_per_plan"),
        (dict(max_moves_per_step=0), InvalidArgumentError, "max_moves_per_step"),
        (dict(max_moves_per_step=2**31), InvalidArgumentError, "max_moves_per_step"),
        (dict(max_moves_per_step=2**40), InvalidArgumentError, "max_moves_per_step"),
        (dict(max_moves_per_step=8192.0), InvalidTypeError, "max_moves_per_step"),
        (dict(min_gain=0), InvalidArgumentError, "min_gain"),
        (dict(force_sync=1), InvalidTypeError, "force_sync"),
        (dict(check_invariants="yes"), InvalidTypeError, "check_invariants"),
    ],
)
def test_config_validation(kw, exc, match):
    with pytest.raises(exc, match=match):
        ReclaimConfig(**kw)


def test_config_resolve_and_headroom_limit():
    assert ReclaimConfig(low_watermark=0.1, headroom_blocks=0.02).resolve(1000) == (100, 20)
    assert ReclaimConfig(low_watermark=64, headroom_blocks=8).resolve(1000) == (64, 8)
    rt_table = Runtime(num_blocks=16).table
    with pytest.raises(InvalidArgumentError, match="headroom_blocks"):
        ReclamationManager(rt_table, ReclaimConfig(headroom_blocks=100))


# ------------------------------------------------------- end to end (data)
def _attention_all_layers(rt, reqs, q):
    """token_attention over every request's live slots, per layer (through vtoken.device.ops)."""
    lists = [rt.table.live_slots(r) for r in reqs]
    idx = torch.from_numpy(np.concatenate(lists).astype(np.int32))
    ptr = torch.from_numpy(np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int32))
    return [ops.token_attention(q, c, rt.layout, idx, ptr) for c in rt.caches]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_end_to_end_attention_bit_identical(layout, dtype):
    """Random appends + evictions, then reclamation: attention is bit-identical, blocks drop, F < theta."""
    rt = Runtime(num_blocks=120, block_size=8, layout=layout, dtype=dtype, seed=7,
                 low_watermark=1.0, headroom_blocks=8, max_src_per_plan=64, max_moves_per_step=512,
                 theta_F=0.25)
    reqs = ["a", "b", "c"]
    for r in reqs:
        rt.add(r)
    # Build waste first (no maybe_plan call: Naive-Evict behaviour only).
    for step in range(12):
        rt.append(reqs, [5, 7, 6])
        for r in reqs:
            live = rt.table.live_ids(r)
            old = live[:-6]
            k = int(len(old) * (0.6 if step == 11 else 0.05))
            if k:
                rt.evict(r, rt.rng.choice(old, size=k, replace=False))
    F0 = rt.ledger.waste_ratio
    held0 = sum(rt.table.held_blocks(r) for r in reqs)
    assert F0 > 0.25, "the workload must leave reclaimable waste"
    q = torch.randn(len(reqs), 4, rt.layout.head_dim, generator=torch.Generator().manual_seed(3)).to(dtype)
    before = _attention_all_layers(rt, reqs, q)
    slots_before = [rt.table.live_slots(r) for r in reqs]
    moves = 0
    for _ in range(6):
        rt.mgr.before_forward()
        plans = rt.mgr.maybe_plan()
        rt.mgr.launch(plans)
        rt.mgr.commit()
        moves += sum(p.num_moves for p in plans)
    assert moves > 0
    assert any(not np.array_equal(a, rt.table.live_slots(r)) for a, r in zip(slots_before, reqs)), \
        "tokens really moved"
    after = _attention_all_layers(rt, reqs, q)
    for x, y in zip(before, after):
        assert x.dtype == y.dtype and torch.equal(x.view(torch.int16 if dtype != torch.float32 else torch.int32),
                                                  y.view(torch.int16 if dtype != torch.float32 else torch.int32))
    held1 = sum(rt.table.held_blocks(r) for r in reqs)
    assert held1 < held0
    assert rt.ledger.waste_ratio < 0.25 < F0
    # Every request is packed to its ideal (ceil(live/S)) plus at most its tail block.
    for r in reqs:
        assert rt.table.held_blocks(r) <= math.ceil(rt.table.live_count(r) / rt.S) + 1
    rt.table.check_invariants()


@pytest.mark.parametrize("seed", SEEDS)
def test_random_workload_every_invariant_every_step(seed):
    """Many steps of appends, evictions, finishes and reclamation, checked after every step."""
    rt = Runtime(num_blocks=160, block_size=4, seed=seed, low_watermark=0.9, headroom_blocks=5,
                 max_src_per_plan=8, max_moves_per_step=64, mirror=True)
    next_id = 0
    total_moves = 0
    for step in range(50):
        if len(rt.table.requests()) < 5 and rt.mgr.admission_budget().free_blocks > 8 and \
                not rt.mgr.admission_budget().backpressure:
            rt.add(next_id)
            next_id += 1
        if step % 13 == 12 and rt.table.requests():
            rt.mgr.finish_request(rt.table.requests()[0])
        rt.step(evict_frac=0.5, append=3)
        total_moves += rt.mgr.metrics.records[-1].moves
        assert rt.ledger.num_free + rt.ledger.num_owned + rt.ledger.num_shared + rt.ledger.num_inflight \
            == rt.ledger.usable_blocks
        assert rt.ledger.num_inflight == 0, "nothing stays in flight after commit"
    assert total_moves > 0
    for r in list(rt.table.requests()):
        rt.mgr.finish_request(r)
    assert rt.ledger.num_free == rt.ledger.usable_blocks, "no block leaked"


def test_retained_blocks_drop_vs_naive_on_identical_victims():
    def run(mode):
        rt = Runtime(num_blocks=200, block_size=8, seed=11, mode=mode, low_watermark=1.0, headroom_blocks=8,
                     max_src_per_plan=32, max_moves_per_step=1024)
        for r in range(4):
            rt.add(r)
        for _ in range(30):
            rt.step(evict_frac=0.6, append=6)
        return rt

    naive, vt = run("naive"), run("vtoken")
    for r in range(4):  # identical victims: identical logical state
        assert np.array_equal(naive.table.live_ids(r), vt.table.live_ids(r))
    retained_naive = sum(naive.table.held_blocks(r) for r in range(4))
    retained_vt = sum(vt.table.held_blocks(r) for r in range(4))
    assert retained_vt < retained_naive
    assert naive.mgr.metrics.summary()["moves"] == 0
    assert naive.ledger.reserved == 0 and vt.ledger.reserved == 8
    assert vt.ledger.waste_ratio < 0.25 < naive.ledger.waste_ratio


# ------------------------------------------------------------ copy engine
def test_cpu_event_order_forward_copy_commit_free_wait():
    rt = Runtime(num_blocks=64, block_size=4)
    rt.add("a")
    rt.append(["a"], [40])
    rt.evict("a", [i for i in range(32) if i % 4])  # 8 blocks with 1 live token each
    eng = rt.mgr.copy_engine
    assert not rt.mgr.before_forward(), "no launch yet: nothing to wait on"
    plans = rt.mgr.maybe_plan()
    assert plans
    rt.mgr.launch(plans)
    rt.mgr.commit()
    rt.mgr.before_forward()  # the next forward
    kinds = [e[0] for e in eng.log]
    order = ["record_F", "wait_F", "copy", "record_E", "commit", "free", "wait_E"]
    assert kinds == order, kinds
    assert [e[1] for e in eng.log] == [0] * 6 + [1], "the wait happens at the next step"
    assert eng.log[0][2]["on"] == "compute" and eng.log[1][2]["on"] == "relocation"
    assert eng.log[-1][2] == {"on": "compute", "launch_step": 0}
    # One wait per launch: a second forward without a new launch waits on nothing.
    assert not rt.mgr.before_forward()
    assert eng.pending_events == 0 and eng.bytes_in_flight == 0  # CPU copies complete at once


def test_copy_engine_validation_and_bookkeeping_only():
    with pytest.raises(InvalidArgumentError, match="max_moves"):
        CopyEngine(None, None, max_moves=0)
    caches = [torch.zeros(4, 2, 4, 1, 8), torch.zeros(4, 2, 4, 1, 4)]
    from vtoken.layout import KVLayout

    with pytest.raises(InvalidArgumentError, match="kv_caches\\[1\\]"):
        CopyEngine(caches, KVLayout.from_tensor(caches[0], "nhd"), max_moves=4)
    eng = CopyEngine(None, None, max_moves=2)
    assert eng.launch(np.zeros(0, np.int32), np.zeros(0, np.int32), step=0) is None
    with pytest.raises(InvalidArgumentError, match="max_moves"):
        eng.launch(np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int32) + 8, step=0)
    with pytest.raises(InvalidArgumentError, match="shape"):
        eng.launch(np.arange(2, dtype=np.int32), np.arange(1, dtype=np.int32), step=0)
    assert not eng.is_gpu and eng.launches == 0


def test_force_sync_measures_stall_on_cpu_path():
    rt = Runtime(num_blocks=64, block_size=4, force_sync=True)
    rt.add("a")
    rt.append(["a"], [40])
    rt.evict("a", [i for i in range(32) if i % 4])
    plans = rt.mgr.maybe_plan()
    ticket = rt.mgr.launch(plans)
    rt.mgr.commit()
    assert ticket.host_stall_us >= 0.0
    assert [e[0] for e in rt.mgr.copy_engine.log][:5] == ["record_F", "wait_F", "copy", "record_E", "host_sync_E"]


# ------------------------------------------------------ commit / rollback
def _sparse_runtime(**kw):
    rt = Runtime(num_blocks=64, block_size=4, **kw)
    rt.add("a")
    rt.add("b")
    rt.append(["a", "b"], [40, 24])
    rt.evict("a", [i for i in range(32) if i % 4])
    rt.evict("b", [i for i in range(20) if i % 2])
    return rt


def test_copy_failure_rolls_back_everything(monkeypatch):
    rt = _sparse_runtime()
    snap = rt.table.snapshot()
    caches = [c.clone() for c in rt.caches]
    free0 = rt.ledger.num_free

    def boom(*a, **k):
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(ops, "compact_kv", boom)
    plans = rt.mgr.maybe_plan()
    assert len(plans) == 2
    assert (rt.ledger.state[plans[0].dst_blocks] == DST_INFLIGHT).all()
    assert (rt.ledger.state[plans[0].src_blocks] == SRC_INFLIGHT).all()
    with pytest.raises(RuntimeError, match="injected"):
        rt.mgr.launch(plans)
    # Destinations returned, sources and table untouched, nothing lost.
    assert_same(snap, rt.table.snapshot())
    assert rt.ledger.num_free == free0 and rt.ledger.num_inflight == 0
    assert all(torch.equal(a, b) for a, b in zip(caches, rt.caches))
    rt.mgr.commit()
    assert rt.mgr.metrics.records[-1].aborted_plans == 2 and rt.mgr.metrics.records[-1].moves == 0
    # The manager keeps working once the copy works again.
    monkeypatch.undo()
    plans = rt.mgr.maybe_plan()
    rt.mgr.launch(plans)
    freed = rt.mgr.commit()
    assert len(freed) > 0 and rt.ledger.num_inflight == 0


def test_abort_after_launch_and_unlaunched_plans():
    rt = _sparse_runtime()
    snap = rt.table.snapshot()
    plans = rt.mgr.maybe_plan()
    rt.mgr.launch(plans[:1])
    assert rt.mgr.abort() == 2
    assert_same(snap, rt.table.snapshot())
    rt.mgr.commit()
    # Plans made but never launched are rolled back by commit.
    plans = rt.mgr.maybe_plan()
    rt.mgr.launch(plans[:1])
    freed = rt.mgr.commit()
    assert rt.mgr.metrics.records[-1].aborted_plans == 1
    assert set(freed.tolist()) == set(plans[0].src_blocks.tolist())
    assert rt.ledger.num_inflight == 0
    rt.table.check_invariants()


def test_plans_are_exclusive_per_request_and_from_this_step():
    rt = _sparse_runtime()
    plans = rt.mgr.maybe_plan()
    with pytest.raises(InvalidArgumentError, match="unlaunched"):
        rt.mgr.maybe_plan()
    rt.mgr.launch(plans[:1])
    with pytest.raises(InvalidArgumentError, match="unlaunched"):  # plans[1] is still unlaunched
        rt.mgr.maybe_plan()
    rt.mgr.launch(plans[1:])
    # Both requests are in flight: a new plan never includes them (I4).
    assert set(rt.mgr.in_flight()) == {p.request for p in plans}
    assert rt.mgr.maybe_plan() == []
    with pytest.raises(InvalidArgumentError, match="foreign"):
        rt.mgr.launch([plans[0]])
    rt.mgr.commit()


@pytest.mark.parametrize("case", ["one_token", "whole_source", "everything"])
def test_evictions_while_in_flight(case):
    rt = _sparse_runtime()
    plans = rt.mgr.maybe_plan()
    p = next(p for p in plans if p.request == "a")  # 8 sources x 1 live token -> 2 destinations
    if case == "one_token":
        victims = p.token_ids[:1]
    elif case == "whole_source":
        victims = p.token_ids[p.src_slots // 4 == p.src_blocks[0]]
    else:
        victims = p.token_ids
    rt.evict("a", victims)
    # In-flight sources are never released by Naive-Evict, even when emptied.
    assert (rt.ledger.state[p.src_blocks] == SRC_INFLIGHT).all()
    rt.mgr.launch(plans)
    rt.mgr.commit()  # I1 on the survivors, I2, conservation: checked inside (debug flag)
    assert rt.ledger.num_inflight == 0
    assert not np.isin(p.src_blocks, rt.table.block_list("a")).any(), "every source left the block list"
    live = rt.table.live_slots("a")
    assert set((live // 4).tolist()).isdisjoint(p.src_blocks.tolist())
    rt.table.check_invariants()


def test_finish_while_in_flight_leaks_nothing():
    rt = _sparse_runtime()
    plans = rt.mgr.maybe_plan()
    rt.mgr.launch(plans)
    rt.mgr.finish_request("a")
    rt.mgr.commit()
    rt.mgr.finish_request("b")
    assert rt.ledger.num_free == rt.ledger.usable_blocks
    rt.table.check_invariants()


@pytest.mark.debug_checks  # commit() checks I1 only under VTOKEN_DEBUG_INVARIANTS
def test_i1_detects_corrupted_copy(monkeypatch):
    rt = _sparse_runtime()
    real = ops.compact_kv

    def corrupt(caches, layout, src, dst, **kw):
        real(caches, layout, src, dst, **kw)
        caches[1].view(-1)[rt.layout.slot_offset(int(dst[0]))] += 1.0

    monkeypatch.setattr(ops, "compact_kv", corrupt)
    plans = rt.mgr.maybe_plan()
    rt.mgr.launch(plans)
    with pytest.raises(InvariantViolation, match="I1"):
        rt.mgr.commit()


def test_i4_rejects_bad_plans():
    rt = _sparse_runtime(planner="fresh")
    plans = rt.mgr.maybe_plan()
    p = plans[0]
    invariants.check_plans(plans, rt.table, pre_launch=False)
    import dataclasses

    bad = dataclasses.replace(p, dst_slots=p.dst_slots[::-1].copy())
    with pytest.raises(InvariantViolation, match="logical order"):
        invariants.check_plan(bad, rt.table, pre_launch=False)
    bad = dataclasses.replace(p, dst_blocks=np.concatenate([p.dst_blocks, p.src_blocks[:1]]).astype(np.int32))
    with pytest.raises(InvariantViolation):
        invariants.check_plan(bad, rt.table, pre_launch=False)
    with pytest.raises(InvariantViolation, match="two plans"):
        invariants.check_plans([p, p], rt.table, pre_launch=False)
    with pytest.raises(InvariantViolation, match="headroom"):
        invariants.check_plans(plans, rt.table, max_dst=0, pre_launch=False)
    rt.mgr.abort()


# --------------------------------------------------------------- bad input
def _frozen(rt):
    """Everything a rejected call must leave as it was: table, K/V caches, copy-engine log, in-flight set."""
    return rt.table.snapshot(), [c.clone() for c in rt.caches], list(rt.mgr.copy_engine.log), rt.mgr.in_flight()


def _assert_unchanged(rt, frozen):
    snap, caches, log, in_flight = frozen
    assert_same(snap, rt.table.snapshot())
    assert all(torch.equal(a, b) for a, b in zip(caches, rt.caches)), "a rejected launch copied K/V"
    assert list(rt.mgr.copy_engine.log) == log and rt.mgr.in_flight() == in_flight


def test_launch_rejects_a_repeated_plan_before_copying():
    rt = _sparse_runtime()
    plans = rt.mgr.maybe_plan()
    frozen = _frozen(rt)
    with pytest.raises(InvalidArgumentError, match="plans: expected each plan once"):
        rt.mgr.launch([plans[0], plans[0]])
    _assert_unchanged(rt, frozen)
    assert rt.mgr.copy_engine.launches == 0
    # The step goes on: the plans launch once and commit.
    rt.mgr.launch(plans)
    freed = rt.mgr.commit()
    assert set(freed.tolist()) == {b for p in plans for b in p.src_blocks.tolist()}
    assert rt.mgr.metrics.records[-1].aborted_plans == 0 and rt.ledger.num_inflight == 0


def _reregister_a(rt, plans):
    """Finish "a" behind the manager's back and register the id again: it gets the same row back."""
    old = next(p for p in plans if p.request == "a")
    rt.table.finish("a")
    rt.add("a")
    rt.append(["a"], [6])
    assert rt.table.row_of("a") == old.meta["row"], "the scenario needs the row reused"
    assert rt.table.generation("a") != old.meta["generation"]
    return old


def test_launch_rejects_a_plan_whose_request_was_re_registered():
    rt = _sparse_runtime()
    plans = rt.mgr.maybe_plan()
    _reregister_a(rt, plans)
    frozen = _frozen(rt)
    with pytest.raises(InvalidArgumentError, match="finished since maybe_plan"):
        rt.mgr.launch(plans)  # its destinations were freed by the finish: copying would write into free blocks
    _assert_unchanged(rt, frozen)
    new_a = rt.table.snapshot()["per_request"]["a"]
    b_plan = next(p for p in plans if p.request == "b")
    rt.mgr.launch([b_plan])
    freed = rt.mgr.commit()  # the stale plan is dropped, b's commits
    assert set(freed.tolist()) == set(b_plan.src_blocks.tolist())
    assert_same(new_a, rt.table.snapshot()["per_request"]["a"])
    assert rt.mgr.in_flight() == [] and rt.ledger.num_inflight == 0
    rt.table.check_invariants()


def test_commit_drops_a_launched_plan_whose_request_was_re_registered():
    """Before the generation check the stale plan matched (same id, same row) and every commit raised."""
    rt = _sparse_runtime()
    plans = rt.mgr.maybe_plan()
    rt.mgr.launch(plans)
    _reregister_a(rt, plans)
    new_a = rt.table.snapshot()["per_request"]["a"]
    freed = rt.mgr.commit()  # I1 (debug flag) skips the old registration too
    b_plan = next(p for p in plans if p.request == "b")
    assert set(freed.tolist()) == set(b_plan.src_blocks.tolist())
    assert_same(new_a, rt.table.snapshot()["per_request"]["a"])
    assert rt.mgr.in_flight() == [] and rt.ledger.num_inflight == 0
    assert len(rt.mgr.commit()) == 0, "the next step commits normally"
    rt.table.check_invariants()


def test_move_buffer_is_sized_by_the_pool_not_by_the_setting():
    """max_moves_per_step may be as large as int32 slots allow; the move buffer never exceeds the pool's slots."""
    assert ReclaimConfig(max_moves_per_step=MAX_MOVES_PER_STEP).max_moves_per_step == 2**31 - 1
    rt = _sparse_runtime(max_moves_per_step=MAX_MOVES_PER_STEP)
    usable_slots = rt.ledger.usable_blocks * rt.S
    assert rt.mgr.moves_capacity() == rt.mgr.copy_engine.max_moves == usable_slots
    assert CopyEngine(rt.caches, rt.layout, max_moves=MAX_MOVES_PER_STEP).max_moves == rt.layout.num_slots
    # An engine sized to the caches serves any setting; one smaller than a step's moves is refused, unchanged.
    snap = rt.table.snapshot()
    ReclamationManager(rt.table, rt.mgr.config, copy_engine=CopyEngine(rt.caches, rt.layout, max_moves=2**40))
    with pytest.raises(InvalidArgumentError, match=f"copy_engine: expected max_moves >= {usable_slots}"):
        ReclamationManager(rt.table, rt.mgr.config, copy_engine=CopyEngine(None, None, max_moves=usable_slots - 1))
    assert_same(snap, rt.table.snapshot())
    # Reclamation runs as with a step-sized setting.
    plans = rt.mgr.maybe_plan()
    rt.mgr.launch(plans)
    assert len(rt.mgr.commit()) > 0 and rt.mgr.metrics.records[-1].moves == sum(p.num_moves for p in plans) > 0


@pytest.mark.parametrize("table", [None, "table", 3])
def test_manager_rejects_a_table_that_is_not_a_token_table(table):
    with pytest.raises(InvalidTypeError, match="table: expected a TokenTable"):
        ReclamationManager(table)


def test_manager_rejects_bad_arguments_before_reserving_headroom():
    rt = _sparse_runtime()
    snap = rt.table.snapshot()
    with pytest.raises(InvalidTypeError, match="config"):
        ReclamationManager(rt.table, {"mode": "vtoken"})
    with pytest.raises(InvalidArgumentError, match="copy_engine"):
        ReclamationManager(rt.table, ReclaimConfig(headroom_blocks=9, max_moves_per_step=64),
                           copy_engine=CopyEngine(None, None, max_moves=8))
    assert_same(snap, rt.table.snapshot())  # the reserve (6) was not replaced by 9


def test_finish_request_rejects_an_unknown_request_and_changes_nothing():
    rt = _sparse_runtime()
    rt.mgr.maybe_plan()
    rt.table.finish("a")  # behind the manager's back: a's plan is stale, "a" unknown
    frozen = _frozen(rt)
    for req in ("a", "nobody"):
        with pytest.raises(UnknownRequestError, match="req"):
            rt.mgr.finish_request(req)
        _assert_unchanged(rt, frozen)
    rt.mgr.commit()  # rolls back b's plan, drops a's stale one
    assert rt.mgr.metrics.records[-1].aborted_plans == 2
    assert rt.mgr.in_flight() == [] and rt.ledger.num_inflight == 0


# ------------------------------------------- trigger, headroom, backpressure
def test_trigger_gates_and_amortization():
    rt = Runtime(num_blocks=64, block_size=4, check_interval=4, low_watermark=1.0, headroom_blocks=4)
    rt.add("a")
    rt.append(["a"], [12])
    for _ in range(2):  # steps 0, 1: F == 0, nothing to do
        assert rt.mgr.maybe_plan() == []
        rt.mgr.commit()
    rt.append(["a"], [28])
    rt.evict("a", [i for i in range(32) if i % 4])
    assert rt.mgr.maybe_plan() == [] and rt.mgr.step == 2, "checked only every check_interval steps"
    rt.mgr.commit()
    assert rt.mgr.maybe_plan() == []  # step 3
    rt.mgr.commit()
    plans = rt.mgr.maybe_plan()  # step 4
    assert plans and rt.mgr.pending
    rt.mgr.launch(plans)
    rt.mgr.commit()
    # theta_F gate: packed, F is low, nothing triggers.
    assert rt.ledger.waste_ratio <= 0.25
    rt.mgr.maybe_plan()
    assert not rt.mgr.pending


def test_watermark_and_min_gain_gates():
    rt = _sparse_runtime(low_watermark=0)  # free is never below 0
    assert rt.mgr.maybe_plan() == [] and not rt.mgr.pending
    rt = _sparse_runtime(min_gain=1000)
    assert rt.mgr.maybe_plan() == [] and not rt.mgr.pending


def test_admission_budget_and_backpressure():
    S = 4
    rt = Runtime(num_blocks=41, block_size=S, low_watermark=24, headroom_blocks=3, check_interval=1)
    assert rt.ledger.reserved == 3
    b = rt.mgr.admission_budget()
    assert b.free_blocks == 40 - 3 and not b.backpressure
    rt.add("a")
    rt.append(["a"], [4 * 20])  # 20 blocks: free 20 <= watermark 24
    rt.evict("a", [i for i in range(76) if i % 4])
    assert not rt.mgr.admission_budget().backpressure, "pending is only known after a check"
    plans = rt.mgr.maybe_plan()
    assert plans and rt.mgr.pending
    b = rt.mgr.admission_budget()
    assert b.backpressure and b.free_blocks == rt.ledger.num_free - 3
    # Growth cannot eat the headroom: appends see free - reserve.
    assert rt.table.sync_new_tokens("a", 4 * (rt.ledger.num_free - 3 + 1) + 4) is None
    rt.mgr.launch(plans)
    rt.mgr.commit()
    plans = rt.mgr.maybe_plan()
    rt.mgr.launch(plans)
    rt.mgr.commit()
    rt.mgr.maybe_plan()
    assert not rt.mgr.pending and not rt.mgr.admission_budget().backpressure
    assert rt.mgr.metrics.records[0].backpressure


@pytest.mark.parametrize("mode", ["native", "naive"])
def test_modes_without_reclamation(mode):
    rt = _sparse_runtime(mode=mode)
    assert rt.ledger.reserved == 0
    assert rt.mgr.maybe_plan() == [] and rt.mgr.launch([]) is None
    assert len(rt.mgr.commit()) == 0
    assert rt.mgr.evicts == (mode != "native") and not rt.mgr.reclaims
    assert not rt.mgr.admission_budget().backpressure


# ---------------------------------------------------------- prefix sharing
PREFIX_DEGREES = (1, 2, 4, 8)


def test_prefix_sharing_table(capsys):
    """Shared prefix + private suffixes: shared blocks are never moved, suffixes are reclaimed."""
    S, prefix_blocks, suffix = 4, 6, 48
    rows = []
    for degree in PREFIX_DEGREES:
        rt = Runtime(num_blocks=400, block_size=S, seed=degree, low_watermark=1.0, headroom_blocks=8,
                     max_src_per_plan=64, max_moves_per_step=4096)
        rt.add(0)
        rt.append([0], [prefix_blocks * S])
        prefix = rt.table.block_list(0)[:prefix_blocks]
        for r in range(1, degree):
            rt.add(r, prefix)
        reqs = list(range(degree))
        rt.append(reqs, [suffix] * degree)
        # Evict half of every request's tokens, prefix included (a shared block stays while any holder needs it).
        for r in reqs:
            live = rt.table.live_ids(r)[:-4]
            rt.evict(r, rt.rng.choice(live, size=len(live) // 2, replace=False))
        shared = np.flatnonzero(rt.ledger.state == SHARED)
        suffix_before = sum(rt.table.held_blocks(r) for r in reqs) - len(shared) * degree
        moved_src = []
        for _ in range(4):
            plans = rt.mgr.maybe_plan()
            rt.mgr.launch(plans)
            rt.mgr.commit()
            moved_src += [b for p in plans for b in p.src_blocks.tolist()]
        touched_shared = len(set(moved_src) & set(shared.tolist()))
        assert touched_shared == 0
        assert (rt.ledger.state[shared] == SHARED).all()
        suffix_after = sum(rt.table.held_blocks(r) for r in reqs) - len(shared) * degree
        assert suffix_after < suffix_before
        rows.append(dict(degree=degree, shared_blocks=len(shared), shared_relocated=touched_shared,
                         skipped_pct=100.0 if len(shared) else float("nan"),
                         private_blocks_before=suffix_before, private_blocks_after=suffix_after,
                         reclaimed_pct=round(100.0 * (suffix_before - suffix_after) / suffix_before, 1)))
        if degree > 1:
            assert len(shared) > 0
    with capsys.disabled():
        print("\nprefix sharing (S=4, 6 prefix blocks, 48-token suffixes, 50% evicted):")
        print("  ".join(rows[0].keys()))
        for r in rows:
            print("  ".join(str(v) for v in r.values()))


# ----------------------------------------------------------------- metrics
def test_metrics_json_and_csv(tmp_path):
    rt = _sparse_runtime()
    for _ in range(3):
        rt.mgr.before_forward()
        rt.mgr.launch(rt.mgr.maybe_plan())
        rt.mgr.commit()
    recs = rt.mgr.metrics.records
    assert [r.step for r in recs] == [0, 1, 2]
    assert recs[0].plans == 2 and recs[0].moves > 0 and recs[0].freed_blocks > 0 and recs[0].planner_us > 0
    assert recs[1].event_waits == 1 and recs[0].event_waits == 0
    assert recs[-1].free_blocks == rt.ledger.num_free and recs[-1].waste_ratio == rt.ledger.waste_ratio
    js = json.loads(rt.mgr.metrics.to_json(str(tmp_path / "m.json")))
    assert js["summary"]["plans"] == sum(r.plans for r in recs) and len(js["steps"]) == 3
    assert json.load(open(tmp_path / "m.json")) == js
    text = rt.mgr.metrics.to_csv(str(tmp_path / "m.csv"))
    rows = list(csv.DictReader(io.StringIO(text)))
    assert tuple(rows[0].keys()) == FIELDS and int(rows[0]["moves"]) == recs[0].moves
    assert open(tmp_path / "m.csv").read() == text


# ---------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_zero_host_syncs_and_matches_cpu(monkeypatch):
    """The whole per-step runtime path runs under sync-debug 'error' and moves the same bytes as CPU."""
    from vtoken.device.buffers import DeviceMirror, SlotListBuffers

    monkeypatch.setenv("VTOKEN_DEBUG_INVARIANTS", "0")
    dev = torch.device("cuda")
    cpu = Runtime(num_blocks=128, block_size=8, seed=5, check_invariants=False)
    gpu = Runtime(num_blocks=128, block_size=8, seed=5, check_invariants=False)
    gpu.caches = [c.to(dev) for c in cpu.caches]
    gpu.mgr = ReclamationManager(gpu.table, gpu.mgr.config, kv_caches=gpu.caches, layout=gpu.layout,
                                 mirror=DeviceMirror(gpu.table, dev))
    mirror = gpu.mgr.mirror
    bufs = SlotListBuffers(max_reqs=8, nnz_max=4096, max_tokens=64, device=dev)
    for rt in (cpu, gpu):
        for r in range(4):
            rt.table.add_request(r)
    pad = torch.full((1,), -1, dtype=torch.int32, device=dev)
    ops.compact_kv(gpu.caches, gpu.layout, pad, pad, validate=False)  # first-call setup outside the check
    rng_c, rng_g = np.random.default_rng(1), np.random.default_rng(1)
    try:
        for step in range(12):
            if step == 1:  # step 0 warmed up every kernel (first-call setup may sync); none after
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            for rt, rng in ((cpu, rng_c), (gpu, rng_g)):
                rt.mgr.before_forward()
                reqs = rt.table.requests()
                rt.table.sync_new_tokens_batch(reqs, [6] * len(reqs))
                for r in reqs:
                    live = rt.table.live_ids(r)[:-4]
                    v = rng.choice(live, size=len(live) // 3, replace=False)
                    rt.table.evict(r, v)
                if rt is gpu:
                    mirror.build(bufs, reqs, [6] * len(reqs))
                rt.mgr.launch(rt.mgr.maybe_plan())
                rt.mgr.commit()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert gpu.mgr.metrics.summary()["moves"] == cpu.mgr.metrics.summary()["moves"] > 0
    for a, b in zip(cpu.caches, gpu.caches):
        assert torch.equal(a, b.cpu())
    assert gpu.mgr.copy_engine.poll() == 0
    mirror.check_against_table()
    reqs = gpu.table.requests()
    mirror.build(bufs, reqs, [0] * len(reqs))  # after the last commit's moves
    ip = bufs.kv_indptr[: len(reqs) + 1].cpu().numpy()
    want = np.concatenate([gpu.table.live_slots(r) for r in reqs])
    assert np.array_equal(bufs.kv_indices[: ip[-1]].cpu().numpy(), want)


@pytest.mark.gpu
def test_gpu_force_sync_stalls_the_host():
    rt = _sparse_runtime(force_sync=True)
    dev = torch.device("cuda")
    caches = [c.to(dev) for c in rt.caches]
    mgr = ReclamationManager(rt.table, rt.mgr.config, kv_caches=caches, layout=rt.layout)
    plans = mgr.maybe_plan()
    ticket = mgr.launch(plans)
    assert ticket.event.query(), "force_sync: the copy completed before launch returned"
    mgr.commit()
    assert mgr.metrics.records[-1].host_stall_us == ticket.host_stall_us >= 0.0


@pytest.mark.gpu
def test_gpu_move_buffer_is_bounded_by_the_caches():
    rt = _sparse_runtime()
    caches = [c.to("cuda") for c in rt.caches]
    eng = CopyEngine(caches, rt.layout, max_moves=MAX_MOVES_PER_STEP)
    assert eng.max_moves == rt.layout.num_slots and eng._moves_dev.numel() == 2 * rt.layout.num_slots


@pytest.mark.parametrize("check_interval", [1, 8])
def test_a_plan_that_needs_more_than_the_leftover_budget_waits_its_turn(monkeypatch, check_interval):
    """Once this step's earlier plans left too little headroom, planning stops; the next request keeps its place.

    Three requests, each with 9 non-tail blocks keeping 3 of 4 tokens (gain bound 2).
    A plan needs 3 destinations (4 sources of 3 live tokens); the headroom is 4, so
    each step fits one plan and leaves 1 block, too little for the next request.
    """
    import vtoken.reclamation.trigger as trigger_mod

    calls = []
    real = trigger_mod.select_sources
    monkeypatch.setattr(trigger_mod, "select_sources", lambda *a, **k: calls.append(k["max_dst"]) or real(*a, **k))
    rt = Runtime(num_blocks=64, block_size=4, theta_F=0.0, low_watermark=1.0, headroom_blocks=4,
                 check_interval=check_interval, max_src_per_plan=8, planner="fresh")
    reqs = ["a", "b", "c"]
    for r in reqs:
        rt.add(r)
    rt.append(reqs, [37, 37, 37])  # 9 full blocks and a 1-token tail each
    for r in reqs:
        rt.evict(r, np.arange(0, 36, 4))
    planned = []
    for _ in range(3):
        calls.clear()
        rt.mgr.before_forward()
        plans = rt.mgr.maybe_plan()
        rt.mgr.launch(plans)
        rt.mgr.commit()
        planned.append([p.request for p in plans])
        assert [len(p.dst_blocks) for p in plans] == [3]
        # The plan (full budget: 4 blocks), then the next queued request, if any, tried once against the
        # leftover (1 block) and once against the full budget (it would fit, so it waits); no third request.
        assert calls[0] == 4 and calls[1:] in ([], [1, 4])
    assert planned == [["a"], ["b"], ["c"]]
    rt.table.check_invariants()


# ----------------------------------------------------------------------------- the pressure-driven trigger
def _scattered(num_blocks=64, S=4, reqs=("a", "b"), tokens=40):
    """Requests whose non-tail blocks each keep 1 live token of S: plenty to reclaim."""
    t = TokenTable(BlockLedger(BlockPool(num_blocks), S))
    for r in reqs:
        t.add_request(r)
        t.sync_new_tokens(r, tokens)
        t.evict(r, [i for i in range(tokens - S) if i % S])
    return t


def test_no_pressure_moves_nothing_whatever_the_waste():
    t = _scattered(num_blocks=256)
    mgr = ReclamationManager(t, ReclaimConfig(check_interval=1))  # library defaults otherwise
    assert t.ledger.waste_ratio > 0.5 and mgr.trigger.deficit() < 0
    for _ in range(3):
        plans = mgr.maybe_plan()
        mgr.launch(plans)
        mgr.commit()
        assert plans == []
    assert mgr.metrics.totals.moves == 0


def test_pressure_plans_only_until_the_shortfall_is_covered():
    t = _scattered(num_blocks=64, reqs="abcd")  # 4 x 10 blocks held of 63 usable: free 23
    led = t.ledger
    # growth 4 x 2 blocks over check_interval + S = 5 steps, headroom 5: only the watermark (26) presses
    mgr = ReclamationManager(t, ReclaimConfig(check_interval=1, max_src_per_plan=2, low_watermark=26))
    assert t.arena.growth_blocks(5) == 4 * 2 and t.arena.growth_blocks(0) == 0  # 40 tokens + 5: 2 blocks each
    need = mgr.trigger.deficit()
    assert need == 3  # each plan (2 sources of 1 live token into 1 block) nets 1: 3 of the 4 requests
    free0 = led.num_free
    plans = mgr.maybe_plan()
    mgr.launch(plans)
    mgr.commit()
    net = sum(len(p.src_blocks) - len(p.dst_blocks) for p in plans)
    assert plans and net >= need  # covered ...
    assert net - (len(plans[-1].src_blocks) - len(plans[-1].dst_blocks)) < need  # ... and the last plan was needed
    assert led.num_free == free0 + net
    # Covered: the next check finds no shortfall and moves nothing more.
    assert mgr.trigger.deficit() <= 0 and mgr.maybe_plan() == []


def test_waiting_prompts_are_part_of_the_demand():
    t = _scattered(num_blocks=256)
    mgr = ReclamationManager(t, ReclaimConfig(check_interval=1))
    assert mgr.trigger.deficit() < 0 and mgr.maybe_plan() == []
    mgr.commit()
    mgr.note_waiting(t.ledger.num_free)  # a prompt needing every free block is waiting
    assert mgr.trigger.deficit() > 0
    plans = mgr.maybe_plan()
    mgr.launch(plans)
    mgr.commit()
    assert plans
    with pytest.raises(InvalidArgumentError, match="blocks"):
        mgr.note_waiting(-1)


def test_waste_floor_holds_under_pressure():
    t = _scattered(num_blocks=64, reqs="abcd")
    F = t.ledger.waste_ratio
    mgr = ReclamationManager(t, ReclaimConfig(check_interval=1, low_watermark=26, theta_F=min(0.99, F + 0.01)))
    assert mgr.trigger.deficit() > 0 and mgr.maybe_plan() == []  # pressure, but F is under the floor


def test_automatic_headroom_follows_the_running_requests():
    t = TokenTable(BlockLedger(BlockPool(1000), 16))
    mgr = ReclamationManager(t, ReclaimConfig(planner="fresh"))
    assert mgr.headroom == t.ledger.reserved == auto_headroom(0, 16) == 1
    for i in range(10):
        t.add_request(i)
    mgr.admission_budget()
    assert mgr.headroom == t.ledger.reserved == auto_headroom(10, 16) == 15
    with pytest.raises(InvalidArgumentError, match="block_size"):
        ReclaimConfig(planner="fresh").resolve(100)  # an automatic headroom needs the block size
    assert ReclaimConfig(headroom_blocks=7).resolve(100) == (0, 7)


# ------------------------------------------------------- held commit (copies confirmed later)
@pytest.mark.parametrize("planner", ["fresh", "holes"])
@pytest.mark.parametrize("outcome", ["confirm", "abort"])
def test_held_plans_change_nothing_until_confirmed_and_roll_back_cleanly(outcome, planner):
    """``commit(hold=True)`` (the vLLM connector): the table and the sources stay until ``confirm``."""
    t = TokenTable(BlockLedger(BlockPool(40), 4))
    mgr = ReclamationManager(t, ReclaimConfig(low_watermark=40, headroom_blocks=2, check_interval=1, planner=planner))
    t.add_request("a")
    t.sync_new_tokens("a", 32)
    t.evict("a", [i for i in range(28) if i % 4])  # every full block keeps 1 of 4
    slots0, blocks0 = t.slots("a").copy(), t.block_list("a").copy()
    plans = mgr.maybe_plan()
    mgr.launch(plans)
    assert len(plans) == 1 and mgr.commit(hold=True).size == 0
    p = plans[0]
    assert (t.ledger.state[p.src_blocks] == SRC_INFLIGHT).all() and (t.ledger.state[p.dst_blocks] == DST_INFLIGHT).all()
    assert np.array_equal(t.slots("a"), slots0) and np.array_equal(t.block_list("a"), blocks0)
    assert mgr.in_flight() == ["a"] and mgr.maybe_plan() == []  # never planned again while in flight (I4)
    t.sync_new_tokens("a", 1)  # the request grows meanwhile
    t.evict("a", [int(p.token_ids[0])])  # and a moved token dies: the commit takes the survivors
    free0 = t.ledger.num_free
    if outcome == "confirm":
        freed = mgr.confirm(plans)
        assert set(freed.tolist()) == set(p.src_blocks.tolist())
        assert np.isin(t.slots("a")[p.token_ids[1:]], p.dst_slots[1:]).all()
        assert t.ledger.num_free == free0 + len(p.src_blocks)
    else:
        assert mgr.abort(plans) == 1
        assert np.array_equal(t.slots("a")[p.token_ids[1:]], p.src_slots[1:])  # the table still reads the sources
        # The destinations, and the source whose one live token died meanwhile, are free again.
        assert t.ledger.num_free == free0 + len(p.dst_blocks) + 1
        assert (t.ledger.state[p.src_blocks] != SRC_INFLIGHT).all()
    assert mgr.in_flight() == [] and mgr.confirm(plans).size == 0 and mgr.abort(plans) == 0  # settled once
    t.check_invariants()
    t.ledger.check_conservation()


def test_hole_filling_keeps_no_reserve_whatever_the_running_count():
    t = TokenTable(BlockLedger(BlockPool(1000), 16))
    mgr = ReclamationManager(t, ReclaimConfig())
    assert mgr.config.planner == "holes" and mgr.headroom == t.ledger.reserved == 0
    for i in range(40):
        t.add_request(i)
    assert mgr.admission_budget().free_blocks == t.ledger.num_free
    assert mgr.headroom == t.ledger.reserved == 0
    with pytest.raises(InvalidArgumentError, match="planner"):
        ReclaimConfig(planner="dense")
