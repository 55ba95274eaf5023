"""ModelRunner: steps over the token table, eviction semantics, key scores, errors, CUDA graphs.

The eviction oracle is Hugging Face ``LlamaForCausalLM`` recomputing the whole
sequence WITHOUT a cache, under a 4-D boolean attention mask: row i may see key
j iff ``j <= i`` and token j was alive when token i was processed (logical
positions unchanged). That is exactly what the engine's token-indexed
attention must compute when dead tokens are dropped from the slot lists.
Tolerance: the fp32 ``LOGIT_ATOL`` of ``test_engine_fidelity.py`` (same reason).
"""
from __future__ import annotations

import dataclasses
import random
import types

import numpy as np
import pytest
import torch

from kernel_device import cpu_engine_triton
from vtoken.engine.model import LlamaModel, ModelConfig, ModelOutput
from vtoken.engine.runner import ModelRunner, RunnerConfig, _Graph
from vtoken.errors import InvalidArgumentError, InvariantViolation, UnknownRequestError
from vtoken.device.step_graphs import padded_batch_sizes

LOGIT_ATOL = 1e-4
TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            init_std=0.2)


def _model(seed=0, **kw):
    return LlamaModel(ModelConfig(**{**TINY, **kw, "seed": seed}))


def _runner(model, **kw):
    kw = {"num_blocks": 48, "block_size": 4, "max_num_reqs": 4, **kw}
    return ModelRunner(model, RunnerConfig(**kw))


def _hf_twin(model: LlamaModel):
    transformers = pytest.importorskip("transformers")
    c = model.config
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, max_position_embeddings=256,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.load_state_dict(model.state_dict(), strict=False)
    for k, v in model.state_dict().items():
        assert torch.equal(hf.state_dict()[k], v), k
    return hf


class _Oracle:
    """Per request: all tokens so far and, per token, the key set it saw (row of the visibility mask)."""

    def __init__(self, hf):
        self.hf = hf
        self.tokens, self.visible, self.alive = {}, {}, {}

    def append(self, req, toks):
        seq, vis = self.tokens.setdefault(req, []), self.visible.setdefault(req, [])
        alive = self.alive.setdefault(req, [])
        for t in toks:
            seq.append(int(t))
            alive.append(True)
            vis.append(np.array(alive, dtype=bool))

    def evict(self, req, ids):
        for i in ids:
            self.alive[req][i] = False

    @torch.no_grad()
    def last_logits(self, req):
        n = len(self.tokens[req])
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i, row in enumerate(self.visible[req]):
            mask[i, : len(row)] = torch.from_numpy(row)
        out = self.hf(torch.tensor([self.tokens[req]]), attention_mask=mask[None, None],
                      position_ids=torch.arange(n)[None])
        return out.logits[0, -1]


