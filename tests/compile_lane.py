"""GPU-faithful compile lane: compile every recorded Triton launch for sm_90 and sm_80, no GPU needed.

The interpreted suite (TRITON_INTERPRET=1) never runs Triton's JIT, so it
never sees what the JIT does on a GPU: an int argument equal to 1 becomes a
compile-time constant (``x.to(tl.int64)`` on it no longer compiles), ints and
pointers divisible by 16 get ``tt.divisibility``, each dtype its own kernel.
This lane replays the launches that ``tests/triton_launches.py`` recorded
(``VTOKEN_TRITON_LAUNCH_LOG``) through the real ``JITFunction.run`` with
``warmup=True``, so Triton's own binder computes each specialization and its
own ``compile`` builds it, exactly as on a GPU, for ``GPUTarget("cuda", arch, 32)``.
A stand-in driver answers the three questions ``run`` asks of the device
(device, stream, target); nothing is launched.

Each arch compiles in a fresh process without TRITON_INTERPRET (see
tests/aot_helpers.py for why never in an interpreted process) and with an
empty Triton cache, so a cache hit cannot hide a failure. ``--triton-path``
puts another Triton first on that process's PYTHONPATH (the GPU image pins
3.6; ``pip install --target DIR --no-deps triton==3.6.0``).

    python tests/compile_lane.py LOG [--triton-path DIR]

Exits non-zero when nothing was recorded or any specialization fails to compile.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ARCHS = (90, 80)
"""sm_90 (H100/H200) and sm_80 (A100): the GPUs vtoken targets."""

_RESULT = "LANE_RESULT "
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(TESTS_DIR)


def read_log(path: str) -> list[dict]:
    """The recorded launches, one dict per JSON line (duplicates already dropped by the recorder)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class _RecordedTensor:
    """What Triton's binder reads of a tensor argument: its dtype and its pointer."""

    def __init__(self, dtype, data_ptr: int):
        self.dtype = dtype
        self._data_ptr = data_ptr

    def data_ptr(self) -> int:
        return self._data_ptr


def decode(value):
    """Inverse of ``triton_launches.encode``, in the compile process."""
    import torch
    import triton.language as tl

    if isinstance(value, dict):
        if "tensor" in value:
            return _RecordedTensor(getattr(torch, value["tensor"]), value["data_ptr"])
        if "tl_dtype" in value:
            return getattr(tl, value["tl_dtype"])
        if "tuple" in value:
            return tuple(decode(v) for v in value["tuple"])
    return value


