"""The device eviction path (vtoken.policies.device) against the numpy oracles, exactly.

Every policy runs a randomized multi-step simulation: requests in a shuffled
batch order over shuffled mirror segments, appends of varied sizes, padding
past ``kv_indptr``, budgets as ratios and caps, sinks and windows that often
leave fewer candidates than the excess. Each step feeds the SAME key scores
to :class:`DevicePolicyState` and to one ``ScoreAccumulator`` per request,
then the device victims must equal ``select_victims(view)`` per request, id
for id, and the device state must equal the accumulator's.

NOTE (conversion): key scores are float32 multiples of 2**-12 below 1, so
every float64 sum of them is exact in any order; the device (torch) and the
oracle (numpy pairwise) then hold bit-identical accumulations, per-request
totals (Scissorhands' 1/n threshold) and pooled votes (SnapKV). Coarse
multiples of 1/8 in half the steps make ties frequent.
"""
import numpy as np
import pytest
import torch

from vtoken import policies as P
from vtoken.errors import InvalidArgumentError, InvalidTypeError
from vtoken.policies.base import lowest, request_seed
from vtoken.policies.counter_hash import fold32
from vtoken.policies.device import (
    DeviceBatch,
    DevicePolicyState,
    order_key,
    popcount64,
    resolve_budgets,
    select_victims,
)

torch.set_num_threads(1)

# The cuda cases carry the gpu mark: bench/gpu_check.sh runs them with the other GPU tests (-m gpu).
DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])
SEG = 256  # mirror segment per request
PAD_ROWS = 5  # packed entries past kv_indptr[num_reqs]

CONFIGS = [
    ("streamingllm", {"sink": 2, "window": 4, "budget": None}),
    ("streamingllm", {"sink": 0, "window": 3, "budget": 0.5}),
    ("h2o", {"budget": 0.4, "window": 3, "sink": 1}),
    ("h2o", {"budget": 7, "window": 6, "sink": 3}),
    ("h2o", {"budget": {"ratio": 0.6, "cap": 20}, "window": 0}),
    ("tova", {"budget": 9}),
    ("tova", {"budget": 0.5, "window": 2, "sink": 2}),
    ("scissorhands", {"budget": 0.5, "window": 2, "history": 3}),
    ("scissorhands", {"budget": 10, "window": 4, "sink": 1, "history": 64}),
    ("snapkv", {"budget": 12, "window": 4}),
    ("snapkv", {"budget": 0.5, "window": 2, "sink": 1, "kernel": 3, "pooling": "maxpool"}),
    ("snapkv", {"budget": 9, "window": 1, "kernel": 7}),
    ("random", {"budget": 0.5, "window": 2, "seed": 3}),
    ("random", {"budget": 6, "sink": 2, "window": 0, "seed": 2**40 + 5}),
]


def _scores(rng, shape, coarse):
    step = 1 / 8 if coarse else 2.0 ** -12
    return (rng.integers(0, int(1 / step), size=shape) * step).astype(np.float32)


