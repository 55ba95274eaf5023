"""Runtime invariants of the token table and of relocation (docs/architecture.md).

* **I1** (content) reads the K/V caches, so it lives on the device side:
  :mod:`vtoken.device.kv_fingerprint`.
* **I2** (mapping): every live token has exactly one slot and no slot has two
  owners; the ledger's counts equal a recount; conservation
  (:func:`check_table`); and the device mirror,
  when there is one, equals the table.
* **I4** (plan gates): :func:`check_plan` / :func:`check_plans`.

These checks walk the whole table (and the mirror check reads the device, a
sync on GPU), so the runtime runs them only when :func:`enabled` is true: ``VTOKEN_DEBUG_INVARIANTS=1``
(the test suite sets it) or an explicit ``check_invariants=True`` in the
reclamation config.
"""
from __future__ import annotations

from typing import Iterable, Optional

import numpy as np

from vtoken import cdiv
from vtoken.errors import InvariantViolation, debug_checks_enabled, has_duplicates
from vtoken.bookkeeping.ledger import DST_INFLIGHT, FREE, OWNED, SHARED, SRC_INFLIGHT
from vtoken.bookkeeping.pool import NULL_BLOCK

enabled = debug_checks_enabled
"""True under ``VTOKEN_DEBUG_INVARIANTS=1`` (any value but empty / ``0``): see :func:`vtoken.errors.debug_checks_enabled`."""


# ----------------------------------------------------------------------- I2
def table_snapshot(table) -> dict:
    """A deep copy of a TokenTable's state, for bit-identical comparisons (tests, error paths)."""
    arena = table.arena
    snap = {"ledger": table.ledger.snapshot(), "registry": table.registry.snapshot(), "end": arena.end,
            "garbage": arena.garbage, "nlive": table._nlive.copy()}
    for name in ("base", "cap", "ntok", "in_use"):
        snap[name] = getattr(arena, name).copy()
    snap["per_request"] = {
        req: (table.slots(req), table.live_mask(req), table.block_list(req)) for req in table.registry
    }
    snap["moved_into"] = table.shared.moved_into.copy()
    snap["ref"] = None
    alloc = table.ledger.allocator
    if hasattr(alloc, "ref_count"):
        snap["ref"] = alloc.ref_count(np.arange(1, alloc.num_blocks))
    return snap


def check_table(table) -> None:
    """Conservation, I2 (unique mapping) and live counts vs a recount, for a TokenTable. O(tokens + blocks)."""
    led, S, arena = table.ledger, table.S, table.arena
    led.check_conservation()
    recount = np.zeros(led.num_blocks, dtype=np.int64)
    private_slots = []
    list_refs = np.zeros(led.num_blocks, dtype=np.int64)
    for req, row in table.registry.items():
        n = int(arena.ntok[row])
        mask = arena.alive_range(row, 0, n)
        if int(mask.sum()) != int(table._nlive[row]):
            raise InvariantViolation(f"request {req!r}: live count {int(table._nlive[row])} != recount {int(mask.sum())}")
        base = int(arena.base[row])
        live_slots = arena.slots[base : base + n][mask].astype(np.int64)
        tids = np.nonzero(mask)[0]
        if live_slots.size and (live_slots < S).any():
            raise InvariantViolation(f"request {req!r}: a live token has no slot")
        blocks = live_slots // S
        st = led.state[blocks]
        mine = np.isin(st, (OWNED, SRC_INFLIGHT)) & (led.owner[blocks] == row)
        sh = st == SHARED
        if not (mine | sh).all():
            raise InvariantViolation(f"request {req!r}: live tokens in blocks it does not own: {np.unique(blocks[~(mine | sh)])[:8].tolist()}")
        for b in np.unique(blocks[sh]).tolist():
            if row not in led.holders[b]:
                raise InvariantViolation(f"request {req!r}: token in shared block {b} it does not hold")
        exp = (led.pos[blocks[sh]].astype(np.int64) * S + (live_slots[sh] % S))
        if not np.array_equal(exp, tids[sh]):
            raise InvariantViolation(f"request {req!r}: shared-block token at the wrong position")
        np.add.at(recount, blocks[mine], 1)
        private_slots.append(live_slots[mine])
        blist = table.lists.row(row, arena.num_list_blocks(row))
        held = blist[blist != NULL_BLOCK]
        np.add.at(list_refs, held, 1)
        for p, b in zip(np.nonzero(blist != NULL_BLOCK)[0].tolist(), held.tolist()):
            if led.pos[b] != p or not (led.owner[b] == row or (led.state[b] == SHARED and row in led.holders[b])):
                raise InvariantViolation(f"request {req!r}: block {b} at list position {p} is not recorded there")
    allp = np.concatenate(private_slots) if private_slots else np.zeros(0, np.int64)
    if has_duplicates(allp):
        raise InvariantViolation("I2: a slot is held by two live tokens")
    for b in led.holders:
        recount[b] = table.shared.union_live(b)
    allocated = led.state != FREE
    allocated[NULL_BLOCK] = False
    if not np.array_equal(recount[allocated], led.live[allocated].astype(np.int64)):
        bad = np.nonzero(allocated & (recount != led.live))[0]
        raise InvariantViolation(f"ledger live counts differ from a recount at blocks {bad[:8].tolist()}")
    in_list = np.isin(led.state, (OWNED, SHARED, SRC_INFLIGHT))
    in_list[NULL_BLOCK] = False
    expected_refs = np.where(led.state == SHARED, 0, 1)
    for b, h in led.holders.items():
        expected_refs[b] = len(h)
    if not np.array_equal(list_refs[in_list], expected_refs[in_list]):
        bad = np.nonzero(in_list & (list_refs != expected_refs))[0]
        raise InvariantViolation(f"blocks not listed exactly once per holder: {bad[:8].tolist()}")
    if (list_refs[~in_list] != 0).any():
        raise InvariantViolation("a free or in-flight destination block appears in a block list")


