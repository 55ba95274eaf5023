"""RequestRows: request id <-> row registry of the token table.

Rows index every per-request array (the arena's segments, live counts, the
ledger's ``owner``); they are reused after a request finishes. Each
registration gets a number of its own (:meth:`generation`), so a holder of a
stale ``(request, row)`` pair, such as a relocation plan whose request was
finished and registered again under the same id, can tell.
"""
from __future__ import annotations

import operator
from typing import Hashable

import numpy as np

from vtoken.errors import InvalidArgumentError, UnknownRequestError, check_request_id


class RequestRows:
    """Ids to rows and back; the most recently freed row is reused first."""

    def __init__(self, num_rows: int):
        self._rows: dict[Hashable, int] = {}
        self._row_req: list = [None] * num_rows
        self._free: list[int] = list(range(num_rows - 1, -1, -1))
        self._registrations = 0
        self._generation: dict[Hashable, int] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self):
        return iter(self._rows)

    def __contains__(self, req) -> bool:
        try:
            return req in self._rows
        except TypeError:
            return False

    def num_rows(self) -> int:
        return len(self._row_req)

    def requests(self) -> list:
        return list(self._rows)

    def items(self):
        return self._rows.items()

    def row_of(self, req) -> int:
        try:
            return self._rows[req]
        except (KeyError, TypeError):
            raise UnknownRequestError(f"req: expected a registered request, got {req!r}") from None

    def rows_of(self, reqs) -> np.ndarray:
        """Rows of ``reqs`` (int64), one C-level lookup pass; unknown ids raise UnknownRequestError."""
        reqs = list(reqs)
        if len(reqs) < 2:
            return np.array([self.row_of(r) for r in reqs], dtype=np.int64)
        try:
            return np.array(operator.itemgetter(*reqs)(self._rows), dtype=np.int64)
        except (KeyError, TypeError):
            for r in reqs:
                self.row_of(r)  # raises, naming the first unknown request
            raise

    def request_of(self, row: int):
        return self._row_req[row]

    def generation(self, req) -> int:
        """A number unique to this registration of ``req`` (a re-registered id gets a new one)."""
        self.row_of(req)  # raises UnknownRequestError
        return self._generation[req]

    def generations_of(self, reqs) -> np.ndarray:
        """:meth:`generation` of each of ``reqs`` (int64), -1 for an id not registered now."""
        return np.fromiter((self._generation.get(r, -1) for r in reqs), dtype=np.int64)

    def check_new(self, req) -> None:
        """Raise unless ``req`` can be registered: hashable, equal to itself, not registered."""
        # NOTE: an id that is not equal to itself (a float NaN) could never be found again.
        check_request_id("req", req)
        if req in self._rows:
            raise InvalidArgumentError(f"req: expected a new request id, got already registered {req!r}")

    def add(self, req) -> int:
        """Register checked ``req``; its row (the row space doubles when full)."""
        if not self._free:
            n = len(self._row_req)
            self._row_req.extend([None] * n)
            self._free = list(range(2 * n - 1, n - 1, -1))
        row = self._free.pop()
        self._rows[req] = row
        self._row_req[row] = req
        self._registrations += 1
        self._generation[req] = self._registrations
        return row

    def remove(self, req) -> int:
        """Forget ``req``; its row, now free."""
        row = self._rows.pop(req)
        del self._generation[req]
        self._row_req[row] = None
        self._free.append(row)
        return row

    def snapshot(self) -> dict:
        return {"rows": dict(self._rows), "generation": dict(self._generation)}
