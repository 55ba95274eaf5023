"""Build logic for the compiled extension ``vtoken._C`` (called from setup.py).

The build is split in two so that it works against a CPU-only torch as well as
a CUDA torch:

* every ``csrc/*.cu`` is compiled by ``nvcc`` into an object file. These files
  include no torch header: they hold plain CUDA C++ kernels and the
  ``extern "C"`` launchers declared in ``csrc/vtoken_kernels.h``;
* every ``csrc/*.cpp`` (the op bindings, their C++ CPU kernels, the module
  init) is compiled by torch's ``CppExtension`` machinery, and the CUDA objects
  are linked into the same shared library together with ``libcudart``.

``CUDAExtension`` is not used because it refuses to build against a CPU torch,
and CI builds the extension against the CPU torch with nvcc 13.0 so the
binding path is tested there (the CUDA kernels are compiled, not run).

New ``.cu`` / ``.cpp`` files are picked up by globbing ``csrc/``; nothing has to
be registered here. ``csrc/testing/`` is not globbed: its test-only ops stay out
of the shipped library (the tests build them themselves).

Environment knobs:

``CUDA_HOME``             toolkit root (default: torch's guess, then nvcc's
                          location, then ``/usr/local/cuda``)
``VTOKEN_NVCC_GENCODE``   replaces the default ``-gencode`` flags, e.g.
                          ``"-gencode arch=compute_90,code=sm_90"``. On a GPU
                          without code in the build, vtoken.device.ops falls back to
                          Triton (vtoken::kernel_image_status tells).
``MAX_JOBS``              parallel compile jobs (nvcc and ninja)
"""
from __future__ import annotations

import glob
import os
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

