"""Shared benchmark plumbing: timing, copy-bandwidth baseline, table + JSON output.

GPU timings use CUDA events through ``triton.testing.do_bench`` (median and
quantiles, no host sync per iteration). CPU timings use ``time.perf_counter``
medians over repeats; on CPU, report ratios against a baseline timed in the
same process rather than absolute speed.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch

# VTOKEN_BENCH_RESULTS: another folder for the JSON files (gpu_check.sh keeps one run's files together).
RESULTS_DIR = os.environ.get("VTOKEN_BENCH_RESULTS") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def prepare_kernel_env() -> None:
    """Set up the environment for a kernel benchmark; call it before importing vtoken.

    NOTE: it must precede any Triton import: without CUDA, Triton kernels only
    run in the interpreter. The debug flag is forced off because its contract
    checks would add host work (and syncs) to every timed call.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ["VTOKEN_DEBUG_INVARIANTS"] = "0"


def on_gpu() -> bool:
    return torch.cuda.is_available()


def bench_device() -> torch.device:
    return torch.device("cuda" if on_gpu() else "cpu")


def time_fn(fn, *, warmup: int = 3, rep: int = 20) -> dict:
    """Median / p20 / p80 time of ``fn()`` in microseconds.

    On GPU: ``triton.testing.do_bench`` (CUDA events, L2 flushed between reps).
    On CPU: wall-clock over ``rep`` calls after ``warmup`` calls.
    """
    if on_gpu():
        import triton.testing

        q = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])
        return {"median_us": q[0] * 1e3, "p20_us": q[1] * 1e3, "p80_us": q[2] * 1e3}
    return host_time(fn, warmup=warmup, rep=rep)


def host_time(fn, *, warmup: int = 3, rep: int = 20) -> dict:
    """Median / p20 / p80 wall-clock time of ``fn()`` in microseconds, on any machine.

    For host-only work (bookkeeping, policies), also on a GPU machine: ``rep``
    timed calls after ``warmup`` untimed ones.
    """
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    samples.sort()
    return {
        "median_us": statistics.median(samples),
        "p20_us": samples[int(0.2 * (len(samples) - 1))],
        "p80_us": samples[int(0.8 * (len(samples) - 1))],
    }


def time_graph(fn, *, rep: int = 200) -> dict:
    """Median time of a small launch captured in a CUDA graph (GPU only), in µs."""
    assert on_gpu(), "time_graph needs CUDA"
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return time_fn(g.replay)


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth (GB/s, read + write counted).

    The reference every GPU benchmark reports its fraction of. On CPU this is a
    memcpy of a smaller buffer, reported for context only.
    """
    dev = bench_device()
    if dev.type == "cpu":
        nbytes = min(nbytes, 64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src))
    return 2 * nbytes / (t["median_us"] * 1e-6) / 1e9


def gbs(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e9


def print_table(title: str, rows: list[dict]) -> None:
    """Print rows as an aligned text table (tabulate when installed)."""
    print(f"\n== {title} ==")
    if not rows:
        print("(no rows)")
        return
    try:
        from tabulate import tabulate

        print(tabulate(rows, headers="keys", floatfmt=".3g"))
        return
    except ImportError:
        pass
    keys = list(rows[0].keys())
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    widths = [max(len(k), *(len(fmt(r.get(k, ""))) for r in rows)) for k in keys]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths)))
    for r in rows:
        print("  ".join(fmt(r.get(k, "")).rjust(w) for k, w in zip(keys, widths)))


def write_json(name: str, payload: dict) -> str:
    """Write ``<RESULTS_DIR>/<name>.json`` (default ``bench/results``) with device info; return its path."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    payload = dict(payload)
    payload.setdefault(
        "device", torch.cuda.get_device_name() if on_gpu() else "cpu"
    )
    payload.setdefault("date", time.strftime("%Y-%m-%d"))
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path
