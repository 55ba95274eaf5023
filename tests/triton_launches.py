"""Record every Triton launch the interpreted suite makes, for the compile lane (tests/compile_lane.py).

Active when ``VTOKEN_TRITON_LAUNCH_LOG`` names a file and ``TRITON_INTERPRET=1``:
:func:`install` wraps ``InterpretedFunction.run`` (what ``kernel[grid](...)``
calls under the interpreter) and appends one JSON line per distinct launch:
the kernel's ``module`` and ``qualname``, its positional ``args`` and its
``kwargs`` (constexprs and launch options such as ``num_warps``), each value
encoded by :func:`encode`. The lane replays them through the real
``JITFunction``'s own binder, so what decides the specialization (ints equal
to 1, divisibility by 16, dtypes) is Triton's code, not ours.

NOTE: a tensor keeps its ``data_ptr``: divisibility by 16 of a pointer is part
of the specialization. CPU allocations are 64-byte aligned like CUDA's, so an
offset view (``t[1:]``) is what makes a pointer unaligned on both.
"""
from __future__ import annotations

import json
import os
import threading

LOG_ENV = "VTOKEN_TRITON_LAUNCH_LOG"

_lock = threading.Lock()
_seen: set[str] = set()


def encode(value):
    """A JSON-able form of one launch argument; raises TypeError on a kind the lane cannot replay."""
    import torch
    import triton.language as tl

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "data_ptr": value.data_ptr()}
    if isinstance(value, tl.dtype):
        return {"tl_dtype": value.name}
    if isinstance(value, tl.constexpr):
        return encode(value.value)
    if isinstance(value, (tuple, list)):
        return {"tuple": [encode(v) for v in value]}
    raise TypeError(f"launch argument: expected a tensor, number, bool, None, str or tl.dtype, got {type(value).__name__}")


def record(path: str, fn, args, kwargs) -> None:
    """Append the launch of ``fn`` (the kernel's Python function) to ``path`` unless already there."""
    entry = {"module": fn.__module__, "qualname": fn.__qualname__,
             "args": [encode(a) for a in args], "kwargs": {k: encode(v) for k, v in kwargs.items()}}
    line = json.dumps(entry, sort_keys=True)
    with _lock:
        if line in _seen:
            return
        _seen.add(line)
        with open(path, "a") as f:
            f.write(line + "\n")


def install() -> bool:
    """Wrap the interpreter's launch entry point when the log is asked for; returns whether it did."""
    if not os.environ.get(LOG_ENV) or os.environ.get("TRITON_INTERPRET") != "1":
        return False
    from triton.runtime.interpreter import InterpretedFunction

    if getattr(InterpretedFunction.run, "_vtoken_recorder", False):
        return True
    inner = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        path = os.environ.get(LOG_ENV)  # read per launch: a test may point it elsewhere for a while
        if path:
            record(path, self.fn, args, kwargs)
        return inner(self, *args, grid=grid, warmup=warmup, **kwargs)

    run._vtoken_recorder = True
    InterpretedFunction.run = run
    return True
