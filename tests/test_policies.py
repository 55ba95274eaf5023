"""Eviction policies: each against an independent re-implementation of its definition.

The "model" below is a fixed, hand-built logit tensor ``[num_q_heads, T, T]``
(seeded noise plus a few planted heavy-hitter columns). Both sides see the
same per-head causal attention probabilities; the reference implementations
are plain-Python loops written from the papers' definitions (dicts keyed by
token id, per query head, no vtoken helpers), the policies go through
ScoreAccumulator / window_key_scores / lowest. Victims must match exactly.
"""
from __future__ import annotations

import ast
import doctest
import json
import math
import pathlib
from collections import defaultdict, deque

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import vtoken.policies as P
from vtoken.errors import InvalidArgumentError, InvalidTypeError, InvariantViolation, VTokenError
from vtoken.policies import base as policy_base
from vtoken.policies import scores as policy_scores
from vtoken.policies.base import Budget, PolicyView
from vtoken.policies.trace import ReplayDivergenceError, ReplayPolicy, TraceRecorder
from vtoken.policies.scores import ScoreAccumulator, accumulate_batch, window_key_scores

POLICY_DIR = pathlib.Path(P.__file__).parent
NAMES = ["h2o", "random", "scissorhands", "snapkv", "streamingllm", "tova"]
POLICY_FILES = {n: POLICY_DIR / f"{n}.py" for n in NAMES}

SEEDS = [0, 1, 2]
HEADS = [(4, 4), (4, 1), (6, 2)]  # (num_q_heads, num_kv_heads): MHA, MQA, GQA
PROMPT, TOTAL = 13, 40  # odd prompt length; 27 decode steps


# --------------------------------------------------------------------------- the hand-built model


def sinkless(name: str, **cfg):
    """The references and hand examples here protect no sink unless told (the default sink is 4)."""
    return P.get(name, **{"sink": 0, **cfg})


