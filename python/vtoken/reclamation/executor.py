"""Plan execution: a relocation plan from its reservation to its commit or rollback.

Life of a plan (one per request at a time, I4)::

    make      destinations reserved (DST_INFLIGHT), sources marked SRC_INFLIGHT
    launch    its moves copied on the relocation stream (one compact_kv per call)
    commit    the table switches to the destinations (its journal tells the mirrors), the sources are freed
    rollback  destinations freed, sources back to OWNED, the table untouched

A plan remembers the registration of its request (``plan.meta["generation"]``,
from :meth:`vtoken.bookkeeping.table.TokenTable.generation`): once that request is
finished, even if an id is registered again (and gets the same row), the plan
is stale; its blocks were freed by the finish, so it is never copied,
committed or rolled back.
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

import numpy as np

from vtoken.errors import InvalidArgumentError
from vtoken.bookkeeping.ledger import DST_INFLIGHT
from vtoken.metrics import StepRecord
from vtoken.reclamation.hole_planner import FillChoice, collect_fill_moves
from vtoken.reclamation.planner import Plan, SourceChoice, make_plan
from vtoken.reclamation.checks import ReclaimChecks


class PlanExecutor:
    """Makes, launches, commits and rolls back plans; owns the made / launched / in-flight sets.

    Args:
        table: the :class:`vtoken.bookkeeping.table.TokenTable`.
        copy_engine: the :class:`vtoken.device.copy_engine.CopyEngine` that copies the moves.
        checks: the :class:`ReclaimChecks` run around each plan (debug only).
    """

    def __init__(self, table, copy_engine, checks: ReclaimChecks):
        self.table = table
        self.ledger = table.ledger
        self.copy_engine = copy_engine
        self.checks = checks
        self._planned: list[Plan] = []  # made, not launched
        self._launched: list[Plan] = []  # launched, not committed
        self._busy: dict = {}  # request -> its one plan made or launched (I4)

    def in_flight(self) -> list:
        """Requests with a plan made or launched but not committed."""
        return list(self._busy)

    def busy_rows(self) -> set:
        """Table rows with a plan in flight: never planned again before it commits (I4)."""
        return {p.meta["row"] for p in self._busy.values()}

    @property
    def has_unlaunched(self) -> bool:
        return bool(self._planned)

    # ------------------------------------------------------------------ make
    def make(self, req, row: int, choice: SourceChoice) -> Optional[Plan]:
        """Reserve ``choice``'s destinations from the headroom and put its sources in flight.

        Returns the plan, or ``None`` when the allocator has fewer free blocks
        than the ledger's count (foreign allocations).
        """
        table, led = self.table, self.ledger
        dst = led.allocate(choice.num_dst, row, -1, state=DST_INFLIGHT, use_reserve=True)
        if dst is None:
            return None
        plan = make_plan(req, table.slots(req), table.live_mask(req), choice, dst,
                         block_size=table.S, num_blocks=led.num_blocks)
        plan.meta["row"] = row
        plan.meta["generation"] = table.generation(req)
        self.checks.check_plan(plan)
        table.relocation.begin_relocation(req, plan.src_blocks)
        self._busy[req] = plan
        self._planned.append(plan)
        return plan

    def make_fill(self, req, row: int, choice: FillChoice) -> Plan:
        """Put ``choice``'s sources and non-tail fill blocks in flight (no block is reserved).

        NOTE: the fill blocks go SRC_INFLIGHT too, so Naive-Evict never releases
        one that empties while the copy into its holes is in flight.
        """
        table, S = self.table, self.table.S
        tids, src, dst = collect_fill_moves(table.slots(req), table.live_mask(req), choice,
                                            block_size=S, num_blocks=self.ledger.num_blocks)
        plan = Plan(req, tids, src, dst, choice.src_blocks, np.zeros(0, dtype=np.int32), S,
                    fill_blocks=choice.fill_blocks)
        plan.meta["row"] = row
        plan.meta["generation"] = table.generation(req)
        self.checks.check_plan(plan)
        table.relocation.begin_relocation(req, plan.src_blocks)
        table.relocation.begin_fill(req, plan.fill_blocks)
        self._busy[req] = plan
        self._planned.append(plan)
        return plan

    # ---------------------------------------------------------------- launch
    def launch(self, plans: Optional[Sequence[Plan]], *, step: int, rec: StepRecord):
        """Copy the moves of ``plans`` (``None``: every unlaunched plan) in ONE copy launch.

        ``plans`` must be unlaunched plans of this step, each once, of requests
        still registered; anything else is rejected before any copy. On a copy
        failure every unlaunched plan is rolled back and the error re-raised.
        Returns the copy ticket or None.
        """
        plans = list(self._planned) if plans is None else list(plans)
        if not plans:
            return None
        self._validate_launch(plans)
        t0 = time.perf_counter()
        src = np.concatenate([p.src_slots for p in plans])
        dst = np.concatenate([p.dst_slots for p in plans])
        self.checks.capture(plans)
        try:
            ticket = self.copy_engine.launch(src, dst, step=step)
        except Exception:
            self._rollback(self._planned)
            rec.aborted_plans += len(self._planned)
            self._planned = []
            raise
        launched = {id(p) for p in plans}
        self._planned = [p for p in self._planned if id(p) not in launched]
        self._launched.extend(plans)
        rec.plans += len(plans)
        rec.moves += len(src)
        rec.src_blocks += sum(len(p.src_blocks) for p in plans)
        rec.dst_blocks += sum(len(p.dst_blocks) for p in plans)
        rec.launch_us += (time.perf_counter() - t0) * 1e6
        if ticket is not None:
            rec.host_stall_us += ticket.host_stall_us
        return ticket

    def _validate_launch(self, plans: Sequence[Plan]) -> None:
        ids = {id(p) for p in self._planned}
        if any(id(p) not in ids for p in plans):
            raise InvalidArgumentError("plans: expected plans made by this step's maybe_plan(), got foreign plans")
        # NOTE: a repeated plan would copy its moves twice (the GPU copy does not
        # re-check destinations) and then fail every commit.
        seen: set = set()
        for p in plans:
            if id(p) in seen:
                raise InvalidArgumentError(f"plans: expected each plan once, got the plan of {p.request!r} twice")
            seen.add(id(p))
        for p in plans:
            if not self._is_current(p):
                raise InvalidArgumentError(
                    f"plans: expected plans of registered requests, got a plan of {p.request!r}, "
                    "finished since maybe_plan() (its destinations were freed)"
                )

    # ---------------------------------------------------------------- commit
    def commit(self, *, step: int, rec: StepRecord, hold: bool = False) -> np.ndarray:
        """Roll back the unlaunched plans, apply the launched ones; return the freed block ids (int32).

        ``hold``: the launched plans stay launched (their copies run elsewhere and are
        confirmed later): :meth:`commit_launched` or :meth:`rollback_launched` settles them.
        """
        if self._planned:
            self._rollback(self._planned)
            rec.aborted_plans += len(self._planned)
            self._planned = []
        if hold:
            return np.zeros(0, dtype=np.int32)
        return self.commit_launched(list(self._launched), step=step, rec=rec)

    def commit_launched(self, plans: Sequence[Plan], *, step: int, rec: StepRecord) -> np.ndarray:
        """Apply ``plans`` still launched (a finish may have rolled some back); return the freed block ids."""
        mine = self._take_launched(plans)
        freed: list[np.ndarray] = []
        if mine:
            self.copy_engine.log_event("commit", step, plans=len(mine))
            for plan in mine:
                out = self._commit_plan(plan, rec)
                if out is not None:
                    freed.append(out)
        ids = np.concatenate(freed).astype(np.int32) if freed else np.zeros(0, dtype=np.int32)
        if ids.size:
            self.copy_engine.log_event("free", step, blocks=len(ids))
        return ids

    def _commit_plan(self, plan: Plan, rec: StepRecord) -> Optional[np.ndarray]:
        table, S = self.table, self.table.S
        req = plan.request
        self._unbusy(plan)
        if not self._is_current(plan):  # finished meanwhile: its blocks are already free
            return None
        alive = table.is_alive(req, plan.token_ids)
        if alive.all():
            released = table.relocation.apply_moves(req, plan.token_ids, plan.dst_slots)
            # Every source emptied; a full commit leaves nothing in flight but the fill blocks.
            if plan.fills_holes:
                released = np.concatenate([released, table.relocation.end_relocation(req, plan.fill_blocks)])
            return released
        # Some moved tokens died after planning: commit the survivors if the
        # destinations they use fit the source positions they free; else roll back.
        tids, dst = plan.token_ids[alive], plan.dst_slots[alive]
        # Only fresh destinations need a source position; fill blocks already have theirs.
        used = np.intersect1d(np.unique(dst.astype(np.int64) // S), plan.dst_blocks)
        emptied = np.unique(plan.src_slots[alive].astype(np.int64) // S)
        if len(used) > len(emptied):
            self._rollback([plan])
            rec.aborted_plans += 1
            return None
        released = []
        if len(tids):
            released.append(table.relocation.apply_moves(req, tids, dst))
        table.relocation.release_destinations(req, np.setdiff1d(plan.dst_blocks, used))  # unused: back to the pool
        released.append(table.relocation.end_relocation(req, np.concatenate([plan.src_blocks, plan.fill_blocks])))
        return np.concatenate(released)

    def _take_launched(self, plans: Sequence[Plan]) -> list[Plan]:
        """Remove ``plans`` from the launched ones; return those that were launched."""
        want = {id(p) for p in plans}
        mine = [p for p in self._launched if id(p) in want]
        self._launched = [p for p in self._launched if id(p) not in want]
        return mine

    # ------------------------------------------------------------- rollback
    def rollback_launched(self, plans: Sequence[Plan], rec: StepRecord) -> int:
        """Roll back ``plans`` still launched (their copy failed or was never confirmed); return how many."""
        mine = self._take_launched(plans)
        self._rollback(mine)
        rec.aborted_plans += len(mine)
        return len(mine)

    def abort(self, rec: StepRecord) -> int:
        """Roll back every plan made or launched and not committed; return how many."""
        plans = self._planned + self._launched
        self._rollback(plans)
        self._planned, self._launched = [], []
        rec.aborted_plans += len(plans)
        return len(plans)

    def finish_request(self, req, rec: StepRecord) -> np.ndarray:
        """Roll back ``req``'s uncommitted plan, then free everything it holds (table.finish)."""
        self.table.row_of(req)  # an unknown request raises before anything changes
        mine = [p for p in self._planned + self._launched if p.request == req]
        if mine:
            self._rollback(mine)
            self._planned = [p for p in self._planned if p.request != req]
            self._launched = [p for p in self._launched if p.request != req]
            rec.aborted_plans += len(mine)
        return self.table.finish(req)

    def _rollback(self, plans: Sequence[Plan]) -> None:
        led = self.ledger
        for plan in plans:
            req = plan.request
            self._unbusy(plan)
            if not self._is_current(plan):
                continue
            d = plan.dst_blocks.astype(np.int64)
            d = d[(led.state[d] == DST_INFLIGHT) & (led.owner[d] == plan.meta["row"])]
            self.table.relocation.release_destinations(req, d)
            self.table.relocation.end_relocation(req, np.concatenate([plan.src_blocks, plan.fill_blocks]))

    # ------------------------------------------------------------- helpers
    def _is_current(self, plan: Plan) -> bool:
        """The plan's request is still the registration it was made for."""
        req = plan.request
        return req in self.table and self.table.generation(req) == plan.meta.get("generation")

    def _unbusy(self, plan: Plan) -> None:
        # Only this plan's own entry: a stale plan must not clear a newer registration's plan.
        if self._busy.get(plan.request) is plan:
            del self._busy[plan.request]
