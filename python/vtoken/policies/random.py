"""Random eviction: the seeded baseline.

Source: the random-eviction baseline of H2O, https://arxiv.org/abs/2306.14048
(also kvpress's ``RandomPress``, https://github.com/NVIDIA/kvpress).

Definition. When the request is over budget, evict tokens drawn uniformly
without replacement from the unprotected live tokens, as many as needed.

Determinism: the draw uses ``numpy.random.default_rng([seed, step,
request_seed(request_id)])``, so a decision depends only on the seed, the step,
the request and its live ids, not on the order in which requests are asked.

Scores: none.

Defaults: ``budget=0.5``, ``window=0``, ``seed=0``.
"""
from dataclasses import dataclass
from typing import Any

import numpy as np

from vtoken.errors import check_int
from vtoken.policies.base import EvictionPolicy, register, request_seed


@register("random")
@dataclass
class RandomPolicy(EvictionPolicy):
    """Evict uniformly random unprotected tokens (seeded per request and step)."""

    budget: Any = 0.5
    window: int = 0
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        self.seed = check_int("random.seed", self.seed)

    def choose(self, view, candidates, n):
        rng = np.random.default_rng([self.seed, view.step, request_seed(view.request_id)])
        return rng.choice(candidates, size=n, replace=False)