def make_logits(seed: int, hq: int, t: int = TOTAL) -> np.ndarray:
    """[hq, t, t] logits: noise plus heavy-hitter keys 0, 5 and 11 that every query likes."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 1.0, size=(hq, t, t))
    logits[:, :, [0, 5, 11]] += 2.5
    return logits


def attention_probs(logits: np.ndarray, live: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """[hq, n_queries, n_live] causal softmax of each query over the live keys it can see."""
    sub = logits[:, queries][:, :, live]
    sub = np.where(live[None, None, :] > queries[None, :, None], -np.inf, sub)
    sub = sub - sub.max(-1, keepdims=True)
    e = np.exp(sub)
    return e / e.sum(-1, keepdims=True)


def key_scores(probs: np.ndarray, hkv: int) -> np.ndarray:
    """What token_attention returns for one request: [n_live, hkv], summed over queries and GQA group."""
    hq, _, n = probs.shape
    return probs.sum(1).reshape(hkv, hq // hkv, n).sum(1).T


def steps(prompt: int = PROMPT, total: int = TOTAL):
    """(step, seq_len, query positions): one prefill step, then one decode token per step."""
    yield 0, prompt, np.arange(prompt)
    for s, length in enumerate(range(prompt + 1, total + 1), start=1):
        yield s, length, np.array([length - 1])


def run_policy(policy, logits, hkv, *, request_id=0, prompt=PROMPT, total=TOTAL, torch_scores=False):
    """Drive ``policy`` through the model; returns the per-step victim lists."""
    live = np.zeros(0, dtype=np.int64)
    acc = policy.make_accumulator()
    out = []
    for step, length, queries in steps(prompt, total):
        live = np.union1d(live, queries)
        if acc is not None:
            ks = key_scores(attention_probs(logits, live, queries), hkv)
            acc.update(live, torch.from_numpy(ks).float() if torch_scores else ks)
        view = policy.view(request_id, step, live, seq_len=length, num_new=len(queries), scores=acc)
        victims = policy.select_victims(view)
        assert victims.dtype == np.int64 and np.all(np.diff(victims) > 0)
        out.append(victims.tolist())
        live = np.setdiff1d(live, victims)
    return out


# --------------------------------------------------------------------------- references (from the papers)


def ref_budget(kind, value, length):
    return value if kind == "cap" else (length * value[0]) // value[1]  # ratio as an exact fraction


def ref_protected(token, length, window, num_new, sink=0):
    return token < sink or token >= length - max(window, num_new)


def ref_h2o(logits, budget, window):
    live, acc, out = [], defaultdict(float), []
    for step, length, queries in steps():
        live += [int(q) for q in queries if q not in live]
        probs = attention_probs(logits, np.array(live), queries)
        for j, tok in enumerate(live):
            acc[tok] += float(probs[:, :, j].sum())  # summed over steps, queries and every head
        excess = len(live) - ref_budget(*budget, length)
        cands = [t for t in live if not ref_protected(t, length, window, len(queries))]
        victims = sorted(sorted(cands, key=lambda t: (acc[t], t))[: max(excess, 0)])
        out.append(victims)
        live = [t for t in live if t not in victims]
    return out


def ref_scissorhands(logits, budget, window, history):
    live, ring, out = [], deque(maxlen=history), []
    for step, length, queries in steps():
        live += [int(q) for q in queries if q not in live]
        probs = attention_probs(logits, np.array(live), queries)
        hq, nq, n = probs.shape
        mean_p = {tok: probs[:, :, j].sum() / (hq * nq) for j, tok in enumerate(live)}
        ring.append((set(live), {t for t in live if mean_p[t] < 1.0 / n}))
        frac = {t: sum(t in low for _, low in ring) / sum(t in seen for seen, _ in ring) for t in live}
        excess = len(live) - ref_budget(*budget, length)
        cands = [t for t in live if not ref_protected(t, length, window, len(queries))]
        victims = sorted(sorted(cands, key=lambda t: (-frac[t], t))[: max(excess, 0)])
        out.append(victims)
        live = [t for t in live if t not in victims]
    return out


def ref_tova(logits, budget, window):
    live, out = [], []
    for step, length, queries in steps():
        live += [int(q) for q in queries if q not in live]
        probs = attention_probs(logits, np.array(live), queries)
        last_q = probs.mean(axis=0).sum(axis=0)  # averaged over heads (summed over the step's queries)
        score = dict(zip(live, last_q))
        cands = [t for t in live if not ref_protected(t, length, window, len(queries))]
        victims = []
        if len(live) > ref_budget(*budget, length) and cands:
            victims = [min(cands, key=lambda t: (score[t], t))]
        out.append(victims)
        live = [t for t in live if t not in victims]
    return out


def ref_streamingllm(sink, window, budget=None):
    live, out = [], []
    for step, length, queries in steps():
        live += [int(q) for q in queries if q not in live]
        if budget is None:
            keep = {t for t in live if t < sink or t >= length - max(window, len(queries))}
        else:
            b = ref_budget(*budget, length)
            cands = [t for t in live if not ref_protected(t, length, window, len(queries), sink)]
            keep = set(live) - set(cands[: max(len(live) - b, 0)])
        out.append(sorted(set(live) - keep))
        live = sorted(keep)
    return out


def budget_cfg(budget):
    kind, value = budget
    return value if kind == "cap" else value[0] / value[1]


BUDGETS = [("cap", 9), ("ratio", (3, 10)), ("ratio", (1, 2))]
WINDOWS = [0, 3]


# --------------------------------------------------------------------------- policy == reference


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("window", WINDOWS)
def test_h2o_matches_reference(seed, heads, budget, window):
    hq, hkv = heads
    logits = make_logits(seed, hq)
    got = run_policy(sinkless("h2o", budget=budget_cfg(budget), window=window), logits, hkv)
    assert got == ref_h2o(logits, budget, window)
    assert any(got), "the budget must force evictions, or the test proves nothing"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("window,history", [(0, 1), (3, 4), (2, 64)])
def test_scissorhands_matches_reference(seed, heads, budget, window, history):
    hq, hkv = heads
    logits = make_logits(seed, hq)
    policy = sinkless("scissorhands", budget=budget_cfg(budget), window=window, history=history)
    got = run_policy(policy, logits, hkv)
    assert got == ref_scissorhands(logits, budget, window, history)
    assert any(got)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("window", WINDOWS)
def test_tova_matches_reference(seed, heads, budget, window):
    hq, hkv = heads
    logits = make_logits(seed, hq)
    got = run_policy(sinkless("tova", budget=budget_cfg(budget), window=window), logits, hkv)
    assert got == ref_tova(logits, budget, window)
    assert all(len(v) <= 1 for v in got) and any(got)


@pytest.mark.parametrize("sink,window", [(4, 8), (1, 1), (0, 5), (3, 0)])
@pytest.mark.parametrize("budget", [None] + BUDGETS)
def test_streamingllm_matches_reference(sink, window, budget):
    cfg = {} if budget is None else {"budget": budget_cfg(budget)}
    if budget is None and sink + window == 0:
        pytest.skip("needs a budget")
    got = run_policy(P.get("streamingllm", sink=sink, window=window, **cfg), make_logits(0, 1), 1)
    assert got == ref_streamingllm(sink, window, budget)
    assert any(got)


def ref_snapkv(q, k, window, keep_prefix, pooling, kernel=5):
    """SnapKV as in its public code, per query head in float64, then summed over heads for one token set."""
    n, hkv, d = k.shape
    hq = q.shape[1]
    qw = q[-window:].double()
    votes = torch.zeros(n - window, dtype=torch.float64)
    for h in range(hq):
        kh = k[:, h // (hq // hkv)].double()
        attn = qw[:, h] @ kh.T / math.sqrt(d)  # [window, n]
        causal = torch.arange(n)[None, :] > torch.arange(n - window, n)[:, None]
        attn = torch.softmax(attn.masked_fill(causal, float("-inf")), dim=-1)
        vote = attn[:, : n - window].sum(0)[None, None]
        pool = F.avg_pool1d if pooling == "avgpool" else F.max_pool1d
        votes += pool(vote, kernel_size=kernel, padding=kernel // 2, stride=1)[0, 0]
    order = sorted(range(n - window), key=lambda i: (-float(votes[i]), -i))  # ties: keep the newer
    kept = set(order[:keep_prefix]) | set(range(n - window, n))
    return sorted(set(range(n)) - kept)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("pooling", ["avgpool", "maxpool"])
@pytest.mark.parametrize("n,window,budget", [(41, 8, 20), (23, 5, 12), (64, 16, 17)])
def test_snapkv_matches_reference(seed, heads, pooling, n, window, budget):
    hq, hkv = heads
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, 16, generator=g)
    k = torch.randn(n, hkv, 16, generator=g)
    k[[2, 9, n // 2]] *= 3.0  # planted strong keys
    policy = sinkless("snapkv", budget=budget, window=window, pooling=pooling)
    ids = np.arange(n)
    expect = ref_snapkv(q, k, window, budget - window, pooling)
    # per query head, as SnapKV pools; with avgpool (linear) the GQA-summed scores give the same answer
    for group_heads in ([False, True] if pooling == "avgpool" else [False]):
        ws = window_key_scores(q[-window:], k, key_ids=ids, group_heads=group_heads)
        assert ws.shape == (n, hkv if group_heads else hq)
        victims = policy.select_victims(policy.view("r", 0, ids, window_scores=ws))
        assert victims.tolist() == expect
    # a decode step (no window votes) evicts nothing
    assert policy.select_victims(policy.view("r", 1, ids)).size == 0


# --------------------------------------------------------------------------- hand-computed examples


def test_h2o_hand_example():
    p = sinkless("h2o", budget=5, window=2)
    acc = p.make_accumulator()
    ids = np.arange(7)
    acc.update(ids, np.array([[0.6, 0.5], [0.1, 0.0], [0.2, 0.3], [0.05, 0.05], [0.3, 0.1], [0.1, 0.1], [0.0, 0.1]]))
    acc.update(ids, np.array([0.0, 0.0, 0.1, 0.5, 0.0, 0.0, 0.0]))
    # accumulated: 1.1, 0.1, 0.6, 0.6, 0.4, .2, .1; 5 and 6 are the recent window -> evict 1 then 4 (3 and 2 tie
    # at 0.6 but are not needed)
    assert p.select_victims(p.view(0, 5, ids, scores=acc)).tolist() == [1, 4]


@pytest.mark.parametrize("history,expected", [(2, [2, 3]), (3, [1, 3])])
def test_scissorhands_hand_example(history, expected):
    p = sinkless("scissorhands", budget=3, window=1, history=history)
    acc = p.make_accumulator()
    ids = np.arange(5)
    for s in ([0.5, 0.05, 0.3, 0.1, 0.05], [0.4, 0.3, 0.1, 0.15, 0.05], [0.3, 0.3, 0.3, 0.05, 0.05]):
        acc.update(ids, np.array(s))  # low = below 1/5 of the step's mass
    # history 2: fractions 0, 0, 1/2, 1, (1: protected) -> evict 3, 2
    # history 3: fractions 0, 1/3, 1/3, 1 -> evict 3, then the 1/3 tie goes to the older token, 1
    assert p.select_victims(p.view(0, 2, ids, scores=acc)).tolist() == expected


def test_tova_hand_example():
    p = sinkless("tova", budget=3)
    acc = p.make_accumulator()
    acc.update(np.arange(5), np.array([0.3, 0.1, 0.05, 0.25, 0.01]))
    # id 4 is the current step's token: never evicted, even with the lowest score; one victim per step
    assert p.select_victims(p.view(0, 0, np.arange(5), scores=acc)).tolist() == [2]


@pytest.mark.parametrize("pooling", ["avgpool", "maxpool"])
def test_snapkv_hand_example(pooling):
    p = sinkless("snapkv", budget=6, window=2, pooling=pooling)
    votes = np.zeros(10)
    votes[[0, 7]] = [1.0, 5.0]
    # pooled (k=5): avg .2 .2 .2 0 0 1 1 1 | max 1 1 1 0 0 5 5 5; keep 4 prefix keys + window 8, 9:
    # 5, 6, 7, then one of the tied 0, 1, 2 (older first evicted -> 2 stays); evict 0, 1, 3, 4
    view = p.view(0, 0, np.arange(10), window_scores=votes)
    assert p.select_victims(view).tolist() == [0, 1, 3, 4]


@pytest.mark.parametrize("pooling,expected", [("avgpool", [0, 3, 4, 5]), ("maxpool", [0, 1, 2, 5])])
def test_snapkv_pools_the_prefix_only(pooling, expected):
    """The window's own keys (huge self-votes) must not leak into the pooled votes of the prefix's tail."""
    p = sinkless("snapkv", budget=4, window=2, pooling=pooling)
    votes = np.array([0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 8.0, 8.0])
    # avg: .3 .3 .3 .2 .1 0 -> evict 5, 4, 3, then the oldest of the .3 tie; max: .5 x5, 0 -> evict 5, 0, 1, 2
    assert p.select_victims(p.view(0, 0, np.arange(8), window_scores=votes)).tolist() == expected


# --------------------------------------------------------------------------- budgets, protection, determinism


def _view_for(policy, rng, live, length, num_new):
    acc = ScoreAccumulator(history=getattr(policy, "history", 0))
    for _ in range(3):
        acc.update(live, rng.random((live.size, 2)))
    ws = rng.random(live.size) if policy.score_source == "window" else None
    return policy.view("req", 7, live, seq_len=length, num_new=num_new, scores=acc, window_scores=ws)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    length=st.integers(1, 300),
    keep_frac=st.floats(0.05, 1.0),
    budget=st.one_of(st.floats(0.01, 0.99), st.integers(1, 200)),
    window=st.integers(0, 40),
    sink=st.integers(0, 6),
    num_new=st.integers(0, 20),
    seed=st.integers(0, 2**32 - 1),
)
def test_budget_and_protection_hold_for_every_policy(name, length, keep_frac, budget, window, sink, num_new, seed):
    rng = np.random.default_rng(seed)
    live = np.flatnonzero(rng.random(length) < keep_frac)
    live = np.union1d(live, np.arange(max(length - num_new, 0), length))  # the current step's tokens are live
    policy = P.get(name, budget=budget, window=window, sink=sink)
    view = _view_for(policy, rng, live, length, num_new)
    victims = policy.select_victims(view)
    protected = (live < sink) | (live >= length - max(window, num_new))
    target = policy.budget.resolve(length)
    unprotected = int((~protected).sum())
    assert np.isin(victims, live).all() and not np.isin(victims, live[protected]).any()
    assert np.array_equal(victims, np.unique(victims))
    expected = max(0, min(live.size - target, unprotected))
    if name == "tova":
        expected = min(expected, 1)  # one token per step, by definition
    assert victims.size == expected
    if name != "tova":
        assert live.size - victims.size == max(target, live.size - unprotected) or live.size <= target


@pytest.mark.parametrize("name", NAMES)
def test_within_budget_evicts_nothing(name):
    policy = sinkless(name, budget=50)
    rng = np.random.default_rng(0)
    view = _view_for(policy, rng, np.arange(50), 50, 1)
    assert policy.select_victims(view).size == 0


@pytest.mark.parametrize("name", ["h2o", "scissorhands", "random", "streamingllm"])
def test_steady_state_stays_at_budget(name):
    policy = sinkless(name, budget=12, window=4)
    hist = run_policy(policy, make_logits(3, 2), 2, prompt=5, total=40)
    live = 5 + len(hist) - 1 - sum(len(v) for v in hist)
    assert live == 12


def test_tova_steady_state_one_per_step():
    hist = run_policy(sinkless("tova", budget=10), make_logits(3, 2), 2, prompt=18, total=40)
    # the prompt's excess (8 tokens) is never caught up: one eviction per step, as TOVA defines it
    assert [len(v) for v in hist] == [0] + [1] * 22


@pytest.mark.parametrize("seed", [0, 7])
def test_random_is_deterministic_under_a_seed(seed):
    logits = make_logits(0, 1)
    a = run_policy(sinkless("random", budget=0.4, seed=seed), logits, 1)
    b = run_policy(sinkless("random", budget=0.4, seed=seed), logits, 1)
    c = run_policy(sinkless("random", budget=0.4, seed=seed + 1), logits, 1)
    assert a == b and a != c


def _mix32(x):
    """The documented 32-bit finalizer, re-derived on Python ints."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x5BD1E995) % 2**32
    return x ^ (x >> 16)


