"""Triton kernels for vtoken, one module per op.

Each module's public launch wrapper validates its inputs, allocates what it
needs, and launches the private ``_<op>_kernel`` defined last in the file.
Callers normally go through :mod:`vtoken.ops`, which picks a backend.
"""
