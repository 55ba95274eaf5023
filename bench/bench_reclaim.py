"""Relocation on its own stream: host stall of async vs force-sync, and the hooks' overhead.

1. **Host stall** (the paper's ablation: about 29 ms per relocation with a
   host sync, none without). Each step enqueues a stand-in forward (a chain of
   GEMMs on the compute stream), then plans and launches the step's
   relocation and commits it. With ``force_sync=False`` the host only
   enqueues (F_N, wait, one ``compact_kv``, E_N); with ``force_sync=True`` it
   blocks on E_N, i.e. until the forward AND the copy are done. Reported per
   mode: host µs of ``maybe_plan + launch`` per relocating step, the measured
   stall, moves and bytes per launch, the GPU time of the forward and of the
   copy alone (CUDA events), and the wall time per step.
2. **Hooks overhead**: decode steps with the reclamation hooks
   (``admission_budget``, ``before_forward``, ``maybe_plan``, ``launch``,
   ``commit``) in vtoken mode with no eviction (nothing to reclaim) vs no
   hooks at all, same stand-in forward; wall time per step (one sync per run),
   median of alternating repeats, and the relative overhead (goal <= 0.5%).

GPU: 32 layers x 8 KV heads x 128 dims fp16, block size 16 (vLLM 0.32 flash
layout), 32 requests x 2K tokens with half evicted at random.
``--quick``: the same protocol on CPU (synchronous copy engine) at toy sizes.

    python bench/bench_reclaim.py            # GPU
    python bench/bench_reclaim.py --quick    # CPU smoke run
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from common import print_table, write_json

from vtoken.layout import KVLayout, kv_cache_shape
from vtoken.bookkeeping.ledger import BlockLedger
from vtoken.bookkeeping.pool import BlockPool
from vtoken.reclamation.manager import ReclaimConfig, ReclamationManager
from vtoken.bookkeeping.table import TokenTable


def sizes(quick: bool) -> dict:
    if quick:
        return dict(layers=2, heads=2, head_dim=32, S=16, reqs=8, ctx=512, gemm=256, gemm_reps=4, steps=6,
                    overhead_steps=30, repeats=7, dtype=torch.float32, max_moves=2048)
    return dict(layers=32, heads=8, head_dim=128, S=16, reqs=32, ctx=2048, gemm=8192, gemm_reps=8, steps=8,
                overhead_steps=50, repeats=5, dtype=torch.float16, max_moves=8192)


class Forward:
    """A stand-in forward pass: ``reps`` dependent GEMMs on the current stream."""

    def __init__(self, n: int, reps: int, device, dtype):
        g = torch.Generator(device="cpu").manual_seed(0)
        self.a = (torch.randn(n, n, generator=g) / n**0.5).to(device, dtype)
        self.reps = reps

    def __call__(self):
        x = self.a
        for _ in range(self.reps):
            x = x @ self.a
        return x


def make_runtime(sz, device, *, force_sync: bool, evict: bool, seed: int = 0, mode: str = "vtoken",
                 theta_F: float = 0.0, check_interval: int = 1):
    S = sz["S"]
    blocks_needed = sz["reqs"] * (sz["ctx"] // S + 8)
    num_blocks = blocks_needed + blocks_needed // 4 + 64
    table = TokenTable(BlockLedger(BlockPool(num_blocks), S))
    shape = kv_cache_shape("vllm_flash", num_blocks, S, sz["heads"], sz["head_dim"])
    caches = [torch.zeros(shape, dtype=sz["dtype"], device=device) for _ in range(sz["layers"])]
    layout = KVLayout.from_tensor(caches[0], "vllm_flash")
    reqs = list(range(sz["reqs"]))
    for r in reqs:
        table.add_request(r)
    table.sync_new_tokens_batch(reqs, [sz["ctx"]] * len(reqs))
    if evict:
        rng = np.random.default_rng(seed)
        table.evict_batch(reqs, [rng.choice(sz["ctx"] - 16, size=sz["ctx"] // 2, replace=False) for _ in reqs])
    # Stall run: theta_F = 0 reclaims whenever a plan frees a block, so every step relocates.
    cfg = ReclaimConfig(mode=mode, theta_F=theta_F, low_watermark=1.0, headroom_blocks=256,
                        check_interval=check_interval,
                        max_src_per_plan=256, max_moves_per_step=sz["max_moves"], force_sync=force_sync,
                        check_invariants=False)
    mgr = ReclamationManager(table, cfg, kv_caches=caches, layout=layout)
    return table, mgr, caches, layout


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _gpu_ms(fn, device) -> float:
    """GPU time of ``fn`` (CUDA events; wall time on CPU), ms."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e)


