"""``vtoken demo / retained / sla / prefix`` and ``fragmentation --policy``: in-process with tiny sizes, JSON asserted.

What must hold whatever the machine (no timing thresholds):

- paired runs: the greedy outputs of naive and vtoken are IDENTICAL on the
  recorded trace, vtoken relocates tokens and retains fewer blocks than naive
  where the victims are scattered, naive never relocates;
- the reported numbers agree with their definitions (max concurrency =
  usable // peak per request, native's retention = the unevicted footprint,
  the SLA = 1.05 x naive's p95 at the reference C, the best point under it);
- prefix sharing: every shared block with dead tokens is skipped by
  reclamation (100%) and keeps its slots, and suffix blocks are reclaimed;
- ``--json`` prints exactly one JSON object on stdout.

The engine runs on the torch reference kernels (VTOKEN_BACKEND=torch): the
Triton interpreter is far too slow for whole engine runs, and the kernels
have their own tests. conftest's VTOKEN_DEBUG_INVARIANTS=1 makes the
reclamation manager check I1/I2/I4 at every step of these runs.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from vtoken.cli import main
from vtoken.errors import InvalidArgumentError
from vtoken.experiments.common import Progress, full_blocks
from vtoken.reclamation.config import auto_headroom

# Tiny sizes: block size 4 and a 4-token window, so the policies evict within a few dozen tokens.
TINY = ["--block-size", "4", "--window", "4", "--device", "cpu"]
MODE_KEYS = {"mode", "retained_blocks_per_request", "utilization", "waste_ratio_mean", "ideal_blocks_per_request",
             "peak_blocks", "peak_blocks_per_request", "usable_blocks", "max_concurrency", "tokens_per_s", "seconds",
             "evicted_tokens", "relocated_tokens", "reclaimed_blocks", "preemptions", "steady_utilization"}
SCATTERED = ("h2o", "random", "scissorhands", "tova")  # victims spread over blocks: naive keeps holes


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    import torch

    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # the CLI sets 1 CPU thread for the tiny model; other tests keep theirs


def run_json(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert len(lines) == 1, out  # one JSON object, nothing else on stdout
    return json.loads(lines[0])


# ----------------------------------------------------------------------------------------- demo
DEMO = ["demo", "--requests", "3", "--prompt-len", "24", "--output-len", "20", "--num-blocks", "48", *TINY]


def test_demo_json(capsys):
    got = run_json(capsys, *DEMO)
    assert set(got) == {"config", "model", "modes", "outputs_identical", "identical", "seconds", "prompt_lens",
                        "prompts", "reclaim"}
    assert got["reclaim"]["theta_F"] == 0.01 and got["reclaim"]["low_watermark"] == 1.0  # the run's settings
    assert got["reclaim"]["headroom_blocks"] is None  # automatic: 0 with hole filling
    assert got["reclaim"]["planner"] == "holes" and got["config"]["planner"] == "holes"
    assert got["identical"] is True and got["prompts"] is None and got["prompt_lens"] == [24] * 3  # random ids
    assert list(got["modes"]) == ["native", "naive", "vtoken"]
    assert set(got["modes"]["native"]) == MODE_KEYS
    assert all(set(got["modes"][m]) == MODE_KEYS | {"identical"} for m in ("naive", "vtoken"))
    assert got["modes"]["vtoken"]["identical"] is got["modes"]["naive"]["identical"] is True
    assert got["outputs_identical"] is True
    nat, nv, vt = (got["modes"][m] for m in ("native", "naive", "vtoken"))
    # Native keeps everything: prompt + all outputs but the last, packed from block 0 of each request.
    full = full_blocks(24, 20, 4)
    assert nat["retained_blocks_per_request"] == full and nat["peak_blocks_per_request"] == full
    assert nat["utilization"] == pytest.approx((24 + 20 - 1) / (full * 4))
    assert nat["evicted_tokens"] == 0 and nat["relocated_tokens"] == 0
    # The same victims in naive and vtoken; only vtoken moves tokens, and it keeps fewer blocks.
    assert nv["evicted_tokens"] == vt["evicted_tokens"] > 0
    assert nv["relocated_tokens"] == 0 and vt["relocated_tokens"] > 0 and vt["reclaimed_blocks"] > 0
    assert vt["retained_blocks_per_request"] < nv["retained_blocks_per_request"]
    assert vt["utilization"] > nv["utilization"]
    assert vt["steady_utilization"] > nv["steady_utilization"]
    assert vt["ideal_blocks_per_request"] == nv["ideal_blocks_per_request"]  # same live tokens
    assert vt["retained_blocks_per_request"] >= vt["ideal_blocks_per_request"]
    # Max concurrency by its definition; hole filling holds no headroom back.
    assert nat["usable_blocks"] == nv["usable_blocks"] == vt["usable_blocks"] == 47
    for m in (nat, nv, vt):
        assert m["max_concurrency"] == m["usable_blocks"] // m["peak_blocks_per_request"]
    for m in (nat, nv, vt):
        assert m["preemptions"] == 0 and 0 < m["utilization"] <= 1 and 0 <= m["waste_ratio_mean"] < 1
    assert vt["peak_blocks_per_request"] < nat["peak_blocks_per_request"]
    assert vt["max_concurrency"] > nat["max_concurrency"]


def test_demo_json_fresh_planner(capsys):
    """The former planner on demand: its automatic headroom is inside the same budget."""
    got = run_json(capsys, *DEMO, "--planner", "fresh")
    assert got["reclaim"]["planner"] == "fresh" and got["identical"] is True
    vt = got["modes"]["vtoken"]
    assert vt["usable_blocks"] == 47 - auto_headroom(3, 4)
    c, per = vt["max_concurrency"], vt["peak_blocks_per_request"]  # with the headroom those c requests need
    assert c * per + auto_headroom(c, 4) <= 47 < (c + 1) * per + auto_headroom(c + 1, 4)


def test_demo_table(capsys):
    assert main(DEMO) == 0
    out = capsys.readouterr().out
    for label in ("retained/req", "utilization", "peak/req", "tokens/s", "max concurrency", "native", "naive",
                  "vtoken", "greedy outputs, naive vs vtoken: IDENTICAL"):
        assert label in out


@pytest.mark.parametrize("args, match", [
    (["--num-blocks", "20"], "num_blocks: expected a budget that holds all 3 requests"),
    (["--evict-ratio", "1.0"], "evict_ratio: expected a value in"),
    (["--policy", "nope"], "invalid choice"),
    (["--requests", "0"], "requests: expected an int >= 1"),
    (["--prompt", "Hello there"], "prompts: expected a model with a tokenizer"),  # the random preset has none
    (["--sink", "-1"], "sink: expected an int >= 0"),
    (["--policy", "snapkv", "--at", "decode"], "snapkv.at: expected one of"),
    (["--model", "smollm2", "--model-path", "/x"], "model: expected --model or --model-path, got both"),
    (["--device", "cuda:0"] if not __import__("torch").cuda.is_available() else ["--model-preset", "bogus"],
     "device: expected an available device" if not __import__("torch").cuda.is_available() else "invalid choice"),
])
def test_demo_bad_options_exit_2(capsys, args, match):
    with pytest.raises(SystemExit) as e:
        main([*DEMO, *args])
    assert e.value.code == 2
    assert match in capsys.readouterr().err


# ------------------------------------------------------------------------------------- retained
def test_retained_json_all_policies(capsys):
    from vtoken.policies import available

    got = run_json(capsys, "retained", "--requests", "2", "--prompt-len", "24", "--output-len", "20", *TINY[:4])
    assert set(got) == {"config", "model", "policies", "seconds", "reclaim"}
    assert got["reclaim"]["low_watermark"] == 1.0 and got["reclaim"]["mode"] == "vtoken"  # what the run used
    assert sorted(got["policies"]) == available()  # all six
    for name, row in got["policies"].items():
        nv, vt = row["naive"], row["vtoken"]
        assert row["outputs_identical"] is True, name
        assert nv["evicted_tokens"] > 0, name
        assert nv["relocated_tokens"] == 0
        assert vt["retained_blocks_per_request"] <= nv["retained_blocks_per_request"], name
        assert vt["retained_blocks_per_request"] >= vt["ideal_blocks_per_request"], name
        assert row["reduction"] == pytest.approx(
            1 - vt["retained_blocks_per_request"] / nv["retained_blocks_per_request"])
        if name in SCATTERED:
            assert vt["relocated_tokens"] > 0, name
            assert vt["retained_blocks_per_request"] < nv["retained_blocks_per_request"], name
            assert vt["utilization"] > nv["utilization"], name


# ------------------------------------------------------------------------------------------ sla
def test_sla_json(capsys):
    got = run_json(capsys, "sla", "--concurrency", "1,2,4", "--sla-concurrency", "2", "--rounds", "1",
                   "--prompt-len", "16", "--output-len", "12", "--num-blocks", "24", *TINY)
    assert set(got) == {"config", "model", "points", "sla_p95_token_latency_s", "best_under_sla", "reclaim",
                        "vtoken_over_naive", "seconds"}
    ref = next(p for p in got["points"]["naive"] if p["concurrency"] == 2)
    sla = got["sla_p95_token_latency_s"]
    assert sla == pytest.approx(1.05 * ref["p95_token_latency_s"], rel=1e-12)
    for mode, pts in got["points"].items():
        assert [p["concurrency"] for p in pts] == [1, 2, 4]
        for p in pts:
            assert p["requests"] == p["concurrency"] and p["generated_tokens"] == 12 * p["requests"]
            assert p["throughput_tok_s"] == pytest.approx(p["generated_tokens"] / p["seconds"])
            assert p["p95_token_latency_s"] > 0 and p["peak_running"] <= p["concurrency"]
            assert p["peak_blocks"] <= 23
        ok = [p for p in pts if p["p95_token_latency_s"] <= sla]
        best = got["best_under_sla"][mode]
        if ok:
            top = max(ok, key=lambda p: p["throughput_tok_s"])
            assert best == {k: top[k] for k in ("concurrency", "throughput_tok_s", "p95_token_latency_s")}
        else:
            assert best is None
        if mode == "native":
            assert all(p["relocated_tokens"] == 0 for p in pts)
    # 4 requests x up to 7 blocks do not fit 23 blocks: native must preempt (recompute) at C=4.
    assert got["points"]["native"][2]["preemptions"] > 0


def test_sla_reference_concurrency_must_be_swept(capsys):
    with pytest.raises(SystemExit) as e:
        main(["sla", "--concurrency", "1,2", "--sla-concurrency", "8"])
    assert e.value.code == 2
    assert "sla_concurrency: expected one of the swept concurrencies [1, 2]" in capsys.readouterr().err


def test_token_times_by_hand():
    """The metrics both sla runs share, from step boundaries: request a submitted at 0, tokens at 1, 2, 4;
    request b submitted at 2, tokens at 3, 4."""
    from types import SimpleNamespace

    from vtoken.experiments.sla import token_times

    eng = SimpleNamespace(marks=[None] * 5, first_steps=[(0, 1), (2, 3)], gap_steps=[(1, 2), (2, 4), (3, 4)])
    t = [10.0, 11.0, 13.0, 14.0, 18.0]
    got = token_times(eng, t, prefix="x_")
    gaps, ttfts = [2.0, 5.0, 4.0], [1.0, 1.0]
    assert got == {"x_seconds": 8.0, "x_throughput_tok_s": 5 / 8.0,
                   "x_p95_token_latency_s": pytest.approx(float(np.percentile(gaps, 95)), rel=1e-15),
                   "x_mean_token_latency_s": pytest.approx(11.0 / 3, rel=1e-15),
                   "x_p95_ttft_s": pytest.approx(float(np.percentile(ttfts, 95)), rel=1e-15)}
    with pytest.raises(InvalidArgumentError, match="times"):
        token_times(eng, t[:4])


# --------------------------------------------------------------------------- sla, modeled H200
MODELED = ["sla", "--cost-model", "h200", "--concurrency", "1,2,4", "--sla-concurrency", "2", "--rounds", "1",
           "--prompt-len", "16", "--output-len", "12", "--num-blocks", "24", "--block-size", "4", "--window", "4"]
MODELED_TIMES = ("seconds", "throughput_tok_s", "p95_token_latency_s", "mean_token_latency_s", "p95_ttft_s")


def test_sla_modeled_h200_json(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sla.png"
    got = run_json(capsys, *MODELED, "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert got["modeled"] is True and got["cost_model"] == "h200" and "modeled H200" in got["title"]
    assert list(got["shapes"]) == ["llama-8b", "mistral-7b"] and got["paper_up_to"] == 1.37
    for sr in got["shapes"].values():
        ref = next(p for p in sr["points"]["naive"] if p["concurrency"] == 2)
        sla = sr["modeled_sla_p95_token_latency_s"]
        assert sla == pytest.approx(1.05 * ref["modeled_p95_token_latency_s"], rel=1e-12)
        for mode, pts in sr["points"].items():
            assert [p["concurrency"] for p in pts] == [1, 2, 4]
            for p in pts:
                assert not {k for k in MODELED_TIMES if k in p}  # every time field says modeled
                assert p["generated_tokens"] == 12 * p["requests"] and p["peak_blocks"] <= 23
                assert p["modeled_throughput_tok_s"] == pytest.approx(p["generated_tokens"] / p["modeled_seconds"])
            ok = [p for p in pts if p["modeled_p95_token_latency_s"] <= sla]
            top = max(ok, key=lambda p: p["modeled_throughput_tok_s"]) if ok else None
            assert sr["best_under_sla"][mode] == (top and {k: top[k] for k in (
                "concurrency", "modeled_throughput_tok_s", "modeled_p95_token_latency_s")})
        best = {m: b["modeled_throughput_tok_s"] for m, b in sr["best_under_sla"].items() if b}
        if "naive" in best and "vtoken" in best:
            assert sr["vtoken_over_naive"] == pytest.approx(best["vtoken"] / best["naive"], rel=1e-12)
        assert sr["points"]["native"][2]["preemptions"] > 0  # 4 requests x up to 7 blocks do not fit 23
    # one engine run serves both shapes: the same schedule on two clocks (llama's larger LM head is slower)
    llama, mistral = got["shapes"]["llama-8b"]["points"], got["shapes"]["mistral-7b"]["points"]
    for mode in llama:
        for a, b in zip(llama[mode], mistral[mode]):
            assert {k: v for k, v in a.items() if not k.startswith("modeled_") and k != "host_seconds"} == \
                {k: v for k, v in b.items() if not k.startswith("modeled_") and k != "host_seconds"}
            assert a["modeled_seconds"] > b["modeled_seconds"]


def test_sla_modeled_h200_table_says_modeled(capsys):
    assert main([*MODELED, "--shape", "mistral-7b"]) == 0
    out = capsys.readouterr().out
    assert "mistral-7b (modeled H200)" in out and "llama-8b" not in out and "modeled tok/s" in out


@pytest.mark.parametrize("argv, line", [
    (["sla", "--cost-model", "h200", "--model", "smollm2"], "model: expected none with --cost-model h200"),
    (["sla", "--cost-model", "h200", "--device", "cpu"], "device: expected none with --cost-model h200"),
    (["sla", "--shape", "llama-8b"], "shape: expected --cost-model h200 with it"),
    (["sla", "--memory-utilization", "0.9"], "memory_utilization: expected --cost-model h200 with it"),
    (["sla", "--cost-model", "h200", "--num-blocks", "24", "--memory-utilization", "0.9"],
     "memory_utilization: expected --num-blocks or --memory-utilization, got both"),
    (["sla", "--cost-model", "h200", "--memory-utilization", "1.5"], "memory_utilization: expected a value in (0, 1]"),
    (["sla", "--cost-model", "h200", "--memory-utilization", "0.1"], "memory_utilization: expected room for"),
    (["sla", "--cost-model", "h200", "--concurrency", "1,2"], "sla_concurrency: expected one of the swept"),
    (["sla", "--cost-model", "h200", "--num-blocks", "1"], "num_blocks: expected an int >= 2"),
])
def test_sla_modeled_bad_options_name_the_argument(capsys, argv, line):
    assert line in exit_2_line(capsys, argv)


# --------------------------------------------------------------------------------------- prefix
def test_prefix_json(capsys):
    # --sink 0: the tiny random model's victims must reach the shared prefix blocks for the checks below
    got = run_json(capsys, "prefix", "--degrees", "1,2,4", "--requests", "4", "--prefix-len", "16",
                   "--suffix-len", "8", "--output-len", "16", "--sink", "0", *TINY)
    rows = {r["degree"]: r for r in got["degrees"]}
    assert sorted(rows) == [1, 2, 4]
    k = 16 // 4  # prefix blocks
    for d, r in rows.items():
        assert r["outputs_identical"] is True, d
        assert r["evicted_tokens"] > 0
        assert r["shared_blocks_used_as_sources"] == 0 and r["shared_slots_intact"] is True
        assert r["reclaimed_suffix_blocks"] + r["reclaimed_prefix_blocks"] == r["reclaimed_blocks"]
        assert r["reclaimed_suffix_blocks"] > 0
        assert r["vtoken_retained_blocks"] <= r["naive_retained_blocks"]
        assert r["retained_vs_naive"] == pytest.approx(r["vtoken_retained_blocks"] / r["naive_retained_blocks"])
        assert r["vtoken_retained_blocks"] >= r["packed_blocks"]
    assert rows[1]["shared_blocks"] == 0 and rows[1]["shared_skipped_pct"] is None
    for d in (2, 4):
        assert rows[d]["shared_blocks"] == (4 // d) * k
        assert rows[d]["shared_blocks_with_dead_tokens"] > 0
        assert rows[d]["shared_skipped_pct"] == 100.0
    assert any(r["vtoken_retained_blocks"] < r["naive_retained_blocks"] for r in rows.values())


def test_prefix_rejects_partial_prefix_blocks(capsys):
    with pytest.raises(SystemExit):
        main(["prefix", "--prefix-len", "10", "--block-size", "4"])
    assert "prefix_len: expected a multiple of block_size (4)" in capsys.readouterr().err


# --------------------------------------------------------------------------- fragmentation --policy
def test_fragmentation_policy_h2o(capsys):
    got = run_json(capsys, "fragmentation", "--policy", "h2o", "--requests", "2", "--context", "128")
    # H2O keeps exactly half of each prompt: 64 live tokens = 4 packed blocks of 16.
    assert got["ideal_blocks_per_request"] == 4.0
    assert 4.0 < got["retained_blocks_per_request"] <= 8.0
    assert got["waste_ratio"] == pytest.approx(1 - 64 / (got["retained_blocks_per_request"] * 16))


def test_fragmentation_policy_streamingllm_is_contiguous(capsys):
    got = run_json(capsys, "fragmentation", "--policy", "streamingllm", "--requests", "2", "--context", "128")
    # Sinks 0..3 stay, tokens 4..67 die, the last 60 stay: blocks 1-3 are freed, blocks 0 and 4 are partial.
    assert got["retained_blocks_per_request"] == 5.0 and got["ideal_blocks_per_request"] == 4.0
    assert got["waste_ratio"] == pytest.approx(1 - 64 / 80)


def test_policy_victims_contract():
    import numpy as np

    from vtoken.experiments.common import ModelSpec
    from vtoken.experiments.policy_victims import policy_victims

    spec = ModelSpec(device="cpu")
    for name, n in (("h2o", 150), ("snapkv", 150), ("scissorhands", 150), ("tova", 1)):
        v = policy_victims(name, requests=2, context=300, evict_ratio=0.5, seed=1, model=spec)
        for x in v:
            assert x.dtype == np.int64 and (np.diff(x) > 0).all()
            assert len(x) == n, name  # TOVA evicts one token per decision, by definition
            assert x.max() < 300 - 32 or name == "tova"  # the recent window (32) is protected
    assert all(len(x) == 0 for x in policy_victims("h2o", requests=2, context=64, evict_ratio=0.0))


# ---------------------------------------------------------------------------------- bad sizes
def exit_2_line(capsys, argv) -> str:
    """Run the CLI expecting a usage error; return its one error line (no traceback)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("policies, what", [("", "at least one policy, got none"),
                                            (",", "at least one policy, got none"),
                                            (" , ", "at least one policy, got none"),
                                            ("h2o,tova,h2o", "unique policies, got ['h2o', 'tova', 'h2o']")])
