"""Ahead-of-time compilation of Triton kernels for sm_90 / sm_80 in the tests (no GPU needed).

NOTE: under TRITON_INTERPRET=1, ``@triton.jit`` gives interpreter objects
that the compiler rejects (the @triton.jit helpers a kernel calls included;
compiling from ``JITFunction(kernel.fn)`` fails in Triton 3.9's code generator
with "'value' object has no attribute 'dtype'"), so the compile runs in a
fresh process without it: :func:`run_without_interpreter`.
"""
from __future__ import annotations

import os
import subprocess
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def compile_kernel(kernel, signature: dict, constexprs: dict, arch: int, num_warps: int):
    """Compile ``kernel`` for ``sm_<arch>``; its arguments not in ``signature`` are constexprs.

    Asserts that ``signature`` and ``constexprs`` name every argument and
    nothing else, and that a cubin came out; returns the compiled kernel.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: signature.get(n, "constexpr") for n in kernel.arg_names}
    assert set(sig) == set(signature) | set(constexprs), kernel.arg_names
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    assert compiled.asm.get("cubin"), kernel.arg_names
    return compiled


def run_without_interpreter(module: str, func: str, *args) -> str:
    """Call ``tests/<module>.py``'s ``func(*args)`` in a fresh process without TRITON_INTERPRET; its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import sys; sys.path.insert(0, {TESTS_DIR!r}); import {module} as t; t.{func}(*{args!r})"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout
