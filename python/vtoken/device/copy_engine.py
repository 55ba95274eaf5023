"""CopyEngine: the stage-aware, host-sync-free relocation copy (docs/architecture.md §6, docs/reclamation.md).

GPU protocol, per step N that has moves (all plans of the step together):

1. record event ``F_N`` on the compute stream (after the step's forward was
   launched) and make the dedicated relocation stream wait on it, so the copy
   never races the forward that still reads the sources;
2. write the moves into a pinned host staging buffer, copy them (one async
   H2D) into a persistent device move buffer, and issue ONE ``compact_kv``
   launch covering every layer, K and V, of every plan, on the relocation
   stream;
3. record event ``E_N`` on the relocation stream;
4. the next forward's pre-attention hook, :meth:`CopyEngine.before_forward`,
   enqueues ``compute_stream.wait_event(E_N)`` (I3): every reader of the
   destinations and every writer of the freed sources comes after the copy.

The host never waits: a staging buffer stays alive until its ``E`` has
completed, found by polling ``E.query()``. ``force_sync=True`` is the paper's
ablation: the host blocks on ``E`` after every launch, and the stall is
measured (:attr:`CopyTicket.host_stall_us`).

CPU protocol: the same steps, executed synchronously, with host-side events
recorded in :attr:`CopyEngine.log` so tests can assert the order
``record F -> wait F -> copy -> record E -> (commit -> free) -> wait E`` before
the next forward.

Which path runs is decided once, in the constructor, from
``torch.cuda.is_available()`` and the caches' device.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from vtoken.device import ops
from vtoken.errors import InvalidArgumentError, InvalidTypeError, check_int
from vtoken.layout import KVLayout


class HostEvent:
    """CPU stand-in for ``torch.cuda.Event``: completes when recorded (work is synchronous)."""

    __slots__ = ("name", "step", "_done")

    def __init__(self, name: str, step: int):
        self.name, self.step, self._done = name, step, False

    def record(self) -> None:
        self._done = True

    def query(self) -> bool:
        return self._done

    def synchronize(self) -> None:
        pass


class StagingRing:
    """Host staging buffers for async H2D copies, reused only once their event completed.

    NOTE: an async H2D copy reads the pinned buffer when the stream gets to it,
    so the host must not overwrite a buffer before the copy's event completes.
    :meth:`acquire` only hands out buffers whose event ``query()`` is true and
    allocates a new one otherwise: it never blocks.
    """

    def __init__(self, *, pinned: bool, dtype=torch.int32, prealloc: int = 0, capacity: int = 0):
        self.pinned, self.dtype = pinned, dtype
        self._free: list[torch.Tensor] = []
        self._busy: collections.deque = collections.deque()  # (event, buffer)
        for _ in range(prealloc):
            self._free.append(self._new(capacity))

    def _new(self, n: int) -> torch.Tensor:
        return torch.empty(max(int(n), 1), dtype=self.dtype, pin_memory=self.pinned)

    def poll(self) -> int:
        """Recycle buffers whose event completed; return how many are still in use."""
        while self._busy and self._busy[0][0].query():
            self._free.append(self._busy.popleft()[1])
        if self._busy:  # events complete in stream order, but be exact for mixed streams
            keep = collections.deque()
            for ev, buf in self._busy:
                (self._free.append(buf) if ev.query() else keep.append((ev, buf)))
            self._busy = keep
        return len(self._busy)

    def acquire(self, n: int) -> torch.Tensor:
        """A host buffer with room for ``n`` elements that no pending copy reads."""
        self.poll()
        for i, buf in enumerate(self._free):
            if buf.numel() >= n:
                return self._free.pop(i)
        if self._free:  # replace the smallest free buffer by a larger one
            self._free.sort(key=lambda b: b.numel())
            self._free.pop(0)
        return self._new(max(n, 1024))

    def retire(self, buf: torch.Tensor, event) -> None:
        """``buf`` is read by work that completes with ``event``."""
        self._busy.append((event, buf))


@dataclass
class CopyTicket:
    """One step's relocation launch."""

    step: int
    num_moves: int
    nbytes: int  # K/V bytes copied (read once, written once), all layers
    event: object  # torch.cuda.Event or HostEvent (E_N)
    host_stall_us: float = 0.0  # force_sync only: time the host blocked on E_N


