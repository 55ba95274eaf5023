"""The tests hand Triton kernels tensors on KERNEL_DEVICE (tests/kernel_device.py), read from their sources.

On a GPU machine tests/conftest.py leaves Triton's interpreter off, so Triton
compiles and takes CUDA tensors only: a test that builds its tensors on the
CPU passes here and fails there. Without a GPU to run them on, this guard reads
every test module (ast) and checks:

* a test function that launches a Triton kernel (calls a public
  ``vtoken_kernels`` launcher or a helper of its module that does, or sets ``VTOKEN_BACKEND`` to ``triton`` or to a
  parametrized backend and then calls an op of ``vtoken.device.ops`` other than
  ``select_backend``, or no op at all: an engine run) picks
  its device through tests/kernel_device.py: it names ``KERNEL_DEVICE``,
  ``DEV`` or ``device_for``, or calls a helper of its module that does;
* no launcher call gets a literal CPU device (``device="cpu"``,
  ``torch.device("cpu")``, ``.cpu()``, ``.to("cpu")``) in its arguments.

The ``gpu`` tests (they allocate on CUDA themselves) and the tests marked
``cpu_engine_triton`` (skipped with CUDA) are exempt.
"""
from __future__ import annotations

import ast
import os

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
DEVICE_NAMES = {"KERNEL_DEVICE", "DEV", "device_for"}


def kernel_launchers() -> dict[str, set[str]]:
    """Per ``vtoken_kernels`` module, its public functions / classes that launch a kernel.

    A definition launches when it holds a ``kernel[grid](...)`` call or calls a
    definition of its module that launches (``token_attention`` runs a plan).
    """
    out = {}
    kernels = os.path.join(ROOT, "vtoken_kernels")
    for name in sorted(os.listdir(kernels)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(kernels, name)) as f:
            tree = ast.parse(f.read())
        defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        calls = {k: [c for c in ast.walk(n) if isinstance(c, ast.Call)] for k, n in defs.items()}
        launching = {k for k, cs in calls.items() if any(isinstance(c.func, ast.Subscript) for c in cs)}
        grown = True
        while grown:
            more = {k for k, cs in calls.items() if any(_call_name(c) in launching for c in cs)} - launching
            launching |= more
            grown = bool(more)
        public = {k for k in launching if not k.startswith("_")}
        if public:
            out[name[:-3]] = public
    return out


def _bindings(tree, launchers):
    """Names a test module binds to launchers (``from vtoken_kernels.x import f``) and to kernel modules."""
    funcs, mods = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("vtoken_kernels."):
                mod = node.module.split(".", 1)[1]
                funcs |= {a.asname or a.name for a in node.names if a.name in launchers.get(mod, ())}
            elif node.module == "vtoken_kernels":
                mods.update({a.asname or a.name: a.name for a in node.names if a.name in launchers})
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("vtoken_kernels.") and a.asname and a.name.split(".", 1)[1] in launchers:
                    mods[a.asname] = a.name.split(".", 1)[1]
    return funcs, mods


def _is_launch(call, funcs, mods, launchers) -> bool:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id in funcs
    return (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in mods
            and f.attr in launchers[mods[f.value.id]])


def _call_name(call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _forces_triton(fn) -> bool:
    for c in ast.walk(fn):
        if isinstance(c, ast.Call) and _call_name(c) == "setenv" and len(c.args) == 2:
            key, value = c.args
            if isinstance(key, ast.Constant) and key.value == "VTOKEN_BACKEND":
                if not isinstance(value, ast.Constant) or value.value == "triton":
                    return True
    return False


def _literal_cpu(node) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.keyword) and n.arg == "device" and getattr(n.value, "value", None) == "cpu":
            return True
        if isinstance(n, ast.Call):
            name = _call_name(n)
            if name == "cpu" and not n.args:
                return True
            if name in ("device", "to") and any(isinstance(a, ast.Constant) and a.value == "cpu" for a in n.args):
                return True
    return False