def test_retained_rejects_an_empty_or_repeated_policy_list(capsys, policies, what):
    assert exit_2_line(capsys, ["retained", "--policies", policies]) == f"vtoken retained: error: policies: expected {what}"


SLOTS = "expected a pool of at most 134217728 blocks of 16 tokens (int32 slot ids), got"


@pytest.mark.parametrize("argv, line", [
    (["demo", "--num-blocks", "10000000000"], f"num_blocks: {SLOTS} 10000000000"),
    (["sla", "--num-blocks", "100000000000"], f"num_blocks: {SLOTS} 100000000000"),
    (["retained", "--requests", "100000000"], f"requests: {SLOTS} 100000000, which needs 1740625001"),
    (["retained", "--prompt-len", "100000000000"],
     f"prompt_len + output_len: {SLOTS} 100000000128, which needs 6250000009"),
    (["prefix", "--requests", "100000000", "--degrees", "1"], f"requests: {SLOTS} 100000000, which needs 1540625001"),
    (["frontier", "--trace-only", "--num-blocks", "1000000000000"], f"num_blocks: {SLOTS} 1000000000000"),
])
def test_sizes_past_int32_slots_are_refused_before_any_model(capsys, monkeypatch, argv, line):
    from vtoken.experiments.common import ModelSpec

    built = []
    monkeypatch.setattr(ModelSpec, "build", lambda self: built.append(self))
    assert exit_2_line(capsys, argv) == f"vtoken {argv[0]}: error: {line}"
    assert built == []


