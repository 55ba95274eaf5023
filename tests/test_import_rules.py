"""Import rules over ``python/vtoken``, read with ``ast`` (nothing is imported; lazy imports inside functions count).

* No cycle between vtoken's parts. The graph's nodes: each subpackage is one
  node (``vtoken.checkpoints``, ``vtoken.engine``, ``vtoken.experiments``,
  ``vtoken.integrations``, ``vtoken.policies``, ``vtoken.reference``), and each
  top-level module is a node of its own (``vtoken.bookkeeping.table``, ``vtoken.device.ops``, ...,
  ``vtoken`` for ``__init__.py``). An edge is any import from one node of
  another; imports inside a node are not edges.
* The host bookkeeping modules (:data:`HOST_MODULES`) import no torch: not in
  their own file (lazy imports included), and not through the vtoken modules
  they import when loaded. ``vtoken/bookkeeping/invariants.py`` imports torch (its device
  checks) and is not one of them; ``TokenTable.snapshot`` and
  ``check_invariants`` import it lazily, only when called.
"""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIR = os.path.join(ROOT, "python", "vtoken")
# The host bookkeeping: numpy only, so it runs and is tested without torch. Paths relative to the repository.
HOST_MODULES = [
    "python/vtoken/bookkeeping/table.py",
    "python/vtoken/bookkeeping/arena.py",
    "python/vtoken/bookkeeping/journal.py",
    "python/vtoken/bookkeeping/ledger.py",
    "python/vtoken/bookkeeping/pool.py",
    "python/vtoken/bookkeeping/request_rows.py",
    "python/vtoken/bookkeeping/shared_blocks.py",
    "python/vtoken/bookkeeping/relocation.py",
]


def package_modules() -> dict[str, str]:
    """``{dotted module name: path}`` of every module under ``python/vtoken``."""
    found = {}
    for dirpath, _, files in os.walk(PACKAGE_DIR):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                parts = os.path.relpath(path, os.path.dirname(PACKAGE_DIR))[:-3].split(os.sep)
                found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = package_modules()


