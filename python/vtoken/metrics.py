"""Per-step reclamation metrics, exported as JSON or CSV.

One :class:`StepRecord` per engine step, appended by
:meth:`vtoken.reclamation.manager.ReclamationManager.commit` (the call that ends a step).
Counts are read from the ledger in O(1); times are host wall-clock.

A :class:`MetricsLog` keeps the newest ``capacity`` records (a ring, so a
server that runs for days does not grow without bound) and running totals
over every step it was given, which the ring does not lose: :meth:`summary`
and :attr:`MetricsLog.totals` cover the whole run, ``records`` and the
exports only the steps still kept.

Example:
    >>> log = MetricsLog(capacity=2)
    >>> for step in range(3):
    ...     log.append(StepRecord(step=step, free_blocks=10 - step, plans=1))
    >>> [r.step for r in log.records], log.totals.steps, log.summary()["plans"]
    ([1, 2], 3, 3)
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
from collections import deque
from dataclasses import dataclass
from typing import Optional

from vtoken.errors import check_int

DEFAULT_CAPACITY = 4096
"""Records a :class:`MetricsLog` keeps unless told otherwise: the newest 4096 steps."""


@dataclass
class StepRecord:
    """What one step did to memory. Times in microseconds."""

    step: int
    free_blocks: int = 0  # ledger.num_free after the step
    reserved_blocks: int = 0  # the headroom held back from admission
    waste_ratio: float = 0.0  # F after the step
    live_tokens: int = 0
    allocated_blocks: int = 0
    plans: int = 0  # plans launched this step
    moves: int = 0  # tokens relocated this step
    src_blocks: int = 0  # sources of the launched plans
    dst_blocks: int = 0  # destinations of the launched plans
    freed_blocks: int = 0  # blocks returned to the pool by this step's commit
    aborted_plans: int = 0  # plans rolled back (copy failure, abort, stale commit)
    bytes_in_flight: int = 0  # K/V bytes of launches whose event had not completed at commit
    planner_us: float = 0.0  # maybe_plan(): trigger, snapshot, planning, destination reservation
    launch_us: float = 0.0  # launch(): host time to enqueue the copy
    commit_us: float = 0.0  # commit(): apply_moves (the journal carries them to the mirrors), frees
    host_stall_us: float = 0.0  # force_sync only: host blocked on the relocation event
    pending_events: int = 0  # relocation events not yet complete (GPU)
    event_waits: int = 0  # compute-stream waits enqueued by before_forward this step
    triggered: bool = False  # the trigger fired (or reclamation was pending) this step
    backpressure: bool = False  # admission_budget() reported backpressure during the step (or at its end)


FIELDS = tuple(f.name for f in dataclasses.fields(StepRecord))


@dataclass
class StepTotals:
    """Running totals over every step appended to a :class:`MetricsLog` (the ring does not drop them)."""

    steps: int = 0
    plans: int = 0
    moves: int = 0
    src_blocks: int = 0
    dst_blocks: int = 0
    freed_blocks: int = 0
    aborted_plans: int = 0
    event_waits: int = 0
    backpressure_steps: int = 0
    planner_us: float = 0.0
    commit_us: float = 0.0
    planning_steps: int = 0  # steps that launched at least one plan
    planner_us_when_planning: float = 0.0
    host_stall_us_when_planning: float = 0.0
    allocated_steps: int = 0  # steps that ended with blocks allocated (where F means something)
    waste_ratio_when_allocated: float = 0.0  # F summed over those steps

    def add(self, r: StepRecord) -> None:
        self.steps += 1
        self.plans += r.plans
        self.moves += r.moves
        self.src_blocks += r.src_blocks
        self.dst_blocks += r.dst_blocks
        self.freed_blocks += r.freed_blocks
        self.aborted_plans += r.aborted_plans
        self.event_waits += r.event_waits
        self.backpressure_steps += bool(r.backpressure)
        self.planner_us += r.planner_us
        self.commit_us += r.commit_us
        if r.plans:
            self.planning_steps += 1
            self.planner_us_when_planning += r.planner_us
            self.host_stall_us_when_planning += r.host_stall_us
        if r.allocated_blocks > 0:
            self.allocated_steps += 1
            self.waste_ratio_when_allocated += r.waste_ratio

    @property
    def mean_waste_ratio(self) -> float:
        """F averaged over the steps that ended with blocks allocated (0.0 if none did)."""
        return self.waste_ratio_when_allocated / self.allocated_steps if self.allocated_steps else 0.0


class MetricsLog:
    """The newest ``capacity`` :class:`StepRecord` (oldest first) and running totals over all steps.

    Args:
        capacity: records kept (default :data:`DEFAULT_CAPACITY`); ``None``
            keeps every record, for a caller that needs the whole per-step
            history (the totals never need it).
    """

    def __init__(self, capacity: Optional[int] = DEFAULT_CAPACITY):
        self.capacity = None if capacity is None else check_int("capacity", capacity, min_value=1)
        self.records: deque[StepRecord] = deque(maxlen=self.capacity)
        self.totals = StepTotals()

    def append(self, rec: StepRecord) -> None:
        self.records.append(rec)
        self.totals.add(rec)

    def __len__(self) -> int:
        """Records kept (at most ``capacity``); ``totals.steps`` counts every step appended."""
        return len(self.records)

    def to_rows(self) -> list[dict]:
        return [dataclasses.asdict(r) for r in self.records]

    def to_json(self, path: Optional[str] = None) -> str:
        """The kept records and the summary of all steps as JSON; written to ``path`` when given."""
        text = json.dumps({"summary": self.summary(), "steps": self.to_rows()}, indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def to_csv(self, path: Optional[str] = None) -> str:
        """One CSV row per kept step, header = :data:`FIELDS`; written to ``path`` when given."""
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=FIELDS, lineterminator="\n")
        w.writeheader()
        w.writerows(self.to_rows())
        text = buf.getvalue()
        if path is not None:
            with open(path, "w", newline="") as f:
                f.write(text)
        return text

    def summary(self) -> dict:
        """Totals and means over every step appended, the ones the ring dropped included."""
        t = self.totals
        if not t.steps:
            return {"steps": 0}
        last = self.records[-1]
        return {
            "steps": t.steps,
            "plans": t.plans,
            "moves": t.moves,
            "freed_blocks": t.freed_blocks,
            "dst_blocks": t.dst_blocks,
            "aborted_plans": t.aborted_plans,
            "final_waste_ratio": last.waste_ratio,
            "final_free_blocks": last.free_blocks,
            "mean_planner_us": t.planner_us / t.steps,
            "mean_commit_us": t.commit_us / t.steps,
            "mean_planner_us_when_planning": _mean(t.planner_us_when_planning, t.planning_steps),
            "mean_host_stall_us_when_planning": _mean(t.host_stall_us_when_planning, t.planning_steps),
            "backpressure_steps": t.backpressure_steps,
            "event_waits": t.event_waits,
        }


def _mean(total: float, n: int) -> float:
    return total / n if n else 0.0
