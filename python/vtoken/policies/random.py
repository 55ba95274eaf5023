"""Random eviction: the seeded baseline.

Source: the random-eviction baseline of H2O, https://arxiv.org/abs/2306.14048
(also kvpress's ``RandomPress``, https://github.com/NVIDIA/kvpress).

Definition. When the request is over budget, evict tokens drawn uniformly
without replacement from the unprotected live tokens, as many as needed.

Determinism: each token draws ``token_priority(key, token_id)`` with ``key =
request_key(seed, step, request_seed(request_id))``, a counter-based hash
(:mod:`vtoken.policies.counter_hash`), and the lowest draws are evicted (ties:
the older token). The draws are i.i.d. uniform 32-bit values, so the evicted
set is a uniform draw without replacement; a decision depends only on the
seed, the step, the request and its live ids, not on the order in which
requests are asked, and the device path computes the very same draws.

Scores: none.

Defaults: ``budget=0.5``, ``window=0``, ``seed=0``.
"""
from dataclasses import dataclass
from typing import Any

import numpy as np

from vtoken.errors import InvalidArgumentError, check_int
from vtoken.policies.base import EvictionPolicy, lowest, register, request_seed
from vtoken.policies.counter_hash import request_key, token_priority


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
        key = request_key(self.seed, view.step, request_seed(view.request_id))
        return lowest(candidates, token_priority(key, candidates).astype(np.float64), n)

    def device_priority(self, state, batch):
        return self.device_int_priority(state, batch)[0].double()

    def device_int_priority(self, state, batch):
        if batch.step is None or batch.request_seed is None:
            raise InvalidArgumentError("batch.step/request_seed: expected per-request tensors for random, got None")
        key = batch.per_entry(request_key(self.seed, batch.step, batch.request_seed), 0)
        return token_priority(key, batch.pos), 32  # a 32-bit draw per token