def _fold32(x):
    x %= 2**64
    return (x % 2**32) ^ (x >> 32)


def test_random_matches_reference_draw():
    """The documented draw: the lowest counter-hash draws of (seed, step, request_seed, token id)."""
    p = sinkless("random", budget=10, window=3, seed=5)
    live = np.array([0, 2, 3, 5, 8, 9, 11, 12, 13, 17, 18, 19, 20, 21, 25, 26, 29])
    for rid in (3, "req-a", 2**64 + 3):
        victims = p.select_victims(p.view(rid, 4, live, seq_len=30))
        rseed = rid if isinstance(rid, int) else __import__("zlib").crc32(repr(rid).encode())
        key = _mix32(_fold32(5) ^ _mix32(_fold32(4) ^ _mix32(_fold32(rseed))))
        draws = sorted((_mix32(key ^ _mix32(int(t))), int(t)) for t in live[live < 27])
        assert victims.tolist() == sorted(t for _, t in draws[:7])


def test_random_draw_is_uniform_over_candidates():
    """Over many (request, step) keys, every unprotected token is evicted about equally often."""
    p = sinkless("random", budget=0.5, window=0, seed=9)
    hits = np.zeros(40, np.int64)
    for rid in range(100):
        for step in range(20):
            hits[p.select_victims(p.view(rid, step, np.arange(40)))] += 1
    assert hits[39] == 0  # the current step's token is protected
    expect = 2000 * 20 / 39  # 2000 decisions of 20 victims among 39 candidates
    chi2 = float(((hits[:39] - expect) ** 2 / expect).sum())
    assert chi2 < 80  # 38 degrees of freedom: p < 1e-4 beyond 80; deterministic under the fixed seeds


