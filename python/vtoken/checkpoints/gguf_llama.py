"""A llama.cpp GGUF Llama checkpoint as Hugging Face tensors, config and tokenizer.

:func:`read_gguf_llama` dequantizes every tensor with ``gguf`` (llama.cpp's
numpy reader; any of its quant types) into float32 and renames it to the
Hugging Face Llama names. llama.cpp's converter permutes the rows of
``q_proj`` / ``k_proj`` (it interleaves each head's two rotary halves); the
reverse permutation is applied here, so the tensors are exactly the ones
``transformers`` would hold. :func:`export_hf` writes them as a standard
checkpoint directory (``config.json``, ``model.safetensors``, the tokenizer
files, ``generation_config.json``) that vtoken's engine, ``transformers``
and vLLM load.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import numpy as np

from vtoken.errors import InvalidArgumentError

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass
class GGUFLlama:
    """What :func:`read_gguf_llama` returns: HF config dict, HF-named float32 tensors, GGUF metadata."""

    config: dict
    tensors: dict
    metadata: dict


def _field_value(field):
    """A GGUF metadata field as a Python value (str, number, or list of them)."""
    import gguf

    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]].tolist()[0]


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a q/k projection ``[n_head * head_dim, hidden]``."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf_llama(path: str | os.PathLike, *, with_tensors: bool = True) -> GGUFLlama:
    """Read a GGUF Llama checkpoint (see the module docstring). ``with_tensors=False`` reads metadata only."""
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - environment dependent
        raise ImportError("reading a GGUF checkpoint needs `pip install gguf` (or vtoken[models])") from e
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise InvalidArgumentError(f"path: expected a GGUF file, got {path!r}")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError, struct.error) as e:  # gguf's errors on a truncated file
        raise InvalidArgumentError(f"path: expected a complete GGUF file, got {path!r} that cannot be read "
                                   f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    meta = {name: _field_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")
            and name not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                             "tokenizer.ggml.scores")}
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise InvalidArgumentError(f"path: expected a GGUF of architecture 'llama', got {arch!r}")
    n_head, n_kv = int(meta["llama.attention.head_count"]), int(meta["llama.attention.head_count_kv"])
    hidden = int(meta["llama.embedding_length"])
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    names = {t.name for t in reader.tensors}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // n_head)),
        "max_position_embeddings": int(meta["llama.context_length"]),
        # GGUF stores it as float32: the shortest decimal that rounds to it (1e-05, not 9.99e-06).
        "rms_norm_eps": float(f"{np.float32(meta['llama.attention.layer_norm_rms_epsilon']):g}"),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for key, ggml_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                          ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if ggml_key in meta:
            config[key] = int(meta[ggml_key])
    tensors = {}
    if with_tensors:
        import torch

        for t in reader.tensors:
            base, _, suffix = t.name.rpartition(".")
            parts = base.split(".")
            if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
                name = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
            elif base in _TOP_NAMES:
                name = f"{_TOP_NAMES[base]}.{suffix}"
            else:
                raise InvalidArgumentError(f"path: unexpected tensor {t.name!r} in a Llama GGUF")
            # NOTE: reader shapes are GGUF's (fastest dimension first); dequantize gives row-major rows.
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            w = w.reshape([int(d) for d in reversed(t.shape)]) if w.ndim != len(t.shape) else w
            if parts[-1:] == ["attn_q"]:
                w = _unpermute(w, n_head)
            elif parts[-1:] == ["attn_k"]:
                w = _unpermute(w, n_kv)
            tensors[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))
    return GGUFLlama(config, tensors, meta)


def export_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> str:
    """Write the GGUF Llama at ``gguf_path`` as a Hugging Face checkpoint directory; returns ``out_dir``.

    Weights: float32 ``model.safetensors`` (the exact dequantized values).
    Tokenizer: converted from the GGUF vocabulary, merges and chat template by
    ``transformers``' GGUF support, then saved in its standard files.
    """
    try:
        from safetensors.torch import save_file
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover - environment dependent
        raise ImportError("exporting needs `pip install transformers safetensors gguf` (or vtoken[models])") from e
    gguf_path, out_dir = os.fspath(gguf_path), os.fspath(out_dir)
    model = read_gguf_llama(gguf_path)
    os.makedirs(out_dir, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(gguf_path)),
                                        gguf_file=os.path.basename(gguf_path))
    tok.save_pretrained(out_dir)
    save_file(model.tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(model.config, f, indent=1)
    gen = {k: model.config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in model.config}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=1)
    return out_dir
