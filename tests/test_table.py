"""Token table + block ledger: every public call, Naive-Evict, sharing, moves, metrics and errors."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from table_helpers import assert_same, make_table
from vtoken.errors import InvalidArgumentError, InvalidTypeError, InvariantViolation, UnknownRequestError
from vtoken.bookkeeping.ledger import (
    DST_INFLIGHT, FREE, NO_OWNER, OWNED, SHARED, SHARED_OWNER, BlockLedger,
)
from vtoken.bookkeeping.pool import NULL_BLOCK, BlockPool

BLOCK_SIZES = [1, 3, 16]
SPLITS = [(1,), (5, 11), (16, 1, 15, 33), (0, 7, 0, 64)]


def expected_slots(blist, S, tids):
    tids = np.asarray(tids)
    return (np.asarray(blist)[tids // S] * S + tids % S).astype(np.int32)


# ---------------------------------------------------------------- append
@pytest.mark.parametrize("S", BLOCK_SIZES)
@pytest.mark.parametrize("splits", SPLITS)
def test_sync_new_tokens_assigns_tail_slots_and_opens_blocks(S, splits):
    t = make_table(256, S)
    t.add_request("a")
    n = 0
    for k in splits:
        free_before = t.ledger.num_free
        out = t.sync_new_tokens("a", k)
        assert out.dtype == np.int32 and len(out) == k
        opened = math.ceil((n + k) / S) - math.ceil(n / S)
        assert t.ledger.num_free == free_before - opened
        n += k
        blist = t.block_list("a")
        assert len(blist) == math.ceil(n / S) and (blist != NULL_BLOCK).all()
        assert np.array_equal(out, expected_slots(blist, S, np.arange(n - k, n)))
    assert t.num_tokens("a") == t.live_count("a") == n
    assert np.array_equal(t.live_ids("a"), np.arange(n))
    assert np.array_equal(t.live_slots("a"), t.slots("a"))
    assert np.array_equal(t.slots("a"), expected_slots(t.block_list("a"), S, np.arange(n)))
    assert t.held_blocks("a") == math.ceil(n / S)
    assert t.tail_block("a") == (int(t.block_list("a")[-1]) if n else NULL_BLOCK)
    assert t.total_tokens() == n
    t.check_invariants()


@pytest.mark.parametrize("S", BLOCK_SIZES)
def test_batch_append_equals_sequential_appends(S):
    counts = [3, 0, 17, 1, 40]
    a, b = make_table(256, S), make_table(256, S)
    for t in (a, b):
        for r in range(5):
            t.add_request(r)
    for _ in range(3):
        out = a.sync_new_tokens_batch(range(5), np.array(counts, dtype=np.int32))
        seq = [b.sync_new_tokens(r, c) for r, c in enumerate(counts)]
        assert np.array_equal(out, np.concatenate(seq))
    assert_same(a.snapshot(), b.snapshot())
    a.check_invariants()


def test_append_out_of_blocks_returns_none_and_changes_nothing():
    t = make_table(5, 4)  # 4 usable blocks
    t.add_request("a")
    t.add_request("b")
    t.sync_new_tokens("a", 10)  # 3 blocks
    before = t.snapshot()
    assert t.sync_new_tokens("b", 5) is None  # needs 2, 1 free
    assert t.sync_new_tokens_batch(["a", "b"], [3, 1]) is None  # 1 + 1 > 1
    assert_same(before, t.snapshot())
    assert t.sync_new_tokens("a", 2) is not None  # fits in the tail: no block needed
    assert t.sync_new_tokens("b", 4) is not None  # exactly the last block
    assert t.ledger.num_free == 0
    t.check_invariants()


def test_reserve_is_hidden_from_appends_but_not_from_the_reclaimer():
    t = make_table(9, 4)  # 8 usable
    led = t.ledger
    t.add_request("a")
    led.set_reserve(3)
    assert led.reserved == 3 and led.admission_free == 5
    assert t.sync_new_tokens("a", 24) is None  # 6 blocks > 5 admissible
    assert t.sync_new_tokens("a", 20) is not None
    assert led.num_free == 3 and led.admission_free == 0
    assert t.sync_new_tokens("a", 1) is None
    assert led.allocate(1, t.row_of("a"), -1, state=DST_INFLIGHT) is None  # reserve applies by default
    dst = led.allocate(2, t.row_of("a"), -1, state=DST_INFLIGHT, use_reserve=True)
    assert dst is not None and led.num_free == 1 and led.admission_free == 0
    assert (led.state[dst] == DST_INFLIGHT).all() and (led.owner[dst] == t.row_of("a")).all()
    led.set_reserve(0)
    assert led.admission_free == 1
    with pytest.raises(InvalidArgumentError, match="n: "):
        led.set_reserve(-1)
    t.check_invariants()


# ----------------------------------------------------------------- evict
@pytest.mark.parametrize("S", BLOCK_SIZES)
def test_evict_keeps_dead_slots_and_reads_stay_logical(S):
    t = make_table(128, S)
    t.add_request("a")
    t.sync_new_tokens("a", 50)
    slots = t.slots("a")
    victims = np.array([49, 3, 0, 17, 18, 30], dtype=np.int32)
    t.evict("a", victims)
    alive = np.ones(50, dtype=bool)
    alive[victims] = False
    assert t.live_count("a") == 44 and t.num_tokens("a") == 50
    assert np.array_equal(t.live_mask("a"), alive)
    assert t.live_ids("a").dtype == np.int64 and np.array_equal(t.live_ids("a"), np.flatnonzero(alive))
    assert t.live_slots("a").dtype == np.int32 and np.array_equal(t.live_slots("a"), slots[alive])
    assert np.array_equal(t.slots("a"), slots)  # dead tokens keep the slot they died in
    t.check_invariants()


@pytest.mark.parametrize("form", ["evict", "evict_batch", "evict_batch_lists", "evict_flat"])
@pytest.mark.parametrize("S", BLOCK_SIZES)
def test_evict_forms_agree(form, S):
    rng = np.random.default_rng(S)
    ref, t = make_table(256, S), make_table(256, S)
    for x in (ref, t):
        for r in range(4):
            x.add_request(r)
        x.sync_new_tokens_batch(range(4), [30, 1, 64, 17])
    per = [rng.choice(n, size=min(n, 9), replace=False) for n in (30, 1, 64, 17)]
    per[2] = np.sort(per[2])  # ascending and shuffled ids both
    for r, ids in enumerate(per):
        ref.evict(r, ids)
    if form == "evict":
        for r, ids in enumerate(per):
            t.evict(r, ids)
    elif form == "evict_batch":
        t.evict_batch(range(4), per)
    elif form == "evict_batch_lists":
        t.evict_batch(list(range(4)), [p.tolist() for p in per])
    else:
        t.evict_flat(range(4), np.concatenate(per), [len(p) for p in per])
    assert_same(ref.snapshot(), t.snapshot())
    t.check_invariants()


@pytest.mark.parametrize("S", [1, 4, 16])
def test_naive_evict_frees_fully_dead_non_tail_blocks_only(S):
    t = make_table(64, S)
    led = t.ledger
    t.add_request("a")
    t.sync_new_tokens("a", 3 * S + 1)  # 4 blocks, the tail holds one token
    b0, b1, b2, tail = t.block_list("a").tolist()
    free0 = led.num_free
    t.evict("a", np.arange(S - 1) + S)  # block 1 partially dead (token 2S-1 lives): kept
    assert led.live[b1] == 1 and led.state[b1] == OWNED and led.num_free == free0
    t.evict("a", np.arange(S))  # block 0 fully dead: freed at once
    assert led.state[b0] == FREE and led.num_free == free0 + 1 and led.owner[b0] == NO_OWNER
    assert t.block_list("a").tolist() == [NULL_BLOCK, b1, b2, tail]
    assert t.held_blocks("a") == 3
    t.evict("a", [3 * S])  # the tail is never freed, even with no live token
    assert led.state[tail] == OWNED and led.live[tail] == 0 and led.num_free == free0 + 1
    t.evict("a", np.arange(S) + 2 * S)
    assert led.state[b2] == FREE
    t.check_invariants()
    # Appending past the dead tail: the old tail becomes a non-tail and goes at once.
    t.sync_new_tokens("a", S - 1)  # fills the tail (still the tail)
    t.evict("a", np.arange(3 * S + 1, 4 * S))
    assert led.state[tail] == OWNED
    t.sync_new_tokens("a", 1)
    assert led.state[tail] == FREE
    assert t.block_list("a")[3] == NULL_BLOCK and t.block_list("a")[4] != NULL_BLOCK
    assert t.live_count("a") == 2
    assert t.live_ids("a").tolist() == [2 * S - 1, 4 * S]
    t.check_invariants()


def test_evicting_everything_keeps_only_the_tail():
    t = make_table(32, 4)
    t.add_request("a")
    t.sync_new_tokens("a", 18)
    t.evict("a", np.arange(18)[::-1].copy())
    blist = t.block_list("a")
    assert (blist[:-1] == NULL_BLOCK).all() and blist[-1] != NULL_BLOCK
    assert t.live_count("a") == 0 and t.ledger.num_allocated == 1
    assert t.live_slots("a").size == 0 and t.live_ids("a").size == 0
    assert t.ledger.waste_ratio == 1.0
    t.check_invariants()


# ---------------------------------------------------------------- metrics
def test_waste_ratio_and_utilization_by_hand():
    t = make_table(32, 4)
    led = t.ledger
    assert led.waste_ratio == 0.0 and led.frac_blocks_at_most(0.5) == 0.0
    t.add_request("a")
    t.sync_new_tokens("a", 10)  # blocks: [4, 4, 2]
    t.evict("a", [0, 1, 2, 5])  # live per block: [1, 3, 2]
    assert led.total_live == 6 and led.num_allocated == 3
    assert led.waste_ratio == pytest.approx(1 - 6 / 12)
    assert led.frac_blocks_at_most(0.25) == pytest.approx(1 / 3)  # live <= 1
    assert led.frac_blocks_at_most(0.5) == pytest.approx(2 / 3)  # live <= 2
    assert led.frac_blocks_at_most(1.0) == 1.0
    t.add_request("b")
    t.sync_new_tokens("b", 4)  # one full block
    assert led.waste_ratio == pytest.approx(1 - 10 / 16)
    assert led.frac_blocks_at_most(0.5) == pytest.approx(2 / 4)
    assert (led.num_owned, led.num_shared, led.num_inflight, led.num_free) == (4, 0, 0, 27)
    assert led.count(OWNED) == 4 and led.usable_blocks == 31


# ----------------------------------------------------------------- moves
def sparse_request(S=4, n=None):
    """Request "a" with 5 blocks; blocks 0..3 are sparse (one or two live tokens)."""
    t = make_table(64, S)
    t.add_request("a")
    t.add_request("other")
    t.sync_new_tokens("a", 5 * S)
    t.sync_new_tokens("other", 2 * S)
    keep = {1, S + 2, 2 * S, 2 * S + 3, 3 * S + 1}
    t.evict("a", [i for i in range(4 * S) if i not in keep])
    return t


def test_apply_moves_into_fresh_destination_blocks():
    S = 4
    t = sparse_request(S)
    led = t.ledger
    row = t.row_of("a")
    blist = t.block_list("a").tolist()
    live_ids = t.live_ids("a")
    srcs = blist[:4]
    toks = live_ids[live_ids < 4 * S]  # 5 tokens -> 2 destination blocks
    F_before, free_before = led.waste_ratio, led.num_free
    dst = led.allocate(2, row, -1, state=DST_INFLIGHT, use_reserve=True)
    assert led.num_inflight == 2 and (led.pos[dst] == -1).all()
    new_slots = np.concatenate([dst[0] * S + np.arange(S), dst[1] * S + np.arange(1)])
    order = np.array([3, 0, 4, 1, 2])  # any order of the move list
    released = t.relocation.apply_moves("a", toks[order], new_slots[order])
    assert sorted(released.tolist()) == sorted(srcs)
    assert (led.state[srcs] == FREE).all()
    # Destinations take the emptied positions, first positions first, in logical order.
    assert t.block_list("a").tolist() == [dst[0], dst[1], NULL_BLOCK, NULL_BLOCK, blist[4]]
    assert (led.state[dst] == OWNED).all() and led.pos[dst].tolist() == [0, 1]
    assert led.live[dst].tolist() == [4, 1] and led.num_inflight == 0
    assert np.array_equal(t.live_ids("a"), live_ids)  # logical order unchanged
    assert np.array_equal(t.live_slots("a")[:5], new_slots)
    assert led.num_free == free_before - 2 + 4
    assert led.waste_ratio < F_before
    t.check_invariants()


def test_apply_moves_into_empty_slots_of_own_blocks():
    S = 4
    t = sparse_request(S)
    led = t.ledger
    blist = t.block_list("a").tolist()
    # Token 1 (block 0) and token S+2 (block 1) move into dead slots of block 2.
    dst = [blist[2] * S + 1, blist[2] * S + 2]  # tokens 2S+1, 2S+2 are dead
    released = t.relocation.apply_moves("a", [1, S + 2], dst)
    assert sorted(released.tolist()) == sorted(blist[:2])
    assert t.block_list("a").tolist() == [NULL_BLOCK, NULL_BLOCK] + blist[2:]
    assert led.live[blist[2]] == 4
    assert t.slots("a")[[1, S + 2]].tolist() == dst
    # The tail's dead slots below the last token are empty too; its future slots are not.
    t.evict("a", [4 * S + 1])
    t.relocation.apply_moves("a", [3 * S + 1], [blist[4] * S + 1])
    assert led.state[blist[3]] == FREE
    t.check_invariants()


def test_unused_destination_blocks_stay_inflight_until_finish():
    S = 4
    t = sparse_request(S)
    led = t.ledger
    row = t.row_of("a")
    dst = led.allocate(3, row, -1, state=DST_INFLIGHT, use_reserve=True)
    before = t.snapshot()
    with pytest.raises(InvalidArgumentError, match="new_slots: expected at most 1 new destination"):
        t.relocation.apply_moves("a", [2 * S, 2 * S + 3], [dst[0] * S, dst[1] * S])  # 1 source emptied, 2 new blocks
    assert_same(before, t.snapshot())
    t.relocation.apply_moves("a", [1, S + 2], [dst[0] * S, dst[0] * S + 1])
    assert led.state[dst[0]] == OWNED and (led.state[dst[1:]] == DST_INFLIGHT).all()
    t.check_invariants()
    free = led.num_free
    freed = t.finish("a")
    assert set(dst[1:].tolist()) <= set(freed.tolist())
    assert led.num_free == free + len(freed) and led.num_inflight == 0
    t.check_invariants()


# ---------------------------------------------------------------- finish
def test_finish_frees_everything_and_rows_are_reused():
    t = make_table(32, 4)
    led = t.ledger
    for r in "abc":
        t.add_request(r)
    t.sync_new_tokens_batch("abc", [9, 5, 12])
    t.evict("b", [0, 1])
    row_b = t.row_of("b")
    blocks_b = t.block_list("b").tolist()
    free = led.num_free
    freed = t.finish("b")
    assert sorted(freed.tolist()) == sorted(blocks_b) and led.num_free == free + 2
    assert (led.state[blocks_b] == FREE).all()
    assert "b" not in t and sorted(t.requests()) == ["a", "c"]
    with pytest.raises(UnknownRequestError, match="req: "):
        t.row_of("b")
    t.add_request("d")
    assert t.row_of("d") == row_b and t.request_of(row_b) == "d"
    assert t.num_tokens("d") == 0 and t.block_list("d").size == 0 and t.tail_block("d") == NULL_BLOCK
    t.sync_new_tokens("d", 3)
    for r in ["a", "c", "d"]:
        t.finish(r)
    assert led.num_free == led.usable_blocks and led.total_live == 0 and led.waste_ratio == 0.0
    assert t.total_tokens() == 0
    t.check_invariants()


# ---------------------------------------------------------------- sharing
def shared_pair(S=4):
    t = make_table(64, S)
    t.add_request("donor")
    t.sync_new_tokens("donor", 3 * S + 2)
    prefix = t.block_list("donor")[:2]
    t.add_request("child", prefix)
    return t, prefix


def test_prefix_blocks_are_shared_with_refcounts():
    S = 4
    t, prefix = shared_pair(S)
    led, pool = t.ledger, t.ledger.allocator
    assert (led.state[prefix] == SHARED).all() and (led.owner[prefix] == SHARED_OWNER).all()
    assert pool.ref_count(prefix).tolist() == [2, 2]
    assert led.holders[int(prefix[0])] == {t.row_of("donor"), t.row_of("child")}
    assert t.num_tokens("child") == t.live_count("child") == 2 * S
    assert np.array_equal(t.live_slots("child"), t.slots("donor")[: 2 * S])
    assert led.num_shared == 2
    out = t.sync_new_tokens("child", 1)  # the child's own tail after the shared prefix
    assert out[0] // S not in prefix
    # A third holder.
    t.add_request("grandchild", prefix[:1])
    assert pool.ref_count(prefix).tolist() == [3, 2]
    t.check_invariants()


def test_shared_live_count_is_the_union_over_holders():
    S = 4
    t, prefix = shared_pair(S)
    led = t.ledger
    b0 = int(prefix[0])
    t.sync_new_tokens("child", 1)
    t.evict("donor", [1])
    assert led.live[b0] == S  # the child still has token 1 alive
    t.evict("child", [1])
    assert led.live[b0] == S - 1
    t.evict("donor", [0, 2, 3])  # the donor has nothing left in b0: drops its reference
    assert t.block_list("donor")[0] == NULL_BLOCK
    assert led.state[b0] == OWNED and led.owner[b0] == t.row_of("child")
    assert led.allocator.ref_count([b0]).tolist() == [1] and led.live[b0] == S - 1
    t.evict("child", [0, 2, 3])  # the last holder empties it: freed
    assert led.state[b0] == FREE and t.block_list("child")[0] == NULL_BLOCK
    t.check_invariants()


def test_finishing_a_holder_hands_shared_blocks_to_the_rest():
    S = 4
    t, prefix = shared_pair(S)
    led = t.ledger
    t.evict("child", [0, 1, 2, 3])  # child drops block 0 (non-tail)
    t.finish("donor")
    b0, b1 = prefix.tolist()
    assert led.state[b0] == FREE  # held by nobody any more
    assert led.state[b1] == OWNED and led.owner[b1] == t.row_of("child") and led.live[b1] == S
    assert led.allocator.ref_count([b1]).tolist() == [1]
    t.check_invariants()


def test_shared_tail_is_kept_until_the_holder_appends():
    S = 4
    t, prefix = shared_pair(S)
    led = t.ledger
    b1 = int(prefix[1])
    t.evict("child", np.arange(S, 2 * S))  # b1 is the child's tail: kept
    assert t.block_list("child")[1] == b1 and led.state[b1] == SHARED
    t.sync_new_tokens("child", 1)  # b1 is no longer the tail: the child lets go
    assert t.block_list("child")[1] == NULL_BLOCK
    assert led.state[b1] == OWNED and led.owner[b1] == t.row_of("donor")
    t.check_invariants()


def test_tokens_in_shared_blocks_cannot_move():
    S = 4
    t, prefix = shared_pair(S)
    t.sync_new_tokens("child", S)
    own = int(t.block_list("child")[2])
    t.evict("child", [2 * S])
    before = t.snapshot()
    with pytest.raises(InvalidArgumentError, match="token_ids: expected tokens in private blocks"):
        t.relocation.apply_moves("child", [0], [own * S])
    with pytest.raises(InvalidArgumentError, match="new_slots: expected slots in blocks owned"):
        t.relocation.apply_moves("child", [2 * S + 1], [int(prefix[0]) * S])
    assert_same(before, t.snapshot())


@pytest.mark.parametrize("case", ["partial", "misaligned", "moved_into", "null", "out_of_range", "duplicate",
                                  "free", "inflight", "float", "2d"])
def test_bad_prefix_blocks_are_rejected(case):
    S = 4
    t = make_table(32, S)
    t.add_request("donor")
    t.sync_new_tokens("donor", 3 * S - 1)  # blocks 0, 1 full; block 2 partial
    bl = t.block_list("donor")
    exc, arg = InvalidArgumentError, [int(bl[0])]
    if case == "partial":
        arg = bl.tolist()
    elif case == "misaligned":
        arg = [int(bl[1])]
    elif case == "moved_into":
        t.evict("donor", [2])  # a dead slot of block 0, then a token moved into it
        t.relocation.apply_moves("donor", [2 * S], [int(bl[0]) * S + 2])
    elif case == "null":
        arg = [0]
    elif case == "out_of_range":
        arg = [99]
    elif case == "duplicate":
        arg = [int(bl[0])] * 2
    elif case == "free":
        arg = [int(bl[-1]) + 1]
    elif case == "inflight":
        arg = t.ledger.allocate(1, t.row_of("donor"), -1, state=DST_INFLIGHT, use_reserve=True).tolist()
    elif case == "float":
        exc, arg = InvalidTypeError, np.array([float(bl[0])])
    elif case == "2d":
        exc, arg = InvalidTypeError, np.array([[bl[0]]])
    before = t.snapshot()
    with pytest.raises(exc, match="prefix_blocks: "):
        t.add_request("child", arg)
    assert_same(before, t.snapshot())
    assert "child" not in t


# ------------------------------------------------- regressions (found by the state machine)
def test_segment_move_keeps_alive_bits_and_tail_block():
    """A request's segment moved to the arena's end kept only whole bytes of alive bits."""
    t = make_table(64, 16, initial_tokens=64)
    t.add_request("a")
    t.sync_new_tokens("a", 5)
    t.add_request("b")
    t.sync_new_tokens("b", 1)
    out = t.sync_new_tokens("a", 100)  # "a" outgrows its segment and moves past "b"
    assert np.array_equal(t.live_ids("a"), np.arange(105))
    assert np.array_equal(out, expected_slots(t.block_list("a"), 16, np.arange(5, 105)))
    t.check_invariants()


def test_moves_into_the_tails_future_slots_are_rejected():
    t = make_table(64, 16)
    t.add_request("a")
    t.sync_new_tokens("a", 20)
    tail = int(t.block_list("a")[1])
    before = t.snapshot()
    with pytest.raises(InvalidArgumentError, match="new_slots: .*reserved for future tokens"):
        t.relocation.apply_moves("a", [0], [tail * 16 + 10])
    assert_same(before, t.snapshot())


# ------------------------------------------------------------ invariants
def corruptions():
    def live(t):
        t.ledger._live[t.block_list("a")[1]] += 1

    def total_live(t):
        t.ledger.total_live += 1

    def two_owners(t):
        t.arena.slots[t.arena.base[t.row_of("a")] + 1] = t.arena.slots[t.arena.base[t.row_of("a")] + 2]

    def state(t):
        t.ledger._state[t.block_list("a")[0]] = FREE

    def state_count(t):
        t.ledger._count[OWNED] += 1

    def nlive(t):
        t._nlive[t.row_of("a")] -= 1

    def foreign(t):
        t.arena.slots[t.arena.base[t.row_of("a")] + 1] = t.block_list("b")[0] * t.S + 9

    def block_list(t):
        t.arena.blocks[t.arena.base[t.row_of("a")] // t.S + 1] = t.block_list("b")[0]

    def pos(t):
        t.ledger._pos[t.block_list("a")[0]] = 3

    return [live, total_live, two_owners, state, state_count, nlive, foreign, block_list, pos]


@pytest.mark.parametrize("corrupt", corruptions(), ids=lambda f: f.__name__)
def test_check_invariants_catches_corruption(corrupt):
    t = make_table(32, 16)
    t.add_request("a")
    t.add_request("b")
    t.sync_new_tokens_batch(["a", "b"], [40, 20])
    t.evict("a", [7, 30])
    t.check_invariants()
    bad = copy.deepcopy(t)
    corrupt(bad)
    with pytest.raises(InvariantViolation):
        bad.check_invariants()
    t.check_invariants()  # the original is untouched


# ---------------------------------------------------------------- errors
def error_table():
    t = make_table(64, 4)
    t.add_request("a")
    t.add_request("b")
    t.sync_new_tokens_batch(["a", "b"], [22, 9])
    t.evict("a", [3, 8, 9, 10, 11])  # block 2 of "a" fully dead: freed
    return t


A_TAIL = lambda t: int(t.block_list("a")[-1])  # noqa: E731
B0 = lambda t: int(t.block_list("b")[0])  # noqa: E731

BAD_CALLS = [
    # unknown request
    ("unknown_evict", lambda t: t.evict("x", [0]), UnknownRequestError, "req: .*'x'"),
    ("unknown_append", lambda t: t.sync_new_tokens("x", 1), UnknownRequestError, "req: "),
    ("unknown_batch_append", lambda t: t.sync_new_tokens_batch(["a", "x"], [1, 1]), UnknownRequestError, "req: .*'x'"),
    ("unknown_evict_batch", lambda t: t.evict_batch(["a", "x"], [[0], [0]]), UnknownRequestError, "req: "),
    ("unknown_evict_flat", lambda t: t.evict_flat(["x"], [0], [1]), UnknownRequestError, "req: "),
    ("unknown_moves", lambda t: t.relocation.apply_moves("x", [0], [A_TAIL(t) * 4]), UnknownRequestError, "req: "),
    ("unknown_finish", lambda t: t.finish("x"), UnknownRequestError, "req: "),
    ("unknown_read", lambda t: t.live_ids("x"), UnknownRequestError, "req: "),
    ("unhashable", lambda t: t.evict(["a"], [0]), UnknownRequestError, "req: "),
    ("duplicate_request", lambda t: t.add_request("a"), InvalidArgumentError, "req: .*already registered"),
    ("unhashable_add", lambda t: t.add_request(["a"]), InvalidArgumentError, "req: .*hashable"),
    # double evict
    ("double_evict", lambda t: t.evict("a", [3]), InvalidArgumentError, "token_ids: .*already-evicted"),
    ("double_evict_mixed", lambda t: t.evict("a", [4, 3]), InvalidArgumentError, "token_ids: .*already-evicted"),
    ("double_evict_batch", lambda t: t.evict_batch(["b", "a"], [[0], [4, 8]]), InvalidArgumentError, "token_ids: "),
    ("double_evict_flat", lambda t: t.evict_flat(["a"], [2, 8], [2]), InvalidArgumentError, "token_ids: "),
    # out-of-range ids
    ("id_too_big", lambda t: t.evict("a", [0, 22]), InvalidArgumentError, r"token_ids: expected ids in \[0, "),
    ("id_negative", lambda t: t.evict("a", [-1]), InvalidArgumentError, "token_ids: "),
    ("id_other_request_range", lambda t: t.evict_batch(["a", "b"], [[0], [9]]), InvalidArgumentError, "token_ids: "),
    ("move_id_out_of_range", lambda t: t.relocation.apply_moves("a", [22], [A_TAIL(t) * 4]), InvalidArgumentError, "token_ids: "),
    # duplicate ids
    ("dup_evict", lambda t: t.evict("a", [5, 5]), InvalidArgumentError, "token_ids: expected unique"),
    ("dup_evict_unsorted", lambda t: t.evict("a", [6, 5, 6]), InvalidArgumentError, "token_ids: expected unique"),
    ("dup_evict_flat", lambda t: t.evict_flat(["a", "a"], [5, 5], [1, 1]), InvalidArgumentError, "token_ids: expected unique"),
    ("dup_move_ids", lambda t: t.relocation.apply_moves("a", [0, 0], [A_TAIL(t) * 4, A_TAIL(t) * 4 + 1]),
     InvalidArgumentError, "token_ids: expected unique"),
    ("dup_move_slots", lambda t: t.relocation.apply_moves("a", [0, 1], [A_TAIL(t) * 4, A_TAIL(t) * 4]),
     InvalidArgumentError, "new_slots: expected unique"),
    ("dup_batch_requests", lambda t: t.sync_new_tokens_batch(["a", "a"], [1, 1]), InvalidArgumentError, "reqs: "),
    # moves to foreign / occupied / bad slots
    ("move_foreign", lambda t: t.relocation.apply_moves("a", [0], [B0(t) * 4 + 3]), InvalidArgumentError, "new_slots: .*owned by"),
    ("move_free_block", lambda t: t.relocation.apply_moves("a", [0], [60 * 4]), InvalidArgumentError, "new_slots: .*owned by"),
    ("move_null_block", lambda t: t.relocation.apply_moves("a", [0], [1]), InvalidArgumentError, r"new_slots: expected slots in \[4, "),
    ("move_out_of_range", lambda t: t.relocation.apply_moves("a", [0], [64 * 4]), InvalidArgumentError, "new_slots: "),
    ("move_occupied", lambda t: t.relocation.apply_moves("a", [0], [int(t.slots("a")[1])]), InvalidArgumentError,
     "new_slots: expected empty slots, got occupied"),
    ("move_future_tail", lambda t: t.relocation.apply_moves("a", [0], [A_TAIL(t) * 4 + 3]), InvalidArgumentError,
     "new_slots: .*future"),
    ("move_dead", lambda t: t.relocation.apply_moves("a", [3], [A_TAIL(t) * 4]), InvalidArgumentError, "token_ids: expected live"),
    ("move_length", lambda t: t.relocation.apply_moves("a", [0, 1], [A_TAIL(t) * 4]), InvalidArgumentError, "new_slots: expected 2"),
    # wrong dtype or shape
    ("float_ids", lambda t: t.evict("a", np.array([1.0])), InvalidTypeError, "token_ids: expected an integer array"),
    ("bool_ids", lambda t: t.evict("a", np.array([True, False])), InvalidTypeError, "token_ids: expected an integer"),
    ("2d_ids", lambda t: t.evict("a", np.array([[0, 1]])), InvalidTypeError, "token_ids: expected a 1-D array"),
    ("str_ids", lambda t: t.evict("a", ["0"]), InvalidTypeError, "token_ids: "),
    ("float_batch_ids", lambda t: t.evict_batch(["a", "b"], [np.array([0]), np.array([1.0])]), InvalidTypeError,
     r"token_ids_per_req\[1\]: expected an integer array"),
    ("bool_batch_ids", lambda t: t.evict_batch(["a", "b"], [np.array([0]), np.array([True])]), InvalidTypeError,
     r"token_ids_per_req\[1\]: "),
    ("2d_batch_ids", lambda t: t.evict_batch(["a", "b"], [np.array([[0]]), np.array([[1]])]), InvalidTypeError,
     r"token_ids_per_req\[0\]: expected a 1-D array"),
    ("mixed_uint_batch_ids", lambda t: t.evict_batch(["a", "b"], [np.array([0], np.uint64), np.array([0.5])]),
     InvalidTypeError, r"token_ids_per_req\[1\]: "),
    ("float_flat_ids", lambda t: t.evict_flat(["a"], np.array([0.0]), [1]), InvalidTypeError, "token_ids: "),
    ("2d_flat_counts", lambda t: t.evict_flat(["a"], [0], [[1]]), InvalidTypeError, "counts: expected a 1-D"),
    ("float_new_slots", lambda t: t.relocation.apply_moves("a", [0], np.array([float(A_TAIL(t) * 4)])), InvalidTypeError,
     "new_slots: expected an integer array"),
    ("2d_new_slots", lambda t: t.relocation.apply_moves("a", [0], np.array([[A_TAIL(t) * 4]])), InvalidTypeError,
     "new_slots: expected a 1-D array"),
    ("float_counts", lambda t: t.sync_new_tokens_batch(["a"], np.array([1.0])), InvalidTypeError, "counts: "),
    ("2d_counts", lambda t: t.sync_new_tokens_batch(["a"], np.array([[1]])), InvalidTypeError, "counts: expected a 1-D"),
    ("float_n", lambda t: t.sync_new_tokens("a", 1.0), InvalidTypeError, "n: "),
    ("bool_n", lambda t: t.sync_new_tokens("a", True), InvalidTypeError, "n: "),
    ("negative_n", lambda t: t.sync_new_tokens("a", -2), InvalidArgumentError, "n: "),
    ("negative_count", lambda t: t.sync_new_tokens_batch(["a", "b"], [1, -1]), InvalidArgumentError, "counts: "),
    ("count_length", lambda t: t.sync_new_tokens_batch(["a", "b"], [1]), InvalidArgumentError, "counts: expected 2"),
    ("batch_length", lambda t: t.evict_batch(["a", "b"], [[0]]), InvalidArgumentError, "token_ids_per_req: expected 2"),
    ("flat_count_length", lambda t: t.evict_flat(["a", "b"], [0], [1]), InvalidArgumentError, "counts: expected 2"),
    ("flat_sum", lambda t: t.evict_flat(["a", "b"], [0, 1], [1, 2]), InvalidArgumentError, "token_ids: expected sum"),
    ("flat_negative", lambda t: t.evict_flat(["a", "b"], [0], [2, -1]), InvalidArgumentError, "counts: "),
]


@pytest.mark.parametrize("name, call, exc, match", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_a_typed_error_and_leaves_state_bit_identical(name, call, exc, match):
    t = error_table()
    before = t.snapshot()
    with pytest.raises(exc, match=match):
        call(t)
    assert_same(before, t.snapshot())
    t.check_invariants()


def test_ledger_constructor_errors():
    with pytest.raises(InvalidArgumentError, match="block_size: "):
        BlockLedger(BlockPool(4), 0)
    with pytest.raises(InvalidArgumentError, match="allocator: "):
        BlockLedger(object(), 16)
    pool = BlockPool(4)
    pool.allocate(1)
    with pytest.raises(InvalidArgumentError, match="allocator: expected an empty allocator"):
        BlockLedger(pool, 16)


def test_evict_batch_mixed_integer_dtypes():
    """uint64 + int64 arrays concatenate to float64 in numpy: the batch must not cast silently."""
    t = make_table(16, 4)
    t.add_request("a")
    t.add_request("b")
    t.sync_new_tokens_batch(["a", "b"], [6, 6])
    t.evict_batch(["a", "b"], [np.array([5], dtype=np.uint64), np.array([0, 2], dtype=np.int8)])
    assert t.live_ids("a").tolist() == [0, 1, 2, 3, 4] and t.live_ids("b").tolist() == [1, 3, 4, 5]
    t.check_invariants()


HUGE_UINT64 = [
    ("evict_max", lambda t, v: t.evict("a", v), "token_ids", np.array([2**64 - 1], dtype=np.uint64)),
    ("evict_just_above_int64", lambda t, v: t.evict("a", v), "token_ids", np.array([1, 2**63], dtype=np.uint64)),
    ("evict_python_ints", lambda t, v: t.evict("a", v), "token_ids", [2**64 - 1]),  # numpy makes these uint64
    ("batch_counts", lambda t, v: t.sync_new_tokens_batch(["a", "b"], v), "counts",
     np.array([1, 2**64 - 1], dtype=np.uint64)),
]


@pytest.mark.parametrize("name, call, arg, value", HUGE_UINT64, ids=[c[0] for c in HUGE_UINT64])
def test_uint64_above_int64_is_rejected_with_its_real_value(name, call, arg, value):
    """A uint64 >= 2**63 must not wrap to a negative id: the message shows the value the caller passed."""
    t = error_table()
    before = t.snapshot()
    big = [int(x) for x in np.asarray(value).tolist() if int(x) >= 2**63]
    with pytest.raises(InvalidArgumentError) as e:
        call(t, value)
    assert str(e.value) == f"{arg}: expected ids < 2**63, got {big}"
    assert_same(before, t.snapshot())
    t.check_invariants()


def test_uint64_below_int64_max_still_works():
    t = error_table()
    t.evict("a", np.array([0, 1], dtype=np.uint64))
    assert t.sync_new_tokens_batch(["a", "b"], np.array([1, 0], dtype=np.uint64)).size == 1
    assert t.live_ids("a").tolist()[:3] == [2, 4, 5] and t.num_tokens("a") == 23
    t.check_invariants()


def test_request_ids_and_rows():
    t = make_table(16, 4)
    for r in ["x", 7, ("t", 1)]:
        t.add_request(r)
    assert t.requests() == ["x", 7, ("t", 1)]
    assert 7 in t and "nope" not in t and [1] not in t
    rows = t.rows_of(["x", ("t", 1), 7])
    assert rows.dtype == np.int64 and [t.request_of(int(r)) for r in rows] == ["x", ("t", 1), 7]
    with pytest.raises(UnknownRequestError, match="req: .*'nope'"):
        t.rows_of(["x", "nope"])


def test_many_requests_grow_the_row_arrays():
    t = make_table(300, 1, initial_tokens=64)
    for r in range(150):
        t.add_request(r)
    t.sync_new_tokens_batch(range(150), np.ones(150, dtype=np.int64))
    assert [int(t.slots(r)[0]) for r in (0, 149)] == [int(t.block_list(0)[0]), int(t.block_list(149)[0])]
    t.check_invariants()


# ------------------------------------------------------------ bytes/token
@pytest.mark.parametrize("S", [16, 32])
def test_metadata_is_at_most_5_bytes_per_token_one_shot(S):
    t = make_table((1 << 16) // S + 1, S)
    t.add_request("a")
    t.sync_new_tokens("a", 1 << 16)
    assert t.total_tokens() == 1 << 16
    assert t.nbytes() / t.total_tokens() <= 5.0


@pytest.mark.parametrize("S", [16, 32])
@pytest.mark.parametrize("R", [1, 8, 64])
def test_metadata_is_at_most_5_bytes_per_token_grown_in_small_appends(S, R):
    """R interleaved requests grow in 1..37-token appends from a tiny arena to 64K tokens."""
    total = 1 << 16
    t = make_table(total // S + R + 1, S, initial_tokens=64)
    for r in range(R):
        t.add_request(r)
    rng = np.random.default_rng(0)
    n = 0
    while n < total:
        counts = rng.integers(1, 38, size=R)
        if n + counts.sum() > total:
            counts[:] = 0
            counts[0] = total - n
        assert t.sync_new_tokens_batch(range(R), counts) is not None
        n += int(counts.sum())
    assert t.total_tokens() == total
    ratio = t.nbytes() / t.total_tokens()
    assert ratio <= 5.0, f"{ratio:.3f} bytes/token"
    for r in range(R):  # the moves on the way kept every token
        assert np.array_equal(t.slots(r), expected_slots(t.block_list(r), S, np.arange(t.num_tokens(r))))
    t.check_invariants()


# ------------------------------------------------- bad input: typed, state unchanged
@pytest.mark.parametrize("req", [float("nan"), np.float64("nan")])
def test_a_request_id_not_equal_to_itself_is_rejected(req):
    t = error_table()
    before = t.snapshot()
    with pytest.raises(InvalidArgumentError, match="req: expected an id equal to itself"):
        t.add_request(req)
    assert_same(before, t.snapshot())


def test_set_reserve_rejects_a_bool():
    t = error_table()
    before = t.snapshot()
    with pytest.raises(InvalidTypeError, match="n: "):
        t.ledger.set_reserve(True)
    assert_same(before, t.snapshot())


def test_evict_batch_takes_a_generator_and_rejects_a_non_iterable():
    t = error_table()
    ref = error_table()
    t.evict_batch(["a"], (ids for ids in [np.array([0, 2])]))
    ref.evict("a", [0, 2])
    assert_same(ref.snapshot(), t.snapshot())
    before = t.snapshot()
    with pytest.raises(InvalidTypeError, match="token_ids_per_req: expected an iterable"):
        t.evict_batch(["a"], 5)
    with pytest.raises(InvalidTypeError, match="reqs: expected an iterable"):
        t.evict_batch(None, [[0]])
    assert_same(before, t.snapshot())


def test_ledger_arrays_are_read_only_outside_the_ledger():
    t = error_table()
    b = int(t.block_list("a")[0])
    for name in ("live", "owner", "pos", "state"):
        with pytest.raises(ValueError, match="read-only"):
            getattr(t.ledger, name)[b] = 0
    t.check_invariants()


def test_evict_batch_names_an_unsigned_id_past_int64_as_given():
    t = error_table()
    before = t.snapshot()
    with pytest.raises(InvalidArgumentError, match="18446744073709551615"):
        t.evict_batch(["a"], [np.array([2**64 - 1], dtype=np.uint64)])
    assert_same(before, t.snapshot())
    t.evict_batch(["a"], [np.array([0, 1], dtype=np.uint64)])  # small unsigned ids still work
    assert not t.is_alive("a", [0, 1]).any()


def test_evict_origin_travels_in_the_journal_and_a_bad_one_changes_nothing():
    from vtoken.errors import InvalidArgumentError

    t = make_table(16, 4)
    t.add_request("a")
    t.sync_new_tokens("a", 6)
    reader = t.journal.subscribe()
    t.evict("a", [1])
    t.evict_flat(["a"], np.array([2]), np.array([1]), origin="device")
    events = t.journal.take(reader)
    assert [(e[0], e[3]) for e in events] == [("evict", "host"), ("evict", "device")]
    with pytest.raises(InvalidArgumentError, match="origin: expected one of"):
        t.evict("a", [3], origin="gpu")
    assert t.live_count("a") == 4 and t.journal.take(reader) == []
