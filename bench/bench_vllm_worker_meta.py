"""Bytes the vLLM workers send the scheduler per decode step: worker-side decisions vs per-token scores.

Workload: vLLM 0.32's own scheduler (``Scheduler``, ``KVCacheManager``,
``BlockPool``) with the vtoken connector, and the test harness's fake model
(``tests/vllm_sched_harness.FakeWorker``: vtoken's real ``WorkerSide``, its
device decision loop included, over a CPU KV cache, random attention mass).
``--reqs`` requests (64) x ``--prompt`` prompt tokens (1024), all admitted in
one step, then decode steps; h2o with an absolute budget of ``--budget``
tokens (1000), so each request keeps about 1K live tokens and evicts about
one token per decode step, the steady state of a budgeted policy.

Reported per decode step (mean and max over ``--steps`` steps):

* ``decisions_pickle_bytes``: the pickled ``VTokenWorkerMetadata`` the worker
  returns (what vLLM ships from worker to engine core): the victims of the
  decisions whose records arrived, as token ids per request;
* ``scores_pickle_bytes``: the pickled payload the workers returned before
  decisions moved to them, rebuilt from the same steps' live counts: one
  float32 array of attention mass per live key of every scheduled request,
  in a dict keyed by request id (the old ``VTokenWorkerMetadata.scores``);
* ``ratio``: scores over decisions.

Needs vllm 0.32 (run it in the vLLM venv: ``.venv-vllm/bin/python
bench/bench_vllm_worker_meta.py``). Bytes, not time: nothing here depends on
the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reqs", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args()

    from vllm_e2e_helper import make_tiny_llama
    from vllm_sched_harness import FakeWorker, make_request, make_scheduler

    bs = 16
    per_req_blocks = -(-(args.prompt + args.steps + 2) // bs)
    num_blocks = args.reqs * per_req_blocks + 64
    extra = {"mode": "vtoken", "policy": "h2o", "check_invariants": False,
             "policy_config": {"budget": args.budget, "window": 8, "sink": 4}}
    sched = make_scheduler(make_tiny_llama(tempfile.mkdtemp()), block_size=bs, num_blocks=num_blocks,
                           max_num_seqs=args.reqs, max_model_len=args.prompt + args.steps + 64,
                           max_num_batched_tokens=args.reqs * args.prompt, prefix_caching=False, extra=extra)
    rng = np.random.default_rng(0)
    for i in range(args.reqs):
        sched.add_request(make_request(f"r{i}", rng.integers(3, 500, size=args.prompt).tolist(), args.steps + 2, bs))
    fw = FakeWorker(sched, checking=False)
    side = sched.connector.scheduler_side
    sent = []
    real = side.update_output

    def spy(worker_meta):  # the aggregated worker metadata of one step, as vLLM hands it over
        live = [side.table.live_count(r) for r in side.table.requests()]
        sent.append((worker_meta, live))
        return real(worker_meta)

    side.update_output = spy
    fw.step()  # the prefill of every request
    sent.clear()
    for _ in range(args.steps):
        fw.step()
    dec = np.array([len(pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL)) for m, _ in sent])
    # The old payload's layout: {request id: float32 mass per live key}.
    old = np.array([len(pickle.dumps({f"r{i}": np.zeros(n, np.float32) for i, n in enumerate(live)},
                                     protocol=pickle.HIGHEST_PROTOCOL)) for _, live in sent])
    victims = [sum(int(d.counts.sum()) for d in m.decisions) for m, _ in sent]
    out = {
        "reqs": args.reqs, "prompt": args.prompt, "budget": args.budget, "steps": args.steps,
        "live_tokens_mean": float(np.mean([sum(live) for _, live in sent])),
        "victims_per_step_mean": float(np.mean(victims)),
        "decisions_pickle_bytes_mean": float(dec.mean()), "decisions_pickle_bytes_max": int(dec.max()),
        "scores_pickle_bytes_mean": float(old.mean()), "scores_pickle_bytes_max": int(old.max()),
        "ratio": float(old.mean() / dec.mean()),
    }
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
