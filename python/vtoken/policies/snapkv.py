"""SnapKV: "LLM Knows What You are Looking for Before Generation" (Li et al., NeurIPS 2024).

Source: https://arxiv.org/abs/2404.14469 (code: https://github.com/FasterDecoding/SnapKV)

Definition. Once, at the end of prefill, the queries of the last ``window``
prompt tokens (the observation window) vote on the prompt keys before it: each
key's vote is the attention those queries give it, summed over the window's
queries. The votes are pooled along the sequence (kernel ``kernel``, stride 1,
padding ``kernel // 2``; ``avgpool`` as in the public code's default, which
counts the zero padding, or ``maxpool``) so that neighbours of a strong key
survive with it. Keep the ``budget - window`` best-voted prefix keys plus the
observation window; evict the rest. Decode steps evict nothing.

Token-level adaptation: the paper selects per head; vtoken pools each kv head's
votes (summed over its GQA group) and sums the pooled votes over kv heads. With
``avgpool`` this equals pooling each query head, since both steps are linear.

Scores: window. The caller computes ``view.window_scores`` once with
:func:`vtoken.policies.scores.window_key_scores` (the last ``window`` queries
against the live keys) and builds that view with ``num_new=1``; a view without
window scores (a decode step) yields no victims.

Device path: :meth:`SnapKV.record_votes_device` pools a batch's window votes
into the per-token ``votes`` state on the step the window votes
(``batch.window_step``); only those requests evict, by the same ranking.

Defaults (the public code's): ``budget=2048`` tokens, ``window=32``,
``kernel=5``, ``pooling="avgpool"``; ``at="prefill"``, the only mode SnapKV has.
"""
from dataclasses import dataclass
from typing import Any

import numpy as np

from vtoken.errors import InvalidArgumentError, check_int
from vtoken.policies.base import EvictionPolicy, lowest, register


@register("snapkv")
@dataclass
class SnapKV(EvictionPolicy):
    """Keep the prompt keys the observation window votes for (pooled), plus the window."""

    score_source = "window"
    budget: Any = 2048
    window: int = 32
    kernel: int = 5
    pooling: str = "avgpool"
    at: str = "prefill"
    at_modes = ("prefill",)  # its votes come from the prompt's last window
    device_state = ("votes",)

    def __post_init__(self):
        super().__post_init__()
        if check_int("snapkv.kernel", self.kernel, min_value=1) % 2 == 0:
            raise InvalidArgumentError(f"snapkv.kernel: expected an odd size (same-length pooling), got {self.kernel}")
        if self.pooling not in ("avgpool", "maxpool"):
            raise InvalidArgumentError(f"snapkv.pooling: expected 'avgpool' or 'maxpool', got {self.pooling!r}")

    def choose(self, view, candidates, n):
        if view.window_scores is None:
            return candidates[:0]
        prefix = view.token_ids < self.recent_start(view)
        pad, fill = self.kernel // 2, (0.0 if self.pooling == "avgpool" else -np.inf)
        votes = view.window_scores[prefix].T
        if self.pooling == "avgpool":  # linear: summing the heads first gives the same pooled sum, H times cheaper
            votes = votes.sum(0, keepdims=True)
        votes = np.pad(votes, ((0, 0), (pad, pad)), constant_values=fill)
        win = np.lib.stride_tricks.sliding_window_view(votes, self.kernel, axis=-1)
        pooled = (win.mean(-1) if self.pooling == "avgpool" else win.max(-1)).sum(0)
        return lowest(candidates, pooled[np.searchsorted(view.token_ids[prefix], candidates)], n)

    def record_votes_device(self, state, batch, window_scores):
        """Pool ``window_scores`` float [nnz_max, H] (rows as kv_pos) into ``state.votes`` (window-step requests)."""
        from vtoken.policies.device import segmented_pool

        prefix = (batch.pos < batch.recent_start(self.window)) & batch.per_entry(self.device_active(batch), False)
        votes = window_scores.double().reshape(batch.nnz_max, -1)
        if self.pooling == "avgpool":  # linear: heads first, as choose
            votes = votes.sum(1, keepdim=True)
        pooled = segmented_pool(votes, prefix & batch.valid, batch.req, self.kernel, self.pooling).sum(1)
        state.votes.index_copy_(0, batch.mirror_pos(state.capacity).where(prefix, state.capacity), pooled)

    def device_active(self, batch):  # only the requests whose window votes this step evict; decode steps none
        none = batch.seq_len.new_zeros(batch.seq_len.shape, dtype=bool)
        return batch.window_step if batch.window_step is not None else none

    def device_priority(self, state, batch):
        return state.votes[batch.mirror_pos(state.capacity)]