class Sim:
    """A batch of requests that grow and lose victims step after step, with a mirror layout."""

    def __init__(self, policy, rng, num_reqs, device="cpu"):
        self.policy, self.rng, self.device = policy, rng, torch.device(device)
        self.live = {r: np.zeros(0, np.int64) for r in range(num_reqs)}
        self.seq = {r: 0 for r in range(num_reqs)}
        self.start = {r: int(s) * SEG for r, s in enumerate(rng.permutation(num_reqs))}
        self.accs = {r: policy.make_accumulator() for r in range(num_reqs)}
        self.state = DevicePolicyState.for_policy(policy, SEG * num_reqs, device)
        self.step = 0

    def batch(self, order, new, window_step=None):
        """Append ``new[r]`` tokens to each request of ``order`` and build the device batch."""
        for r in order:
            self.live[r] = np.concatenate([self.live[r], np.arange(self.seq[r], self.seq[r] + new[r])])
            self.seq[r] += new[r]
        lives = [self.live[r] for r in order]
        counts = [x.size for x in lives]
        indptr = np.concatenate([[0], np.cumsum(counts)])
        kv_pos = np.concatenate(lives + [np.full(PAD_ROWS, -1)]).astype(np.int32)
        seqs = [self.seq[r] for r in order]
        t = lambda a, dt=torch.int64: torch.tensor(np.asarray(a), dtype=dt, device=self.device)  # noqa: E731
        return DeviceBatch(
            kv_pos=t(kv_pos, torch.int32), kv_indptr=t(indptr, torch.int32),
            mirror_starts=t([self.start[r] for r in order]), seq_len=t(seqs), num_new=t([new[r] for r in order]),
            budget=t(resolve_budgets(self.policy, seqs)), num_reqs=len(order),
            step=t([self.step] * len(order)), request_seed=t([fold32(request_seed(r)) for r in order]),
            window_step=None if window_step is None else t(window_step, torch.bool),
        ), indptr

    def run_step(self, order, new, coarse):
        votes = self.policy.score_source == "window"
        window_step = [self.step == 0 or bool(self.rng.random() < 0.3) for _ in order] if votes else None
        batch, indptr = self.batch(order, new, window_step)
        ks = _scores(self.rng, (batch.nnz_max, 3 if votes else 2), coarse)
        ks[indptr[-1]:] = np.nan  # padding rows hold garbage; the device must ignore them
        if votes:
            self.policy.record_votes_device(self.state, batch, torch.from_numpy(ks).to(self.device))
        elif self.policy.device_state:
            self.state.update(batch, torch.from_numpy(ks).to(self.device))
        for i, r in enumerate(order):
            if self.accs[r] is not None:
                self.accs[r].update(self.live[r], ks[indptr[i]: indptr[i + 1]])
        self.check_state(batch, order)
        mask, counts = self.policy.select_victims_device(self.state, batch)
        assert mask.device == self.device and counts.device == self.device
        mask, counts = mask.cpu(), counts.cpu()
        assert mask.shape == (batch.nnz_max,) and mask.dtype == torch.bool and not mask[indptr[-1]:].any()
        got = batch.kv_pos.to(torch.int64).cpu().numpy()
        for i, r in enumerate(order):
            ws = ks[indptr[i]: indptr[i + 1]] if votes and window_step[i] else None
            view = self.policy.view(r, self.step, self.live[r], seq_len=self.seq[r], num_new=new[r],
                                    scores=self.accs[r], window_scores=ws)
            expect = self.policy.select_victims(view)
            seg = slice(indptr[i], indptr[i + 1])
            victims = got[seg][mask[seg].numpy()]
            assert victims.tolist() == expect.tolist(), (self.policy.name, self.step, r)
            assert int(counts[i]) == expect.size
            self.live[r] = np.setdiff1d(self.live[r], victims)
        self.step += 1
        return int(counts.sum())

    def check_state(self, batch, order):
        """The device state at each live token equals its request's ScoreAccumulator, bit for bit."""
        st = self.state
        for r in order:
            acc, ids = self.accs[r], self.live[r]
            if acc is None or ids.size == 0:
                continue
            mp = torch.from_numpy(ids + self.start[r]).to(self.device)
            if st.accumulated is not None:
                assert st.accumulated[mp].tolist() == acc.accumulated(ids).tolist()
            if st.last is not None:
                assert st.last[mp].tolist() == acc.last(ids).tolist()
            if st.history:
                assert popcount64(st.low_bits[mp]).tolist() == acc.low_counts(ids).tolist()
                assert st.seen[mp].tolist() == acc.seen_counts(ids).tolist()
                assert st.low_fraction(mp).tolist() == acc.low_fraction(ids).tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name,cfg", CONFIGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CONFIGS)])