@pytest.mark.parametrize("backend,seed", [("torch", 0), pytest.param("triton", 1, marks=cpu_engine_triton)])
def test_eviction_matches_hf_masked_recompute(backend, seed, monkeypatch):
    """Prefill, decode, evict random live tokens between steps: logits equal an HF recompute with the mask."""
    monkeypatch.setenv("VTOKEN_BACKEND", backend)
    model = _model(seed)
    hf = _hf_twin(model)
    oracle = _Oracle(hf)
    rng = random.Random(seed)
    runner = _runner(model)
    reqs = [0, 1, 2]
    prompts = [np.array([rng.randrange(160) for _ in range(n)]) for n in (6, 11, 9)]
    for r, p in zip(reqs, prompts):
        runner.add_request(r)
        oracle.append(r, p)
    res = runner.prefill(reqs, prompts)
    evicted = 0
    for step in range(6):
        for i, r in enumerate(reqs):
            torch.testing.assert_close(res.logits[i], oracle.last_logits(r), atol=LOGIT_ATOL, rtol=0)
        nxt = res.next_tokens()
        if step % 2 == 1:  # evict ~1/3 of each request's live tokens, never the newest
            for r in reqs:
                live = runner.table.live_ids(r)[:-1].tolist()
                victims = sorted(rng.sample(live, len(live) // 3))
                runner.evict(r, victims)
                oracle.evict(r, victims)
                evicted += len(victims)
        for r, t in zip(reqs, nxt):
            oracle.append(r, [t])
        res = runner.decode(reqs, nxt)
        assert [int(x) for x in np.diff(res.kv_indptr)] == [runner.table.live_count(r) for r in reqs]
    runner.table.check_invariants()
    assert evicted > 10
    assert runner.table.ledger.waste_ratio > 0  # dead tokens really sit in live blocks


def test_out_of_blocks_returns_none_and_changes_nothing():
    model = _model()
    runner = _runner(model, num_blocks=6, block_size=4)  # 5 usable blocks = 20 tokens
    runner.add_request("a")
    runner.add_request("b")
    assert runner.prefill(["a"], [np.arange(10)]) is not None  # 3 blocks
    snap = runner.table.snapshot()
    caches = [c.clone() for c in runner.kv_caches]
    assert runner.prefill(["a", "b"], [np.arange(3), np.arange(9)]) is None  # needs 0 + 3 > 2 free
    _assert_snapshot_equal(runner.table.snapshot(), snap)
    for c, c0 in zip(runner.kv_caches, caches):
        assert torch.equal(c, c0)
    res = runner.prefill(["b"], [np.arange(7)])  # exactly the 2 free blocks
    assert res is not None and runner.table.ledger.num_free == 0
    assert runner.decode(["a", "b"], [1, 2]) is not None  # both tails have room (11/12, 8/8)
    snap = runner.table.snapshot()
    assert runner.decode(["a", "b"], [1, 2]) is None  # b's tail is full now
    _assert_snapshot_equal(runner.table.snapshot(), snap)
    runner.finish("b")
    assert runner.table.ledger.num_free == 2


def _assert_snapshot_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        va, vb = a[k], b[k]
        if isinstance(va, np.ndarray):
            assert np.array_equal(va, vb), k
        elif isinstance(va, dict) and k == "ledger":
            _assert_snapshot_equal(va, vb)
        elif k == "per_request":
            assert va.keys() == vb.keys()
            for r in va:
                for x, y in zip(va[r], vb[r]):
                    assert np.array_equal(x, y), (k, r)
        else:
            assert va == vb, k


BAD_STEPS = [
    ("prefill", ["a", "a"], [[1], [2]], InvalidArgumentError, "unique"),
    ("prefill", ["a"], [[1], [2]], InvalidArgumentError, "one per request"),
    ("prefill", ["a"], [[]], InvalidArgumentError, "non-empty"),
    ("prefill", ["a"], [[160]], InvalidArgumentError, r"ids in \[0, 160\)"),
    ("prefill", ["a"], [[-1]], InvalidArgumentError, r"ids in \[0, 160\)"),
    ("prefill", ["a"], [list(range(40))], InvalidArgumentError, "max_num_tokens"),
    ("prefill", [], [], InvalidArgumentError, "at least one"),
    ("prefill", ["a", "b", "c", "d", "e"], [[1]] * 5, InvalidArgumentError, "max_num_reqs"),
    ("prefill", ["zzz"], [[1]], UnknownRequestError, "registered"),
    ("decode", ["a", "b"], [1], InvalidArgumentError, "one per request"),
    ("decode", ["a"], [1.5], TypeError, "integer"),
]


@pytest.mark.parametrize("kind,reqs,toks,err,match", BAD_STEPS)
def test_bad_step_raises_and_changes_nothing(kind, reqs, toks, err, match):
    runner = _runner(_model(), max_num_tokens=32)
    for r in "abcde":
        runner.add_request(r)
    runner.prefill(["a", "b"], [[3, 4, 5], [6]])
    snap = runner.table.snapshot()
    with pytest.raises(err, match=match):
        getattr(runner, kind)(reqs, toks)
    _assert_snapshot_equal(runner.table.snapshot(), snap)


def test_kv_indices_capacity_checked_before_any_change():
    runner = _runner(_model(), num_blocks=48, block_size=4, max_kv_indices=10)
    runner.add_request("a")
    snap = runner.table.snapshot()
    with pytest.raises(InvalidArgumentError, match="max_kv_indices"):
        runner.prefill(["a"], [np.arange(11)])
    _assert_snapshot_equal(runner.table.snapshot(), snap)


@pytest.mark.parametrize("mode", ("sum", "per_layer"))
def test_key_scores_rows_and_mass(mode):
    """Per request, key scores cover its live keys and sum to num_layers * num_heads * n_new."""
    model = _model()
    c = model.config
    runner = _runner(model, key_scores=mode)
    runner.add_request(0)
    runner.add_request(1)
    res = runner.prefill([0, 1], [np.arange(5), np.arange(9)])
    for r, n_new in ((0, 5), (1, 9)):
        ks = res.request_key_scores(r)
        assert ks.shape == (n_new, c.num_kv_heads) and ks.dtype == torch.float32
        np.testing.assert_array_equal(res.token_ids[r], np.arange(n_new))
        torch.testing.assert_close(ks.sum(), torch.tensor(float(c.num_layers * c.num_heads * n_new)))
    runner.evict(1, [0, 3, 4])
    res = runner.decode([0, 1], res.next_tokens())
    np.testing.assert_array_equal(res.token_ids[1], [1, 2, 5, 6, 7, 8, 9])
    for r in (0, 1):
        ks = res.request_key_scores(r)
        assert ks.shape[0] == runner.table.live_count(r) and bool((ks >= 0).all())
        torch.testing.assert_close(ks.sum(), torch.tensor(float(c.num_layers * c.num_heads)))
    if mode == "per_layer":
        assert res.layer_key_scores.shape == (c.num_layers,) + tuple(res.key_scores.shape)
        torch.testing.assert_close(res.layer_key_scores.sum(0), res.key_scores)
    else:
        assert res.layer_key_scores is None


def test_step_hooks_run_around_the_forward():
    calls = []

    class Hooks:
        def pre_forward(self, runner):
            calls.append(("pre", runner.table.total_tokens()))

        def post_forward(self, runner, result):
            calls.append(("post", runner.table.total_tokens(), tuple(result.logits.shape)))

    runner = ModelRunner(_model(), RunnerConfig(num_blocks=16, block_size=4), hooks=[Hooks()])
    runner.add_request(0)
    runner.prefill([0], [[1, 2, 3]])
    runner.decode([0], [7])
    assert calls == [("pre", 0), ("post", 3, (1, 160)), ("pre", 3), ("post", 4, (1, 160))]


def test_config_and_model_errors():
    with pytest.raises(InvalidArgumentError, match="num_blocks"):
        RunnerConfig(num_blocks=1)
    with pytest.raises(InvalidArgumentError, match="layout"):
        RunnerConfig(num_blocks=8, layout="mla")
    with pytest.raises(InvalidArgumentError, match="key_scores"):
        RunnerConfig(num_blocks=8, key_scores="mean")
    with pytest.raises(InvalidArgumentError, match="graph_batch_sizes"):
        RunnerConfig(num_blocks=8, max_num_reqs=4, graph_batch_sizes=(2, 8))
    with pytest.raises(InvalidArgumentError, match="multiple of num_kv_heads"):
        ModelConfig(num_heads=4, num_kv_heads=3, hidden_size=48)
    with pytest.raises(InvalidArgumentError, match="unknown"):
        ModelConfig.from_dict({"hidden_sise": 64})
    with pytest.raises(InvalidArgumentError, match="rope_type"):
        ModelConfig(rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(InvalidArgumentError, match="model_type"):
        ModelConfig.from_dict({"model_type": "gpt2"})
    model = _model()
    sd = {k: v for k, v in model.state_dict().items() if k != "model.norm.weight"}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(InvalidArgumentError, match="missing"):
        model.load_hf_state_dict(sd)
    bad = dict(model.state_dict())
    bad["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(InvalidArgumentError, match="shape"):
        model.load_hf_state_dict(bad)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.raises(InvalidArgumentError, match="config.json"):
        LlamaModel.from_pretrained("/nonexistent/dir")


def test_random_weights_are_seeded():
    a, b, c = _model(seed=3), _model(seed=3), _model(seed=4)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


class _ReplayOnCPU:
    """A CUDA graph's CPU stand-in: ``replay`` re-runs the padded decode eagerly over the runner's fixed buffers
    and writes the outputs into the object the capture returned (as a graph writes its static outputs)."""

    def __init__(self, runner, batch, score_out):
        self.runner, self.batch, self.score_out = runner, batch, score_out
        self.output = ModelOutput(logits=torch.empty(0))

    def replay(self):
        r = self.runner
        out = r.model(r._step_inputs(self.batch, self.batch, decode=True), r.kv_caches, r.layout,
                      score_out=self.score_out)
        for f in dataclasses.fields(out):
            setattr(self.output, f.name, getattr(out, f.name))


def _cpu_graph_runner(model, monkeypatch, **kw):
    """A runner on the graph path, its captures recorded and replayed eagerly (CPU)."""
    runner = _runner(model, **kw)
    runner.use_graph = True
    captured = []

    def capture(batch, score_out=None):
        captured.append(batch)
        g = _ReplayOnCPU(runner, batch, score_out)
        return _Graph(g, g.output)

    monkeypatch.setattr(runner, "_capture", capture)
    return runner, captured


def test_padded_graph_batches_match_unpadded_on_cpu(monkeypatch):
    """The graph path on CPU: every padded size captured at warm-up, serving only replays, same logits.

    On CUDA the decode runs as a graph captured at a padded batch size; here the
    "replay" is an eager forward over the same fixed buffers at that padded
    size, which checks what the graph relies on: padding requests list no key,
    write to PAD slots, and leave the real rows (and the cache) unchanged.
    """
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    model = _model()
    padded_r, captured = _cpu_graph_runner(model, monkeypatch, max_num_reqs=8)
    plain_r = _runner(model, max_num_reqs=8)
    reqs = [0, 1, 2]
    res = []
    for runner in (padded_r, plain_r):
        for r in reqs:
            runner.add_request(r)
        res.append(runner.prefill(reqs, [np.arange(n) % 160 for n in (6, 11, 9)]))
    before = padded_r.table.num_tokens(0)
    with pytest.raises(InvalidArgumentError, match="warmup"):  # no capture while serving: refused, nothing changed
        padded_r.decode(reqs, res[1].next_tokens())
    assert padded_r.table.num_tokens(0) == before and captured == []
    padded_r.warmup()
    assert captured == list(padded_batch_sizes(8)) == [1, 2, 4, 8]
    for step in range(5):
        nxt = res[1].next_tokens()
        active = reqs if step < 3 else reqs[:1]
        res = [runner.decode(active, nxt[: len(active)]) for runner in (padded_r, plain_r)]
        assert res[0].graph and not res[1].graph
        assert res[0].logits.shape == res[1].logits.shape == (len(active), 160)
        torch.testing.assert_close(res[0].logits, res[1].logits, atol=LOGIT_ATOL, rtol=0)  # GEMMs over other row counts
    assert captured == [1, 2, 4, 8]  # serving replayed, never captured
    assert padded_r.num_graph_replays == 5 and padded_r.num_graph_captures == 0  # (the stand-in counts nothing)
    # Real blocks hold identical K/V: padding rows only ever wrote the null block (block 0).
    for a, b in zip(padded_r.kv_caches, plain_r.kv_caches):
        torch.testing.assert_close(a[1:], b[1:], atol=1e-5, rtol=0)


def test_graph_score_buffer_move_recaptures_every_size_and_a_missing_size_raises(monkeypatch):
    """Graphs bake in the score sink's buffer: when it moves, every size is captured again at once (never one
    size lazily); another sink is refused; a size missing from the warm-up is an internal error."""
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    runner, captured = _cpu_graph_runner(_model(), monkeypatch, max_num_reqs=4)
    cap = runner.mirror.slots.numel() + 1
    sink = types.SimpleNamespace(token_mass=torch.zeros(cap))
    runner.warmup(score_sink=sink)
    assert captured == [1, 2, 4]
    for r in (0, 1, 2):
        runner.add_request(r)
    nxt = runner.prefill([0, 1, 2], [np.arange(n) % 160 for n in (5, 7, 3)]).next_tokens()
    nxt = runner.decode([0, 1, 2], nxt, score_sink=sink).next_tokens()
    assert captured == [1, 2, 4] and sink.token_mass.sum() > 0  # the replay added the key masses
    sink.token_mass = torch.zeros(cap)  # the sink re-allocated its buffer (a mirror arena growth)
    nxt = runner.decode([0, 1, 2], nxt, score_sink=sink).next_tokens()
    assert captured == [1, 2, 4, 1, 2, 4] and sink.token_mass.sum() > 0
    before = runner.table.num_tokens(0)
    with pytest.raises(InvalidArgumentError, match="score_sink"):
        runner.decode([0, 1, 2], nxt, score_sink=types.SimpleNamespace(token_mass=torch.zeros(cap)))
    assert runner.table.num_tokens(0) == before
    del runner._graphs[4]
    with pytest.raises(InvariantViolation, match="padded batch 4 was not captured"):
        runner.decode([0, 1, 2], nxt, score_sink=sink)


def test_window_votes_path_copies_nothing_from_the_host_and_reads_nothing_back(monkeypatch):
    """SnapKV's observation window: its rows travel with the step's tokens (one staged copy), its votes come
    from device buffers only (no from_numpy / .to(device) in the step, no tensor read in the votes), and they
    equal window_key_scores over the host table's live keys (the former host-copied path), exactly."""
    import sys

    from vtoken.policies.scores import window_key_scores

    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    runner = _runner(_model(), num_blocks=32, max_num_reqs=4)
    prompts = [np.arange(n) % 160 for n in (9, 4, 12)]
    for r in range(3):
        runner.add_request(r)
    runner.prefill([0, 1, 2], [p[:-3] for p in prompts])  # a first chunk: keys before the window
    runner.evict(0, [1, 2])  # request 0 takes no window: its dead keys shift the others' rows
    host_copies, reads = [], []
    real_from_numpy, real_to, real_votes = torch.from_numpy, torch.Tensor.to, runner._window_votes

    def from_numpy(a):
        host_copies.append(("from_numpy", sys._getframe(1).f_code.co_name))
        return real_from_numpy(a)

    def to(self, *args, **kwargs):
        if any(isinstance(a, (torch.device, str)) for a in args) or "device" in kwargs:
            host_copies.append(("to", sys._getframe(1).f_code.co_name))
        return real_to(self, *args, **kwargs)

    def votes_guarded(*args):
        with monkeypatch.context() as m:
            for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__"):
                m.setattr(torch.Tensor, name, lambda self, *a, _n=name, **k: reads.append(_n))
            return real_votes(*args)

    with monkeypatch.context() as m:
        m.setattr(torch, "from_numpy", from_numpy)
        m.setattr(torch.Tensor, "to", to)
        m.setattr(runner, "_window_votes", votes_guarded)
        res = runner.prefill([0, 1, 2], [p[-3:] for p in prompts], window=[0, 2, 3])
    assert [c for c in host_copies if c[1] in ("_step", "_window_votes", "window_key_scores", "_pos")] == []
    assert reads == []
    n_win = [0, 2, 3]
    views = [runner.layout.canonical_view(c) for c in runner.kv_caches]
    win = torch.tensor([4, 5, 6, 7, 8], dtype=torch.int64)  # the step's rows: 3 + 3 + 3 tokens, windows 0, 2, 3
    step = runner._step_inputs(3, 9, decode=False)
    step.window_indices = win
    queries = runner.model(step, runner.kv_caches, runner.layout).window_queries  # the step's window, recomputed
    q_pos = runner.positions[win].numpy()
    lo = 0
    for i, r in enumerate([0, 1, 2]):
        got = res.window_votes[res.kv_indptr[i]: res.kv_indptr[i + 1]]
        if not n_win[i]:
            assert not got.any()
            continue
        slots = torch.from_numpy(runner.table.live_slots(r).astype(np.int64))
        hi = lo + n_win[i]
        expect = sum(window_key_scores(queries[layer, lo:hi], v[slots // 4, slots % 4, 0],
                                       key_ids=runner.table.live_ids(r), query_ids=q_pos[lo:hi])
                     for layer, v in enumerate(views))
        torch.testing.assert_close(got, expect, atol=0, rtol=0)
        lo = hi
    assert not res.window_votes[res.kv_indptr[-1]:].any()


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_cuda_graph_decode_matches_eager(dtype):
    """Graph-replayed decode == eager decode, in lockstep on the same tokens (with evictions, shrinking batch).

    Tolerance: fp32 1e-4 (as above); bf16 3e-2 on logits of magnitude ~6: the
    padded graph batch may change the kernel's kv split, so the fp32
    accumulations run in another order and bf16 rounding of the hidden states
    amplifies that. Both runners are fed the eager run's tokens, so a bf16
    near-tie cannot make them diverge; in fp32 the greedy tokens must agree too.
    """
    atol = 1e-4 if dtype == torch.float32 else 3e-2
    model = LlamaModel(ModelConfig(**{**TINY, "dtype": str(dtype).replace("torch.", "")}), device="cuda")
    graph_r = _runner(model, cuda_graph=True, num_blocks=96, max_num_reqs=8)
    eager_r = _runner(model, cuda_graph=False, num_blocks=96, max_num_reqs=8)
    graph_r.warmup()  # every padded size, before the first step
    assert sorted(graph_r._graphs) == [1, 2, 4, 8] and graph_r.num_graph_captures == 4
    rng = random.Random(0)
    reqs = [0, 1, 2]
    prompts = [np.arange(n) % 160 for n in (6, 11, 9)]
    results = []
    for runner in (graph_r, eager_r):
        for r in reqs:
            runner.add_request(r)
        results.append(runner.prefill(reqs, prompts))
    for step in range(10):
        nxt = results[1].next_tokens()
        if dtype == torch.float32:
            np.testing.assert_array_equal(results[0].next_tokens(), nxt)
        if step == 4:
            for r in reqs:
                live = eager_r.table.live_ids(r)[:-1].tolist()
                victims = sorted(rng.sample(live, len(live) // 3))
                graph_r.evict(r, victims)
                eager_r.evict(r, victims)
        active = reqs if step < 6 else reqs[:2]  # batch 3 -> graph 4, then 2 -> graph 2
        results = [runner.decode(active, nxt[: len(active)]) for runner in (graph_r, eager_r)]
        assert results[0].graph and not results[1].graph
        torch.testing.assert_close(results[0].logits, results[1].logits, atol=atol, rtol=0)
    assert graph_r.num_graph_replays == 10 and eager_r.num_graph_replays == 0
    assert sorted(graph_r._graphs) == [1, 2, 4, 8] and graph_r.num_graph_captures == 4  # none while serving
