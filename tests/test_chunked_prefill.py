"""Chunked prefill in the embedded engine (``EngineConfig(chunked_prefill=True)``, issue 14 §2).

A step's token budget (``max_num_tokens``) is shared by decode tokens, prompt
chunks and new admissions (:mod:`vtoken.engine.batch_plan`). Every check is
exact, token for token and decision for decision, over budgets that split
prompts at block boundaries (4, 8 with ``block_size=4``) and not (5, 13),
smaller than every prompt (4, 5), and with staggered arrivals (closed loop) so
that steps mix decodes of some requests with chunks of others:

* native chunked == native unchunked == Hugging Face transformers (random weights);
* chunked == unchunked for h2o (decides at decode), streamingllm and snapkv
  (decides once, at the end of the prompt, from the window's votes), on the
  device loop and on the host path;
* naive == vtoken under chunking (both on the device loop, and a naive trace
  replayed in vtoken mode);
* nothing is evicted and nothing decided inside an unfinished prompt, also
  when the device's victims reach the host a step late (as on a GPU);
* preemption by recompute of partially prefilled requests;
* the budget holds every step, every request completes; bad configs raise typed errors.

NOTE (float order): chunking changes the order of float sums, not their
terms. A key's attention mass over a prompt is summed per chunk and then
across chunks, and the GEMMs run over other row counts, so the masses differ
from an unchunked run in their last bits: on these inputs by at most 4.3e-7
relative after the prompt and 2.7e-6 after the last decode step (h2o, host
path, budgets 4, 5, 8, 13; measured). The decisions compare masses, so they
could only differ where two candidates' masses lie that close; the h2o test
asserts that every eviction boundary's relative gap is at least MIN_MARGIN
(the smallest measured is 0.04), so the exact equality below is not luck.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_helpers import TINY, POLICY_CFG, EAGER_RECLAIM, prompts as _prompts
from vtoken import cdiv
from vtoken.engine.batch_plan import BatchLimits, SeqState, chunk_size, plan_batch
from vtoken.engine.model import LlamaModel, ModelConfig
from vtoken.engine.scheduler import Engine, EngineConfig
from vtoken.errors import InvalidArgumentError, InvalidTypeError
from vtoken.policies import ReplayPolicy

BUDGETS = (4, 5, 8, 13)  # with block_size 4 and max_num_reqs 4; every prompt below is longer than 5
LENS = (20, 27, 33, 14, 9)
NEW = 8
MIN_MARGIN = 1e-3  # relative gap at every h2o eviction boundary (0.04 measured): > 300x the float-order drift


@pytest.fixture(scope="module")
def model():
    return LlamaModel(ModelConfig(**TINY))


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")


def _engine(model, mode, *, policy=None, budget=None, record=None, **kw):
    """``budget=None``: whole prompts (unchunked); else chunked prefill with that token budget."""
    cfg = dict(num_blocks=96, block_size=4, max_num_reqs=4, reclaim=EAGER_RECLAIM, mode=mode,
               max_num_tokens=256 if budget is None else budget, chunked_prefill=budget is not None)
    if isinstance(policy, str):
        cfg.update(policy=policy, policy_config=POLICY_CFG)
        policy = None
    cfg.update(kw)
    record = mode != "native" and policy is None if record is None else record
    return Engine(model, EngineConfig(**cfg), policy=policy, record_trace=record)


def _decisions(eng, nonempty=True):
    """``(request, seq_len, victims)`` sorted; the host path also records decisions to keep everything."""
    out = sorted((d.request_id, d.step, tuple(int(t) for t in d.token_ids)) for d in eng.trace.decisions)
    return [d for d in out if d[2]] if nonempty else out


def _serve(eng, prompts, new=NEW, concurrency=3):
    """Closed loop (as ``generate(concurrency=)``), checking after every step that no request in the middle
    of its prompt lost a token (host table and device mirror) and that the step kept to the budget."""
    out = []
    pending = list(enumerate(prompts))

    def submit():
        i, p = pending.pop(0)
        out.append(eng.requests[eng.add_request(p, new, request_id=i)])

    while pending and len(out) < concurrency:
        submit()
    while eng.has_work():
        finished = eng.step()
        s = eng.stats[-1]
        assert s.num_tokens <= eng.config.max_num_tokens and s.num_reqs <= eng.config.max_num_reqs
        for r in eng.running:
            if r._pending is not None:  # mid-prompt (or mid-recompute): nothing evicted, not even on the device
                n = eng.table.num_tokens(r.request_id)
                assert r._prefilled == n and eng.table.live_count(r.request_id) == n
                assert eng.runner.mirror.host_copy(r.request_id)[1].all()
        for _ in finished:
            if pending:
                submit()
    assert all(len(r.output) == new and r.finished for r in out)
    eng.table.check_invariants()
    assert eng.table.ledger.num_allocated == 0
    return sorted(out, key=lambda r: r.request_id)


def _assert_no_decision_inside_a_prompt(eng, reqs):
    """Every decision is keyed at or after its request's prompt (a run without preemption)."""
    assert eng.num_preemptions == 0
    prompt_len = {r.request_id: len(r.prompt) for r in reqs}
    assert all(seq_len >= prompt_len[rid] for rid, seq_len, _ in _decisions(eng, nonempty=False))


