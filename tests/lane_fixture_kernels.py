"""Tiny Triton kernels for tests/test_compile_lane.py (importable by name from the lane's compile process)."""
import triton
import triton.language as tl


@triton.jit
def _widen_kernel(
    # Outputs
    out_ptr,  # [1] int64
    # Constants
    n,
):
    # Grid: (1,)
    # NOTE: deliberately the bug class the lane exists for: n.to() does not
    # compile when the JIT has turned n == 1 into a constant.
    tl.store(out_ptr, n.to(tl.int64))


@triton.jit
def _scale_kernel(
    # Inputs
    x_ptr,  # [n] float32
    # Outputs
    y_ptr,  # [n] float32
    # Constants
    n,
    BLOCK: tl.constexpr,
):
    # Grid: (cdiv(n, BLOCK),)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)
