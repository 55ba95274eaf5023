"""A Llama-family decoder in plain torch over vtoken's paged, token-indexed KV cache.

RMSNorm, rotary embeddings at logical positions, grouped-query attention and a
SwiGLU MLP, with Hugging Face Llama's numerics (fp32 RMSNorm statistics, fp32
rotary angles, rotate-half convention), so that the fidelity test can compare
it token for token with ``transformers.LlamaForCausalLM``.

Weights come from a config (random, seeded: the default for tests, the demo
and the trace experiments) or from a LOCAL checkpoint directory in Hugging Face
Llama naming (``config.json`` + ``*.safetensors``). Nothing is downloaded.

Attention follows the vtoken contract (docs/architecture.md §5): each layer first
writes the step's new K/V through ``slot_mapping`` (RoPE already applied, at
the token's logical position, which never changes), then reads every live
token of each request through ``kv_indices[kv_indptr[r]:kv_indptr[r+1]]`` with
:func:`vtoken.device.ops.token_attention`. A dead token is never read, and its
neighbours keep their positions.

Example (random tiny model, one request of 3 tokens in blocks 1..)::

    >>> import torch
    >>> from vtoken.engine.model import LlamaModel, ModelConfig, StepInputs
    >>> model = LlamaModel(ModelConfig(vocab_size=128, hidden_size=64, num_heads=4, num_kv_heads=2))
    >>> caches, layout = model.allocate_kv_caches(num_blocks=4, block_size=16)
    >>> i32 = lambda v: torch.tensor(v, dtype=torch.int32)
    >>> step = StepInputs(input_ids=torch.tensor([5, 7, 9]), positions=torch.arange(3),
    ...                   slot_mapping=i32([16, 17, 18]), kv_indices=i32([16, 17, 18]),
    ...                   kv_indptr=i32([0, 3]), q_indptr=i32([0, 3]))
    >>> model(step, caches, layout).logits.shape
    torch.Size([1, 128])
"""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
from torch import nn
from torch.nn import functional as F