def test_random_draw_does_not_depend_on_request_order():
    p = sinkless("random", budget=0.5, seed=1)
    live = np.arange(40)
    first = {r: p.select_victims(p.view(r, 3, live)).tolist() for r in range(4)}
    second = {r: p.select_victims(p.view(r, 3, live)).tolist() for r in reversed(range(4))}
    assert first == second and len({tuple(v) for v in first.values()}) == 4


def test_all_policies_deterministic():
    for name in NAMES:
        policy = sinkless(name, budget=0.5, window=2)
        a = _view_for(policy, np.random.default_rng(11), np.arange(0, 90, 2), 90, 1)
        b = _view_for(policy, np.random.default_rng(11), np.arange(0, 90, 2), 90, 1)
        assert policy.select_victims(a).tolist() == policy.select_victims(b).tolist()


@settings(max_examples=100, deadline=None)
@given(
    prio=st.lists(st.one_of(st.integers(0, 4).map(float), st.just(float("nan")), st.just(float("inf"))), max_size=40),
    n=st.integers(0, 45),
)
def test_lowest_equals_a_stable_sort(prio, n):
    """Partition-based selection == "sort by (priority, id), NaN last, take n"."""
    cands = np.arange(len(prio), dtype=np.int64) * 3 + 1
    key = [(math.isnan(p), p if not math.isnan(p) else 0.0, int(c)) for p, c in zip(prio, cands)]
    expect = sorted(c for *_, c in sorted(key)[:n])
    assert sorted(P.lowest(cands, np.array(prio, dtype=np.float64), n).tolist()) == expect


def test_rogue_policy_cannot_evict_protected_tokens():
    class Rogue(P.EvictionPolicy):
        def choose(self, view, candidates, n):
            return view.token_ids[-n:]  # the newest tokens: protected

    p = Rogue(budget=2, window=1)
    with pytest.raises(InvariantViolation, match="unprotected"):
        p.select_victims(p.view(0, 0, np.arange(6)))


# --------------------------------------------------------------------------- traces


