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

# The vLLM releases this integration supports (PEP 440, the same string as
# setup.py's "vllm" extra). It reads vLLM internals (the KV cache manager's
# block lists, the runner's batch), so a release outside the range is refused
# loudly rather than half-working.
SUPPORTED_VLLM_SPEC = ">=0.32.0,<0.33"


def supported_version(version: str) -> bool:
    """Whether ``version`` (a vLLM version string) is in :data:`SUPPORTED_VLLM_SPEC`, as pip reads the range.

    Pre-releases of the lowest release (``0.32.0rc1``) are outside it, as PEP 440 says.
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return Version(str(version)) in SpecifierSet(SUPPORTED_VLLM_SPEC)
    except InvalidVersion:
        return False


def vllm_available() -> tuple[bool, str]:
    """``(True, version)`` when a vLLM in :data:`SUPPORTED_VLLM_SPEC` is importable, else ``(False, reason)``."""
    try:
        import vllm
    except Exception as e:  # ImportError, or a broken install raising anything
        return False, f"vllm is not importable ({type(e).__name__}: {e})"
    version = str(getattr(vllm, "__version__", "unknown"))
    if not supported_version(version):
        return False, f"vtoken's vLLM integration supports vllm {SUPPORTED_VLLM_SPEC}, found {version}"
    return True, version
