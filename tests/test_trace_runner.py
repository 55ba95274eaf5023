"""TraceRunner: the engine without a model forward keeps the real table, ledger and schedule.

- A trace engine and a tiny-model engine serving the same workload on the same
  victims (the model run's, replayed) take the same steps: kind, batch, new
  tokens, preemptions, evictions, allocated / free blocks and live tokens after
  every step, and the same per-request preemptions, peak and retained blocks.
- Each step's :class:`Forward` holds what it attended (hand-checked), and the
  modeled clock is the roofline's sum over those steps.
- The synthetic attention of a whole prompt is frontier's, bit for bit.
- Bad input raises a typed error naming the argument, before any state changes.
"""
from __future__ import annotations

import dataclasses
import doctest
import importlib

import numpy as np
import pytest

from engine_helpers import EAGER_RECLAIM, POLICY_CFG, TINY, prompts as _prompts
from vtoken.engine.model import LlamaModel, ModelConfig
from vtoken.engine.runner import RunnerConfig
from vtoken.engine.scheduler import DEFAULT_HISTORY, Engine, EngineConfig
from vtoken.engine.trace_runner import TraceRunner, trace_engine
from vtoken.errors import InvalidArgumentError, InvalidTypeError
from vtoken.experiments.cost_model import H200Roofline, ModelShape
from vtoken.experiments.synthetic_scores import SyntheticAttention
from vtoken.experiments.sla import timed_engine_class
from vtoken.experiments.sla_modeled import ForwardMarks, modeled_times
from vtoken.experiments.synthetic_scores import SyntheticScores
from vtoken.policies import ReplayPolicy

MODES = ("native", "naive", "vtoken")
VOCAB = TINY["vocab_size"]


@pytest.fixture(scope="module")
def model():
    return LlamaModel(ModelConfig(**TINY))


def _config(mode: str, **kw) -> EngineConfig:
    evicts = mode != "native"
    cfg = dict(mode=mode, num_blocks=30, block_size=4, max_num_reqs=6, max_num_tokens=256, decision="host",
               reclaim=EAGER_RECLAIM, policy="h2o" if evicts else None, policy_config=POLICY_CFG if evicts else {})
    return EngineConfig(**{**cfg, **kw})


def _step_rows(eng) -> list:
    return [tuple(v for k, v in dataclasses.asdict(s).items() if k != "seconds") for s in eng.stats]


def _request_rows(out) -> list:
    return [(r.request_id, len(r.output), r.num_preemptions, r.peak_blocks, r.retained_blocks, r.live_tokens)
            for r in out]


