"""What the scheduler-side connector ships to the workers each step, and what comes back."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from vtoken.errors import InvalidArgumentError, InvariantViolation


@dataclass
class VTokenConnectorMetadata(KVConnectorMetadata):
    """One step's token-table changes and relocation copies.

    ``events``: the scheduler table's :mod:`vtoken.bookkeeping.journal` events since the
    last step, in order (finishes and evictions, the ``move`` events of the
    relocations the workers confirmed since, registrations and appends of this
    step; a request's first append starts with the slots of its prefix-cache
    hits). Every worker applies them all to its mirror before the forward
    (``handle_preemptions``): a ``move`` only re-points tokens at slots an
    earlier step's copy already filled.

    ``copy_src`` / ``copy_dst`` (int32 ``[M]``): the slots of this step's
    relocation plans, not yet in the table. After the forward
    (``wait_for_save``) every worker copies each layer's K/V rows from
    ``copy_src`` to ``copy_dst`` (one ``compact_kv`` launch) and reports the
    copy in :attr:`VTokenWorkerMetadata.copies`; only then does the scheduler
    commit the plans (docs/vllm.md, "Copies and frees").

    ``prompt_tokens``: for each request admitted this step (new, or resumed
    after a preemption), the tokens it must compute before it may evict
    (its prompt, plus its outputs when resumed).
    """

    step: int
    events: list = field(default_factory=list)
    prompt_tokens: dict = field(default_factory=dict)
    copy_src: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    copy_dst: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    def __post_init__(self):
        self.copy_src = np.ascontiguousarray(self.copy_src, dtype=np.int32)
        self.copy_dst = np.ascontiguousarray(self.copy_dst, dtype=np.int32)
        if self.copy_src.ndim != 1 or self.copy_src.shape != self.copy_dst.shape:
            raise InvalidArgumentError(
                f"copy_dst: expected the shape of copy_src {self.copy_src.shape}, got {self.copy_dst.shape}"
            )

    @property
    def num_moves(self) -> int:
        """Tokens whose relocation this step's events commit."""
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
    """What a worker reports after a step: its relocation copy, and decisions that reached the host.

    ``copies``: ``{step: ok}`` for the relocation copy of the step just run
    (present only when that step's metadata had moves): True once the copy
    was enqueued behind the forward, before every later reader and writer of
    its slots (the compute stream waits on its event), False when it failed.

    ``decisions``: :class:`StepDecisions`, oldest first, keyed by the
    scheduler step they were decided at (after that step's forward). The
    victims are already dead on the workers; the scheduler's table learns
    them here, a step or more late. No per-token score travels.

    Tensor-parallel ranks decide identically (their key masses are summed on
    the device before the policy runs), but each rank's records reach its
    host on their own schedule, so :meth:`aggregate` takes the union by step
    and checks that two ranks' reports of one step agree. A copy counts as
    done only when every rank reports it done (a rank that reports nothing
    for a step the other reports counts as failed).
    """

    step: int
    decisions: list = field(default_factory=list)
    copies: dict = field(default_factory=dict)

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
        copies = {s: self.copies.get(s) is True and other.copies.get(s) is True
                  for s in sorted(set(self.copies) | set(other.copies))}
        return VTokenWorkerMetadata(self.step, [by_step[s] for s in sorted(by_step)], copies)

    @property
    def nbytes(self) -> int:
        """Array bytes of the report (the request ids travel once per decided request)."""
        return sum(d.nbytes for d in self.decisions)
