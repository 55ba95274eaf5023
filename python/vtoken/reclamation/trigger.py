"""When to reclaim and how much: the pressure-driven trigger, the headroom and the per-step budgets.

Pressure is a shortfall of free blocks against the projected demand::

    target  = max(low_watermark, growth + waiting + headroom)
    deficit = target - free

``growth``: the blocks the running requests open if each appends
``check_interval + S`` more tokens (to its next due check, plus one block
each: see the NOTE in :class:`ReclaimTrigger`); ``waiting``: the blocks of the prompts the driver could admit next
(:meth:`ReclaimTrigger.note_waiting`); ``headroom``: the destination reserve.
The trigger fires when ``deficit > 0``, the waste ratio F exceeds the floor
``theta_F`` and at least ``min_gain`` blocks are reclaimable. It is evaluated
every ``check_interval`` steps, and every step while reclamation is pending. A
fired step plans request after request, best gain bound first, until the plans
free ``deficit`` blocks net (sized to the need), within two budgets:
destinations (the headroom, at most the free blocks) and moves
(``max_moves_per_step``, the rate limit). Without pressure nothing moves.
"""
from __future__ import annotations

import numpy as np

from vtoken.errors import check_int
from vtoken.bookkeeping.ledger import OWNED
from vtoken.metrics import StepRecord
from vtoken.reclamation.hole_planner import select_fill
from vtoken.reclamation.planner import Plan, per_request_gain, select_sources
from vtoken.reclamation.config import AdmissionBudget, ReclaimConfig
from vtoken.reclamation.executor import PlanExecutor


