"""Engine modes (native / naive / vtoken), victim traces, admission and preemption.

The second fidelity test of issue 6: for EVERY registered policy, a victim
trace is recorded in ``naive`` mode and replayed in ``vtoken`` mode; the greedy
outputs must be IDENTICAL token for token, and relocation must really have
happened (relocated tokens > 0, reclaimed blocks > 0). Equality is exact, not
within a tolerance: relocation copies K/V bit-exactly and attention reads the
same values in the same logical order, only from other slots.

conftest sets ``VTOKEN_DEBUG_INVARIANTS=1``, so the reclamation manager checks
I1 (live ids + K/V bytes unchanged across every relocation), I2 and I4 at every
step of these runs.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import TINY, POLICY_CFG, EAGER_RECLAIM, prompts as _prompts
from kernel_device import KERNEL_DEVICE
from vtoken.engine.model import LlamaModel, ModelConfig
from vtoken.engine.scheduler import Engine, EngineConfig
from vtoken.errors import InvalidArgumentError
from vtoken.policies import ReplayDivergenceError, ReplayPolicy, available



@pytest.fixture(scope="module")
def model():
    return LlamaModel(ModelConfig(**TINY))


def _engine(model, mode, *, policy=None, record=False, **kw):
    cfg = dict(num_blocks=96, block_size=4, max_num_reqs=4, max_num_tokens=256, reclaim=EAGER_RECLAIM, mode=mode)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg), policy=policy, record_trace=record)


def _paired(model, policy, prompts, new_tokens):
    naive = _engine(model, "naive", policy=policy, record=True, policy_config=POLICY_CFG)
    out_naive = naive.generate(prompts, new_tokens)
    replay = ReplayPolicy(naive.trace)
    vt = _engine(model, "vtoken", policy=replay)
    out_vt = vt.generate(prompts, new_tokens)
    replay.check_complete()
    return naive, out_naive, vt, out_vt


@pytest.mark.parametrize("policy", available())
def test_vtoken_equals_naive_on_recorded_trace(model, policy, monkeypatch):
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    naive, out_naive, vt, out_vt = _paired(model, policy, _prompts((20, 27, 33, 14)), 16)
    for a, b in zip(out_naive, out_vt):
        assert len(a.output) == 16
        assert a.output == b.output, f"request {a.request_id}: naive {a.output} vs vtoken {b.output}"
    sn, sv = naive.summary(), vt.summary()
    assert sum(len(d.token_ids) for d in naive.trace.decisions) > 0
    assert sv["relocated_tokens"] > 0 and sv["reclaimed_blocks"] > 0
    assert sn["relocated_tokens"] == 0  # naive never moves a token
    assert sn["preemptions"] == sv["preemptions"] == 0  # identical batches in both modes
    # Fig. 7: the same victims leave fewer retained blocks, at higher utilization.
    assert sv["mean_retained_blocks"] < sn["mean_retained_blocks"]
    assert sv["utilization"] > sn["utilization"]
    for eng in (naive, vt):
        eng.table.check_invariants()
        assert eng.table.ledger.num_allocated == 0  # every finished request released its blocks


def test_vtoken_equals_naive_triton_backend(monkeypatch):
    """The same pairing through the Triton kernels (interpreter on CPU): attention, slot lists, compact_kv."""
    monkeypatch.setenv("VTOKEN_BACKEND", "triton")
    model = LlamaModel(ModelConfig(**TINY), device=KERNEL_DEVICE)  # Triton takes CUDA tensors only on a GPU
    naive, out_naive, vt, out_vt = _paired(model, "h2o", _prompts((18, 11), seed=1), 8)
    assert [r.output for r in out_naive] == [r.output for r in out_vt]
    assert vt.summary()["relocated_tokens"] > 0


def test_native_mode_never_evicts_and_matches_naive_without_victims(model, monkeypatch):
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    prompts = _prompts((9, 13))
    native = _engine(model, "native")
    out = native.generate(prompts, 6)
    s = native.summary()
    assert s["relocated_tokens"] == 0 and native.policy is None
    assert all(r.live_tokens == len(r.prompt) + 5 for r in out)  # every token appended is still live
    # A policy whose budget never binds evicts nothing: naive must then equal native exactly.
    naive = _engine(model, "naive", policy="h2o", policy_config=dict(budget=10_000, window=4))
    assert [r.output for r in naive.generate(prompts, 6)] == [r.output for r in out]


def test_replay_detects_a_diverging_run(model, monkeypatch):
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    naive = _engine(model, "naive", policy="streamingllm", record=True, policy_config=POLICY_CFG)
    naive.generate(_prompts((20,)), 6)
    other = _engine(model, "vtoken", policy=ReplayPolicy(naive.trace))
    with pytest.raises(ReplayDivergenceError, match="diverged"):
        other.generate(_prompts((23,)), 6)  # a different prompt length asks other questions


def test_backpressure_holds_admission_and_budget_is_respected(model, monkeypatch):
    """Tight budget in vtoken mode: backpressure steps admit nothing; blocks never exceed the budget."""
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    eng = _engine(model, "vtoken", policy="h2o", policy_config=POLICY_CFG, num_blocks=40,
                  reclaim=dict(EAGER_RECLAIM, headroom_blocks=4))
    out = eng.generate(_prompts((20, 27, 33, 14, 22, 17), seed=2), 12)
    assert all(len(r.output) == 12 for r in out)
    bp = [s for s in eng.stats if s.backpressure]
    assert bp, "expected backpressure with reclamation always pending"
    assert all(s.kind == "decode" for s in bp)  # nothing admitted under backpressure
    assert max(s.allocated_blocks for s in eng.stats) <= eng.table.ledger.usable_blocks
    assert eng.summary()["relocated_tokens"] > 0
    eng.table.check_invariants()


def test_preemption_by_recompute_and_closed_loop(model, monkeypatch):
    """Native mode over too few blocks: requests are preempted and recomputed, and all complete."""
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    eng = _engine(model, "native", num_blocks=17, max_num_reqs=4)  # 16 blocks = 64 tokens < 3 x 26
    prompts = _prompts((17, 19, 15, 18, 16), seed=3)
    out = eng.generate(prompts, 10, concurrency=3)
    assert all(len(r.output) == 10 for r in out)
    assert eng.num_preemptions > 0 and any(r.num_preemptions for r in out)
    assert eng.peak_running <= 3
    assert eng.peak_blocks <= 16
    assert all(r.latency is not None and r.latency > 0 and r.first_token_time >= r.arrival_time for r in out)
    # Recompute resumes exactly where the request was: same tokens as a run with room for everyone.
    roomy = _engine(model, "native", num_blocks=96).generate(prompts, 10)
    assert [r.output for r in out] == [r.output for r in roomy]


def test_engine_errors(model):
    with pytest.raises(InvalidArgumentError, match="policy"):
        _engine(model, "naive")
    with pytest.raises(InvalidArgumentError, match="mode"):
        EngineConfig(mode="lazy")
    with pytest.raises(InvalidArgumentError, match="record_trace"):
        _engine(model, "naive", policy=ReplayPolicy([]), record=True)
    eng = _engine(model, "native", max_num_tokens=32)
    with pytest.raises(InvalidArgumentError, match="max_num_tokens"):
        eng.add_request(np.arange(30), 5)
    with pytest.raises(InvalidArgumentError, match="max_new_tokens"):
        eng.add_request(np.arange(3), 0)
    with pytest.raises(InvalidArgumentError, match="token ids"):
        eng.add_request(np.array([1, 999]), 3)
    small = _engine(model, "native", num_blocks=4)
    with pytest.raises(InvalidArgumentError, match="block budget"):
        small.add_request(np.arange(12), 4)
    eng.add_request(np.arange(3), 2, request_id="x")
    with pytest.raises(InvalidArgumentError, match="new id"):
        eng.add_request(np.arange(3), 2, request_id="x")
    assert len(eng.waiting) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ("h2o", "streamingllm"))
def test_cuda_graph_engine_with_relocation_equals_eager(policy):
    """vtoken mode on GPU: decode replays CUDA graphs while relocation runs outside them; same tokens as eager."""
    import torch

    model = LlamaModel(ModelConfig(**TINY), device="cuda")
    prompts = _prompts((20, 27, 33, 14))
    runs = {}
    for graph in (True, False):
        eng = _engine(model, "vtoken", policy=policy, policy_config=POLICY_CFG, cuda_graph=graph)
        out = eng.generate(prompts, 16)
        runs[graph] = ([r.output for r in out], eng.summary(), eng.runner.num_graph_replays)
    torch.cuda.synchronize()
    (tok_g, sum_g, replays_g), (tok_e, _, replays_e) = runs[True], runs[False]
    assert replays_g > 0 and replays_e == 0
    assert sum_g["relocated_tokens"] > 0
    assert tok_g == tok_e


def test_default_reclamation_moves_nothing_without_memory_pressure(model, monkeypatch):
    """ReclaimConfig's defaults: a roomy pool moves no token; the same run in a pool at its limit does."""
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    ps, n = _prompts((20, 27, 33, 14)), 24

    def run(num_blocks):
        eng = _engine(model, "vtoken", policy="h2o", policy_config=POLICY_CFG, num_blocks=num_blocks, reclaim=None)
        out = eng.generate(ps, n)
        return eng.summary(), [r.output for r in out]

    roomy, out_roomy = run(96)  # 4 requests of <= 14 blocks unevicted: never short of blocks
    assert roomy["relocated_tokens"] == 0 and roomy["preemptions"] == 0
    tight, out_tight = run(40)  # the growth look-ahead and the headroom exceed what is free: pressure
    assert tight["relocated_tokens"] > 0 and tight["reclaimed_blocks"] > 0
    assert out_tight == out_roomy  # relocation never changes what attention reads