def test_sla_prompts_beyond_memory_are_refused_before_any_model(capsys, monkeypatch):
    from vtoken.experiments.common import ModelSpec

    built = []
    monkeypatch.setattr(ModelSpec, "build", lambda self: built.append(self))
    line = exit_2_line(capsys, ["sla", "--rounds", "1000000000000"])
    assert line.startswith("vtoken sla: error: rounds: expected at most ") and " of prompts (this machine's memory), " \
        "got 1000000000000, which needs about " in line
    assert built == []


@pytest.mark.parametrize("argv, arg", [(DEMO, "num_blocks"),
                                       (["retained", "--policies", "h2o", "--requests", "2", *TINY], "requests"),
                                       (["sla", "--num-blocks", "48", *TINY], "num_blocks")])
def test_kv_cache_beyond_memory_is_refused_before_any_engine(capsys, monkeypatch, argv, arg):
    import vtoken.engine.scheduler
    import vtoken.experiments.common as common

    engines = []
    monkeypatch.setattr(vtoken.engine.scheduler, "Engine", lambda *a, **kw: engines.append(a))
    monkeypatch.setattr(common, "memory_bytes", lambda device=None: 50 * 2**10)  # prompts fit, the KV cache not
    line = exit_2_line(capsys, argv)
    assert line.startswith(f"vtoken {argv[0]}: error: {arg}: expected at most 0.0 MiB of KV cache (this machine's")
    assert engines == []


