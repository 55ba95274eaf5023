"""Hole-filling plans (vtoken.reclamation.hole_planner): choice vs brute force, plan rules on random states, I1-I4 online."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from reclaim_helpers import Runtime
from vtoken.bookkeeping import invariants
from vtoken.errors import InvalidArgumentError, InvariantViolation
from vtoken.reclamation.hole_planner import select_fill
from vtoken.bookkeeping.ledger import FREE, OWNED, SRC_INFLIGHT
from vtoken.reclamation.planner import select_sources

SEEDS = range(12)
BLOCK_SIZES = [1, 2, 4, 8, 16]


def _brute_k(live, fillable, S, tail_holes, max_src, max_moves):
    """The most sparsest-first sources whose live tokens fit into the other candidates' holes (one by one)."""
    keep = [i for i in range(len(live)) if 0 < live[i] < S]
    order = sorted(keep, key=lambda i: (live[i], i))
    best = 0
    for k in range(1, len(order) + 1):
        moves = sum(live[i] for i in order[:k])
        room = sum(S - live[i] for i in order[k:] if fillable[i]) + tail_holes
        if moves <= room and (max_src is None or k <= max_src) and (max_moves is None or moves <= max_moves):
            best = k
        else:
            break
    return best, order


@pytest.mark.parametrize("seed,S", list(itertools.product(SEEDS, BLOCK_SIZES)))
def test_select_fill_matches_brute_force(seed, S):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 40))
    live = rng.integers(0, S + 1, size=n)
    fillable = rng.random(n) < 0.8
    blocks = rng.permutation(np.arange(1, 200))[:n]
    tail_holes = int(rng.integers(0, S)) if rng.random() < 0.5 else 0
    max_src = None if rng.random() < 0.5 else int(rng.integers(2, 10))
    max_moves = None if rng.random() < 0.5 else int(rng.integers(1, 64))
    c = select_fill(blocks, live, fillable, block_size=S, tail_block=999 if tail_holes else 0,
                    tail_holes=tail_holes, tail_cursor=S, max_src=max_src, max_moves=max_moves)
    k, order = _brute_k(live.tolist(), fillable.tolist(), S, tail_holes, max_src, max_moves)
    if k == 0:
        assert c is None
        return
    assert c.src_blocks.tolist() == [int(blocks[i]) for i in order[:k]]
    assert c.num_moves == sum(int(live[i]) for i in order[:k]) <= k * (S - 1)
    assert not np.intersect1d(c.src_blocks, c.fill_blocks).size
    room = {int(blocks[i]): S - int(live[i]) for i in order[k:] if fillable[i]}
    if tail_holes:
        room[999] = tail_holes
    assert set(c.fill_blocks.tolist()) <= set(room)
    held = [room[b] for b in c.fill_blocks.tolist()]
    # Just enough fill blocks: all but the last are not enough on their own.
    assert sum(held) >= c.num_moves > sum(held[:-1])


@pytest.mark.parametrize("seed,S", list(itertools.product(SEEDS, BLOCK_SIZES)))
def test_hole_filling_frees_at_least_what_a_fresh_plan_frees_with_no_more_moves(seed, S):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 60))
    live = rng.integers(1, S + 1, size=n)
    blocks = np.arange(1, n + 1)
    fresh = select_sources(blocks, live, block_size=S)
    fill = select_fill(blocks, live, np.ones(n, bool), block_size=S)
    if fresh is None:
        return
    assert fill is not None and fill.gain >= fresh.gain
    assert fill.num_moves <= fresh.num_moves


def test_select_fill_rejects_mismatched_shapes():
    with pytest.raises(InvalidArgumentError, match="live / fillable"):
        select_fill(np.arange(3), np.arange(2), np.ones(3, bool), block_size=4)