def _outputs(reqs):
    return [r.output for r in reqs]


# --------------------------------------------------------------------- batch plan (plain data)
def test_plan_decodes_first_then_partial_prompts_then_fifo_admission():
    lim = BatchLimits(max_num_reqs=4, max_num_tokens=8, block_size=4, chunked=True)
    running = [SeqState("d1", 5, 5), SeqState("p", 20, 4), SeqState("d2", 3, 3)]
    plan = plan_batch(running, [SeqState("w", 6)], lim, free_blocks=10)
    assert [(c.request_id, c.num_tokens, c.decode, c.completes_prompt) for c in plan.chunks] == [
        ("d1", 1, True, False), ("p", 6, False, False), ("d2", 1, True, False)]
    assert plan.kind == "mixed" and plan.num_tokens == 8 and plan.admitted == []
    # p completes with its last 2 tokens; the 6 left start the queue's head (9 tokens), and w2 waits.
    plan = plan_batch([SeqState("p", 20, 18)], [SeqState("w1", 9), SeqState("w2", 2)], lim, free_blocks=10)
    assert [(c.request_id, c.num_tokens, c.completes_prompt, c.admitted) for c in plan.chunks] == [
        ("p", 2, True, False), ("w1", 6, False, True)]
    # The head of the queue does not fit its blocks (p still owes 5 - 1 = 4): nothing behind it is admitted.
    plan = plan_batch([SeqState("p", 20, 4)], [SeqState("w1", 12), SeqState("w2", 2)],
                      BatchLimits(4, 64, 4, chunked=True), free_blocks=6)
    assert plan.admitted == [] and plan.kind == "prefill"
    assert plan_batch([], [SeqState("w", 3)], lim, free_blocks=1, backpressure=True).chunks == ()


def test_plan_never_leaves_a_final_chunk_shorter_than_the_window():
    assert chunk_size(10, 8, 4) == 6  # leaves exactly the window
    assert chunk_size(5, 4, 4) == 1
    assert chunk_size(4, 3, 4) == 0  # cannot complete, cannot leave a full window: waits
    assert chunk_size(3, 3, 4) == 3  # a prompt shorter than the window runs whole
    lim = BatchLimits(max_num_reqs=4, max_num_tokens=6, block_size=4, chunked=True, min_final_chunk=4)
    # After the decode, 5 tokens are left: p's last 5 run whole; with 6 left it runs 2 and keeps its last 4.
    plan = plan_batch([SeqState("d", 1, 1), SeqState("p", 9, 4)], [], lim, free_blocks=9)
    assert [c.num_tokens for c in plan.chunks] == [1, 5] and plan.chunks[1].completes_prompt
    plan = plan_batch([SeqState("d", 1, 1), SeqState("p", 10, 4)], [], lim, free_blocks=9)
    assert [c.num_tokens for c in plan.chunks] == [1, 2] and not plan.chunks[1].completes_prompt
    # Two decodes leave 4 < p's 5 left: a chunk of 1 keeps the last 4 together.
    running = [SeqState("d1", 1, 1), SeqState("d2", 1, 1), SeqState("p", 9, 4)]
    assert [c.num_tokens for c in plan_batch(running, [], lim, free_blocks=9).chunks] == [1, 1, 1]
    # With a budget of 5, they leave 3 < p's 4 left, and any chunk would split its last 4: p waits, and the
    # queue waits behind it (FIFO), although w would fit.
    lim = BatchLimits(max_num_reqs=4, max_num_tokens=5, block_size=4, chunked=True, min_final_chunk=4)
    running[2] = SeqState("p", 8, 4)
    plan = plan_batch(running, [SeqState("w", 1)], lim, free_blocks=9)
    assert [c.request_id for c in plan.chunks] == ["d1", "d2"] and plan.admitted == []