def test_a_full_pool_preempts_instead_of_raising(model, monkeypatch):
    """More listed keys than the pool's slots means the appends cannot get blocks: the runner returns None
    and the engine preempts (it used to raise on max_kv_indices first)."""
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    eng = _engine(model, "native", num_blocks=9, block_size=2, max_num_reqs=8, max_num_tokens=64, reclaim=None)
    out = eng.generate(_prompts((2,) * 8), 3)
    assert [len(r.output) for r in out] == [3] * 8 and eng.num_preemptions > 0


def test_the_engine_reports_partial_prompts_and_admissible_waiting_prompts_as_demand(model, monkeypatch):
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    eng = _engine(model, "vtoken", policy="streamingllm", policy_config=POLICY_CFG, max_num_reqs=2,
                  max_num_tokens=8, chunked_prefill=True, reclaim=None)
    for p in _prompts((12, 12, 12)):
        eng.add_request(p, 4)
    eng.step()  # A: 8 of 12 prompt tokens (owes 3 - 2 blocks); one free slot: B's 3 blocks wait
    assert eng.reclaimer.trigger.waiting_blocks == 1 + 3
    eng.step()  # A completes; B admitted with 4 of 12 (owes 3 - 1); no free slot: C does not count
    assert eng.reclaimer.trigger.waiting_blocks == 2


