"""The engine's eviction decisions on the device loop (decision="device", the default) and on the host.

* naive == vtoken, token for token, for every policy, with BOTH runs deciding
  on the device (no replay): the device loop's decisions depend only on what
  attention saw, which relocation leaves bit-identical.
* device == host: for the policies whose inputs are the same bits on both
  paths (no scores, or SnapKV's window votes), the device loop makes exactly
  the numpy oracle's decisions, so traces and outputs are equal. For the
  exact-score policies (h2o, tova, scissorhands) the device sums each key's
  mass over heads and layers in the kernel, in another float order than the
  host's per-layer rows, so a near-tie may break differently; their device
  traces replay token-identically on the host path instead.
* the one-step delay is in the trace: decisions are recorded when the host
  applies them, keyed by the deciding step's seq_len, and the meta says so.
"""
from __future__ import annotations

import pytest

from engine_helpers import TINY, POLICY_CFG, EAGER_RECLAIM, prompts as _prompts
from vtoken.device.buffers import DeltaShipper
from vtoken.engine.model import LlamaModel, ModelConfig
from vtoken.engine.scheduler import Engine, EngineConfig
from vtoken.errors import InvalidArgumentError
from vtoken.policies import ReplayPolicy, available



@pytest.fixture(scope="module")
def model():
    return LlamaModel(ModelConfig(**TINY))


def _run(model, mode, policy, decision, prompts, new_tokens=14, **kw):
    cfg = dict(num_blocks=96, block_size=4, max_num_reqs=4, max_num_tokens=256, reclaim=EAGER_RECLAIM, mode=mode,
               policy_config=POLICY_CFG, decision=decision)
    cfg.update(kw)
    eng = Engine(model, EngineConfig(**cfg), policy=policy, record_trace=not isinstance(policy, ReplayPolicy))
    out = eng.generate(prompts, new_tokens)
    return eng, [r.output for r in out]


def _decisions(trace):
    return sorted((d.request_id, d.step, d.token_ids) for d in trace.decisions)


@pytest.mark.parametrize("policy", available())
def test_naive_equals_vtoken_both_on_the_device_loop(model, policy, monkeypatch):
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    prompts = _prompts((20, 27, 33, 14))
    naive, out_naive = _run(model, "naive", policy, "device", prompts)
    vt, out_vt = _run(model, "vtoken", policy, "device", prompts)
    assert naive.decisions is not None and vt.decisions is not None
    assert out_naive == out_vt
    assert _decisions(naive.trace) == _decisions(vt.trace)
    assert sum(len(d.token_ids) for d in naive.trace.decisions) > 0
    assert naive.trace.meta["host_apply_delay"] == 1
    assert vt.summary()["relocated_tokens"] > 0 and naive.summary()["relocated_tokens"] == 0
    assert vt.summary()["mean_retained_blocks"] < naive.summary()["mean_retained_blocks"]
    for eng in (naive, vt):
        eng.table.check_invariants()
        assert eng.table.ledger.num_allocated == 0


@pytest.mark.parametrize("policy", ("streamingllm", "random", "snapkv"))
def test_device_decisions_equal_the_host_oracle_in_the_engine(model, policy, monkeypatch):
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    prompts = _prompts((20, 27, 33, 14), seed=1)
    dev, out_dev = _run(model, "vtoken", policy, "device", prompts)
    host, out_host = _run(model, "vtoken", policy, "host", prompts)
    assert dev.decisions is not None and host.decisions is None
    # The host path also records the empty decisions of a request's finishing step; the device skips them.
    host_decisions = [d for d in _decisions(host.trace) if d[2]]
    assert [d for d in _decisions(dev.trace) if d[2]] == host_decisions and host_decisions
    assert out_dev == out_host


@pytest.mark.parametrize("policy", ("h2o", "tova", "scissorhands"))
def test_a_device_trace_replays_token_identically_on_the_host(model, policy, monkeypatch):
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    prompts = _prompts((20, 27, 33, 14), seed=2)
    dev, out_dev = _run(model, "naive", policy, "device", prompts)
    replay = ReplayPolicy(dev.trace, strict=False)
    host, out_host = _run(model, "vtoken", replay, "host", prompts)
    assert out_dev == out_host
    assert sum(len(d.token_ids) for d in dev.trace.decisions) > 0


