"""``vtoken fragmentation``: in-process and as a subprocess, against exact expectations.

Random eviction kills each token independently with probability p, so the live
count X of a block is Binomial(S, 1 - p). Naive-Evict frees a non-tail block
with X == 0 and keeps the tail, so over R requests of B = L / S blocks:
    E[allocated] = R * ((B - 1) * P(X >= 1) + 1)
    E[blocks at <= u] = R * ((B - 1) * P(1 <= X <= u*S) + P(X <= u*S))
    E[live] = R * L * (1 - p)
The reported fractions are ratios over N = R * B = 16,384 blocks (defaults), so
their standard deviation is at most sqrt(0.25 / N) = 0.0039; F's is ~0.001
over R * L = 262,144 tokens (``sds`` below). The tolerances are 5 standard
deviations: a false failure has probability < 1e-6 per check.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from vtoken.cli import main
from vtoken.experiments.fragmentation import FragmentationConfig, run_fragmentation, victims

KEYS = {"waste_ratio", "frac_blocks_le_25pct", "frac_blocks_le_50pct", "retained_blocks_per_request",
        "ideal_blocks_per_request", "table_bytes_per_token"}
SEEDS = [0, 1, 2]


def binom_cdf(k: int, n: int, q: float) -> float:
    return sum(math.comb(n, i) * q**i * (1 - q) ** (n - i) for i in range(0, k + 1)) if k >= 0 else 0.0


def expected_random(p: float, R: int, L: int, S: int) -> dict:
    q = 1 - p  # a token survives
    B = L // S
    p0 = binom_cdf(0, S, q)
    alloc = R * ((B - 1) * (1 - p0) + 1)
    frac = {u: R * ((B - 1) * (binom_cdf(int(u * S), S, q) - p0) + binom_cdf(int(u * S), S, q)) / alloc
            for u in (0.25, 0.5)}
    return {"waste_ratio": 1 - R * L * q / (alloc * S), "frac_blocks_le_25pct": frac[0.25],
            "frac_blocks_le_50pct": frac[0.5], "retained_blocks_per_request": alloc / R}


def run_cli_json(capsys, *args) -> dict:
    assert main(["fragmentation", *args, "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    return json.loads(out[0])


@pytest.mark.parametrize("seed", SEEDS)
def test_random_half_matches_binomial_arithmetic(capsys, seed):
    got = run_cli_json(capsys, "--pattern", "random", "--evict-ratio", "0.5", "--seed", str(seed))
    assert set(got) == KEYS and all(isinstance(v, float) for v in got.values())
    d = FragmentationConfig()
    exp = expected_random(0.5, d.requests, d.context, d.block_size)
    assert abs(got["waste_ratio"] - 0.5) < 0.05  # the acceptance bound
    sd = sds(0.5, d.requests, d.context, d.block_size)
    assert sd["waste_ratio"] < 0.001 and sd["frac"] < 0.004
    assert got["waste_ratio"] == pytest.approx(exp["waste_ratio"], abs=5 * sd["waste_ratio"])
    assert exp["frac_blocks_le_50pct"] == pytest.approx(0.598, abs=1e-3)  # 0.5 + P(X = 8) / 2
    assert got["frac_blocks_le_50pct"] == pytest.approx(exp["frac_blocks_le_50pct"], abs=5 * sd["frac"])
    assert got["frac_blocks_le_25pct"] == pytest.approx(exp["frac_blocks_le_25pct"], abs=5 * sd["frac"])
    # Hardly any block is fully dead at S = 16: a paged engine keeps them all, twice the packed need.
    assert got["retained_blocks_per_request"] == pytest.approx(exp["retained_blocks_per_request"], abs=0.05)
    assert got["ideal_blocks_per_request"] == pytest.approx(d.context / 2 / d.block_size, rel=0.02)
    assert got["table_bytes_per_token"] <= 5.0


def sds(p: float, R: int, L: int, S: int) -> dict:
    """Standard deviations (upper bounds) of the reported values under random eviction.

    live T ~ Binomial(R*L, 1-p); allocated A = R + Binomial((B-1)*R, 1 - P(X=0));
    F = 1 - T / (A*S), so sd(F) <= (1 - F) * (sd(T)/T + sd(A)/A) whatever their
    correlation; a fraction of A i.i.d. blocks has sd <= sqrt(0.25 / A).
    """
    q, B = 1 - p, L // S
    p0 = binom_cdf(0, S, q)
    T, A = R * L * q, R * ((B - 1) * (1 - p0) + 1)
    sd_A = math.sqrt((B - 1) * R * p0 * (1 - p0))
    rel = math.sqrt(R * L * q * p) / T + sd_A / A
    return {"waste_ratio": T / (A * S) * rel, "frac": math.sqrt(0.25 / A), "retained": sd_A / R}


@pytest.mark.parametrize("p", [0.25, 0.75, 0.9])
def test_random_other_ratios(capsys, p):
    R, L, S = 16, 2048, 16
    got = run_cli_json(capsys, "--evict-ratio", str(p), "--requests", str(R), "--context", str(L))
    exp, sd = expected_random(p, R, L, S), sds(p, R, L, S)
    assert got["waste_ratio"] == pytest.approx(exp["waste_ratio"], abs=5 * sd["waste_ratio"])
    assert got["frac_blocks_le_50pct"] == pytest.approx(exp["frac_blocks_le_50pct"], abs=5 * sd["frac"])
    assert got["frac_blocks_le_25pct"] == pytest.approx(exp["frac_blocks_le_25pct"], abs=5 * sd["frac"])
    assert got["retained_blocks_per_request"] == pytest.approx(exp["retained_blocks_per_request"],
                                                               abs=5 * sd["retained"] + 1e-9)


def test_strided_is_exact(capsys):
    got = run_cli_json(capsys, "--pattern", "strided", "--evict-ratio", "0.5", "--requests", "8")
    assert got["waste_ratio"] == 0.5  # every block keeps exactly 8 of 16
    assert got["frac_blocks_le_50pct"] == 1.0 and got["frac_blocks_le_25pct"] == 0.0
    assert got["retained_blocks_per_request"] == 256.0 and got["ideal_blocks_per_request"] == 128.0


def test_window_frees_whole_blocks(capsys):
    got = run_cli_json(capsys, "--pattern", "window", "--evict-ratio", "0.5", "--requests", "8")
    # Tokens 4..2051 die: blocks 1..127 are freed, block 0 keeps 4 live, block 128 keeps 12.
    assert got["retained_blocks_per_request"] == 129.0 and got["ideal_blocks_per_request"] == 128.0
    assert got["waste_ratio"] == pytest.approx(1 - 2048 / (129 * 16), abs=1e-12)
    assert got["frac_blocks_le_25pct"] == pytest.approx(1 / 129, abs=1e-12)  # block 0 (4 of 16)
    assert got["frac_blocks_le_50pct"] == pytest.approx(1 / 129, abs=1e-12)


@pytest.mark.parametrize("pattern", ["random", "strided", "window"])
def test_edge_ratios(capsys, pattern):
    none = run_cli_json(capsys, "--pattern", pattern, "--evict-ratio", "0", "--requests", "4", "--context", "100")
    assert none["waste_ratio"] == pytest.approx(1 - 100 / (7 * 16)) and none["retained_blocks_per_request"] == 7.0
    everything = run_cli_json(capsys, "--pattern", pattern, "--evict-ratio", "1", "--requests", "4", "--context", "100")
    assert everything["waste_ratio"] == 1.0 and everything["retained_blocks_per_request"] == 1.0  # the tail stays
    assert everything["ideal_blocks_per_request"] == 0.0


@pytest.mark.parametrize("pattern", ["random", "strided", "window"])
@pytest.mark.parametrize("p", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("L", [1, 17, 100])
def test_victims_are_unique_ascending_and_in_range(pattern, p, L):
    import numpy as np

    v = victims(pattern, p, L, np.random.default_rng(0))
    assert v.dtype == np.int64 and (np.diff(v) > 0).all() and (v.size == 0 or (v[0] >= 0 and v[-1] < L))
    if pattern != "random":
        assert len(v) == min(L, round(p * L))


def test_text_output(capsys):
    assert main(["fragmentation", "--requests", "2", "--context", "64"]) == 0
    out = capsys.readouterr().out
    for label in ("waste ratio F", "<= 25%", "<= 50%", "retained blocks per request",
                  "ideal packed blocks per request", "bytes/token"):
        assert label in out


@pytest.mark.parametrize("args, match", [
    (["--evict-ratio", "1.5"], "evict_ratio: expected a value in"),
    (["--requests", "0"], "requests: expected an int >= 1"),
    (["--block-size", "0"], "block_size: expected an int >= 1"),
    (["--pattern", "bogus"], "invalid choice"),
])
def test_bad_options_exit_2_naming_the_option(capsys, args, match):
    with pytest.raises(SystemExit) as e:
        main(["fragmentation", *args])
    assert e.value.code == 2
    assert match in capsys.readouterr().err


def test_no_subcommand_prints_help(capsys):
    assert main([]) == 2
    assert "fragmentation" in capsys.readouterr().err


def test_config_dataclass_validates():
    with pytest.raises(ValueError, match="pattern: "):
        FragmentationConfig(pattern="nope")
    r = run_fragmentation(FragmentationConfig(requests=2, context=64, block_size=8, evict_ratio=0.0))
    assert r.waste_ratio == 0.0 and r.retained_blocks_per_request == 8.0


@pytest.mark.parametrize("entry", ["module", "script"])
def test_subprocess_json(entry):
    if entry == "module":
        cmd = [sys.executable, "-m", "vtoken.cli"]
    else:
        script = os.path.join(os.path.dirname(sys.executable), "vtoken")
        if not os.path.exists(script):
            pytest.skip("the vtoken console script is not installed in this environment")
        cmd = [script]
    res = subprocess.run(cmd + ["fragmentation", "--pattern", "random", "--evict-ratio", "0.5", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert set(got) == KEYS
    assert abs(got["waste_ratio"] - 0.5) < 0.05
    assert got["frac_blocks_le_50pct"] == pytest.approx(0.598, abs=0.02)


@pytest.mark.parametrize("args, line", [
    (["--seed", "-1"], "seed: expected an int >= 0, got -1"),
    (["--requests", "1000000000000"],
     "requests: expected a pool of at most 134217728 blocks of 16 tokens (int32 slot ids), got 1000000000000, "
     "which needs 256000000000001"),
    (["--context", "1099511627776"],
     "context: expected a pool of at most 134217728 blocks of 16 tokens (int32 slot ids), got 1099511627776, "
     "which needs 68719476737"),
    (["--context", "2147483648", "--block-size", "1"],
     "context: expected a pool of at most 2147483648 blocks of 1 tokens (int32 slot ids), got 2147483648, "
     "which needs 2147483649"),
])
def test_bad_sizes_exit_2_with_one_line_before_allocating(capsys, monkeypatch, args, line):
    import vtoken.experiments.fragmentation as frag

    pools = []
    monkeypatch.setattr(frag, "BlockPool", lambda n: pools.append(n))  # nothing may be allocated
    with pytest.raises(SystemExit) as e:
        main(["fragmentation", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == f"vtoken fragmentation: error: {line}"
    assert pools == []


@pytest.mark.parametrize("args, memory, arg", [
    ([], 2**24, "requests"),  # 64 x 4096 tokens: about 30 MiB, one request 0.5 MiB
    (["--requests", "1", "--context", "1000000"], 2**24, "context"),  # one request alone: about 110 MiB
    (["--requests", "1", "--context", "10000", "--policy", "h2o"], 2**24, "context"),  # the policy's prefill counts
])
def test_sizes_beyond_memory_are_refused_naming_the_option(capsys, monkeypatch, args, memory, arg):
    import vtoken.experiments.common as common
    import vtoken.experiments.fragmentation as frag

    monkeypatch.setattr(common, "memory_bytes", lambda device=None: memory)
    pools = []
    monkeypatch.setattr(frag, "BlockPool", lambda n: pools.append(n))
    with pytest.raises(SystemExit) as e:
        main(["fragmentation", *args])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"vtoken fragmentation: error: {arg}: expected at most 16.0 MiB of token table")
    assert "(this machine's memory), got " in last and pools == []


def test_size_estimate_covers_a_measured_run():
    """The memory estimate bounds what a run really allocates (tracemalloc peak), within 2x."""
    import tracemalloc

    from vtoken.experiments.fragmentation import host_bytes

    for S, R, L in ((1, 8, 8192), (16, 8, 8192), (16, 1024, 16)):
        cfg = FragmentationConfig(requests=R, context=L, block_size=S, evict_ratio=1.0)
        tracemalloc.start()
        try:
            run_fragmentation(cfg)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert 0.5 * host_bytes(R, L, S) < peak <= host_bytes(R, L, S), (S, R, L, peak)
