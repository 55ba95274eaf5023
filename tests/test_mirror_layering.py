"""The device mirror and the decision loop depend one way: the loop uses the mirror, never the reverse.

The mirror's module may not name the decision loop, its module or its methods (no import, no callback
such as a registered "kill source" it calls back); the device kills it has not yet seen from the table
reach its check as data (``check_against_table(pending_kills=...)``). Modules are found by the class
they define, so a move between packages keeps the rule.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "python", "vtoken")


def module_defining(class_name: str) -> tuple[str, ast.Module]:
    for d, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                with open(path, encoding="utf-8") as fh:
                    tree = ast.parse(fh.read())
                if any(isinstance(n, ast.ClassDef) and n.name == class_name for n in tree.body):
                    return path, tree
    raise AssertionError(f"no module defines {class_name}")


def names_in(tree: ast.Module) -> set[str]:
    """Every identifier, attribute and imported module name in ``tree``."""
    found = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            found.add(n.id)
        elif isinstance(n, ast.Attribute):
            found.add(n.attr)
        elif isinstance(n, ast.Import):
            found.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            found.add(n.module or "")
            found.update(a.name for a in n.names)
    return found


LOOP_NAMES = {"DecisionLoop", "pending_victims", "add_kill_source", "check_mirror", "drain", "decide"}


def test_the_mirror_never_names_the_decision_loop():
    path, tree = module_defining("DeviceMirror")
    names = names_in(tree)
    loop_path, _ = module_defining("DecisionLoop")
    loop_module = os.path.splitext(os.path.basename(loop_path))[0]
    assert not (names & LOOP_NAMES), f"{path} names {sorted(names & LOOP_NAMES)}"
    assert not any(loop_module in n.split(".") for n in names), f"{path} imports {loop_module}"


def test_the_decision_loop_uses_the_mirror():
    _, tree = module_defining("DecisionLoop")
    names = names_in(tree)
    assert {"kill_on_device", "check_against_table"} <= names


def test_the_scan_sees_a_callback_name():
    tree = ast.parse("def f(src):\n    return src.pending_victims()\n")
    assert "pending_victims" in names_in(tree)
