"""Benchmark build_slot_lists: a batch's slot lists read in place from the device mirror.

GPU (default when CUDA is present): batches of ``num_reqs`` requests with
``live`` live tokens each, the mirror holding ``live / (1 - dead)`` tokens per
request (``dead`` = fraction of evicted tokens) in a segment with 25% slack,
the segments in a shuffled mirror order (so the batch reads the mirror through
per-request starts, as after any batch reordering), one new token per request
(decode) or 512 (a prefill chunk). Goal: a rebuild of 256 requests x 4K live
tokens in <= 10 us. Each backend is captured in a CUDA graph and the replay
timed with CUDA events (``time_graph``), as the engine runs it. Rows give:

* ``us``: median time per call;
* ``GBps``: the op's minimum traffic per second: alive (1 B) and slot (4 B)
  of every batch token read once, ``kv_indices`` and ``kv_pos`` (4 B each per
  live token), ``kv_indptr`` and ``slot_mapping`` written once, the new
  tokens' slots read once;
* ``frac_copy``: that over the D2D ``torch`` copy bandwidth measured in this
  run (read + write counted);
* ``x_masked_select``: speedup over a plain torch implementation timed in the
  same run (index gather + ``masked_select`` + ``cumsum``; eager, since
  ``masked_select`` and ``repeat_interleave`` sync with the host to size
  their outputs).

The torch reference (sync-free scatter formulation, graph-capturable) is
timed as a second baseline.

``--quick`` (and any run without CUDA): small sizes on the CPU; the torch
reference and the C++ CPU op (when built) against the masked_select baseline,
medians and ratios from this process, single-threaded. The Triton interpreter
is meaningless for speed, so the CPU run only checks once that Triton matches
the reference.

Usage: ``python bench/bench_build_slot_lists.py [--quick]``; writes
``bench/results/build_slot_lists.json``.
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
from vtoken.reference import build_slot_lists as ref  # noqa: E402
import vtoken_kernels.build_slot_lists as tk  # noqa: E402

PAD = PAD_SLOT


class Case:
    """A batch of ``num_reqs`` requests with exactly ``live`` live tokens each, in a shuffled mirror, and its buffers."""

    def __init__(self, num_reqs, live, dead, new, device, seed=0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        per_req = max(int(round(live / (1.0 - dead))), live)
        seg = per_req + per_req // 4  # the mirror's 25% slack per segment
        self.num_reqs, self.live, self.dead, self.new, self.per_req = num_reqs, live, dead, new, per_req
        self.batch_tokens = num_reqs * per_req
        mirror_len = num_reqs * seg
        self.slots = torch.randperm(2 * mirror_len, generator=g)[:mirror_len].to(torch.int32).to(device)
        # Exactly `live` live tokens per request, the last `new` (the new ones) always live; slack dead.
        keys = torch.rand(num_reqs, per_req, generator=g)
        keys[:, per_req - new :] = -1.0
        order = keys.argsort(dim=1)[:, :live]
        alive = torch.zeros(num_reqs, seg, dtype=torch.int8)
        alive[:, :per_req].scatter_(1, order, 1)
        # Request r of the batch sits in segment place[r]: batch order != mirror order.
        place = torch.randperm(num_reqs, generator=g)
        self.starts = (place * seg).to(torch.int64).to(device)
        self.alive = alive[place.argsort()].view(-1).to(device)  # request r's tokens live in segment place[r]
        self.lens = torch.full((num_reqs,), per_req, dtype=torch.int64, device=device)
        self.counts = torch.full((num_reqs,), new, dtype=torch.int64, device=device)
        self.nnz_max = num_reqs * live
        self.max_tokens = num_reqs * new
        self.bufs = (
            torch.empty(self.nnz_max, dtype=torch.int32, device=device),
            torch.empty(num_reqs + 1, dtype=torch.int32, device=device),
            torch.empty(self.max_tokens, dtype=torch.int32, device=device),
            torch.empty(self.nnz_max, dtype=torch.int32, device=device),
        )

    def args(self):
        """The op's arguments, as ``torch.ops.vtoken.build_slot_lists`` takes them."""
        return (self.slots, self.alive, self.starts, self.lens, self.counts, *self.bufs, self.num_reqs)

    def build_bytes(self) -> int:
        return self.batch_tokens * 5 + 8 * self.nnz_max + 4 * (self.num_reqs + 1) + 8 * self.max_tokens

    def name(self) -> str:
        return f"{self.num_reqs}x{self.live} dead={self.dead:g} new={self.new}"