@pytest.mark.parametrize("seed", range(6))
def test_plan_rules_on_random_states(seed):
    """The plan's invariants on random running sets and queues, chunked or not."""
    rng = np.random.default_rng(seed)
    for _ in range(200):
        S, R = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        chunked = bool(rng.integers(2))
        w = int(rng.integers(0, 5)) if chunked else 0
        T = int(rng.integers(max(R, w, 1), 40))
        lim = BatchLimits(R, T, S, chunked=chunked, min_final_chunk=w)
        running = []
        for i in range(int(rng.integers(0, R + 1))):
            n = int(rng.integers(1, 30))
            done = n if (not chunked or rng.random() < 0.5) else int(rng.integers(0, n))
            running.append(SeqState(f"r{i}", n, done))
        waiting = [SeqState(f"w{i}", int(rng.integers(1, 30))) for i in range(int(rng.integers(0, 5)))]
        free = int(rng.integers(0, 30))
        backpressure = bool(rng.random() < 0.2)
        plan = plan_batch(running, waiting, lim, free_blocks=free, backpressure=backpressure)
        by_id = {s.request_id: s for s in running + waiting}
        ids = [c.request_id for c in plan.chunks]
        assert len(set(ids)) == len(ids) and len(running) + len(plan.admitted) <= R
        assert plan.admitted == [s.request_id for s in waiting[: len(plan.admitted)]]  # FIFO prefix
        if not chunked:  # exactly the engine's rule before chunking (whole prompts, prefill first)
            expect, blocks, tokens = [], free, 0
            for w in [] if backpressure else waiting:
                if len(running) + len(expect) >= R or cdiv(w.prompt_len, S) > blocks or tokens + w.prompt_len > T:
                    break
                expect.append(w.request_id)
                blocks, tokens = blocks - cdiv(w.prompt_len, S), tokens + w.prompt_len
            assert plan.admitted == expect
            assert ids == (expect or [s.request_id for s in running])
            assert all(c.completes_prompt if expect else c.decode for c in plan.chunks)
            continue
        owed = sum(cdiv(s.prompt_len, S) - cdiv(s.prefilled, S) for s in running if s.remaining)
        assert sum(cdiv(by_id[a].prompt_len, S) for a in plan.admitted) <= max(free - owed, 0) or not plan.admitted
        assert plan.num_tokens <= T
        assert [c.request_id for c in plan.chunks if c.decode] == [s.request_id for s in running if not s.remaining]
        for c in plan.chunks:
            left = by_id[c.request_id].remaining - c.num_tokens
            assert c.num_tokens >= 1 and (c.decode or left >= 0)
            assert c.completes_prompt == (not c.decode and left == 0)
            assert c.decode or left == 0 or left >= w  # never a final chunk shorter than the window


