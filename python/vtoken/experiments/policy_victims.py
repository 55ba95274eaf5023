"""Victims chosen by a real eviction policy over a real model, for ``vtoken fragmentation --policy``.

Each request's ``context`` random tokens are prefilled by the embedded
engine's runner (the model preset's random weights), in chunks, and the
policy makes ONE decision at the end of the prompt from what it saw: the
attention every key received over the whole prefill (H2O, Scissorhands,
TOVA), the last ``window`` queries' votes (SnapKV), or positions only
(StreamingLLM, Random). The decision keeps ``1 - evict_ratio`` of the
tokens, like SnapKV-style prompt compression. TOVA, by definition, evicts one
token per decision, so one decision removes a single token; its decode-time
behavior is what ``vtoken retained`` measures.

Example:
    >>> from vtoken.experiments.common import ModelSpec
    >>> from vtoken.experiments.policy_victims import policy_victims
    >>> v = policy_victims("h2o", requests=2, context=64, evict_ratio=0.5, seed=0, window=8,
    ...                    model=ModelSpec(device="cpu"))
    >>> [len(x) for x in v]
    [32, 32]
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from vtoken import cdiv
from vtoken.errors import check_int
from vtoken.experiments.common import (
    MODEL_PRESETS,
    ModelSpec,
    Progress,
    check_policy,
    kv_bytes_per_token,
    make_prompts,
    policy_config,
)

# NOTE: prefill in chunks of 256 queries: a 4096-token prompt of the tiny model took 1.6 s in chunks
# of 256 vs 2.0 s (512), 3.8 s (1024) and 7.5 s in one piece on CPU (torch reference attention,
# 1 thread), whose per-chunk score tensor is [heads, chunk, context].
PREFILL_CHUNK = 256


def peak_bytes(context: int) -> int:
    """Estimated peak memory of one request's prefill: its KV cache and the attention scores.

    The scores of a chunk are [heads, chunk, context] float32, and a few such tensors are
    alive at once in the torch reference attention (scores, probabilities, their sum): x3.
    """
    tiny = MODEL_PRESETS["tiny"]
    scores = 3 * 4 * tiny["num_heads"] * min(PREFILL_CHUNK, context)
    return context * (kv_bytes_per_token(tiny) + scores)


def make_policy(policy: str, evict_ratio: float, window: Optional[int] = None, sink: Optional[int] = None):
    """The policy that keeps ``1 - evict_ratio`` of a prompt (``None`` when nothing is evicted); validates."""
    from vtoken.errors import InvalidArgumentError
    from vtoken.policies import get

    check_policy(policy)
    if isinstance(evict_ratio, bool) or not isinstance(evict_ratio, (int, float)) or not 0 <= evict_ratio <= 1:
        raise InvalidArgumentError(f"evict_ratio: expected a value in [0, 1], got {evict_ratio!r}")
    if evict_ratio == 0:
        return None
    cfg = policy_config(policy, float(evict_ratio), window, sink)
    # A ratio budget lies in (0, 1); evicting everything means "keep only the protected tokens" (budget None).
    cfg["budget"] = None if evict_ratio == 1 else round(1.0 - float(evict_ratio), 9)
    return get(policy, **cfg)


def policy_victims(policy: str, *, requests: int, context: int, evict_ratio: float, seed: int = 0,
                   window: Optional[int] = None, sink: Optional[int] = None, model: Optional[ModelSpec] = None,
                   progress: Optional[Progress] = None) -> list:
    """Per request, the sorted logical ids (int64) ``policy`` evicts at the end of its prompt."""
    import torch

    from vtoken.engine.runner import ModelRunner, RunnerConfig
    from vtoken.policies import accumulate_batch

    check_int("requests", requests, min_value=1)
    check_int("context", context, min_value=1)
    pol = make_policy(policy, evict_ratio, window, sink)
    if pol is None:
        return [np.zeros(0, dtype=np.int64) for _ in range(requests)]
    spec = model if model is not None else ModelSpec(threads=1)
    threads = torch.get_num_threads()
    try:
        lm = spec.build()  # may set CPU threads (see configure_threads): restored below
        S = 16  # the victims are logical ids: the runner's block size does not change them
        chunk = min(PREFILL_CHUNK, context)
        runner = ModelRunner(lm, RunnerConfig(
            num_blocks=cdiv(context, S) + 2, block_size=S, max_num_reqs=1, max_num_tokens=chunk,
            key_scores="sum" if pol.score_source == "exact" else "none", cuda_graph=False))
        win = int(pol.window) if pol.score_source == "window" else 0
        prompts = make_prompts(requests, context, lm.config.vocab_size, seed)
        # Chunk bounds from the end, so the last chunk is full (SnapKV's window votes come from it).
        ends = list(range(context, 0, -chunk))[::-1]
        starts = [0] + ends[:-1]
        out = []
        for r, prompt in enumerate(prompts):
            runner.add_request(r)
            acc = pol.make_accumulator()
            res = None
            for i, (a, b) in enumerate(zip(starts, ends)):
                res = runner.prefill([r], [prompt[a:b]], window=win if i == len(ends) - 1 else 0)
                if res.key_scores is not None:
                    accumulate_batch([acc], res.token_ids, res.key_scores, res.kv_indptr)
            ws = res.window_scores[0] if res.window_scores is not None else None
            ids = runner.table.live_ids(r)
            view = pol.view(r, context, ids, seq_len=context, num_new=1, scores=acc, window_scores=ws)
            out.append(np.asarray(pol.select_victims(view), dtype=np.int64))
            runner.finish(r)
            if progress is not None:
                progress.advance()
        return out
    finally:
        torch.set_num_threads(threads)
