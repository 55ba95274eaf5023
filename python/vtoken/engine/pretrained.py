"""One call from a checkpoint name or path to a model, its tokenizer and its end-of-sequence token.

``load_checkpoint(name_or_path)`` accepts what :func:`vtoken.checkpoints.resolve`
does: a known name (``"smollm2"``, fetched and exported once into the cache,
then loaded from the export: about 3 s on a 2-core machine instead of the
GGUF's 8 s dequantization and 15 s tokenizer conversion), a ``.gguf`` file or a
Hugging Face checkpoint directory. It lives in the engine, above
:mod:`vtoken.checkpoints`, because it builds the engine's
:class:`~vtoken.engine.model.LlamaModel`; the checkpoints package only reads
and caches files.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from vtoken.checkpoints.loader import checkpoint_eos, resolve
from vtoken.engine.model import LlamaModel


@dataclass
class Checkpoint:
    """A loaded checkpoint: ``model`` (:class:`~vtoken.engine.model.LlamaModel`), ``tokenizer``
    (:class:`~vtoken.checkpoints.tokenizer.Tokenizer`), ``eos_token_id`` and where it came from."""

    model: LlamaModel
    tokenizer: Any
    eos_token_id: Optional[int]
    source: str


def load_checkpoint(name_or_path: str, *, device="cpu", dtype=None, cache: Optional[str] = None, progress=None,
                    tokenizer: bool = True) -> Checkpoint:
    """Model, tokenizer and end-of-sequence id of a known name, a ``.gguf`` file or an HF directory
    (``tokenizer=False``: no tokenizer, which saves a GGUF's 15 s conversion when only the model is needed).
    ``eos_token_id`` is the checkpoint's (:func:`~vtoken.checkpoints.loader.checkpoint_eos`), else the tokenizer's."""
    from vtoken.checkpoints.tokenizer import Tokenizer

    path = resolve(name_or_path, cache=cache, progress=progress)
    # NOTE: the model first: its reader refuses a truncated file with a typed error, the tokenizer's does not
    model = LlamaModel.from_pretrained(path, device=device, dtype=dtype)
    tok = Tokenizer.from_checkpoint(path) if tokenizer else None
    eos = checkpoint_eos(path)
    if eos is None and tok is not None:
        eos = tok.eos_token_id
    return Checkpoint(model, tok, None if eos is None else int(eos), path)


__all__ = ["Checkpoint", "load_checkpoint"]