def test_kv_bytes_per_token_matches_the_allocated_cache():
    from vtoken.experiments.common import MODEL_PRESETS, ModelSpec, kv_bytes_per_token

    model = ModelSpec(device="cpu").build()
    caches, _ = model.allocate_kv_caches(6, 4)
    assert sum(t.numel() * t.element_size() for t in caches) == 6 * 4 * kv_bytes_per_token(model.config)
    assert kv_bytes_per_token(MODEL_PRESETS["tiny"]) == kv_bytes_per_token(model.config) == 2 * 2 * 2 * 16 * 4
    assert kv_bytes_per_token(MODEL_PRESETS["gpu"]) == 2 * 22 * 4 * 64 * 2  # TinyLlama's shape in bf16


def test_default_demo_packs_to_95_percent_in_steady_state(capsys):
    """The acceptance of the pressure-driven defaults: ``vtoken demo`` as shipped (memory pressure declared)."""
    got = run_json(capsys, "demo", "--device", "cpu")
    vt = got["modes"]["vtoken"]
    assert got["identical"] is True and got["config"]["prompt_len"] == 512
    assert got["reclaim"]["theta_F"] == 0.01 and got["reclaim"]["low_watermark"] == 1.0
    assert vt["steady_utilization"] >= 0.95 and vt["relocated_tokens"] > 0
    assert got["modes"]["naive"]["steady_utilization"] < 0.65


