"""What the scheduler-side connector ships to the workers each step, and what comes back."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from vtoken.errors import InvalidArgumentError


@dataclass
class VTokenConnectorMetadata(KVConnectorMetadata):
    """One step's token-table deltas, applied by every worker in this order.

    Before the forward (``handle_preemptions``):
        1. ``dropped``: requests to forget (finished or preempted);
        2. ``evictions[req]``: token ids (int64) that died since the last step;
        3. ``appends[req]``: the slots (int32, logical order) of the tokens the
           request gained: the step's new tokens (their slots equal vLLM's
           ``slot_mapping``), preceded, on a request's first step, by the
           slots of its prefix-cache hits (K/V already in the cache).
    After the forward (``wait_for_save``):
        4. ``moves[req] = (token_ids int64, new_slots int32)``: relocations the
           scheduler committed this step. The worker copies every layer's K/V
           rows from the tokens' current slots to ``new_slots`` (one
           ``compact_kv`` launch for all requests), then updates its mirror.
    """

    step: int
    dropped: list = field(default_factory=list)
    evictions: dict = field(default_factory=dict)
    appends: dict = field(default_factory=dict)
    moves: dict = field(default_factory=dict)
    want_scores: bool = False

    @property
    def num_moves(self) -> int:
        return int(sum(len(t) for t, _ in self.moves.values()))


@dataclass
class VTokenWorkerMetadata(KVConnectorWorkerMetadata):
    """Per request, the step's attention mass per live key (float32, logical order).

    Each value sums, over the layers of this worker, its KV heads and the
    query heads of their GQA groups and the step's queries, the softmax
    probability the key received. Tensor-parallel ranks hold disjoint KV
    heads, so :meth:`aggregate` sums them.
    """

    step: int
    scores: dict = field(default_factory=dict)

    def aggregate(self, other: "VTokenWorkerMetadata") -> "VTokenWorkerMetadata":
        if other.step != self.step:
            raise InvalidArgumentError(f"other.step: expected {self.step}, got {other.step}")
        out = {k: v.copy() for k, v in self.scores.items()}
        for k, v in other.scores.items():
            if k in out:
                if out[k].shape != v.shape:
                    raise InvalidArgumentError(f"scores[{k!r}]: expected shape {out[k].shape}, got {v.shape}")
                out[k] += v
            else:
                out[k] = np.array(v, copy=True)
        return VTokenWorkerMetadata(self.step, out)