@pytest.mark.parametrize("bad", [float("nan"), np.float64("nan"), ("a", float("nan")), (1, (float("nan"),)), [1]])
def test_an_unusable_request_id_is_rejected_and_the_queue_keeps_working(model, bad):
    """A NaN id (also inside a tuple) or an unhashable one: rejected at add_request, before it is queued;
    the request admitted before it still runs to completion."""
    eng = _engine(model, "native")
    first = eng.add_request(np.arange(3), 2, request_id="first")
    record = eng.requests[first]  # a bounded engine (the default) forgets a finished request's id
    with pytest.raises(InvalidArgumentError, match="request_id: expected"):
        eng.add_request(np.arange(3), 2, request_id=bad)
    assert list(eng.requests) == ["first"] and len(eng.waiting) == 1
    while eng.has_work():
        eng.step()
    assert len(record.output) == 2 and first not in eng.requests


@pytest.mark.parametrize("field, value, err", [
    ("num_blocks", 1, InvalidArgumentError), ("num_blocks", 2.5, TypeError), ("block_size", 0, InvalidArgumentError),
    ("layout", "bogus", InvalidArgumentError), ("max_num_reqs", 0, InvalidArgumentError),
    ("max_num_tokens", True, TypeError), ("cuda_graph", "yes", TypeError), ("policy", "no-such-policy", InvalidArgumentError),
    ("policy_config", {"no_such_key": 1}, InvalidArgumentError),
])
def test_engine_config_checks_every_field_when_built(field, value, err):
    """EngineConfig rejects a bad field in __post_init__, naming it, before any Engine is built."""
    kw = {field: value}
    if field == "policy_config":
        kw["policy"] = "h2o"
    name = "h2o" if field == "policy_config" else field
    with pytest.raises(err, match=name):
        EngineConfig(**kw)


@pytest.mark.parametrize("max_steps", [-1, 0, 1.5, True])
def test_generate_rejects_a_bad_max_steps_before_queueing(model, max_steps):
    eng = _engine(model, "native")
    with pytest.raises((InvalidArgumentError, TypeError), match="max_steps: expected an int >= 1"):
        eng.generate([np.arange(3)], 2, max_steps=max_steps)
    assert not eng.requests and not eng.has_work()


def test_a_prompt_past_the_models_context_is_refused(model):
    """A prompt longer than max_position_embeddings: refused at add_request, nothing queued."""
    small = LlamaModel(ModelConfig(**{**TINY, "max_position_embeddings": 16}))
    eng = _engine(small, "native")
    with pytest.raises(InvalidArgumentError, match=r"prompt: expected at most max_position_embeddings \(16\) tokens, got 17"):
        eng.add_request(np.arange(17), 2)
    assert not eng.requests and not eng.has_work()
    eng.add_request(np.arange(16), 2)
    assert len(eng.waiting) == 1