def _multi_request_run(policy, order):
    """Three requests of different lengths, decided in ``order`` each step; returns {(rid, step): victims}."""
    rng = np.random.default_rng(0)
    lives = {rid: np.arange(n) for rid, n in (("a", 9), ("b", 14), ("c", 20))}
    accs = {rid: policy.make_accumulator() for rid in lives}
    out = {}
    for step in range(1, 25):
        for rid in order:
            nxt = int(lives[rid][-1]) + 1
            lives[rid] = np.append(lives[rid], nxt)
            if accs[rid] is not None:
                accs[rid].update(lives[rid], rng.random((lives[rid].size, 2)))
            ws = rng.random(lives[rid].size) if policy.score_source == "window" else None
            view = policy.view(rid, step, lives[rid], seq_len=nxt + 1, scores=accs[rid], window_scores=ws)
            v = policy.select_victims(view)
            out[(rid, step)] = v.tolist()
            lives[rid] = np.setdiff1d(lives[rid], v)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_trace_replays_identically(name, tmp_path):
    rec = TraceRecorder(sinkless(name, budget=0.5, window=2))
    recorded = _multi_request_run(rec, ["a", "b", "c"])
    assert len(rec) == 3 * 24 and any(recorded.values())
    path = tmp_path / "trace.json"
    rec.save(path)
    assert json.loads(path.read_text())["meta"]["policy"] == name
    replay = ReplayPolicy(path)
    replayed = _multi_request_run(replay, ["c", "a", "b"])  # another order: decisions are keyed by (request, step)
    assert replayed == recorded
    replay.check_complete()
    loaded = TraceRecorder.load(path)
    assert loaded.decisions == rec.decisions and loaded.meta == rec.meta


def test_replay_divergence_raises():
    rec = TraceRecorder()
    rec.record(1, 0, [3, 4])
    rec.record(2, 0, [])
    replay = ReplayPolicy(rec)
    view = replay.view(0, 1, np.array([0, 1, 2, 4, 5]))  # 3 is not live: the run diverged
    with pytest.raises(ReplayDivergenceError, match=r"not live.*\[3\]|\[3\] not live"):
        replay.select_victims(view)
    assert replay.select_victims(replay.view(0, 1, np.arange(6))).tolist() == [3, 4]
    with pytest.raises(ReplayDivergenceError, match="no|none left"):
        replay.select_victims(replay.view(0, 1, np.arange(6)))  # the same question twice
    with pytest.raises(ReplayDivergenceError, match="1 left"):
        replay.check_complete()
    assert replay.select_victims(replay.view(0, 2, np.arange(6))).size == 0
    replay.check_complete()
    lenient = ReplayPolicy(rec, strict=False)
    assert lenient.select_victims(lenient.view(9, 9, np.arange(3))).size == 0


def test_trace_rejects_bad_input(tmp_path):
    rec = TraceRecorder()
    rec.record(0, (1, 2), [1])  # a tuple id is fine in memory ...
    with pytest.raises(InvalidTypeError, match="request_id"):
        rec.save(tmp_path / "t.json")  # ... not in JSON, and nothing is written
    assert not (tmp_path / "t.json").exists()
    with pytest.raises(InvalidArgumentError, match="format"):
        TraceRecorder.from_json({"decisions": []})
    with pytest.raises(InvalidArgumentError, match=r"decisions\[0\]"):
        TraceRecorder.from_json({"format": TraceRecorder.FORMAT, "version": 1, "decisions": [{"step": 1}]})
    with pytest.raises(InvalidArgumentError, match="policy"):
        TraceRecorder().select_victims(P.get("h2o").view(0, 0, np.arange(3)))


# --------------------------------------------------------------------------- registry, config, budgets


def test_registry_lists_every_policy():
    assert P.available() == NAMES
    for name in NAMES:
        p = P.get(name)  # sensible defaults: no config needed
        assert p.name == name and isinstance(p, P.EvictionPolicy)
        assert P.get(name, **p.config()).config() == p.config()
        assert P.get(name.upper()).name == name


def test_register_a_new_policy():
    from dataclasses import dataclass

    @P.register("oldest_first_test")
    @dataclass
    class OldestFirst(P.EvictionPolicy):
        def choose(self, view, candidates, n):
            return candidates[:n]

    try:
        assert "oldest_first_test" in P.available()
        p = sinkless("oldest_first_test", budget=3, window=1)
        assert p.select_victims(p.view(0, 0, np.arange(5))).tolist() == [0, 1]
        with pytest.raises(InvalidArgumentError, match="already registered"):
            P.register("oldest_first_test")(type("Other", (OldestFirst,), {}))
    finally:
        policy_base._REGISTRY.pop("oldest_first_test", None)


@pytest.mark.parametrize(
    "name,cfg,err,match",
    [
        ("h2o", {"budget": 0.0}, InvalidArgumentError, r"ratio: expected a float in \(0, 1\), got 0.0"),
        ("h2o", {"budget": 1.0}, InvalidArgumentError, r"ratio: expected a float in \(0, 1\)"),
        ("tova", {"budget": 1.5}, InvalidArgumentError, r"ratio: expected a float in \(0, 1\)"),
        ("random", {"budget": -0.2}, InvalidArgumentError, r"ratio"),
        ("h2o", {"budget": {"ratio": 2.0}}, InvalidArgumentError, r"ratio"),
        ("h2o", {"budget": 0}, InvalidArgumentError, r"cap: expected an int >= 1, got 0"),
        ("h2o", {"budget": True}, InvalidTypeError, r"budget"),
        ("h2o", {"budget": "0.5"}, InvalidTypeError, r"budget"),
        ("h2o", {"budget": {"max": 3}}, InvalidArgumentError, r"'ratio' and/or 'cap'"),
        ("h2o", {"window": -1}, InvalidArgumentError, r"h2o.window: expected an int >= 0, got -1"),
        ("streamingllm", {"window": -4}, InvalidArgumentError, r"window"),
        ("streamingllm", {"sink": -1}, InvalidArgumentError, r"sink"),
        ("streamingllm", {"sink": 0, "window": 0}, InvalidArgumentError, r"budget"),
        ("snapkv", {"window": 2.5}, InvalidTypeError, r"window: expected an int"),
        ("scissorhands", {"history": 0}, InvalidArgumentError, r"history: expected an int >= 1"),
        ("snapkv", {"kernel": 4}, InvalidArgumentError, r"kernel: expected an odd size"),
        ("snapkv", {"pooling": "sum"}, InvalidArgumentError, r"pooling"),
        ("random", {"seed": -3}, InvalidArgumentError, r"seed"),
        ("h2o", {"recent": 3}, InvalidArgumentError, r"unknown \['recent'\]"),
        ("lru", {}, InvalidArgumentError, r"policy: expected one of \['h2o'.*got 'lru'"),
    ],
)
def test_bad_config_raises_clear_typed_errors(name, cfg, err, match):
    with pytest.raises(err, match=match):
        P.get(name, **cfg)
    assert issubclass(err, VTokenError)


