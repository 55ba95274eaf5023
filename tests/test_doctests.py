"""The examples in vtoken's docstrings run and print what they show (doctest).

Every module under ``python/vtoken`` with a ``>>>`` example is found by walking
the tree, so a moved module keeps its check. The vLLM integration is left out:
it needs vLLM, which the core venv does not have (its examples run in the vLLM lane's tests).
"""
from __future__ import annotations

import doctest
import importlib
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIR = os.path.join(ROOT, "python", "vtoken")


def modules_with_examples() -> list[str]:
    found = []
    for d, _, files in os.walk(PACKAGE_DIR):
        for f in sorted(files):
            path = os.path.join(d, f)
            if not f.endswith(".py") or os.sep + "integrations" + os.sep in path:
                continue
            with open(path, encoding="utf-8") as fh:
                if ">>>" not in fh.read():
                    continue
            rel = os.path.relpath(path, os.path.join(ROOT, "python"))[:-3].replace(os.sep, ".")
            found.append(rel[: -len(".__init__")] if rel.endswith(".__init__") else rel)
    return sorted(found)


def test_examples_are_found():
    assert "vtoken.bookkeeping.pool" in modules_with_examples()


@pytest.mark.parametrize("name", modules_with_examples())
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} doctest examples failed (run pytest --doctest-modules on it)"
