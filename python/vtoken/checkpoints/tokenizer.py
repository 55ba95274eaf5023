"""Text in, token ids out, and back: a checkpoint's own tokenizer and chat template.

:class:`Tokenizer` wraps the ``transformers`` tokenizer a checkpoint ships
(a Hugging Face directory's tokenizer files, or the vocabulary, merges and
chat template inside a GGUF file) behind the three calls an engine needs:

- ``encode(prompt)``: a string is tokenized as is; a list of chat messages
  (``{"role": ..., "content": ...}``) goes through the checkpoint's chat
  template with the assistant's turn opened, as a chat server does;
- ``decode(ids)``: text, special tokens left out, cut at the first
  end-of-sequence token;
- ``eos_token_id``.

Example (needs the ``models`` extra and a checkpoint directory)::

    tok = Tokenizer.from_checkpoint("path/to/hf-dir")
    ids = tok.encode([{"role": "user", "content": "Name three rivers."}])
    text = tok.decode(engine_output_ids)
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Union

import numpy as np

from vtoken.errors import InvalidArgumentError, InvalidTypeError

Prompt = Union[str, Sequence[dict]]


def is_text_prompt(prompt) -> bool:
    """True for a string or a list of chat messages (what :meth:`Tokenizer.encode` takes), False for token ids."""
    if isinstance(prompt, str):
        return True
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(m, dict) for m in prompt)


ROLES = ("system", "user", "assistant", "tool")  # the chat roles Llama-family templates know


def check_text(arg: str, text: str) -> str:
    """``text`` if it is valid Unicode text (encodable as UTF-8), else a typed error naming ``arg``.

    NOTE: a Python str can hold a lone surrogate (e.g. from a JSON ``"\\ud800"``); the tokenizer
    fails on it deep inside with an untyped error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(f"{arg}: expected valid Unicode text, got a lone surrogate "
                                   f"{text[e.start]!r} at index {e.start}") from None
    return text


def check_messages(arg: str, messages) -> list:
    """``messages`` as a list of ``{"role": str, "content": str}`` dicts, or a typed error naming ``arg``."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidArgumentError(f"{arg}: expected a non-empty list of chat messages, got {messages!r:.80}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidArgumentError(f"{arg}[{i}]: expected {{'role': str, 'content': str}}, got {m!r:.80}")
        if m["role"] not in ROLES:
            raise InvalidArgumentError(f"{arg}[{i}].role: expected one of {ROLES}, got {m['role']!r:.40}")
        out.append({"role": m["role"], "content": check_text(f"{arg}[{i}].content", m["content"])})
    return out


class Tokenizer:
    """A checkpoint's tokenizer (see module docstring). Build it with :meth:`from_checkpoint`."""

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        eos = getattr(hf_tokenizer, "eos_token_id", None)
        self.eos_token_id: Optional[int] = None if eos is None else int(eos)
        self.vocab_size = len(hf_tokenizer)

    @classmethod
    def from_checkpoint(cls, path: Union[str, os.PathLike]) -> "Tokenizer":
        """The tokenizer of a Hugging Face checkpoint directory or of a ``.gguf`` file.

        NOTE: reading it from a GGUF converts the vocabulary in ``transformers``
        (about 15 s for SmolLM2 on a 2-core machine); :func:`vtoken.checkpoints.resolve`
        caches a known checkpoint's converted tokenizer next to its file.
        """
        try:
            from transformers import AutoTokenizer
        except ImportError as e:  # pragma: no cover - environment dependent
            raise ImportError("a tokenizer needs `pip install transformers` (or vtoken[models])") from e
        path = os.fspath(path)
        if path.endswith(".gguf") and os.path.isfile(path):
            full = os.path.abspath(path)
            return cls(AutoTokenizer.from_pretrained(os.path.dirname(full), gguf_file=os.path.basename(full)))
        if not os.path.isdir(path):
            raise InvalidArgumentError(f"path: expected a checkpoint directory or a .gguf file, got {path!r}")
        return cls(AutoTokenizer.from_pretrained(path))

    def encode(self, prompt: Prompt, *, arg: str = "prompt") -> np.ndarray:
        """Token ids (int64) of a string, or of chat messages through the chat template (assistant turn open);
        errors name ``arg``."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgumentError(f"{arg}: expected a non-empty string, got ''")
            ids = self.hf(check_text(arg, prompt))["input_ids"]
        elif is_text_prompt(prompt):
            if getattr(self.hf, "chat_template", None) is None:
                raise InvalidArgumentError(f"{arg}: expected a string (this checkpoint has no chat template), "
                                           "got chat messages")
            ids = self.hf.apply_chat_template(check_messages(arg, prompt), add_generation_prompt=True,
                                              tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            raise InvalidTypeError(f"{arg}: expected a string or a list of chat messages, got {type(prompt).__name__}"
                                   + (" (decode bytes to str first)" if isinstance(prompt, (bytes, bytearray)) else ""))
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids) -> str:
        """Text of ``ids`` up to the first end-of-sequence token, special tokens left out."""
        ids = [int(t) for t in np.asarray(ids, dtype=np.int64).reshape(-1)]
        if self.eos_token_id is not None and self.eos_token_id in ids:
            ids = ids[: ids.index(self.eos_token_id)]
        return self.hf.decode(ids, skip_special_tokens=True)

    def save(self, out_dir: Union[str, os.PathLike]) -> None:
        """Write the tokenizer's standard files (``from_checkpoint(out_dir)`` reads them back)."""
        self.hf.save_pretrained(os.fspath(out_dir))