def test_get_rejects_non_string_name():
    with pytest.raises(InvalidTypeError, match="policy"):
        P.get(3)


@pytest.mark.parametrize(
    "budget,length,expected",
    [(Budget(ratio=0.25), 10, 2), (Budget(ratio=0.29), 100, 29), (Budget(ratio=0.5), 0, 0),
     (Budget(cap=4), 10, 4), (Budget(cap=40), 10, 10), (Budget(0.5, 30), 100, 30), (Budget(0.5, 30), 41, 20)],
)
def test_budget_resolve(budget, length, expected):
    assert budget.resolve(length) == expected


def test_budget_of():
    assert Budget.of(0.3) == Budget(ratio=0.3) and Budget.of(12) == Budget(cap=12)
    assert Budget.of(np.float32(0.5)) == Budget(ratio=0.5) and Budget.of({"cap": 3}) == Budget(cap=3)
    with pytest.raises(InvalidArgumentError, match="neither"):
        Budget()


# --------------------------------------------------------------------------- the view


def test_view_contents_and_validation():
    p = sinkless("h2o", budget=0.5)
    v = p.view("r", 3, [0, 2, 5, 6], seq_len=8, num_new=1)
    assert v.budget == 4 and v.live_count == 4 and v.positions is v.token_ids and v.token_ids.dtype == np.int64
    assert not hasattr(v, "block_ids") and "block" not in " ".join(f for f in PolicyView.__dataclass_fields__)
    with pytest.raises(InvalidArgumentError, match="strictly increasing"):
        p.view("r", 0, [0, 3, 2])
    with pytest.raises(InvalidArgumentError, match="strictly increasing"):
        p.view("r", 0, [1, 1, 2])
    with pytest.raises(InvalidArgumentError, match="non-negative|strictly"):
        p.view("r", 0, [-1, 2])
    with pytest.raises(InvalidArgumentError, match="seq_len: expected an int >= 7"):
        p.view("r", 0, [0, 6], seq_len=5)
    with pytest.raises(InvalidTypeError, match="integer"):
        p.view("r", 0, np.array([0.0, 1.0]))
    with pytest.raises(InvalidArgumentError, match="step"):
        p.view("r", -1, [0])
    with pytest.raises(InvalidArgumentError, match=r"window_scores: expected shape \[3\]"):
        p.view("r", 0, [0, 1, 2], window_scores=np.ones(4))
    with pytest.raises(InvalidArgumentError, match="view.scores: expected a ScoreAccumulator"):
        p.select_victims(p.view("r", 0, np.arange(100)))
    with pytest.raises(InvalidTypeError, match="PolicyView"):
        p.select_victims(np.arange(4))
    with pytest.raises(InvalidArgumentError, match=r"scores.history: expected 64"):
        sc = sinkless("scissorhands", budget=2, window=0)
        sc.select_victims(sc.view(0, 0, np.arange(5), scores=ScoreAccumulator(history=3)))


def test_empty_view():
    for name in NAMES:
        p = P.get(name)
        assert p.select_victims(p.view(0, 0, np.zeros(0, np.int64), scores=p.make_accumulator())).size == 0


# --------------------------------------------------------------------------- score sources


def test_accumulator_sums_steps_heads_and_tracks_last():
    acc = ScoreAccumulator()
    acc.update([0, 1, 2], np.array([[0.2, 0.1], [0.3, 0.3], [0.5, 0.6]]))
    second = torch.tensor([[0.1, 0.1], [0.2, 0.2], [0.7, 0.7]], dtype=torch.bfloat16)
    acc.update([0, 2, 3], second)
    s2 = second.double().sum(1).numpy()  # bf16 values, summed over kv heads
    np.testing.assert_array_equal(acc.accumulated([0, 1, 2, 3, 99]), [0.3 + s2[0], 0.6, 1.1 + s2[1], s2[2], 0.0])
    np.testing.assert_array_equal(acc.last([0, 1, 2, 3, 99]), [s2[0], 0.0, s2[1], s2[2], 0.0])
    assert acc.steps == 2 and acc.history == 0


def test_accumulator_grows_amortized():
    acc = ScoreAccumulator(history=4)
    caps = set()
    for t in range(1, 3000, 7):
        ids = np.arange(max(0, t - 50), t)
        acc.update(ids, np.full(ids.size, 1.0))
        caps.add(acc.capacity)
    assert len(caps) <= 8 and acc.capacity >= 2994  # doubling: a handful of reallocations
    assert acc.seen_counts([2950, 2996]).tolist() == [4, 1] and acc.low_counts([2950]).tolist() == [0]
    assert acc.nbytes < 30 * acc.capacity