class _StandInDriver:
    """The device, stream and target ``JITFunction.run`` asks for; it never launches (warmup=True)."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


def kernel_of(entry: dict):
    """The ``JITFunction`` a recorded launch named."""
    import importlib

    obj = importlib.import_module(entry["module"])
    for part in entry["qualname"].split("."):
        obj = getattr(obj, part)
    return obj


def specialization_key(kernel, args, kwargs) -> str:
    """Triton's own specialization of a launch (its binder's output), as a dedupe key."""
    binder = kernel.device_caches[0][4]
    _, specialization, options = binder(*args, **kwargs)
    return repr((specialization, sorted(options.items())))


def ones_variant(kernel, args: list, kwargs: dict) -> tuple[list, dict]:
    """The launch with every non-constexpr int argument set to 1.

    On a GPU each of them may be 1 in some batch (one request, one span, ...),
    and Triton then compiles it as a constant: this variant has every such
    argument constant at once, whatever values the tests happened to use.
    """
    params = {p.name: p for p in kernel.params}
    names = [p.name for p in kernel.params]

    def one(name, value):
        plain_int = isinstance(value, int) and not isinstance(value, bool)
        return 1 if plain_int and not params[name].is_constexpr else value

    return ([one(names[i], v) for i, v in enumerate(args)],
            {k: one(k, v) if k in params else v for k, v in kwargs.items()})


def compile_all(log: str, arch: int) -> None:
    """In the compile process: compile every distinct specialization in ``log`` for ``sm_<arch>``; print results.

    Besides the recorded launches, each kernel's first launch is compiled once
    more as its :func:`ones_variant`.
    """
    import triton
    from triton.runtime.driver import driver

    driver.set_active(_StandInDriver(arch))
    launches = []
    for entry in read_log(log):
        name = f"{entry['module']}:{entry['qualname']}"
        kernel = kernel_of(entry)
        args = [decode(a) for a in entry["args"]]
        kwargs = {k: decode(v) for k, v in entry["kwargs"].items()}
        launches.append((name, kernel, args, kwargs))
    firsts = {}
    for name, kernel, args, kwargs in launches:
        firsts.setdefault(name, (name, kernel) + ones_variant(kernel, args, kwargs))
    seen = set()
    for name, kernel, args, kwargs in launches + list(firsts.values()):
        key = specialization_key(kernel, args, kwargs)
        if (name, key) in seen:
            continue
        seen.add((name, key))
        t0 = time.perf_counter()
        try:
            compiled = kernel.run(*args, grid=(1,), warmup=True, **kwargs)
            error = None if compiled.asm.get("cubin") else "no cubin produced"
        except Exception as e:  # noqa: BLE001 - every compile error is reported, none may stop the others
            error = f"{type(e).__name__}: {e}"
        print(_RESULT + json.dumps({"kernel": name, "key": key, "arch": arch, "error": error,
                                    "seconds": round(time.perf_counter() - t0, 2),
                                    "triton": triton.__version__}), flush=True)


def run_arch(log: str, arch: int, triton_path: str | None) -> tuple[list[dict], str]:
    """Run :func:`compile_all` in a fresh process; returns its results and its stderr tail."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "VTOKEN_TRITON_LAUNCH_LOG")}
    paths = ([triton_path] if triton_path else []) + [TESTS_DIR, REPO_DIR, os.path.join(REPO_DIR, "python")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    with tempfile.TemporaryDirectory(prefix="vtoken-lane-cache-") as cache:
        env["TRITON_CACHE_DIR"] = cache
        code = f"import compile_lane as c; c.compile_all({log!r}, {arch})"
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    results = [json.loads(ln[len(_RESULT):]) for ln in proc.stdout.splitlines() if ln.startswith(_RESULT)]
    tail = "" if proc.returncode == 0 else f"exit {proc.returncode}\n{proc.stderr[-6000:]}"
    return results, tail


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log", help="the VTOKEN_TRITON_LAUNCH_LOG file the interpreted suite wrote")
    parser.add_argument("--triton-path", help="a directory holding another triton, put first on PYTHONPATH")
    parser.add_argument("--archs", default=",".join(map(str, ARCHS)), help="comma-separated sm versions")
    ns = parser.parse_args(argv)
    entries = read_log(ns.log)
    if not entries:
        print(f"compile lane: no launch recorded in {ns.log}", file=sys.stderr)
        return 1
    archs = [int(a) for a in ns.archs.split(",")]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=2) as pool:
        outs = list(pool.map(lambda a: run_arch(os.path.abspath(ns.log), a, ns.triton_path), archs))
    failed = False
    version = next((r["triton"] for res, _ in outs for r in res), "?")
    print(f"compile lane (triton {version}): {len(entries)} launches recorded, "
          f"{len({e['module'] + ':' + e['qualname'] for e in entries})} kernels")
    for arch, (results, tail) in zip(archs, outs):
        errors = [r for r in results if r["error"]]
        print(f"  sm_{arch}: {len(results)} distinct specializations, {len(results) - len(errors)} compiled, "
              f"{len(errors)} failed, {sum(r['seconds'] for r in results):.1f} s compiling")
        for r in errors:
            print(f"    FAIL {r['kernel']}\n      specialization {r['key']}\n      {r['error']}")
        if tail:
            print(f"    compile process died: {tail}")
        failed |= bool(errors) or bool(tail) or not results
    print(f"  wall {time.perf_counter() - t0:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
