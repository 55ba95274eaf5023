"""Victim traces: record every decision of a policy, and replay it exactly in paired runs (docs/architecture.md §7).

:class:`TraceRecorder` stands in for a policy and records each decision
(:class:`Decision`), saved as JSON; :class:`ReplayPolicy` gives back the same
victims for the same ``(request, step)`` and raises
:class:`ReplayDivergenceError` when the run leaves the trace. The paired
native / naive / vtoken runs use them so that every mode evicts the same tokens.
"""
from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import dataclass
from typing import Hashable, Iterable

import numpy as np

from vtoken.errors import InvalidArgumentError, InvalidTypeError, as_index_array, check_int
from vtoken.policies.base import EvictionPolicy, PolicyView
from vtoken.policies.ids import check_live_ids, is_member

__all__ = ["Decision", "ReplayDivergenceError", "ReplayPolicy", "TraceRecorder"]


class ReplayDivergenceError(InvalidArgumentError):
    """A replayed run asked for a decision the trace does not hold, or a recorded victim is not live."""


@dataclass(frozen=True)
class Decision:
    """One recorded decision: at ``step``, request ``request_id`` evicted ``token_ids``."""

    step: int
    request_id: Hashable
    token_ids: tuple

    def to_json(self) -> dict:
        rid = self.request_id
        if isinstance(rid, bool) or not isinstance(rid, (int, str)):
            raise InvalidTypeError(f"request_id: expected int or str for a JSON trace, got {rid!r}")
        return {"step": self.step, "request": rid, "victims": list(self.token_ids)}


class TraceRecorder:
    """Records every decision of a policy, to replay it in paired runs (docs/architecture.md §7).

    Use it in place of the policy: ``rec = TraceRecorder(policy)``; then
    ``rec.select_victims(view)`` decides, records ``(step, request, victims)``
    (empty decisions included, so a replay can check it is asked the same
    questions) and returns the victims. ``rec.save(path)`` writes JSON;
    ``TraceRecorder.load(path)`` reads it back (without a policy).

    NOTE: decisions are keyed by ``(request_id, step)``. When the modes of a
    paired run may schedule requests differently (vtoken frees memory sooner,
    so admission can differ), pass a per-request step, e.g. the request's
    ``seq_len``, rather than a global step counter.
    """

    FORMAT = "vtoken-victim-trace"
    VERSION = 1

    def __init__(self, policy: EvictionPolicy | None = None, *, meta: dict | None = None):
        self.policy = policy
        self.meta = dict(meta or {})
        if policy is not None:
            self.meta.setdefault("policy", policy.name)
            self.meta.setdefault("config", policy.config())
            self.meta.setdefault("at", policy.at)  # when it decided: a replay asks at the same steps
        self.decisions: list[Decision] = []

    def __len__(self) -> int:
        return len(self.decisions)

    @property
    def name(self) -> str:
        return self.policy.name if self.policy is not None else "trace"

    @property
    def score_source(self) -> str:
        return self.policy.score_source if self.policy is not None else "none"

    def _policy(self) -> EvictionPolicy:
        if self.policy is None:
            raise InvalidArgumentError("TraceRecorder.policy: expected a policy to record, got None (a loaded trace)")
        return self.policy

    def view(self, *args, **kwargs) -> PolicyView:
        return self._policy().view(*args, **kwargs)

    def make_accumulator(self):
        return self._policy().make_accumulator()

    def record(self, step: int, request_id: Hashable, token_ids) -> Decision:
        """Append one decision (victims are stored sorted and unique)."""
        ids = check_live_ids("token_ids", np.unique(as_index_array("token_ids", token_ids)))
        rid = int(request_id) if isinstance(request_id, np.integer) else request_id
        d = Decision(check_int("step", step), rid, tuple(int(i) for i in ids))
        self.decisions.append(d)
        return d

    def select_victims(self, view: PolicyView) -> np.ndarray:
        victims = self._policy().select_victims(view)
        self.record(view.step, view.request_id, victims)
        return victims

    def to_json(self) -> dict:
        return {"format": self.FORMAT, "version": self.VERSION, "meta": self.meta,
                "decisions": [d.to_json() for d in self.decisions]}

    def save(self, path: str | os.PathLike) -> None:
        payload = self.to_json()  # validate everything before touching the file
        with open(path, "w") as f:
            json.dump(payload, f, separators=(",", ":"))

    @classmethod
    def from_json(cls, payload: dict) -> "TraceRecorder":
        if not isinstance(payload, dict):
            raise InvalidArgumentError(f"trace: expected a JSON object, got {type(payload).__name__}")
        if payload.get("format") != cls.FORMAT:
            raise InvalidArgumentError(f"trace.format: expected {cls.FORMAT!r}, got {payload.get('format')!r}")
        if payload.get("version") != cls.VERSION:
            raise InvalidArgumentError(f"trace.version: expected {cls.VERSION}, got {payload.get('version')!r}")
        rec = cls(meta=payload.get("meta") or {})
        for i, d in enumerate(payload.get("decisions", [])):
            try:
                rec.record(d["step"], d["request"], np.asarray(d["victims"], dtype=np.int64))
            except (KeyError, TypeError) as e:
                raise InvalidArgumentError(f"trace.decisions[{i}]: expected step/request/victims, got {d!r}") from e
        return rec

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TraceRecorder":
        with open(path) as f:
            return cls.from_json(json.load(f))


