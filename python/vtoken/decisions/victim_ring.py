"""VictimRing: a step's device-side eviction decisions, shipped to the host asynchronously.

The device decision loop (:mod:`vtoken.decisions.loop`) writes each step's
outcome into one fixed-size int32 device record; :meth:`VictimRing.ship` then
copies it to a pinned host buffer with ``non_blocking=True`` and records an
event. :meth:`VictimRing.ready` hands back, oldest first, the records whose
event has completed: the host never waits on the device.

Record layout (int32, ``record_size`` elements)::

    [0]                 victims written (<= victim_capacity)
    [1]                 victims deferred (over capacity: left alive, chosen again next step)
    [2]                 emptied blocks written (<= block_capacity)
    [3]                 emptied blocks over capacity (not listed; the host finds them itself)
    [4 : 4+R]           victims per request, batch order (R = max_reqs)
    [.. : +victim_cap]  the victims' token ids, CSR by request (ids ascending within one)
    [.. : +block_cap]   the blocks emptied this step (device live count dropped to 0)

NOTE: a victim is never lost. The device kills only the victims that fit the
record (the rest stay alive on the device and on the host, and the policy
picks them again next step; a policy that decides only once, SnapKV at the
end of prefill, gets a record sized for the whole batch first). Between steps
(:meth:`grow`) the capacity doubles past the largest demand seen; records in
flight keep the geometry they were shipped with. A record leaves the queue
only once the host has applied it (:meth:`next_ready`, :meth:`release`).

On CPU (no CUDA) the "copy" is a plain clone and every record is ready at
once; the decision loop still applies it one step late, so both paths give
the same trace.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from vtoken.errors import check_int

HEADER = 4


@dataclass
class ShippedRecord:
    """One step's record on its way to the host, with what the host needs to apply it."""

    host: torch.Tensor  # int32 [record_size], pinned on CUDA
    event: Any  # torch.cuda.Event, or None on CPU (ready at once)
    meta: Any  # the caller's per-step context (requests, generations, decision keys)
    victim_capacity: int  # the geometry the record was written with (max_reqs never changes)


@dataclass(frozen=True)
class VictimRecord:
    """A completed record, decoded on the host (numpy views of the pinned buffer)."""

    counts: np.ndarray  # int32 [num_reqs]: victims per request, batch order
    token_ids: np.ndarray  # int32 [sum(counts)]: CSR by request
    emptied_blocks: np.ndarray  # int32 [k]
    deferred: int  # victims left alive because the record was full
    emptied_overflow: int  # emptied blocks that did not fit the record
    meta: Any


class VictimRing:
    """Fixed-size device records and their async copies to pinned host memory (see module docstring).

    Args:
        max_reqs: most requests per step.
        victim_capacity: victims one record holds.
        block_capacity: emptied blocks one record holds.
        device: where the decisions are made.
    """

    def __init__(self, max_reqs: int, victim_capacity: int, block_capacity: int, device):
        self.max_reqs = check_int("max_reqs", max_reqs, min_value=1)
        self.victim_capacity = check_int("victim_capacity", victim_capacity, min_value=1)
        self.block_capacity = check_int("block_capacity", block_capacity, min_value=1)
        self.device = torch.device(device)
        self.is_gpu = self.device.type == "cuda"
        self._in_flight: collections.deque[ShippedRecord] = collections.deque()
        self._spare: list[torch.Tensor] = []
        self._demand = 0  # the most victims one step asked for since the last grow
        self._alloc()
        self.num_grows = 0

    def _alloc(self) -> None:
        # +1: a trash element, the fixed-shape scatters' target for entries that write nothing.
        self.record = torch.zeros(self.record_size + 1, dtype=torch.int32, device=self.device)
        self._spare = [h for h in self._spare if h.numel() == self.record_size]

    @property
    def record_size(self) -> int:
        return HEADER + self.max_reqs + self.victim_capacity + self.block_capacity

    @property
    def nbytes(self) -> int:
        """Bytes one step copies device -> host."""
        return 4 * self.record_size

    # ------------------------------------------------------------- device side views
    @property
    def header(self) -> torch.Tensor:
        return self.record[:HEADER]

    @property
    def counts(self) -> torch.Tensor:
        return self.record[HEADER : HEADER + self.max_reqs]

    @property
    def victims_offset(self) -> int:
        return HEADER + self.max_reqs

    @property
    def blocks_offset(self) -> int:
        return self.victims_offset + self.victim_capacity

    @property
    def trash(self) -> int:
        return self.record_size

    # ------------------------------------------------------------- shipping
    def ship(self, meta) -> None:
        """Copy the current record to the host (async on CUDA) and queue it with ``meta``."""
        n = self.record_size
        host = self._spare.pop() if self._spare and self._spare[-1].numel() == n else \
            torch.empty(n, dtype=torch.int32, pin_memory=self.is_gpu)
        if self.is_gpu:
            host.copy_(self.record[:n], non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        else:
            host.copy_(self.record[:n])
            event = None
        self._in_flight.append(ShippedRecord(host, event, meta, self.victim_capacity))

    def next_ready(self) -> Optional[VictimRecord]:
        """The oldest shipped record if its copy completed (never blocks), else None. It stays queued
        until :meth:`release`, so a record whose application fails is not lost."""
        if self._in_flight and (self._in_flight[0].event is None or self._in_flight[0].event.query()):
            return self._decode(self._in_flight[0])
        return None

    def release(self) -> None:
        """Drop the oldest record (applied) and recycle its host buffer."""
        rec = self._in_flight.popleft()
        if rec.host.numel() == self.record_size:
            self._spare.append(rec.host)
        h = rec.host.numpy()
        self._demand = max(self._demand, int(h[0]) + int(h[1]))

    def wait_all(self) -> None:
        """Wait for every copy in flight (a shutdown / test helper: syncs)."""
        for rec in self._in_flight:
            if rec.event is not None:
                rec.event.synchronize()

    def peek(self) -> list[VictimRecord]:
        """Every shipped record, decoded but left in flight (a debug check's view: syncs)."""
        self.wait_all()
        return [self._decode(rec) for rec in self._in_flight]

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def _decode(self, rec: ShippedRecord) -> VictimRecord:
        h = rec.host.numpy()  # decoded with the geometry it was shipped with
        nv, deferred, nb, b_over = (int(x) for x in h[:HEADER])
        v0 = self.victims_offset
        b0 = v0 + rec.victim_capacity
        counts = h[HEADER : HEADER + rec.meta.num_reqs].copy()
        return VictimRecord(counts, h[v0 : v0 + nv].copy(), h[b0 : b0 + nb].copy(), deferred, b_over, rec.meta)

    def grow(self, min_victims: int = 0) -> bool:
        """Re-allocate the device record larger: past the largest demand seen since the last grow, and
        to at least ``min_victims``. Records in flight keep their own geometry, so any time between
        steps is safe. Returns True when the record moved (a captured graph over it is stale).
        """
        need = max(self._demand, int(min_victims))
        self._demand = 0
        if need <= self.victim_capacity:
            return False
        cap = self.victim_capacity
        while cap < need:
            cap *= 2
        self.victim_capacity = cap
        self._alloc()
        self.num_grows += 1
        return True
