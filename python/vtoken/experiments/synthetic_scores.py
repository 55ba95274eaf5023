"""Synthetic attention for trace engines: the frontier's :class:`SyntheticAttention` behind the
:class:`~vtoken.engine.trace_runner.AttentionSource` interface a :class:`TraceRunner` asks.

A request's tokens carry a fixed salience (a few heavy hitters, many light
tokens; :class:`~vtoken.experiments.frontier.SyntheticAttention`). A decode
query attends its live keys in proportion to their salience times per-step
noise (``SyntheticAttention.decode``). A chunk of ``n`` new queries after
``p`` listed keys attends causally: query ``j`` spreads a unit of mass over the
``p`` earlier keys and the new keys up to itself, in proportion to salience;
with no earlier keys this is exactly ``SyntheticAttention.prefill``
(tests/test_trace_runner.py checks it bit for bit).

Example::

    >>> import numpy as np
    >>> src = SyntheticScores(length=16, seed=0)(3)        # request 3's source
    >>> s = src.scores(np.arange(8), num_new=8)            # a prompt of 8: every query's unit of mass
    >>> round(float(s.sum()), 9)
    8.0
"""
from __future__ import annotations

import numpy as np

from vtoken.errors import InvalidArgumentError, check_int, is_int
from vtoken.experiments.frontier import SyntheticAttention


class SyntheticScores:
    """``request_id -> AttentionSource`` over :class:`SyntheticAttention` (a TraceRunner's ``attention``).

    Args:
        length: the most tokens a request reaches (its salience is drawn for them).
        seed: seeds every request's salience and decode noise (with the request id).
    """

    def __init__(self, *, length: int, seed: int = 0):
        self.length = check_int("length", length, min_value=1)
        self.seed = check_int("seed", seed)

    def __call__(self, request_id) -> "RequestScores":
        if not is_int(request_id) or request_id < 0:
            raise InvalidArgumentError(f"request_id: expected an int >= 0 (it seeds the salience), got {request_id!r}")
        return RequestScores(SyntheticAttention(self.length, seed=self.seed, request=int(request_id)))


class RequestScores:
    """One request's synthetic attention (see the module docstring)."""

    def __init__(self, attention: SyntheticAttention):
        self.attention = attention

    def scores(self, key_ids: np.ndarray, num_new: int, window: int = 0) -> np.ndarray:
        """float64 ``[len(key_ids)]``: the mass the last ``num_new`` keys (the queries) give each listed key."""
        key_ids = np.asarray(key_ids)
        if key_ids.size and key_ids[-1] >= self.attention.salience.size:
            raise InvalidArgumentError(f"key_ids: expected ids below the request's length "
                                       f"{self.attention.salience.size}, got {int(key_ids[-1])}")
        if num_new == 1 and not window:
            return self.attention.decode(key_ids)
        w = self.attention.salience[key_ids]
        past = key_ids.size - num_new
        inv_z = 1.0 / (w[:past].sum() + np.cumsum(w[past:]))  # query j's normalizer: every key it sees
        if window:
            inv_z[: max(0, num_new - window)] = 0.0
        tail = np.cumsum(inv_z[::-1])[::-1]  # tail[j]: what the queries from j on give a key they all see
        out = w.copy()
        out[:past] *= tail[0] if num_new else 0.0
        out[past:] *= tail
        return out
