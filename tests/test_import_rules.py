"""No import cycle between vtoken's parts, read with ``ast`` (nothing is imported; lazy imports inside functions count).

The graph's nodes: each subpackage is one node (``vtoken.bookkeeping``,
``vtoken.device``, ``vtoken.engine``, ``vtoken.checkpoints``, ...), and each
top-level module is a node of its own (``vtoken.cli``, ``vtoken.errors``, ...,
``vtoken`` for ``__init__.py``). An edge is any import from one node of
another; imports inside a node are not edges. (tests/test_layering.py states
which package may import which, and that the bookkeeping imports no torch.)
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIR = os.path.join(ROOT, "python", "vtoken")


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
    assert [node_of(m) for m in ("vtoken", "vtoken.bookkeeping.table", "vtoken.engine.model", "vtoken.cli", "torch")] == [
        "vtoken", "vtoken.bookkeeping", "vtoken.engine", "vtoken.cli", None]


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": [], "c": []}, "b": {"c": []}, "c": {}}) == []


def test_the_graph_has_the_expected_parts():
    graph = package_graph()
    for node in ("vtoken.checkpoints", "vtoken.engine", "vtoken.experiments", "vtoken.integrations",
                 "vtoken.policies", "vtoken.reference", "vtoken.bookkeeping", "vtoken.device", "vtoken.reclamation",
                 "vtoken.decisions", "vtoken.cli", "vtoken"):
        assert node in graph, node
    assert "vtoken.checkpoints" in graph["vtoken.engine"]  # the engine builds models from checkpoints
    assert "vtoken.engine" in graph["vtoken.experiments"]


def test_no_import_cycle_between_vtokens_parts():
    graph = package_graph()
    cycle = find_cycle(graph)
    where = [f"{a} -> {b}: {', '.join(graph[a][b][:3])}" for a, b in zip(cycle, cycle[1:])]
    assert not cycle, "import cycle " + " -> ".join(cycle) + "\n" + "\n".join(where)