def test_accumulator_low_fraction_ring():
    acc = ScoreAccumulator(history=2)
    acc.update([0, 1, 2], np.array([0.1, 0.8, 0.1]))  # low: 0, 2 (below 1/3)
    acc.update([0, 1, 2, 3], np.array([0.1, 0.1, 0.7, 0.1]))  # low: 0, 1, 3 (below 1/4)
    assert acc.low_counts([0, 1, 2, 3]).tolist() == [2, 1, 1, 1]
    assert acc.seen_counts([0, 1, 2, 3]).tolist() == [2, 2, 2, 1]
    acc.update([0, 1, 3], np.array([0.5, 0.4, 0.1]))  # 2 evicted; low: 3; the first step leaves the ring
    assert acc.low_counts([0, 1, 3]).tolist() == [1, 1, 2]
    np.testing.assert_allclose(acc.low_fraction([0, 1, 3, 7]), [0.5, 0.5, 1.0, 0.0])


def test_accumulator_rejects_bad_input_unchanged():
    acc = ScoreAccumulator(history=2)
    acc.update([0, 1, 2], np.array([0.2, 0.3, 0.5]))
    before = (acc._acc.copy(), acc._low.copy(), acc.steps, len(acc._ring))
    bad = [
        ([0, 1, 2], np.ones(4), InvalidArgumentError, "expected 3 rows"),
        ([0, 2, 1], np.ones(3), InvalidArgumentError, "strictly increasing"),
        ([0, 1, 2], np.array([0.1, np.nan, 0.2]), InvalidArgumentError, "finite"),
        ([0, 1, 2], np.array([0.1, -0.5, 0.2]), InvalidArgumentError, "non-negative"),
        ([0, 1, 2], np.ones((3, 2, 2)), InvalidTypeError, "shape"),
        ([0, 1, 2], np.array([True, False, True]), InvalidTypeError, "real-valued"),
        ([0, 1, 2], torch.ones(3, dtype=torch.int32), InvalidTypeError, "floating"),
    ]
    for ids, scores, err, match in bad:
        with pytest.raises(err, match=match):
            acc.update(ids, scores)
    after = (acc._acc, acc._low, acc.steps, len(acc._ring))
    assert np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1]) and before[2:] == after[2:]


def test_accumulate_batch_slices_rows_by_indptr():
    rng = np.random.default_rng(4)
    lives = [np.array([0, 3, 4]), np.array([1, 2]), np.arange(5)]
    indptr = torch.tensor([0, 3, 5, 10, 10], dtype=torch.int32)
    ks = torch.from_numpy(rng.random((12, 2)).astype(np.float32))  # nnz_max 12 > 10 used rows
    batch = [ScoreAccumulator(), None, ScoreAccumulator()]
    accumulate_batch(batch, lives, ks, indptr)
    solo = ScoreAccumulator()
    solo.update(lives[2], ks[5:10])
    np.testing.assert_array_equal(batch[2].accumulated(lives[2]), solo.accumulated(lives[2]))
    np.testing.assert_allclose(batch[0].accumulated(lives[0]), ks[0:3].double().sum(1).numpy())
    with pytest.raises(InvalidArgumentError, match="kv_indptr"):
        accumulate_batch(batch, lives, ks, np.array([0, 3, 2, 10]))
    with pytest.raises(InvalidArgumentError, match="kv_indptr"):
        accumulate_batch(batch, lives, ks, np.array([0, 3, 5, 13]))
    with pytest.raises(InvalidArgumentError, match="one array per accumulator"):
        accumulate_batch(batch, lives[:2], ks, indptr)