def test_fit_num_blocks_is_the_smallest_pool_that_fits():
    from vtoken.experiments.common import fit_num_blocks

    for requests in (1, 3, 8, 50):
        for per in (1, 7, 16, 100, 1000):
            need, n = requests * per, fit_num_blocks(requests, per, 16)
            assert n - 1 - auto_headroom(requests, 16) == need


# ---------------------------------------------------------------------------------- plot, progress
def test_plot_writes_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "demo.png"
    assert main([*DEMO, "--plot", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["outputs_identical"] is True
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


PLOTTED = {
    "prefix": ["prefix", "--degrees", "2", "--requests", "2", "--prefix-len", "16", "--suffix-len", "8",
               "--output-len", "10", *TINY],
    "retained": ["retained", "--policies", "h2o", "--requests", "2", "--prompt-len", "24", "--output-len", "8", *TINY],
    "frontier": ["frontier", "--trace-only", "--num-blocks", "64"],
    "sla": ["sla", "--concurrency", "1,2", "--sla-concurrency", "2", "--rounds", "1", "--prompt-len", "16",
            "--output-len", "8", "--num-blocks", "48", *TINY],
}


@pytest.mark.parametrize("command", sorted(PLOTTED))
def test_every_experiment_writes_its_figure(capsys, tmp_path, command):
    pytest.importorskip("matplotlib")
    path = tmp_path / f"{command}.png"
    assert main([*PLOTTED[command], "--plot", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_extra(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit) as e:
        main(["prefix", "--plot", str(tmp_path / "x.png")])
    assert e.value.code == 2
    assert "pip install 'vtoken[bench]'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_progress_goes_to_stderr_only(capsys):
    pytest.importorskip("rich")
    with Progress(3, "t", enabled=True) as p:
        for _ in range(3):
            p.advance()
        p.set_description("done")
    assert capsys.readouterr().out == ""
    with Progress(3, "t") as p:  # stderr is not a terminal under pytest: no bar at all
        assert p._bar is None


# ---------------------------------------------------------------------------------- subprocess
def test_subprocess_demo_json():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the user's default dispatch, as `vtoken demo` gets it
    env.pop("VTOKEN_BACKEND", None)
    res = subprocess.run([sys.executable, "-m", "vtoken.cli", *DEMO, "--json"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1, res.stdout
    got = json.loads(lines[0])
    assert got["outputs_identical"] is True
    assert got["modes"]["vtoken"]["retained_blocks_per_request"] < got["modes"]["naive"]["retained_blocks_per_request"]
    assert math.isfinite(got["modes"]["vtoken"]["tokens_per_s"])
