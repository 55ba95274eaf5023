"""A roofline model of one engine step on an H200: the modeled clock of ``vtoken sla --cost-model h200``.

One step (one forward over a batch) reads every weight once and the K/V of
every token it attends, and performs the matmul and attention FLOPs of its
new tokens. On a GPU these overlap, so the step takes the longer of the two,
plus a fixed per-step overhead (scheduling, the sampler, launches)::

    t_step = max(bytes / hbm_bandwidth, flops / flops_rate) + step_overhead
    bytes  = weight_bytes + kv_bytes_per_token * (attended + new tokens)
    flops  = 2 * matmul_params * new_tokens + 4 * layers * q_heads * head_dim * attended_pairs

``attended_pairs`` counts (query, key) pairs: a decode query attends its
request's live tokens; a prefill chunk of ``n`` new tokens after ``p`` live
ones attends ``n * p + n * (n + 1) / 2`` pairs (causal).

The point of the model: on an H200 a decode step is memory-bound and the
weights dominate its bytes, so a bigger batch costs little; vtoken's effect
(more requests fit) shows up as throughput at a latency SLA, which a CPU,
where every extra request costs compute, cannot show. Only the clock is
modeled; the decisions, memory and scheduling stay real.

Example (the 8B shape at batch 64, every request attending 4,096 tokens)::

    >>> m = ModelShape.llama_8b()
    >>> t = H200Roofline().decode_seconds(m, [4096] * 64)
    >>> round(t * 1e3, 2)   # ms: 15 GB of weights + 64 x 4,096 x 128 KiB of KV at 4.3 TB/s, + 1.5 ms
    12.98
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from vtoken.errors import InvalidArgumentError, InvalidTypeError, as_index_array, check_int


def check_memory_utilization(value) -> float:
    """vLLM's ``gpu_memory_utilization``: a number in (0, 1] (a typed error naming it otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise InvalidArgumentError(f"memory_utilization: expected a value in (0, 1], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-family decoder that set a step's bytes and FLOPs (bf16 weights and KV)."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool = False
    dtype_bytes: int = 2

    def __post_init__(self):
        for f in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                  "vocab_size", "dtype_bytes"):
            check_int(f, getattr(self, f), min_value=1)
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgumentError(f"num_heads: expected a multiple of num_kv_heads={self.num_kv_heads}, "
                                       f"got {self.num_heads}")

    @classmethod
    def llama_8b(cls) -> "ModelShape":
        """Llama-3-8B's shape (32 layers, GQA 32/8, head_dim 128, FFN 14,336, vocab 128,256)."""
        return cls("llama-8b", 32, 4096, 14336, 32, 8, 128, 128256)

    @classmethod
    def mistral_7b(cls) -> "ModelShape":
        """Mistral-7B's shape (32 layers, GQA 32/8, head_dim 128, FFN 14,336, vocab 32,000)."""
        return cls("mistral-7b", 32, 4096, 14336, 32, 8, 128, 32000)

    @property
    def layer_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d + 2 * h * self.num_kv_heads * d + self.num_heads * d * h
        return attn + 3 * h * self.intermediate_size + 2 * h  # + the two RMSNorm weights

    @property
    def matmul_params(self) -> int:
        """Weights every new token multiplies through: the layers and the LM head (not the embedding lookup)."""
        return self.num_layers * self.layer_params + self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        embed = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return self.matmul_params + embed + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        """Bytes one step reads once: every weight but the embedding table (only the batch's rows are read)."""
        return (self.matmul_params + self.hidden_size) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class H200Roofline:
    """A roofline of one engine step on one NVIDIA H200 SXM (141 GB HBM3e).

    Attributes (and where they come from):
        hbm_bandwidth: bytes/s the step streams at. 4.3e12: the device-to-device
            copy bandwidth measured on an H200, ~90% of its 4.8 TB/s datasheet
            peak (NVIDIA H200 Tensor Core GPU datasheet, 2024).
        flops_rate: dense bf16 tensor FLOP/s. 989e12: the datasheet's dense
            (non-sparse) BF16 Tensor Core rate for the H200 SXM, derated by
            ``mfu``.
        mfu: the fraction of ``flops_rate`` a step's matmuls reach (0.6: what
            large prefill GEMMs typically reach; decode is memory-bound and
            does not depend on it).
        step_overhead: seconds per step outside the roofline: scheduling,
            sampling and the launch of a captured CUDA graph (1.5e-3: an
            assumption; ``bench/bench_cost_model.py`` on a GPU calibrates measured / modeled).
        hbm_bytes: the HBM capacity, 141e9 (the datasheet's 141 GB); with
            :meth:`kv_blocks` it sizes the KV cache a server would get.
    """

    hbm_bandwidth: float = 4.3e12
    flops_rate: float = 989e12
    mfu: float = 0.6
    step_overhead: float = 1.5e-3
    hbm_bytes: float = 141e9

    def __post_init__(self):
        for f in ("hbm_bandwidth", "flops_rate", "mfu", "hbm_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise InvalidArgumentError(f"{f}: expected a number > 0, got {v!r}")
        if not 0 < self.mfu <= 1:
            raise InvalidArgumentError(f"mfu: expected a value in (0, 1], got {self.mfu!r}")
        if isinstance(self.step_overhead, bool) or not isinstance(self.step_overhead, (int, float)) \
                or self.step_overhead < 0:
            raise InvalidArgumentError(f"step_overhead: expected seconds >= 0, got {self.step_overhead!r}")

    def step_seconds(self, shape: ModelShape, *, new_tokens: int, kv_tokens_read: int, attended_pairs: int) -> float:
        """Modeled seconds of one step: ``new_tokens`` computed, ``kv_tokens_read`` K/V rows read (each
        request's live tokens once), ``attended_pairs`` (query, key) pairs scored."""
        new_tokens = check_int("new_tokens", new_tokens)
        kv_tokens_read = check_int("kv_tokens_read", kv_tokens_read)
        attended_pairs = check_int("attended_pairs", attended_pairs)
        if new_tokens == 0:
            return 0.0
        nbytes = shape.weight_bytes + shape.kv_bytes_per_token * (kv_tokens_read + new_tokens)
        flops = 2 * shape.matmul_params * new_tokens \
            + 4 * shape.num_layers * shape.num_heads * shape.head_dim * attended_pairs
        return max(nbytes / self.hbm_bandwidth, flops / (self.flops_rate * self.mfu)) + self.step_overhead

    def batch_seconds(self, shape: ModelShape, past, new) -> float:
        """Any step (decode, prefill, or both mixed): request ``i`` computes ``new[i]`` tokens after the
        ``past[i]`` live ones it held, every new token attending those and the new ones before it (causal)."""
        past, new = as_index_array("past", past), as_index_array("new", new)
        if past.shape != new.shape:
            raise InvalidArgumentError(f"new: expected {past.size} counts (one per request, as past), got {new.size}")
        if new.size and new.min() < 1:
            raise InvalidArgumentError(f"new: expected counts >= 1, got {int(new.min())}")
        if past.size and past.min() < 0:
            raise InvalidArgumentError(f"past: expected counts >= 0, got {int(past.min())}")
        pairs = int((new * past + new * (new + 1) // 2).sum())
        return self.step_seconds(shape, new_tokens=int(new.sum()), kv_tokens_read=int(past.sum()),
                                 attended_pairs=pairs)

    def decode_seconds(self, shape: ModelShape, live_tokens: Sequence[int]) -> float:
        """A decode step: one new token per request, each attending its ``live_tokens`` (the new one included)."""
        live = as_index_array("live_tokens", live_tokens)
        if live.size and live.min() < 1:
            raise InvalidArgumentError(f"live_tokens: expected counts >= 1, got {int(live.min())}")
        return self.batch_seconds(shape, live - 1, np.ones_like(live))

    def prefill_seconds(self, shape: ModelShape, chunks: Sequence[tuple]) -> float:
        """A prefill step: ``(past, new)`` per request, ``new`` tokens after ``past`` live ones (causal)."""
        chunks = [(check_int("past", p), check_int("new", n, min_value=1)) for p, n in chunks]
        return self.batch_seconds(shape, [p for p, _ in chunks], [n for _, n in chunks])

    def kv_blocks(self, shape: ModelShape, block_size: int, *, memory_utilization: float = 0.9) -> int:
        """KV blocks of ``block_size`` tokens a server gets: ``hbm_bytes x memory_utilization - weights``.

        ``memory_utilization`` is vLLM's ``gpu_memory_utilization`` (default
        0.9): the share of the HBM the server may use, its bf16 weights
        included (activations and the CUDA context are not modeled).
        """
        check_int("block_size", block_size, min_value=1)
        check_memory_utilization(memory_utilization)
        free = self.hbm_bytes * memory_utilization - shape.params * shape.dtype_bytes
        if free <= 0:
            raise InvalidArgumentError(f"memory_utilization: expected room for {shape.name}'s "
                                       f"{shape.params * shape.dtype_bytes} bytes of weights in "
                                       f"{memory_utilization!r} x {self.hbm_bytes:.3g} bytes of HBM, got none")
        return int(free // (shape.kv_bytes_per_token * block_size))


class ModeledClock:
    """Time advanced by the roofline instead of the wall clock: ``now`` grows by each step's modeled seconds.

    Example (two decode steps of the 8B shape, 2 requests attending 1,000 and 3,000 tokens)::

        >>> clock = ModeledClock(ModelShape.llama_8b())
        >>> for _ in range(2):
        ...     _ = clock.advance([999, 2999], [1, 1])
        >>> clock.now == 2 * H200Roofline().decode_seconds(ModelShape.llama_8b(), [1000, 3000]), clock.steps
        (True, 2)
    """

    def __init__(self, shape: ModelShape, roofline: Optional[H200Roofline] = None):
        if not isinstance(shape, ModelShape):
            raise InvalidTypeError(f"shape: expected a ModelShape, got {type(shape).__name__}")
        roofline = H200Roofline() if roofline is None else roofline
        if not isinstance(roofline, H200Roofline):
            raise InvalidTypeError(f"roofline: expected an H200Roofline, got {type(roofline).__name__}")
        self.shape, self.roofline = shape, roofline
        self.now = 0.0
        self.steps = 0

    def advance(self, past, new) -> float:
        """Add one step (:meth:`H200Roofline.batch_seconds` of ``past`` / ``new``); returns its seconds."""
        dt = self.roofline.batch_seconds(self.shape, past, new)
        self.now += dt
        self.steps += 1
        return dt
