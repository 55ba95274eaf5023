"""Benchmark block_live_counts: live tokens per block + F, against torch.bincount.

GPU (default when CUDA is present): mirrors of 1M and 4M tokens (random
unique slots, some PAD, 50% or 90% alive) over caches of 64K / 256K blocks of
16 tokens (the CUDA op's warp-aggregated global atomics) and 1K blocks of 1024
tokens (its shared-memory histogram), with an ``allocated`` mask. Each backend is
captured in a CUDA graph and replayed (``time_graph``). Rows give:

* ``us``: median time per call;
* ``GBps``: minimum traffic per second: slot (4 B) + alive (1 B) of every token
  read, the allocated mask read and the counts written once;
* ``frac_copy``: that over the D2D ``torch`` copy bandwidth measured in this run;
* ``x_bincount``: speedup over ``torch.bincount`` of the live tokens' blocks
  (``torch.where`` to a dummy bin, then ``bincount(minlength=num_blocks + 1)``)
  plus the F reduction, timed eagerly in the same run (bincount reads the
  maximum on the host, so it cannot be graph-captured).

The torch reference (``index_add_``, graph-capturable) is timed too.

``--quick`` (and any run without CUDA): small sizes on the CPU; the torch
reference and the C++ CPU op (when built) against the bincount baseline, single-threaded. The
Triton interpreter is not timed; the CPU run checks once that it matches.

Usage: ``python bench/bench_block_live_counts.py [--quick]``; writes
``bench/results/block_live_counts.json``.
"""
from __future__ import annotations

import argparse

from common import (
    bench_device,
    copy_bandwidth_gbs,
    gbs,
    on_gpu,
    prepare_kernel_env,
    print_table,
    time_fn,
    time_graph,
    write_json,
)

prepare_kernel_env()  # before vtoken / triton imports
import torch  # noqa: E402

from vtoken import PAD_SLOT  # noqa: E402
from vtoken.device import ops  # noqa: E402
from vtoken.reference import block_live_counts as ref  # noqa: E402
import vtoken_kernels.block_live_counts as tk  # noqa: E402

PAD = PAD_SLOT


class Case:
    def __init__(self, num_tokens, num_blocks, density, device, *, block_size=16, seed=0):
        g = torch.Generator().manual_seed(seed)
        num_tokens = min(num_tokens, num_blocks * block_size)
        self.num_tokens, self.num_blocks, self.density, self.block_size = num_tokens, num_blocks, density, block_size
        slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(torch.int32)
        slots[::13] = PAD
        self.slots = slots.to(device)
        self.alive = (torch.rand(num_tokens, generator=g) < density).to(torch.int8).to(device)
        self.allocated = (torch.rand(num_blocks, generator=g) < 0.8).to(device)

    def nbytes(self) -> int:
        return 5 * self.num_tokens + 5 * self.num_blocks

    def name(self) -> str:
        return f"T={self.num_tokens} blocks={self.num_blocks}x{self.block_size} alive={self.density:g}"


def bincount_baseline(c: Case):
    s = c.slots.to(torch.int64)
    valid = (c.alive != 0) & (s >= 0) & (s < c.num_blocks * c.block_size)
    blk = torch.where(valid, s // c.block_size, c.num_blocks)
    counts = torch.bincount(blk, minlength=c.num_blocks + 1)[: c.num_blocks]
    live = (counts * c.allocated).sum()
    f = 1.0 - live.double() / (c.allocated.sum() * c.block_size).double()
    return counts.to(torch.int32), f.float()


def backends(device):
    out = []
    if ops.has_extension_op("block_live_counts"):
        out.append(("cuda" if device.type == "cuda" else "cpp",
                    lambda c: torch.ops.vtoken.block_live_counts(c.slots, c.alive, c.allocated, c.num_blocks,
                                                                 c.block_size)))
    if device.type == "cuda":
        out.append(("triton", lambda c: tk.block_live_counts(c.slots, c.alive, c.num_blocks, c.block_size, c.allocated)))
    out.append(("torch_ref", lambda c: ref.block_live_counts(c.slots, c.alive, c.num_blocks, c.block_size, c.allocated)))
    return out


def check(c: Case, fn) -> None:
    want = ref.block_live_counts(c.slots, c.alive, c.num_blocks, c.block_size, c.allocated)
    got = fn(c)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), "backend disagrees with the reference"


def run(cases, copy_gbs, device):
    rows, summary = [], []
    for c in cases:
        base = time_fn(lambda: bincount_baseline(c))["median_us"]
        rows.append({"case": c.name(), "backend": "bincount", "us": base, "GBps": gbs(c.nbytes(), base),
                     "frac_copy": gbs(c.nbytes(), base) / copy_gbs, "x_bincount": 1.0})
        for name, fn in backends(device):
            check(c, fn)
            us = (time_graph(lambda: fn(c)) if on_gpu() else time_fn(lambda: fn(c)))["median_us"]
            row = {"case": c.name(), "backend": name, "us": us, "GBps": gbs(c.nbytes(), us),
                   "frac_copy": gbs(c.nbytes(), us) / copy_gbs, "x_bincount": base / us}
            rows.append(row)
            if name in ("cuda", "triton", "cpp"):
                summary.append({k: row[k] for k in ("case", "backend", "us", "frac_copy", "x_bincount")})
    return rows, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small CPU-sized run")
    args = parser.parse_args()
    device = bench_device()
    quick = args.quick or not on_gpu()
    if quick:
        device = torch.device("cpu")
        # NOTE: single-threaded on purpose: on a loaded 2-core CI machine, torch's
        # OpenMP threads spinning against other processes made the bincount
        # baseline 300x slower in one run (233 ms vs 0.7 ms at 100K tokens).
        torch.set_num_threads(1)
        cases = [Case(20_000, 2_000, 0.5, device), Case(100_000, 20_000, 0.9, device),
                 Case(50_000, 100, 0.5, device, block_size=1024)]
        small = Case(5000, 700, 0.5, device, seed=1)
        check(small, lambda c: tk.block_live_counts(c.slots, c.alive, c.num_blocks, c.block_size, c.allocated))
        print("triton (interpreter) matches the torch reference on", small.name())
    else:
        cases = [
            Case(1 << 20, 1 << 16, 0.5, device),
            Case(1 << 22, 1 << 18, 0.9, device),
            Case(1 << 20, 1024, 0.5, device, block_size=1024),
        ]
    copy_gbs = copy_bandwidth_gbs()
    rows, summary = run(cases, copy_gbs, device)
    print(f"D2D copy bandwidth (read + write): {copy_gbs:.1f} GB/s on {device}")
    print_table("block_live_counts", rows)
    path = write_json("block_live_counts", {"copy_gbs": copy_gbs, "quick": quick, "rows": rows, "summary": summary})
    print("wrote", path)


if __name__ == "__main__":
    main()
