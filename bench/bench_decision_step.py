"""Decision loop: how the device step's work scales with the buffers, the step's entries fixed.

``DecisionLoop._device_step`` (policy state update, victim selection, kills,
block counts, record) runs over fixed-shape buffers: the slot lists' entry
bucket (``[:bucket]``, the smallest rung >= the step's entries; ``nnz_max``
before buckets), the device mirror's capacity, every KV slot. This
benchmark keeps one step's work fixed (``--reqs`` requests of ``--ctx`` live
tokens, each one token over its budget: one victim per request per step) and
grows the buffers by ``--scales`` (``nnz_max``, the mirror's capacity and the
KV cache's blocks all x scale), so what grows with the scale is work the
step does over whole buffers rather than over its own entries.

Reported per (policy, scale), medians over ``--steps`` decode steps:

* ``elements``: elements the step's aten ops touch, summed over ops (each op
  counts its largest operand; an in-place scatter or gather counts its index,
  not the tensor it writes or reads; a view (slice, select) touches none: a
  cost model, not a measurement);
* ``bucket``: the entries the step ran over (``nnz_max`` where it has no buckets);
* ``nnz_max_elements`` / ``bucket_elements`` / ``mirror_elements`` / ``slot_elements`` /
  ``block_elements``: the part of it in ops whose largest operand is that
  buffer's length (the mirror is twice ``nnz_max``, so those classes do not
  collide; a bucket equal to ``nnz_max`` counts in both);
* ``ops``: aten ops dispatched (a launch each on a GPU); ``sorts``: ``aten.sort``
  calls and the elements they sort;
* ``step_us``: the wall-clock of ``_device_step`` (CPU: the kernels run inline,
  so it grows with the buffer-length work; on a GPU it is the launch time).

Compare the rows of one run (scales) and two checkouts (before / after) run
on the same machine; ``--json`` prints one object per row.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common import bench_device, on_gpu, prepare_kernel_env, print_table

prepare_kernel_env()
if not on_gpu():
    os.environ.pop("TRITON_INTERPRET", None)  # the C++ CPU ops or the torch references stand in for kernels

from vtoken import policies as P  # noqa: E402
from vtoken.device.buffers import DeviceMirror, SlotListBuffers  # noqa: E402
from vtoken.decisions.loop import DecisionLoop  # noqa: E402
from vtoken.bookkeeping.ledger import BlockLedger  # noqa: E402
from vtoken.bookkeeping.pool import BlockPool  # noqa: E402
from vtoken.bookkeeping.table import TokenTable  # noqa: E402

S = 16
_GATHERS = {"index.Tensor", "index_select.default", "gather.default"}


class WorkCount(TorchDispatchMode):
    """Per aten op: its largest operand's elements (scatters and gathers: their index's)."""

    def __init__(self, lengths: dict):
        super().__init__()
        self.lengths = lengths  # buffer name -> length (a +1 trash entry counts as the buffer too)
        self.by_buffer = dict.fromkeys(lengths, 0)
        self.ops = self.elements = self.sorts = self.sorted = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__  # e.g. "index_add_.default"
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        for a in args:
            if isinstance(a, (list, tuple)):
                tensors += [t for t in a if isinstance(t, torch.Tensor)]
        outs = [o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, torch.Tensor)]
        if func.is_view:
            n = 0  # a view touches no element
        elif name.split(".")[0].endswith("_") and len(tensors) > 1:
            n = max(t.numel() for t in tensors[1:])  # in place: the index / source, not the whole target
        elif name in _GATHERS:
            n = max(o.numel() for o in outs)  # a gather touches its index's elements
        else:
            n = max([t.numel() for t in tensors + outs] or [0])
        self.ops += 1
        self.elements += n
        for buf, length in self.lengths.items():
            if n in (length, length + 1):
                self.by_buffer[buf] += n
        if name.startswith("sort"):
            self.sorts += 1
            self.sorted += tensors[0].numel()
        return out


class Workload:
    """``reqs`` requests of ``ctx`` tokens; buffers ``scale`` times the size the step needs."""

    def __init__(self, reqs: int, ctx: int, scale: int, device):
        self.reqs = list(range(reqs))
        need = reqs * (ctx + 64)
        self.num_blocks = scale * (reqs * (ctx // S + 8) + 16)
        self.table = TokenTable(BlockLedger(BlockPool(self.num_blocks), block_size=S))
        self.mirror = DeviceMirror(self.table, device, initial_tokens=2 * scale * need, slack=0.0, min_slack=64)
        self.bufs = SlotListBuffers(max_reqs=reqs, nnz_max=scale * need, max_tokens=reqs, device=device)
        for r in self.reqs:
            self.table.add_request(r)
        self.table.sync_new_tokens_batch(self.reqs, np.full(reqs, ctx))
        self.seq = np.full(reqs, ctx, dtype=np.int64)
        self.ones = np.ones(reqs, dtype=np.int64)

    def append(self) -> None:
        self.table.sync_new_tokens_batch(self.reqs, self.ones)
        self.seq += 1
        self.mirror.build(self.bufs, self.reqs, self.ones)


def make_policy(name: str, ctx: int):
    """``name`` at a budget of ``ctx`` live tokens (h2o, tova, random, streamingllm)."""
    if name == "streamingllm":
        return P.get("streamingllm", sink=4, window=ctx - 4)
    return P.get(name, budget=ctx, window=min(32, ctx // 2), **({"seed": 1} if name == "random" else {}))


def run(policy_name: str, reqs: int, ctx: int, scale: int, steps: int) -> dict:
    dev = bench_device()
    w = Workload(reqs, ctx, scale, dev)
    loop = DecisionLoop(make_policy(policy_name, ctx), w.mirror, num_blocks=w.num_blocks, block_size=S, max_reqs=reqs)
    lengths = {"nnz_max": w.bufs.nnz_max, "mirror": w.mirror.slots.numel(), "slot": w.num_blocks * S,
               "block": w.num_blocks}
    inner = loop._device_step
    seen: dict = {"times": [], "counts": []}

    def timed(*args, **kwargs):  # the step alternates: timed plainly, then counted; args[2]: its bucket
        if len(seen["times"]) <= len(seen["counts"]):
            if on_gpu():
                torch.cuda.synchronize()
            t = time.perf_counter()
            inner(*args, **kwargs)
            if on_gpu():
                torch.cuda.synchronize()
            seen["times"].append(time.perf_counter() - t)
        else:
            bucket = args[2] if len(args) > 2 and isinstance(args[2], int) else w.bufs.nnz_max
            seen["bucket"] = bucket
            with WorkCount({"nnz_max": lengths["nnz_max"], "bucket": bucket, **lengths}) as c:
                inner(*args, **kwargs)
            seen["counts"].append(c)

    loop._device_step = timed
    w.mirror.build(w.bufs, w.reqs, np.zeros(reqs, dtype=np.int64))
    applied = 0
    for i in range(2 * steps + 1):
        w.append()
        if loop.token_mass is not None:
            loop.token_mass.copy_(torch.rand(loop.token_mass.numel(), generator=torch.Generator().manual_seed(i)))
        applied += sum(r.num_victims for r in loop.drain())
        loop.decide(w.reqs, w.bufs, seq_lens=w.seq, num_new=w.ones)
    applied += sum(r.num_victims for r in loop.drain_all())
    if applied != (2 * steps + 1) * reqs:
        raise AssertionError(f"applied {applied} victims, expected one per request per step")
    c = seen["counts"][-1]
    return {"policy": policy_name, "scale": scale, "nnz_max": w.bufs.nnz_max, "mirror": w.mirror.slots.numel(),
            "slots": w.num_blocks * S, "step_entries": int(w.bufs.kv_indptr_host[reqs]), "bucket": seen["bucket"],
            "elements": c.elements, **{f"{k}_elements": v for k, v in c.by_buffer.items()}, "ops": c.ops, "sorts": c.sorts,
            "sorted_elements": c.sorted, "step_us": round(statistics.median(seen["times"][1:]) * 1e6, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reqs", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--scales", default="1,8,64")
    ap.add_argument("--policies", default="h2o,tova,random,streamingllm")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1 if not on_gpu() else torch.get_num_threads())
    rows = []
    for name in args.policies.split(","):
        for scale in (int(s) for s in args.scales.split(",")):
            row = run(name, args.reqs, args.ctx, scale, args.steps)
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
    if not args.json:
        print_table("decision step: work vs buffer size (the step's entries fixed)", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
