"""Eviction decision loop: the device loop (vtoken.decisions.loop) against the host numpy path, per step.

Workload: ``--reqs`` requests (256) x {4K, 16K, 64K} live tokens, block size
16, policies h2o and streamingllm, each request exactly at its budget so that
every decode step appends one token per request and evicts one victim per
request. Both paths run in the same process over their own token table.

Per step, for each path, only the DECISION work is timed (the append and
the slot-list build are the same for both and are not counted):

* device loop: ``DecisionLoop.drain`` (apply the last step's ring: one
  ``evict_flat``) + ``DecisionLoop.decide`` (policy state update, batched
  selection, kills in the mirror, block counts, ring copy);
* host path (the wave-1 baseline): the step's key scores copied to the host
  (``[nnz]`` float32, already summed over heads: the cheapest form), each
  request's live ids, ``accumulate_batch``, then per request ``view`` +
  ``select_victims`` + ``TokenTable.evict``.

Reported per step:

* ``host_us_per_step``: Python and numpy time of the device loop outside device
  kernels: ``drain`` (pure host work, timed at each size) plus ``decide``'s
  host share. On a GPU: the wall-clock of the asynchronous calls. On the CPU
  the torch ops run the "kernels" inline, so ``decide``'s host share is the
  wall-clock of a proxy step with the same requests and 8 tokens each: the
  same code path and the same op count (the benchmark checks it at every
  size), with kernels so small that what remains is mostly dispatch, which a
  GPU charges to the host as well. An upper bound;
* ``device_us_per_step``: the device loop's kernel time (CUDA events on GPU;
  on the CPU the time inside aten ops: the stand-in kernels' CPU time, not a
  GPU estimate);
* ``torch_ops_per_step``: aten ops ``decide`` dispatches (CPU; equal at every size);
* on a GPU the loop runs twice, eagerly and replayed from CUDA graphs
  (``DecisionLoop(cuda_graph=True)``): ``host_us_per_step`` / ``device_us_per_step``
  are the graphed loop's, ``*_eager`` the eager loop's;
* ``d2h_bytes_per_step``: the ring record (device loop), the scores + CSR
  offsets (host path);
* ``baseline_host_us_per_step``: the host path's whole decision time (on the
  CPU its score copy included);
* ``kv_read_ratio``: KV bytes that decode attention with scores reads, over
  attention without scores, counted from the kernels' construction
  (``bench_token_attention.kv_bytes_read``; not a timing).

``--json`` prints one object per (policy, size). Ratios, not absolute times,
are what to compare on a shared CPU.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common import bench_device, on_gpu, prepare_kernel_env, print_table, write_json

prepare_kernel_env()
if not on_gpu():
    # No Triton interpreter here: the C++ CPU ops (when built) or the torch references stand in for kernels.
    os.environ.pop("TRITON_INTERPRET", None)

from bench_token_attention import kv_bytes_read  # noqa: E402
from vtoken import policies as P  # noqa: E402
from vtoken.device.buffers import DeviceMirror, SlotListBuffers  # noqa: E402
from vtoken.decisions.loop import DecisionLoop  # noqa: E402
from vtoken.bookkeeping.ledger import BlockLedger  # noqa: E402
from vtoken.policies import accumulate_batch  # noqa: E402
from vtoken.bookkeeping.pool import BlockPool  # noqa: E402
from vtoken.bookkeeping.table import TokenTable  # noqa: E402

S = 16
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # an 8B-class model, for the KV byte count


def make_policy(name: str, ctx: int):
    if name == "h2o":
        return P.get("h2o", budget=ctx, window=min(32, ctx // 2))
    return P.get("streamingllm", sink=min(4, ctx // 4), window=ctx - min(4, ctx // 4))


class Workload:
    """``reqs`` requests of ``ctx`` live tokens over one table, its device mirror and slot lists."""

    def __init__(self, reqs: int, ctx: int, device):
        self.reqs, self.ctx, self.device = list(range(reqs)), ctx, device
        num_blocks = reqs * (ctx // S + 4) + 16
        self.table = TokenTable(BlockLedger(BlockPool(num_blocks), block_size=S))
        self.num_blocks = num_blocks
        slack = ctx if ctx < 64 else 64  # room for the benchmark's appends, without a re-layout
        self.mirror = DeviceMirror(self.table, device, initial_tokens=reqs * (ctx + slack + 8), slack=0.0,
                                   min_slack=slack)
        self.bufs = SlotListBuffers(max_reqs=reqs, nnz_max=reqs * (ctx + 8), max_tokens=reqs, device=device)
        for r in self.reqs:
            self.table.add_request(r)
        self.table.sync_new_tokens_batch(self.reqs, np.full(reqs, ctx))
        self.seq = np.full(reqs, ctx, dtype=np.int64)
        self.ones = np.ones(reqs, dtype=np.int64)

    def append(self) -> None:
        """The step's common part: one new token per request, slot lists rebuilt (not timed)."""
        assert self.table.sync_new_tokens_batch(self.reqs, self.ones) is not None
        self.seq += 1
        self.mirror.build(self.bufs, self.reqs, self.ones)

    @property
    def nnz(self) -> int:
        return int(self.bufs.kv_indptr_host[len(self.reqs)])


