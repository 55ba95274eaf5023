"""Planner and per-step reclamation bookkeeping cost (CPU).

1. **Plan of N sources** (N = 1,000; goal <= 2 ms): one request of
   ``2N`` blocks whose non-tail blocks keep a few live tokens each. Timed:
     * ``vectorized``: ``select_sources`` + ``make_plan`` (the numpy planner)
       on the request's snapshot (candidates, slots, alive bits);
     * ``vectorized+snapshot``: the same plus reading the snapshot from the
       table (``relocation_candidates``, ``slots``, ``live_mask``);
     * ``per-token python``: a straightforward per-token Python planner with
       the same rules, whose plan is checked equal to the vectorized one;
   and the ratio of the two, timed in the same process.
2. **Decode-step bookkeeping** at R requests x L tokens (256 x 16K), block
   size 16, half of every request's tokens evicted at random before timing.
   One step = ``before_forward`` + append one token per request + evict k
   per request (victims drawn beforehand) + read F + ``admission_budget`` +
   ``maybe_plan`` + ``launch`` (bookkeeping-only copy engine: no KV tensors)
   + ``commit``. Modes:
     * ``naive``: the hooks do nothing (Naive-Evict only);
     * ``vtoken idle``: trigger armed but never firing (theta_F = 0.99);
     * ``vtoken active``: reclamation planning and committing every step
       (watermark above the pool, so the trigger holds throughout).
   Median / p20 / p80 µs per step, the median µs of the manager's hooks
   alone (``hooks_us``: everything but the table's append / evict / F), the
   median over the steps that planned,
   plus moves and plans per step.

    python bench/bench_planner.py            # N = 1000; 256 x 16K
    python bench/bench_planner.py --quick    # N = 200; 32 x 2K
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

from common import host_time, print_table, write_json

from vtoken.bookkeeping.ledger import BlockLedger
from vtoken.reclamation.planner import make_plan, select_sources
from vtoken.bookkeeping.pool import BlockPool
from vtoken.reclamation.manager import ReclaimConfig, ReclamationManager
from vtoken.bookkeeping.table import TokenTable


def python_planner(slots, alive, cand_blocks, cand_live, S, max_src, dst_blocks_pool):
    """The baseline: per-block and per-token Python loops, same rules as vtoken.reclamation.planner."""
    cands = sorted(range(len(cand_blocks)), key=lambda i: cand_live[i])  # stable: list order on ties
    cands = [i for i in cands if 0 < cand_live[i] < S][:max_src]
    best_k, best_gain, tot = 0, 0, 0
    for k, i in enumerate(cands, 1):
        tot += cand_live[i]
        g = k - math.ceil(tot / S)
        if g > best_gain:
            best_gain, best_k = g, k
    if best_gain < 1:
        return None
    src = [cand_blocks[i] for i in cands[:best_k]]
    src_set = set(src)
    tids, src_slots = [], []
    for t in range(len(slots)):  # per-token opportunity check
        if alive[t] and slots[t] // S in src_set:
            tids.append(t)
            src_slots.append(slots[t])
    ndst = math.ceil(len(tids) / S)
    dst = dst_blocks_pool[:ndst]
    dst_slots = [dst[j // S] * S + j % S for j in range(len(tids))]
    return src, tids, src_slots, dst_slots, dst


def _median_ms(fn, rep):
    t = host_time(fn, warmup=0, rep=rep)
    return t["median_us"] / 1e3, t["p20_us"] / 1e3, t["p80_us"] / 1e3


def bench_plan(n_src: int, S: int, rep: int, seed: int = 0) -> list[dict]:
    nblk = 2 * n_src + 1
    table = TokenTable(BlockLedger(BlockPool(nblk + 64), S), initial_tokens=nblk * S + 1024)
    table.add_request("r")
    table.sync_new_tokens("r", nblk * S)
    rng = np.random.default_rng(seed)
    # Every non-tail block keeps 1..S/2 live tokens (random): all are sparse candidates.
    keep = rng.integers(1, S // 2 + 1, size=nblk - 1)
    victims = np.concatenate([b * S + rng.permutation(S)[k:] for b, k in enumerate(keep.tolist())])
    table.evict("r", victims)
    blocks, live = table.relocation.relocation_candidates("r")
    slots, alive = table.slots("r"), table.live_mask("r")
    num_blocks = table.ledger.num_blocks

    def vec_pure():
        c = select_sources(blocks, live, block_size=S, max_src=n_src)
        dst = np.arange(c.num_dst, dtype=np.int32) + 1  # stand-in ids: planning only
        return make_plan("r", slots, alive, c, dst, block_size=S, num_blocks=num_blocks)

    def vec_snapshot():
        b, lv = table.relocation.relocation_candidates("r")
        c = select_sources(b, lv, block_size=S, max_src=n_src)
        dst = np.arange(c.num_dst, dtype=np.int32) + 1
        return make_plan("r", table.slots("r"), table.live_mask("r"), c, dst, block_size=S, num_blocks=num_blocks)

    sl, al = slots.tolist(), alive.tolist()
    bl, lvl = blocks.tolist(), live.tolist()
    dst_pool = list(range(1, n_src + 1))

    def per_token():
        return python_planner(sl, al, bl, lvl, S, n_src, dst_pool)

    p = vec_pure()
    ref = per_token()
    assert len(p.src_blocks) >= n_src - S, f"expected ~{n_src} sources, got {len(p.src_blocks)}"
    assert p.src_blocks.tolist() == ref[0] and p.token_ids.tolist() == ref[1]
    assert p.src_slots.tolist() == ref[2] and p.dst_slots.tolist() == ref[3]
    rows = []
    base = None
    for name, fn, r in (("per-token python", per_token, max(3, rep // 10)), ("vectorized", vec_pure, rep),
                        ("vectorized+snapshot", vec_snapshot, rep)):
        med, p20, p80 = _median_ms(fn, r)
        if base is None:
            base = med
        rows.append({"planner": name, "sources": len(p.src_blocks), "moves": p.num_moves, "ms_median": med,
                     "ms_p20": p20, "ms_p80": p80, "speedup_vs_python": base / med})
    return rows


def build_state(R, L, S, mode, seed=0, **cfg):
    blocks_per_req = L // S + 64
    nb = R * blocks_per_req + 1024
    table = TokenTable(BlockLedger(BlockPool(nb), S), initial_tokens=R * (L + 1024))
    reqs = list(range(R))
    for r in reqs:
        table.add_request(r)
    table.sync_new_tokens_batch(reqs, [L] * R)
    rng = np.random.default_rng(seed)
    perm = [rng.permutation(L - 64) for _ in reqs]  # older tokens, in a random order
    half = L // 2
    table.evict_batch(reqs, [p[:half] for p in perm])
    # Warm-up: the first append past a full segment moves it in the table's arena
    # (amortized growth); do it once here so the timed steps are steady state.
    table.sync_new_tokens_batch(reqs, [1] * R)
    config = ReclaimConfig(mode=mode, check_invariants=False, **cfg)
    mgr = ReclamationManager(table, config)
    return table, mgr, reqs, [p[half:] for p in perm]


def bench_steps(R, L, S, k, steps, label, mode, **cfg) -> dict:
    table, mgr, reqs, pool = build_state(R, L, S, mode, **cfg)
    ones = np.ones(R, dtype=np.int64)
    counts = np.full(R, k, dtype=np.int64)
    flat = [np.concatenate([p[s * k : (s + 1) * k] for p in pool]) for s in range(steps)]
    F0 = table.ledger.waste_ratio
    times, moves, plans, plan_us, commit_us = [], [], [], [], []
    hooks = []
    for s in range(steps):
        t0 = time.perf_counter()
        mgr.before_forward()
        t1 = time.perf_counter()
        table.sync_new_tokens_batch(reqs, ones)
        table.evict_flat(reqs, flat[s], counts)
        _ = table.ledger.waste_ratio
        t2 = time.perf_counter()
        budget = mgr.admission_budget()
        ps = mgr.maybe_plan()
        mgr.launch(ps)
        mgr.commit()
        t3 = time.perf_counter()
        times.append((t3 - t0) * 1e6)
        hooks.append((t1 - t0 + t3 - t2) * 1e6)
        rec = mgr.metrics.records[-1]
        moves.append(rec.moves)
        plans.append(rec.plans)
        plan_us.append(rec.planner_us)
        commit_us.append(rec.commit_us)
    del budget
    ts = sorted(times)
    return {
        "mode": label, "requests": R, "tokens": L, "evict_per_step": k,
        "us_median": statistics.median(ts), "us_p20": ts[int(0.2 * (len(ts) - 1))],
        "us_p80": ts[int(0.8 * (len(ts) - 1))],
        "hooks_us_median": statistics.median(hooks),
        "us_median_planning_steps": statistics.median([t for t, n in zip(times, plans) if n] or [0.0]),
        "planning_steps": sum(1 for n in plans if n),
        "planner_us_median": statistics.median(plan_us), "commit_us_median": statistics.median(commit_us),
        "plans_per_step": statistics.mean(plans), "moves_per_step": statistics.mean(moves),
        "F_before": round(F0, 4), "F_after": round(table.ledger.waste_ratio, 4),
        "blocks_freed": int(mgr.metrics.totals.freed_blocks),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args(argv)
    S = 16
    if args.quick:
        n_src, rep, R, L, steps = 200, 20, 32, 2048, 30
    else:
        n_src, rep, R, L, steps = 1000, 50, 256, 16384, 60
    steps = args.steps or steps
    plan_rows = bench_plan(n_src, S, rep)
    print_table(f"plan of {n_src} sources (S={S})", plan_rows)
    common = dict(low_watermark=1.0, headroom_blocks=512, check_interval=8, max_src_per_plan=256,
                  max_moves_per_step=8192)
    step_rows = [
        bench_steps(R, L, S, 1, steps, "naive", "naive"),
        bench_steps(R, L, S, 1, steps, "vtoken idle", "vtoken", theta_F=0.99, **{k: v for k, v in common.items()}),
        bench_steps(R, L, S, 1, steps, "vtoken active", "vtoken", **common),
    ]
    print_table(f"decode-step bookkeeping, {R} requests x {L} tokens, S={S}", step_rows)
    summary = [{"planner": r["planner"], "sources": r["sources"], "ms_median": r["ms_median"]} for r in plan_rows]
    summary += [{"mode": r["mode"], "us_median": r["us_median"], "hooks_us_median": r["hooks_us_median"],
                 "moves_per_step": r["moves_per_step"]} for r in step_rows]
    payload = {"summary": summary, "plan": plan_rows, "steps": step_rows, "quick": args.quick}
    path = write_json("planner", payload)
    print(f"\nwrote {path}")
    return payload


if __name__ == "__main__":
    main()