def test_device_decisions_equal_the_numpy_oracle(name, cfg, seed, device):
    rng = np.random.default_rng(seed)
    policy = P.get(name, **cfg)
    num_reqs = int(rng.integers(1, 9))
    sim = Sim(policy, rng, num_reqs, device)
    evicted = 0
    for step in range(14):
        order = [int(r) for r in rng.permutation(num_reqs) if step == 0 or rng.random() < 0.8]
        if step == 0:  # prefill: prompts of varied length, some shorter than sink + window
            new = {r: int(rng.integers(1, 40)) for r in order}
        else:  # decode, sometimes a chunk
            new = {r: int(rng.choice([1, 1, 1, 2, 5])) for r in order}
        evicted += sim.run_step(order, new, coarse=bool(step % 2))
    assert evicted > 0  # the simulation did exercise the selection


# --------------------------------------------------------------------------- the shared primitive


class _Probe(P.EvictionPolicy):
    """Ranks by a priority given per token: the primitive against ``lowest`` on arbitrary floats."""

    name = "probe"

    def __init__(self, priority, **cfg):
        super().__init__(**cfg)
        self.priority = priority  # {request: float64 array over its live ids}

    def choose(self, view, candidates, n):
        return lowest(candidates, self.priority[view.request_id][np.searchsorted(view.token_ids, candidates)], n)

    def device_priority(self, state, batch):
        return self.device_values


@pytest.mark.parametrize("seed", range(6))
def test_segmented_selection_ties_nan_signed_zero_and_infinities(seed):
    rng = np.random.default_rng(100 + seed)
    pool = np.array([np.nan, -np.inf, np.inf, -0.0, 0.0, -1.5, 1.5, 2.0, 1e300, -1e-300])
    num_reqs = int(rng.integers(1, 12))
    cfg = {"budget": {"ratio": 0.3, "cap": int(rng.integers(1, 30))}, "sink": int(rng.integers(0, 4)),
           "window": int(rng.integers(0, 5))}
    lives, prio = [], {}
    for r in range(num_reqs):
        seq = int(rng.integers(1, 60))
        live = np.flatnonzero(rng.random(seq) < rng.uniform(0.2, 1.0))
        lives.append(live if live.size else np.array([seq - 1]))
        prio[r] = pool[rng.integers(0, pool.size, lives[-1].size)]
    probe = _Probe(prio, **cfg)
    probe.device_values = torch.from_numpy(np.concatenate([prio[r] for r in range(num_reqs)] + [np.full(3, -np.inf)]))
    seqs = [int(x[-1]) + 1 + int(rng.integers(0, 3)) for x in lives]
    nnew = [int(rng.integers(1, 4)) for _ in range(num_reqs)]
    batch = DeviceBatch(
        kv_pos=torch.from_numpy(np.concatenate(lives + [np.zeros(3, np.int64)])),
        kv_indptr=torch.from_numpy(np.concatenate([[0], np.cumsum([x.size for x in lives])])),
        mirror_starts=torch.zeros(num_reqs, dtype=torch.int64), seq_len=torch.tensor(seqs),
        num_new=torch.tensor(nnew), budget=torch.from_numpy(resolve_budgets(probe, seqs)), num_reqs=num_reqs)
    mask, counts = select_victims(probe, DevicePolicyState(0, "cpu"), batch)
    ptr = batch.kv_indptr.numpy()
    for r in range(num_reqs):
        expect = probe.select_victims(probe.view(r, 0, lives[r], seq_len=seqs[r], num_new=nnew[r]))
        assert lives[r][mask[ptr[r]: ptr[r + 1]].numpy()].tolist() == expect.tolist()
        assert int(counts[r]) == expect.size