def sync():
    if on_gpu():
        torch.cuda.synchronize()


class AtenOps(TorchDispatchMode):
    """Counts the aten ops a call dispatches and sums the time inside them (kernels, on the CPU)."""

    def __init__(self):
        super().__init__()
        self.count, self.seconds = 0, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds += time.perf_counter() - t
        self.count += 1
        return out


def run_loop(policy_name: str, reqs: int, ctx: int, steps: int, *, timing: str, cuda_graph: bool = False) -> dict:
    """``steps`` measured decode steps of the device loop (after warm-up steps).

    ``timing``: "plain" (``decide`` wall-clock), "aten" (``decide`` under
    :class:`AtenOps`: time inside aten ops and the op count) or "both"
    (alternate steps). Every mode times ``drain`` (pure host work). Returns medians.
    """
    dev = bench_device()
    w = Workload(reqs, ctx, dev)
    loop = DecisionLoop(make_policy(policy_name, ctx), w.mirror, num_blocks=w.num_blocks, block_size=S,
                        max_reqs=reqs, cuda_graph=cuda_graph)
    w.mirror.build(w.bufs, w.reqs, np.zeros(reqs, dtype=np.int64))
    noise = torch.rand(loop.state.capacity + 1, generator=torch.Generator().manual_seed(1)).to(dev)
    drain_s, decide_s, kernel_s, aten_s, ops, applied = [], [], [], [], [], 0
    warm = 2 if cuda_graph else 1  # a graphed size runs eagerly once, then captures
    rounds = steps * (2 if timing == "both" else 1) + warm - 1
    for i in range(rounds + 1):  # the first `warm` steps warm up
        w.append()
        if loop.token_mass is not None:
            if loop.token_mass.numel() != noise.numel():
                noise = torch.rand(loop.token_mass.numel(), device=dev)
            loop.token_mass.copy_(noise)  # stands in for the attention's score_out
        sync()
        t = time.perf_counter()
        done = loop.drain()  # host only: the last step's record, one evict_flat
        drain = time.perf_counter() - t
        applied += sum(r.num_victims for r in done)
        counted = timing == "aten" or (timing == "both" and i % 2 == 0)
        mode = AtenOps() if counted else None
        ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if on_gpu() else None
        if ev is not None:
            ev[0].record()
        t = time.perf_counter()
        if mode is not None:
            with mode:
                loop.decide(w.reqs, w.bufs, seq_lens=w.seq, num_new=w.ones)
        else:
            loop.decide(w.reqs, w.bufs, seq_lens=w.seq, num_new=w.ones)
        decide = time.perf_counter() - t
        if ev is not None:
            ev[1].record()
            torch.cuda.synchronize()
        if i < warm:
            continue
        drain_s.append(drain)
        if mode is not None:
            aten_s.append(mode.seconds)
            ops.append(mode.count)
        else:
            decide_s.append(decide)
            if ev is not None:
                kernel_s.append(ev[0].elapsed_time(ev[1]) * 1e-3)
    applied += sum(r.num_victims for r in loop.drain_all())
    if applied != (rounds + 1) * reqs:
        raise AssertionError(f"device loop applied {applied} victims, expected one per request per step "
                             f"({(rounds + 1) * reqs})")
    med = statistics.median
    return {"drain": med(drain_s), "decide": med(decide_s) if decide_s else None,
            "kernel": med(kernel_s) if kernel_s else None,
            "aten": med(aten_s) if aten_s else None, "ops": ops[0] if ops else None,
            "d2h": loop.ring.nbytes, "nnz": w.nnz}


PROXY_CTX = 8  # the proxy step: the same requests and code path, 8 tokens each (tiny kernels)


def device_loop(policy_name: str, reqs: int, ctx: int, steps: int, proxy: dict) -> dict:
    """The device loop's per-step numbers at ``ctx`` (``proxy``: :func:`run_loop` at PROXY_CTX, both timings)."""
    m = run_loop(policy_name, reqs, ctx, steps, timing="plain" if on_gpu() else "aten")
    if on_gpu():  # asynchronous launches: decide's wall is the host's share; CUDA events time the kernels
        host_decide, device = m["decide"], m["kernel"]
        g = run_loop(policy_name, reqs, ctx, steps, timing="plain", cuda_graph=True)
        extra = {"host_us_per_step_eager": round((m["drain"] + host_decide) * 1e6, 1),
                 "device_us_per_step_eager": round(device * 1e6, 1)}
        m, host_decide, device = g, g["decide"], g["kernel"]
    else:
        # NOTE: on the CPU the kernels run inline in decide(); their time cannot be split off a large
        # step (the noise swamps the host share), and a dispatch mode's own redispatch cost distorts
        # a subtraction. decide's host share is the wall-clock of a proxy step with the same requests
        # and 8 tokens each: the same code and the same op count (checked), with kernels so small that
        # their time is mostly dispatch, which a GPU charges to the host too. An upper bound.
        if m["ops"] != proxy["ops"]:
            raise AssertionError(f"decide dispatched {m['ops']} ops at {ctx} tokens, {proxy['ops']} on the proxy")
        host_decide = proxy["decide"]
        device = m["aten"]
        extra = {}
    return {**extra, "host_us_per_step": round((m["drain"] + host_decide) * 1e6, 1),
            "host_drain_us": round(m["drain"] * 1e6, 1), "host_decide_us": round(host_decide * 1e6, 1),
            "device_us_per_step": round(device * 1e6, 1), "d2h_bytes_per_step": m["d2h"],
            "torch_ops_per_step": m["ops"], "live_tokens": m["nnz"]}