from vtoken.device import ops
from vtoken.engine.kv_cache import KV_LAYOUTS, allocate_kv_caches, write_kv
from vtoken.errors import InvalidArgumentError, InvalidTypeError, check_int, check_tensor
from vtoken.layout import KVLayout

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Hugging Face config keys -> ours.
_HF_ALIASES = {
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "initializer_range": "init_std",
    "torch_dtype": "dtype",
}
# Keys a Hugging Face Llama config.json carries that do not change the forward.
_HF_IGNORED = {
    "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act", "model_type",
    "transformers_version", "use_cache", "pretraining_tp", "attention_dropout", "mlp_bias",
    "output_attentions", "output_hidden_states", "return_dict", "_name_or_path", "name_or_path",
    "max_window_layers", "use_sliding_window", "sliding_window", "layer_types", "chunk_size_feed_forward",
    "is_encoder_decoder", "id2label", "label2id", "problem_type", "tokenizer_class",
}
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    """Shape and numerics of the model (Hugging Face Llama semantics).

    ``head_dim`` defaults to ``hidden_size // num_heads``. ``rope_scaling`` is
    ``None`` or a dict with ``rope_type`` in ``("default", "linear", "llama3")``
    and that type's parameters (``factor``; llama3 adds ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``). ``init_std`` and
    ``seed`` only matter for random weights.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    init_std: float = 0.02
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "max_position_embeddings"):
            setattr(self, name, check_int(name, getattr(self, name), min_value=1))
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise InvalidArgumentError(
                    f"hidden_size: expected a multiple of num_heads ({self.num_heads}), got {self.hidden_size}"
                )
            self.head_dim = self.hidden_size // self.num_heads
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 2 or self.head_dim % 2:
            raise InvalidArgumentError(f"head_dim: expected an even int >= 2 (rotary pairs), got {self.head_dim!r}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                f"num_heads: expected a multiple of num_kv_heads ({self.num_kv_heads}) for GQA, got {self.num_heads}"
            )
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0 and self.init_std > 0):
            raise InvalidArgumentError(
                f"rms_norm_eps, rope_theta, init_std: expected > 0, got "
                f"{self.rms_norm_eps}, {self.rope_theta}, {self.init_std}"
            )
        if self.dtype is None:  # HF configs leave it unset for fp32
            self.dtype = "float32"
        if isinstance(self.dtype, torch.dtype):
            self.dtype = str(self.dtype).replace("torch.", "")
        if self.dtype not in _DTYPES:
            raise InvalidArgumentError(f"dtype: expected one of {tuple(_DTYPES)}, got {self.dtype!r}")
        if self.rope_scaling is not None:
            rs = dict(self.rope_scaling)
            rope_type = rs.get("rope_type", rs.get("type", "default"))
            if rope_type not in _ROPE_TYPES:
                raise InvalidArgumentError(f"rope_scaling: expected rope_type in {_ROPE_TYPES}, got {rope_type!r}")
            rs["rope_type"] = rope_type
            rs.pop("type", None)
            self.rope_scaling = None if rope_type == "default" else rs

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, strict: bool = True) -> "ModelConfig":
        """Build from our keys or Hugging Face Llama ``config.json`` keys.

        With ``strict`` (the default), a key that is neither ours, an alias, nor
        a known no-op Hugging Face key raises, so a typo cannot go unnoticed.
        """
        if not isinstance(d, Mapping):
            raise InvalidTypeError(f"config: expected a dict, got {type(d).__name__}")
        d = dict(d)
        model_type = d.get("model_type", "llama")
        if model_type not in ("llama", "mistral"):
            raise InvalidArgumentError(f"config: expected model_type 'llama' (or 'mistral'), got {model_type!r}")
        if d.get("hidden_act", "silu") != "silu":
            raise InvalidArgumentError(f"hidden_act: expected 'silu' (SwiGLU), got {d['hidden_act']!r}")
        if d.get("mlp_bias"):
            raise InvalidArgumentError("mlp_bias: expected False (bias-free SwiGLU), got True")
        if d.get("sliding_window") and d.get("use_sliding_window", model_type == "mistral"):
            raise InvalidArgumentError(f"sliding_window: expected None (full attention), got {d['sliding_window']!r}")
        # transformers >= 5 nests rope_theta and the scaling in rope_parameters.
        rope = d.pop("rope_parameters", None)
        if isinstance(rope, Mapping):
            if "rope_theta" in rope:
                d.setdefault("rope_theta", rope["rope_theta"])
            if rope.get("rope_type", "default") != "default":
                d.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs, unknown = {}, []
        for key, value in d.items():
            name = _HF_ALIASES.get(key, key)
            if name in fields:
                kwargs[name] = value
            elif key not in _HF_IGNORED:
                unknown.append(key)
        if unknown and strict:
            raise InvalidArgumentError(f"config: expected known keys {sorted(fields)}, got unknown {sorted(unknown)}")
        return cls(**kwargs)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------- inputs / outputs
@dataclass
class StepInputs:
    """One forward over a batch: ``T`` new tokens of ``R`` requests.

    Attributes:
        input_ids: int64 ``[T]``: the new tokens, request after request.
        positions: int64 ``[T]``: their logical positions (token ids; RoPE).
        slot_mapping: int32 ``[T]``: where each new token's K/V goes (PAD -1: skip).
        kv_indices: int32 ``[nnz_max]``: every request's live slots in logical
            order (the new tokens' last), PAD past ``kv_indptr[-1]``.
        kv_indptr: int32 ``[R + 1]``.
        q_indptr: int32 ``[R + 1]`` for a prefill (varlen, causal within the
            chunk), or ``None`` for decode (exactly one new token per request,
            ``T == R``).
        logits_indices: int64 ``[R]``: the row of each request's last new token;
            ``None`` derives it on the device (``q_indptr[1:] - 1``, or
            ``arange(R)`` in decode).
        window_indices: int64 ``[W]``: rows whose queries (after RoPE) every
            layer returns in ``ModelOutput.window_queries`` (SnapKV's
            observation window); ``None`` for none.
        mirror_starts: int64 ``[>= R]`` and kv_pos: int32 ``[nnz_max]``: where
            each listed key's attention mass goes in the forward's ``score_out``
            (``mirror_starts[r] + kv_pos[j]``, the key's device-mirror position).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    kv_indices: torch.Tensor
    kv_indptr: torch.Tensor
    q_indptr: Optional[torch.Tensor] = None
    logits_indices: Optional[torch.Tensor] = None
    window_indices: Optional[torch.Tensor] = None
    mirror_starts: Optional[torch.Tensor] = None
    kv_pos: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_reqs(self) -> int:
        return self.kv_indptr.shape[0] - 1


@dataclass
class ModelOutput:
    """What a forward returns.

    Attributes:
        logits: float32 ``[R, vocab]``: each request's last new token.
        all_logits: float32 ``[T, vocab]`` when asked for (``all_logits=True``).
        key_scores: float32 ``[nnz_max, num_kv_heads]`` when asked for: row j
            is the attention probability the key at ``kv_indices[j]`` received
            in this step, SUMMED over layers, over the request's new queries and
            over the query heads of the kv head's GQA group (the aggregation
            :mod:`vtoken.policies.scores` expects: for request r the rows sum to
            ``num_layers * num_heads * n_new_r``).
        layer_key_scores: float32 ``[num_layers, nnz_max, num_kv_heads]`` when
            asked for (``key_scores="per_layer"``); ``key_scores`` is its sum.
        window_queries: ``[num_layers, W, num_heads, head_dim]`` (model dtype):
            the queries of ``StepInputs.window_indices`` after RoPE.
    """

    logits: torch.Tensor
    all_logits: Optional[torch.Tensor] = None
    key_scores: Optional[torch.Tensor] = None
    layer_key_scores: Optional[torch.Tensor] = None
    window_queries: Optional[torch.Tensor] = None


# ----------------------------------------------------------------------- layers
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: statistics in fp32, then cast back before the weight (HF LlamaRMSNorm).
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """float32 ``[head_dim // 2]`` rotary frequencies, with linear / llama3 scaling."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d))
    rs = config.rope_scaling
    if rs is None:
        return inv_freq
    factor = float(rs["factor"])
    if rs["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old_ctx = float(rs["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, step: StepInputs, kv_cache, layout, attn, want_scores: bool, window: list,
                score_out=None):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if step.window_indices is not None:
            window.append(q[step.window_indices])
        write_kv(kv_cache, layout, step.slot_mapping, k, v)
        res = attn.run(q, kv_cache, return_key_scores=want_scores, score_out=score_out)  # planned once per step
        o, scores = res if want_scores else (res, None)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim)), scores


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, step, kv_cache, layout, attn, want_scores, window, score_out=None):
        h, scores = self.self_attn(self.input_layernorm(x), cos, sin, step, kv_cache, layout, attn, want_scores,
                                   window, score_out)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), scores


# ----------------------------------------------------------------------- model
class LlamaModel(nn.Module):
    """Llama-family causal LM over a paged KV cache (see the module docstring).

    Parameter names follow Hugging Face Llama (``model.layers.0.self_attn.q_proj.weight``
    ...), so :meth:`load_hf_state_dict` is a name-for-name copy.
    """

    def __init__(self, config: ModelConfig | Mapping | None = None, *, device: torch.device | str = "cpu",
                 init_weights: bool = True):
        super().__init__()
        if config is None:
            config = ModelConfig()
        elif isinstance(config, Mapping):
            config = ModelConfig.from_dict(config)
        elif not isinstance(config, ModelConfig):
            raise InvalidTypeError(f"config: expected a ModelConfig or dict, got {type(config).__name__}")
        self.config = config
        c = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.model.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(c), persistent=False)
        if init_weights:
            self._init_random_weights()
        self.to(device=device, dtype=c.torch_dtype)
        # NOTE: inv_freq stays fp32 whatever the model dtype (HF computes the angles in fp32).
        self.inv_freq = rope_inv_freq(c).to(device)
        self.eval()

    # -- weights -----------------------------------------------------------
    @torch.no_grad()
    def _init_random_weights(self) -> None:
        """HF Llama's init (normal(0, init_std) for linears and embeddings, ones for norms), seeded."""
        gen = torch.Generator().manual_seed(self.config.seed)
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.empty(p.shape).normal_(0.0, self.config.init_std, generator=gen))

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy weights from a Hugging Face Llama state dict (names as ``LlamaForCausalLM``'s).

        Every parameter must be present (``lm_head.weight`` may be absent when
        embeddings are tied); extra keys other than rotary buffers raise.
        Validates everything before copying anything.
        """
        own = dict(self.named_parameters())
        sd = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
        if self.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
            own.pop("lm_head.weight", None)
        missing = sorted(set(own) - set(sd))
        extra = sorted(set(sd) - set(own))
        if missing or extra:
            raise InvalidArgumentError(
                f"state_dict: expected exactly the Llama parameters, got missing {missing[:6]} extra {extra[:6]}"
            )
        for name, p in own.items():
            if tuple(sd[name].shape) != tuple(p.shape):
                raise InvalidArgumentError(
                    f"state_dict[{name!r}]: expected shape {tuple(p.shape)}, got {tuple(sd[name].shape)}"
                )
        for name, p in own.items():
            p.copy_(sd[name].to(device=p.device, dtype=p.dtype))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, device: torch.device | str = "cpu",
                        dtype: str | torch.dtype | None = None) -> "LlamaModel":
        """Load a LOCAL Llama checkpoint: a Hugging Face directory (``config.json`` + ``*.safetensors``)
        or a llama.cpp ``.gguf`` file (dequantized to float32, :mod:`vtoken.checkpoints.gguf_llama`).

        ``dtype`` overrides the checkpoint's ``torch_dtype``. Nothing is downloaded.
        """
        path = os.fspath(path)
        if path.endswith(".gguf") and os.path.isfile(path):
            from vtoken.checkpoints.gguf_llama import read_gguf_llama

            ck = read_gguf_llama(path)
            cfg, state = dict(ck.config), ck.tensors
        else:
            cfg, state = cls._read_hf_dir(path)
        ck_dtype = cfg.pop("dtype", None)
        ck_dtype = cfg.pop("torch_dtype", None) or ck_dtype
        cfg["dtype"] = dtype if dtype is not None else (ck_dtype or "float32")
        model = cls(ModelConfig.from_dict(cfg, strict=False), device="cpu", init_weights=False)
        model.load_hf_state_dict(state)
        return model.to(device)

    @staticmethod
    def _read_hf_dir(path: str) -> tuple[dict, dict]:
        """``(config.json as a dict, every *.safetensors tensor)`` of a Hugging Face checkpoint directory."""
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise InvalidArgumentError(f"path: expected a local checkpoint directory with config.json, got {path!r}")
        with open(cfg_file) as f:
            cfg = json.load(f)
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise InvalidArgumentError(f"path: expected *.safetensors weights in {path!r}, got none")
        try:
            from safetensors.torch import load_file
        except ImportError as e:  # pragma: no cover - environment dependent
            raise ImportError("loading a checkpoint needs `pip install safetensors`") from e
        state = {}
        for fname in files:
            state.update(load_file(fname, device="cpu"))
        return cfg, state

    def allocate_kv_caches(self, num_blocks: int, block_size: int, *, layout: str = "nhd",
                           device: torch.device | str | None = None) -> tuple[list[torch.Tensor], KVLayout]:
        """One cache tensor per layer, in the model's dtype and on its device by default."""
        c = self.config
        device = self.lm_head.weight.device if device is None else device
        return allocate_kv_caches(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                                  layout=layout, dtype=c.torch_dtype, device=device)

    # -- forward -----------------------------------------------------------
    def _check(self, step: StepInputs, kv_caches, layout) -> None:
        """Shape / dtype / device checks only (no device sync: graph capture safe)."""
        dev = self.lm_head.weight.device
        t = step.num_tokens
        check_tensor("input_ids", step.input_ids, dtype=(torch.int64, torch.int32), ndim=1, device=dev)
        check_tensor("positions", step.positions, dtype=(torch.int64, torch.int32), shape=(t,), device=dev)
        check_tensor("slot_mapping", step.slot_mapping, dtype=(torch.int32, torch.int64), shape=(t,), device=dev)
        if step.q_indptr is None and t != step.num_reqs:
            raise InvalidArgumentError(
                f"input_ids: expected one token per request in decode (q_indptr=None), got {t} tokens "
                f"for {step.num_reqs} requests"
            )
        if step.window_indices is not None:
            check_tensor("window_indices", step.window_indices, dtype=torch.int64, ndim=1, device=dev)
        if step.logits_indices is not None:
            check_tensor("logits_indices", step.logits_indices, dtype=torch.int64, shape=(step.num_reqs,), device=dev)
        if not isinstance(layout, KVLayout) or layout.name not in KV_LAYOUTS:
            raise InvalidArgumentError(f"layout: expected a KVLayout named one of {KV_LAYOUTS}, got {layout!r}")
        if len(kv_caches) != self.config.num_layers:
            raise InvalidArgumentError(f"kv_caches: expected {self.config.num_layers} tensors, got {len(kv_caches)}")
        if layout.num_heads != self.config.num_kv_heads or layout.head_dim != self.config.head_dim:
            raise InvalidArgumentError(
                f"layout: expected {self.config.num_kv_heads} kv heads of dim {self.config.head_dim}, "
                f"got {layout.num_heads} of dim {layout.head_dim}"
            )

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, head_dim]`` at the given logical positions (fp32 angles, then ``dtype``)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(torch.float32)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.inference_mode()
    def forward(self, step: StepInputs, kv_caches: list[torch.Tensor], layout: KVLayout, *,
                all_logits: bool = False, key_scores: str = "none", score_out=None) -> ModelOutput:
        """Run one step: write the new K/V, attend over the live slots, return logits.

        Args:
            step: the batch (:class:`StepInputs`).
            kv_caches: one cache tensor per layer (:meth:`allocate_kv_caches`).
            layout: their :class:`~vtoken.layout.KVLayout`.
            all_logits: also return the logits of every new token.
            key_scores: ``"none"``, ``"sum"`` (summed over layers) or
                ``"per_layer"`` (both); see :class:`ModelOutput`.
            score_out: float32 ``[mirror_size]`` or ``None``: every listed key's
                attention mass (all layers, query heads and new queries) is
                ADDED in place at ``step.mirror_starts[r] + step.kv_pos[j]``;
                nothing per layer is kept (the device decision loop's input).

        No host sync happens here (checks are on shapes; on CUDA the index
        contents are validated only under ``VTOKEN_DEBUG_INVARIANTS=1``), so the
        decode step can be captured in a CUDA graph.
        """
        if key_scores not in ("none", "sum", "per_layer"):
            raise InvalidArgumentError(f"key_scores: expected 'none', 'sum' or 'per_layer', got {key_scores!r}")
        self._check(step, kv_caches, layout)
        want = key_scores != "none"
        x = self.model.embed_tokens(step.input_ids)
        cos, sin = self.rope(step.positions, x.dtype)
        if score_out is not None and (step.mirror_starts is None or step.kv_pos is None):
            raise InvalidArgumentError("score_out: expected step.mirror_starts and step.kv_pos with it, got None")
        c = self.config
        # One plan per step (validation, tiling, workspaces); each layer only runs it.
        attn = ops.plan_token_attention(
            layout, step.kv_indices, step.kv_indptr, step.q_indptr, num_q_heads=c.num_heads, dtype=x.dtype,
            num_q_tokens=step.num_tokens, scale=c.head_dim ** -0.5, scores=want or score_out is not None,
            mirror_starts=step.mirror_starts if score_out is not None else None,
            kv_pos=step.kv_pos if score_out is not None else None,
        )
        per_layer, window, total = [], [], None
        for layer, cache in zip(self.model.layers, kv_caches):
            x, scores = layer(x, cos, sin, step, cache, layout, attn, want, window, score_out)
            if key_scores == "per_layer":
                per_layer.append(scores)
            elif want:  # summed in place: no [layers, nnz, heads] intermediate
                total = scores if total is None else total.add_(scores)
        x = self.model.norm(x)
        idx = step.logits_indices
        if idx is None:
            if step.q_indptr is None:
                idx = torch.arange(step.num_reqs, device=x.device)
            else:
                idx = step.q_indptr[1:].to(torch.int64) - 1
        out = ModelOutput(logits=self.lm_head(x[idx]).float())
        if all_logits:
            out.all_logits = self.lm_head(x).float()
        if window:
            out.window_queries = torch.stack(window)
        if key_scores == "per_layer":
            out.layer_key_scores = torch.stack(per_layer)
            out.key_scores = out.layer_key_scores.sum(0)
        elif want:
            out.key_scores = total
        return out
