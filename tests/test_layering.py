"""Layering: ``vtoken_kernels`` (kernels, their contracts, KVLayout, errors) never imports ``vtoken``.

``vtoken`` imports ``vtoken_kernels``, not the reverse, so the kernels can be
read, tested and compiled on their own. Every module is parsed with ``ast``
(nothing is imported), and every ``import`` / ``from ... import`` node is
checked, lazy imports inside functions included.
"""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS_DIR = os.path.join(ROOT, "vtoken_kernels")
MODULES = sorted(
    os.path.relpath(os.path.join(d, f), ROOT)
    for d, _, files in os.walk(KERNELS_DIR)
    for f in files
    if f.endswith(".py")
)
# NOTE: build_slot_lists is being rewritten in a parallel change that moves its
# contract into vtoken_kernels/contracts.py; strict, so the marker must go when it lands.

def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, module)`` for every import in ``tree``, at any depth; relative imports as ``.name``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "." * node.level + (node.module or "")))
    return found


def imports_vtoken(module: str) -> bool:
    return module == "vtoken" or module.startswith("vtoken.")


def test_the_scan_sees_every_kind_of_import():
    src = (
        "import os, vtoken.device.ops\n"
        "from vtoken import ops\n"
        "from vtoken_kernels.errors import VTokenError\n"
        "def f():\n"
        "    if True:\n"
        "        from vtoken.reference import compact_kv\n"
        "    import vtoken\n"
        "from . import layout\n"
    )
    found = imported_modules(ast.parse(src))
    assert sorted(found) == [(1, "os"), (1, "vtoken.device.ops"), (2, "vtoken"), (3, "vtoken_kernels.errors"),
                             (6, "vtoken.reference"), (7, "vtoken"), (8, ".")]
    assert sorted(m for _, m in found if imports_vtoken(m)) == ["vtoken", "vtoken", "vtoken.device.ops", "vtoken.reference"]
    assert not imports_vtoken("vtoken_kernels.errors") and not imports_vtoken("vtokens")


def test_modules_found():
    assert os.path.join("vtoken_kernels", "contracts.py") in MODULES
    assert os.path.join("vtoken_kernels", "layout.py") in MODULES
    assert len(MODULES) >= 7


@pytest.mark.parametrize("path", MODULES)
def test_kernels_never_import_vtoken(path):
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read(), filename=path)
    bad = [f"{path}:{line}: {module}" for line, module in imported_modules(tree) if imports_vtoken(module)]
    assert not bad, "vtoken_kernels must not import vtoken:\n" + "\n".join(bad)


# ------------------------------------------------------------ house rules
WORD = "ARCHI" + "TECTURE"  # spelled apart so this file does not cite it


def test_sources_cite_only_the_projects_own_docs():
    """The design doc is docs/architecture.md; no source cites a file outside the repository."""
    bad = []
    for top in ("python", "vtoken_kernels", "csrc", "bench", "tests"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith((".py", ".cu", ".cpp", ".h", ".sh", ".md")):
                    path = os.path.join(dirpath, name)
                    with open(path, encoding="utf-8") as f:
                        if WORD in f.read():
                            bad.append(os.path.relpath(path, ROOT))
    assert not bad, f"cite docs/architecture.md instead: {bad}"
    assert os.path.exists(os.path.join(ROOT, "docs", "architecture.md"))


def test_no_class_in_the_package_exceeds_400_lines():
    long = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "python", "vtoken")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read(), filename=path)
                long += [f"{os.path.relpath(path, ROOT)}:{n.name} ({n.end_lineno - n.lineno + 1})"
                         for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno >= 400]
    assert not long, long
