"""Build script for vtoken.

Installs two packages: ``vtoken`` (from ``python/vtoken``) and ``vtoken_kernels``
(Triton kernels). The CUDA extension ``vtoken._C`` is built from ``csrc/`` when a
CUDA toolchain and torch are usable, or when ``VTOKEN_BUILD_CUDA=1``; it is skipped
when ``VTOKEN_BUILD_CUDA=0``. When it is skipped, one line says why, and vtoken
falls back to Triton / torch reference kernels (see ``vtoken.device.ops``).

Install without build isolation so the extension builds against the torch you
already have (an isolated build would pull a different torch):
    pip install --no-build-isolation --use-pep517 -e .
"""
import os
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _cuda_extension_decision():
    """Return (build: bool, reason: str) for the vtoken._C extension."""
    flag = os.environ.get("VTOKEN_BUILD_CUDA", "").strip()
    if flag == "0":
        return False, "VTOKEN_BUILD_CUDA=0"
    try:
        import torch  # noqa: F401
        from torch.utils import cpp_extension  # noqa: F401
    except ImportError:
        return False, "torch is not importable in the build environment (use --no-build-isolation)"
    nvcc = shutil.which("nvcc") or (
        os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None
    )
    if flag == "1":
        if not nvcc or not os.path.exists(nvcc):
            return False, "VTOKEN_BUILD_CUDA=1 but nvcc was not found (set CUDA_HOME)"
        return True, "VTOKEN_BUILD_CUDA=1"
    if nvcc and os.path.exists(nvcc):
        return True, f"nvcc found at {nvcc}"
    return False, "nvcc not found (set CUDA_HOME or VTOKEN_BUILD_CUDA=1)"


def _ext_modules_and_cmdclass():
    build, reason = _cuda_extension_decision()
    if not build:
        print(f"vtoken: skipping CUDA extension vtoken._C: {reason}", file=sys.stderr)
        return [], {}
    if not os.path.exists(os.path.join(ROOT, "csrc", "build_ext.py")):
        print("vtoken: skipping CUDA extension vtoken._C: csrc/build_ext.py is missing", file=sys.stderr)
        return [], {}
    sys.path.insert(0, os.path.join(ROOT, "csrc"))
    from build_ext import make_extension  # csrc/build_ext.py: nvcc for .cu, CppExtension for .cpp

    return make_extension(ROOT)


ext_modules, cmdclass = _ext_modules_and_cmdclass()

setup(
    name="vtoken",
    version="0.1.0",
    description="Token-level KV virtualization for paged LLM serving: token tables, "
    "token-indexed attention and lazy request-local compaction.",
    long_description=open(os.path.join(ROOT, "README.md")).read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    package_dir={"vtoken": "python/vtoken", "vtoken_kernels": "vtoken_kernels"},
    packages=["vtoken_kernels"]
    + ["vtoken" + p[len("vtoken"):] for p in find_packages("python", include=["vtoken", "vtoken.*"])],
    package_data={"vtoken.experiments": ["prompts.jsonl"]},  # the shipped chat prompt set
    # torch is not pinned here: GPU servers bring their own CUDA build. On CPU
    # machines install torch==2.13.0 first (see README) so pip never pulls CUDA torch.
    # Supported: torch >= 2.11, Triton >= 3.6 (vtoken.versions checks both at run time).
    # NOTE: Triton is not required: Linux CUDA torch wheels already depend on the
    # Triton they were built with, and on a CPU install it only serves the
    # interpreter (the tests); without it vtoken.device.ops uses the extension or the
    # torch reference. The "triton" extra adds it.
    install_requires=["numpy>=1.24", "torch>=2.11"],
    extras_require={
        "triton": ["triton>=3.6"],
        # transformers 5.19 verified against torch 2.13 CPU (it pulls no torch); fidelity tests only.
        # ninja: torch.utils.cpp_extension.load builds the test-only ops (csrc/testing/) with it.
        # triton: the kernel tests run it (its interpreter on CPU).
        # matplotlib: the experiments' --plot figures are written in the tests.
        "test": ["pytest", "hypothesis", "triton>=3.6", "transformers==5.19.0", "safetensors>=0.4", "ninja",
                 "gguf>=0.17", "matplotlib"],
        "bench": ["matplotlib", "rich", "tabulate", "nvidia-ml-py"],
        # Real checkpoints (vtoken.checkpoints): GGUF reading, HF export, tokenizers and chat templates.
        "models": ["gguf>=0.17", "transformers==5.19.0", "safetensors>=0.4"],
        "vllm": ["vllm>=0.32.0,<0.33"],  # = vtoken.integrations.vllm.SUPPORTED_VLLM_SPEC; tested: 0.32.0
    },
    entry_points={
        "console_scripts": ["vtoken=vtoken.cli:main"],
        "vllm.general_plugins": ["vtoken=vtoken.integrations.vllm.plugin:register"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
