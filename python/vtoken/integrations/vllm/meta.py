"""What the scheduler-side connector ships to the workers each step, and what comes back."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from vtoken.errors import InvalidArgumentError


@dataclass
class VTokenConnectorMetadata(KVConnectorMetadata):
    """One step's token-table changes: the scheduler table's journal events since the last step.

    ``events`` are :mod:`vtoken.journal` events, in order: finishes
    (finished or preempted requests) and evictions since the last step,
    registrations and appends of this step (a request's first append starts
    with the slots of its prefix-cache hits), then this step's relocation
    ``move`` events. Every worker applies the events before the first
    ``move`` ahead of the forward (``handle_preemptions``); after the forward
    (``wait_for_save``) it copies every layer's K/V rows of the moves from
    their old slots to their new ones (one ``compact_kv`` launch), then
    applies the moves to its mirror.
    """

    step: int
    events: list = field(default_factory=list)
    want_scores: bool = False

    def split_moves(self) -> tuple[list, list]:
        """``(events before the first move, the move events)``."""
        first = next((i for i, ev in enumerate(self.events) if ev[0] == "move"), len(self.events))
        before, moves = self.events[:first], self.events[first:]
        if any(ev[0] != "move" for ev in moves):
            raise InvalidArgumentError("events: expected the relocation moves last in a step's events")
        return before, moves

    @property
    def num_moves(self) -> int:
        return int(sum(len(ev[2]) for ev in self.events if ev[0] == "move"))


@dataclass
class VTokenWorkerMetadata(KVConnectorWorkerMetadata):
    """Per request, the step's attention mass per live key (float32, logical order).

    Each value sums, over the layers of this worker, its KV heads and the
    query heads of their GQA groups and the step's queries, the softmax
    probability the key received. Tensor-parallel ranks hold disjoint KV
    heads, so :meth:`aggregate` sums them.
    """

    step: int
    scores: dict = field(default_factory=dict)

    def aggregate(self, other: "VTokenWorkerMetadata") -> "VTokenWorkerMetadata":
        if other.step != self.step:
            raise InvalidArgumentError(f"other.step: expected {self.step}, got {other.step}")
        out = {k: v.copy() for k, v in self.scores.items()}
        for k, v in other.scores.items():
            if k in out:
                if out[k].shape != v.shape:
                    raise InvalidArgumentError(f"scores[{k!r}]: expected shape {out[k].shape}, got {v.shape}")
                out[k] += v
            else:
                out[k] = np.array(v, copy=True)
        return VTokenWorkerMetadata(self.step, out)
