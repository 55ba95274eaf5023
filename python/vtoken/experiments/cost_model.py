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
from typing import Sequence

from vtoken.errors import InvalidArgumentError, check_int


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
            assumption; ``bench/gpu_check.sh`` calibrates measured / modeled).
    """

    hbm_bandwidth: float = 4.3e12
    flops_rate: float = 989e12
    mfu: float = 0.6
    step_overhead: float = 1.5e-3

    def __post_init__(self):
        for f in ("hbm_bandwidth", "flops_rate", "mfu"):
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

    def decode_seconds(self, shape: ModelShape, live_tokens: Sequence[int]) -> float:
        """A decode step: one new token per request, each attending its ``live_tokens`` (the new one included)."""
        live = [check_int("live_tokens", int(n), min_value=1) for n in live_tokens]
        return self.step_seconds(shape, new_tokens=len(live), kv_tokens_read=sum(live) - len(live),
                                 attended_pairs=sum(live))

    def prefill_seconds(self, shape: ModelShape, chunks: Sequence[tuple]) -> float:
        """A prefill step: ``(past, new)`` per request, ``new`` tokens after ``past`` live ones (causal)."""
        pairs = kv = n_new = 0
        for past, new in chunks:
            past, new = check_int("past", past), check_int("new", new, min_value=1)
            pairs += new * past + new * (new + 1) // 2
            kv += past
            n_new += new
        return self.step_seconds(shape, new_tokens=n_new, kv_tokens_read=kv, attended_pairs=pairs)