class _IntProbe(_Probe):
    """A probe whose priorities are small integers: ``device_int_priority`` gives them with ``bits`` bits."""

    name = "int-probe"

    def __init__(self, priority, bits, **cfg):
        super().__init__(priority, **cfg)
        self.bits = bits

    def device_int_priority(self, state, batch):
        return self.device_values.to(torch.int64), self.bits


@pytest.mark.parametrize("bits", [0, 2, 40, 62])
@pytest.mark.parametrize("seed", range(3))
def test_one_sort_over_integer_priorities_equals_the_oracle_with_many_requests_and_ties(seed, bits):
    """One sort of (request, candidate first, integer priority) picks the oracle's victims, ties to the
    older token; ``bits`` 0 is the packed order, and 62 bits leave no room for the segment (two sorts)."""
    rng = np.random.default_rng(200 + seed)
    num_reqs = int(rng.integers(150, 400))  # segments above 2**8: more than a byte of segment bits
    cfg = {"budget": {"ratio": 0.4, "cap": int(rng.integers(1, 12))}, "sink": int(rng.integers(0, 3)),
           "window": int(rng.integers(0, 3))}
    top = 1 if bits == 0 else min(1 << bits, 4 if seed % 2 else 1 << 40)  # seeds 1: four values, ties everywhere
    lives, prio = [], {}
    for r in range(num_reqs):
        seq = int(rng.integers(1, 24))
        live = np.flatnonzero(rng.random(seq) < 0.7)
        lives.append(live if live.size else np.array([seq - 1]))
        prio[r] = (lives[-1] if bits == 0 else rng.integers(0, top, lives[-1].size)).astype(np.float64)
    probe = _IntProbe(prio, bits, **cfg)
    probe.device_values = torch.from_numpy(np.concatenate([prio[r] for r in range(num_reqs)] + [np.zeros(3)]))
    seqs = [int(x[-1]) + 1 for x in lives]
    batch = DeviceBatch(
        kv_pos=torch.from_numpy(np.concatenate(lives + [np.zeros(3, np.int64)])),
        kv_indptr=torch.from_numpy(np.concatenate([[0], np.cumsum([x.size for x in lives])])),
        mirror_starts=torch.zeros(num_reqs, dtype=torch.int64), seq_len=torch.tensor(seqs),
        num_new=torch.ones(num_reqs, dtype=torch.int64), budget=torch.from_numpy(resolve_budgets(probe, seqs)),
        num_reqs=num_reqs)
    mask, counts = select_victims(probe, DevicePolicyState(0, "cpu"), batch)
    ptr = batch.kv_indptr.numpy()
    chosen = 0
    for r in range(num_reqs):
        expect = probe.select_victims(probe.view(r, 0, lives[r], seq_len=seqs[r], num_new=1))
        assert lives[r][mask[ptr[r]: ptr[r + 1]].numpy()].tolist() == expect.tolist()
        assert int(counts[r]) == expect.size
        chosen += expect.size
    assert chosen > num_reqs // 2 and not mask[ptr[num_reqs]:].any()


def test_order_key_orders_like_a_stable_float_sort():
    x = torch.tensor([np.nan, 3.0, -0.0, -np.inf, 0.0, np.inf, -2.5, -np.nan, 5e-324, -5e-324])
    key = order_key(x)
    assert torch.sort(key, stable=True).indices.tolist() == np.argsort(x.numpy(), kind="stable").tolist()
    assert key[2] == key[4] and key[0] == key[7]  # -0.0 == 0.0, every NaN equal


def test_popcount64_counts_every_bit():
    vals = [0, 1, -1, -(1 << 63), 0x5555555555555555, 12345678901234567]
    got = popcount64(torch.tensor(vals, dtype=torch.int64)).tolist()
    assert got == [bin(v & ((1 << 64) - 1)).count("1") for v in vals]


# --------------------------------------------------------------------------- contracts