@pytest.mark.parametrize("w,n,hq,hkv,d", [(1, 1, 1, 1, 8), (3, 17, 8, 2, 16), (5, 31, 6, 3, 8), (4, 9, 4, 4, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_key_scores_against_loops(w, n, hq, hkv, d, dtype):
    g = torch.Generator().manual_seed(n * 7 + w)
    q = torch.randn(w, hq, d, generator=g).to(dtype)
    k = torch.randn(n, hkv, d, generator=g).to(dtype)
    key_ids = np.sort(np.random.default_rng(n).choice(4 * n, size=n, replace=False))
    got = window_key_scores(q, k, key_ids=key_ids)
    expect = torch.zeros(n, hkv, dtype=torch.float64)
    for i in range(w):
        qpos = key_ids[n - w + i]
        for h in range(hq):
            logits = [float(q[i, h].double() @ k[j, h // (hq // hkv)].double()) / math.sqrt(d) for j in range(n)]
            vis = [j for j in range(n) if key_ids[j] <= qpos]
            m = max(logits[j] for j in vis)
            z = sum(math.exp(logits[j] - m) for j in vis)
            for j in vis:
                expect[j, h // (hq // hkv)] += math.exp(logits[j] - m) / z
    assert got.dtype == torch.float32 and got.shape == (n, hkv)
    # float32 softmax of float32-upcast inputs vs float64 loops: a few ulps of float32
    torch.testing.assert_close(got.double(), expect, rtol=1e-5, atol=1e-6)
    assert abs(float(got.sum()) - w * hq) < 1e-4


def test_window_key_scores_explicit_query_ids_and_errors():
    q, k = torch.randn(2, 4, 8), torch.randn(6, 2, 8)
    s = window_key_scores(q, k, query_ids=torch.tensor([0, 5]))
    only_last = window_key_scores(q[1:], k, query_ids=[5])
    first = s - only_last  # query 0 sees key 0 only: all of its 4 heads' mass lands there
    torch.testing.assert_close(first[0].sum(), torch.tensor(4.0))
    torch.testing.assert_close(first[1:], torch.zeros(5, 2), atol=1e-6, rtol=0)
    with pytest.raises(InvalidArgumentError, match="multiple of num_kv_heads"):
        window_key_scores(torch.randn(2, 3, 8), k)
    with pytest.raises(InvalidTypeError, match="head_dim"):
        window_key_scores(torch.randn(2, 4, 4), k)
    with pytest.raises(InvalidArgumentError, match="at most 6 queries"):
        window_key_scores(torch.randn(7, 4, 8), k)
    with pytest.raises(InvalidArgumentError, match="at least one key"):
        window_key_scores(q, k, key_ids=np.arange(10, 16), query_ids=[3, 12])
    with pytest.raises(InvalidTypeError, match="torch.Tensor"):
        window_key_scores(np.zeros((2, 4, 8)), k)


def test_window_scorer_feeds_the_accumulator_like_exact_scores():
    """An engine without probabilities: the step's query through window_key_scores == exact key scores."""
    hq, hkv, d = 4, 2, 16
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, hq, d, generator=g), torch.randn(9, hkv, d, generator=g)
    logits = torch.einsum("hd,nkd->hnk", q[0].double(), k.double())[:, :, :].numpy() / math.sqrt(d)
    probs = np.stack([np.exp(logits[h, :, h // 2]) / np.exp(logits[h, :, h // 2]).sum() for h in range(hq)])
    exact = key_scores(probs[:, None, :], hkv)
    a, b = ScoreAccumulator(), ScoreAccumulator()
    a.update(np.arange(9), exact)
    b.update(np.arange(9), window_key_scores(q, k))
    np.testing.assert_allclose(a.accumulated(np.arange(9)), b.accumulated(np.arange(9)), rtol=1e-5)


def test_exact_scores_accept_torch_tensors():
    logits = make_logits(1, 4)
    p = sinkless("h2o", budget=0.3, window=2)
    assert run_policy(p, logits, 2, torch_scores=True) == run_policy(p, logits, 2)


# --------------------------------------------------------------------------- files and docs


def code_lines(path: pathlib.Path) -> int:
    """Non-blank, non-comment lines outside the module docstring."""
    src = path.read_text()
    tree = ast.parse(src)
    start = 0
    if tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(getattr(tree.body[0], "value", None),
                                                                           ast.Constant):
        start = tree.body[0].end_lineno
    return sum(1 for line in src.splitlines()[start:] if line.strip() and not line.strip().startswith("#"))


@pytest.mark.parametrize("name", NAMES)
def test_policy_file_is_small_and_documented(name):
    path = POLICY_FILES[name]
    assert code_lines(path) < 50, f"{path.name}: {code_lines(path)} lines"
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and "Definition." in doc and "https://" in doc
    if name != "random":
        assert "arxiv.org/abs/" in doc


def test_code_lines_counter(tmp_path):
    path = tmp_path / "p.py"
    path.write_text('"""Doc.\n\nmore doc\n"""\n# comment\nimport os\n\n\nx = 1  # trailing\n')
    assert code_lines(path) == 2


def imported_modules(path: pathlib.Path) -> set:
    """Every module (and ``module.name``) a file imports, at top level or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import of {node.module!r}"  # absolute imports only
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


@pytest.mark.parametrize("name", ["scores", "ids"])
def test_score_and_id_modules_do_not_import_the_policy_contract(name):
    """base imports scores and ids; neither may import base back (no import cycle, not even a lazy one)."""
    mods = imported_modules(POLICY_DIR / f"{name}.py")
    assert not {m for m in mods if m == "vtoken.policies" or m.startswith("vtoken.policies.base")}, mods
    if name == "scores":
        assert "vtoken.policies.ids.check_live_ids" in mods
    assert "vtoken.policies.scores.ScoreAccumulator" in imported_modules(POLICY_DIR / "base.py")


@pytest.mark.parametrize("module", [policy_base, policy_scores] + [getattr(P, n) for n in NAMES])
def test_docstring_examples_run(module):
    failures, tried = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert failures == 0
    if module in (policy_base, policy_scores, P.h2o, P.streamingllm):
        assert tried > 0


# --------------------------------------------------------------------------- contract with token_attention


@pytest.mark.parametrize("prefill", [False, True])
def test_token_attention_key_scores_feed_the_accumulator(prefill):
    """token_attention's key_scores (torch reference) == the window scorer on the same live keys."""
    ref = pytest.importorskip("vtoken.reference.token_attention")
    from vtoken.layout import KVLayout, kv_cache_shape

    hq, hkv, d, bs, nb = 4, 2, 16, 4, 8
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(kv_cache_shape("nhd", nb, bs, hkv, d), generator=g)
    layout = KVLayout.from_tensor(cache, "nhd")
    slots = torch.randperm(nb * bs, generator=g)
    lives = [np.array([0, 2, 3, 5, 7, 8]), np.array([1, 4, 6])]  # live ids (holes = evicted tokens)
    per_req = [slots[:6], slots[6:9]]
    n_new = [3, 1] if prefill else [1, 1]
    kv_indices = torch.cat(per_req + [torch.full((5,), -1)]).to(torch.int32)  # PAD tail past kv_indptr[-1]
    kv_indptr = torch.tensor([0, 6, 9], dtype=torch.int32)
    q_indptr = torch.tensor([0, n_new[0], n_new[0] + n_new[1]], dtype=torch.int32) if prefill else None
    q = torch.randn(sum(n_new), hq, d, generator=g)
    _, ks = ref.token_attention(q, cache, layout, kv_indices, kv_indptr, q_indptr, return_key_scores=True)
    accs = [ScoreAccumulator(), ScoreAccumulator()]
    accumulate_batch(accs, lives, ks, kv_indptr)
    q_off = 0
    for r, (ids, sl) in enumerate(zip(lives, per_req)):
        keys = cache[sl // bs, 0, sl % bs]  # [n_live, hkv, d]
        win = window_key_scores(q[q_off: q_off + n_new[r]], keys, key_ids=ids)
        q_off += n_new[r]
        torch.testing.assert_close(ks[int(kv_indptr[r]): int(kv_indptr[r + 1])], win, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(accs[r].accumulated(ids), win.double().sum(1).numpy(), rtol=1e-5)
