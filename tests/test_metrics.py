"""MetricsLog: a bounded ring of step records whose totals cover every step.

The reference is the same log with no bound (``capacity=None``): fed the same
records, the ring must keep exactly its newest ``capacity`` records and report
the same summary and totals, the dropped steps included.
"""
from __future__ import annotations

import csv
import doctest
import functools
import io
import json
import random

import pytest

import vtoken.metrics as metrics_module
from vtoken.errors import InvalidArgumentError, InvalidTypeError
from vtoken.metrics import DEFAULT_CAPACITY, FIELDS, MetricsLog, StepRecord

SEEDS = [0, 1, 2]
CAPACITIES = [1, 2, 7, 64]


def random_records(seed: int, n: int) -> list:
    """``n`` steps with a plan on about a third, blocks allocated on most, backpressure now and then."""
    rng = random.Random(seed)
    out = []
    for step in range(n):
        plans = rng.choice([0, 0, 1, 2])
        out.append(StepRecord(
            step=step, free_blocks=rng.randrange(100), waste_ratio=rng.random(),
            allocated_blocks=rng.choice([0, rng.randrange(1, 50)]), plans=plans, moves=plans * rng.randrange(30),
            src_blocks=2 * plans, dst_blocks=plans, freed_blocks=rng.randrange(3), aborted_plans=rng.randrange(2),
            planner_us=rng.uniform(1, 500), commit_us=rng.uniform(1, 50), host_stall_us=rng.uniform(0, 9),
            event_waits=rng.randrange(2), backpressure=rng.random() < 0.2,
        ))
    return out


def fill(log: MetricsLog, records: list) -> MetricsLog:
    for r in records:
        log.append(r)
    return log


def test_default_capacity_is_bounded():
    log = MetricsLog()
    assert log.capacity == DEFAULT_CAPACITY == 4096
    fill(log, [StepRecord(step=i) for i in range(DEFAULT_CAPACITY + 10)])
    assert len(log) == DEFAULT_CAPACITY and log.totals.steps == DEFAULT_CAPACITY + 10
    assert log.records[0].step == 10 and log.records[-1].step == DEFAULT_CAPACITY + 9


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("capacity", CAPACITIES)
@pytest.mark.parametrize("n", [0, 1, 7, 100])
def test_ring_keeps_the_newest_and_totals_cover_every_step(seed, capacity, n):
    recs = random_records(seed, n)
    ring, full = fill(MetricsLog(capacity), recs), fill(MetricsLog(None), recs)
    assert list(ring.records) == recs[-capacity:] if n else list(ring.records) == []
    assert len(ring) == min(n, capacity) and len(full) == n
    assert ring.totals == full.totals and ring.summary() == full.summary()
    # The summary is over every step, by its definitions.
    s = ring.summary()
    assert s["steps"] == n
    if n:
        planned = [r for r in recs if r.plans]
        assert s["plans"] == sum(r.plans for r in recs) and s["moves"] == sum(r.moves for r in recs)
        assert s["freed_blocks"] == sum(r.freed_blocks for r in recs)
        assert s["backpressure_steps"] == sum(r.backpressure for r in recs)
        assert s["final_waste_ratio"] == recs[-1].waste_ratio and s["final_free_blocks"] == recs[-1].free_blocks
        assert s["mean_planner_us"] == pytest.approx(sum(r.planner_us for r in recs) / n, rel=1e-12)
        assert s["mean_planner_us_when_planning"] == pytest.approx(
            sum(r.planner_us for r in planned) / len(planned) if planned else 0.0, rel=1e-12)
    else:
        assert s == {"steps": 0}
    allocated = [r.waste_ratio for r in recs if r.allocated_blocks > 0]
    assert ring.totals.mean_waste_ratio == pytest.approx(sum(allocated) / len(allocated) if allocated else 0.0,
                                                        rel=1e-12)
    assert ring.totals.dst_blocks == sum(r.dst_blocks for r in recs)