class ReclaimTrigger:
    """Decides which requests to relocate each step; owns the pending flag and the candidate queue.

    Args:
        table: the :class:`vtoken.bookkeeping.table.TokenTable` (its ledger is read).
        config: the :class:`ReclaimConfig`; its block counts are resolved
            against the pool here (``low_watermark``, ``headroom``).
    """

    def __init__(self, table, config: ReclaimConfig):
        self.table = table
        self.ledger = table.ledger
        self.config = config
        self.low_watermark, self.headroom = config.resolve(self.ledger.usable_blocks, block_size=table.S)
        self.waiting_blocks = 0  # blocks of the prompts waiting for admission (note_waiting)
        # NOTE: the look-ahead covers the steps to the next due check plus S more: over any S steps a
        # request opens exactly one block, so lockstep requests (the capacity frontier) open theirs all
        # in one step, and reclamation, which nets ~1 block per S - 1 destinations once holes are
        # scattered, must start before that burst. With check_interval alone (paper-0.35, 10 requests)
        # the trigger first fired 1 step before a 10-block burst, too late: the frontier fell to 8.
        self.lookahead = config.check_interval + table.S
        self.pending = False  # the last trigger check found reclaimable waste
        self._queue = np.zeros(0, dtype=np.int64)  # candidate rows, best gain first (see _scan)

    @property
    def reclaims(self) -> bool:
        return self.config.mode == "vtoken"

    def reserve_headroom(self) -> None:
        """Hold the headroom back from admission (vtoken mode only); an automatic one follows the running count."""
        if self.config.headroom_blocks is None:
            running = len(self.table.requests())
            self.headroom = self.config.resolve(self.ledger.usable_blocks, block_size=self.table.S,
                                                running=running)[1]
        if self.reclaims:
            self.ledger.set_reserve(self.headroom)

    def note_waiting(self, blocks: int) -> None:
        """The blocks the prompts waiting for admission need (the driver's part of the projected demand)."""
        self.waiting_blocks = check_int("blocks", blocks)

    def deficit(self) -> int:
        """Blocks short of the projected demand: ``max(low_watermark, growth + waiting + headroom) - free``."""
        growth = self.table.arena.growth_blocks(self.lookahead)
        target = max(self.low_watermark, growth + self.waiting_blocks + self.headroom)
        return target - self.ledger.num_free

    def admission_budget(self) -> AdmissionBudget:
        """Free blocks minus the reserve, and the backpressure flag (an automatic headroom is resized first:
        O(requests); a fixed one was set once, at construction, and is never touched again)."""
        if self.config.headroom_blocks is None:
            self.reserve_headroom()
        led = self.ledger
        bp = bool(self.reclaims and self.pending and led.num_free <= self.low_watermark)
        return AdmissionBudget(free_blocks=led.admission_free, backpressure=bp)

    # ------------------------------------------------------------------ plan
    def plan(self, step: int, executor: PlanExecutor, rec: StepRecord) -> list[Plan]:
        """Check the trigger at ``step`` and have ``executor`` make this step's plans within the budgets."""
        cfg, led, table, S = self.config, self.ledger, self.table, self.table.S
        due = step % cfg.check_interval == 0
        if not (self.pending or due):
            return []
        need = self.deficit()
        if not (need > 0 and led.waste_ratio > cfg.theta_F):
            self.pending = False
            return []
        if due or len(self._queue) == 0:
            if self._scan() < cfg.min_gain:
                self.pending = False
                return []
        rec.triggered = True
        dst_budget = dst_full = min(led.num_free, self.headroom)
        move_budget = cfg.max_moves_per_step
        plans: list[Plan] = []
        busy_rows = executor.busy_rows()
        used = 0
        holes = cfg.planner == "holes"
        for row in self._queue.tolist():
            if need <= 0 or move_budget < 1 or (dst_budget < 1 and not holes):  # covered, or a budget spent
                break
            used += 1
            req = table.request_of(row)
            if req is None or row in busy_rows:  # finished since the scan / in flight (I4)
                continue
            if holes:
                plan = self._plan_holes(req, row, executor, move_budget, dst_budget)
                if plan is not None:
                    plans.append(plan)
                    need -= plan.gain
                    dst_budget -= len(plan.dst_blocks)
                    move_budget -= plan.num_moves
                    continue
                if dst_budget < 1:
                    continue
            blocks, live = table.relocation.relocation_candidates(req)
            choice = select_sources(blocks, live, block_size=S, max_src=cfg.max_src_per_plan,
                                    max_moves=move_budget, max_dst=dst_budget)
            if choice is None:
                # NOTE: when only this step's earlier plans left too little budget, the request
                # keeps its place and planning stops for this step. Trying every later request
                # against the leftover instead cost 6x the select_sources calls per plan, all
                # failing (continuous reclamation, 22 requests x 16K tokens: 16,722 calls for
                # 2,794 plans; the leftover was 1-4 blocks, a plan needs ~S - 1).
                if plans and select_sources(blocks, live, block_size=S, max_src=cfg.max_src_per_plan,
                                            max_moves=cfg.max_moves_per_step, max_dst=dst_full) is not None:
                    used -= 1
                    break
                continue
            plan = executor.make(req, row, choice)
            if plan is None:  # the allocator disagrees with num_free (foreign allocations)
                used -= 1
                break
            plans.append(plan)
            need -= len(plan.src_blocks) - len(plan.dst_blocks)
            dst_budget -= len(plan.dst_blocks)
            move_budget -= plan.num_moves
        self._queue = self._queue[used:]
        # Nothing profitable within the budgets: not pending (no backpressure on false hope).
        self.pending = bool(plans) or len(self._queue) > 0
        return plans

    def _plan_holes(self, req, row: int, executor: PlanExecutor, move_budget: int, dst_budget: int):
        """``req``'s hole-filling plan, or ``None`` when a fresh-block plan frees more (or nothing fits).

        NOTE: over the same candidates hole filling frees ``floor(H / S)`` blocks
        (H: their holes, plus the tail's), a fresh-block plan at most that many,
        and the hole plan moves the fewest tokens (the sparsest sources, no
        refill of fresh blocks). A fresh plan can win only when fill blocks are
        excluded (prefix-cache readable) or the move budget cuts the hole plan
        short, and only with a reserve (``headroom_blocks``) to take it.
        """
        cfg, S = self.config, self.table.S
        blocks, live, fillable, tail, tail_holes, cursor = self.table.relocation.fill_candidates(req)
        choice = select_fill(blocks, live, fillable, block_size=S, tail_block=tail, tail_holes=tail_holes,
                             tail_cursor=cursor, max_src=cfg.max_src_per_plan, max_moves=move_budget)
        if choice is None:
            return None
        if dst_budget >= 1:
            fresh = select_sources(blocks, live, block_size=S, max_src=cfg.max_src_per_plan,
                                   max_moves=move_budget, max_dst=dst_budget)
            if fresh is not None and fresh.gain > choice.gain:
                return None
        return executor.make_fill(req, row, choice)

    def _scan(self) -> int:
        """Order the requests by their gain bound (one vectorized pass over the pool); return the total.

        NOTE: O(pool blocks), so it runs only on a due check (every
        ``check_interval`` steps) or when the queue of candidate requests has
        drained; between scans, plans are taken from the queue in order. A
        stale entry costs one per-request ``select_sources`` that finds nothing.
        """
        led, table, S = self.ledger, self.table, self.table.S
        cand = (led.state == OWNED) & (led.live < S)
        cand[table.tail_block_ids()] = False
        idx = np.flatnonzero(cand)
        if idx.size == 0:
            self._queue = np.zeros(0, dtype=np.int64)
            return 0
        owners = led.owner[idx].astype(np.int64)
        gain, _ = per_request_gain(owners, led.live[idx], int(owners.max()) + 1, block_size=S)
        rows = np.flatnonzero(gain > 0)
        self._queue = rows[np.argsort(-gain[rows], kind="stable")]
        return int(gain[rows].sum())