def _names(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def audit_source(source: str, launchers) -> list[str]:
    """The violations of one test module's source, as "function: why" lines."""
    tree = ast.parse(source)
    funcs, mods = _bindings(tree, launchers)
    assigned = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    # Module helpers that allocate on the kernel device (name it, or call a helper that does).
    helpers = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("test_")}
    aware_helpers = {k for k, n in helpers.items() if _names(n) & DEVICE_NAMES}
    grown = True
    while grown:
        more = {k for k, n in helpers.items() if _names(n) & aware_helpers} - aware_helpers
        aware_helpers |= more
        grown = bool(more)
    # Module helpers that call a launcher (``run_backend(backend, ...)``): calling one is a launch.
    launching_helpers = {k for k, n in helpers.items()
                         if any(isinstance(c, ast.Call) and _is_launch(c, funcs, mods, launchers) for c in ast.walk(n))}
    bad = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")):
        marks = set()
        for d in fn.decorator_list:
            marks |= _names(d) | {n.attr for n in ast.walk(d) if isinstance(n, ast.Attribute)}
            for name in _names(d) & assigned.keys():
                marks |= _names(assigned[name])
        if fn.name.startswith("test_gpu_") or "gpu" in marks or "cpu_engine_triton" in marks:
            continue
        calls = [c for c in ast.walk(fn) if isinstance(c, ast.Call)]
        launches = [c for c in calls if _is_launch(c, funcs, mods, launchers) or _call_name(c) in launching_helpers]
        for c in launches:
            if _literal_cpu(c):
                bad.append(f"{fn.name}: line {c.lineno} hands a Triton launcher a literal CPU device")
        op_calls = [c for c in calls if isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Name)
                    and c.func.value.id == "ops"]
        forced = _forces_triton(fn) and (not op_calls or any(c.func.attr != "select_backend" for c in op_calls))
        aware = bool(_names(fn) & DEVICE_NAMES) or any(_call_name(c) in aware_helpers for c in calls)
        if (launches or forced) and not aware:
            bad.append(f"{fn.name}: runs Triton on tensors whose device is not chosen by tests/kernel_device.py")
    return bad


TEST_MODULES = sorted(n for n in os.listdir(TESTS) if n.startswith("test_") and n.endswith(".py"))


def test_launchers_are_found():
    """The guard knows every launcher: it would pass vacuously otherwise."""
    assert kernel_launchers() == {
        "block_live_counts": {"block_live_counts"},
        "build_slot_lists": {"build_slot_lists"},
        "compact_kv": {"compact_kv"},
        "token_attention": {"token_attention", "TokenAttentionPlan"},
    }


@pytest.mark.parametrize("module", TEST_MODULES)
def test_triton_tests_allocate_on_the_kernel_device(module):
    with open(os.path.join(TESTS, module)) as f:
        assert audit_source(f.read(), kernel_launchers()) == []


BAD_SOURCES = {
    "launcher on CPU tensors": '''
import torch
import vtoken_kernels.block_live_counts as tk
def test_x():
    tk.block_live_counts(torch.zeros(4, dtype=torch.int32), torch.ones(4), 1, 4, None)
''',
    "literal cpu into a launcher": '''
import torch
from kernel_device import KERNEL_DEVICE
from vtoken_kernels.compact_kv import compact_kv
def test_x():
    compact_kv([torch.zeros(4, device=KERNEL_DEVICE)], None, torch.zeros(1, device="cpu"), None)
''',
    "forced triton through ops": '''
import pytest, torch
from vtoken.device import ops
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_x(backend, monkeypatch):
    monkeypatch.setenv("VTOKEN_BACKEND", backend)
    ops.block_live_counts(torch.zeros(4, dtype=torch.int32), torch.ones(4), 1, 4)
''',
    "launcher behind a helper": '''
import pytest, torch
import vtoken_kernels.block_live_counts as tk
def run(backend, slots):
    return tk.block_live_counts(slots, None, 1, 4, None) if backend == "triton" else None
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_x(backend):
    run(backend, torch.zeros(4, dtype=torch.int32))
''',
    "launcher imported inside the test": '''
import torch
def test_x():
    from vtoken_kernels.token_attention import token_attention as attn
    attn(torch.zeros(1, 1, 8).cpu(), None, None, None, None)
''',
}
GOOD_SOURCES = {
    "kernel device": '''
import torch
from kernel_device import KERNEL_DEVICE
import vtoken_kernels.block_live_counts as tk
def test_x():
    tk.block_live_counts(torch.zeros(4, dtype=torch.int32, device=KERNEL_DEVICE), None, 1, 4, None)
''',
    "a helper naming it": '''
import torch
from kernel_device import KERNEL_DEVICE
from vtoken_kernels.token_attention import token_attention
def make(device=KERNEL_DEVICE):
    return torch.zeros(4, device=device)
def test_x():
    token_attention(make(), None, None, None, None)
''',
    "forced torch, or triton only to check dispatch": '''
import torch
from vtoken.device import ops
def test_x(monkeypatch):
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    ops.block_live_counts(torch.zeros(4, dtype=torch.int32), torch.ones(4), 1, 4)
def test_y(monkeypatch):
    monkeypatch.setenv("VTOKEN_BACKEND", "triton")
    assert ops.select_backend("compact_kv", torch.device("cpu")) == "triton"
''',
}


@pytest.mark.parametrize("name", BAD_SOURCES)
def test_guard_flags_cpu_tensors_for_triton(name):
    assert len(audit_source(BAD_SOURCES[name], kernel_launchers())) >= 1


@pytest.mark.parametrize("name", GOOD_SOURCES)
def test_guard_accepts_the_kernel_device(name):
    assert audit_source(GOOD_SOURCES[name], kernel_launchers()) == []
