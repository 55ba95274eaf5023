"""The vLLM integration's version gate: a supported range, refused loudly outside it (no vLLM needed)."""
import sys
import types

import pytest

from vtoken.integrations import vllm as integ


@pytest.mark.parametrize("version, release", [
    ("0.32.0", (0, 32, 0)), ("0.32.0+cpu", (0, 32, 0)), ("0.32.3", (0, 32, 3)), ("0.33.0rc1", (0, 33, 0)),
    ("0.32", (0, 32, 0)), ("1.0.0.dev3", (1, 0, 0)), ("unknown", (0, 0, 0)),
])
def test_release_numbers_of_vllm_version_strings(version, release):
    assert integ._release(version) == release


@pytest.mark.parametrize("version, ok", [("0.32.0", True), ("0.32.0+cpu", True), ("0.32.5", True),
                                         ("0.31.9", False), ("0.33.0", False), ("0.33.0rc1", False)])
def test_vllm_available_accepts_exactly_the_supported_range(monkeypatch, version, ok):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
    got, why = integ.vllm_available()
    assert got is ok
    if ok:
        assert why == version
    else:
        assert integ.SUPPORTED_VLLM_SPEC in why and version in why


def test_setup_py_states_the_same_range():
    import os

    with open(os.path.join(os.path.dirname(__file__), "..", "setup.py")) as f:
        assert f'"vllm": ["vllm{integ.SUPPORTED_VLLM_SPEC}"]' in f.read()
