"""Per-decode-step bookkeeping cost of the token table + block ledger (CPU).

Each request first has ``--pre-evict`` (default half) of its L tokens evicted
at random, untimed, so the waste ratio starts near F = 0.5 as in a running
eviction policy. Then one decode step over the batch of R requests (block size S):
  1. append one token per request   (``sync_new_tokens_batch``),
  2. evict k tokens per request      (Naive-Evict frees included), either from
     one flat [R*k] id array, ascending within each request (``evict_flat``,
     "flat"), or from a list of R per-request arrays in random order
     (``evict_batch``, "lists"),
  3. read the waste ratio F          (``ledger.waste_ratio``).
The victims are drawn beforehand (the policy's work is not timed). Each step's
wall time is measured and the median over all steps of all repeats reported,
next to a straightforward per-token dict implementation with the same
semantics, timed in the same process, and the ratio of the two.

    python bench/bench_table.py            # 256 requests x 16K tokens, k in {1, 8}
    python bench/bench_table.py --quick    # 32 requests x 2K tokens
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from common import print_table, write_json

from vtoken.bookkeeping.ledger import BlockLedger
from vtoken.bookkeeping.pool import BlockPool
from vtoken.bookkeeping.table import TokenTable


class DictTable:
    """The baseline: per-token Python dicts and sets, per-block counters, naive free.

    Same semantics as TokenTable for this workload: token t of a request goes
    to offset t % S of its tail block, a new block is taken from a free list
    when the tail is full, an evicted token decrements its block's live count,
    a non-tail block whose count reaches 0 is freed at once, and F is kept as
    running sums.
    """

    def __init__(self, num_blocks: int, S: int):
        self.S = S
        self.free = list(range(num_blocks - 1, 0, -1))
        self.live = {}  # block -> live tokens
        self.slot = {}  # req -> {token id: slot}
        self.alive = {}  # req -> set of live token ids
        self.blocks = {}  # req -> list of block ids (0 = freed)
        self.ntok = {}
        self.total_live = 0
        self.allocated = 0

    def add_request(self, req, n: int) -> None:
        self.slot[req], self.alive[req], self.blocks[req], self.ntok[req] = {}, set(), [], 0
        for _ in range(n):
            self._append(req)

    def _append(self, req) -> int:
        S, t = self.S, self.ntok[req]
        blocks = self.blocks[req]
        if t % S == 0:
            b = self.free.pop()
            self.live[b] = 0
            self.allocated += 1
            blocks.append(b)
            if len(blocks) > 1:  # the previous tail became a non-tail block
                prev = blocks[-2]
                if prev and self.live[prev] == 0:
                    self._free(req, len(blocks) - 2)
        b = blocks[t // S]
        s = b * S + t % S
        self.slot[req][t] = s
        self.alive[req].add(t)
        self.live[b] += 1
        self.total_live += 1
        self.ntok[req] = t + 1
        return s

    def _free(self, req, pos: int) -> None:
        b = self.blocks[req][pos]
        self.blocks[req][pos] = 0
        del self.live[b]
        self.free.append(b)
        self.allocated -= 1

    def evict(self, req, ids) -> None:
        S = self.S
        alive, slot = self.alive[req], self.slot[req]
        tail = (self.ntok[req] - 1) // S
        for t in ids:
            if t not in alive:
                raise ValueError(f"token_ids: expected live tokens, got {t}")
            alive.remove(t)
            b = slot[t] // S
            self.live[b] -= 1
            self.total_live -= 1
            if self.live[b] == 0 and t // S != tail:  # no moves here: token t sits at position t // S
                self._free(req, t // S)

    def step(self, reqs, victims) -> float:
        for req in reqs:
            self._append(req)
        for req, ids in zip(reqs, victims):
            self.evict(req, ids)
        return 1.0 - self.total_live / (self.allocated * self.S)


def make_victims(rng, R: int, L: int, k: int, steps: int, pre: float = 0.0):
    """(pre-evicted ids per request, per step k distinct live ids per request), from the first L tokens."""
    n_pre = round(pre * L)
    if n_pre + k * steps > L:
        raise ValueError(f"steps: expected pre-eviction + k * steps <= context, got {n_pre} + {k * steps} > {L}")
    perm = np.argsort(rng.random((R, L)), axis=1)
    pre_ids = [np.sort(perm[r, :n_pre]).astype(np.int64) for r in range(R)]
    per_step = [[perm[r, n_pre + s * k : n_pre + (s + 1) * k].astype(np.int64) for r in range(R)] for s in range(steps)]
    return pre_ids, per_step


def run_vtoken(R, L, S, k, steps, pre_ids, victims, form: str = "flat") -> list:
    ledger = BlockLedger(BlockPool(R * (_blocks(L + steps, S) + 1) + 1), S)
    table = TokenTable(ledger, initial_tokens=R * (L + steps))
    reqs = list(range(R))
    for r in reqs:
        table.add_request(r)
    table.sync_new_tokens_batch(reqs, np.full(R, L, dtype=np.int64))
    table.evict_batch(reqs, pre_ids)
    ones = np.ones(R, dtype=np.int64)
    counts = np.full(R, k, dtype=np.int64)
    # A batched policy's output: [R*k] ids, ascending within each request.
    flat = [np.concatenate([np.sort(x) for x in v]) for v in victims]
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        table.sync_new_tokens_batch(reqs, ones)
        if form == "flat":
            table.evict_flat(reqs, flat[s], counts)
        else:
            table.evict_batch(reqs, victims[s])
        f = ledger.waste_ratio
        times.append((time.perf_counter() - t0) * 1e6)
    table.check_invariants()
    return times, f


def run_dict(R, L, S, k, steps, pre_ids, victims) -> list:
    d = DictTable(R * (_blocks(L + steps, S) + 1) + 1, S)
    reqs = list(range(R))
    for r in reqs:
        d.add_request(r, L)
        d.evict(r, pre_ids[r].tolist())
    vlists = [[v.tolist() for v in vs] for vs in victims]  # the dict version gets Python ints
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        f = d.step(reqs, vlists[s])
        times.append((time.perf_counter() - t0) * 1e6)
    return times, f


def _blocks(n, S):
    return -(-n // S)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32 requests x 2K tokens")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--evict", type=int, nargs="+", default=[1, 8], help="tokens evicted per request per step")
    ap.add_argument("--steps", type=int, default=100, help="decode steps per repeat")
    ap.add_argument("--pre-evict", type=float, default=0.5,
                    help="fraction of each request evicted at random before the timed steps (F ~ this)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.context, args.repeats = 32, 2048, 3
    R, L, S = args.requests, args.context, args.block_size
    rows = []
    for k in args.evict:
        vt, vb, dt = [], [], []
        for rep in range(args.repeats):
            pre, victims = make_victims(np.random.default_rng(args.seed + rep), R, L, k, args.steps, args.pre_evict)
            t, f_vt = run_vtoken(R, L, S, k, args.steps, pre, victims, "flat")
            vt += t
            t, f_vb = run_vtoken(R, L, S, k, args.steps, pre, victims, "lists")
            vb += t
            t, f_dict = run_dict(R, L, S, k, args.steps, pre, victims)
            dt += t
            assert f_vt == f_vb and abs(f_vt - f_dict) < 1e-12, f"waste ratio differs: {f_vt}, {f_vb}, dict {f_dict}"
        v, b, d = statistics.median(vt), statistics.median(vb), statistics.median(dt)
        rows.append({
            "requests": R, "context": L, "block_size": S, "evict_per_req": k, "steps": len(vt),
            "vtoken_flat_us": v, "vtoken_flat_p90_us": float(np.percentile(vt, 90)),
            "vtoken_lists_us": b, "dict_us": d,
            "dict_over_flat": d / v, "dict_over_lists": d / b, "final_F": f_vt,
        })
    print_table(f"table bookkeeping per decode step ({R} requests x {L} tokens, S={S})", rows)
    path = write_json("table", {"rows": rows, "args": vars(args)})
    print(f"wrote {path}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
