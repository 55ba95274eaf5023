"""Device mirror of the token tables and the fixed-address attention buffers (docs/architecture.md).

:class:`DeviceMirror` keeps, on the device, every tracked request's per-token
``slot`` (int32) and ``alive`` (int8) arrays. Appends, evictions and
relocation moves ship only deltas (position + value): they are collected on
the host and shipped by :meth:`DeviceMirror.flush` in ONE async H2D copy from
a pinned staging buffer, then applied by one ``index_copy_`` per array.

:class:`SlotListBuffers` holds the batch's attention inputs at fixed
addresses (``kv_indices``, ``kv_indptr``, ``slot_mapping``, ``kv_pos``, plus
the ``mirror_starts`` / ``num_tokens`` / ``new_token_counts`` arguments),
overwritten in place by ``ops.build_slot_lists`` so a captured CUDA graph
replays against them.

Mirror layout
    Each request owns a segment ``[start, start + cap)`` of the mirror arena;
    its ``n`` tokens fill ``[start, start + n)`` in logical order and the rest
    of the segment is slack with ``alive == 0``. Every mirror position that is
    not a current token of a tracked request has ``alive == 0`` (slack, the
    segments of removed requests). A batch is passed to ``build_slot_lists``
    as each request's ``(start, n)``, in batch order, so any batch order and
    any subset of the tracked requests reads the mirror in place. The mirror
    is re-laid out (one gather over the live segments on the device, no host
    sync, fresh slack) only when a request outgrows its segment and that
    segment is not the arena's last (the last one grows in place).

NOTE: the mirror tensors may change address on a re-layout or growth; they
are inputs of ``build_slot_lists`` (run before a graph replay), never
captured themselves. The :class:`SlotListBuffers` tensors never move.

The mirror follows the table through its delta journal
(:mod:`vtoken.bookkeeping.journal`): every append, eviction, move, registration and
finish reaches it at the next :meth:`DeviceMirror.sync` (``build`` syncs
first), so no caller has to remember to tell it. Without a table
(the vLLM worker), :meth:`DeviceMirror.apply` takes the events directly.

Per step (engine side)::

    table.sync_new_tokens_batch(reqs, counts)             # slot mapping of the new tokens
    table.evict_flat(reqs, victims, counts)               # the policy's decisions
    mirror.build(buffers, batch_reqs, new_token_counts)   # sync + flush + build_slot_lists
    # attention reads buffers.kv_indices / kv_indptr, writes K/V at buffers.slot_mapping
"""
from __future__ import annotations

import weakref
from typing import Optional, Sequence

import numpy as np
import torch

from vtoken import PAD_SLOT
from vtoken.device import ops
from vtoken.device.copy_engine import StagingRing
from vtoken.errors import InvalidArgumentError, InvalidTypeError, InvariantViolation, as_index_array, check_int, has_duplicates

PAD = PAD_SLOT


