"""Tensor-parallel ranks reach the key masses' all-reduce equally often, even when a debug check fails on one.

Two processes, gloo on loopback (``tests/tp_rank_helper.py``), each one
tensor-parallel rank of vtoken's worker side. A failed debug check on one
rank must make both ranks raise, never leave the other waiting in the
collective. The deadline below only detects a hang (a rank that never
reports); it is not a performance bound.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from vtoken.integrations.vllm import vllm_available

VLLM_OK, VLLM_WHY = vllm_available()
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not VLLM_OK, reason=f"needs vllm 0.32: {VLLM_WHY}")]

HELPER = os.path.join(os.path.dirname(__file__), "tp_rank_helper.py")
HANG_DEADLINE_S = 240  # both ranks import torch + vLLM on a shared 2-core machine first


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(tmp_path, bad_rank: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, HELPER, str(r), str(port), str(tmp_path), str(bad_rank)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in (0, 1)]
    files = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    deadline = time.monotonic() + HANG_DEADLINE_S
    try:
        while time.monotonic() < deadline and not all(f.exists() for f in files):
            if any(p.poll() is not None for p in procs) and not all(f.exists() for f in files):
                break  # a rank died without a report
            time.sleep(0.5)
    finally:
        for p in procs:
            p.kill()
        logs = [p.communicate()[0].decode(errors="replace")[-3000:] for p in procs]
    missing = [r for r, f in enumerate(files) if not f.exists()]
    assert not missing, f"ranks {missing} never finished the step (hung in the collective?):\n" + "\n".join(logs)
    return {r: json.loads(f.read_text()) for r, f in enumerate(files)}


@pytest.mark.parametrize("bad_rank", [1, 0])
def test_a_debug_check_failing_on_one_rank_makes_every_rank_raise_instead_of_hanging(tmp_path, bad_rank):
    out = run_two_ranks(tmp_path, bad_rank)
    bad, good = out[bad_rank], out[1 - bad_rank]
    assert bad["error"] == "InvariantViolation" and "slot mapping differs" in bad["message"], bad
    assert good["error"] == "InvariantViolation" and "another tensor-parallel rank at step 0" in good["message"], good


def test_ranks_without_a_failure_sum_their_masses_and_raise_nothing(tmp_path):
    out = run_two_ranks(tmp_path, bad_rank=-1)
    assert out[0]["error"] is None and out[1]["error"] is None, out
    # Rank r added r + 1 per head (2 heads) to each of the 20 entries: both hold 2 + 4.
    assert out[0]["masses"] == out[1]["masses"] == [6.0] * 20


def test_in_one_process_the_collective_runs_once_and_the_failure_waits_for_it():
    """The same step with a stand-in collective: one call per step, the masses plus the failure flag."""
    from tp_rank_helper import build_rank, run_step

    from vtoken.errors import InvariantViolation

    calls = []

    def collective(t):  # this rank's side of the all-reduce; the other rank's check failed
        calls.append(t.clone())
        t[-1] += 1.0

    w, meta, attn = build_rank(rank=0, bad_rank=-1, reduce_scores=collective)
    with pytest.raises(InvariantViolation, match="another tensor-parallel rank at step 0"):
        run_step(w, meta, attn, rank=0)
    assert len(calls) == 1 and calls[0].tolist() == [2.0] * 20 + [0.0]  # 20 entries, 2 heads x 1.0; no failure here
    # The failing rank: its check raises only after the collective, into which it put its flag.
    calls.clear()
    w, meta, attn = build_rank(rank=1, bad_rank=1, reduce_scores=lambda t: calls.append(t.clone()))
    with pytest.raises(InvariantViolation, match="slot mapping differs"):
        run_step(w, meta, attn, rank=1)
    assert len(calls) == 1 and calls[0][-1].item() == 1.0
    # One rank (no collective): the check raises at once, before the forward, as before.
    w, meta, attn = build_rank(rank=1, bad_rank=1, reduce_scores=None)
    w.begin_step(meta)
    w.expect_attention(attn)
    with pytest.raises(InvariantViolation, match="slot mapping differs"):
        w.prepare_step()
