"""The eviction half of an engine step: after each forward, the policy decides for the batch.

Two paths (``EngineConfig.decision``), the same decisions:

* **device** (a :class:`~vtoken.decisions.loop.DecisionLoop`): the whole batch
  decides on the device with no host sync; the host applies the victims at the
  START of the next step (:meth:`StepEviction.apply_device_victims`), one step
  late, and records them in the trace under the deciding step's ``seq_len``;
* **host** (numpy, the baseline and oracle): key scores go to each request's
  :class:`~vtoken.policies.scores.ScoreAccumulator` and the policy decides per
  request, evicted at once.

Who decides (``EvictionPolicy.decision_plan``): at ``"decode"`` every request
of the step, at ``"prefill"`` only those whose prompt the step completes. On
top of that, no request decides inside its prompt: a chunked prefill's
mid-prompt request (``mid``) evicts nothing and its key masses are held
(``DecisionLoop.decide(defer=)``, ``ScoreAccumulator.defer``) for the step that
completes the prompt, which sees the whole prompt as its new tokens, as an
unchunked prefill does. A finished request decides nothing either.
"""
from __future__ import annotations

import numpy as np

from vtoken.policies import accumulate_batch, decision_plan

__all__ = ["StepEviction"]


class StepEviction:
    """Runs a step's eviction decisions for an engine (see the module docstring).

    Args:
        policy: the engine's policy (an ``EvictionPolicy``, ``TraceRecorder`` or ``ReplayPolicy``).
        decisions: the engine's :class:`~vtoken.decisions.loop.DecisionLoop`, or ``None`` (host path).
        trace: the :class:`~vtoken.policies.TraceRecorder` that records device decisions, or ``None``.
        runner: the engine's :class:`~vtoken.engine.runner.ModelRunner` (its table, slot lists, ``evict``).
        decides_at: ``"decode"`` or ``"prefill"`` (``EvictionPolicy.at``; a replay's from its trace).
    """

    def __init__(self, policy, decisions, trace, runner, decides_at: str):
        self.policy = policy
        self.decisions = decisions
        self.trace = trace
        self.runner = runner
        self.decides_at = decides_at

    def apply_device_victims(self) -> int:
        """Apply the device's decisions whose copy completed (one step late); returns the victims applied."""
        if self.decisions is None:
            return 0
        applied = self.decisions.drain()
        if self.trace is not None:
            for rec in applied:
                for rid, seq_len, ids in rec.decisions():
                    self.trace.record(seq_len, rid, ids)
        return sum(rec.num_victims for rec in applied)

    def decide(self, batch: list, res, num_new, *, finished, mid, prompt_done) -> int:
        """Decide for ``batch`` (``(request, chunk)`` pairs, as run) after its forward ``res``.

        ``num_new``: int per request, the step's new tokens as the policy sees
        them (a completed prompt whole); ``finished`` / ``mid`` / ``prompt_done``:
        bool per request. Returns the victims evicted now (the host path; the
        device path's arrive with :meth:`apply_device_victims`).
        """
        if self.decisions is not None:  # the loop applies the same plan on the device
            n = len(batch)
            table = self.runner.table
            seq_lens = np.fromiter((table.num_tokens(r.request_id) for r, _ in batch), dtype=np.int64, count=n)
            self.decisions.decide([r.request_id for r, _ in batch], self.runner.slot_lists, seq_lens=seq_lens,
                                  num_new=num_new, done=finished, defer=mid, prompt_done=prompt_done,
                                  window_scores=res.window_votes)
            return 0
        decides, num_new = decision_plan(self.decides_at, num_new, prompt_done)
        return self._on_host(batch, res, num_new, decides & ~finished & ~mid, mid)

    def _on_host(self, batch: list, res, num_new, decides, mid) -> int:
        if res.key_scores is not None:
            accumulate_batch([r.accumulator for r, _ in batch], res.token_ids, res.key_scores, res.kv_indptr,
                             defer=mid)
        table, evicted = self.runner.table, 0
        for i, (r, _) in enumerate(batch):
            if not decides[i]:
                continue
            rid = r.request_id
            ids = table.live_ids(rid)
            seq_len = table.num_tokens(rid)
            window_scores = res.window_scores[i] if res.window_scores is not None else None
            view = self.policy.view(rid, seq_len, ids, seq_len=seq_len, num_new=int(num_new[i]),
                                    scores=r.accumulator, window_scores=window_scores)
            victims = self.policy.select_victims(view)
            if len(victims):
                self.runner.evict(rid, victims)
                evicted += len(victims)
        return evicted
