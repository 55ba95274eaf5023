"""The device decision loop (vtoken.decisions.loop) against the host numpy path, exactly, through real tables.

Two token tables run the same workload side by side: table A is driven by
:class:`DecisionLoop` (device state, device kills, victims applied one step
late through the ring), table B by the numpy policy per request (the oracle,
applied at once). Every step both see the same key masses. Checked:

* after A's drain, A and B hold exactly the same live tokens (ids and slots);
* right after ``decide``, A's device mirror already has exactly B's alive bits
  (the kill is on the device at once; only the host is a step late);
* the device's per-block live counts equal ``block_live_counts`` recomputed
  from the host ledger's union rule, and every block the device reports
  emptied is free on the host or a kept tail block;
* ring overflow defers victims (never loses one) and grows the ring;
* a step run over an entry bucket (views ``[:bucket]``) equals the same step
  over the whole ``nnz_max`` buffers bit for bit.

The pairs here use a small first bucket (8), so the steps' entry counts cross
several buckets, all below ``nnz_max``.
"""
import numpy as np
import pytest
import torch

from vtoken import policies as P
from vtoken.device.buffers import DeviceMirror, SlotListBuffers
from vtoken.decisions.loop import DecisionLoop
from vtoken.errors import InvalidArgumentError, InvariantViolation
from vtoken.bookkeeping.ledger import BlockLedger
from vtoken.bookkeeping.pool import BlockPool
from vtoken.device.step_graphs import StepGraphs, entry_buckets, padded_batch_sizes
from vtoken.bookkeeping.table import TokenTable

torch.set_num_threads(1)

S, NB = 4, 512

CONFIGS = [
    ("streamingllm", {"sink": 2, "window": 4, "budget": None}),
    ("h2o", {"budget": 0.5, "window": 3, "sink": 1}),
    ("h2o", {"budget": 9, "window": 2}),
    ("tova", {"budget": 0.6, "window": 2}),
    ("scissorhands", {"budget": 0.5, "window": 2, "history": 4}),
    ("snapkv", {"budget": 10, "window": 3}),
    ("random", {"budget": 0.5, "window": 2, "seed": 7}),
    # prefill compression: one decision when the prompt completes, none after
    ("h2o", {"budget": 0.5, "window": 3, "at": "prefill"}),
    ("tova", {"budget": 0.5, "window": 2, "sink": 1, "at": "prefill"}),
    ("streamingllm", {"budget": 0.5, "window": 2, "at": "prefill"}),
]


def _masses(rng, n, coarse):
    step = 1 / 8 if coarse else 2.0 ** -12  # exact float64 sums in any order (see test_device_policies)
    return (rng.integers(0, int(1 / step), size=n) * step).astype(np.float32)


