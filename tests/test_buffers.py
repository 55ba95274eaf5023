"""DeviceMirror + SlotListBuffers: deltas, layout, and slot lists equal to the table.

Each check compares the fixed-address buffers built by ``ops.build_slot_lists``
from the device mirror against the canonical host table: ``kv_indices`` =
every batch request's live slots in logical order, ``kv_indptr`` = the prefix
sum of live counts, ``slot_mapping`` = the slots of each request's new tokens.
Buffers are poisoned before every build, and their addresses never change.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from reclaim_helpers import Runtime
from vtoken.device.buffers import DeviceMirror, SlotListBuffers
from vtoken.errors import InvalidArgumentError, InvalidTypeError
from table_helpers import assert_same

SEEDS = (0, 1, 2, 3)
POISON = -7


def _poison(bufs):
    for t in (bufs.kv_indices, bufs.kv_indptr, bufs.slot_mapping, bufs.kv_pos):
        t.fill_(POISON)


def _expect(table, reqs, new_counts, bufs):
    lists = [table.live_slots(r) for r in reqs]
    live = np.concatenate(lists) if lists else np.zeros(0, np.int32)
    ids = [table.live_ids(r) for r in reqs]
    pos = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    ptr = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int64)
    new = [table.slots(r)[table.num_tokens(r) - k:] for r, k in zip(reqs, new_counts)]
    new = np.concatenate(new) if new else np.zeros(0, np.int32)
    n = len(reqs)
    got_idx = bufs.kv_indices.cpu().numpy()
    got_ptr = bufs.kv_indptr.cpu().numpy()
    got_sm = bufs.slot_mapping.cpu().numpy()
    got_pos = bufs.kv_pos.cpu().numpy()
    assert np.array_equal(got_idx[: len(live)], live)
    assert (got_idx[len(live):] == -1).all()
    assert np.array_equal(got_pos[: len(pos)], pos) and (got_pos[len(pos):] == -1).all()
    assert np.array_equal(got_ptr[: n + 1], ptr) and (got_ptr[n + 1:] == ptr[-1]).all()
    assert np.array_equal(bufs.kv_indptr_host[: n + 1], ptr)
    assert np.array_equal(got_sm[: len(new)], new) and (got_sm[len(new):] == -1).all()


@pytest.mark.parametrize("seed", SEEDS)
def test_random_steps_build_equals_table(seed, monkeypatch):
    # NOTE: the torch reference backend keeps this 40-step x 4-seed test fast;
    # the Triton interpreter costs ~0.8 s per build, and backend equality is
    # tests/test_build_slot_lists.py's job. The other tests use the default dispatch.
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    rt = Runtime(num_blocks=200, block_size=4, seed=seed, mirror=True, low_watermark=0.9, headroom_blocks=6,
                 max_src_per_plan=8, max_moves_per_step=128)
    m = rt.mirror
    bufs = SlotListBuffers(max_reqs=8, nnz_max=2048, max_tokens=64)
    ptrs = [t.data_ptr() for t in (bufs.kv_indices, bufs.kv_indptr, bufs.slot_mapping, bufs.kv_pos)]
    rng = np.random.default_rng(seed)
    next_id = 0
    relocated = 0
    for step in range(40):
        reqs = rt.table.requests()
        if len(reqs) < 6 and rng.random() < 0.4 and rt.mgr.admission_budget().free_blocks > 10:
            if reqs and rng.random() < 0.3 and rt.table.num_tokens(reqs[0]) >= 8:
                # share a pristine prefix block when the donor's first block is untouched
                b0 = rt.table.block_list(reqs[0])[:1]
                try:
                    rt.add(next_id, b0)
                except InvalidArgumentError:
                    rt.add(next_id)
            else:
                rt.add(next_id)
            next_id += 1
        if reqs and rng.random() < 0.1:
            rt.mgr.finish_request(reqs[int(rng.integers(len(reqs)))])
        reqs = rt.table.requests()
        if not reqs:
            continue
        counts = rng.integers(0, 9, size=len(reqs))
        rt.mgr.before_forward()
        if rt.append(reqs, counts) is None:
            counts = np.zeros(len(reqs), dtype=np.int64)
        for r in reqs:
            live = rt.table.live_ids(r)
            if len(live) > 4 and rng.random() < 0.7:
                k = int(rng.integers(1, max(2, len(live) // 3)))
                rt.evict(r, rng.choice(live[:-2], size=min(k, len(live) - 2), replace=False))
        # A batch in a random order, sometimes a subset.
        order = list(rng.permutation(len(reqs))) if rng.random() < 0.3 else list(range(len(reqs)))
        if rng.random() < 0.2 and len(order) > 1:
            order = order[:-1]
        batch = [reqs[i] for i in order]
        new = [int(counts[i]) for i in order]
        _poison(bufs)
        m.sync()  # the step's appends (a segment that outgrew its slack re-lays out here)
        relayouts = m.relayouts
        m.build(bufs, batch, new)
        assert m.relayouts == relayouts  # any order, any subset: read in place
        _expect(rt.table, batch, new, bufs)
        plans = rt.mgr.maybe_plan()
        rt.mgr.launch(plans)
        rt.mgr.commit()  # record_moves into the mirror; the manager checks mirror == table (debug flag)
        relocated += sum(p.num_moves for p in plans)
        m.check_against_table()
    assert relocated > 0 and m.relayouts > 0  # re-layouts come from segments outgrowing their slack
    assert ptrs == [t.data_ptr() for t in (bufs.kv_indices, bufs.kv_indptr, bufs.slot_mapping, bufs.kv_pos)]


def test_any_batch_order_or_subset_reads_the_mirror_in_place():
    rt = Runtime(num_blocks=100, block_size=4, mirror=True, mirror_min_slack=64)
    m = rt.mirror
    for r in "abcd":
        rt.add(r)
    bufs = SlotListBuffers(max_reqs=4, nnz_max=512, max_tokens=32)
    for step in range(3):
        rt.append(list("abcd"), [3, 1, 2, 4])
        rt.evict("b", [rt.table.live_ids("b")[0]])
    slots, alive = m.slots, m.alive
    # The same requests in two different orders, then subsets with requests left out.
    for batch, new in ((list("abcd"), [3, 1, 2, 4]), (list("dbca"), [4, 1, 2, 3]),
                       (["c", "a"], [2, 0]), (["d"], [1]), ([], [])):
        _poison(bufs)
        m.build(bufs, batch, new)
        _expect(rt.table, batch, new, bufs)
        # kv_pos addresses the mirror: entry j of request r sits at mirror_starts[r] + kv_pos[j].
        ptr = bufs.kv_indptr_host
        for i, start in enumerate(bufs.mirror_starts[: len(batch)].tolist()):
            at = start + bufs.kv_pos.numpy()[ptr[i] : ptr[i + 1]]
            assert np.array_equal(m.slots.numpy()[at], bufs.kv_indices.numpy()[ptr[i] : ptr[i + 1]])
    assert m.relayouts == 0 and m.slots is slots and m.alive is alive
    # A removed request leaves dead space that the others never read.
    rt.mgr.finish_request("a")
    m.build(bufs, ["c", "b"], [0, 0])
    _expect(rt.table, ["c", "b"], [0, 0], bufs)
    assert m.relayouts == 0
    with pytest.raises(InvalidArgumentError, match="each request once"):
        m.build(bufs, ["c", "c"], [0, 0])
    m.check_against_table()


def test_growth_past_the_segment_and_same_step_append_evict():
    rt = Runtime(num_blocks=200, block_size=4, mirror=True)
    m = rt.mirror  # min_slack=8 in the helper: segments overflow quickly
    rt.add("a")
    rt.add("b")
    bufs = SlotListBuffers(max_reqs=2, nnz_max=1024, max_tokens=64)
    for step in range(12):
        rt.append(["a", "b"], [7, 5])
        # Evict a token appended in this very step (its alive delta follows its append delta).
        rt.evict("a", [rt.table.num_tokens("a") - 3])
        m.build(bufs, ["a", "b"], [7, 5])
        _expect(rt.table, ["a", "b"], [7, 5], bufs)
    assert m.relayouts > 0
    m.check_against_table()


def test_mirror_argument_errors():
    rt = Runtime(num_blocks=32, block_size=4, mirror=True)
    m = rt.mirror
    rt.add("a")
    bufs = SlotListBuffers(max_reqs=1, nnz_max=8, max_tokens=4)
    with pytest.raises(InvalidArgumentError, match="tracked"):
        m.build(bufs, ["x"], [0])  # not a request of the table
    with pytest.raises(InvalidArgumentError, match="new_token_counts"):
        m.build(bufs, ["a"], [0, 1])
    rt.append(["a"], [6])
    with pytest.raises(InvalidArgumentError, match="new_token_counts"):
        m.build(bufs, ["a"], [7])
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        m.build(bufs, ["a"], [6])
    with pytest.raises(InvalidArgumentError, match="max_reqs"):
        m.build(bufs, ["a", "a"], [0, 0])
    rt.append(["a"], [4])
    with pytest.raises(InvalidArgumentError, match="nnz_max"):
        m.build(bufs, ["a"], [1])
    with pytest.raises(InvalidArgumentError, match="max_reqs"):
        SlotListBuffers(max_reqs=0, nnz_max=8, max_tokens=4)


@pytest.mark.gpu
def test_gpu_mirror_matches_cpu_mirror(monkeypatch):
    monkeypatch.setenv("VTOKEN_DEBUG_INVARIANTS", "0")
    dev = torch.device("cuda")
    cpu = Runtime(num_blocks=128, block_size=8, seed=2, mirror=True, check_invariants=False)
    gm = DeviceMirror(cpu.table, dev, initial_tokens=1024, min_slack=8)
    cb = SlotListBuffers(max_reqs=4, nnz_max=2048, max_tokens=64)
    gb = SlotListBuffers(max_reqs=4, nnz_max=2048, max_tokens=64, device=dev)
    for r in range(3):
        cpu.add(r)
    rng = np.random.default_rng(0)
    try:
        for step in range(10):
            if step == 1:  # step 0 warmed up the kernels (first-call setup may sync); no sync after
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            reqs = cpu.table.requests()
            cpu.append(reqs, [5] * len(reqs))
            for r in reqs:
                v = rng.choice(cpu.table.live_ids(r)[:-2], size=2, replace=False)
                cpu.evict(r, v)
            order = reqs[::-1] if step % 3 == 2 else reqs
            cpu.mirror.build(cb, order, [5] * len(order))
            gm.build(gb, order, [5] * len(order))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for a, b in ((cb.kv_indices, gb.kv_indices), (cb.kv_indptr, gb.kv_indptr), (cb.slot_mapping, gb.slot_mapping),
                 (cb.kv_pos, gb.kv_pos)):
        assert torch.equal(a, b.cpu())
    gm.check_against_table()


def test_mirror_rejects_a_request_twice_in_one_batch_and_keeps_its_state():
    rt = Runtime(num_blocks=32, block_size=4, mirror=True)
    m = rt.mirror
    rt.add("a")
    rt.add("b")
    rt.append(["a", "b"], [5, 3])
    bufs = SlotListBuffers(max_reqs=4, nnz_max=32, max_tokens=16)
    m.build(bufs, ["a", "b"], [5, 3])
    before = [t.clone() for t in (bufs.kv_indices, bufs.kv_indptr, bufs.slot_mapping, m.slots, m.alive)]
    with pytest.raises(InvalidArgumentError, match="reqs: expected each request once"):
        m.build(bufs, ["a", "a"], [0, 0])
    after = (bufs.kv_indices, bufs.kv_indptr, bufs.slot_mapping, m.slots, m.alive)
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    m.check_against_table()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_mirror_on_cuda_without_cuda_is_a_typed_error():
    rt = Runtime(num_blocks=32, block_size=4)
    rt.add("a")
    before = rt.table.snapshot()
    with pytest.raises(InvalidArgumentError, match="device: expected an available device"):
        DeviceMirror(rt.table, "cuda")
    with pytest.raises(InvalidArgumentError, match="device: expected a torch device"):
        DeviceMirror(rt.table, "not-a-device")
    with pytest.raises(InvalidTypeError, match="table: expected a TokenTable"):
        DeviceMirror(object())
    assert_same(before, rt.table.snapshot())
    assert rt.table.journal._readers == {}  # a rejected mirror never subscribed


def test_a_mirror_made_late_and_one_made_early_agree_with_the_table():
    """The mirror follows the journal: appends, evictions, finishes and relocation moves all reach it."""
    rt = Runtime(num_blocks=64, block_size=4, seed=3, mirror=True, theta_F=0.0)
    for r in range(3):
        rt.add(r)
    reclaimed = 0
    late = None
    for step in range(8):
        reclaimed += len(rt.step(evict_frac=0.5, append=4, protect=2))  # relocation commits free blocks
        if step == 3:
            rt.mgr.finish_request(0)
            late = DeviceMirror(rt.table, "cpu", initial_tokens=64, min_slack=4)
    assert reclaimed > 0
    for m in (rt.mirror, late):
        m.check_against_table()


def test_evicting_an_unknown_request_changes_neither_the_table_nor_the_mirror():
    """The mirror has no evict of its own: the table rejects first, so the two never disagree."""
    from vtoken.errors import UnknownRequestError

    rt = Runtime(num_blocks=32, block_size=4, mirror=True)
    rt.add("a")
    rt.append(["a"], [6])
    m = rt.mirror
    m.sync()
    m.flush()
    before, dev = rt.table.snapshot(), (m.slots.clone(), m.alive.clone())
    with pytest.raises(UnknownRequestError, match="req: "):
        rt.table.evict("zzz", [0])
    assert_same(before, rt.table.snapshot())
    m.sync()
    m.flush()
    assert torch.equal(dev[0], m.slots) and torch.equal(dev[1], m.alive)
    assert not hasattr(m, "evict")
    m.check_against_table()


def test_the_mirror_arena_stays_bounded_when_requests_come_and_go():
    """Finished requests' segments are reclaimed by a re-layout; the arena tracks the live size, not history."""
    rt = Runtime(num_blocks=64, block_size=4, mirror=True, mirror_min_slack=8)
    m = rt.mirror
    bufs = SlotListBuffers(max_reqs=4, nnz_max=256, max_tokens=64)
    for i in range(300):
        rt.add(i)
        rt.append([i], [13])
        rt.evict(i, [0, 5])
        live = [r for r in rt.table.requests()]
        m.build(bufs, live, [13 if r == i else 0 for r in live])
        _expect(rt.table, live, [13 if r == i else 0 for r in live], bufs)
        if i >= 2:
            rt.mgr.finish_request(i - 2)  # two requests resident at a time
    m.sync()
    assert m.relayouts > 0
    assert m._end <= 3 * m._seg_cap(13) * 2, m._end  # a few segments, not 300
    m.check_against_table()


