"""``vtoken frontier``: the capacity frontier (Figure 10), trace-only and on the engine.

Hand-computable cases use S = 4, a 4-token prompt and 5 generated tokens: a
request holds 4 + 5 - 1 = 8 KV tokens (2 blocks) at its end; a pool of 8
blocks has 7 usable ones (block 0 is the null block). So 3 requests fit
(6 blocks) and a 4th cannot: the 4 prompts take 4 blocks, and decode step 1
needs one more block per request, 8 > 7.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from vtoken.cli import main
from vtoken.errors import InvalidArgumentError
from vtoken.reclamation.config import auto_headroom
from vtoken.experiments.frontier import (
    PRESETS,
    FrontierConfig,
    VictimTrace,
    max_probes,
    run_frontier,
    search_mode,
    simulate_engine,
    simulate_trace_only,
    upper_bound,
)

KEYS = {"max_concurrency", "blocks_per_request", "ideal_packed_blocks_per_request", "num_blocks"}
MODES = ("native", "naive", "vtoken")
# A small frontier: 16-block requests (255 KV tokens), 8 packed (a 128-token budget).
SMALL = dict(num_blocks=193, prompt_len=128, output_len=128, trace_only=True)


def hand_cfg(**kw) -> FrontierConfig:
    base = dict(num_blocks=8, block_size=4, prompt_len=4, output_len=5, trace_only=True, reclaim={"check_invariants": True})
    return FrontierConfig(**{**base, **kw})


# ----------------------------------------------------------------------------- feasibility, by hand
def test_native_feasibility_by_hand():
    cfg = hand_cfg()
    ok = simulate_trace_only(cfg, "native", 3)
    assert ok.feasible and ok.reason == "ok" and ok.steps == 5
    assert ok.peak_allocated_blocks == 6 and ok.blocks_per_request == 2.0 and ok.final_blocks_per_request == 2.0
    bad = simulate_trace_only(cfg, "native", 4)
    assert not bad.feasible and bad.reason.startswith("allocation failure at step 1") and bad.steps == 1
    assert bad.peak_allocated_blocks == 4  # the prompts fit; the first decode step does not
    assert upper_bound(cfg, "native") == 3
    res = run_frontier(cfg)
    assert res.max_concurrency["native"] == 3 == 7 // 2
    assert [(p.concurrency, p.feasible) for p in res.modes["native"].probes] == [(3, True)]


def test_queuing_is_infeasible():
    # 8-token prompts need 2 blocks each at admission: 3 requests fit in 7 blocks, the 4th would wait.
    cfg = hand_cfg(prompt_len=8, output_len=1)
    assert simulate_trace_only(cfg, "native", 3).feasible
    p = simulate_trace_only(cfg, "native", 4)
    assert not p.feasible and p.reason == "queued: 3 of 4 requests fit at admission" and p.steps == 0


def test_headroom_counts_inside_the_budget():
    # Nothing is evicted (the budget holds every token), so vtoken needs what native needs,
    # but its 2-block reserve leaves 5 blocks: 2 requests, not 3.
    cfg = hand_cfg(kv_budget=8, reclaim={"headroom_blocks": 2, "check_invariants": True})
    assert upper_bound(cfg, "vtoken") == 2 and upper_bound(cfg, "native") == 3
    p = simulate_trace_only(cfg, "vtoken", 3)
    assert not p.feasible and p.reason.startswith("allocation failure at step 1") and p.headroom_blocks == 2
    res = run_frontier(cfg)
    assert res.max_concurrency == {"native": 3, "naive": 3, "vtoken": 2}
    assert res.modes["vtoken"].best.headroom_blocks == 2


@pytest.fixture
def tiny_model(monkeypatch):
    """The tiny engine model on the torch reference kernels (the Triton interpreter is slow), 1 CPU thread."""
    import torch

    from vtoken.experiments.common import ModelSpec

    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    threads = torch.get_num_threads()
    yield ModelSpec(device="cpu", threads=1).build()  # tiny matmuls: extra threads only wait (see common)
    torch.set_num_threads(threads)


def test_engine_driver_by_hand(tiny_model):
    """The engine runs the model; a 4th request is preempted at the first decode step."""
    cfg = hand_cfg(trace_only=False)
    model = tiny_model
    ok = simulate_engine(cfg, "native", 3, model)
    assert ok.feasible and ok.peak_allocated_blocks == 6 and ok.final_blocks_per_request == 2.0
    bad = simulate_engine(cfg, "native", 4, model)
    assert not bad.feasible and bad.reason == "preempted at step 1"
    queued = simulate_engine(hand_cfg(trace_only=False, prompt_len=8, output_len=2), "native", 4, model)
    assert not queued.feasible and queued.reason.startswith("queued: 1 of 4 requests waiting")


def test_engine_frontier(tiny_model):
    """The whole search on the engine (model forward, real attention): the same ordering as trace-only."""
    cfg = FrontierConfig(num_blocks=49, block_size=4, prompt_len=32, output_len=33)
    res = run_frontier(cfg, model=tiny_model)
    mc, bpr = res.max_concurrency, res.blocks_per_request
    assert res.full_blocks_per_request == 16 and res.ideal_packed_blocks_per_request == 8
    assert mc["native"] == 48 // 16 == run_frontier(FrontierConfig(**{**cfg.to_dict(), "trace_only": True,
                                                                         "modes": ("native",)})).max_concurrency["native"]
    assert mc["native"] == mc["naive"] < mc["vtoken"]
    assert bpr["vtoken"] < bpr["naive"] <= bpr["native"] == 16.0
    assert res.modes["vtoken"].best.relocated_tokens > 0


def test_default_headroom_scales_with_concurrency():
    assert [auto_headroom(c, 16) for c in (0, 1, 10, 22)] == [1, 2, 15, 31]
    cfg = FrontierConfig(**SMALL)
    assert cfg.reclaim_config("vtoken").headroom_blocks is None  # automatic: the library's default
    assert cfg.headroom("vtoken", 10) == cfg.headroom("vtoken", 22) == 0  # hole filling: no reserve
    fresh = FrontierConfig(**SMALL, reclaim={"planner": "fresh"})
    assert fresh.headroom("vtoken", 10) == 15
    assert FrontierConfig(**SMALL, reclaim={"headroom_blocks": 7}).headroom("vtoken", 10) == 7
    assert cfg.headroom("naive", 10) == 0


# ----------------------------------------------------------------------------- a small frontier
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("policy", ["random", "h2o"])
def test_small_frontier(policy, seed):
    cfg = FrontierConfig(**SMALL, policy=policy, seed=seed)
    res = run_frontier(cfg)
    mc, bpr = res.max_concurrency, res.blocks_per_request
    assert res.full_blocks_per_request == 16 and res.ideal_packed_blocks_per_request == 8
    assert mc["native"] == 192 // 16
    assert mc["native"] == mc["naive"] <= mc["vtoken"] and mc["vtoken"] > mc["naive"]
    assert bpr["native"] == 16.0 and bpr["vtoken"] < bpr["naive"] <= 16.0
    for m in MODES:
        f = res.modes[m]
        assert f.max_concurrency <= f.upper_bound
        # The search's answer: feasible at max C, infeasible at every probe above it.
        assert all(p.feasible == (p.concurrency <= f.max_concurrency) for p in f.probes)
        assert f.best.concurrency == f.max_concurrency and f.best.feasible
    vt = res.modes["vtoken"].best
    assert vt.relocated_tokens > 0 and vt.reclaimed_blocks > 0
    assert vt.utilization_mean > res.modes["naive"].best.utilization_mean


def test_same_victims_in_naive_and_vtoken():
    # memory declared always low (low_watermark=1.0): vtoken reclaims at 6 requests too
    cfg = FrontierConfig(**SMALL, reclaim={"check_invariants": True, "low_watermark": 1.0})
    trace = VictimTrace(cfg)
    naive = simulate_trace_only(cfg, "naive", 6, trace)
    decided = trace.decisions
    vt = simulate_trace_only(cfg, "vtoken", 6, trace)
    assert naive.feasible and vt.feasible
    assert decided == 6 * (cfg.output_len - 1) and trace.decisions == decided  # vtoken only replayed
    assert vt.relocated_tokens > 0 and vt.final_blocks_per_request < naive.final_blocks_per_request


def test_default_reclamation_moves_nothing_without_pressure_and_packs_under_it():
    cfg = FrontierConfig(**SMALL, reclaim={"check_invariants": True})
    trace = VictimTrace(cfg)
    roomy = simulate_trace_only(cfg, "vtoken", 6, trace)  # 6 x 16 full blocks fit 191 usable: no pressure
    assert roomy.feasible and roomy.relocated_tokens == 0 and roomy.plans == 0
    naive_c = run_frontier(FrontierConfig(**{**SMALL, "modes": ("naive",)})).max_concurrency["naive"]
    tight = simulate_trace_only(cfg, "vtoken", naive_c + 4, trace)  # only reclamation makes this fit
    assert tight.feasible and tight.relocated_tokens > 0 and tight.reclaimed_blocks > 0


def test_upper_bound_plus_one_is_infeasible():
    cfg = FrontierConfig(**SMALL)
    trace = VictimTrace(cfg)
    for m in MODES:
        ub = upper_bound(cfg, m)
        assert not simulate_trace_only(cfg, m, ub + 1, trace).feasible


@pytest.mark.parametrize("frontier", [0, 1, 7, 17, 18])
def test_search_bisects_on_a_monotone_oracle(frontier):
    cfg = FrontierConfig(**SMALL)
    ub = upper_bound(cfg, "vtoken")
    assert ub == 21  # 21 x ceil(129 / 16) = 189 <= 192 blocks (hole filling: no reserve)
    assert upper_bound(FrontierConfig(**SMALL, reclaim={"planner": "fresh"}), "vtoken") == 18  # + auto_headroom
    seen = []

    class P:  # the fields search_mode reads
        def __init__(self, c):
            self.concurrency, self.feasible = c, c <= frontier

    def sim(c):
        seen.append(c)
        return P(c)

    f = search_mode(cfg, "vtoken", sim)
    assert f.max_concurrency == frontier and seen[0] == ub
    assert len(seen) == len(set(seen)) <= 1 + math.ceil(math.log2(ub))
    assert (f.best is None) == (frontier == 0) and max_probes(cfg) >= len(seen)


# ----------------------------------------------------------------------------- configuration
def test_preset_and_options():
    cfg = FrontierConfig.from_preset("paper-0.35", trace_only=True)
    assert (cfg.num_blocks, cfg.block_size, cfg.kv_tokens, cfg.kv_budget) == (5427, 16, 16320, 8192)
    assert PRESETS["paper-0.50"]["num_blocks"] == 11519
    assert FrontierConfig.from_options("paper-0.50", num_blocks=None).num_blocks == 11519
    # An explicit evict ratio replaces the preset's budget: 30% of 16320 tokens evicted.
    assert FrontierConfig.from_options("paper-0.35", evict_ratio=0.3).kv_budget == 11424
    assert FrontierConfig.from_options("paper-0.35", window=8).make_policy().window == 8
    assert FrontierConfig.from_options(None, reclaim={"headroom_blocks": None}).reclaim == {}


@pytest.mark.parametrize("kw, match", [
    (dict(num_blocks=1), "num_blocks: expected an int >= 2"),
    (dict(evict_ratio=1.0), r"evict_ratio: expected a value in \[0, 1\)"),
    (dict(policy="lru"), "policy: expected one of"),
    (dict(modes=("native", "native")), "modes: expected distinct modes"),
    (dict(policy_config={"budget": 3}), "policy_config: expected a dict without 'budget'"),
    (dict(reclaim={"theta_F": 2.0}), r"theta_F: expected a value in \[0, 1\)"),
    (dict(reclaim={"mode": "naive"}), "reclaim: expected ReclaimConfig fields without 'mode'"),
])
def test_bad_config(kw, match):
    with pytest.raises(InvalidArgumentError, match=match):
        FrontierConfig(**kw)


def test_bad_preset():
    with pytest.raises(InvalidArgumentError, match="preset: expected one of"):
        FrontierConfig.from_preset("paper-1.0")
    with pytest.raises(InvalidArgumentError, match="preset: expected one of"):
        FrontierConfig.from_options("paper-1.0")


# ----------------------------------------------------------------------------- CLI
def run_cli_json(capsys, *args) -> dict:
    assert main(["frontier", *args, "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    return json.loads(out[0])


def test_cli_json(capsys):
    d = run_cli_json(capsys, "--trace-only", "--num-blocks", "193", "--prompt-len", "128", "--output-len", "128")
    assert KEYS <= set(d)
    assert set(d["max_concurrency"]) == set(MODES) and set(d["blocks_per_request"]) == set(MODES)
    assert all(isinstance(v, int) for v in d["max_concurrency"].values())
    assert d["num_blocks"] == 193 and d["ideal_packed_blocks_per_request"] == 8
    assert d["max_concurrency"]["native"] == d["max_concurrency"]["naive"] == 12 < d["max_concurrency"]["vtoken"]
    assert d["utilization"]["vtoken"] > d["utilization"]["naive"]


def test_cli_table_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "frontier.png"
    assert main(["frontier", "--trace-only", "--num-blocks", "97", "--prompt-len", "64", "--output-len", "64",
                 "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "vtoken frontier:" in out and "native" in out and "vtoken" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plot_without_matplotlib(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit) as e:
        main(["frontier", "--trace-only", "--plot", str(tmp_path / "x.png")])
    assert e.value.code == 2
    assert "vtoken[bench]" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_cli_bad_option(capsys):
    with pytest.raises(SystemExit) as e:
        main(["frontier", "--trace-only", "--evict-ratio", "1.5"])
    assert e.value.code == 2 and "evict_ratio: expected a value in [0, 1)" in capsys.readouterr().err


@pytest.mark.parametrize("trace_only", [True, False])
def test_cli_pool_beyond_memory_is_refused_before_any_probe(capsys, monkeypatch, trace_only):
    """193 blocks of 16: the trace-only run's ~1 MiB (320 B per slot) or the tiny model's 1.5 MiB KV cache."""
    import vtoken.experiments.common as common
    import vtoken.experiments.frontier as frontier

    probes = []
    monkeypatch.setattr(frontier, "search_mode", lambda *a: probes.append(a))
    monkeypatch.setattr(common, "memory_bytes", lambda device=None: 2**19)
    with pytest.raises(SystemExit) as e:
        main(["frontier", *(["--trace-only"] if trace_only else ["--device", "cpu"]), "--num-blocks", "193"])
    assert e.value.code == 2
    what = "trace-only run" if trace_only else "KV cache"
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"vtoken frontier: error: num_blocks: expected at most 0.5 MiB of {what} (this machine's")
    assert last.endswith(", got 193, which needs about " + ("0.9 MiB" if trace_only else "1.5 MiB"))
    assert probes == []


# ----------------------------------------------------------------------------- the paper's setting
# The paper's request scaled down 8x: 1024 + 1009 tokens (2032 KV tokens = 127 blocks), a
# 1024-token budget (64 blocks), 679 blocks (5427 / 8): native 678 // 127 = 5.
SCALED = ["--trace-only", "--num-blocks", "679", "--prompt-len", "1024", "--output-len", "1009",
          "--kv-budget", "1024"]


def test_scaled_paper_preset(capsys):
    d = run_cli_json(capsys, *SCALED)
    mc = d["max_concurrency"]
    assert d["full_blocks_per_request"] == 127 and d["ideal_packed_blocks_per_request"] == 64
    assert mc["native"] == mc["naive"] == 5 and mc["vtoken"] >= 8
    assert d["blocks_per_request"]["vtoken"] < 70 < 120 < d["blocks_per_request"]["naive"]
    assert d["utilization"]["vtoken"] >= 0.95


@pytest.mark.slow
def test_paper_preset_subprocess():
    """The issue's acceptance command, as a user runs it (about 25 s on a 2-core CPU)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-m", "vtoken.cli", "frontier", "--preset", "paper-0.35", "--trace-only",
                          "--json"], capture_output=True, text=True, check=True, env=env, timeout=600)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout
    d = json.loads(lines[0])
    assert KEYS <= set(d)
    assert d["num_blocks"] == 5427 and d["ideal_packed_blocks_per_request"] == 512
    assert d["full_blocks_per_request"] == 1020 and d["blocks_per_request"]["native"] == 1020.0
    mc = d["max_concurrency"]
    assert mc["native"] == mc["naive"] == 5 and mc["vtoken"] == 10  # the ideal packed bound, with the defaults
    rec = d["config"]["reclaim"]
    assert rec["theta_F"] == 0.01 and rec["low_watermark"] == 0 and rec["headroom_blocks"] is None  # the defaults
    cont = d["continuous_reclaim"]
    assert cont["max_concurrency"] == 10 and cont["best"]["utilization_mean"] >= 0.95
    wa = d["write_amplification"]
    assert 0 < wa["default"] < wa["continuous"]  # moving only what the pressure needs moves less per block
