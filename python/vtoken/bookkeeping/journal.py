"""DeltaJournal: what changed in the token table, for every mirror of it.

The table emits one event per batched mutation, in order; each reader (a
device mirror, the vLLM scheduler's per-step metadata) takes the events since
its last read. Since the table itself emits them, no caller can forget to
tell a mirror about a change.

Events (rows are the table's stable row ids, valid from ``add`` to ``finish``):

- ``("add", row, req)``: a request registered (its shared-prefix tokens, if
  any, follow as an ``append``);
- ``("append", rows int64[k], counts int64[k], slots int32[sum(counts)])``:
  new tokens, request after request, alive;
- ``("evict", rows int64[m], token_ids int64[m], origin)``: tokens died; ``origin``
  is ``"host"``, or ``"device"`` when a device decision loop already cleared
  their alive bits in its mirror (a mirror then ships nothing back);
- ``("move", row, token_ids int64[m], old_slots int32[m], new_slots int32[m])``:
  live tokens took new slots (a relocation commit; a copy reads ``old_slots``);
- ``("finish", row)``: the request left; the row may be reused by a later ``add``.

With no reader, emitting costs nothing.
"""
from __future__ import annotations

from vtoken.errors import InvalidArgumentError

EVICT_ORIGINS = ("host", "device")  # who decided an eviction: see the "evict" event above


class DeltaJournal:
    """An ordered event log with one read position per reader."""

    def __init__(self):
        self._events: list[tuple] = []
        self._first = 0  # absolute index of self._events[0]
        self._readers: dict[int, int] = {}  # reader -> absolute index of its next event
        self._next_reader = 0

    def subscribe(self) -> int:
        """A new reader; it sees the events emitted from now on."""
        reader = self._next_reader
        self._next_reader += 1
        self._readers[reader] = self._first + len(self._events)
        return reader

    def unsubscribe(self, reader: int) -> None:
        self._readers.pop(reader, None)
        self._trim()

    def emit(self, *event) -> None:
        if self._readers:
            self._events.append(event)

    def take(self, reader: int) -> list[tuple]:
        """The events since ``reader``'s last take, oldest first."""
        pos = self._readers.get(reader)
        if pos is None:
            raise InvalidArgumentError(f"reader: expected a subscribed reader, got {reader!r}")
        out = self._events[pos - self._first:]
        self._readers[reader] = self._first + len(self._events)
        self._trim()
        return out

    def pending(self, reader: int) -> int:
        """How many events ``reader`` has not taken."""
        return self._first + len(self._events) - self._readers[reader]

    def _trim(self) -> None:
        low = min(self._readers.values(), default=self._first + len(self._events))
        if low > self._first:
            del self._events[: low - self._first]
            self._first = low
