"""ReclamationManager: trigger, headroom, backpressure, planning, copy, commit.

The engine (or the vLLM connector) drives one manager per block pool, once
per step, in this order::

    budget = mgr.admission_budget()   # admit new work within budget.free_blocks,
                                      # none at all while budget.backpressure
    mgr.before_forward()              # I3: the compute stream waits on the last copy
    ...build slot lists, launch the forward, let the policy evict...
    plans = mgr.maybe_plan()          # pressure-driven trigger + plans (destinations reserved)
    mgr.launch(plans)                 # after the forward: ONE compact_kv on the relocation stream
    freed = mgr.commit()              # table updated (its journal tells the mirror), sources freed; ends the step

Requests leave through :meth:`ReclamationManager.finish_request`, which
rolls back any plan of theirs before the table frees their blocks.

Modes (the paired experiments): ``native`` (no eviction: the manager
does nothing), ``naive`` (eviction; a block is freed only once fully dead,
which the table does by itself), ``vtoken`` (eviction + reclamation). Only
``vtoken`` holds a headroom reserve back from admission.

Commit ordering. The copy of step N is ordered after forward N by event F_N
and before forward N+1 by the wait on E_N, so the host may commit right after
the launch: the table, the mirror and the ledger switch to the destinations
at once, and the freed sources can be handed out at once (their next writer
is a later forward, which waits on E_N).

The manager is a facade over three parts, each owning its state:
:class:`vtoken.reclamation.trigger.ReclaimTrigger` (when and how much),
:class:`vtoken.reclamation.executor.PlanExecutor` (plans from reservation to
commit) and :class:`vtoken.reclamation.checks.ReclaimChecks` (debug checks). It
owns the step counter and the metrics.
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import numpy as np

from vtoken.device.copy_engine import CopyEngine
from vtoken.errors import InvalidArgumentError, InvalidTypeError
from vtoken.metrics import MetricsLog, StepRecord
from vtoken.reclamation.planner import Plan
from vtoken.reclamation.checks import ReclaimChecks
from vtoken.reclamation.config import MAX_MOVES_PER_STEP, MODES, AdmissionBudget, Count, ReclaimConfig
from vtoken.reclamation.executor import PlanExecutor
from vtoken.reclamation.trigger import ReclaimTrigger
from vtoken.bookkeeping.table import TokenTable

__all__ = ["MAX_MOVES_PER_STEP", "MODES", "AdmissionBudget", "Count", "ReclaimConfig", "ReclamationManager"]


class ReclamationManager:
    """Turns the holes eviction leaves into free blocks. See the module docstring.

    Args:
        table: the :class:`vtoken.bookkeeping.table.TokenTable` (its ledger is used).
        config: a :class:`ReclaimConfig` (default: vtoken mode, defaults).
        kv_caches / layout: every layer's KV cache and its layout, for the
            copy; ``None`` runs the bookkeeping only (no data moves).
        mirror: a :class:`vtoken.device.buffers.DeviceMirror` checked against the table
            (I2, debug only); it follows the table's journal by itself.
        pending_kills: ``() -> {request: token ids}`` killed on the device and not yet in the table
            (a decision loop's ``pending_victims``): the I2 check expects those bits cleared.
        copy_engine: a prepared :class:`CopyEngine` (else one is built); its
            ``max_moves`` must cover a step's moves (see :meth:`moves_capacity`).
        compute_stream / device: passed to the copy engine.

    Example (bookkeeping only):
        >>> from vtoken.bookkeeping.pool import BlockPool
        >>> from vtoken.bookkeeping.ledger import BlockLedger
        >>> from vtoken.bookkeeping.table import TokenTable
        >>> t = TokenTable(BlockLedger(BlockPool(40), 4))
        >>> mgr = ReclamationManager(t, ReclaimConfig(low_watermark=40, headroom_blocks=2, check_interval=1))
        >>> t.add_request("a"); _ = t.sync_new_tokens("a", 32)
        >>> t.evict("a", [i for i in range(28) if i % 4])   # every block keeps 1 of 4
        >>> plans = mgr.maybe_plan(); ticket = mgr.launch(plans); freed = mgr.commit()
        >>> len(freed), t.held_blocks("a")
        (5, 3)
    """

    def __init__(
        self,
        table,
        config: Optional[ReclaimConfig] = None,
        *,
        kv_caches: Optional[Sequence] = None,
        layout=None,
        mirror=None,
        pending_kills: Optional[Callable[[], dict]] = None,
        copy_engine: Optional[CopyEngine] = None,
        compute_stream=None,
        device=None,
    ):
        if not isinstance(table, TokenTable):
            raise InvalidTypeError(f"table: expected a TokenTable, got {type(table).__name__}")
        self.config = config if config is not None else ReclaimConfig()
        if not isinstance(self.config, ReclaimConfig):
            raise InvalidTypeError(f"config: expected a ReclaimConfig, got {type(self.config).__name__}")
        self.table = table
        self.ledger = table.ledger
        self.S = table.S
        self.trigger = ReclaimTrigger(table, self.config)
        need = self.moves_capacity()
        if copy_engine is None:
            copy_engine = CopyEngine(
                kv_caches, layout, max_moves=need,
                force_sync=self.config.force_sync, compute_stream=compute_stream, device=device,
            )
        elif copy_engine.max_moves < need:
            raise InvalidArgumentError(
                f"copy_engine: expected max_moves >= {need} (max_moves_per_step, at most the pool's "
                f"usable slots), got {copy_engine.max_moves}"
            )
        self.trigger.reserve_headroom()  # the first state change: every argument is valid
        self.copy_engine = copy_engine
        self.mirror = mirror
        self.checks = ReclaimChecks(table, copy_engine, mirror, self.config.check_invariants, pending_kills)
        self.executor = PlanExecutor(table, copy_engine, self.checks)
        self.metrics = MetricsLog()
        self.step = 0
        self._rec: Optional[StepRecord] = None

    def moves_capacity(self) -> int:
        """The most moves one step can launch: ``max_moves_per_step``, at most the pool's usable slots.

        NOTE: destinations are unique slots of the pool, so no step moves more
        tokens than ``usable_blocks * block_size``; sizing the copy engine's
        move buffer by this bound keeps a huge setting from allocating a huge
        device buffer.
        """
        return max(1, min(self.config.max_moves_per_step, self.ledger.usable_blocks * self.S))

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
        return self.checks.enabled

    @property
    def pending(self) -> bool:
        """The last trigger check found waste worth reclaiming."""
        return self.trigger.pending

    @property
    def low_watermark(self) -> int:
        return self.trigger.low_watermark

    @property
    def headroom(self) -> int:
        return self.trigger.headroom

    def in_flight(self) -> list:
        """Requests with a plan made or launched but not committed."""
        return self.executor.in_flight()

    def _record(self) -> StepRecord:
        if self._rec is None:
            self._rec = StepRecord(step=self.step)
        return self._rec

    # ------------------------------------------------------------ admission
    def admission_budget(self) -> AdmissionBudget:
        """Free blocks minus the reserve, and the backpressure flag (an automatic headroom is resized first)."""
        budget = self.trigger.admission_budget()
        if budget.backpressure:
            self._record().backpressure = True
        return budget

    def note_waiting(self, blocks: int) -> None:
        """The blocks the prompts waiting for admission need: the driver's part of the projected demand
        (it stays until the next call; the engine reports it every step)."""
        self.trigger.note_waiting(blocks)

    # ------------------------------------------------------------- pre-forward
    def before_forward(self) -> bool:
        """I3: enqueue the compute stream's wait on the newest relocation event (no host wait)."""
        rec = self._record()
        waited = self.copy_engine.before_forward(step=self.step)
        rec.event_waits += int(waited)
        return waited

    # ------------------------------------------------------------------ plan
    def maybe_plan(self) -> list[Plan]:
        """Check the pressure-driven trigger and plan this step's relocations.

        The trigger: free blocks short of the projected demand (the running
        requests' growth over ``check_interval + S`` steps, the prompts of
        :meth:`note_waiting` and the headroom; at least ``low_watermark``),
        ``F > theta_F`` and at least ``min_gain`` blocks reclaimable; the plans
        stop once they cover the shortfall. It is evaluated every
        ``check_interval`` steps, and every step while reclamation is pending.
        Each plan's destinations are reserved (DST_INFLIGHT) from the headroom
        and its sources marked SRC_INFLIGHT, so the plans must be launched (or
        aborted) this step.
        """
        rec = self._record()
        if not self.reclaims:
            return []
        if self.executor.has_unlaunched:
            raise InvalidArgumentError("maybe_plan: expected the previous plans launched or aborted, got unlaunched plans")
        t0 = time.perf_counter()
        plans = self.trigger.plan(self.step, self.executor, rec)
        if plans:
            reserved = sum(len(p.dst_blocks) for p in plans)
            self.checks.check_plans(plans, max_dst=min(self.headroom, self.ledger.num_free + reserved),
                                    max_moves=self.config.max_moves_per_step)
        rec.planner_us += (time.perf_counter() - t0) * 1e6
        return plans

    # ---------------------------------------------------------------- launch
    def launch(self, plans: Optional[Sequence[Plan]] = None):
        """Copy the moves of ``plans`` (default: every plan of this step) after the forward.

        ONE ``compact_kv`` launch for all of them. ``plans`` must be this
        step's unlaunched plans, each once, of requests still registered
        (:class:`vtoken.errors.InvalidArgumentError` otherwise, before any
        copy). On a copy failure every unlaunched plan of the step is rolled
        back (destinations freed, sources and table untouched) and the error is
        re-raised. Returns the copy ticket or None.
        """
        return self.executor.launch(plans, step=self.step, rec=self._record())

    # ---------------------------------------------------------------- commit
    def commit(self, *, hold: bool = False) -> np.ndarray:
        """Apply the launched plans to the table, the mirror and the ledger; end the step.

        Plans made but not launched are rolled back. Returns the freed block
        ids (int32). ``hold=True`` (a driver whose copies run in other
        processes, the vLLM connector): the launched plans stay in flight, with
        their sources and destinations held, until :meth:`confirm` commits
        them once their copy is known done, or :meth:`abort` rolls them back.
        """
        rec = self._record()
        t0 = time.perf_counter()
        ids = self.executor.commit(step=self.step, rec=rec, hold=hold)
        rec.freed_blocks += len(ids)
        rec.commit_us += (time.perf_counter() - t0) * 1e6
        self.checks.check_after_commit()
        self._end_step(rec)
        return ids

    def confirm(self, plans: Sequence[Plan]) -> np.ndarray:
        """Commit ``plans``, launched and held by ``commit(hold=True)``, whose copy completed.

        Plans rolled back since (their request finished) are skipped. Returns
        the freed block ids (int32), counted in the current step's record.
        """
        rec = self._record()
        t0 = time.perf_counter()
        ids = self.executor.commit_launched(plans, step=self.step, rec=rec)
        rec.freed_blocks += len(ids)
        rec.commit_us += (time.perf_counter() - t0) * 1e6
        self.checks.check_after_commit()
        return ids

    # ------------------------------------------------------------------ abort
    def abort(self, plans: Optional[Sequence[Plan]] = None) -> int:
        """Roll back ``plans`` (default: every plan made or launched and not committed); return how many.

        Destinations return to the pool; sources and the table are untouched.
        (A launched copy only wrote blocks that are freed here; the next writer
        of those blocks is a later forward, which waits on the copy's event.)
        """
        if plans is None:
            return self.executor.abort(self._record())
        return self.executor.rollback_launched(plans, self._record())

    # ---------------------------------------------------------------- finish
    def finish_request(self, req) -> np.ndarray:
        """Roll back ``req``'s uncommitted plan, then free everything it holds (table.finish)."""
        return self.executor.finish_request(req, self._record())

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