# eager: the tests' always-low-memory reclamation, whole prompts; defaults: the library's pressure-driven
# reclamation with chunked prefill (16-token steps: prompts of up to 29 tokens span two or three)
SCHEDULES = {"eager": {}, "defaults+chunked": dict(reclaim=None, chunked_prefill=True, max_num_tokens=16)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_trace_engine_takes_the_model_engines_steps(model, monkeypatch, mode, seed, schedule):
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    rng = np.random.default_rng(seed)
    prompts = _prompts(rng.integers(6, 30, 10), seed=seed)
    new_tokens = [int(n) for n in rng.integers(4, 20, 10)]
    extra = SCHEDULES[schedule]
    real = Engine(model, _config(mode, **extra), record_trace=mode != "native")
    out_real = real.generate(prompts, new_tokens, concurrency=5)
    replay = ReplayPolicy(real.trace) if mode != "native" else None
    sim = trace_engine(_config(mode, **extra), vocab_size=VOCAB, policy=replay)
    out_sim = sim.generate(prompts, new_tokens, concurrency=5)
    if replay is not None:
        replay.check_complete()  # every recorded decision was asked for, at the same (request, seq_len)
    assert _step_rows(sim) == _step_rows(real)
    assert _request_rows(out_sim) == _request_rows(out_real)
    s, r = sim.summary(), real.summary()
    for key in ("preemptions", "peak_blocks", "peak_running", "relocated_tokens", "reclaimed_blocks",
                "backpressure_steps"):
        assert s[key] == r[key], key
    if schedule == "eager":
        assert r["preemptions"] > 0  # the pool is tight enough to exercise preemption by recompute
        if mode == "vtoken":
            assert r["relocated_tokens"] > 0 and r["backpressure_steps"] > 0
    else:
        assert any(st.kind == "mixed" for st in real.stats)  # prompt chunks ran next to decodes
        if mode == "vtoken":
            assert r["relocated_tokens"] > 0  # the pressure-driven trigger fired
    assert sim.table.ledger.num_allocated == 0
    sim.table.check_invariants()


def test_forwards_record_what_each_step_attended():
    # native: everything held is attended; two prompts (3 and 5 tokens), 3 new tokens each
    eng = trace_engine(_config("native", num_blocks=16), vocab_size=VOCAB)
    eng.generate([np.arange(3), np.arange(5)], 3)
    got = [(f.past.tolist(), f.new.tolist(), f.decode) for f in eng.runner.take_forwards()]
    assert got == [([0, 0], [3, 5], False), ([3, 5], [1, 1], True), ([4, 6], [1, 1], True)]
    assert eng.runner.take_forwards() == []
    # naive: only live tokens are attended. StreamingLLM keeps sink 1 + window 2; at decode the prompt's own step
    # protects its new tokens, so the first decode attends all 6 and the later ones the 3 kept
    eng = trace_engine(_config("naive", num_blocks=16, policy="streamingllm",
                               policy_config={"budget": 3, "window": 2, "sink": 1}), vocab_size=VOCAB)
    eng.generate([np.arange(6)], 4)
    got = [(f.past.tolist(), f.new.tolist()) for f in eng.runner.take_forwards()]
    assert got == [([0], [6]), ([6], [1]), ([3], [1]), ([3], [1])]


def test_the_modeled_clock_is_the_roofline_summed_over_the_steps():
    m = ModelShape("toy", num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1,
                   head_dim=4, vocab_size=VOCAB)
    r = H200Roofline(hbm_bandwidth=1000.0, flops_rate=1e6, mfu=0.5, step_overhead=0.25)
    eng = trace_engine(_config("native", num_blocks=16), vocab_size=VOCAB,
                       engine_class=lambda *a, **kw: timed_engine_class()(*a, clock=ForwardMarks(), **kw))
    eng.generate([np.arange(3), np.arange(5)], 3)

    def step(new, kv, pairs):  # the roofline by hand: bytes and FLOPs of the step
        nbytes = m.weight_bytes + m.kv_bytes_per_token * (kv + new)
        flops = 2 * m.matmul_params * new + 4 * 2 * 2 * 4 * pairs
        return max(nbytes / 1000.0, flops / 5e5) + 0.25

    prefill = step(8, 0, 3 * 4 // 2 + 5 * 6 // 2)  # causal: 6 + 15 pairs
    decode1, decode2 = step(2, 3 + 5, 4 + 6), step(2, 4 + 6, 5 + 7)
    expected = np.cumsum([0.0, prefill, decode1, decode2])
    times = modeled_times(eng.marks, m, r)
    assert times == pytest.approx(expected, rel=1e-12, abs=0)
    assert eng.first_steps == [(0, 1), (0, 1)] and sorted(eng.gap_steps) == [(1, 2), (1, 2), (2, 3), (2, 3)]


@pytest.mark.parametrize("n, window", [(1, 0), (7, 0), (64, 0), (64, 8), (5, 9)])
def test_a_whole_prompts_scores_are_frontiers_synthetic_attention(n, window):
    got = SyntheticScores(length=64, seed=3)(5).scores(np.arange(n), n, window)
    want = SyntheticAttention(64, seed=3, request=5).prefill(n, window=window)
    if n == 1 and not window:  # one query: the decode path (with noise)
        want = SyntheticAttention(64, seed=3, request=5).decode(np.arange(1))
    assert np.array_equal(got, want)


def test_decode_scores_are_frontiers_and_a_chunk_hands_out_one_unit_per_query():
    src = SyntheticScores(length=64, seed=1)(2)
    ids = np.array([0, 3, 4, 9, 10])
    assert np.array_equal(src.scores(ids, 1), SyntheticAttention(64, seed=1, request=2).decode(ids))
    chunk = src.scores(ids, 3)  # queries 4, 9, 10 after keys 0 and 3
    assert chunk.sum() == pytest.approx(3.0, rel=1e-12)
    w = src.attention.salience[ids]
    first_query = w[:3] / w[:3].sum()  # query 4 sees keys 0, 3 and itself
    assert chunk[0] > first_query[0]  # the two later queries add to key 0's mass


def test_trace_runner_refuses_what_it_cannot_do():
    rc = RunnerConfig(num_blocks=8, block_size=4, key_scores="sum")
    with pytest.raises(InvalidArgumentError, match="attention"):
        TraceRunner(rc, vocab_size=10)
    with pytest.raises(InvalidArgumentError, match="key_scores"):
        TraceRunner(RunnerConfig(num_blocks=8, block_size=4, key_scores="per_layer"), vocab_size=10)
    with pytest.raises(InvalidArgumentError, match="cuda_graph"):
        TraceRunner(RunnerConfig(num_blocks=8, block_size=4, cuda_graph=True), vocab_size=10)
    with pytest.raises(InvalidTypeError, match="attention"):
        TraceRunner(RunnerConfig(num_blocks=8), vocab_size=10, attention=3)
    with pytest.raises(InvalidArgumentError, match="decision"):
        trace_engine(_config("naive", decision="device"), vocab_size=VOCAB)
    with pytest.raises(InvalidTypeError, match="config"):
        trace_engine({"mode": "native"}, vocab_size=VOCAB)
    with pytest.raises(InvalidArgumentError, match="request_id"):
        SyntheticScores(length=8)("a")


@pytest.mark.parametrize("call, match", [
    (lambda r: r.decode(["a"], [10]), "token_ids"),  # id outside the vocabulary
    (lambda r: r.decode(["a", "a"], [1, 2]), "reqs"),
    (lambda r: r.prefill(["a"], [[1, 2]], window=[1, 2]), "window"),
    (lambda r: r.prefill(["a"], [[1, 2]], window=2), "window"),  # no attention source to vote
    (lambda r: r.prefill(["a"], [[1, 2]], score_sink=object()), "score_sink"),
    (lambda r: r.prefill(["a"], [list(range(9))]), "max_num_tokens"),
])
def test_bad_steps_are_refused_before_the_table_changes(call, match):
    runner = TraceRunner(RunnerConfig(num_blocks=8, block_size=4, max_num_tokens=8), vocab_size=10)
    runner.add_request("a")
    runner.prefill(["a"], [[1, 2, 3]])
    before = (runner.table.num_tokens("a"), runner.table.ledger.num_free, len(runner.take_forwards()))
    with pytest.raises(InvalidArgumentError, match=match):
        call(runner)
    assert (runner.table.num_tokens("a"), runner.table.ledger.num_free, len(runner.take_forwards())) == \
        (3, before[1], 0)


def test_out_of_blocks_returns_none_with_nothing_changed():
    runner = TraceRunner(RunnerConfig(num_blocks=3, block_size=4), vocab_size=10)  # 2 usable blocks
    runner.add_request("a")
    assert runner.prefill(["a"], [np.arange(8)]) is not None
    runner.take_forwards()
    assert runner.decode(["a"], [1]) is None
    assert runner.table.num_tokens("a") == 8 and runner.take_forwards() == []


@pytest.mark.parametrize("module", ["vtoken.engine.trace_runner", "vtoken.experiments.synthetic_scores",
                                    "vtoken.experiments.sla_modeled"])
def test_docstring_examples_run(module):
    failures, tried = doctest.testmod(importlib.import_module(module))
    assert tried > 0 and failures == 0


def _long_lived(history, steps):
    """A trace engine serving a stream of short requests for ``steps`` steps; returns it and the net bytes
    Python allocated over the steps after a warm-up (tracemalloc). The warm-up fills every bounded ring:
    the reclaimer's MetricsLog keeps its last 4096 step records."""
    import tracemalloc

    eng = trace_engine(EngineConfig(mode="native", num_blocks=64, block_size=4, max_num_reqs=4, max_num_tokens=64,
                                    decision="host", history=history), vocab_size=100)
    prompt = np.arange(6)

    def run(n):
        for _ in range(n):
            while len(eng.running) + len(eng.waiting) < 4:
                eng.add_request(prompt, 5)
            eng.step()
            eng.runner.take_forwards()  # the trace runner's Forward records are the caller's (a modeled clock)

    warm = min(4500, steps)
    # NOTE: traced from the start: a block allocated before tracemalloc.start() is not counted when it is
    # freed, so a full ring replacing its old entries would look like growth
    tracemalloc.start()
    try:
        run(warm)
        before = tracemalloc.take_snapshot()
        run(steps - warm)
        growth = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    return eng, growth


def test_a_long_lived_engine_with_history_stays_bounded():
    """10,000 steps (about 8,000 requests) with history=64: the containers hold fewer than 2 x 64 entries and
    the net allocation over the last 5,500 steps stays within the trimming's swing (192 KiB), where an unbounded engine grows by
    0.18 KB per step stats + 0.8 KB per finished request (about 4 MB over those steps)."""
    eng, growth = _long_lived(64, 10_000)
    assert eng.step_count == 10_000 and eng.totals["finished"] > 7_000
    assert len(eng.stats) < 128 and len(eng.finished) < 128
    assert len(eng.requests) == len(eng.running) + len(eng.waiting)  # finished ids are forgotten
    assert eng.stats[-1].step == 9_999 and eng.summary()["requests"] == eng.totals["finished"]
    # the design's swing: each container is trimmed back to 64 once it holds 128, so between two snapshots it may
    # hold up to 64 more step stats (~0.2 KB) and finished requests (~0.8 KB): 64 KiB, doubled for allocator slack
    # (dict/list over-allocation); an unbounded engine grows ~4 MB over the same steps
    assert growth < 2 * 64 * 1024 + 64 * 1024, growth


def test_history_none_keeps_everything_and_the_summary_is_the_same():
    """history=None keeps every step and request (what the experiments' whole-run metrics read); a bounded engine's
    summary totals equal an unbounded one's over the same run."""
    full, _ = _long_lived(None, 600)
    bounded, _ = _long_lived(16, 600)
    assert len(full.stats) == 600 and len(full.finished) == full.totals["finished"]
    a, b = full.summary(), bounded.summary()
    for k in ("requests", "generated_tokens", "steps", "mean_retained_blocks", "utilization", "peak_blocks",
              "preemptions"):
        assert a[k] == b[k], k
    assert a["generated_tokens"] == sum(len(r.output) for r in full.finished)


def container_sizes(root) -> dict:
    """``{path: size}`` of every container reachable from ``root`` through attributes and items: len() of lists,
    dicts, deques, sets and tuples, elements of arrays and tensors. Items of a container share one path
    (``x[]``), their sizes summed, so a path stands for one kind of state however many entries it has."""
    import collections

    import torch

    sizes: dict = collections.Counter()
    seen = set()
    todo = [("engine", root)]
    while todo:
        path, obj = todo.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, type)) or callable(obj) \
                and not hasattr(obj, "__dict__"):
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            sizes[path] += obj.size
        elif isinstance(obj, torch.Tensor):
            sizes[path] += obj.numel()
        elif isinstance(obj, dict):
            sizes[path] += len(obj)
            todo += [(path + "[]", v) for v in obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            sizes[path] += len(obj)
            todo += [(path + "[]", v) for v in obj]
        elif type(obj).__module__.startswith(("vtoken", "tests", "engine_helpers")) or hasattr(obj, "__dataclass_fields__"):
            fields = dict(getattr(obj, "__dict__", {}))
            fields.update({k: getattr(obj, k) for k in getattr(type(obj), "__slots__", ()) if hasattr(obj, k)})
            todo += [(f"{path}.{k}", v) for k, v in fields.items()]
    return sizes


def test_a_long_lived_vtoken_engine_keeps_every_container_bounded():
    """vtoken mode, a policy evicting every step and reclamation at every check, history=64: over 10,000 steps
    (about 3,300 requests) no container reachable from the engine (its stats, finished requests and ids, the
    table, ledger, journal, reclaimer and its metrics ring, the policy, the runner) is larger in the last 2,000
    steps than in steps 4,000 to 6,000 (after the 4,096-step metrics ring is full): the largest size of each
    path, sampled every 25 steps, may not grow by more than 10% + 16 entries (a per-step or per-request leak
    grows by thousands)."""
    eng = trace_engine(EngineConfig(mode="vtoken", num_blocks=64, block_size=4, max_num_reqs=4, max_num_tokens=64,
                                    decision="host", history=64, policy="streamingllm",
                                    policy_config={"budget": 8, "sink": 2, "window": 4}, reclaim=EAGER_RECLAIM),
                       vocab_size=100)
    prompt = np.arange(6)
    early, late = {}, {}
    for step in range(10_000):
        while len(eng.running) + len(eng.waiting) < 4:
            eng.add_request(prompt, 12)
        eng.step()
        eng.runner.take_forwards()  # the trace runner's Forward records are the caller's (a modeled clock)
        window = early if 4_000 <= step < 6_000 else late if step >= 8_000 else None
        if window is not None and step % 25 == 0:
            for path, size in container_sizes(eng).items():
                window[path] = max(window.get(path, 0), size)
    summary = eng.summary()
    assert summary["relocated_tokens"] > 1_000 and summary["reclaimed_blocks"] > 1_000  # it evicted and reclaimed
    assert eng.totals["finished"] > 3_000 and len(early) > 50
    grew = {p: (early.get(p, 0), n) for p, n in late.items() if n > 1.1 * early.get(p, 0) + 16}
    assert not grew, grew
    assert len(eng.requests) == len(eng.running) + len(eng.waiting)


def test_the_default_engine_is_bounded_and_hands_finished_requests_to_the_caller():
    """A default EngineConfig keeps DEFAULT_HISTORY entries at most; a finished request leaves Engine.requests and
    reaches the caller through step()'s return value, output complete."""
    eng = trace_engine(EngineConfig(mode="native", num_blocks=64, block_size=4, max_num_reqs=4, max_num_tokens=64,
                                    decision="host"), vocab_size=100)
    assert eng.config.history == DEFAULT_HISTORY
    rid = eng.add_request(np.arange(6), 3)
    record, finished = eng.requests[rid], []
    while eng.has_work():
        finished += eng.step()
    assert finished == [record] and len(record.output) == 3 and rid not in eng.requests
    assert eng.finished == [record]  # kept in the bounded window