# sm_80 (A100) and sm_90 (H100/H200) SASS: the GPUs vtoken targets. Plus
# compute_90 PTX, which the driver JIT-compiles on newer GPUs (sm_100, ...):
# without it the ops would load there and fail at launch with "no kernel image".
DEFAULT_GENCODE = (
    "-gencode", "arch=compute_80,code=sm_80",
    "-gencode", "arch=compute_90,code=sm_90",
    "-gencode", "arch=compute_90,code=compute_90",
)
NVCC_FLAGS = ("-O3", "-std=c++17", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr")


def _has_runtime_headers(home: str | None) -> bool:
    return bool(home) and os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h"))


def find_cuda_home() -> str:
    """Return the CUDA toolkit root, or raise RuntimeError saying what was tried."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    try:
        from torch.utils.cpp_extension import CUDA_HOME as torch_cuda_home

        candidates.append(torch_cuda_home)
    except ImportError:
        pass
    nvcc = shutil.which("nvcc")
    if nvcc:
        # NOTE: /usr/local/bin/nvcc may be a wrapper script rather than a
        # symlink, so its directory does not always lead to the toolkit root.
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if _has_runtime_headers(home):
            return os.path.realpath(home)
    tried = [c for c in candidates if c]
    raise RuntimeError(f"vtoken: CUDA toolkit not found (tried {tried}); set CUDA_HOME")


def find_cudart_libdir(cuda_home: str) -> str:
    """The directory that holds ``libcudart.so`` under ``cuda_home``."""
    subdirs = ["lib64", "lib"] + [
        os.path.relpath(d, cuda_home) for d in sorted(glob.glob(os.path.join(cuda_home, "targets", "*", "lib")))
    ]
    for sub in subdirs:
        d = os.path.join(cuda_home, sub)
        if glob.glob(os.path.join(d, "libcudart.so*")):
            return d
    raise RuntimeError(f"vtoken: libcudart.so not found under {cuda_home} ({subdirs})")


def find_nvcc(cuda_home: str) -> str:
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    if os.path.exists(nvcc):
        return nvcc
    nvcc = shutil.which("nvcc")
    if not nvcc:
        raise RuntimeError(f"vtoken: nvcc not found in {cuda_home}/bin or on PATH")
    return nvcc


def _jobs() -> int:
    try:
        return max(1, int(os.environ.get("MAX_JOBS", "")))
    except ValueError:
        return max(1, os.cpu_count() or 1)


def _newest_mtime(paths) -> float:
    return max((os.path.getmtime(p) for p in paths), default=0.0)


def make_extension(root: str):
    """Return ``(ext_modules, cmdclass)`` that build ``vtoken._C`` from ``root/csrc``."""
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    csrc = os.path.join(root, "csrc")
    cu_sources = sorted(glob.glob(os.path.join(csrc, "*.cu")))
    cpp_sources = sorted(glob.glob(os.path.join(csrc, "*.cpp")))
    headers = sorted(glob.glob(os.path.join(csrc, "*.h")) + glob.glob(os.path.join(csrc, "*.cuh")))
    if not cpp_sources:
        print("vtoken: skipping CUDA extension vtoken._C: csrc/ has no .cpp sources", file=sys.stderr)
        return [], {}

    cuda_home = find_cuda_home()
    cudart_dir = find_cudart_libdir(cuda_home)
    nvcc = find_nvcc(cuda_home)
    # A CUDA torch provides c10_cuda, so the bindings take the current stream
    # from c10::cuda directly; against a CPU torch they use c10::Stream's
    # native handle (never reached at runtime: a CPU torch has no CUDA tensor).
    torch_has_cuda = torch.version.cuda is not None
    define_macros = [("VTOKEN_WITH_CUDA_TORCH", "1")] if torch_has_cuda else []
    libraries = ["cudart"] + (["c10_cuda"] if torch_has_cuda else [])

    ext = CppExtension(
        name="vtoken._C",
        sources=[os.path.relpath(p, root) for p in cpp_sources],
        include_dirs=[csrc, os.path.join(cuda_home, "include")],
        library_dirs=[cudart_dir],
        libraries=libraries,
        define_macros=define_macros,
        extra_compile_args={"cxx": ["-O3"]},
        # rpath: libcudart is found without LD_LIBRARY_PATH. Loading it needs
        # no driver; nothing in vtoken._C calls CUDA at import time.
        extra_link_args=[f"-Wl,-rpath,{cudart_dir}"],
    )
    gencode = tuple(shlex.split(os.environ.get("VTOKEN_NVCC_GENCODE", ""))) or DEFAULT_GENCODE

    class VTokenBuildExt(BuildExtension):
        """BuildExtension that first compiles csrc/*.cu with nvcc into objects."""

        def build_extensions(self):
            objects = self._compile_cuda_objects()
            for e in self.extensions:
                if e.name == "vtoken._C":
                    e.extra_objects = list(e.extra_objects or []) + objects
            t0 = time.perf_counter()
            super().build_extensions()
            print(f"vtoken: C++ bindings compiled and linked in {time.perf_counter() - t0:.1f}s")

        def _compile_cuda_objects(self):
            out_dir = os.path.join(os.path.abspath(self.build_temp), "vtoken_cu")
            os.makedirs(out_dir, exist_ok=True)
            header_mtime = _newest_mtime(headers)
            jobs = []
            for src in cu_sources:
                obj = os.path.join(out_dir, os.path.splitext(os.path.basename(src))[0] + ".o")
                stale = not os.path.exists(obj) or os.path.getmtime(obj) < max(os.path.getmtime(src), header_mtime)
                cmd = [nvcc, *gencode, *NVCC_FLAGS, "-I", csrc, "-c", src, "-o", obj]
                jobs.append((src, obj, cmd, stale))

            def run(job):
                src, obj, cmd, stale = job
                if not stale:
                    return src, 0.0, None
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    return src, 0.0, f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
                return src, time.perf_counter() - t0, None

            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=_jobs()) as pool:
                results = list(pool.map(run, jobs))
            errors = [err for _, _, err in results if err]
            if errors:
                raise RuntimeError("vtoken: nvcc failed:\n" + "\n".join(errors))
            built = [f"{os.path.basename(s)} {dt:.1f}s" for s, dt, _ in results if dt]
            if built:
                print(f"vtoken: nvcc {' '.join(gencode)}: {', '.join(built)} "
                      f"(wall {time.perf_counter() - t0:.1f}s)")
            return [obj for _, obj, _, _ in jobs]

    return [ext], {"build_ext": VTokenBuildExt.with_options(use_ninja=shutil.which("ninja") is not None)}