def test_exports_hold_the_kept_steps_and_the_summary_of_all(tmp_path):
    recs = random_records(0, 10)
    log = fill(MetricsLog(capacity=3), recs)
    js = json.loads(log.to_json(str(tmp_path / "m.json")))
    assert [row["step"] for row in js["steps"]] == [7, 8, 9]
    assert js["summary"]["steps"] == 10 and js["summary"]["plans"] == sum(r.plans for r in recs)
    rows = list(csv.DictReader(io.StringIO(log.to_csv())))
    assert tuple(rows[0]) == FIELDS and [int(r["step"]) for r in rows] == [7, 8, 9]


@pytest.mark.parametrize("bad, exc", [(0, InvalidArgumentError), (-1, InvalidArgumentError),
                                      (True, InvalidTypeError), (2.5, InvalidTypeError), ("8", InvalidTypeError)])
def test_bad_capacity_is_rejected(bad, exc):
    with pytest.raises(exc, match="capacity: expected an int >= 1, got "):
        MetricsLog(bad)


def test_docstring_example_runs():
    failures, tried = doctest.testmod(metrics_module)
    assert failures == 0 and tried > 0


def test_frontier_probe_is_the_same_with_a_tiny_ring(monkeypatch):
    """An experiment that sums over all steps reads the running totals: a 4-record ring changes nothing."""
    import vtoken.reclamation.manager
    from vtoken.experiments.frontier import FrontierConfig, VictimTrace, simulate_trace_only

    # memory declared always low: 6 requests would fit without reclaiming (no pressure, nothing moved)
    cfg = FrontierConfig(num_blocks=97, prompt_len=64, output_len=64, trace_only=True, reclaim={"low_watermark": 1.0})
    trace = VictimTrace(cfg)
    probes = {}
    for capacity in (None, 4):
        monkeypatch.setattr(vtoken.reclamation.manager, "MetricsLog", functools.partial(MetricsLog, capacity=capacity))
        p = simulate_trace_only(cfg, "vtoken", 6, trace)
        probes[capacity] = {k: v for k, v in p.to_dict().items() if k != "seconds"}
    assert probes[None]["steps"] > 4 and probes[None]["relocated_tokens"] > 0 and probes[None]["plans"] > 4
    assert probes[4] == probes[None]


def test_paired_run_summary_is_the_same_with_a_tiny_ring(monkeypatch):
    """The engine experiments' per-mode numbers (F averaged over all steps, relocations) survive a 4-record ring."""
    import vtoken.reclamation.manager
    from vtoken.experiments.common import ModelSpec, make_prompts, paired_run, policy_config

    monkeypatch.setenv("VTOKEN_BACKEND", "torch")  # the Triton interpreter is far too slow for engine runs
    model = ModelSpec(device="cpu").build()
    prompts = make_prompts(2, 16, model.config.vocab_size, 0)
    engine_cfg = dict(num_blocks=32, block_size=4, max_num_reqs=2, max_num_tokens=64, reclaim=dict(low_watermark=1.0))
    runs = {}
    for capacity in (None, 4):
        monkeypatch.setattr(vtoken.reclamation.manager, "MetricsLog", functools.partial(MetricsLog, capacity=capacity))
        out = paired_run(model, prompts, 16, modes=("naive", "vtoken"), policy="h2o",
                         policy_cfg=policy_config("h2o", 0.5, 4, sink=0), engine_cfg=engine_cfg)
        runs[capacity] = {m: {k: v for k, v in r.to_dict().items() if k not in ("seconds", "tokens_per_s")}
                          for m, r in out.items()}
        assert len(out["vtoken"].engine.reclaimer.metrics.records) == min(out["vtoken"].engine.step_count,
                                                                         capacity or 10**9)
    vt = runs[None]["vtoken"]
    assert vt["relocated_tokens"] > 0 and vt["waste_ratio_mean"] > 0
    assert runs[4] == runs[None]
