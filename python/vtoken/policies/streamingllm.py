"""StreamingLLM: attention sinks (Xiao et al., ICLR 2024).

Source: https://arxiv.org/abs/2309.17453 (code: https://github.com/mit-han-lab/streaming-llm)

Definition. Keep the first ``sink`` tokens (the attention sinks) plus the last
``window`` tokens; evict everything in between. With the default
``budget=None`` the budget is exactly ``sink + window`` live tokens. Given an
explicit budget, the oldest non-sink tokens are evicted until the request is
within it (still never a sink or one of the last ``window`` tokens).

Positions stay logical (vtoken applies RoPE at write time), unlike the paper's
cache-relative positions; the kept set is the same.

Scores: none.

Defaults: ``sink=4`` (the paper's four sinks), ``window=1020`` (a 1024-token cache).

>>> import numpy as np
>>> from vtoken.policies import get
>>> p = get("streamingllm", sink=1, window=2)
>>> p.select_victims(p.view(0, 0, np.arange(6)))
array([1, 2, 3])
"""
from dataclasses import dataclass
from typing import Any

from vtoken.policies.base import EvictionPolicy, register


@register("streamingllm")
@dataclass
class StreamingLLM(EvictionPolicy):
    """Keep the sink tokens and the most recent window; evict the oldest others first."""

    budget: Any = None
    window: int = 1020
    sink: int = 4

    def choose(self, view, candidates, n):
        return candidates[:n]

    def device_priority(self, state, batch):
        return batch.pos.to(float)  # the oldest first

    def device_int_priority(self, state, batch):
        return None, 0  # the oldest first is the packed order