def masked_select_baseline(c: Case) -> None:
    """The same outputs with plain torch ops (repeat_interleave / masked_select size their outputs on the host)."""
    kv_indices, kv_indptr, slot_mapping, kv_pos = c.bufs
    first = torch.cumsum(c.lens, 0) - c.lens
    req = torch.repeat_interleave(torch.arange(c.num_reqs, device=c.lens.device), c.lens)
    logical = torch.arange(req.numel(), device=req.device) - first[req]
    where = c.starts[req] + logical
    live = c.alive[where] != 0
    sel = torch.masked_select(c.slots[where], live)
    kv_indices[: sel.numel()] = sel
    kv_indices[sel.numel() :] = PAD
    pos = torch.masked_select(logical, live)
    kv_pos[: pos.numel()] = pos.to(torch.int32)
    kv_pos[pos.numel() :] = PAD
    prefix = torch.cat([torch.zeros(1, dtype=torch.int64, device=live.device), torch.cumsum(live, 0)])
    kv_indptr.copy_(prefix[torch.cat([first, first[-1:] + c.lens[-1:]])])
    new = torch.masked_select(c.slots[where], logical >= (c.lens - c.counts)[req])
    slot_mapping[: new.numel()] = new
    slot_mapping[new.numel() :] = PAD


def backends(device):
    """(name, build) for every backend usable on ``device``."""
    out = []
    if ops.has_extension_op("build_slot_lists"):
        out.append(("cuda" if device.type == "cuda" else "cpp", lambda c: torch.ops.vtoken.build_slot_lists(*c.args())))
    if device.type == "cuda":
        out.append(("triton", lambda c: tk.build_slot_lists(*c.args())))
    out.append(("torch_ref", lambda c: ref.build_slot_lists(*c.args())))
    return out


def check_against_reference(c: Case, build) -> None:
    want = [torch.empty_like(b) for b in c.bufs]
    ref.build_slot_lists(*c.args()[:5], *want, c.num_reqs)
    for b in c.bufs:
        b.fill_(-77)
    build(c)
    if on_gpu():
        torch.cuda.synchronize()
    for got, w in zip(c.bufs, want):
        assert torch.equal(got, w), "backend disagrees with the torch reference"


def time_call(fn) -> dict:
    return time_graph(fn) if on_gpu() else time_fn(fn)


def run(cases, copy_gbs, device):
    rows, summary = [], []
    for c in cases:
        check_against_reference(c, masked_select_baseline)
        base = time_fn(lambda: masked_select_baseline(c))
        rows.append({"case": c.name(), "backend": "masked_select", "us": base["median_us"],
                     "GBps": gbs(c.build_bytes(), base["median_us"]),
                     "frac_copy": gbs(c.build_bytes(), base["median_us"]) / copy_gbs, "x_masked_select": 1.0})
        for name, build in backends(device):
            check_against_reference(c, build)
            us = time_call(lambda: build(c))["median_us"]
            rows.append({"case": c.name(), "backend": name, "us": us,
                         "GBps": gbs(c.build_bytes(), us), "frac_copy": gbs(c.build_bytes(), us) / copy_gbs,
                         "x_masked_select": base["median_us"] / us})
            if c.num_reqs == 256 and c.live == 4096 and name in ("cuda", "triton"):
                summary.append({"case": c.name(), "backend": name, "us": us, "goal_us": 10.0, "goal_met": us <= 10.0,
                                "frac_copy": gbs(c.build_bytes(), us) / copy_gbs,
                                "x_masked_select": base["median_us"] / us})
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
        cases = [Case(16, 512, 0.5, 1, device), Case(64, 256, 0.0, 1, device), Case(8, 1024, 0.3, 64, device)]
        # The interpreter is not a speed measurement: check once that Triton agrees.
        small = Case(5, 300, 0.5, 2, device, seed=1)
        check_against_reference(small, lambda c: tk.build_slot_lists(*c.args()))
        print("triton (interpreter) matches the torch reference on", small.name())
    else:
        cases = [
            Case(256, 4096, 0.0, 1, device),
            Case(256, 4096, 0.5, 1, device),
            Case(256, 4096, 0.0, 512, device),
            Case(64, 4096, 0.0, 1, device),
            Case(1024, 1024, 0.3, 1, device),
            Case(8, 131072, 0.0, 1, device),
        ]
    copy_gbs = copy_bandwidth_gbs()
    rows, summary = run(cases, copy_gbs, device)
    print(f"D2D copy bandwidth (read + write): {copy_gbs:.1f} GB/s on {device}")
    print_table("build_slot_lists", rows)
    path = write_json("build_slot_lists", {"copy_gbs": copy_gbs, "quick": quick, "rows": rows,
                                           "summary": summary or [
                                               {k: r[k] for k in ("case", "backend", "us", "x_masked_select")}
                                               for r in rows if r["backend"] != "masked_select"][:4]})
    print("wrote", path)


if __name__ == "__main__":
    main()
