"""Per-step reclamation metrics, exported as JSON or CSV.

One :class:`StepRecord` per engine step, appended by
:meth:`vtoken.reclaim.ReclamationManager.commit` (the call that ends a step).
Counts are read from the ledger in O(1); times are host wall-clock.

Example:
    >>> log = MetricsLog()
    >>> log.append(StepRecord(step=1, free_blocks=10, reserved_blocks=2, waste_ratio=0.5))
    >>> log.to_rows()[0]["free_blocks"]
    10
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
from dataclasses import dataclass
from typing import Optional


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
    commit_us: float = 0.0  # commit(): apply_moves, mirror deltas, frees
    host_stall_us: float = 0.0  # force_sync only: host blocked on the relocation event
    pending_events: int = 0  # relocation events not yet complete (GPU)
    event_waits: int = 0  # compute-stream waits enqueued by before_forward this step
    triggered: bool = False  # the trigger fired (or reclamation was pending) this step
    backpressure: bool = False  # admission_budget() reported backpressure during the step (or at its end)


FIELDS = tuple(f.name for f in dataclasses.fields(StepRecord))


class MetricsLog:
    """An append-only list of :class:`StepRecord` with exports and a summary."""

    def __init__(self, max_records: Optional[int] = None):
        self.records: list[StepRecord] = []
        self.max_records = max_records

    def append(self, rec: StepRecord) -> None:
        self.records.append(rec)
        if self.max_records is not None and len(self.records) > self.max_records:
            del self.records[: len(self.records) - self.max_records]

    def __len__(self) -> int:
        return len(self.records)

    def to_rows(self) -> list[dict]:
        return [dataclasses.asdict(r) for r in self.records]

    def to_json(self, path: Optional[str] = None) -> str:
        """The records (and a summary) as JSON; written to ``path`` when given."""
        text = json.dumps({"summary": self.summary(), "steps": self.to_rows()}, indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def to_csv(self, path: Optional[str] = None) -> str:
        """One CSV row per step, header = :data:`FIELDS`; written to ``path`` when given."""
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
        """Totals and means over the recorded steps."""
        rs = self.records
        if not rs:
            return {"steps": 0}
        n = len(rs)
        planned = [r for r in rs if r.plans]

        def mean(xs):
            xs = list(xs)
            return sum(xs) / len(xs) if xs else 0.0

        return {
            "steps": n,
            "plans": sum(r.plans for r in rs),
            "moves": sum(r.moves for r in rs),
            "freed_blocks": sum(r.freed_blocks for r in rs),
            "aborted_plans": sum(r.aborted_plans for r in rs),
            "final_waste_ratio": rs[-1].waste_ratio,
            "final_free_blocks": rs[-1].free_blocks,
            "mean_planner_us": mean(r.planner_us for r in rs),
            "mean_commit_us": mean(r.commit_us for r in rs),
            "mean_planner_us_when_planning": mean(r.planner_us for r in planned),
            "mean_host_stall_us_when_planning": mean(r.host_stall_us for r in planned),
            "backpressure_steps": sum(1 for r in rs if r.backpressure),
            "event_waits": sum(r.event_waits for r in rs),
        }