class CopyEngine:
    """Relocation copies on their own stream, ordered by events, without host syncs.

    Args:
        kv_caches: every layer's KV cache tensor (same shape, layout and
            device), or ``None`` / ``[]`` for bookkeeping-only runs (no data moves).
        layout: the caches' :class:`vtoken.layout.KVLayout` (``None`` iff no caches).
        max_moves: capacity of the persistent move buffer (moves per step);
            with caches, at most their slot count (``layout.num_slots``).
        force_sync: block the host on ``E`` after every launch (ablation).
        compute_stream: the stream the forwards run on (GPU; default: the
            current stream at each call).
        device: needed only when ``kv_caches`` is empty (default CPU).
        log_size: entries of :attr:`log` kept (a bounded deque).

    Example (CPU, bookkeeping only):
        >>> import numpy as np
        >>> eng = CopyEngine(None, None, max_moves=8)
        >>> t = eng.launch(np.array([16], np.int32), np.array([32], np.int32), step=1)
        >>> [e[0] for e in eng.log]
        ['record_F', 'wait_F', 'copy', 'record_E']
    """

    def __init__(
        self,
        kv_caches: Optional[Sequence[torch.Tensor]],
        layout: Optional[KVLayout],
        *,
        max_moves: int,
        force_sync: bool = False,
        compute_stream=None,
        device=None,
        log_size: int = 4096,
    ):
        caches = list(kv_caches) if kv_caches is not None else []
        check_int("max_moves", max_moves, min_value=1)
        if caches:
            if not isinstance(layout, KVLayout):
                raise InvalidTypeError(f"layout: expected a KVLayout, got {type(layout).__name__}")
            for i, t in enumerate(caches):
                if not isinstance(t, torch.Tensor):
                    raise InvalidTypeError(f"kv_caches[{i}]: expected a torch.Tensor, got {type(t).__name__}")
                if t.device != caches[0].device or t.dtype != caches[0].dtype or t.shape != caches[0].shape:
                    raise InvalidArgumentError(
                        f"kv_caches[{i}]: expected the shape/dtype/device of kv_caches[0] "
                        f"({tuple(caches[0].shape)}, {caches[0].dtype}, {caches[0].device}), "
                        f"got ({tuple(t.shape)}, {t.dtype}, {t.device})"
                    )
            device = caches[0].device
        self.kv_caches = caches
        self.layout = layout
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        # NOTE: destinations are unique slots of the caches, so no launch moves more
        # tokens than the caches hold; the move buffer is never sized beyond that.
        self.max_moves = min(int(max_moves), layout.num_slots) if caches else int(max_moves)
        self.force_sync = bool(force_sync)
        # Decided once: the GPU protocol needs CUDA and caches on a CUDA device.
        self.is_gpu = torch.cuda.is_available() and self.device.type == "cuda"
        self._compute_stream = compute_stream
        self.log: collections.deque = collections.deque(maxlen=log_size)
        self._pending: collections.deque[CopyTicket] = collections.deque()
        self._last_ticket: Optional[CopyTicket] = None  # newest launch the compute stream has not waited on
        self.event_waits = 0
        self.launches = 0
        self.total_moves = 0
        itemsize = caches[0].element_size() if caches else 0
        self.bytes_per_token = (
            len(caches) * layout.num_kv * layout.num_heads * layout.head_dim * itemsize if caches else 0
        )
        if self.is_gpu:
            self.reloc_stream = torch.cuda.Stream(device=self.device)
            # [src(m) | dst(m)] of the current launch; fixed address, reused every step.
            self._moves_dev = torch.full((2 * self.max_moves,), -1, dtype=torch.int32, device=self.device)
            self._staging = StagingRing(pinned=True, prealloc=4, capacity=2 * self.max_moves)
        else:
            self.reloc_stream = None
            self._moves_dev = None
            self._staging = None

    # ------------------------------------------------------------------ API
    def compute_stream(self):
        if self._compute_stream is not None:
            return self._compute_stream
        return torch.cuda.current_stream(self.device)

    def log_event(self, kind: str, step: int, **info) -> None:
        """Append ``(kind, step, info)`` to :attr:`log` (the manager logs commit / free here)."""
        self.log.append((kind, step, info))

    def launch(self, src_slots: np.ndarray, dst_slots: np.ndarray, *, step: int) -> Optional[CopyTicket]:
        """Copy every layer's K/V rows from ``src_slots`` to ``dst_slots`` after the current forward.

        Args: int32 numpy ``[M]`` each, ``M <= max_moves``; destinations unique
        and disjoint from the sources (the planner guarantees it). Returns the
        step's :class:`CopyTicket` (``None`` when ``M == 0``). On an error
        nothing is pending and the caller rolls the plans back.
        """
        src = np.ascontiguousarray(src_slots, dtype=np.int32)
        dst = np.ascontiguousarray(dst_slots, dtype=np.int32)
        if src.ndim != 1 or src.shape != dst.shape:
            raise InvalidArgumentError(
                f"dst_slots: expected the shape of src_slots {src.shape}, got {dst.shape}"
            )
        m = len(src)
        if m == 0:
            return None
        if m > self.max_moves:
            raise InvalidArgumentError(f"src_slots: expected at most max_moves={self.max_moves} moves, got {m}")
        if self.is_gpu:
            ticket = self._launch_gpu(src, dst, m, step)
        else:
            ticket = self._launch_cpu(src, dst, m, step)
        self.launches += 1
        self.total_moves += m
        self._pending.append(ticket)
        self._last_ticket = ticket
        if self.force_sync:
            t0 = time.perf_counter()
            ticket.event.synchronize()
            ticket.host_stall_us = (time.perf_counter() - t0) * 1e6
            self.log_event("host_sync_E", step, stall_us=ticket.host_stall_us)
        return ticket

    def before_forward(self, *, step: int = -1) -> bool:
        """Pre-forward hook: the compute stream waits on the newest relocation event (I3).

        Enqueues the wait at most once per launch; never blocks the host.
        Returns True when a wait was enqueued.
        """
        self.poll()
        ticket = self._last_ticket
        if ticket is None:
            return False
        self._last_ticket = None
        if self.is_gpu:
            self.compute_stream().wait_event(ticket.event)
        self.event_waits += 1
        self.log_event("wait_E", step, on="compute", launch_step=ticket.step)
        return True

    def poll(self) -> int:
        """Drop completed launches and recycle their staging buffers; return launches pending."""
        while self._pending and self._pending[0].event.query():
            self._pending.popleft()
        if self._staging is not None:
            self._staging.poll()
        return len(self._pending)

    def synchronize(self) -> None:
        """Block the host until every launched copy completed (debug checks, teardown; never per step)."""
        for t in list(self._pending):
            t.event.synchronize()
        self.poll()

    @property
    def pending_events(self) -> int:
        """Launches whose ``E`` has not completed (as of the last poll)."""
        return len(self._pending)

    @property
    def bytes_in_flight(self) -> int:
        return sum(t.nbytes for t in self._pending)

    # ------------------------------------------------------------ internals
    def _copy(self, src_dev: torch.Tensor, dst_dev: torch.Tensor) -> None:
        if self.kv_caches:
            # NOTE: validate=False on GPU: the planner guarantees the contract
            # (unique destinations, disjoint from the sources), vtoken.bookkeeping.invariants
            # re-checks it on the host under VTOKEN_DEBUG_INVARIANTS, and the
            # kernel's own content checks would read device memory (a sync).
            ops.compact_kv(self.kv_caches, self.layout, src_dev, dst_dev,
                           validate=False if self.is_gpu else None)

    def _launch_cpu(self, src: np.ndarray, dst: np.ndarray, m: int, step: int) -> CopyTicket:
        f = HostEvent("F", step)
        f.record()
        self.log_event("record_F", step, on="compute")
        self.log_event("wait_F", step, on="relocation")
        self._copy(torch.from_numpy(src).to(self.device), torch.from_numpy(dst).to(self.device))
        self.log_event("copy", step, moves=m)
        e = HostEvent("E", step)
        e.record()
        self.log_event("record_E", step, on="relocation")
        return CopyTicket(step, m, m * self.bytes_per_token * 2, e)

    def _launch_gpu(self, src: np.ndarray, dst: np.ndarray, m: int, step: int) -> CopyTicket:
        compute = self.compute_stream()
        f = torch.cuda.Event()
        f.record(compute)
        self.log_event("record_F", step, on="compute")
        self.reloc_stream.wait_event(f)
        self.log_event("wait_F", step, on="relocation")
        staging = self._staging.acquire(2 * m)
        host = staging.numpy()
        host[:m] = src
        host[m : 2 * m] = dst
        moves = self._moves_dev[: 2 * m]
        with torch.cuda.stream(self.reloc_stream):
            moves.copy_(staging[: 2 * m], non_blocking=True)
            try:
                self._copy(moves[:m], moves[m:])
            finally:
                # The H2D copy may still read ``staging``: keep it until E, even on error.
                e = torch.cuda.Event()
                e.record(self.reloc_stream)
                self._staging.retire(staging, e)
        self.log_event("copy", step, moves=m)
        self.log_event("record_E", step, on="relocation")
        return CopyTicket(step, m, m * self.bytes_per_token * 2, e)
