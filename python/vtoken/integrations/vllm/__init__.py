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

SUPPORTED_VLLM = "0.32"


def vllm_available() -> tuple[bool, str]:
    """``(True, version)`` when a supported vLLM is importable, else ``(False, reason)``."""
    try:
        import vllm
    except Exception as e:  # ImportError, or a broken install raising anything
        return False, f"vllm is not importable ({type(e).__name__}: {e})"
    version = getattr(vllm, "__version__", "unknown")
    if not str(version).startswith(SUPPORTED_VLLM):
        return False, f"vtoken's vLLM integration targets vllm {SUPPORTED_VLLM}.x, found {version}"
    return True, str(version)