# --------------------------------------------------------------------- native: chunked == unchunked == HF
@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """A random-weight HF Llama saved as a checkpoint, its prompts and HF's greedy tokens."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("hf_chunked")
    hf.save_pretrained(path, safe_serialization=True)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 160, (n,), generator=gen) for n in (3, 7, 12, 17, 9)]
    toks = [hf.generate(p[None], max_new_tokens=9, min_new_tokens=9, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    return LlamaModel.from_pretrained(path), [p.numpy() for p in prompts], toks


def test_native_chunked_equals_unchunked_and_hf(hf_run):
    model, prompts, hf_toks = hf_run
    unchunked = _serve(_engine(model, "native"), prompts, new=9, concurrency=2)
    assert _outputs(unchunked) == hf_toks
    for budget in BUDGETS:
        eng = _engine(model, "native", budget=budget)
        out = _serve(eng, prompts, new=9, concurrency=2)
        assert _outputs(out) == hf_toks, f"budget {budget}"
        kinds = [s.kind for s in eng.stats]
        assert "mixed" in kinds and "prefill" in kinds and "decode" in kinds
        assert max(s.num_tokens for s in eng.stats) == budget  # the budget was used up, never exceeded


# --------------------------------------------------------------------- evicting policies
@pytest.mark.parametrize("decision", ("device", "host"))
@pytest.mark.parametrize("policy", ("h2o", "streamingllm", "snapkv"))
def test_chunked_equals_unchunked_with_eviction(model, policy, decision):
    prompts = _prompts(LENS)
    base_eng = _engine(model, "naive", policy=policy, decision=decision)
    base = _serve(base_eng, prompts)
    assert _decisions(base_eng)
    for budget in BUDGETS if decision == "device" else (5, 8):  # the host path: one budget of each kind
        eng = _engine(model, "naive", policy=policy, decision=decision, budget=budget)
        out = _serve(eng, prompts)
        assert _outputs(out) == _outputs(base), f"budget {budget}"
        assert _decisions(eng) == _decisions(base_eng), f"budget {budget}"
        _assert_no_decision_inside_a_prompt(eng, out)
        assert "mixed" in {s.kind for s in eng.stats}


def test_h2o_decisions_are_not_near_ties(model, monkeypatch):
    """The equality above is robust: every h2o eviction boundary has a relative margin >= MIN_MARGIN."""
    from vtoken.policies.h2o import H2O

    margins = []
    choose = H2O.choose

    def spy(self, view, candidates, n):
        s = np.sort(view.scores.accumulated(candidates))
        if 0 < n < s.size:
            margins.append((s[n] - s[n - 1]) / s[n])
        return choose(self, view, candidates, n)

    monkeypatch.setattr(H2O, "choose", spy)
    _serve(_engine(model, "naive", policy="h2o", decision="host", budget=5), _prompts(LENS))
    assert len(margins) >= 10 and min(margins) >= MIN_MARGIN


@pytest.mark.parametrize("policy", ("h2o", "streamingllm", "snapkv"))
def test_naive_equals_vtoken_under_chunking(model, policy):
    prompts = _prompts(LENS, seed=1)
    naive = _engine(model, "naive", policy=policy, budget=5)
    out_naive = _serve(naive, prompts)
    vt = _engine(model, "vtoken", policy=policy, budget=5)
    out_vt = _serve(vt, prompts)
    assert _outputs(out_naive) == _outputs(out_vt)
    assert _decisions(naive) == _decisions(vt) and _decisions(naive)
    assert vt.summary()["relocated_tokens"] > 0 and naive.summary()["relocated_tokens"] == 0
    # The naive trace replayed in vtoken mode (host path), under another budget.
    replay = ReplayPolicy(naive.trace)
    out_replay = _serve(_engine(model, "vtoken", policy=replay, budget=8, record=False), prompts)
    replay.check_complete()
    assert _outputs(out_replay) == _outputs(out_naive)


@pytest.mark.parametrize("policy", ("h2o", "snapkv"))
def test_device_victims_reaching_the_host_late_change_nothing(model, policy, monkeypatch):
    """On a GPU a step's victims may reach the host a step later still; then a request that decoded before
    a completing prompt in the same batch lists fewer keys on the device than on the host, and the window
    votes must land at the device's rows. Held back two extra steps here: same tokens, same decisions."""
    prompts = _prompts(LENS, seed=2)
    ref = _engine(model, "naive", policy=policy, budget=8)
    out_ref = _serve(ref, prompts)
    eng = _engine(model, "naive", policy=policy, budget=8)
    ring = eng.decisions.ring
    ready = ring.next_ready
    held = []

    def late():
        rec = ready()
        if rec is not None and rec.meta.step >= eng.decisions.steps - 3:  # ready 3 steps late instead of 1
            held.append(rec.meta.step)
            return None
        return rec

    monkeypatch.setattr(ring, "next_ready", late)
    out = _serve(eng, prompts)
    monkeypatch.setattr(ring, "next_ready", ready)
    eng.eviction.apply_device_victims()  # the records still held at the end
    assert held and _outputs(out) == _outputs(out_ref)
    assert _decisions(eng) == _decisions(ref)


