"""Layering: ``vtoken_kernels`` never imports ``vtoken``; vtoken's packages import one way; no torch in the bookkeeping.

``vtoken`` imports ``vtoken_kernels`` (kernels, their contracts, KVLayout,
errors), not the reverse, so the kernels can be read, tested and compiled on
their own. Inside ``vtoken`` the packages follow the order of
docs/architecture.md §8 (:data:`MAY_IMPORT`), no module sits beside the
packages but the shared top-level ones, and the host bookkeeping never
imports torch. Every module is parsed with ``ast``
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


# ------------------------------------------------------------ vtoken's packages
# The one-way order of docs/architecture.md §8: a unit may import only what its entry lists, plus the
# top-level modules (errors, layout, versions, metrics and the root's PAD_SLOT / cdiv), which import no
# package. bookkeeping, policies and reference stand alone; reclamation and decisions are siblings.
PACKAGE_DIR = os.path.join(ROOT, "python", "vtoken")
TOP_LEVEL_MODULES = {"__init__", "errors", "layout", "versions", "metrics", "cli"}
CORE = {"bookkeeping", "policies", "reference", "device", "reclamation", "decisions"}
MAY_IMPORT = {
    "top": set(),
    "bookkeeping": set(),
    "policies": set(),
    "reference": set(),
    "device": {"bookkeeping", "reference"},
    "reclamation": {"bookkeeping", "device"},
    "decisions": {"bookkeeping", "device", "policies"},
    "integrations": CORE | {"checkpoints"},
    "engine": CORE | {"checkpoints"},  # the engine builds models from checkpoints (engine.pretrained)
    "checkpoints": CORE,
    "experiments": CORE | {"engine", "checkpoints"},
    "cli": CORE | {"engine", "checkpoints", "experiments"},
}
BOOKKEEPING_MODULES = {"pool", "ledger", "arena", "block_lists", "request_rows", "shared_blocks", "relocation", "journal",
                       "table", "invariants"}


def unit_of(module: str) -> str:
    """The package-graph unit of ``vtoken.<x>...``: a subpackage, ``cli``, or ``top`` (the other top-level
    modules and the root's names)."""
    first = module.split(".")[1] if "." in module else "__init__"
    is_package = os.path.exists(os.path.join(PACKAGE_DIR, first, "__init__.py"))
    return first if is_package or first == "cli" else "top"


def package_sources() -> dict[str, str]:
    """``{module name: path}`` for every ``.py`` under python/vtoken."""
    found = {}
    for dirpath, _, files in os.walk(PACKAGE_DIR):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), os.path.join(ROOT, "python"))[:-3]
                found[rel.replace(os.sep, ".").removesuffix(".__init__")] = os.path.join(dirpath, name)
    return found


def vtoken_imports(path: str) -> list[tuple[int, str]]:
    """``(line, module)`` for every vtoken module ``path`` imports, at any depth; ``from vtoken import x`` as ``vtoken.x``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if imports_vtoken(a.name)]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import; vtoken imports by absolute path"
            if node.module == "vtoken":
                found += [(node.lineno, "vtoken." + a.name) for a in node.names]
            elif imports_vtoken(node.module or ""):
                found.append((node.lineno, node.module))
    return found


def test_unit_of():
    assert unit_of("vtoken") == unit_of("vtoken.cdiv") == unit_of("vtoken.errors") == unit_of("vtoken.layout") == "top"
    assert unit_of("vtoken.bookkeeping.table") == "bookkeeping" and unit_of("vtoken.device") == "device"
    assert unit_of("vtoken.cli") == "cli" and unit_of("vtoken.integrations.vllm.worker") == "integrations"


def test_every_unit_has_a_rule():
    units = {unit_of(m) for m in package_sources()}
    assert units == set(MAY_IMPORT), units ^ set(MAY_IMPORT)


def test_packages_import_one_way():
    bad = []
    for module, path in sorted(package_sources().items()):
        unit = unit_of(module)
        for line, imported in vtoken_imports(path):
            target = unit_of(imported)
            if target not in (unit, "top") and target not in MAY_IMPORT[unit]:
                bad.append(f"{os.path.relpath(path, ROOT)}:{line}: {unit} imports {imported}")
    assert not bad, "imports against the package order (docs/architecture.md §8):\n" + "\n".join(bad)


def test_the_package_check_sees_a_back_edge(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from vtoken.reclamation.manager import ReclamationManager\n"
                    "from vtoken import policies, cdiv\n")
    assert sorted(vtoken_imports(str(path))) == [(2, "vtoken.reclamation.manager"), (3, "vtoken.cdiv"),
                                                 (3, "vtoken.policies")]
    assert "reclamation" not in MAY_IMPORT["bookkeeping"] | MAY_IMPORT["device"]


def test_no_flat_module_beside_the_packages():
    """python/vtoken holds packages and only the few top-level modules every package may use."""
    flat = {n[:-3] for n in os.listdir(PACKAGE_DIR) if n.endswith(".py")}
    assert flat == TOP_LEVEL_MODULES, f"move {sorted(flat - TOP_LEVEL_MODULES)} into a package"
    for dirpath, dirs, files in os.walk(PACKAGE_DIR):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if any(n.endswith(".py") for n in files):
            init = os.path.join(dirpath, "__init__.py")
            assert os.path.exists(init), f"{os.path.relpath(dirpath, ROOT)} is not a package"
            with open(init, encoding="utf-8") as f:
                assert ast.get_docstring(ast.parse(f.read())), f"{os.path.relpath(init, ROOT)}: say what the package is"


def test_bookkeeping_is_what_the_docs_list():
    found = {os.path.splitext(n)[0] for n in os.listdir(os.path.join(PACKAGE_DIR, "bookkeeping")) if n.endswith(".py")}
    assert found - {"__init__"} == BOOKKEEPING_MODULES


@pytest.mark.parametrize("name", sorted(BOOKKEEPING_MODULES))
def test_host_bookkeeping_never_imports_torch(name):
    """No torch (or Triton) import in the host bookkeeping, at any depth, lazy ones included."""
    path = os.path.join(PACKAGE_DIR, "bookkeeping", name + ".py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    bad = [f"{line}: {m}" for line, m in imported_modules(tree) if m.split(".")[0] in ("torch", "triton")]
    assert not bad, f"vtoken/bookkeeping/{name}.py imports torch:\n" + "\n".join(bad)


def test_importing_the_bookkeeping_loads_no_torch():
    """The whole import closure of the bookkeeping (vtoken's top level, vtoken_kernels' errors) stays torch-free."""
    import subprocess
    import sys

    mods = ", ".join(f"vtoken.bookkeeping.{m}" for m in sorted(BOOKKEEPING_MODULES))
    code = f"import sys, {mods}\nprint(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "python"), ROOT]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