def bench_stall(sz, device, force_sync: bool) -> dict:
    table, mgr, caches, layout = make_runtime(sz, device, force_sync=force_sync, evict=True)
    fwd = Forward(sz["gemm"], sz["gemm_reps"], device, sz["dtype"])
    reqs = table.requests()
    rng = np.random.default_rng(1)

    def evict_some():
        """Keep waste coming: evict 1/16 of every request's older live tokens."""
        for r in reqs:
            old = table.live_ids(r)[:-16]
            if len(old) > 16:
                table.evict(r, rng.choice(old, size=len(old) // 16, replace=False))

    fwd()  # warm-up: one full relocating step outside the measurement
    mgr.launch(mgr.maybe_plan())
    mgr.commit()
    _sync(device)
    host_us, stall_us, moves, nbytes, wall = [], [], [], [], []
    t_start = time.perf_counter()
    for _ in range(sz["steps"]):
        t0 = time.perf_counter()
        mgr.before_forward()
        fwd()
        evict_some()
        t1 = time.perf_counter()
        plans = mgr.maybe_plan()
        ticket = mgr.launch(plans)
        t2 = time.perf_counter()
        mgr.commit()
        wall.append((time.perf_counter() - t0) * 1e3)
        if ticket is not None:
            host_us.append((t2 - t1) * 1e6)
            stall_us.append(ticket.host_stall_us)
            moves.append(ticket.num_moves)
            nbytes.append(ticket.nbytes)
    _sync(device)
    total_ms = (time.perf_counter() - t_start) * 1e3
    fwd_ms = statistics.median([_gpu_ms(fwd, device) for _ in range(3)])
    # The copy alone, same size as a typical launch, outside the protocol.
    m = int(statistics.median(moves)) if moves else 0
    copy_ms = 0.0
    if m:
        from vtoken.device import ops

        free = np.flatnonzero(table.ledger.state == 0)[1:]
        src = torch.arange(m, dtype=torch.int32, device=device) + sz["S"]  # any distinct slots
        dst_blocks = free[-(m // sz["S"] + 1):]
        dst = torch.from_numpy((dst_blocks[:, None] * sz["S"] + np.arange(sz["S"])).reshape(-1)[:m].astype(np.int32))
        dst = dst.to(device)
        ops.compact_kv(caches, layout, src, dst, validate=False)
        copy_ms = statistics.median([_gpu_ms(lambda: ops.compact_kv(caches, layout, src, dst, validate=False), device)
                                     for _ in range(5)])
    return {
        "mode": "force_sync" if force_sync else "async",
        "relocating_steps": len(moves),
        "host_us_plan_launch": statistics.median(host_us) if host_us else 0.0,
        "host_stall_ms": statistics.median(stall_us) / 1e3 if stall_us else 0.0,
        "moves_per_launch": statistics.mean(moves) if moves else 0,
        "MB_per_launch": (statistics.mean(nbytes) / 2**20) if nbytes else 0.0,
        "forward_ms": fwd_ms,
        "copy_ms": copy_ms,
        "host_ms_per_step": statistics.median(wall),
        "wall_ms_per_step": total_ms / sz["steps"],
        "F_after": round(table.ledger.waste_ratio, 4),
    }


def bench_overhead(sz, device) -> dict:
    # The default trigger settings: the hooks as an engine would run them.
    table, mgr, caches, layout = make_runtime(sz, device, force_sync=False, evict=False, theta_F=0.25,
                                              check_interval=8)
    fwd = Forward(sz["gemm"], sz["gemm_reps"], device, sz["dtype"])

    def run(hooks: bool) -> float:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(sz["overhead_steps"]):
            if hooks:
                mgr.admission_budget()
                mgr.before_forward()
            fwd()
            if hooks:
                mgr.launch(mgr.maybe_plan())
                mgr.commit()
        _sync(device)
        return (time.perf_counter() - t0) * 1e3 / sz["overhead_steps"]

    run(True), run(False)  # warm-up
    on, off = [], []
    for _ in range(sz["repeats"]):
        off.append(run(False))
        on.append(run(True))
    med_on, med_off = statistics.median(on), statistics.median(off)
    host = []
    for _ in range(20):
        t0 = time.perf_counter()
        mgr.admission_budget()
        mgr.before_forward()
        mgr.launch(mgr.maybe_plan())
        mgr.commit()
        host.append((time.perf_counter() - t0) * 1e6)
    return {
        "ms_per_step_hooks_off": med_off,
        "ms_per_step_hooks_on": med_on,
        "overhead_pct": 100.0 * (med_on - med_off) / med_off,
        "hooks_host_us": statistics.median(host),
        "plans": mgr.metrics.summary()["plans"],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CPU protocol at toy sizes")
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if gpu else "cpu")
    if not gpu:
        torch.set_num_threads(1)  # CPU: keep the stand-in forward's timing stable on a shared machine
    sz = sizes(quick=not gpu)
    stall = [bench_stall(sz, device, False), bench_stall(sz, device, True)]
    print_table(f"relocation host stall ({device.type}: {sz['layers']} layers x {sz['heads']} heads x "
                f"{sz['head_dim']} {str(sz['dtype']).replace('torch.', '')}, S={sz['S']})", stall)
    over = bench_overhead(sz, device)
    print_table("reclamation hooks on (no eviction) vs off", [over])
    summary = [{"mode": r["mode"], "host_us_plan_launch": r["host_us_plan_launch"],
                "host_stall_ms": r["host_stall_ms"], "forward_ms": r["forward_ms"], "copy_ms": r["copy_ms"]}
               for r in stall]
    summary.append({"mode": "hooks", "overhead_pct": over["overhead_pct"], "hooks_host_us": over["hooks_host_us"]})
    payload = {"summary": summary, "stall": stall, "overhead": over, "device_type": device.type, "quick": not gpu,
               "sizes": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in sz.items()}}
    path = write_json("reclaim", payload)
    print(f"\nwrote {path}")
    return payload


if __name__ == "__main__":
    main()
