"""Debug-only checks of the reclamation: I4 on every plan, I1 across every copy, I2 after every commit.

Enabled by ``ReclaimConfig.check_invariants`` (``None``: the
``VTOKEN_DEBUG_INVARIANTS`` flag). They read the K/V caches on the host and
wait on the copies, so they never run on a production step.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from vtoken.bookkeeping import invariants
from vtoken.device import kv_fingerprint
from vtoken.errors import InvariantViolation
from vtoken.reclamation.planner import Plan


class ReclaimChecks:
    """I1 / I2 / I4 checks around one manager's plans; owns the I1 "before" captures.

    Args:
        table: the :class:`vtoken.bookkeeping.table.TokenTable`.
        copy_engine: the :class:`vtoken.device.copy_engine.CopyEngine` (its caches and layout are read).
        mirror: the device mirror compared with the table (I2), or ``None``.
        flag: ``True`` / ``False``, or ``None`` to read ``VTOKEN_DEBUG_INVARIANTS`` at each call.
        pending_kills: ``() -> {request: token ids}``, the device kills the table has yet to learn
            (a decision loop's ``pending_victims``), or ``None`` when nothing kills on the device.
    """

    def __init__(self, table, copy_engine, mirror, flag: Optional[bool],
                 pending_kills: Optional[Callable[[], dict]] = None):
        self.table = table
        self.copy_engine = copy_engine
        self.mirror = mirror
        self.pending_kills = pending_kills
        self.flag = flag
        # request -> (its registration number, live ids, every layer's K/V rows) at launch
        self._before: dict = {}

    @property
    def enabled(self) -> bool:
        return invariants.enabled() if self.flag is None else self.flag

    # ------------------------------------------------------------------ I4
    def check_plan(self, plan: Plan) -> None:
        """I4 on one plan before its sources go in flight."""
        if self.enabled:
            invariants.check_plan(plan, self.table, pre_launch=True)

    def check_plans(self, plans: Sequence[Plan], *, max_dst: int, max_moves: int) -> None:
        """I4 across one step's plans: disjoint, within the headroom and the move budget."""
        if self.enabled and plans:
            invariants.check_plans(plans, self.table, max_dst=max_dst, max_moves=max_moves, pre_launch=False)

    # ------------------------------------------------------------------ I1
    def capture(self, plans: Sequence[Plan]) -> None:
        """I1 'before' side: per request, live ids and every layer's K/V rows."""
        if not self.enabled:
            return
        eng, table = self.copy_engine, self.table
        for p in plans:
            ids = table.live_ids(p.request)
            slots = table.live_slots(p.request)
            rows = [kv_fingerprint.gather_token_rows(c, eng.layout, slots).cpu() for c in eng.kv_caches]
            self._before[p.request] = (table.generation(p.request), ids, rows)

    def check_after_commit(self) -> None:
        """I1 on every captured request still registered (its survivors), then I2 (table vs mirror)."""
        if not self.enabled:
            return
        eng, table = self.copy_engine, self.table
        if self._before:
            eng.synchronize()  # the "after" side must read completed copies (debug only)
            for req, (generation, ids, rows) in self._before.items():
                if req not in table or table.generation(req) != generation:  # finished (maybe re-registered)
                    continue
                still = table.is_alive(req, ids)
                keep_ids = ids[still]
                slots = table.slots(req)[keep_ids]
                before = kv_fingerprint.fingerprint_rows(keep_ids, [r[still] for r in rows])
                after_rows = [kv_fingerprint.gather_token_rows(c, eng.layout, slots).cpu() for c in eng.kv_caches]
                after = kv_fingerprint.fingerprint_rows(keep_ids, after_rows)
                if before != after:
                    raise InvariantViolation(
                        f"I1: live ids / K/V bytes of request {req!r} changed across a relocation"
                    )
            self._before = {}
        pending = None if self.pending_kills is None or self.mirror is None else self.pending_kills()
        invariants.check_mapping(table, self.mirror, pending)