def _available_device(device) -> torch.device:
    """``device`` as a torch.device, refusing CUDA where none is available."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidArgumentError(f"device: expected a torch device, got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(f"device: expected an available device, got {dev} (CUDA is not available here)")
    return dev


class SlotListBuffers:
    """Fixed-address attention inputs of one batch.

    Tensors (device, allocated once):
        kv_indices       int32 [nnz_max]      live slots, packed per request, PAD tail
        kv_indptr        int32 [max_reqs + 1] exclusive prefix sum of live counts
        slot_mapping     int32 [max_tokens]   the new tokens' slots, PAD tail
        kv_pos           int32 [nnz_max]      each live slot's token id in its request, PAD tail
                                              (its mirror position is mirror_starts[r] + kv_pos)
        mirror_starts    int64 [max_reqs]     build argument: each request's segment start
        num_tokens       int64 [max_reqs]     build argument: each request's token count
        new_token_counts int64 [max_reqs]     build argument

    Host mirrors (no device read): ``num_reqs``, ``kv_indptr_host`` (int64,
    from the mirror's live counts), ``num_tokens_host`` (int64, the build's
    ``num_tokens``), ``num_new_tokens``.

    Example:
        >>> bufs = SlotListBuffers(max_reqs=4, nnz_max=64, max_tokens=8, device="cpu")
        >>> bufs.kv_indices.shape, bufs.kv_indptr.dtype
        (torch.Size([64]), torch.int32)
    """

    def __init__(self, *, max_reqs: int, nnz_max: int, max_tokens: int, device="cpu"):
        for name, v in (("max_reqs", max_reqs), ("nnz_max", nnz_max), ("max_tokens", max_tokens)):
            check_int(name, v, min_value=1)
        dev = torch.device(device)
        self.device = dev
        self.max_reqs, self.nnz_max, self.max_tokens = int(max_reqs), int(nnz_max), int(max_tokens)
        self.kv_indices = torch.full((self.nnz_max,), PAD, dtype=torch.int32, device=dev)
        self.kv_indptr = torch.zeros(self.max_reqs + 1, dtype=torch.int32, device=dev)
        self.slot_mapping = torch.full((self.max_tokens,), PAD, dtype=torch.int32, device=dev)
        self.kv_pos = torch.full((self.nnz_max,), PAD, dtype=torch.int32, device=dev)
        self.mirror_starts = torch.zeros(self.max_reqs, dtype=torch.int64, device=dev)
        self.num_tokens = torch.zeros(self.max_reqs, dtype=torch.int64, device=dev)
        self.new_token_counts = torch.zeros(self.max_reqs, dtype=torch.int64, device=dev)
        self.num_reqs = 0
        self.reqs: list = []
        self.num_new_tokens = 0
        self.kv_indptr_host = np.zeros(self.max_reqs + 1, dtype=np.int64)
        self.num_tokens_host = np.zeros(self.max_reqs, dtype=np.int64)


class DeltaShipper:
    """Pending (position, value) writes to a mirror's slot / alive tensors, shipped in one H2D copy.

    ``flush`` dedupes (the last write to a position wins), packs both arrays
    into one int64 host buffer, copies it to the device (pinned staging and a
    non-blocking copy on GPU: no host sync) and applies it with one
    ``index_copy_`` per tensor.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.is_gpu = device.type == "cuda"
        self._slot: list = []  # (positions int64, values int32)
        self._alive: list = []  # (positions int64, values int8)
        self._dead: list = []  # (start, length): ranges whose alive bits go to 0 after the writes above
        # NOTE: a staging buffer is reused only once its copy's event completed (no host wait).
        self._staging = StagingRing(pinned=True, dtype=torch.int64, prealloc=8, capacity=1 << 16) \
            if self.is_gpu else None
        self.bytes_shipped = 0
        self._watchers: list = []  # weak refs (see add_write_watcher)

    def add_write_watcher(self, watcher) -> None:
        """Show ``watcher`` the positions each :meth:`flush` writes, before and after it writes them.

        ``watcher.before_mirror_writes(positions)`` / ``watcher.after_mirror_writes(positions)``:
        ``positions`` int64 on the device, the distinct positions whose slot or
        alive bit the flush may change. Counts derived from the mirror follow
        with work over those positions, not a recount of the arena. Held weakly.
        """
        self._watchers.append(weakref.ref(watcher))

    def pending_positions(self) -> np.ndarray:
        """int64, ascending: the distinct positions the next :meth:`flush` writes (slot, alive or a dead range)."""
        parts = [p for p, _ in self._slot] + [p for p, _ in self._alive]
        parts += [np.arange(start, start + length) for start, length in self._dead]
        return np.unique(np.concatenate(parts).astype(np.int64)) if parts else np.zeros(0, np.int64)

    def set_slots(self, positions: np.ndarray, values) -> None:
        self._slot.append((positions, np.asarray(values, dtype=np.int32)))

    def set_alive(self, positions: np.ndarray, value: int) -> None:
        self._alive.append((positions, np.full(len(positions), value, dtype=np.int8)))

    def kill_range(self, start: int, length: int) -> None:
        """Zero ``alive[start : start + length]`` at the next flush, after every pending write.

        NOTE: a finished request's range: pending writes may still target it
        (they were made before the finish), none can after it (new segments
        never overlap a dead one until a re-layout, which flushes first).
        """
        if length:
            self._dead.append((int(start), int(length)))

    @staticmethod
    def _dedupe(parts: list) -> tuple[np.ndarray, np.ndarray]:
        """Concatenate (positions, values) parts; for a repeated position the LAST write wins."""
        pos = np.concatenate([p for p, _ in parts])
        val = np.concatenate([v for _, v in parts])
        if len(pos) > 1:
            rpos = pos[::-1]
            _, first = np.unique(rpos, return_index=True)
            keep = len(pos) - 1 - first
            pos, val = pos[keep], val[keep]
        return pos, val

    def flush(self, slots: torch.Tensor, alive: torch.Tensor) -> int:
        """Apply every pending write to ``slots`` / ``alive``; return the entries shipped."""
        if not self._slot and not self._alive and not self._dead:
            return 0
        watchers = [w for w in (ref() for ref in self._watchers) if w is not None]
        touched = self.to_device(self.pending_positions()) if watchers else None
        for w in watchers:
            w.before_mirror_writes(touched)
        sp, sv = self._dedupe(self._slot) if self._slot else (np.zeros(0, np.int64), np.zeros(0, np.int32))
        ap, av = self._dedupe(self._alive) if self._alive else (np.zeros(0, np.int64), np.zeros(0, np.int8))
        self._slot, self._alive = [], []
        k1, k2 = len(sp), len(ap)
        packed = np.concatenate([sp, sv.astype(np.int64), ap, av.astype(np.int64)])
        dev = self.to_device(packed)
        if k1:
            slots.index_copy_(0, dev[:k1], dev[k1 : 2 * k1].to(torch.int32))
        if k2:
            alive.index_copy_(0, dev[2 * k1 : 2 * k1 + k2], dev[2 * k1 + k2 :].to(torch.int8))
        for start, length in self._dead:
            alive[start : start + length].zero_()
        self._dead = []
        for w in watchers:
            w.after_mirror_writes(touched)
        self.bytes_shipped += packed.nbytes
        return k1 + k2

    def to_device(self, arr: np.ndarray) -> torch.Tensor:
        """An int64 host array on the device: pinned staging + async H2D on GPU (no sync)."""
        arr = np.ascontiguousarray(arr, dtype=np.int64)
        if not self.is_gpu:
            return torch.from_numpy(arr).to(self.device)
        host = self._staging.acquire(len(arr))
        host.numpy()[: len(arr)] = arr
        dev = host[: len(arr)].to(self.device, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._staging.retire(host, ev)
        return dev


class DeviceMirror:
    """Per-token slot / alive arrays of a :class:`vtoken.bookkeeping.table.TokenTable`, on a device.

    Args:
        table: the token table mirrored (the host copy is canonical).
        device: where the mirror and its scatters live.
        initial_tokens: initial arena size (grows by 1.5x).
        slack: fraction of extra room given to each segment on (re-)layout.
        min_slack: at least this many extra positions per segment.

    Example:
        >>> from vtoken.bookkeeping.pool import BlockPool
        >>> from vtoken.bookkeeping.ledger import BlockLedger
        >>> from vtoken.bookkeeping.table import TokenTable
        >>> t = TokenTable(BlockLedger(BlockPool(16), 4))
        >>> m = DeviceMirror(t, "cpu")
        >>> t.add_request("a"); _ = t.sync_new_tokens("a", 6); t.evict("a", [1])
        >>> bufs = SlotListBuffers(max_reqs=2, nnz_max=16, max_tokens=8)
        >>> m.build(bufs, ["a"], [6])
        >>> bufs.kv_indices[:6].tolist(), bufs.kv_indptr[:2].tolist()
        ([4, 6, 7, 8, 9, -1], [0, 5])
    """

    def __init__(self, table=None, device="cpu", *, initial_tokens: int = 1 << 16, slack: float = 0.25,
                 min_slack: int = 256):
        if isinstance(slack, bool) or not isinstance(slack, (int, float)) or not 0.0 <= float(slack) <= 4.0:
            raise InvalidArgumentError(f"slack: expected a fraction in [0, 4], got {slack!r}")
        check_int("min_slack", min_slack, min_value=1)
        check_int("initial_tokens", initial_tokens, min_value=1)
        if table is not None and not hasattr(table, "journal"):
            raise InvalidTypeError(f"table: expected a TokenTable (or None), got {type(table).__name__}")
        self.device = _available_device(device)
        self.table = table
        self.slack, self.min_slack = float(slack), int(min_slack)
        self.is_gpu = self.device.type == "cuda"
        cap = max(int(initial_tokens), 1024)
        self.slots = torch.full((cap,), PAD, dtype=torch.int32, device=self.device)
        self.alive = torch.zeros(cap, dtype=torch.int8, device=self.device)
        self._end = 0
        self._garbage = 0  # positions held by finished requests' segments
        # Per table row (grown with the row space seen in the events).
        self._start = np.zeros(64, dtype=np.int64)
        self._cap = np.zeros(64, dtype=np.int64)
        self._n = np.zeros(64, dtype=np.int64)
        self._nlive = np.zeros(64, dtype=np.int64)
        self._tracked: dict = {}  # req -> row
        self._req_of: dict = {}  # row -> req
        self.deltas = DeltaShipper(self.device)
        self.relayouts = 0
        self._layout_listeners: list = []  # called with (source, new_size) when positions move or the arena grows
        self.device_evictions_applied = 0  # evictions the table learned from kill_on_device: never shipped back
        self._reader = None
        if table is not None:
            self._reader = table.journal.subscribe()
            # A mirror that goes away stops pinning the journal's events.
            weakref.finalize(self, table.journal.unsubscribe, self._reader)
            for req in table.requests():  # requests registered before the mirror existed
                self._bootstrap(req)

    # ----------------------------------------------------------- tracking
    def _row(self, req) -> int:
        row = self._tracked.get(req)
        if row is None:
            raise InvalidArgumentError(f"reqs: expected requests tracked by the mirror, got {req!r}")
        return row

    def _ensure_rows(self, row: int) -> None:
        if row >= len(self._start):
            n = max(row + 1, 2 * len(self._start))
            for name in ("_start", "_cap", "_n", "_nlive"):
                a = getattr(self, name)
                setattr(self, name, np.concatenate([a, np.zeros(n - len(a), dtype=a.dtype)]))

    def _seg_cap(self, n: int) -> int:
        return int(n + max(self.min_slack, int(n * self.slack)))

    def tracked(self) -> list:
        return list(self._tracked)

    def live_count(self, req) -> int:
        return int(self._nlive[self._row(req)])

    def close(self) -> None:
        """Stop following the table (its journal no longer keeps events for this mirror)."""
        if self._reader is not None:
            self.table.journal.unsubscribe(self._reader)
            self._reader = None

    def num_tokens(self, req) -> int:
        return int(self._n[self._row(req)])

    def request_of_row(self, row: int):
        return self._req_of[row]

    def host_copy(self, req) -> tuple[np.ndarray, np.ndarray]:
        """``(slots int32, alive bool)`` of ``req``'s tokens read back from the device (debug: syncs)."""
        self.flush()
        row = self._row(req)
        s, n = int(self._start[row]), int(self._n[row])
        return self.slots[s : s + n].cpu().numpy(), self.alive[s : s + n].cpu().numpy() != 0

    def add_layout_listener(self, listener) -> None:
        """Call ``listener(source, size)`` whenever the arena changes size or its positions move.

        ``source`` int64 [size] on the device: new position i holds old
        position ``source[i]`` (-1: nothing). Per-position device state kept
        beside the mirror (e.g. eviction-policy scores) follows with one gather.
        """
        # NOTE: held weakly (a bound method through WeakMethod): a dropped listener stops being called.
        ref = weakref.WeakMethod(listener) if hasattr(listener, "__self__") else (lambda fn=listener: fn)
        self._layout_listeners.append(ref)

    def _notify_layout(self, source: torch.Tensor) -> None:
        self._layout_listeners = [ref for ref in self._layout_listeners if ref() is not None]
        for ref in self._layout_listeners:
            ref()(source, source.numel())

    def kill_on_device(self, positions: torch.Tensor, kill: torch.Tensor) -> None:
        """Clear the alive bit at ``positions[i]`` where ``kill[i]`` (device tensors, no host sync).

        The device-side decision loop evicts here first; the host table learns
        the same victims a step later (:mod:`vtoken.decisions.loop`), and its
        journal's ``evict`` event (origin ``"device"``) then brings the
        host-side live counts up to date without shipping those bits back: the
        decision is applied on the device once. Until then
        :meth:`live_count` and ``kv_indptr_host`` count those victims: an upper bound.
        Entries with ``kill`` False may hold any in-range position (duplicates
        included): they leave the bit as it is. Call :meth:`flush` first (a
        pending older delta must not land after the kill); this method only
        launches device work, so it can be captured in a CUDA graph.
        """
        keep = (~kill).to(torch.int8)  # min(alive, 1) == alive; min(alive, 0) == 0
        self.alive.scatter_reduce_(0, positions, keep, "amin")

    # ------------------------------------------------------------- events
    def sync(self) -> None:
        """Catch up with the table: apply the journal events since the last sync (host only)."""
        if self._reader is not None:
            self.apply(self.table.journal.take(self._reader))

    def apply(self, events) -> None:
        """Apply table events (:mod:`vtoken.bookkeeping.journal`) in order; device writes wait for :meth:`flush`."""
        events = list(events)
        unknown = [ev[0] for ev in events if ev[0] not in self._HANDLERS]
        if unknown:  # before any event is applied
            raise InvalidArgumentError(f"events: expected kinds {sorted(self._HANDLERS)}, got {unknown[0]!r}")
        self._check_rows(events)
        for ev in events:
            self._HANDLERS[ev[0]](self, *ev[1:])

    def _check_rows(self, events: list) -> None:
        """Raise, before any event is applied, unless every event names rows tracked at its turn: an ``add``
        a free row and a new request, the others a tracked row (host bookkeeping only, no device work).

        NOTE: an untracked row would otherwise write into another request's segment (its start is 0),
        and a second ``finish`` would raise an untyped KeyError halfway through the batch."""
        owner = dict(self._req_of)  # row -> request, as the batch goes
        reqs = set(self._tracked)
        for i, ev in enumerate(events):
            kind = ev[0]
            if kind == "add":
                row, req = int(ev[1]), ev[2]
                if row in owner or req in reqs:
                    raise InvalidArgumentError(f"events[{i}]: expected 'add' of a free row and a new request, "
                                               f"got row {row} for {req!r} (tracked already)")
                owner[row] = req
                reqs.add(req)
                continue
            rows = [int(ev[1])] if kind in ("move", "finish") else np.asarray(ev[1]).reshape(-1).tolist()
            bad = [r for r in rows if r not in owner]
            if bad:
                raise InvalidArgumentError(f"events[{i}]: expected {kind!r} of rows tracked by the mirror, "
                                           f"got untracked row {bad[0]}")
            if kind == "finish":
                reqs.discard(owner.pop(rows[0]))

    def _bootstrap(self, req) -> None:
        row = self.table.row_of(req)
        self._on_add(row, req)
        slots = self.table.slots(req)
        self._on_append(np.array([row]), np.array([len(slots)]), slots)
        dead = np.flatnonzero(~self.table.live_mask(req))
        self._on_evict(np.full(len(dead), row, dtype=np.int64), dead)

    def _on_add(self, row: int, req) -> None:
        self._ensure_rows(row)
        cap = self._seg_cap(0)
        self._reserve_arena(self._end + cap)
        self._start[row], self._cap[row], self._n[row], self._nlive[row] = self._end, cap, 0, 0
        self._end += cap
        self._tracked[req] = row
        self._req_of[row] = req

    def _on_append(self, rows: np.ndarray, counts: np.ndarray, slots: np.ndarray) -> None:
        need = self._n[rows] + counts
        over = np.flatnonzero(need > self._cap[rows])
        if len(over) == 1 and self._is_last(int(rows[over[0]])):
            self._extend_last(int(rows[over[0]]), int(need[over[0]]))
        elif len(over):
            # One re-layout for all of them, sized for every appending request's new length.
            order = sorted(self._tracked.values(), key=lambda r: self._start[r])
            self._relayout(order, dict(zip(rows.tolist(), need.tolist())))
        if len(slots) == 0:
            return
        starts = np.cumsum(counts) - counts
        within = np.arange(len(slots), dtype=np.int64) - np.repeat(starts, counts)
        pos = np.repeat(self._start[rows] + self._n[rows], counts) + within
        self.deltas.set_slots(pos, slots)
        self.deltas.set_alive(pos, 1)
        self._n[rows] += counts
        self._nlive[rows] += counts

    def _on_evict(self, rows: np.ndarray, token_ids: np.ndarray, origin: str = "host") -> None:
        if token_ids.size:
            if origin == "device":  # kill_on_device cleared these bits already: nothing to ship back
                self.device_evictions_applied += int(token_ids.size)
            else:
                self.deltas.set_alive(self._start[rows] + token_ids, 0)
            np.subtract.at(self._nlive, rows, 1)

    def _on_move(self, row: int, token_ids: np.ndarray, old_slots: np.ndarray, new_slots: np.ndarray) -> None:
        if token_ids.size:
            self.deltas.set_slots(self._start[row] + token_ids, new_slots)

    def _on_finish(self, row: int) -> None:
        """The request left: its segment becomes dead space (alive = 0 at the next flush)."""
        s, n, cap = int(self._start[row]), int(self._n[row]), int(self._cap[row])
        self.deltas.kill_range(s, n)
        del self._tracked[self._req_of.pop(row)]
        self._n[row] = self._cap[row] = self._nlive[row] = 0
        self._garbage += cap  # NOTE: never reused in place: its kill_range is still pending
        # NOTE: dead segments are reclaimed by a re-layout once they exceed 1/8 of
        # the arena, so a long-lived worker's mirror stays bounded by its peak live size.
        if self._garbage > max(self._end // 8, 4 * self.min_slack):
            self._relayout(sorted(self._tracked.values(), key=lambda r: self._start[r]))

    _HANDLERS = {"add": _on_add, "append": _on_append, "evict": _on_evict, "move": _on_move, "finish": _on_finish}

    # -------------------------------------------------------------- shipping
    def flush(self) -> int:
        """Ship every pending delta to the mirror tensors; return the entries shipped."""
        return self.deltas.flush(self.slots, self.alive)

    def _to_device(self, arr: np.ndarray) -> torch.Tensor:
        return self.deltas.to_device(arr)

    # ---------------------------------------------------------------- layout
    def _reserve_arena(self, need: int) -> None:
        cap = self.slots.numel()
        if need <= cap:
            return
        new = max(need, cap + cap // 2)
        slots = torch.full((new,), PAD, dtype=torch.int32, device=self.device)
        alive = torch.zeros(new, dtype=torch.int8, device=self.device)
        slots[: self._end].copy_(self.slots[: self._end])
        alive[: self._end].copy_(self.alive[: self._end])
        self.slots, self.alive = slots, alive
        if self._layout_listeners:
            source = torch.arange(new, dtype=torch.int64, device=self.device)
            self._notify_layout(torch.where(source < cap, source, -1))

    def _is_last(self, row: int) -> bool:
        return int(self._start[row] + self._cap[row]) == self._end

    def _extend_last(self, row: int, need: int) -> None:
        """Grow the arena's last segment in place to hold ``need`` tokens."""
        s = int(self._start[row])
        new_cap = self._seg_cap(need)
        self._reserve_arena(s + new_cap)
        self._cap[row] = new_cap
        self._end = s + new_cap

    def _relayout(self, rows_in_order: Sequence[int], need: Optional[dict] = None) -> None:
        """Rebuild the arena with the tracked segments in ``rows_in_order`` (others after), fresh slack."""
        self.flush()
        need = need or {}
        rows = list(rows_in_order)
        seen = set(rows)
        rest = sorted((r for r in self._tracked.values() if r not in seen), key=lambda r: self._start[r])
        rows = np.array(rows + rest, dtype=np.int64)
        n = self._n[rows]
        caps = np.array([self._seg_cap(max(int(k), need.get(int(r), 0))) for r, k in zip(rows, n)], dtype=np.int64)
        new_start = np.cumsum(caps) - caps
        total_cap = int(caps.sum())
        size = max(self.slots.numel(), total_cap)
        slots = torch.full((size,), PAD, dtype=torch.int32, device=self.device)
        alive = torch.zeros(size, dtype=torch.int8, device=self.device)
        total = int(n.sum())
        if total:
            # Gather index built on the device from per-segment triples (no O(tokens) H2D, no sync).
            meta = self._to_device(np.stack([self._start[rows], new_start, n]).reshape(-1)).view(3, -1)
            seg = torch.repeat_interleave(torch.arange(len(rows), device=self.device), meta[2], output_size=total)
            first = torch.cumsum(meta[2], 0) - meta[2]
            within = torch.arange(total, device=self.device) - first[seg]
            src = meta[0][seg] + within
            dst = meta[1][seg] + within
            slots.index_copy_(0, dst, self.slots.index_select(0, src))
            alive.index_copy_(0, dst, self.alive.index_select(0, src))
        if self._layout_listeners:
            source = torch.full((size,), -1, dtype=torch.int64, device=self.device)
            if total:
                source.index_copy_(0, dst, src)
            self._notify_layout(source)
        self.slots, self.alive = slots, alive
        self._start[rows] = new_start
        self._cap[rows] = caps
        self._end = total_cap
        self._garbage = 0
        self.relayouts += 1

    # ----------------------------------------------------------------- build
    def build(self, buffers: SlotListBuffers, reqs: Sequence, new_token_counts) -> None:
        """Flush the deltas and rebuild ``buffers`` for the batch ``reqs`` (in this order).

        ``new_token_counts[r]``: how many of request r's last tokens are new
        this step (their slots go to ``slot_mapping``). No host sync.
        """
        reqs = list(reqs)
        k = as_index_array("new_token_counts", new_token_counts)
        if len(k) != len(reqs):
            raise InvalidArgumentError(f"new_token_counts: expected {len(reqs)} entries, got {len(k)}")
        if len(reqs) > buffers.max_reqs:
            raise InvalidArgumentError(f"reqs: expected at most max_reqs={buffers.max_reqs} requests, got {len(reqs)}")
        if buffers.device != self.device:
            raise InvalidArgumentError(f"buffers: expected device {self.device}, got {buffers.device}")
        self.sync()
        rows = np.fromiter((self._row(r) for r in reqs), dtype=np.int64, count=len(reqs))
        if has_duplicates(rows):
            raise InvalidArgumentError(f"reqs: expected each request once, got duplicates in {reqs[:8]!r}")
        starts, ntok = self._start[rows].copy(), self._n[rows].copy()
        if len(reqs) and ((k < 0) | (k > ntok)).any():
            raise InvalidArgumentError("new_token_counts: expected 0 <= count <= the request's tokens")
        live = self._nlive[rows]
        if int(live.sum()) > buffers.nnz_max:
            raise InvalidArgumentError(f"buffers: expected nnz_max >= {int(live.sum())} live tokens, got {buffers.nnz_max}")
        if int(k.sum()) > buffers.max_tokens:
            raise InvalidArgumentError(f"buffers: expected max_tokens >= {int(k.sum())} new tokens, got {buffers.max_tokens}")
        self.flush()
        n = len(reqs)
        # One H2D copy for the three argument arrays (zeros past n: empty ranges).
        host = np.zeros((3, buffers.max_reqs), dtype=np.int64)
        host[0, :n], host[1, :n], host[2, :n] = starts, ntok, k
        dev = self._to_device(host.reshape(-1)).view(3, -1)
        buffers.mirror_starts.copy_(dev[0])
        buffers.num_tokens.copy_(dev[1])
        buffers.new_token_counts.copy_(dev[2])
        ops.build_slot_lists(
            self.slots, self.alive, buffers.mirror_starts, buffers.num_tokens, buffers.new_token_counts,
            buffers.kv_indices, buffers.kv_indptr, buffers.slot_mapping, kv_pos=buffers.kv_pos, num_reqs=n,
        )
        buffers.num_reqs = n
        buffers.reqs = reqs  # the batch, in order (what a consumer of the lists checks against)
        buffers.num_new_tokens = int(k.sum())
        buffers.num_tokens_host[:n] = ntok
        buffers.num_tokens_host[n:] = 0
        buffers.kv_indptr_host[0] = 0
        buffers.kv_indptr_host[1 : n + 1] = np.cumsum(live)
        buffers.kv_indptr_host[n + 1 :] = buffers.kv_indptr_host[n]

    # -------------------------------------------------------------- checking
    def check_against_table(self, table=None, *, pending_kills: Optional[dict] = None) -> None:
        """I2 for the mirror: it tracks the table's requests, with equal slots / alive (syncs the device).

        ``pending_kills``: {request: token ids} killed on the device (:meth:`kill_on_device`) that the
        table has yet to learn (a decision loop's ``pending_victims()``); exactly those bits may differ.
        """
        table = self.table if table is None else table
        self.sync()
        self.flush()
        if sorted(map(repr, self._tracked)) != sorted(map(repr, table.requests())):
            raise InvariantViolation("mirror: the tracked requests differ from the table's")
        slots = self.slots.cpu().numpy()
        alive = self.alive.cpu().numpy()
        covered = np.zeros(len(alive), dtype=bool)
        pending = {} if pending_kills is None else pending_kills
        for req, row in self._tracked.items():
            s, n = int(self._start[row]), int(self._n[row])
            if n != table.num_tokens(req) or int(self._nlive[row]) != table.live_count(req):
                raise InvariantViolation(f"mirror: request {req!r} has {n} tokens, the table {table.num_tokens(req)}")
            mask = table.live_mask(req)
            if int(self._nlive[row]) != int(mask.sum()):
                raise InvariantViolation(f"mirror: request {req!r} counts {int(self._nlive[row])} live, the table {int(mask.sum())}")
            mask = mask.copy()
            mask[pending.get(req, np.zeros(0, np.int64))] = False  # killed on the device, applied next step
            if not np.array_equal(alive[s : s + n] != 0, mask):
                raise InvariantViolation(f"mirror: alive bits of request {req!r} differ from the table")
            if not np.array_equal(slots[s : s + n][mask], table.slots(req)[mask]):
                raise InvariantViolation(f"mirror: live slots of request {req!r} differ from the table")
            covered[s : s + n] = True
        if alive[~covered].any():
            raise InvariantViolation("mirror: a position outside every tracked request's tokens is alive")
