"""Shared fixtures of the embedded-engine tests: a tiny random Llama, its prompts, eager reclamation."""
from __future__ import annotations

import numpy as np

TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            init_std=0.2)
POLICY_CFG = dict(budget=0.5, window=4, sink=2)
# Always "low on memory" and a low F threshold, so reclamation runs whenever eviction leaves holes.
EAGER_RECLAIM = dict(theta_F=0.05, low_watermark=1.0, headroom_blocks=8, check_interval=1)


def prompts(lens, seed=0) -> list:
    """Random prompts of the given lengths over the tiny model's vocabulary."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY["vocab_size"], n) for n in lens]
