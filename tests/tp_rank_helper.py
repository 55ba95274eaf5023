"""One tensor-parallel rank of ``tests/test_vllm_tp_agreement.py`` (run as a script, gloo on loopback).

``python tp_rank_helper.py RANK PORT OUT_DIR BAD_RANK``: builds vtoken's
:class:`~vtoken.integrations.vllm.worker.WorkerSide` (checking on, h2o) with
the masses summed by a gloo all-reduce over 2 ranks, then runs one step in the
order vLLM's ``_get_kv_connector_output`` calls the connector:
``handle_preemptions``, ``start_load_kv`` (before the ``try``: an error there
skips the forward and ``wait_for_save``), the forward (each layer's key
scores), and ``wait_for_save`` in a ``finally``. On rank ``BAD_RANK`` vLLM's
slot mapping disagrees with vtoken's, so the slot-mapping debug check fails
there only. The rank writes ``OUT_DIR/rank{RANK}.json`` (the error it raised,
if any), then stays alive, as a vLLM worker does after reporting an error,
until the test kills it.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

BS, H, D, NUM_BLOCKS, PROMPT = 16, 2, 8, 8, 20


def build_rank(rank: int, bad_rank: int, reduce_scores):
    """``(worker, connector metadata, attention metadata)`` of one rank's step 0 (one request, PROMPT tokens)."""
    from vtoken.integrations.vllm.config import VTokenVLLMConfig
    from vtoken.integrations.vllm.meta import VTokenConnectorMetadata
    from vtoken.integrations.vllm.worker import WorkerSide
    from vtoken.bookkeeping.ledger import BlockLedger
    from vtoken.bookkeeping.pool import BlockPool
    from vtoken.bookkeeping.table import TokenTable

    cfg = VTokenVLLMConfig.from_extra_config({"mode": "naive", "policy": "h2o",
                                              "policy_config": {"budget": 0.5, "window": 4, "sink": 0}})
    w = WorkerSide(max_reqs=4, max_tokens=64, max_moves=64, policy=cfg.make_policy(), reduce_scores=reduce_scores,
                   checking=True)
    w.register_kv_caches({"model.layers.0.self_attn.attn": torch.zeros(NUM_BLOCKS, H, BS, 2 * D)})
    table = TokenTable(BlockLedger(BlockPool(NUM_BLOCKS), BS))  # the scheduler's table, for the step's events
    reader = table.journal.subscribe()
    table.add_request("r")
    slots = table.sync_new_tokens("r", PROMPT)
    meta = VTokenConnectorMetadata(step=0, events=table.journal.take(reader), prompt_tokens={"r": PROMPT})
    vllm_slots = torch.from_numpy(np.asarray(slots, dtype=np.int64) + (1 if rank == bad_rank else 0))
    attn = SimpleNamespace(req_ids=["r"], num_reqs=1, query_lens=np.array([PROMPT]), seq_lens=None,
                           slot_mapping=vllm_slots, kv_indices=None, kv_indptr=None, want_scores=False)
    return w, meta, attn


def run_step(w, meta, attn, rank: int) -> list:
    """One step in vLLM's order; returns the step's masses (summed over the ranks)."""
    w.begin_step(meta)  # handle_preemptions
    w.expect_attention(attn)  # the attention metadata builder
    w.prepare_step()  # start_load_kv
    total = int(w.buffers.kv_indptr_host[1])
    try:
        w.score_out[:total] += torch.full((total, H), float(rank + 1)).sum(dim=1)  # the forward: this rank's heads
    finally:
        w.end_step()  # wait_for_save: the masses' all-reduce, the decision
    return w._scores[:total].tolist()


def main(rank: int, port: int, out_dir: str, bad_rank: int) -> None:
    torch.set_num_threads(1)
    # The collective's own timeout is far past the test's hang detector.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=600))
    result = {"rank": rank, "error": None, "message": None, "masses": None}
    try:
        w, meta, attn = build_rank(rank, bad_rank, lambda t: dist.all_reduce(t))
        result["masses"] = run_step(w, meta, attn, rank)  # summed over both ranks
    except Exception as e:  # the test reads what each rank raised
        result["error"], result["message"] = type(e).__name__, str(e)
        result["traceback"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(out_dir, f"rank{rank}.json.tmp"), os.path.join(out_dir, f"rank{rank}.json"))
    time.sleep(600)  # a live worker after its step: the test kills it

if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
