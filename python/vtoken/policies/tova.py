"""TOVA: Token Omission Via Attention (Oren et al., 2024, "Transformers are Multi-State RNNs").

Source: https://arxiv.org/abs/2401.06104 (code: https://github.com/schwartz-lab-NLP/TOVA)

Definition. Once the request is over budget, at every step evict the ONE key
with the lowest attention from the last query, averaged over heads (ties: the
older token first). There is no recent window in the paper; ``window`` (default
0) adds one if wanted.

Deviation: the paper may drop the current token itself; vtoken never evicts a
token of the current step (``view.num_new``), so it is excluded.

Scores: exact, the latest ``ScoreAccumulator.update`` (``last``): the step's
mass summed over heads, whose ranking equals the mean over heads. In a decode
step that is the last query; in a multi-query step, the sum over its queries.

Prefill mode (``at="prefill"``, kvpress's form): one decision when the prompt
is complete, ranking by the prompt step's mass (the sum over the prompt's
queries, not the last query alone) and dropping the whole excess at once.

Defaults: ``budget=512`` tokens (a multi-state size in the paper's range), ``window=0``.
"""
from dataclasses import dataclass
from typing import Any

from vtoken.policies.base import EvictionPolicy, lowest, register


@register("tova")
@dataclass
class TOVA(EvictionPolicy):
    """Evict the one token the last query attended to least, once over budget."""

    score_source = "exact"
    budget: Any = 512
    window: int = 0

    device_state = ("last",)

    @property
    def max_victims_per_step(self):
        return 1 if self.at == "decode" else None  # compressing a prompt at once drops the whole excess

    def choose(self, view, candidates, n):
        cap = self.max_victims_per_step
        return lowest(candidates, view.require_scores(self.name).last(candidates), n if cap is None else min(n, cap))

    def device_priority(self, state, batch):
        return state.last[batch.mirror_pos(state.capacity)]
