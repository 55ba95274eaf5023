"""Integrations of vtoken into serving engines (vLLM 0.32: :mod:`vtoken.integrations.vllm`)."""
