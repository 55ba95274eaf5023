"""Host cost of one eviction decision per request and step, for every policy.

A decision runs on the CPU whatever the accelerator (the policy sees numpy
token ids), so this benchmark always times on the host with
``time.perf_counter`` medians, also on a GPU machine.

Per policy and live count n, one decode step of one request in steady state
(the request is one token over its budget):

- exact-score policies: ``ScoreAccumulator.update`` with ``[n, 8]`` key scores
  (8 kv heads) + ``policy.view`` + ``select_victims``;
- SnapKV: one decision with ``[n, 32]`` per-head window votes and a 50% budget
  (it runs once per request, after prefill);
- StreamingLLM / Random: ``view`` + ``select_victims``.

Baseline, timed in the same process: ``np.argsort(scores, kind="stable")`` of
n floats, the sort any ranking policy needs. The table reports µs per
decision and the ratio to the baseline.

    python bench/bench_policies.py            # n = 1k, 8k, 64k
    python bench/bench_policies.py --quick    # n = 1k, 8k
"""
from __future__ import annotations

import argparse

import numpy as np

from common import host_time, print_table, write_json  # noqa: E402  (bench/ is the script dir)

import vtoken.policies as P  # noqa: E402
from vtoken.policies.scores import ScoreAccumulator  # noqa: E402


def cpu_time_us(fn, *, warmup: int = 3, rep: int = 30) -> float:
    """Median wall-clock µs of ``fn()`` (host-only work)."""
    return host_time(fn, warmup=warmup, rep=rep)["median_us"]


def one_case(name: str, n: int, rng: np.random.Generator) -> float:
    seq_len = 2 * n  # half the ids were evicted earlier: live ids have holes
    live = np.sort(rng.choice(seq_len - 64, size=n - 64, replace=False))
    live = np.concatenate([live, np.arange(seq_len - 64, seq_len)])
    if name == "snapkv":
        policy = P.get(name, budget=n // 2, window=32)
        votes = rng.random((n, 32))
        return cpu_time_us(lambda: policy.select_victims(policy.view(0, 1, live, seq_len=seq_len,
                                                                      window_scores=votes)))
    policy = P.get(name, budget=n - 1, window=32)
    acc = policy.make_accumulator()
    scores = rng.random((n, 8)).astype(np.float32)
    if acc is not None:
        for _ in range(max(acc.history, 1)):
            acc.update(live, scores)

    def step():
        if acc is not None:
            acc.update(live, scores)
        victims = policy.select_victims(policy.view(0, 7, live, seq_len=seq_len, scores=acc))
        assert victims.size == 1

    return cpu_time_us(step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU CI)")
    args = ap.parse_args()
    sizes = [1024, 8192] if args.quick else [1024, 8192, 65536]
    rng = np.random.default_rng(0)
    rows = []
    for n in sizes:
        base = cpu_time_us(lambda x=rng.random(n): np.argsort(x, kind="stable"))
        for name in P.available():
            us = one_case(name, n, rng)
            rows.append({"policy": name, "n_live": n, "us_per_decision": round(us, 1),
                         "argsort_us": round(base, 1), "x_argsort": round(us / base, 2)})
    print_table("eviction decision, one request-step (host)", rows)
    acc = ScoreAccumulator(history=64)
    ids = np.arange(65536)
    for _ in range(64):
        acc.update(ids, np.ones(ids.size))
    print(f"\nScoreAccumulator(history=64) at 64k tokens: {acc.nbytes / ids.size:.1f} bytes/token")
    path = write_json("policies", {"host_timing": True, "sizes": sizes, "rows": rows,
                                   "accumulator_bytes_per_token_64k_h64": acc.nbytes / ids.size})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
