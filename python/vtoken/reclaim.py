"""ReclamationManager: trigger, headroom, backpressure, planning, copy, commit (ARCHITECTURE.md §5).

The engine (or the vLLM connector) drives one manager per block pool, once
per step, in this order::

    budget = mgr.admission_budget()   # admit new work within budget.free_blocks,
                                      # none at all while budget.backpressure
    mgr.before_forward()              # I3: the compute stream waits on the last copy
    ...build slot lists, launch the forward, let the policy evict...
    plans = mgr.maybe_plan()          # amortized trigger + plans (destinations reserved)
    mgr.launch(plans)                 # after the forward: ONE compact_kv on the relocation stream
    freed = mgr.commit()              # table + mirror updated, sources freed; ends the step

Requests leave through :meth:`ReclamationManager.finish_request`, which
rolls back any plan of theirs before the table frees their blocks.

Modes (the paired experiments of §6): ``native`` (no eviction: the manager
does nothing), ``naive`` (eviction; a block is freed only once fully dead,
which the table does by itself), ``vtoken`` (eviction + reclamation). Only
``vtoken`` holds a headroom reserve back from admission.

Commit ordering. The copy of step N is ordered after forward N by event F_N
and before forward N+1 by the wait on E_N, so the host may commit right after
the launch: the table, the mirror and the ledger switch to the destinations
at once, and the freed sources can be handed out at once (their next writer
is a later forward, which waits on E_N).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np

from vtoken import invariants
from vtoken.copy_engine import CopyEngine
from vtoken.errors import InvalidArgumentError, InvalidTypeError, InvariantViolation
from vtoken.ledger import DST_INFLIGHT, OWNED
from vtoken.metrics import MetricsLog, StepRecord
from vtoken.planner import Plan, make_plan, per_request_gain, select_sources

MODES = ("native", "naive", "vtoken")
Count = Union[int, float]


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


@dataclass(frozen=True)
class ReclaimConfig:
    """Reclamation settings, validated on construction.

    Block counts (``low_watermark``, ``headroom_blocks``) are an ``int`` number
    of blocks, or a ``float`` in [0, 1]: a fraction of the pool's usable blocks.

    Attributes:
        mode: ``native`` | ``naive`` | ``vtoken``.
        theta_F: reclaim only while the waste ratio F exceeds it (default 0.25).
        low_watermark: reclaim only while free blocks are below it; admissions
            are held back (backpressure) while reclamation is pending and free
            blocks are at or below it.
        headroom_blocks: destination reserve held back from admission.
        check_interval: steps between trigger checks (every step while pending).
        max_src_per_plan: sources per plan at most (sparsest first).
        max_moves_per_step: tokens moved per step at most (the move buffer size).
        min_gain: reclaim only if at least this many blocks can be freed.
        force_sync: the host waits on each copy (the paper's ablation).
        check_invariants: run I1/I2/I4 every step; ``None`` reads
            ``VTOKEN_DEBUG_INVARIANTS``.

    Example:
        >>> ReclaimConfig(theta_F=0.3, low_watermark=0.2).resolve(1000)
        (200, 20)
    """

    mode: str = "vtoken"
    theta_F: float = 0.25
    low_watermark: Count = 0.10
    headroom_blocks: Count = 0.02
    check_interval: int = 8
    max_src_per_plan: int = 256
    max_moves_per_step: int = 8192
    min_gain: int = 1
    force_sync: bool = False
    check_invariants: Optional[bool] = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise InvalidArgumentError(f"mode: expected one of {MODES}, got {self.mode!r}")
        if isinstance(self.theta_F, bool) or not isinstance(self.theta_F, (int, float)):
            raise InvalidTypeError(f"theta_F: expected a float, got {type(self.theta_F).__name__}")
        if not 0.0 <= float(self.theta_F) < 1.0:
            raise InvalidArgumentError(f"theta_F: expected a value in [0, 1), got {self.theta_F}")
        for name in ("low_watermark", "headroom_blocks"):
            v = getattr(self, name)
            if _is_int(v):
                if v < 0:
                    raise InvalidArgumentError(f"{name}: expected >= 0 blocks, got {v}")
            elif isinstance(v, float):
                if not 0.0 <= v <= 1.0:
                    raise InvalidArgumentError(f"{name}: expected a fraction in [0, 1] (or an int), got {v}")
            else:
                raise InvalidTypeError(f"{name}: expected an int (blocks) or a float (fraction), got {type(v).__name__}")
        for name, lo in (("check_interval", 1), ("max_src_per_plan", 2), ("max_moves_per_step", 1), ("min_gain", 1)):
            v = getattr(self, name)
            if not _is_int(v):
                raise InvalidTypeError(f"{name}: expected an int, got {type(v).__name__}")
            if v < lo:
                raise InvalidArgumentError(f"{name}: expected >= {lo}, got {v}")
        if not isinstance(self.force_sync, bool):
            raise InvalidTypeError(f"force_sync: expected a bool, got {type(self.force_sync).__name__}")
        if self.check_invariants is not None and not isinstance(self.check_invariants, bool):
            raise InvalidTypeError(f"check_invariants: expected a bool or None, got {type(self.check_invariants).__name__}")

    def resolve(self, usable_blocks: int) -> tuple[int, int]:
        """``(low_watermark, headroom)`` in blocks for a pool of ``usable_blocks``."""

        def blocks(v) -> int:
            return int(v) if _is_int(v) else int(math.ceil(v * usable_blocks))

        wm, hr = blocks(self.low_watermark), blocks(self.headroom_blocks)
        if self.mode == "vtoken" and hr > usable_blocks:
            raise InvalidArgumentError(f"headroom_blocks: expected <= usable blocks ({usable_blocks}), got {hr}")
        return wm, hr


@dataclass(frozen=True)
class AdmissionBudget:
    """What the scheduler may admit this step."""

    free_blocks: int  # free blocks minus the headroom reserve
    backpressure: bool  # True: admit nothing new this step (reclamation pending, memory low)


class ReclamationManager:
    """Turns the holes eviction leaves into free blocks. See the module docstring.

    Args:
        table: the :class:`vtoken.table.TokenTable` (its ledger is used).
        config: a :class:`ReclaimConfig` (default: vtoken mode, defaults).
        kv_caches / layout: every layer's KV cache and its layout, for the
            copy; ``None`` runs the bookkeeping only (no data moves).
        mirror: a :class:`vtoken.buffers.DeviceMirror` to receive the moves.
        copy_engine: a prepared :class:`CopyEngine` (else one is built).
        compute_stream / device: passed to the copy engine.

    Example (bookkeeping only):
        >>> from vtoken.pool import BlockPool
        >>> from vtoken.ledger import BlockLedger
        >>> from vtoken.table import TokenTable
        >>> t = TokenTable(BlockLedger(BlockPool(40), 4))
        >>> mgr = ReclamationManager(t, ReclaimConfig(low_watermark=40, headroom_blocks=2, check_interval=1))
        >>> t.add_request("a"); _ = t.sync_new_tokens("a", 32)
        >>> t.evict("a", [i for i in range(28) if i % 4])   # every block keeps 1 of 4
        >>> plans = mgr.maybe_plan(); ticket = mgr.launch(plans); freed = mgr.commit()
        >>> len(freed), t.held_blocks("a")
        (7, 3)
    """

    def __init__(
        self,
        table,
        config: Optional[ReclaimConfig] = None,
        *,
        kv_caches: Optional[Sequence] = None,
        layout=None,
        mirror=None,
        copy_engine: Optional[CopyEngine] = None,
        compute_stream=None,
        device=None,
    ):
        self.config = config if config is not None else ReclaimConfig()
        if not isinstance(self.config, ReclaimConfig):
            raise InvalidTypeError(f"config: expected a ReclaimConfig, got {type(self.config).__name__}")
        self.table = table
        self.ledger = table.ledger
        self.S = table.S
        self.low_watermark, self.headroom = self.config.resolve(self.ledger.usable_blocks)
        if self.reclaims:
            self.ledger.set_reserve(self.headroom)
        if copy_engine is None:
            copy_engine = CopyEngine(
                kv_caches, layout, max_moves=self.config.max_moves_per_step,
                force_sync=self.config.force_sync, compute_stream=compute_stream, device=device,
            )
        elif copy_engine.max_moves < self.config.max_moves_per_step:
            raise InvalidArgumentError(
                f"copy_engine: expected max_moves >= max_moves_per_step ({self.config.max_moves_per_step}), "
                f"got {copy_engine.max_moves}"
            )
        self.copy_engine = copy_engine
        self.mirror = mirror
        self.metrics = MetricsLog()
        self.step = 0
        self._pending = False  # the last trigger check found reclaimable waste
        self._planned: list[Plan] = []  # made by maybe_plan, not launched
        self._launched: list[Plan] = []  # launched, not committed
        self._busy: dict = {}  # request -> its one in-flight plan (I4)
        self._rec: Optional[StepRecord] = None
        self._i1_before: dict = {}
        self._queue = np.zeros(0, dtype=np.int64)  # candidate rows, best gain first (see _scan)

    # ------------------------------------------------------------ properties
    @property
    def evicts(self) -> bool:
        """Whether the policy should evict in this mode."""
        return self.config.mode != "native"

    @property
    def reclaims(self) -> bool:
        return self.config.mode == "vtoken"

    @property
    def checking(self) -> bool:
        c = self.config.check_invariants
        return invariants.enabled() if c is None else c

    @property
    def pending(self) -> bool:
        """The last trigger check found waste worth reclaiming."""
        return self._pending

    def in_flight(self) -> list:
        """Requests with a plan made or launched but not committed."""
        return list(self._busy)

    def _record(self) -> StepRecord:
        if self._rec is None:
            self._rec = StepRecord(step=self.step)
        return self._rec

    # ------------------------------------------------------------ admission
    def admission_budget(self) -> AdmissionBudget:
        """Free blocks minus the reserve, and the backpressure flag (O(1))."""
        led = self.ledger
        bp = bool(self.reclaims and self._pending and led.num_free <= self.low_watermark)
        if bp:
            self._record().backpressure = True
        return AdmissionBudget(free_blocks=led.admission_free, backpressure=bp)

    # ------------------------------------------------------------- pre-forward
    def before_forward(self) -> bool:
        """I3: enqueue the compute stream's wait on the newest relocation event (no host wait)."""
        rec = self._record()
        waited = self.copy_engine.before_forward(step=self.step)
        rec.event_waits += int(waited)
        return waited

    # ------------------------------------------------------------------ plan
    def maybe_plan(self) -> list[Plan]:
        """Check the trigger (amortized) and plan this step's relocations.

        The trigger: ``F > theta_F`` and ``free < low_watermark`` and at least
        ``min_gain`` blocks reclaimable. It is evaluated every
        ``check_interval`` steps, and every step while reclamation is pending.
        Each plan's destinations are reserved (DST_INFLIGHT) from the headroom
        and its sources marked SRC_INFLIGHT, so the plans must be launched (or
        aborted) this step.
        """
        rec = self._record()
        if not self.reclaims:
            return []
        if self._planned:
            raise InvalidArgumentError("maybe_plan: expected the previous plans launched or aborted, got unlaunched plans")
        t0 = time.perf_counter()
        plans = self._plan()
        rec.planner_us += (time.perf_counter() - t0) * 1e6
        return plans

    def _scan(self) -> int:
        """Order the requests by their gain bound (one vectorized pass over the pool); return the total.

        NOTE: O(pool blocks), so it runs only on a due check (every
        ``check_interval`` steps) or when the queue of candidate requests has
        drained; between scans, plans are taken from the queue in order. A
        stale entry costs one per-request ``select_sources`` that finds nothing.
        """
        led, table, S = self.ledger, self.table, self.S
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

    def _plan(self) -> list[Plan]:
        cfg, led, table, S = self.config, self.ledger, self.table, self.S
        due = self.step % cfg.check_interval == 0
        if not (self._pending or due):
            return []
        if not (led.waste_ratio > cfg.theta_F and led.num_free < self.low_watermark):
            self._pending = False
            return []
        if due or len(self._queue) == 0:
            if self._scan() < cfg.min_gain:
                self._pending = False
                return []
        self._record().triggered = True
        dst_budget = dst_full = min(led.num_free, self.headroom)
        move_budget = cfg.max_moves_per_step
        plans: list[Plan] = []
        busy_rows = {p.meta["row"] for p in self._busy.values()}
        used = 0
        for row in self._queue.tolist():
            if dst_budget < 1 or move_budget < 2:
                break
            used += 1
            req = table.request_of(row)
            if req is None or row in busy_rows:  # finished since the scan / in flight (I4)
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
            dst = led.allocate(choice.num_dst, row, -1, state=DST_INFLIGHT, use_reserve=True)
            if dst is None:  # the allocator disagrees with num_free (foreign allocations)
                used -= 1
                break
            plan = make_plan(req, table.slots(req), table.live_mask(req), choice, dst,
                             block_size=S, num_blocks=led.num_blocks)
            plan.meta["row"] = row
            if self.checking:
                invariants.check_plan(plan, table, pre_launch=True)
            table.relocation.begin_relocation(req, plan.src_blocks)
            self._busy[req] = plan
            plans.append(plan)
            dst_budget -= len(plan.dst_blocks)
            move_budget -= plan.num_moves
        self._queue = self._queue[used:]
        # Nothing profitable within the budgets: not pending (no backpressure on false hope).
        self._pending = bool(plans) or len(self._queue) > 0
        self._planned = list(plans)
        if self.checking and plans:
            invariants.check_plans(plans, table, max_dst=min(self.headroom, led.num_free + sum(
                len(p.dst_blocks) for p in plans)), max_moves=cfg.max_moves_per_step, pre_launch=False)
        return plans

    # ---------------------------------------------------------------- launch
    def launch(self, plans: Optional[Sequence[Plan]] = None):
        """Copy the moves of ``plans`` (default: every plan of this step) after the forward.

        ONE ``compact_kv`` launch for all of them. On a copy failure every plan
        of the step is rolled back (destinations freed, sources and table
        untouched) and the error is re-raised. Returns the copy ticket or None.
        """
        rec = self._record()
        plans = list(self._planned) if plans is None else list(plans)
        if not plans:
            return None
        ids = {id(p) for p in self._planned}
        if any(id(p) not in ids for p in plans):
            raise InvalidArgumentError("plans: expected plans made by this step's maybe_plan(), got foreign plans")
        t0 = time.perf_counter()
        src = np.concatenate([p.src_slots for p in plans])
        dst = np.concatenate([p.dst_slots for p in plans])
        if self.checking:
            self._i1_before.update(self._capture_rows(plans))
        try:
            ticket = self.copy_engine.launch(src, dst, step=self.step)
        except Exception:
            self._rollback(list(self._planned))
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

    # ---------------------------------------------------------------- commit
    def commit(self) -> np.ndarray:
        """Apply the launched plans to the table, the mirror and the ledger; end the step.

        Plans made but not launched are rolled back. Returns the freed block
        ids (int32).
        """
        rec = self._record()
        t0 = time.perf_counter()
        freed: list[np.ndarray] = []
        if self._planned:
            self._rollback(self._planned)
            rec.aborted_plans += len(self._planned)
            self._planned = []
        if self._launched:
            self.copy_engine.log_event("commit", self.step, plans=len(self._launched))
            for plan in self._launched:
                out = self._commit_plan(plan, rec)
                if out is not None:
                    freed.append(out)
            self._launched = []
        ids = np.concatenate(freed).astype(np.int32) if freed else np.zeros(0, dtype=np.int32)
        if ids.size:
            self.copy_engine.log_event("free", self.step, blocks=len(ids))
        rec.freed_blocks += len(ids)
        rec.commit_us += (time.perf_counter() - t0) * 1e6
        if self.checking:
            self._check_after_commit()
        self._end_step(rec)
        return ids

    def _alive_row(self, plan: Plan) -> bool:
        req = plan.request
        return req in self.table and self.table.row_of(req) == plan.meta.get("row")

    def _commit_plan(self, plan: Plan, rec: StepRecord) -> Optional[np.ndarray]:
        table, S = self.table, self.S
        req = plan.request
        self._busy.pop(req, None)
        if not self._alive_row(plan):  # finished meanwhile: its blocks are already free
            return None
        alive = table.is_alive(req, plan.token_ids)
        if alive.all():
            released = table.relocation.apply_moves(req, plan.token_ids, plan.dst_slots)
            # Every source emptied; a full commit leaves nothing in flight.
            return released
        # Some moved tokens died after planning: commit the survivors if the
        # destinations they use fit the source positions they free; else roll back.
        tids, dst = plan.token_ids[alive], plan.dst_slots[alive]
        used = np.unique(dst.astype(np.int64) // S)
        emptied = np.unique(plan.src_slots[alive].astype(np.int64) // S)
        if len(used) > len(emptied):
            self._rollback([plan])
            rec.aborted_plans += 1
            return None
        released = [table.relocation.apply_moves(req, tids, dst)] if len(tids) else []
        table.relocation.release_destinations(req, np.setdiff1d(plan.dst_blocks, used))  # unused: back to the pool
        released.append(table.relocation.end_relocation(req, plan.src_blocks))
        return np.concatenate(released)

    # ------------------------------------------------------------------ abort
    def abort(self) -> int:
        """Roll back every plan made or launched this step and not committed; return how many.

        Destinations return to the pool; sources and the table are untouched.
        (A launched copy only wrote blocks that are freed here; the next writer
        of those blocks is a later forward, which waits on the copy's event.)
        """
        plans = self._planned + self._launched
        self._rollback(plans)
        self._planned, self._launched = [], []
        self._record().aborted_plans += len(plans)
        return len(plans)

    def _rollback(self, plans: Sequence[Plan]) -> None:
        for plan in plans:
            req = plan.request
            self._busy.pop(req, None)
            if not self._alive_row(plan):
                continue
            led = self.ledger
            d = plan.dst_blocks.astype(np.int64)
            d = d[(led.state[d] == DST_INFLIGHT) & (led.owner[d] == plan.meta["row"])]
            self.table.relocation.release_destinations(req, d)
            self.table.relocation.end_relocation(req, plan.src_blocks)

    # ---------------------------------------------------------------- finish
    def finish_request(self, req) -> np.ndarray:
        """Roll back ``req``'s uncommitted plan, then free everything it holds (table.finish)."""
        mine = [p for p in self._planned + self._launched if p.request == req]
        if mine:
            self._rollback(mine)
            self._planned = [p for p in self._planned if p.request != req]
            self._launched = [p for p in self._launched if p.request != req]
            self._record().aborted_plans += len(mine)
        return self.table.finish(req)

    # -------------------------------------------------------------- checking
    def _capture_rows(self, plans: Sequence[Plan]) -> dict:
        """I1 'before' side: per request, live ids and every layer's K/V rows (debug only)."""
        eng = self.copy_engine
        out = {}
        for p in plans:
            ids = self.table.live_ids(p.request)
            slots = self.table.live_slots(p.request)
            rows = [invariants.gather_token_rows(c, eng.layout, slots).cpu() for c in eng.kv_caches]
            out[p.request] = (ids, rows)
        return out

    def _check_after_commit(self) -> None:
        eng = self.copy_engine
        if self._i1_before:
            eng.synchronize()  # the "after" side must read completed copies (debug only)
            for req, (ids, rows) in self._i1_before.items():
                if req not in self.table:
                    continue
                still = self.table.is_alive(req, ids)
                keep_ids = ids[still]
                slots = self.table.slots(req)[keep_ids]
                before = invariants.fingerprint_rows(keep_ids, [r[still] for r in rows])
                after_rows = [invariants.gather_token_rows(c, eng.layout, slots).cpu() for c in eng.kv_caches]
                after = invariants.fingerprint_rows(keep_ids, after_rows)
                if before != after:
                    raise InvariantViolation(
                        f"I1: live ids / K/V bytes of request {req!r} changed across a relocation"
                    )
            self._i1_before = {}
        invariants.check_mapping(self.table, self.mirror)

    def _end_step(self, rec: StepRecord) -> None:
        led, eng = self.ledger, self.copy_engine
        eng.poll()
        rec.free_blocks = led.num_free
        rec.reserved_blocks = led.reserved
        rec.waste_ratio = led.waste_ratio
        rec.live_tokens = int(led.total_live)
        rec.allocated_blocks = led.num_allocated
        rec.bytes_in_flight = eng.bytes_in_flight
        rec.pending_events = eng.pending_events
        self.admission_budget()  # sets rec.backpressure if it still holds at the end of the step
        self.metrics.append(rec)
        self._rec = None
        self.step += 1
