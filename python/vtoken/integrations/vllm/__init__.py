"""vtoken inside vLLM 0.32: plugin, KV connector and token-indexed attention backend.

Usage (see ``docs/vllm.md``)::

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(
        model=...,
        kv_transfer_config=KVTransferConfig(
            kv_connector="VTokenConnector",
            kv_connector_module_path="vtoken.integrations.vllm.connector",
            kv_role="kv_both",
            kv_connector_extra_config={"mode": "vtoken", "policy": "h2o",
                                       "policy_config": {"budget": 0.5}},
        ),
        attention_config={"backend": "CUSTOM"},   # GPU; on CPU the plugin routes CPU_ATTN
    )

Nothing here imports vLLM at import time: :func:`vllm_available` says whether
the integration can be used in this environment.
"""
from __future__ import annotations

# The vLLM releases this integration is tested against: [low, high). It reads
# vLLM internals (the KV cache manager's block lists, the runner's batch), so a
# release outside the range is refused loudly rather than half-working.
SUPPORTED_VLLM = ((0, 32, 0), (0, 33, 0))
SUPPORTED_VLLM_SPEC = ">=0.32.0,<0.33"  # the same range, as setup.py's "vllm" extra states it


def _release(version: str) -> tuple:
    """``(major, minor, patch)`` of a version string such as ``0.32.0+cpu`` or ``0.33.0rc1``."""
    parts = []
    for piece in str(version).split("+")[0].split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or 0))
        if len(digits) < len(piece):  # a pre-release or dev marker ends the release numbers
            break
    return tuple(parts + [0] * (3 - len(parts)))


def vllm_available() -> tuple[bool, str]:
    """``(True, version)`` when a vLLM in :data:`SUPPORTED_VLLM` is importable, else ``(False, reason)``."""
    try:
        import vllm
    except Exception as e:  # ImportError, or a broken install raising anything
        return False, f"vllm is not importable ({type(e).__name__}: {e})"
    version = str(getattr(vllm, "__version__", "unknown"))
    low, high = SUPPORTED_VLLM
    if not low <= _release(version) < high:
        return False, f"vtoken's vLLM integration supports vllm {SUPPORTED_VLLM_SPEC}, found {version}"
    return True, version