class ReplayPolicy:
    """Replays a recorded trace exactly: the same victims for the same ``(request, step)``.

    Drop-in for a policy in the paired Native / Naive-Evict / vToken runs. It
    raises :class:`ReplayDivergenceError` when the run diverges from the trace:
    a ``(request, step)`` with no decision left (``strict=True``), or a recorded
    victim that is not live in the view. :meth:`check_complete` verifies at the
    end that every recorded decision was replayed.
    """

    name = "replay"
    score_source = "none"

    def __init__(self, trace: TraceRecorder | Iterable[Decision] | str | os.PathLike, *, strict: bool = True):
        if isinstance(trace, (str, os.PathLike)):
            trace = TraceRecorder.load(trace)
        decisions = trace.decisions if isinstance(trace, TraceRecorder) else list(trace)
        self.strict = bool(strict)
        self.meta = dict(trace.meta) if isinstance(trace, TraceRecorder) else {}
        self._pending: dict[tuple, deque] = {}
        for d in decisions:
            if not isinstance(d, Decision):
                raise InvalidTypeError(f"trace: expected Decision entries, got {type(d).__name__}")
            self._pending.setdefault((d.request_id, d.step), deque()).append(d)

    def view(self, request_id: Hashable, step: int, token_ids, *, seq_len: int | None = None, num_new: int = 1,
             scores=None, window_scores=None) -> PolicyView:
        ids = check_live_ids("token_ids", token_ids)
        seq_len = (int(ids[-1]) + 1 if ids.size else 0) if seq_len is None else seq_len
        return PolicyView(request_id, step, ids, seq_len, ids.size, num_new, scores, window_scores)

    def make_accumulator(self) -> None:
        return None

    def select_victims(self, view: PolicyView) -> np.ndarray:
        if not isinstance(view, PolicyView):
            raise InvalidTypeError(f"view: expected a PolicyView, got {type(view).__name__}")
        queue = self._pending.get((view.request_id, view.step))
        if not queue:
            if self.strict:
                raise ReplayDivergenceError(
                    f"replay: expected a recorded decision for request {view.request_id!r} at step {view.step}, "
                    f"got none left (the run diverged from the trace)"
                )
            return np.zeros(0, dtype=np.int64)
        victims = np.asarray(queue[0].token_ids, dtype=np.int64)
        ok = is_member(view.token_ids, victims)
        if not np.all(ok):
            raise ReplayDivergenceError(
                f"replay: expected recorded victims of request {view.request_id!r} at step {view.step} to be live, "
                f"got {victims[~ok][:8].tolist()} not live (the run diverged from the trace)"
            )
        queue.popleft()
        return victims

    def remaining(self) -> list[Decision]:
        """Recorded decisions not replayed yet."""
        return [d for q in self._pending.values() for d in q]

    def check_complete(self) -> None:
        left = self.remaining()
        if left:
            raise ReplayDivergenceError(
                f"replay: expected every recorded decision to be replayed, got {len(left)} left, first {left[0]}"
            )
