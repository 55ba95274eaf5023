"""DeltaJournal: the table emits every change once, in order, to every reader."""
import numpy as np
import pytest

from table_helpers import make_table
from vtoken.errors import InvalidArgumentError
from vtoken.bookkeeping.journal import DeltaJournal


def test_readers_see_events_from_their_subscription_on_and_the_log_is_trimmed():
    j = DeltaJournal()
    j.emit("x", 0)  # no reader: dropped
    a = j.subscribe()
    j.emit("x", 1)
    b = j.subscribe()
    j.emit("x", 2)
    assert j.take(a) == [("x", 1), ("x", 2)]
    assert j.pending(b) == 1
    assert j.take(b) == [("x", 2)]
    assert j.take(a) == [] and len(j._events) == 0
    j.unsubscribe(a)
    with pytest.raises(InvalidArgumentError, match="reader: "):
        j.take(a)


def replay(events, S):
    """A host mirror built only from the events: per row, slots and alive bits."""
    rows = {}
    for ev in events:
        kind = ev[0]
        if kind == "add":
            rows[ev[1]] = {"req": ev[2], "slots": [], "alive": []}
        elif kind == "append":
            _, rs, counts, slots = ev
            i = 0
            for r, c in zip(rs.tolist(), counts.tolist()):
                rows[r]["slots"] += slots[i : i + c].tolist()
                rows[r]["alive"] += [True] * c
                i += c
        elif kind == "evict":
            for r, t in zip(ev[1].tolist(), ev[2].tolist()):
                rows[r]["alive"][t] = False
        elif kind == "move":
            _, r, tids, old, new = ev
            for t, o, s in zip(tids.tolist(), old.tolist(), new.tolist()):
                assert rows[r]["slots"][t] == o
                rows[r]["slots"][t] = s
        elif kind == "finish":
            del rows[ev[1]]
    return rows


def test_a_replay_of_the_events_equals_the_table():
    rng = np.random.default_rng(0)
    t = make_table(256, 4)
    reader = t.journal.subscribe()
    prefix_src = None
    for step in range(60):
        if step % 7 == 0:
            rid = f"r{step}"
            if prefix_src is not None and prefix_src in t and t.num_tokens(prefix_src) >= 8:
                blist = t.block_list(prefix_src)[:2]
                alive = [t.is_alive(prefix_src, np.arange(i * 4, i * 4 + 4)).all() for i in range(2)]
                try:
                    t.add_request(rid, blist if all(alive) else None)
                except InvalidArgumentError:
                    t.add_request(rid)
            else:
                t.add_request(rid)
            prefix_src = prefix_src or rid
        reqs = t.requests()
        t.sync_new_tokens_batch(reqs, rng.integers(0, 4, len(reqs)).tolist())
        for r in reqs:
            live = t.live_ids(r)
            if len(live) > 6:
                t.evict(r, rng.choice(live[:-2], size=2, replace=False))
        if step % 11 == 10:
            t.finish(reqs[0])
    mirror = replay(t.journal.take(reader), t.S)
    assert sorted(m["req"] for m in mirror.values()) == sorted(t.requests())
    for row, m in mirror.items():
        req = m["req"]
        assert t.row_of(req) == row
        alive = np.array(m["alive"], dtype=bool)
        assert np.array_equal(alive, t.live_mask(req))
        assert np.array_equal(np.array(m["slots"], dtype=np.int32)[alive], t.live_slots(req))


def test_the_journal_keeps_its_own_copies_of_what_the_caller_passed_or_got():
    from vtoken.device.buffers import DeviceMirror

    t = make_table(64, 4)
    m = DeviceMirror(t, "cpu", initial_tokens=64, min_slack=4)
    t.add_request("a")
    counts = np.array([6])
    slots = t.sync_new_tokens_batch(["a"], counts)
    slots[:] = -5  # the caller scribbles on its slot mapping and its counts
    counts[:] = 99
    m.check_against_table()
