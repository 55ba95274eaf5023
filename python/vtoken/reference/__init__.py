"""Torch reference implementations of every vtoken op, one module per op.

These define the semantics the Triton and CUDA kernels must match exactly
(copy/index ops) or within a stated tolerance (attention).
"""