class Pair:
    """Table A (device loop) and table B (numpy oracle) under one workload."""

    def __init__(self, policy, num_reqs, rng, *, victim_capacity=4096, min_entry_bucket=8):
        self.policy, self.rng = policy, rng
        self.a = TokenTable(BlockLedger(BlockPool(NB), block_size=S))
        self.b = TokenTable(BlockLedger(BlockPool(NB), block_size=S))
        self.mirror = DeviceMirror(self.a, "cpu", initial_tokens=64, min_slack=4)
        self.bufs = SlotListBuffers(max_reqs=num_reqs, nnz_max=NB * S, max_tokens=4096)
        self.loop = DecisionLoop(policy, self.mirror, num_blocks=NB, block_size=S, max_reqs=num_reqs,
                                 victim_capacity=victim_capacity, min_entry_bucket=min_entry_bucket)
        self.accs = {r: policy.make_accumulator() for r in range(num_reqs)}
        for r in range(num_reqs):
            self.a.add_request(r)
            self.b.add_request(r)

    def step(self, order, new, coarse):
        self.loop.drain()
        self.check_same_live(order)
        counts = np.array([new[r] for r in order])
        assert self.a.sync_new_tokens_batch(order, counts) is not None
        assert self.b.sync_new_tokens_batch(order, counts) is not None
        self.mirror.build(self.bufs, order, counts)
        nnz = int(self.bufs.kv_indptr_host[len(order)])
        indptr = self.bufs.kv_indptr[: len(order) + 1].numpy()
        votes = self.policy.score_source == "window"
        prompt_step = self.loop.steps == 0  # the first step is every request's whole prompt
        window_step = votes and prompt_step
        mass = _masses(self.rng, nnz, coarse)
        kv_pos = self.bufs.kv_pos[:nnz].numpy().astype(np.int64)
        if self.policy.score_source == "exact":
            mp = np.repeat(self.bufs.mirror_starts[: len(order)].numpy(), np.diff(indptr)) + kv_pos
            self.loop.token_mass[torch.from_numpy(mp)] += torch.from_numpy(mass)
        ws = None
        if window_step:
            ws = torch.zeros(self.bufs.nnz_max, 2)
            ws[:nnz, 0] = torch.from_numpy(mass)
            ws[:nnz, 1] = torch.from_numpy(mass[::-1].copy())
        seq_lens = np.array([self.b.num_tokens(r) for r in order])
        self.loop.decide(order, self.bufs, seq_lens=seq_lens, num_new=counts,
                         prompt_done=np.full(len(order), prompt_step), window_scores=ws)
        evicted = 0
        for i, r in enumerate(order):
            ids = self.b.live_ids(r)
            assert np.array_equal(ids, kv_pos[indptr[i]: indptr[i + 1]])
            if self.accs[r] is not None:
                self.accs[r].update(ids, mass[indptr[i]: indptr[i + 1]])
            decides, num_new = self.policy.decision_plan(counts[i: i + 1], [prompt_step])
            if not decides[0]:
                continue
            w = ws[indptr[i]: indptr[i + 1]].numpy() if window_step else None
            view = self.policy.view(r, int(seq_lens[i]), ids, seq_len=int(seq_lens[i]),
                                    num_new=int(num_new[0]), scores=self.accs[r], window_scores=w)
            victims = self.policy.select_victims(view)
            if len(victims):
                self.b.evict(r, victims)
                evicted += len(victims)
        self.check_device_alive(order)
        self.check_block_counts()
        return evicted

    def check_same_live(self, order):
        for r in range(len(self.accs)):
            assert np.array_equal(self.a.live_ids(r), self.b.live_ids(r)), r
        assert self.a.ledger.num_allocated == self.b.ledger.num_allocated

    def check_device_alive(self, order):
        for r in order:
            _, alive = self.mirror.host_copy(r)
            assert np.array_equal(np.flatnonzero(alive), self.b.live_ids(r)), r

    def check_block_counts(self):
        # The device count of a block: distinct live slots in it over every request (the union rule).
        expect = np.zeros(NB, np.int64)
        for r in self.b.requests():
            slots = np.unique(self.a.slots(r)[self.b.live_mask(r)])
            np.add.at(expect, slots // S, 1)
        assert self.loop.block_live[:NB].tolist() == expect.tolist()


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("name,cfg", CONFIGS, ids=[n for n, _ in CONFIGS])
def test_device_loop_equals_the_host_path_one_step_late(name, cfg, seed):
    rng = np.random.default_rng(seed)
    policy = P.get(name, **cfg)
    n = int(rng.integers(2, 6))
    pair = Pair(policy, n, rng)
    evicted = 0
    for step in range(12):
        order = [int(r) for r in rng.permutation(n)]
        new = {r: int(rng.integers(5, 30)) if step == 0 else 1 for r in order}
        evicted += pair.step(order, new, coarse=bool(step % 2))
    pair.loop.drain_all()
    pair.check_same_live(order)
    assert evicted > 0 and pair.loop.num_applied == evicted
    pair.a.check_invariants()
    pair.loop.check_mirror()


def test_emptied_blocks_are_the_naive_frees():
    rng = np.random.default_rng(3)
    policy = P.get("streamingllm", sink=0, window=2, budget=None)
    pair = Pair(policy, 2, rng)
    pair.step([0, 1], {0: 20, 1: 9}, coarse=True)  # a prefill protects its own tokens
    pair.loop.drain()
    pair.a.sync_new_tokens_batch([0, 1], [1, 1])
    pair.mirror.build(pair.bufs, [0, 1], [1, 1])
    pair.loop.decide([0, 1], pair.bufs, seq_lens=np.array([21, 10]), num_new=np.ones(2, dtype=np.int64))  # all but 2 of each go
    rec = pair.loop.ring.next_ready()
    freed_before = pair.a.ledger.num_free
    pair.loop._apply_record(rec)
    pair.loop.ring.release()
    assert rec.emptied_blocks.size > 0
    assert pair.a.ledger.num_free - freed_before == rec.emptied_blocks.size  # none is a tail here
    assert (pair.a.ledger.live[rec.emptied_blocks] == 0).all()


def test_ring_overflow_defers_victims_and_grows():
    rng = np.random.default_rng(4)
    policy = P.get("streamingllm", sink=1, window=2, budget=None)
    pair = Pair(policy, 3, rng, victim_capacity=5)
    pair.loop.drain()
    for r in range(3):
        pair.a.sync_new_tokens(r, 12)
    pair.mirror.build(pair.bufs, [0, 1, 2], [12, 12, 12])
    pair.loop.decide([0, 1, 2], pair.bufs, seq_lens=np.full(3, 12), num_new=np.ones(3, dtype=np.int64))  # 9 victims each
    applied = pair.loop.drain()
    assert sum(r.num_victims for r in applied) == 5  # the record's capacity
    assert pair.loop.num_deferred == 3 * 9 - 5 and pair.loop.ring.victim_capacity >= 27
    # the deferred victims are still alive on both sides, and the next step takes them
    pair.mirror.build(pair.bufs, [0, 1, 2], [0, 0, 0])
    pair.loop.decide([0, 1, 2], pair.bufs, seq_lens=np.full(3, 12), num_new=np.zeros(3, dtype=np.int64))
    pair.loop.drain()
    assert [pair.a.live_count(r) for r in range(3)] == [3, 3, 3]
    pair.loop.check_mirror()


def test_records_of_finished_or_reregistered_requests_are_skipped():
    rng = np.random.default_rng(5)
    pair = Pair(P.get("streamingllm", sink=0, window=2, budget=None), 2, rng)
    pair.a.sync_new_tokens_batch([0, 1], [6, 6])
    pair.mirror.build(pair.bufs, [0, 1], [6, 6])
    pair.loop.decide([0, 1], pair.bufs, seq_lens=np.full(2, 6), num_new=np.ones(2, dtype=np.int64))
    pair.a.finish(0)
    pair.a.add_request(0)  # same id, a new registration
    applied = pair.loop.drain()
    (rec,) = applied
    # both decisions are reported (the device did drop request 0's victims), only request 1's applied
    assert rec.reqs == [0, 1] and rec.applied.tolist() == [False, True] and rec.counts.tolist() == [4, 4]
    assert pair.a.live_count(0) == 0 and pair.a.live_count(1) == 2 and pair.loop.num_applied == 4
    pair.a.check_invariants()


DEFER_CONFIGS = [c for c in CONFIGS if c[0] != "snapkv"]


@pytest.mark.parametrize("name,cfg", DEFER_CONFIGS, ids=[n for n, _ in DEFER_CONFIGS])
def test_a_deferred_chunked_prompt_decides_as_one_unchunked_prefill(name, cfg):
    """Prompt chunks with ``defer`` evict nothing and fold their masses: decisions equal an unchunked prefill's."""
    rng = np.random.default_rng(11)
    prompt, chunks = 23, {0: [8, 8, 7], 1: [5, 10, 8]}  # two chunkings in one batch
    runs = []
    for chunked in (False, True):
        table = TokenTable(BlockLedger(BlockPool(NB), block_size=S))
        mirror = DeviceMirror(table, "cpu", initial_tokens=64, min_slack=4)
        bufs = SlotListBuffers(max_reqs=2, nnz_max=NB * S, max_tokens=4096)
        loop = DecisionLoop(P.get(name, **cfg), mirror, num_blocks=NB, block_size=S, max_reqs=2)
        for r in (0, 1):
            table.add_request(r)
        runs.append((table, mirror, bufs, loop))
    # Per (request, key), the mass each chunk's queries give; they reach only the keys computed by
    # then (causal), so zero past those. Exact in float32 whatever the summation order.
    ends = {r: np.cumsum(chunks[r]) for r in (0, 1)}
    parts = {r: [np.where(np.arange(prompt) < e, _masses(rng, prompt, True), 0).astype(np.float32) for e in ends[r]]
             for r in (0, 1)}

    def step(run, counts, masses, num_new, defer, prompt_done=(False, False)):
        table, mirror, bufs, loop = run
        loop.drain()
        assert table.sync_new_tokens_batch([0, 1], counts) is not None
        mirror.build(bufs, [0, 1], counts)
        indptr = bufs.kv_indptr_host[:3]
        for i in (0, 1):
            lo, hi = int(indptr[i]), int(indptr[i + 1])
            mp = int(bufs.mirror_starts[i]) + bufs.kv_pos[lo:hi].to(torch.int64)
            if loop.token_mass is not None:
                loop.token_mass[mp] += torch.from_numpy(masses[i][: hi - lo])
        seq = np.array([table.num_tokens(r) for r in (0, 1)])
        loop.decide([0, 1], bufs, seq_lens=seq, num_new=np.asarray(num_new), defer=np.asarray(defer),
                    prompt_done=np.asarray(prompt_done))

    whole, chunked = runs
    step(whole, [prompt, prompt], [sum(parts[r]) for r in (0, 1)], [prompt, prompt], [False, False], [True, True])
    for k in range(3):
        last = k == 2
        counts = [chunks[r][k] for r in (0, 1)]
        masses = [parts[r][k][: ends[r][k]] for r in (0, 1)]
        step(chunked, counts, masses, [prompt if last else c for c in counts], [not last, not last], [last, last])
        if not last:
            chunked[3].drain_all()
            assert [chunked[0].live_count(r) for r in (0, 1)] == [ends[0][k], ends[1][k]]  # nothing evicted mid-prompt
    for t in range(6):  # decode steps: the same masses in both runs
        m = [_masses(rng, 64, bool(t % 2)) for _ in (0, 1)]
        for run in runs:
            n_live = [run[0].live_count(r) for r in (0, 1)]
            step(run, [1, 1], [m[0][: n_live[0] + 1], m[1][: n_live[1] + 1]], [1, 1], [False, False])
    for run in runs:
        run[3].drain_all()
    for r in (0, 1):
        assert np.array_equal(whole[0].live_ids(r), chunked[0].live_ids(r)), r
    assert whole[3].num_applied == chunked[3].num_applied > 0


def test_decide_rejects_bad_arguments_before_changing_anything():
    rng = np.random.default_rng(6)
    pair = Pair(P.get("h2o", budget=4, window=1), 2, rng)
    pair.a.sync_new_tokens_batch([0, 1], [3, 3])
    pair.mirror.build(pair.bufs, [0, 1], [3, 3])
    pair.loop.token_mass[:6] = 0.5
    before = (pair.loop.token_mass.clone(), pair.loop.state.accumulated.clone(), pair.mirror.alive.clone())
    bad = [
        (InvalidArgumentError, "reqs", dict(reqs=[0], seq_lens=[3], num_new=[3])),
        (InvalidArgumentError, "reqs", dict(reqs=[1, 0], seq_lens=[3, 3], num_new=[3, 3])),  # not the built order
        (InvalidArgumentError, "seq_lens", dict(reqs=[0, 1], seq_lens=[3], num_new=[3, 3])),
        (TypeError, "num_new", dict(reqs=[0, 1], seq_lens=[3, 3], num_new=[1.0, 1.0])),
        (InvalidArgumentError, "num_new", dict(reqs=[0, 1], seq_lens=[3, 3], num_new=[4, 1])),
        (InvalidArgumentError, "done", dict(reqs=[0, 1], seq_lens=[3, 3], num_new=[1, 1], done=[0, 1])),
        (InvalidArgumentError, "window_scores", dict(reqs=[0, 1], seq_lens=[3, 3], num_new=[1, 1],
                                                     window_scores=torch.zeros(pair.bufs.nnz_max, 2))),
    ]
    for err, arg, kw in bad:
        reqs = kw.pop("reqs")
        with pytest.raises(err, match=arg):
            pair.loop.decide(reqs, pair.bufs, **kw)
    after = (pair.loop.token_mass, pair.loop.state.accumulated, pair.mirror.alive)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert pair.loop.steps == 0 and pair.loop.ring.in_flight == 0


def test_snapkv_window_step_gets_a_record_for_all_its_victims():
    """SnapKV decides once (end of prefill): its victims are never deferred, whatever the ring's size."""
    rng = np.random.default_rng(8)
    pair = Pair(P.get("snapkv", budget=10, window=3), 2, rng, victim_capacity=5)
    pair.step([0, 1], {0: 40, 1: 45}, coarse=False)  # the window step: 30 + 35 victims
    pair.loop.drain()
    assert pair.loop.num_deferred == 0 and pair.loop.ring.victim_capacity >= 65
    assert [pair.a.live_count(r) for r in (0, 1)] == [10, 10]
    pair.check_same_live([0, 1])


@pytest.mark.parametrize("name", ["h2o", "tova", "streamingllm"])
def test_a_prefill_compression_gets_a_record_for_all_its_victims(name):
    """at="prefill" decides once: a full record cannot defer its victims to a step that will not decide."""
    rng = np.random.default_rng(10)
    pair = Pair(P.get(name, budget=0.25, window=3, at="prefill"), 2, rng, victim_capacity=5)
    pair.step([0, 1], {0: 40, 1: 44}, coarse=False)  # the prompt step: 27 + 30 victims
    pair.step([0, 1], {0: 1, 1: 1}, coarse=False)  # a decode step: decides nothing
    pair.loop.drain_all()
    assert pair.loop.num_deferred == 0 and pair.loop.ring.victim_capacity >= 57
    assert [pair.a.live_count(r) for r in (0, 1)] == [10 + 1, 11 + 1]
    pair.check_same_live([0, 1])


def test_a_record_that_fails_to_apply_stays_queued():
    rng = np.random.default_rng(9)
    pair = Pair(P.get("streamingllm", sink=0, window=2, budget=None), 1, rng)
    pair.a.sync_new_tokens_batch([0], [6])
    pair.mirror.build(pair.bufs, [0], [6])
    pair.loop.decide([0], pair.bufs, seq_lens=np.array([6]), num_new=np.ones(1, dtype=np.int64))
    pair.a.evict(0, [0])  # a direct host eviction of one of the device's victims: the record cannot apply
    with pytest.raises(InvalidArgumentError, match="already-evicted"):
        pair.loop.drain()
    assert pair.loop.ring.in_flight == 1 and pair.a.live_count(0) == 5  # nothing lost, nothing half-applied


class _ReplayOnCPU:
    """A CUDA graph's CPU stand-in: 'replay' re-runs the captured call (same padded size, same buffers)."""

    def __init__(self, fn):
        self.replay = fn


@pytest.mark.parametrize("name,cfg", [CONFIGS[1], CONFIGS[4], CONFIGS[6]], ids=["h2o", "scissorhands", "random"])
def test_padded_graph_steps_equal_eager_steps(name, cfg, monkeypatch):
    """The graph path's logic on CPU: every padded size captured at warm-up (and the warm-up changes nothing),
    serving replays, a re-layout drops the graphs and every size is captured again at once."""
    rng_a, rng_b = np.random.default_rng(11), np.random.default_rng(11)
    policy = P.get(name, **cfg)
    eager, graphed = Pair(policy, 5, rng_a), Pair(policy, 5, rng_b)
    loop = graphed.loop
    captured = []

    replayed = set()

    def capture(lp, sl, size, bucket):
        captured.append((size, bucket))

        def replay():
            replayed.add((size, bucket))
            lp._device_step(sl, size, bucket)
        return _ReplayOnCPU(replay)

    loop._graphs = StepGraphs(5, capture=capture, min_bucket=8)
    loop.cuda_graph = True
    with pytest.raises(InvalidArgumentError, match="warmup"):
        loop._graphs.run(loop, graphed.bufs, 3, 8)
    loop.warmup(graphed.bufs)
    pairs = [(size, b) for size in padded_batch_sizes(5) for b in entry_buckets(NB * S, 8)]
    assert padded_batch_sizes(5) == (1, 2, 4, 5) and entry_buckets(NB * S, 8) == (8, 16, 32, 64, 128, 256, 512,
                                                                                    1024, 2048)
    assert captured == pairs
    relayouts = graphed.mirror.relayouts
    for step in range(10):
        order = [int(r) for r in rng_a.permutation(5)][: 3 + step % 3]  # 3..5 requests: sizes (1, 2, 4, 5)
        rng_b.permutation(5)
        new = {r: 12 if step == 0 else 1 for r in range(5)}
        for pair in (eager, graphed):
            pair.step(order if step else list(range(5)), new, coarse=True)
        for r in range(5):
            assert np.array_equal(eager.a.live_ids(r), graphed.a.live_ids(r))
    assert loop._graphs.replays > 0 and graphed.mirror.relayouts > relayouts
    assert len({b for _, b in replayed}) > 1  # the steps' entries crossed buckets
    # Never one pair lazily: the warm-up, then whole sets again after the buffers moved.
    assert loop._graphs.recaptures > 0
    assert captured == pairs * (1 + loop._graphs.recaptures)
    loop._graphs._graphs.pop((5, 16))
    with pytest.raises(InvariantViolation, match=r"\(padded batch 5, entry bucket 16\) was not captured"):
        loop._graphs.run(loop, graphed.bufs, 5, 16)


BUCKET_CONFIGS = [CONFIGS[i] for i in (0, 1, 3, 4, 5, 6)]  # every policy once


@pytest.mark.parametrize("name,cfg", BUCKET_CONFIGS, ids=[n for n, _ in BUCKET_CONFIGS])
def test_a_step_over_its_entry_bucket_equals_the_step_over_nnz_max(name, cfg):
    """One workload twice: steps over views [:bucket] (ladder 8, 16, ...) and over the whole nnz_max (a
    one-rung ladder). Mask, counts, record, policy state, key masses, mirror and block counts are equal bit
    for bit, on a step whose entries are exactly a bucket (32) and on steps with padding inside the bucket."""
    rng_a, rng_b = np.random.default_rng(5), np.random.default_rng(5)
    bucketed = Pair(P.get(name, **cfg), 3, rng_a)
    full = Pair(P.get(name, **cfg), 3, rng_b, min_entry_bucket=NB * S)
    masks = {}
    for pair in (bucketed, full):
        inner = pair.loop.policy.select_victims_device

        def spy(state, batch, inner=inner, pair=pair):
            mask, counts = inner(state, batch)
            masks[id(pair)] = (batch.nnz_max, mask.clone(), counts.clone())
            return mask, counts
        pair.loop.policy.select_victims_device = spy
    exact = padded = 0
    for step in range(8):
        order = [int(r) for r in rng_a.permutation(3)]
        assert order == [int(r) for r in rng_b.permutation(3)]
        new = {0: 20, 1: 8, 2: 4} if step == 0 else {r: 1 for r in range(3)}  # the prompts: 32 entries
        for pair in (bucketed, full):
            pair.step(order, new, coarse=bool(step % 2))
        entries = int(bucketed.bufs.kv_indptr_host[3])
        bucket, mask_b, counts_b = masks[id(bucketed)]
        nnz, mask_f, counts_f = masks[id(full)]
        assert bucket == next(b for b in entry_buckets(NB * S, 8) if b >= entries) < nnz == NB * S
        exact, padded = exact + (entries == bucket), padded + (entries < bucket)
        assert torch.equal(mask_b, mask_f[:bucket]) and not mask_f[bucket:].any()
        assert torch.equal(counts_b, counts_f)
        la, lb = bucketed.loop, full.loop
        ra, rb = la.ring.peek()[-1], lb.ring.peek()[-1]
        for field in ("counts", "token_ids", "emptied_blocks"):
            assert np.array_equal(getattr(ra, field), getattr(rb, field)), field
        assert (ra.deferred, ra.emptied_overflow) == (rb.deferred, rb.emptied_overflow)
        cap = la.state.capacity
        assert cap == lb.state.capacity  # the trash slot past it is scratch: padding writes land there
        for buf, (a, b) in {k: (v, lb.state._buffers()[k]) for k, v in la.state._buffers().items()}.items():
            assert torch.equal(a[:cap], b[:cap]), buf
        if la.token_mass is not None:
            assert torch.equal(la.token_mass[:cap], lb.token_mass[:cap])
        assert torch.equal(bucketed.mirror.alive, full.mirror.alive)
        assert torch.equal(bucketed.mirror.slots, full.mirror.slots)
        assert torch.equal(la.block_live, lb.block_live) and torch.equal(la.waste_ratio, lb.waste_ratio)
    assert exact >= 1 and padded >= 1


# ------------------------------------------------------------------ bad input at decide / drain
def _decided_pair():
    """Two requests, a prompt step drained, and one decode token each synced and built (not yet decided)."""
    rng = np.random.default_rng(3)
    pair = Pair(P.get("streamingllm", sink=0, window=2, budget=None), 2, rng)
    pair.step([0, 1], {0: 20, 1: 9}, coarse=True)
    pair.loop.drain()
    pair.a.sync_new_tokens_batch([0, 1], [1, 1])
    pair.mirror.build(pair.bufs, [0, 1], [1, 1])
    return pair


def _loop_state(pair):
    return (pair.loop.steps, pair.a.snapshot(), pair.mirror.alive.clone(), pair.loop.ring.peek())


@pytest.mark.parametrize("seq_lens, match", [
    ([22, 10], r"seq_lens: expected each request's token count on the host table, got 22 for 0, which holds 21"),
    ([21, 9], r"seq_lens: expected each request's token count on the host table, got 9 for 1, which holds 10"),
])
def test_decide_with_seq_lens_off_the_host_counts_changes_nothing(seq_lens, match):
    from table_helpers import assert_same

    pair = _decided_pair()
    steps, snap, alive = pair.loop.steps, pair.a.snapshot(), pair.mirror.alive.clone()
    with pytest.raises(InvalidArgumentError, match=match):
        pair.loop.decide([0, 1], pair.bufs, seq_lens=np.array(seq_lens), num_new=np.ones(2, dtype=np.int64))
    assert pair.loop.steps == steps and pair.loop.ring.peek() == [] and torch.equal(alive, pair.mirror.alive)
    assert_same(snap, pair.a.snapshot())
    # the loop still works: the right lengths decide, and every later drain applies
    pair.loop.decide([0, 1], pair.bufs, seq_lens=np.array([21, 10]), num_new=np.ones(2, dtype=np.int64))
    assert sum(r.num_victims for r in pair.loop.drain_all()) > 0
    pair.a.check_invariants()


def test_decide_for_a_request_finished_since_the_build_changes_nothing():
    pair = _decided_pair()
    pair.a.finish(0)
    steps, alive = pair.loop.steps, pair.mirror.alive.clone()
    with pytest.raises(InvalidArgumentError, match=r"reqs: expected requests registered now .* got 0, finished since"):
        pair.loop.decide([0, 1], pair.bufs, seq_lens=np.array([21, 10]), num_new=np.ones(2, dtype=np.int64))
    assert pair.loop.steps == steps and pair.loop.ring.peek() == [] and torch.equal(alive, pair.mirror.alive)
    assert pair.loop.drain() == []


def test_blocks_reused_between_decide_and_drain_are_no_alarm_and_the_loop_keeps_draining(monkeypatch):
    """Debug checks on: a request finishes after its decision and a new one takes its blocks before the drain.
    The blocks the device saw emptied now hold the new request's live tokens rightly: no alarm, no jam."""
    monkeypatch.setenv("VTOKEN_DEBUG_INVARIANTS", "1")
    pair = _decided_pair()
    pair.loop.decide([0, 1], pair.bufs, seq_lens=np.array([21, 10]), num_new=np.ones(2, dtype=np.int64))
    freed = set(pair.a.block_list(0).tolist())
    pair.a.finish(0)
    pair.a.add_request(7)
    pair.a.sync_new_tokens(7, 40)
    assert freed & set(pair.a.block_list(7).tolist())  # the new request holds blocks the decision emptied
    applied = pair.loop.drain()
    assert [r.reqs for r in applied] == [[0, 1]] and applied[0].applied.tolist() == [False, True]
    assert pair.loop.drain() == [] and pair.loop.ring.peek() == []
    pair.a.check_invariants()


def _expected_block_live(table, pending):
    """Distinct live slots per block over every request of ``table`` (the union rule), less the
    device's kills the host has yet to apply (``pending``: {request: token ids})."""
    live = []
    for r in table.requests():
        mask = table.live_mask(r).copy()
        mask[pending.get(r, [])] = False
        live.append(table.slots(r)[mask])
    return np.bincount(np.unique(np.concatenate(live)) // S, minlength=NB)


def test_block_counts_follow_every_mirror_write_without_a_recount():
    """Appends, host evictions, device kills, moves, a shared prefix, a finish and re-layouts: the counts
    the loop maintains over the positions written equal a recount of the whole mirror at every step."""
    from vtoken.bookkeeping.ledger import DST_INFLIGHT

    t = TokenTable(BlockLedger(BlockPool(NB), block_size=S))
    mirror = DeviceMirror(t, "cpu", initial_tokens=16, min_slack=2)  # small: appends re-lay it out
    t.add_request("a")
    t.sync_new_tokens("a", 3 * S)  # before the loop: its first count comes from the mirror
    loop = DecisionLoop(P.get("streamingllm", sink=1, window=3, budget=6), mirror, num_blocks=NB, block_size=S,
                        max_reqs=3)
    bufs = SlotListBuffers(max_reqs=3, nnz_max=NB * S, max_tokens=64)
    t.add_request("b")
    t.add_request("c", prefix_blocks=t.block_list("a")[:2])  # shares a's first two blocks
    t.evict("a", [5])  # a's prefix block holds a dead token for "a" only: still live through "c"

    def check():
        mirror.sync()
        mirror.flush()
        loop.counts.check()
        assert loop.block_live[:NB].tolist() == _expected_block_live(t, loop.pending_victims()).tolist()

    relayouts = mirror.relayouts
    for step in range(6):
        loop.drain()
        reqs = [r for r in ("a", "b", "c") if r in t]
        new = np.array([5 if step == 0 else 1] * len(reqs))
        t.sync_new_tokens_batch(reqs, new)
        mirror.build(bufs, reqs, new)
        loop.decide(reqs, bufs, seq_lens=[t.num_tokens(r) for r in reqs], num_new=new)
        check()
        if step == 2:  # move the live tokens of b's first block into a fresh block
            loop.drain_all()  # the host's live tokens are the device's
            dst = t.ledger.allocate(1, t.row_of("b"), -1, state=DST_INFLIGHT, use_reserve=True)
            toks = t.live_ids("b")[t.live_slots("b") // S == t.block_list("b")[0]]
            t.relocation.apply_moves("b", toks, dst[0] * S + np.arange(len(toks)))
            check()
        if step == 3:
            t.finish("b")
            check()
    loop.drain_all()
    check()
    assert mirror.relayouts > relayouts and loop.num_applied > 0


@pytest.mark.debug_checks
def test_drifted_block_counts_are_caught():
    pair = Pair(P.get("streamingllm", sink=1, window=2, budget=4), 2, np.random.default_rng(0))
    pair.step([0, 1], {0: 8, 1: 8}, coarse=True)
    pair.loop.block_live[0] += 1
    with pytest.raises(InvariantViolation, match="block live counts drifted"):
        pair.step([0, 1], {0: 1, 1: 1}, coarse=True)