def test_the_host_learns_victims_one_step_late(model, monkeypatch):
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    eng = Engine(model, EngineConfig(num_blocks=96, block_size=4, max_num_reqs=2, mode="naive",
                                     policy="streamingllm", policy_config=dict(sink=1, window=3, budget=None)))
    rid = eng.add_request(_prompts((12,))[0], 6)
    eng.step()  # prefill: its own tokens are protected
    eng.step()  # first decode: the device decides 12 + 1 - 4 = 9 victims; the host has not applied them
    assert eng.table.live_count(rid) == 13
    assert eng.runner.mirror.host_copy(rid)[1].sum() == 4  # the device mirror already dropped them
    eng.step()  # the next step applies them first
    assert eng.table.live_count(rid) == 5 and eng.stats[-1].evicted == 9
    eng.decisions.check_mirror()


def test_decision_must_be_device_or_host(model):
    with pytest.raises(InvalidArgumentError, match="decision"):
        EngineConfig(decision="gpu")
    with pytest.raises(InvalidArgumentError, match="cuda_graph"):  # decision graphs need a CUDA model
        Engine(model, EngineConfig(num_blocks=32, block_size=4, mode="naive", policy="h2o", decision_graph=True))


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ("h2o", "streamingllm", "random"))
def test_cuda_graphed_decisions_equal_eager_decisions(policy):
    """On CUDA: the decision loop replayed from CUDA graphs decides exactly as the eager loop."""
    import torch

    model = LlamaModel(ModelConfig(**TINY), device="cuda")
    prompts = _prompts((20, 27, 33, 14, 9), seed=4)
    runs = {}
    for graphed in (False, True):
        cfg = EngineConfig(num_blocks=96, block_size=4, max_num_reqs=8, max_num_tokens=256, reclaim=EAGER_RECLAIM,
                           mode="vtoken", policy=policy, policy_config=POLICY_CFG, decision_graph=graphed)
        eng = Engine(model, cfg, record_trace=True)
        out = eng.generate(prompts, 16)
        runs[graphed] = ([r.output for r in out], _decisions(eng.trace), eng.decisions._graphs.replays)
        g = eng.decisions._graphs
        if graphed:  # every size at the engine's warm-up, then whole sets only after buffers moved
            assert g.captures == len(g.sizes) * (1 + g.recaptures)
    torch.cuda.synchronize()
    assert runs[True][0] == runs[False][0] and runs[True][1] == runs[False][1]
    assert runs[True][2] > 0 and runs[False][2] == 0


@pytest.mark.parametrize("policy", ("h2o", "snapkv"))
def test_preemption_with_device_decisions_in_flight(model, policy, monkeypatch):
    """Requests preempted (recompute) while their device decisions are in flight: nothing leaks or breaks."""
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    cfg = EngineConfig(num_blocks=26, block_size=4, max_num_reqs=4, max_num_tokens=256, mode="naive", policy=policy,
                       policy_config=dict(budget=0.9, window=4, sink=1))
    eng = Engine(model, cfg)
    out = eng.generate(_prompts((17, 19, 15, 18, 16), seed=5), 12, concurrency=4)
    assert all(len(r.output) == 12 for r in out)
    assert eng.num_preemptions > 0  # the tight pool did preempt
    assert sum(s.evicted for s in eng.stats) > 0
    eng.decisions.drain_all()
    eng.table.check_invariants()
    eng.decisions.check_mirror()
    assert eng.table.ledger.num_allocated == 0


@pytest.mark.parametrize("policy", ("streamingllm", "random"))
def test_a_device_decision_is_applied_on_the_device_once(model, policy, monkeypatch):
    """The device loop kills its victims in the mirror; the host's later evict of the same victims ships no
    alive bit back (journal origin "device"), and the tokens equal the host-decided run's."""
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    shipped_dead = []
    set_alive = DeltaShipper.set_alive

    def recording(self, positions, value):
        if value == 0:
            shipped_dead.append(len(positions))
        return set_alive(self, positions, value)

    monkeypatch.setattr(DeltaShipper, "set_alive", recording)
    prompts = _prompts((20, 27, 33, 14), seed=3)
    dev, out_dev = _run(model, "vtoken", policy, "device", prompts)
    evicted = sum(s.evicted for s in dev.stats)
    assert evicted > 0 and dev.runner.mirror.device_evictions_applied == evicted
    assert sum(shipped_dead) == 0  # no eviction went back to the device
    shipped_dead.clear()
    host, out_host = _run(model, "vtoken", policy, "host", prompts)
    assert sum(shipped_dead) == sum(s.evicted for s in host.stats) > 0  # host decisions do ship
    assert host.runner.mirror.device_evictions_applied == 0
    assert out_dev == out_host
