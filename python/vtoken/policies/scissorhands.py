"""Scissorhands (Liu et al., NeurIPS 2023): persistence of importance.

Source: https://arxiv.org/abs/2305.17118

Definition. Over a history window of the last ``history`` steps, count for each
key how often its attention fell below the uniform share ``1 / num_keys`` (a
"low" record). When the request is over budget, evict the non-recent keys with
the highest fraction of low records (low records / steps the key was present in
the history window; ties: the older token first). The ``window`` most recent
tokens are protected.

Token-level adaptation: the paper counts per head; vtoken evicts a token from
all heads at once, so a step's record compares the token's attention averaged
over all (query, head) pairs with ``1 / n_live`` (see
:mod:`vtoken.policies.scores`). Dividing by the steps a key was present keeps
young keys comparable with old ones.

Scores: exact, from ``make_accumulator()`` (a ScoreAccumulator whose ring keeps
``history`` steps) fed once per step.

Defaults: ``budget=0.5``, ``window=32``, ``history=64``.
"""
from dataclasses import dataclass
from typing import Any

from vtoken.errors import InvalidArgumentError, check_int
from vtoken.policies.base import EvictionPolicy, lowest, register


@register("scissorhands")
@dataclass
class Scissorhands(EvictionPolicy):
    """Evict the keys whose attention was most often below 1/n over the history window."""

    score_source = "exact"
    budget: Any = 0.5
    window: int = 32
    history: int = 64
    device_state = ("low",)

    def __post_init__(self):
        super().__post_init__()
        self.history = check_int("scissorhands.history", self.history, min_value=1)

    def choose(self, view, candidates, n):
        acc = view.require_scores(self.name)
        if acc.history != self.history:
            raise InvalidArgumentError(
                f"view.scores.history: expected {self.history} (use policy.make_accumulator()), got {acc.history}"
            )
        return lowest(candidates, -acc.low_fraction(candidates), n)

    def device_priority(self, state, batch):
        return -state.low_fraction(batch.mirror_pos(state.capacity))