def imported_names(tree: ast.AST, importer: str) -> list[tuple[int, str]]:
    """``(line, module)`` for every import in ``tree``, at any depth, relative ones made absolute; for
    ``from P import x`` also ``P.x`` when that is a module of the package."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                is_package = MODULES.get(importer, "").endswith("__init__.py")
                anchor = importer.split(".")[: len(importer.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names if f"{base}.{a.name}" in MODULES]
    return found


def node_of(module: str):
    """The graph node ``module`` belongs to, or None outside vtoken."""
    parts = module.split(".")
    if parts[0] != "vtoken":
        return None
    if len(parts) == 1:
        return "vtoken"
    return "vtoken." + parts[1]


def package_graph() -> dict[str, dict[str, list[str]]]:
    """``{node: {imported node: ["path:line", ...]}}``."""
    graph: dict[str, dict[str, list[str]]] = {}
    for module, path in MODULES.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        src = node_of(module)
        edges = graph.setdefault(src, {})
        for line, imported in imported_names(tree, module):
            dst = node_of(imported)
            if dst is not None and dst != src:
                edges.setdefault(dst, []).append(f"{os.path.relpath(path, ROOT)}:{line}")
    return graph


def find_cycle(graph) -> list[str]:
    """One cycle of ``graph`` as its nodes in order (first == last), or [] if there is none."""
    state: dict[str, str] = {}  # "open" while on the path, "done" after

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, path + [nxt])
                if cycle:
                    return cycle
        state[node] = "done"
        return []

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start, [start])
            if cycle:
                return cycle
    return []


def test_the_scan_sees_lazy_and_relative_imports_and_modules_named_in_from():
    src = ("from vtoken import checkpoints, PAD_SLOT\n"
           "def f():\n"
           "    import vtoken.engine.model\n"
           "from . import loader\n")
    found = imported_names(ast.parse(src), "vtoken.checkpoints.fetch")
    assert sorted(found) == [(1, "vtoken"), (1, "vtoken.checkpoints"), (3, "vtoken.engine.model"),
                             (4, "vtoken.checkpoints"), (4, "vtoken.checkpoints.loader")]
    assert [node_of(m) for m in ("vtoken", "vtoken.bookkeeping.table", "vtoken.engine.model", "torch")] == [
        "vtoken", "vtoken.bookkeeping.table", "vtoken.engine", None]


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": [], "c": []}, "b": {"c": []}, "c": {}}) == []


def test_the_graph_has_the_expected_parts():
    graph = package_graph()
    for node in ("vtoken.checkpoints", "vtoken.engine", "vtoken.experiments", "vtoken.integrations",
                 "vtoken.policies", "vtoken.reference", "vtoken.bookkeeping.table", "vtoken.cli", "vtoken"):
        assert node in graph, node
    assert "vtoken.checkpoints" in graph["vtoken.engine"]  # the engine builds models from checkpoints
    assert "vtoken.engine" in graph["vtoken.experiments"]


def test_no_import_cycle_between_vtokens_parts():
    graph = package_graph()
    cycle = find_cycle(graph)
    where = [f"{a} -> {b}: {', '.join(graph[a][b][:3])}" for a, b in zip(cycle, cycle[1:])]
    assert not cycle, "import cycle " + " -> ".join(cycle) + "\n" + "\n".join(where)


# ------------------------------------------------------------ the host bookkeeping imports no torch
def module_name(path: str) -> str:
    """``python/vtoken/bookkeeping/table.py`` -> ``vtoken.bookkeeping.table``."""
    return ".".join(os.path.relpath(os.path.join(ROOT, path), os.path.dirname(PACKAGE_DIR))[:-3].split(os.sep))


def source_path(module: str):
    """The file of a ``vtoken`` or ``vtoken_kernels`` module, or None (outside the repository)."""
    if module in MODULES:
        return MODULES[module]
    if module == "vtoken_kernels" or module.startswith("vtoken_kernels."):
        base = os.path.join(ROOT, *module.split("."))
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(path):
                return path
    return None


def imports_of(module: str, *, lazy: bool) -> set[str]:
    """What ``module`` imports: at any depth (``lazy=True``) or only the statements run when it is loaded."""
    with open(source_path(module), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    if not lazy:  # module-level statements, and those nested in module-level if / try blocks
        nodes, todo = [], list(tree.body)
        while todo:
            node = todo.pop()
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                nodes.append(node)
                todo += [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
        tree = ast.Module(body=nodes, type_ignores=[])
    return {m for _, m in imported_names(tree, module)}


def loaded_with(module: str) -> dict[str, str]:
    """``{module: the repository module that imports it}``: what ``module`` imports at any depth (lazy imports
    too), and everything that importing ``module`` loads (through vtoken / vtoken_kernels modules)."""
    seen = {m: module for m in imports_of(module, lazy=True)}
    todo, followed = list(imports_of(module, lazy=False)), set()
    while todo:
        current = todo.pop()
        if current in followed or source_path(current) is None:
            continue
        followed.add(current)
        for m in imports_of(current, lazy=False):
            seen.setdefault(m, current)
            todo.append(m)
    return seen


def test_host_modules_exist():
    missing = [p for p in HOST_MODULES if not os.path.isfile(os.path.join(ROOT, p))]
    assert not missing, f"moved? update HOST_MODULES: {missing}"


def test_the_torch_scan_sees_an_import_through_another_module():
    assert "torch" in loaded_with("vtoken.bookkeeping.invariants")  # it imports torch itself
    assert loaded_with("vtoken.device.ops").get("torch") is not None


@pytest.mark.parametrize("path", HOST_MODULES)
def test_host_bookkeeping_imports_no_torch(path):
    found = loaded_with(module_name(path))
    bad = {m: via for m, via in found.items() if m == "torch" or m.startswith("torch.")}
    assert not bad, f"{path} loads torch: {bad} (module: the module that imports it)"