def host_path(policy_name: str, reqs: int, ctx: int, steps: int) -> dict:
    dev = bench_device()
    w = Workload(reqs, ctx, dev)
    policy = make_policy(policy_name, ctx)
    accs = [policy.make_accumulator() for _ in w.reqs]
    times, d2h = [], 0
    for i in range(steps + 1):
        w.append()
        nnz = w.nnz
        scores = torch.rand(w.bufs.nnz_max, device=dev)  # the step's key scores, summed over heads
        sync()
        t = time.perf_counter()
        host_scores = scores[:nnz].cpu().numpy() if on_gpu() else scores[:nnz].clone().numpy()  # the D2H copy
        indptr = w.bufs.kv_indptr_host[: reqs + 1]
        token_ids = [w.table.live_ids(r) for r in w.reqs]
        if accs[0] is not None:
            accumulate_batch(accs, token_ids, host_scores, indptr)
        for j, r in enumerate(w.reqs):
            seq_len = int(w.seq[j])
            view = policy.view(r, seq_len, token_ids[j], seq_len=seq_len, num_new=1, scores=accs[j])
            victims = policy.select_victims(view)
            if len(victims):
                w.table.evict(r, victims)
        if i > 0:
            times.append(time.perf_counter() - t)
        d2h = 4 * nnz + 8 * (reqs + 1)
    return {"baseline_host_us_per_step": round(statistics.median(times) * 1e6, 1), "baseline_d2h_bytes_per_step": d2h}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reqs", type=int, default=256)
    ap.add_argument("--sizes", default="4096,16384,65536", help="live tokens per request, comma-separated")
    ap.add_argument("--policies", default="h2o,streamingllm")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per path (default 2 on CPU, 5 on GPU)")
    ap.add_argument("--quick", action="store_true", help="small sizes (a dry run of the script)")
    ap.add_argument("--json", action="store_true", help="one JSON object per (policy, size) on stdout, nothing else")
    args = ap.parse_args(argv)
    torch.set_num_threads(1 if not on_gpu() else torch.get_num_threads())
    sizes = [int(s) for s in args.sizes.split(",")]
    steps = args.steps if args.steps is not None else (5 if on_gpu() else 2)
    reqs = args.reqs
    if args.quick:
        sizes, reqs = [256, 1024], min(reqs, 32)
    rows = []
    for name in args.policies.split(","):
        proxy = None if on_gpu() else run_loop(name, reqs, PROXY_CTX, max(steps, 5), timing="both")
        for ctx in sizes:
            t0 = time.perf_counter()
            d = device_loop(name, reqs, ctx, steps, proxy)
            gc.collect()
            b = host_path(name, reqs, ctx, steps)
            gc.collect()
            kv_on = kv_bytes_read([ctx + 1] * reqs, None, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, 2, scores=True)
            kv_off = kv_bytes_read([ctx + 1] * reqs, None, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, 2, scores=False)
            row = {"policy": name, "reqs": reqs, "live_per_req": ctx, **d, **b,
                   "kv_read_ratio": round(kv_on["kv"] / kv_off["kv"], 4),
                   "baseline_vs_device_host": round(b["baseline_host_us_per_step"] / max(d["host_us_per_step"], 1e-3), 1),
                   "device": "cuda" if on_gpu() else "cpu", "seconds": round(time.perf_counter() - t0, 1)}
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"{name} {reqs}x{ctx}: done in {row['seconds']} s", file=sys.stderr)
    if not args.json:
        keys = ["policy", "live_per_req", "host_us_per_step", "device_us_per_step", "d2h_bytes_per_step",
                "baseline_host_us_per_step", "baseline_d2h_bytes_per_step", "baseline_vs_device_host", "kv_read_ratio"]
        print_table("decision loop per step (device loop vs host numpy path)", [{k: r[k] for k in keys} for r in rows])
    summary = [{"policy": r["policy"], "live": r["live_per_req"], "host_us": r["host_us_per_step"],
                "device_us": r["device_us_per_step"], "d2h_B": r["d2h_bytes_per_step"],
                "baseline_host_us": r["baseline_host_us_per_step"], "baseline_d2h_B": r["baseline_d2h_bytes_per_step"],
                "kv_read_ratio": r["kv_read_ratio"]} for r in rows]
    write_json("decision_loop", {"bench": "decision_loop", "quick": args.quick, "reqs": reqs, "rows": rows,
                                 "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
