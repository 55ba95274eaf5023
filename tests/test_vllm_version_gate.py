"""The vLLM integration's version gate: a supported range, refused loudly outside it (no vLLM needed)."""
import os
import sys
import types

import pytest

from vtoken.integrations import vllm as integ


@pytest.mark.parametrize("version, ok", [
    ("0.32.0", True), ("0.32.0+cpu", True), ("0.32.5", True), ("0.32.1rc1", True),
    ("0.31.9", False), ("0.32.0rc1", False), ("0.32.0.dev5", False), ("0.33.0", False), ("0.33.0rc1", False),
    ("unknown", False),
])
def test_vllm_available_accepts_exactly_the_supported_range(monkeypatch, version, ok):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
    got, why = integ.vllm_available()
    assert got is ok
    if ok:
        assert why == version
    else:
        assert integ.SUPPORTED_VLLM_SPEC in why and version in why


def test_setup_py_states_the_same_range():
    with open(os.path.join(os.path.dirname(__file__), "..", "setup.py")) as f:
        assert f'"vllm": ["vllm{integ.SUPPORTED_VLLM_SPEC}"]' in f.read()