def test_an_event_batch_with_an_unknown_kind_changes_nothing():
    m = DeviceMirror(None, "cpu", initial_tokens=64, min_slack=4)
    slots, alive = m.slots.clone(), m.alive.clone()
    events = [("add", 0, "a"), ("append", np.array([0]), np.array([2]), np.array([4, 5], dtype=np.int32)),
              ("bogus", 0)]
    with pytest.raises(InvalidArgumentError, match="events: expected kinds"):
        m.apply(events)
    assert m.tracked() == [] and m.flush() == 0
    assert torch.equal(slots, m.slots) and torch.equal(alive, m.alive)


def _two_request_mirror():
    m = DeviceMirror(None, "cpu", initial_tokens=64, min_slack=4)
    m.apply([("add", 0, "a"), ("append", np.array([0]), np.array([2]), np.array([4, 5], dtype=np.int32)),
             ("add", 1, "b"), ("append", np.array([1]), np.array([3]), np.array([8, 9, 10], dtype=np.int32))])
    m.flush()
    return m


def _state(m):
    return (m.slots.clone(), m.alive.clone(), sorted(m.tracked()), m._n.copy(), m._nlive.copy(), m._end,
            m.deltas.pending() if hasattr(m.deltas, "pending") else None)


@pytest.mark.parametrize("events, match", [
    # row 2 is not tracked: its start (0) is request "a"'s segment
    ([("evict", np.array([2]), np.array([0]))], r"events\[0\]: expected 'evict' of rows tracked by the mirror, got untracked row 2"),
    ([("append", np.array([0, 5]), np.array([1, 1]), np.array([6, 7], dtype=np.int32))],
     r"events\[0\]: expected 'append' of rows tracked .* got untracked row 5"),
    ([("move", 3, np.array([0]), np.array([4], dtype=np.int32), np.array([12], dtype=np.int32))],
     r"events\[0\]: expected 'move' of rows tracked .* got untracked row 3"),
    ([("finish", 0), ("finish", 0)], r"events\[1\]: expected 'finish' of rows tracked .* got untracked row 0"),
    ([("finish", 1), ("evict", np.array([1]), np.array([0]))], r"events\[1\]: expected 'evict' .* untracked row 1"),
    ([("add", 1, "c")], r"events\[0\]: expected 'add' of a free row and a new request, got row 1"),
    ([("add", 4, "a")], r"events\[0\]: expected 'add' of a free row and a new request, got row 4 for 'a'"),
])
def test_an_event_for_an_untracked_row_changes_nothing(events, match):
    """An event naming a row the mirror does not track (or a second finish) is refused before any event of
    its batch is applied; the mirror is bit-identical afterwards and still follows valid events."""
    m = _two_request_mirror()
    before = _state(m)
    with pytest.raises(InvalidArgumentError, match=match):
        m.apply(events)
    after = _state(m)
    assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else np.array_equal(x, y) if isinstance(x, np.ndarray)
               else x == y for x, y in zip(before, after))
    assert m.flush() == 0
    m.apply([("finish", 0), ("add", 0, "c")])  # a finished row is free again, in the same batch
    assert sorted(m.tracked()) == ["b", "c"]


def test_a_mirror_that_goes_away_stops_pinning_the_journal():
    import gc

    rt = Runtime(num_blocks=16, block_size=4)
    m = DeviceMirror(rt.table, "cpu")
    assert len(rt.table.journal._readers) == 1
    del m
    gc.collect()
    assert rt.table.journal._readers == {}
    rt.add("a")
    rt.append(["a"], [3])
    assert rt.table.journal._events == []
