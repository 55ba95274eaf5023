"""Synthetic attention for the runs without a model: :class:`SyntheticAttention` (a request's
attention, which the trace-only frontier's policies score by) and :class:`SyntheticScores`, the
same behind the :class:`~vtoken.engine.trace_runner.AttentionSource` interface a
:class:`TraceRunner` asks.

A request's tokens carry a fixed salience (a few heavy hitters, many light
tokens; :class:`SyntheticAttention`). A decode
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


class SyntheticAttention:
    """A request's synthetic attention, for score-based policies in trace-only runs.

    Model: token t has a salience ``w_t ~ LogNormal(0, sigma)`` (a few heavy
    hitters, many light tokens). A query attends to each key it sees with
    probability proportional to the key's salience, times per-step noise
    ``LogNormal(0, noise)`` in decode steps. Prefill is causal: key t gets
    ``w_t * sum_{q >= t} 1 / Z_q`` from the prompt's queries, where ``Z_q``
    sums the salience of the keys query q sees; SnapKV's window votes are the
    same sum over the last ``window`` queries. One kv head (a score per key).
    """

    def __init__(self, length: int, *, seed: int, request: int, sigma: float = 1.5, noise: float = 0.5):
        self._rng = np.random.default_rng([seed, request, 0x5C0E])
        self.salience = self._rng.lognormal(0.0, sigma, length)
        self.noise = noise

    def prefill(self, n: int, window: int = 0) -> np.ndarray:
        """Scores of keys 0..n-1 from the causal queries 0..n-1 (only the last ``window`` if > 0)."""
        w = self.salience[:n]
        inv_z = 1.0 / np.cumsum(w)
        if window:
            inv_z[: max(0, n - window)] = 0.0
        return w * np.cumsum(inv_z[::-1])[::-1]

    def decode(self, ids: np.ndarray) -> np.ndarray:
        """One query's attention over the live keys ``ids`` (sums to 1)."""
        p = self.salience[ids] * self._rng.lognormal(0.0, self.noise, ids.size)
        return p / p.sum()


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
