"""What the scheduler-side connector ships to the workers each step, and what comes back."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from vtoken.errors import InvalidArgumentError, InvariantViolation


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

    ``prompt_tokens``: for each request admitted this step (new, or resumed
    after a preemption), the tokens it must compute before it may evict
    (its prompt, plus its outputs when resumed).
    """

    step: int
    events: list = field(default_factory=list)
    prompt_tokens: dict = field(default_factory=dict)

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


@dataclass(frozen=True)
class StepDecisions:
    """The victims the workers' device policy chose at one step (CSR over ``reqs``).

    ``seq_lens``: each request's tokens when it was decided; ``token_ids``
    int32, ``counts[i]`` of them for ``reqs[i]`` (requests with no victim are
    left out).
    """

    step: int
    reqs: tuple
    seq_lens: np.ndarray
    counts: np.ndarray
    token_ids: np.ndarray

    def rows(self):
        """``(request_id, seq_len, token_ids)`` per request."""
        off = np.concatenate([[0], np.cumsum(self.counts)])
        for k, req in enumerate(self.reqs):
            yield req, int(self.seq_lens[k]), self.token_ids[off[k]: off[k + 1]]

    def same_as(self, other: "StepDecisions") -> bool:
        return (self.step == other.step and self.reqs == other.reqs and np.array_equal(self.seq_lens, other.seq_lens)
                and np.array_equal(self.counts, other.counts) and np.array_equal(self.token_ids, other.token_ids))

    @property
    def nbytes(self) -> int:
        return int(self.seq_lens.nbytes + self.counts.nbytes + self.token_ids.nbytes)


@dataclass
class VTokenWorkerMetadata(KVConnectorWorkerMetadata):
    """The decisions a worker's device loop made, whose records reached the host since its last report.

    ``decisions``: :class:`StepDecisions`, oldest first, keyed by the
    scheduler step they were decided at (after that step's forward). The
    victims are already dead on the workers; the scheduler's table learns
    them here, a step or more late. No per-token score travels.

    Tensor-parallel ranks decide identically (their key masses are summed on
    the device before the policy runs), but each rank's records reach its
    host on their own schedule, so :meth:`aggregate` takes the union by step
    and checks that two ranks' reports of one step agree.
    """

    step: int
    decisions: list = field(default_factory=list)

    def aggregate(self, other: "VTokenWorkerMetadata") -> "VTokenWorkerMetadata":
        if other.step != self.step:
            raise InvalidArgumentError(f"other.step: expected {self.step}, got {other.step}")
        by_step = {d.step: d for d in self.decisions}
        for d in other.decisions:
            mine = by_step.get(d.step)
            if mine is None:
                by_step[d.step] = d
            elif not mine.same_as(d):
                raise InvariantViolation(f"worker decisions: tensor-parallel ranks decided step {d.step} differently")
        return VTokenWorkerMetadata(self.step, [by_step[s] for s in sorted(by_step)])

    @property
    def nbytes(self) -> int:
        """Array bytes of the report (the request ids travel once per decided request)."""
        return sum(d.nbytes for d in self.decisions)
