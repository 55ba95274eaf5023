"""Ahead-of-time compilation of Triton kernels for sm_90 / sm_80 in the tests (no GPU needed).

Every AOT test compiles in a fresh Python process without TRITON_INTERPRET:
one process per kernel module, compiling all of the module's configs for both
architectures (:func:`compile_module_in_fresh_process`).

NOTE: why never in the pytest process. The suite runs Triton in its
interpreter (TRITON_INTERPRET=1), and Triton 3.9's interpreter
(triton/runtime/interpreter.py) runs a kernel by replacing the builtins of
``triton.language`` with wrappers that call its numpy builder
(``_patch_lang``). Two ways those wrappers outlive the kernel:

* ``GridExecutor.__call__`` patches only the language modules found in the
  *kernel's* globals and restores them in a ``finally`` (a kernel that raises
  leaves nothing behind). But every ``@triton.jit`` function the kernel calls
  goes through ``InterpretedFunction.__call__``, which calls ``_patch_lang``
  for *its* globals and drops the scope, never restoring it. The
  ``@triton.jit`` functions of ``triton/language/standard.py`` (``tl.zeros``,
  the combine functions of ``tl.sum``, ``tl.max``, ``tl.cumsum`` ...) have
  ``triton.language.core`` itself in their globals, so core's module-level
  builtins (``core.add``, ``core.load``, ...) stay patched for the rest of
  the process. Reproduced: a kernel that calls ``tl.sum`` leaves
  ``tl.core.load`` patched, one that does not leaves nothing; after one
  interpreted ``block_live_counts`` call, ``triton.compile`` of compact_kv in
  the same process fails at ``s = tl.load(src_slots_ptr + m)`` with
  "'block_argument' object has no attribute 'get_element_ty'"
  (``tensor.__add__`` calls the patched ``core.add``, which hands the MLIR
  value to the interpreter's ``create_addptr``). The same compile in a fresh
  process passes.
* The patch is process-wide, so two threads running interpreted kernels
  restore each other's "originals": reproduced, two threads leave
  ``tensor.__index__``, ``dtype.to_ir`` and ``tl.range`` patched.

A warm Triton cache (``~/.triton/cache``) hides the first leak: a cache hit
skips code generation (reproduced), so the failure can come and go between
runs of the same suite. Also, under TRITON_INTERPRET=1 a kernel that calls a
``@triton.jit`` helper cannot be compiled at all from
``JITFunction(kernel.fn)``: the helper is an ``InterpretedFunction``, and the
code generator stops with "Unsupported function referenced".
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

AOT_ARCHS = (90, 80)
"""sm_90 (H100/H200) and sm_80 (A100): the GPUs vtoken targets."""

_RECORD = "AOT_COMPILED "


def compile_kernel(kernel, signature: dict, constexprs: dict, arch: int, options: dict, *, label: str, attrs=None):
    """Compile ``kernel`` for ``sm_<arch>``; its arguments not in ``signature`` are constexprs.

    Asserts that ``signature`` and ``constexprs`` name every argument and
    nothing else, and that a cubin came out; records ``(label, arch)`` on
    stdout for :func:`compile_module_in_fresh_process`; returns the compiled kernel.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    assert isinstance(kernel, JITFunction), f"{label}: expected a JITFunction (TRITON_INTERPRET set?), got {kernel!r}"
    sig = {n: signature.get(n, "constexpr") for n in kernel.arg_names}
    assert set(sig) == set(signature) | set(constexprs), (label, kernel.arg_names)
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options=options)
    assert compiled.asm.get("cubin"), label
    print(_RECORD + json.dumps({"label": label, "arch": arch}), flush=True)
    return compiled


def compile_module_in_fresh_process(module: str, func: str = "_aot_compile_all") -> list[tuple[str, int]]:
    """Run ``tests/<module>.py``'s ``func()`` in a fresh process without TRITON_INTERPRET.

    ``func`` compiles the module's kernels for every arch in :data:`AOT_ARCHS`
    with :func:`compile_kernel` (asserting what it checks in there); returns
    the ``(label, arch)`` of every compile, in order.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # The child imports exactly what this process imports (worktree, editable install, ...).
    env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR] + [p for p in sys.path if p])
    # Triton 3.9's default (FP fusion on), set to silence its deprecation warning.
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    code = f"import {module} as t; t.{func}()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    records = [json.loads(ln[len(_RECORD):]) for ln in proc.stdout.splitlines() if ln.startswith(_RECORD)]
    return [(r["label"], r["arch"]) for r in records]


def expected_compiles(labels) -> list[tuple[str, int]]:
    """The ``(label, arch)`` list :func:`compile_module_in_fresh_process` returns when every label compiled."""
    labels = list(labels)
    return [(label, arch) for arch in AOT_ARCHS for label in labels]