def check_mapping(table, mirror=None, pending_kills: Optional[dict] = None) -> None:
    """I2 plus conservation and live-count recounts; the device mirror against the table.

    ``pending_kills``: the device kills the table has yet to learn (``DeviceMirror.check_against_table``)."""
    table.check_invariants()
    if mirror is not None:
        mirror.check_against_table(pending_kills=pending_kills)


# ----------------------------------------------------------------------- I4
def check_plan(plan, table, *, pre_launch: bool = True) -> None:
    """I4 for one plan, against the table as it is when the plan was made.

    ``pre_launch``: sources still OWNED (before ``begin_relocation``); else SRC_INFLIGHT.
    """
    led, S = table.ledger, table.S
    req = plan.request
    if req not in table:
        raise InvariantViolation(f"I4: plan for unregistered request {req!r}")
    row = table.row_of(req)
    src = plan.src_blocks.astype(np.int64)
    dst = plan.dst_blocks.astype(np.int64)
    for name, a in (("token_ids", plan.token_ids), ("src_slots", plan.src_slots), ("dst_slots", plan.dst_slots),
                    ("src_blocks", plan.src_blocks), ("dst_blocks", plan.dst_blocks)):
        if a.dtype != np.int32 or a.ndim != 1:
            raise InvariantViolation(f"I4: plan.{name} must be a 1-D int32 array, got {a.dtype} {a.shape}")
    m = plan.num_moves
    if plan.fills_holes:
        _check_fill_plan(plan, table, row, pre_launch=pre_launch)
        return
    if len(src) <= len(dst):
        raise InvariantViolation(f"I4: gate len(src)={len(src)} > N_dst={len(dst)} does not hold")
    if len(dst) != cdiv(m, S):
        raise InvariantViolation(f"I4: N_dst={len(dst)} != ceil(T_live={m} / S={S})")
    if len(np.unique(src)) != len(src) or len(np.unique(dst)) != len(dst) or np.intersect1d(src, dst).size:
        raise InvariantViolation("I4: sources / destinations not unique and disjoint")
    if not ((led.state[dst] == DST_INFLIGHT) & (led.owner[dst] == row) & (led.live[dst] == 0)).all():
        raise InvariantViolation("I4: a destination is not an empty DST_INFLIGHT block of the request")
    _check_sources_and_moved_tokens(plan, table, row, src, pre_launch=pre_launch, max_moves=m)
    j = np.arange(m, dtype=np.int64)
    if not np.array_equal(dst[j // S] * S + j % S, plan.dst_slots.astype(np.int64)):
        raise InvariantViolation("I4: destinations are not filled completely in logical order")


def _check_fill_plan(plan, table, row: int, *, pre_launch: bool) -> None:
    """I4 for a hole-filling plan (vtoken.reclamation.hole_planner): every move lands in a hole of a fill block."""
    led, S, req = table.ledger, table.S, plan.request
    src = plan.src_blocks.astype(np.int64)
    fill = plan.fill_blocks.astype(np.int64)
    m = plan.num_moves
    tail = table.tail_block(req)
    if len(plan.dst_blocks) or len(src) < 1:
        raise InvariantViolation("I4: a hole-filling plan takes no fresh block and frees at least one")
    if len(np.unique(src)) != len(src) or len(np.unique(fill)) != len(fill) or np.intersect1d(src, fill).size:
        raise InvariantViolation("I4: sources / fill blocks not unique and disjoint")
    state = OWNED if pre_launch else SRC_INFLIGHT
    if not ((led.state[fill] == state) & (led.owner[fill] == row)).all():
        raise InvariantViolation(f"I4: a fill block is not a private block of {req!r} in the expected state")
    if table.shared.hit_readable[fill].any():
        raise InvariantViolation("I4: a fill block may be read by a prefix-cache hit")
    _check_sources_and_moved_tokens(plan, table, row, src, pre_launch=pre_launch, max_moves=len(src) * (S - 1))
    slots = table.slots(req)
    dst = plan.dst_slots.astype(np.int64)
    if len(np.unique(dst)) != m or not np.isin(dst // S, fill).all():
        raise InvariantViolation("I4: destination slots are not unique slots of the fill blocks")
    live_slots = slots[table.live_mask(req)]
    if np.isin(dst, live_slots).any():
        raise InvariantViolation("I4: a destination slot holds a live token (not a hole)")
    n = len(slots)
    cursor = n - (cdiv(n, S) - 1) * S
    if ((dst // S == tail) & (dst % S >= cursor)).any():
        raise InvariantViolation("I4: a destination is a tail slot still to be filled by appends")


def check_plans(plans, table, *, in_flight: Iterable = (), max_dst: Optional[int] = None,
                max_moves: Optional[int] = None, pre_launch: bool = True) -> None:
    """I4 for a step's plans: each plan, one plan per request, budgets, disjoint blocks."""
    reqs = [p.request for p in plans]
    if len(set(reqs)) != len(reqs):
        raise InvariantViolation("I4: two plans for one request in a step")
    busy = set(in_flight) & set(reqs)
    if busy:
        raise InvariantViolation(f"I4: a plan for requests already in flight: {sorted(map(repr, busy))[:4]}")
    for p in plans:
        check_plan(p, table, pre_launch=pre_launch)
    if plans:
        allb = np.concatenate([np.concatenate([p.src_blocks, p.dst_blocks, p.fill_blocks]) for p in plans])
        if len(np.unique(allb)) != len(allb):
            raise InvariantViolation("I4: two plans share a block")
        alld = np.concatenate([p.dst_slots for p in plans])
        alls = np.concatenate([p.src_slots for p in plans])
        if len(np.unique(alld)) != len(alld) or np.intersect1d(alld, alls).size:
            raise InvariantViolation("I4: the step's destination slots are not unique and disjoint from its sources")
    if max_dst is not None and sum(len(p.dst_blocks) for p in plans) > max_dst:
        raise InvariantViolation(f"I4: destinations exceed the headroom ({max_dst})")
    if max_moves is not None and sum(p.num_moves for p in plans) > max_moves:
        raise InvariantViolation(f"I4: moves exceed max_moves_per_step ({max_moves})")


def _check_sources_and_moved_tokens(plan, table, row: int, src: np.ndarray, *, pre_launch: bool,
                                    max_moves: int) -> None:
    """I4's rules shared by fresh-block and hole-filling plans: the sources, and the tokens that leave them."""
    led, S, req, m = table.ledger, table.S, plan.request, plan.num_moves
    state = OWNED if pre_launch else SRC_INFLIGHT
    if not ((led.state[src] == state) & (led.owner[src] == row)).all():
        raise InvariantViolation(f"I4: a source is not a private block of {req!r} in the expected state")
    if (src == table.tail_block(req)).any():
        raise InvariantViolation("I4: the tail block is a source")
    if (led.live[src] >= S).any() or (led.live[src] <= 0).any():
        raise InvariantViolation("I4: a source is full or empty")
    if m != int(led.live[src].sum()) or m > max_moves:
        raise InvariantViolation(f"I4: {m} moves but the sources hold {int(led.live[src].sum())} live tokens")
    tids = plan.token_ids.astype(np.int64)
    if m > 1 and (np.diff(tids) <= 0).any():
        raise InvariantViolation("I4: moves are not in ascending logical order")
    if not table.is_alive(req, tids).all():
        raise InvariantViolation("I4: a moved token is dead")
    if not np.array_equal(table.slots(req)[tids], plan.src_slots):
        raise InvariantViolation("I4: src_slots differ from the table")
    if not np.isin(plan.src_slots.astype(np.int64) // S, src).all():
        raise InvariantViolation("I4: a moved token is outside the sources")
