"""Triton kernels for vtoken, one module per op, with their argument contracts.

Each op's contract (``check_*`` / ``validate_*``) lives in
:mod:`vtoken_kernels.contracts`, next to the kernels; :mod:`vtoken.device.ops` checks
it once per call, then dispatches. A module's public launch wrapper takes
validated arguments, allocates what it needs, and launches the private
``_<op>_kernel`` defined last in the file. ``vtoken_kernels`` never imports
``vtoken`` (``tests/test_layering.py``).
"""
