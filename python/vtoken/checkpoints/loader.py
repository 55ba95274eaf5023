"""From a checkpoint name or path to a local checkpoint, checked, and its end-of-sequence token.

``resolve(name_or_path)`` accepts:

- a :data:`~vtoken.checkpoints.fetch.KNOWN` name (``"smollm2"``): the GGUF is
  fetched once (:func:`~vtoken.checkpoints.fetch.fetch`), exported once to a
  Hugging Face directory next to it in the cache (``<cache>/models/<name>/hf``,
  written to a temporary directory and renamed, so a cached export is always
  complete), and that directory is returned: loading it takes about 3 s on a
  2-core machine instead of the GGUF's 8 s dequantization and 15 s tokenizer
  conversion;
- a ``.gguf`` file (its header checked, no cache);
- a Hugging Face checkpoint directory (its ``config.json`` checked).

``eos_token_id`` comes from ``generation_config.json``, else ``config.json``
(the first id when it is a list). Building the model from the result is the
engine's (:func:`vtoken.engine.pretrained.load_checkpoint`): nothing here
imports the engine.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Optional

from vtoken.checkpoints.fetch import KNOWN, cache_dir, fetch, known
from vtoken.errors import InvalidArgumentError

_STAMP = "vtoken-export.json"  # written last into a cached export: which GGUF, which exporter
EXPORT_VERSION = 1  # bump when export_hf's output changes: older cached exports are then redone


def exported_dir(name: str, *, cache: Optional[str] = None, progress=None) -> str:
    """The cached Hugging Face export of known checkpoint ``name`` (fetched and exported on first use)."""
    from vtoken.checkpoints.gguf_llama import export_hf

    ck = known(name)
    gguf_path = fetch(name, cache=cache, **({} if progress is None else {"progress": progress}))
    target = os.path.join(cache_dir(name, cache), "hf")
    stamp = os.path.join(target, _STAMP)
    if os.path.isfile(stamp):
        with open(stamp) as f:
            stamped = json.load(f)
        if stamped.get("sha256") == ck.sha256 and stamped.get("export_version") == EXPORT_VERSION:
            return target
    if progress is not None:
        progress.write(f"exporting {ck.filename} to {target} (once)\n")
    tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".hf-")
    try:
        export_hf(gguf_path, tmp)
        with open(os.path.join(tmp, _STAMP), "w") as f:
            json.dump({"sha256": ck.sha256, "source": ck.filename, "export_version": EXPORT_VERSION}, f)
        shutil.rmtree(target, ignore_errors=True)  # a stale or partial export
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def checkpoint_eos(path: str) -> Optional[int]:
    """The end-of-sequence id a checkpoint declares (see module docstring), or None."""
    if path.endswith(".gguf"):
        from vtoken.checkpoints.gguf_llama import read_gguf_llama

        return read_gguf_llama(path, with_tensors=False).config.get("eos_token_id")
    for name in ("generation_config.json", "config.json"):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file) as f:
                eos = json.load(f).get("eos_token_id")
            if isinstance(eos, list):
                eos = eos[0] if eos else None
            if eos is not None:
                return int(eos)
    return None


def resolve(name_or_path: str, *, cache: Optional[str] = None, progress=None) -> str:
    """The local checkpoint a name or path stands for (a known name's cached export, else the path itself)."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise InvalidArgumentError(f"model: expected a checkpoint name or path, got {name_or_path!r}")
    name_or_path = os.fspath(name_or_path)
    if name_or_path in KNOWN:
        return exported_dir(name_or_path, cache=cache, progress=progress)
    if not (os.path.isdir(name_or_path) or (name_or_path.endswith(".gguf") and os.path.isfile(name_or_path))):
        raise InvalidArgumentError(f"model: expected one of {sorted(KNOWN)}, a checkpoint directory or a .gguf "
                                   f"file, got {name_or_path!r}")
    if os.path.isdir(name_or_path):
        check_hf_dir(name_or_path)
    else:
        check_gguf_header(name_or_path)
    return name_or_path


def check_gguf_header(path: str) -> None:
    """Refuse a ``.gguf`` file that does not even start with the GGUF magic and version (empty, truncated,
    or another format); the rest of a truncated file is refused by ``read_gguf_llama``."""
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8 or head[:4] != b"GGUF":
        raise InvalidArgumentError(f"model: expected a GGUF file (it starts with b'GGUF' and a version), got "
                                   f"{path!r} starting with {head!r} ({os.path.getsize(path)} bytes)")


def check_hf_dir(path: str) -> dict:
    """``config.json`` of the Hugging Face checkpoint directory ``path`` as a dict, or a typed error
    (missing, unreadable, not UTF-8, not JSON, too deeply nested, or not an object)."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise InvalidArgumentError(f"model: expected a checkpoint directory with config.json, got {path!r} without one")
    try:
        with open(cfg_file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        why = "too deeply nested" if isinstance(e, RecursionError) else str(e).splitlines()[0]
        raise InvalidArgumentError(f"model: expected a JSON object in {cfg_file!r}, got one that cannot be read "
                                   f"({why})") from None
    if not isinstance(cfg, dict):
        raise InvalidArgumentError(f"model: expected a JSON object in {cfg_file!r}, got {type(cfg).__name__}")
    return cfg


__all__ = ["check_gguf_header", "check_hf_dir", "checkpoint_eos", "exported_dir", "resolve"]