# --------------------------------------------------------------------- preemption, budget, errors
@pytest.mark.parametrize("mode", ("native", "naive", "vtoken"))
def test_preemption_of_partially_prefilled_requests(model, mode, monkeypatch):
    """A pool too small for everyone: requests are preempted in the middle of their prompt, recompute, and
    complete; native outputs equal a roomy unchunked run."""
    prompts = _prompts((12, 14, 17, 20, 9), seed=3)
    policy = dict(policy="h2o", policy_config=dict(budget=0.9, window=4, sink=1)) if mode != "native" else {}
    if mode == "vtoken":  # evicting half (holes to reclaim), with a reserve the 13 blocks can afford
        policy = dict(policy="h2o", policy_config=dict(budget=0.5, window=4, sink=1),
                      reclaim=dict(EAGER_RECLAIM, headroom_blocks=2))
    eng = _engine(model, mode, budget=6, num_blocks=14, record=False, **policy)  # 13 blocks: 52 tokens
    mid_prompt = []
    preempt = eng._preempt

    def spy(req):
        mid_prompt.append(req._pending is not None and req._prefilled > 0)
        preempt(req)

    monkeypatch.setattr(eng, "_preempt", spy)
    out = _serve(eng, prompts, new=12, concurrency=4)
    assert eng.num_preemptions > 0 and any(mid_prompt)
    assert all(len(r.output) == 12 for r in out)
    if mode == "vtoken":
        assert eng.summary()["relocated_tokens"] > 0  # compaction ran between the preemptions (checked: I1/I2/I4)
    if mode == "native":
        roomy = _serve(_engine(model, "native"), prompts, new=12, concurrency=4)
        assert _outputs(out) == _outputs(roomy)


def test_long_prompts_need_chunking_and_the_budget_holds(model):
    prompts = _prompts((70, 9, 45), seed=4)
    with pytest.raises(InvalidArgumentError, match="max_num_tokens"):
        _engine(model, "native", max_num_tokens=32).add_request(prompts[0], 4)
    eng = _engine(model, "native", budget=16)
    out = eng.generate(prompts, 6, concurrency=2)
    assert all(len(r.output) == 6 for r in out)
    assert max(s.num_tokens for s in eng.stats) == 16 and all(s.num_tokens <= 16 for s in eng.stats)
    roomy = _engine(model, "native").generate(prompts, 6, concurrency=2)
    assert _outputs(out) == _outputs(roomy)


def test_bad_chunking_config_raises_typed_errors(model):
    with pytest.raises(InvalidTypeError, match="chunked_prefill"):
        EngineConfig(chunked_prefill="yes")
    with pytest.raises(InvalidArgumentError, match="max_num_tokens"):
        EngineConfig(chunked_prefill=True, max_num_reqs=8, max_num_tokens=4)  # decodes could not all fit
    with pytest.raises(InvalidArgumentError, match="max_num_tokens.*window"):
        _engine(model, "naive", policy="snapkv", budget=4, policy_config=dict(POLICY_CFG, window=6))
    with pytest.raises(InvalidArgumentError, match="block budget"):
        _engine(model, "native", budget=8, num_blocks=6).add_request(np.arange(30), 4)
    with pytest.raises(InvalidTypeError, match="limits"):
        plan_batch([], [], dict(max_num_reqs=1), free_blocks=1)
    with pytest.raises(InvalidArgumentError, match="min_final_chunk"):
        BatchLimits(2, 8, 4, min_final_chunk=-1)