def _tiny_batch(**over):
    args = dict(kv_pos=torch.arange(4), kv_indptr=torch.tensor([0, 4]), mirror_starts=torch.tensor([0]),
                seq_len=torch.tensor([4]), num_new=torch.tensor([1]), budget=torch.tensor([2]), num_reqs=1)
    args.update(over)
    return DeviceBatch(**args)


@pytest.mark.parametrize("over,err,match", [
    ({"kv_pos": np.arange(4)}, InvalidTypeError, "kv_pos: expected a torch tensor"),
    ({"kv_indptr": torch.tensor([0])}, InvalidArgumentError, r"kv_indptr: expected >= 2"),
    ({"seq_len": torch.tensor([4.0])}, InvalidTypeError, "seq_len: expected a 1-D tensor"),
    ({"budget": torch.tensor([2], dtype=torch.int32)}, InvalidTypeError, "budget"),
    ({"num_reqs": -1}, InvalidArgumentError, "num_reqs"),
    ({"window_step": torch.tensor([1])}, InvalidTypeError, "window_step"),
])
def test_device_batch_rejects_bad_input(over, err, match):
    with pytest.raises(err, match=match):
        _tiny_batch(**over)


def test_state_rejects_bad_scores_and_long_histories():
    state = DevicePolicyState(8, "cpu", accumulated=True)
    with pytest.raises(InvalidArgumentError, match=r"key_scores: expected \[4\]"):
        state.update(_tiny_batch(), torch.zeros(3))
    with pytest.raises(InvalidTypeError, match="key_scores"):
        state.update(_tiny_batch(), torch.zeros(4, dtype=torch.int64))
    assert state.accumulated.abs().sum() == 0  # nothing written
    with pytest.raises(InvalidArgumentError, match="history: expected <= 64"):
        DevicePolicyState.for_policy(P.get("scissorhands", history=65), 8, "cpu")


@pytest.mark.parametrize("name", ["h2o", "streamingllm"])  # two sorts; one sort (an integer priority)
def test_selection_reads_nothing_back_from_the_device(name):
    """On the meta device any host read (.item(), .tolist(), bool()) raises: the selection has none."""
    policy = P.get(name, budget=2, window=1, **({"sink": 0} if name == "streamingllm" else {}))
    batch = DeviceBatch(**{k: (v.to("meta") if isinstance(v, torch.Tensor) else v)
                           for k, v in vars(_tiny_batch()).items() if not k.startswith("_")})
    state = DevicePolicyState.for_policy(policy, 8, "meta")
    state.update(batch, torch.zeros(4, 2, device="meta"))
    mask, counts = policy.select_victims_device(state, batch)
    assert mask.device.type == "meta" and mask.shape == (4,) and counts.shape == (1,)


def test_snapkv_decode_step_evicts_nothing_without_window_votes():
    policy = P.get("snapkv", budget=2, window=1)
    state = DevicePolicyState.for_policy(policy, 8, "cpu")
    mask, counts = policy.select_victims_device(state, _tiny_batch())  # window_step None: a decode step
    assert not mask.any() and counts.tolist() == [0]


def test_relayout_moves_the_state_with_the_mirror():
    state = DevicePolicyState(4, "cpu", accumulated=True, history=3)
    state.accumulated[:4] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    state.seen[:4] = torch.tensor([1, 2, 3, 3], dtype=torch.int32)
    state.accumulated[4] = 99.0  # trash slot garbage must not leak into fresh positions
    state.relayout(torch.tensor([2, -1, 0, 3, -1, 1]))
    assert state.capacity == 6 and state.accumulated.shape == (7,)
    assert state.accumulated[:6].tolist() == [3.0, 0.0, 1.0, 4.0, 0.0, 2.0]
    assert state.seen[:6].tolist() == [3, 0, 1, 3, 0, 2]


@pytest.mark.parametrize("module", ["vtoken.policies.device", "vtoken.policies.counter_hash"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    failures, tried = doctest.testmod(importlib.import_module(module), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert failures == 0 and tried > 0
