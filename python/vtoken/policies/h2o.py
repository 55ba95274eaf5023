"""H2O: Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023).

Source: https://arxiv.org/abs/2306.14048 (code: https://github.com/FMInference/H2O)

Definition. Every key carries its accumulated attention: the attention
probabilities it has received, summed over all steps so far and over the query
heads of its GQA group. The cache keeps the ``window`` most recent tokens plus
the "heavy hitters": when the request is over budget, the non-recent tokens
with the lowest accumulated attention are evicted until it is within budget
(greedy, as in the paper's Algorithm 1; ties: the older token first).

Token-level adaptation: the paper keeps heavy hitters per head; vtoken evicts a
token from all heads and layers at once, so the per-head scores are summed over
kv heads too (see :mod:`vtoken.policies.scores`).

Scores: exact, from a :class:`~vtoken.policies.scores.ScoreAccumulator` fed with
``token_attention`` key scores (or, without them, ``window_key_scores`` of the
step's query).

Defaults: ``budget=0.2`` (the paper's 20% KV cache), ``window=32``.

>>> import numpy as np
>>> from vtoken.policies import get
>>> p = get("h2o", budget=3, window=1, sink=0)
>>> acc = p.make_accumulator()
>>> acc.update(np.arange(5), np.array([0.9, 0.1, 0.5, 0.2, 0.3]))
>>> p.select_victims(p.view(0, 0, np.arange(5), scores=acc))
array([1, 3])
"""
from dataclasses import dataclass
from typing import Any

from vtoken.policies.base import EvictionPolicy, lowest, register


@register("h2o")
@dataclass
class H2O(EvictionPolicy):
    """Keep the heavy hitters (highest accumulated attention) plus a recent window."""

    score_source = "exact"
    budget: Any = 0.2
    window: int = 32

    device_state = ("accumulated",)

    def choose(self, view, candidates, n):
        return lowest(candidates, view.require_scores(self.name).accumulated(candidates), n)

    def device_priority(self, state, batch):
        return state.accumulated[batch.mirror_pos(state.capacity)]