def _random_runtime(seed, S, **cfg):
    rng = np.random.default_rng(seed)
    rt = Runtime(num_blocks=160, block_size=S, seed=seed, theta_F=0.0, check_invariants=True,
                 headroom_blocks=0, max_src_per_plan=64, max_moves_per_step=4096, **cfg)
    reqs = [f"r{i}" for i in range(int(rng.integers(1, 5)))]
    for r in reqs:
        rt.add(r)
    rt.append(reqs, rng.integers(1, 6 * S, size=len(reqs)).tolist())
    for r in reqs:
        ids = rt.table.live_ids(r)
        k = int(len(ids) * rng.random() * 0.8)
        rt.evict(r, rng.choice(ids, size=k, replace=False))
    # A few more appends after the evictions: the tails hold dead slots below their cursor.
    rt.append(reqs, rng.integers(0, S, size=len(reqs)).tolist())
    return rt, reqs


@pytest.mark.parametrize("seed,S", list(itertools.product(SEEDS, [2, 4, 8, 16])))
def test_hole_plans_on_random_states_follow_every_rule(seed, S):
    rt, reqs = _random_runtime(seed, S)
    led, table = rt.ledger, rt.table
    state0, live0 = led.state.copy(), led.live.copy()
    slots0 = {r: table.slots(r) for r in reqs}
    alive0 = {r: table.live_mask(r) for r in reqs}
    ntok0 = {r: len(slots0[r]) for r in reqs}
    tails0 = {r: table.tail_block(r) for r in reqs}
    free0 = led.num_free
    plans = rt.mgr.maybe_plan()
    for p in plans:
        r, row = p.request, table.row_of(p.request)
        assert p.fills_holes and len(p.dst_blocks) == 0
        fill = p.fill_blocks.astype(np.int64)
        assert ((state0[fill] == OWNED) & (led.owner[fill] == row)).all()  # private, not in flight, not shared
        assert not table.shared.hit_readable[fill].any()
        assert not np.intersect1d(fill, p.src_blocks).size
        assert ((state0[p.src_blocks] == OWNED) & ~np.isin(p.src_blocks, list(tails0.values()))).all()
        # every destination was a hole: no live token of the request there, below the tail's cursor
        live_slots = slots0[r][alive0[r]]
        assert not np.isin(p.dst_slots, live_slots).any()
        assert len(np.unique(p.dst_slots)) == p.num_moves
        cursor = ntok0[r] - (-(-ntok0[r] // S) - 1) * S
        in_tail = p.dst_slots // S == tails0[r]
        assert (p.dst_slots[in_tail] % S < cursor).all()
        # all live tokens of every source move, and pure hole filling moves <= S - 1 per freed block
        assert p.num_moves == int(live0[p.src_blocks].sum()) <= len(p.src_blocks) * (S - 1)
        assert (led.state[p.src_blocks] == SRC_INFLIGHT).all() and (led.state[fill] == SRC_INFLIGHT).all()
    rt.mgr.launch(plans)
    freed = rt.mgr.commit()  # I1 (K/V of every live token), I2 and I4 checked online (check_invariants=True)
    for p in plans:
        assert (led.state[p.src_blocks] == FREE).all() and (led.live[p.src_blocks] == 0).all()
        assert (led.state[p.fill_blocks] == OWNED).all()
    assert sorted(freed.tolist()) == sorted(np.concatenate([p.src_blocks for p in plans]).tolist()) if plans else True
    assert led.num_free == free0 + len(freed)
    invariants.check_table(table)
    for r in reqs:  # the logical view is unchanged
        assert np.array_equal(table.live_mask(r), alive0[r])


def test_random_states_produce_hole_plans():
    """The random-state test is not vacuous: most of its states plan."""
    planned = 0
    for seed, S in itertools.product(SEEDS, [4, 8, 16]):
        rt, _ = _random_runtime(seed, S)
        plans = rt.mgr.maybe_plan()
        planned += bool(plans)
        rt.mgr.abort()
    assert planned >= len(SEEDS)


def _one_request(S=4):
    """One request: 9 full blocks, block i keeps i % 4 + ... live tokens; tail with dead slots."""
    rt = Runtime(num_blocks=64, block_size=S, theta_F=0.0, headroom_blocks=0, check_invariants=True)
    rt.add("a")
    rt.append(["a"], [9 * S + 2])
    rt.evict("a", [i for i in range(4 * S) if i % S])  # blocks 0..3 keep 1 of S
    rt.evict("a", [9 * S])  # a dead slot in the tail, below its cursor (offset 0); offset 1 live
    return rt


def test_tail_slots_at_or_after_the_cursor_are_never_destinations():
    rt = _one_request()
    S, table = rt.S, rt.table
    tail = table.tail_block("a")
    blist = table.block_list("a")
    # only the tail's dead slot and blocks 0..3's holes are holes; make blocks 4..8 unfillable
    table.shared.hit_readable[blist[4:9]] = True
    plans = rt.mgr.maybe_plan()
    assert len(plans) == 1
    p = plans[0]
    assert set(p.fill_blocks.tolist()) <= set(blist[:4].tolist()) | {tail}
    in_tail = p.dst_slots[p.dst_slots // S == tail]
    assert (in_tail % S < 2).all()
    rt.mgr.launch(plans)
    rt.mgr.commit()
    assert table.held_blocks("a") == 10 - 3  # 4 blocks of 1 token + 1 hole in the tail: 3 freed


def test_prefix_readable_blocks_are_never_fill_blocks():
    rt = _one_request()
    table = rt.table
    blist = table.block_list("a")
    table.shared.hit_readable[blist] = True
    table.shared.hit_readable[table.tail_block("a")] = True
    assert rt.mgr.maybe_plan() == []  # sources alone cannot take each other's tokens


def test_a_filled_block_is_no_longer_a_pristine_prefix():
    rt = _one_request()
    plans = rt.mgr.maybe_plan()
    rt.mgr.launch(plans)
    rt.mgr.commit()
    fill = plans[0].fill_blocks
    assert rt.table.shared.moved_into[fill].all()
    pos = int(rt.ledger.pos[fill[0]])
    with pytest.raises(InvalidArgumentError, match="prefix_blocks"):
        rt.table.add_request("b", rt.table.block_list("a")[: pos + 1])


def test_a_fill_block_emptied_in_flight_is_kept_until_the_commit():
    rt = _one_request()
    table, led = rt.table, rt.ledger
    plans = rt.mgr.maybe_plan()
    p = plans[0]
    f = int(p.fill_blocks[0])
    # evict every live token of that fill block while the plan is in flight
    slots = table.slots("a")
    ids = np.flatnonzero(table.live_mask("a") & (slots // rt.S == f))
    table.evict("a", ids)
    assert led.state[f] == SRC_INFLIGHT and led.live[f] == 0  # not released
    rt.mgr.launch(plans)
    rt.mgr.commit()
    assert led.state[f] == OWNED and led.live[f] > 0  # it received the moves
    invariants.check_table(table)


def test_i4_rejects_a_move_into_a_live_slot_or_past_the_cursor():
    import dataclasses

    rt = _one_request()
    table, S = rt.table, rt.S
    p = rt.mgr.maybe_plan()[0]
    invariants.check_plan(p, table, pre_launch=False)
    occupied = table.live_slots("a")
    occupied = occupied[np.isin(occupied // S, p.fill_blocks)][:1]
    bad = dataclasses.replace(p, dst_slots=np.concatenate([occupied, p.dst_slots[1:]]).astype(np.int32))
    with pytest.raises(InvariantViolation, match="live token"):
        invariants.check_plan(bad, table, pre_launch=False)
    tail = table.tail_block("a")
    bad = dataclasses.replace(p, dst_slots=np.concatenate([[tail * S + S - 1], p.dst_slots[1:]]).astype(np.int32),
                              fill_blocks=np.union1d(p.fill_blocks, [tail]).astype(np.int32))
    with pytest.raises(InvariantViolation):
        invariants.check_plan(bad, table, pre_launch=False)
    rt.mgr.abort()


def test_no_pressure_no_moves():
    rt = Runtime(num_blocks=64, block_size=4, theta_F=0.0, headroom_blocks=None, low_watermark=0)
    rt.add("a")
    rt.append(["a"], [36])
    rt.evict("a", [i for i in range(32) if i % 4])
    assert rt.mgr.trigger.deficit() <= 0
    assert rt.mgr.maybe_plan() == []
