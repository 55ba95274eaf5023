"""build_slot_lists: every backend against a plain-Python oracle and the torch reference.

The oracle walks each request's tokens with Python lists; it shares no code
with the torch reference or the kernels. Batches place their requests in the
mirror in a random order, with gaps between the ranges (dead slack and the
alive tokens of requests left out of the batch, which must be ignored). Every
output buffer is poisoned with a sentinel that is neither a slot nor PAD
before a build, and compared whole and exactly, so every element (PAD tails
and the kv_indptr tail included) is proven written.

Backends: the torch reference, Triton (interpreter on CPU, plus a run with
tiny tiles so that requests span many tiles, tiles hold many requests and
spans many tiles), the C++ CPU op ``torch.ops.vtoken.build_slot_lists`` (when
``vtoken._C`` is built), ``vtoken.device.ops``, and on GPU the CUDA op and Triton,
including CUDA-graph replay.
"""
from __future__ import annotations

import random

import pytest
import torch

from vtoken.device import ops
from vtoken.errors import InvalidArgumentError, InvalidTypeError
from vtoken.reference import build_slot_lists as ref
import vtoken_kernels.build_slot_lists as tk
from kernel_device import KERNEL_DEVICE, device_for, extension_runs_on_gpu

from aot_helpers import AOT_ARCHS, compile_kernel, compile_module_in_fresh_process, expected_compiles

HAS_EXT = ops.extension_loaded() and hasattr(torch.ops.vtoken, "build_slot_lists")
POISON = -77  # neither a slot nor PAD
PAD = -1

# Per-request token counts. Tiles are 4096 virtual positions (tk.BLOCK):
# [5, 9000, 3] puts one request across three tiles; [4096, 4097, 1] ends on
# tile edges; many_small puts dozens of requests (and empty ones) in a tile.
LENGTHS = {
    "one": [1],
    "long_middle": [5, 9000, 3],
    "empty_req": [3000, 0, 4500, 17],
    "tile_edges": [4096, 4097, 1],
    "many_small": [13] * 37 + [0, 2],
}
DENSITIES = [0.0, 0.5, 1.0]
SEEDS = [0, 1]


# ----------------------------------------------------------------- fixtures


class Batch:
    """Requests (slots list, alive list) placed in a mirror arena in a shuffled order.

    Each request's range is preceded by ``gap`` junk positions: dead slack
    (alive 0, random or PAD slots) or, with ``left_out``, the alive tokens of
    requests that are not in the batch. Batch order is the order of ``reqs``.
    """

    def __init__(self, reqs, *, gap=0, left_out=0, shuffle=True, seed=0):
        rng = random.Random(seed)
        self.reqs = reqs
        self.slots, self.alive = [], []
        order = list(range(len(reqs)))
        if shuffle:
            rng.shuffle(order)
        self.starts = [0] * len(reqs)
        junk = lambda n: [rng.choice([PAD, rng.randrange(1 << 20)]) for _ in range(n)]  # noqa: E731
        for r in order:
            g = rng.randint(0, gap)
            self.slots += junk(g)
            self.alive += [int(left_out > 0 and rng.random() < 0.5) for _ in range(g)]
            self.starts[r] = len(self.slots)
            s, a = reqs[r]
            self.slots += s
            self.alive += a
        self.slots += junk(left_out)  # a trailing request left out of the batch
        self.alive += [1] * left_out

    def tensors(self, *, lens_dtype=torch.int64, alive_dtype=torch.int8, device="cpu"):
        """``(slots, alive, mirror_starts, num_tokens)``."""
        return (
            torch.tensor(self.slots, dtype=torch.int32, device=device),
            torch.tensor(self.alive, dtype=torch.int8, device=device).to(alive_dtype),
            torch.tensor(self.starts, dtype=torch.int64, device=device),
            torch.tensor([len(s) for s, _ in self.reqs], dtype=lens_dtype, device=device),
        )


def random_requests(lengths, density, seed, num_slots=None):
    rng = random.Random(seed)
    total = sum(lengths)
    pool = rng.sample(range(num_slots or 4 * total + 64), total)
    reqs, i = [], 0
    for n in lengths:
        reqs.append((pool[i : i + n], [int(rng.random() < density) for _ in range(n)]))
        i += n
    return reqs


def new_counts_for(reqs, seed, max_new=3):
    rng = random.Random(seed + 1000)
    return [rng.randint(0, min(len(s), max_new)) for s, _ in reqs]


def oracle(reqs, new_counts, nnz_max, max_reqs, max_tokens):
    """kv_indices / kv_indptr / slot_mapping / kv_pos of a build, in plain Python."""
    indices, indptr, mapping, positions = [], [0], [], []
    for (s, a), k in zip(reqs, new_counts):
        indices += [x for x, alive in zip(s, a) if alive]
        positions += [i for i, alive in enumerate(a) if alive]
        indptr.append(min(len(indices), nnz_max))
        mapping += s[len(s) - k :]
    indptr += [indptr[-1]] * (max_reqs + 1 - len(indptr))
    pad = lambda xs, n: xs[:n] + [PAD] * (n - len(xs))  # noqa: E731
    return pad(indices, nnz_max), indptr, pad(mapping, max_tokens), pad(positions, nnz_max)


def poisoned_buffers(nnz_max, max_reqs, max_tokens, device="cpu"):
    """``(kv_indices, kv_indptr, slot_mapping, kv_pos)`` filled with POISON."""
    return tuple(torch.full((n,), POISON, dtype=torch.int32, device=device)
                 for n in (nnz_max, max_reqs + 1, max_tokens, nnz_max))


def sizes(reqs, new_counts, extra=(7, 3, 5)):
    live = sum(sum(a) for _, a in reqs)
    return live + extra[0], len(reqs) + extra[1], sum(new_counts) + extra[2]


def as_lists(bufs):
    return tuple(b.cpu().tolist() for b in bufs)


def run_backend(backend, slots, alive, starts, lens, counts, bufs, num_reqs):
    """One build; ``bufs`` = (kv_indices, kv_indptr, slot_mapping[, kv_pos])."""
    kv_pos = bufs[3] if len(bufs) > 3 else None
    args = (slots, alive, starts, lens, counts, *bufs[:3], kv_pos, num_reqs)
    if backend == "torch":
        ref.build_slot_lists(*args)
    elif backend == "triton":
        tk.build_slot_lists(*args)
    elif backend == "cpp":
        torch.ops.vtoken.build_slot_lists(*args)
    else:
        raise AssertionError(backend)


def reference_lists(slots, alive, starts, lens, counts, nnz_max, max_reqs, max_tokens, num_reqs):
    bufs = poisoned_buffers(nnz_max, max_reqs, max_tokens, device=slots.device)
    ref.build_slot_lists(slots, alive, starts, lens, counts, *bufs[:3], bufs[3], num_reqs)
    return as_lists(bufs)


BACKENDS = ["torch", "triton", pytest.param("cpp", marks=pytest.mark.skipif(not HAS_EXT, reason="vtoken._C not built"))]


@pytest.fixture
def tiny_tiles(monkeypatch):
    """Shrink Triton's tiles so that spans hold several tiles and prefix loads loop."""
    monkeypatch.setattr(tk, "BLOCK", 128)
    monkeypatch.setattr(tk, "MAX_SPANS", 4)
    monkeypatch.setattr(tk, "RBLOCK", 16)
    monkeypatch.setattr(tk, "PAD_BLOCK", 256)


# ----------------------------------------------------------------- oracle sanity


def test_oracle_on_a_hand_example():
    reqs = [([5, 6, 7], [1, 0, 1]), ([20, 21], [1, 1])]
    assert oracle(reqs, [1, 2], 6, 3, 4) == (
        [5, 7, 20, 21, PAD, PAD], [0, 2, 4, 4], [7, 20, 21, PAD], [0, 2, 0, 1, PAD, PAD])
    # Overflow: entries past capacity dropped, kv_indptr saturates.
    assert oracle(reqs, [1, 2], 3, 2, 2) == ([5, 7, 20], [0, 2, 3], [7, 20], [0, 2, 0])


def test_batch_fixture_places_requests_out_of_order():
    b = Batch(random_requests([4, 4, 4, 4], 1.0, 0), gap=3, left_out=2, seed=2)
    assert sorted(b.starts) != b.starts
    for (s, a), st in zip(b.reqs, b.starts):
        assert b.slots[st : st + len(s)] == s and b.alive[st : st + len(a)] == a


# ----------------------------------------------------------------- full build


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("case", list(LENGTHS))
def test_build_matches_oracle_and_reference(case, density, seed, backend):
    dev = device_for(backend)
    reqs = random_requests(LENGTHS[case], density, seed)
    k = new_counts_for(reqs, seed)
    batch = Batch(reqs, gap=seed * 6, left_out=seed * 5, seed=seed)
    slots, alive, starts, lens = batch.tensors(
        lens_dtype=(torch.int64, torch.int32)[seed % 2], alive_dtype=(torch.int8, torch.bool)[seed % 2], device=dev)
    counts = torch.tensor(k, dtype=(torch.int32, torch.int64)[seed % 2], device=dev)
    nnz_max, max_reqs, max_tokens = sizes(reqs, k)
    want = oracle(reqs, k, nnz_max, max_reqs, max_tokens)
    assert reference_lists(slots, alive, starts, lens, counts, nnz_max, max_reqs, max_tokens, len(reqs)) == want
    bufs = poisoned_buffers(nnz_max, max_reqs, max_tokens, device=dev)
    run_backend(backend, slots, alive, starts, lens, counts, bufs, len(reqs))
    assert as_lists(bufs) == want


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_kv_pos_the_other_outputs_are_the_same(backend):
    dev = device_for(backend)
    reqs = random_requests([40, 0, 700, 9], 0.6, 3)
    k = new_counts_for(reqs, 3)
    slots, alive, starts, lens = Batch(reqs, gap=4, left_out=3, seed=3).tensors(device=dev)
    nnz_max, max_reqs, max_tokens = sizes(reqs, k)
    bufs = poisoned_buffers(nnz_max, max_reqs, max_tokens, device=dev)[:3]
    run_backend(backend, slots, alive, starts, lens, torch.tensor(k, device=dev), bufs, len(reqs))
    assert as_lists(bufs) == oracle(reqs, k, nnz_max, max_reqs, max_tokens)[:3]


@pytest.mark.parametrize("backend", BACKENDS)
def test_adjacent_ranges_in_reverse_order(backend):
    """No gap at all, batch order the reverse of mirror order: range ends are the next range's start."""
    dev = device_for(backend)
    reqs = random_requests([7, 1, 300, 16, 0, 5], 0.7, 4)
    k = new_counts_for(reqs, 4)
    batch = Batch(reqs, shuffle=False)
    slots, alive, _, _ = batch.tensors(device=dev)
    rev = reqs[::-1]
    starts = torch.tensor(batch.starts[::-1], dtype=torch.int64, device=dev)
    lens = torch.tensor([len(s) for s, _ in rev], device=dev)
    nnz_max, max_reqs, max_tokens = sizes(rev, k[::-1])
    bufs = poisoned_buffers(nnz_max, max_reqs, max_tokens, device=dev)
    run_backend(backend, slots, alive, starts, lens, torch.tensor(k[::-1], device=dev), bufs, len(rev))
    assert as_lists(bufs) == oracle(rev, k[::-1], nnz_max, max_reqs, max_tokens)


@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("case", ["long_middle", "many_small"])
def test_triton_many_tiles_per_span(case, density, tiny_tiles):
    """tiles_per_span > 1, tiles across request edges and multi-chunk prefix loads (tiny tiles)."""
    reqs = random_requests(LENGTHS[case], density, 3)
    k = new_counts_for(reqs, 3, max_new=400)
    slots, alive, starts, lens = Batch(reqs, gap=9, left_out=3, seed=3).tensors(device=KERNEL_DEVICE)
    nnz_max, max_reqs, max_tokens = sizes(reqs, k, extra=(300, 20, 700))
    num_spans, tiles_per_span = tk.plan_spans(slots.numel())
    assert num_spans <= tk.MAX_SPANS and tiles_per_span > 1
    bufs = poisoned_buffers(nnz_max, max_reqs, max_tokens, device=KERNEL_DEVICE)
    counts = torch.tensor(k, device=KERNEL_DEVICE)
    tk.build_slot_lists(slots, alive, starts, lens, counts, *bufs[:3], bufs[3], len(reqs))
    assert as_lists(bufs) == oracle(reqs, k, nnz_max, max_reqs, max_tokens)


@pytest.mark.parametrize("backend", BACKENDS)
def test_num_reqs_uses_a_prefix_of_the_batch(backend):
    dev = device_for(backend)
    reqs = random_requests([40, 7, 300, 9], 0.6, 5)
    k = new_counts_for(reqs, 5)
    slots, alive, starts, lens = Batch(reqs, gap=2, seed=5).tensors(device=dev)
    nnz_max, max_reqs, max_tokens = sizes(reqs, k)
    bufs = poisoned_buffers(nnz_max, max_reqs, max_tokens, device=dev)
    run_backend(backend, slots, alive, starts, lens, torch.tensor(k, device=dev), bufs, 2)
    assert as_lists(bufs) == oracle(reqs[:2], k[:2], nnz_max, max_reqs, max_tokens)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_requests_and_empty_mirror(backend):
    dev = device_for(backend)
    bufs = poisoned_buffers(5, 3, 4, device=dev)
    empty = torch.zeros(0, dtype=torch.int32, device=dev)
    none = torch.zeros(0, dtype=torch.int64, device=dev)
    run_backend(backend, empty, empty.to(torch.int8), none, none, none, bufs, 0)
    assert as_lists(bufs) == ([PAD] * 5, [0] * 4, [PAD] * 4, [PAD] * 5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_requests_over_a_live_mirror(backend):
    dev = device_for(backend)
    slots, alive, starts, lens = Batch(random_requests([50, 60], 1.0, 6), seed=6).tensors(device=dev)
    bufs = poisoned_buffers(5, 3, 4, device=dev)
    run_backend(backend, slots, alive, starts, lens, torch.zeros(2, dtype=torch.int64, device=dev), bufs, 0)
    assert as_lists(bufs) == ([PAD] * 5, [0] * 4, [PAD] * 4, [PAD] * 5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["long_middle", "many_small"])
def test_overflow_saturates_without_writing_out_of_bounds(case, backend):
    """Capacity is the caller's contract; past it entries are dropped, never written out of bounds."""
    dev = device_for(backend)
    reqs = random_requests(LENGTHS[case], 0.7, 9)
    k = new_counts_for(reqs, 9)
    slots, alive, starts, lens = Batch(reqs, gap=3, seed=9).tensors(device=dev)
    live = sum(sum(a) for _, a in reqs)
    nnz_max, max_reqs, max_tokens = live // 2 + 1, len(reqs), max(sum(k) // 2, 1)
    guard = 11
    arena = [torch.full((n + 2 * guard,), POISON, dtype=torch.int32, device=dev)
             for n in (nnz_max, max_reqs + 1, max_tokens, nnz_max)]
    bufs = tuple(a[guard:-guard] for a in arena)
    run_backend(backend, slots, alive, starts, lens, torch.tensor(k, device=dev), bufs, len(reqs))
    assert as_lists(bufs) == oracle(reqs, k, nnz_max, max_reqs, max_tokens)
    for a in arena:  # the guard bands around each buffer are untouched
        assert (a[:guard] == POISON).all() and (a[-guard:] == POISON).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_pad_slots_of_dead_and_new_tokens_are_copied_verbatim(backend):
    """Dead tokens may carry PAD; a new token's PAD slot goes to slot_mapping as PAD (skipped by writers)."""
    dev = device_for(backend)
    reqs = [([PAD, 3, PAD, 9], [0, 1, 0, 0]), ([PAD, 40, 41], [0, 1, 1])]
    k = [2, 2]
    slots, alive, starts, lens = Batch(reqs, shuffle=False).tensors(device=dev)
    bufs = poisoned_buffers(4, 3, 5, device=dev)
    run_backend(backend, slots, alive, starts, lens, torch.tensor(k, device=dev), bufs, 2)
    assert as_lists(bufs) == ([3, 40, 41, PAD], [0, 1, 3, 3], [PAD, 9, 40, 41, PAD], [1, 1, 2, PAD])


# ----------------------------------------------------------------- vtoken.device.ops


def _ops_backends():
    out = ["torch", "triton"]
    if HAS_EXT:
        out.append("cuda")
    return out


@pytest.mark.parametrize("backend", _ops_backends())
def test_ops_dispatch(backend, monkeypatch):
    dev = device_for(backend)
    monkeypatch.setenv("VTOKEN_BACKEND", backend)
    reqs = random_requests([70, 3, 4500], 0.5, 6)
    k = new_counts_for(reqs, 6)
    slots, alive, starts, lens = Batch(reqs, gap=5, left_out=4, seed=6).tensors(alive_dtype=torch.bool, device=dev)
    nnz_max, max_reqs, max_tokens = sizes(reqs, k)
    bufs = poisoned_buffers(nnz_max, max_reqs, max_tokens, device=dev)
    ops.build_slot_lists(slots, alive, starts, lens, torch.tensor(k, device=dev), *bufs[:3], kv_pos=bufs[3])
    assert as_lists(bufs) == oracle(reqs, k, nnz_max, max_reqs, max_tokens)


# ----------------------------------------------------------------- errors


def _valid_args():
    """Two requests of 10 and 20 tokens: request 0 at [25, 35), request 1 at [2, 22)."""
    reqs = random_requests([10, 20], 0.5, 8)
    slots = torch.arange(40, dtype=torch.int32)
    alive = torch.zeros(40, dtype=torch.int8)
    for (s, a), st in zip(reqs, (25, 2)):
        slots[st : st + len(s)] = torch.tensor(s, dtype=torch.int32)
        alive[st : st + len(a)] = torch.tensor(a, dtype=torch.int8)
    return [slots, alive, torch.tensor([25, 2]), torch.tensor([10, 20]), torch.tensor([1, 2]),
            *poisoned_buffers(40, 4, 8)]


def _set(i, value):
    return lambda a: a.__setitem__(i, value)


BAD_ARGS = [
    ("slots int64", lambda a: a.__setitem__(0, a[0].long()), InvalidTypeError, "slots: expected dtype"),
    ("alive float", lambda a: a.__setitem__(1, a[1].float()), InvalidTypeError, "alive: expected dtype"),
    ("alive short", lambda a: a.__setitem__(1, a[1][:-1]), InvalidTypeError, "alive: expected shape"),
    ("starts int32", lambda a: a.__setitem__(2, a[2].int()), InvalidTypeError, "mirror_starts: expected dtype"),
    ("lens float", lambda a: a.__setitem__(3, a[3].float()), InvalidTypeError, "num_tokens: expected dtype"),
    ("lens short", _set(3, torch.tensor([10])), InvalidTypeError, "num_tokens: expected at least"),
    ("counts short", _set(4, torch.tensor([1])), InvalidTypeError, "new_token_counts: expected at least"),
    ("indices int64", lambda a: a.__setitem__(5, a[5].long()), InvalidTypeError, "kv_indices: expected dtype"),
    ("indices 2-D", lambda a: a.__setitem__(5, a[5].view(2, -1)), InvalidTypeError, "kv_indices: expected 1 dims"),
    ("indptr short", lambda a: a.__setitem__(6, a[6][:2]), InvalidTypeError, "kv_indptr: expected at least"),
    ("mapping strided", _set(7, torch.zeros(16, dtype=torch.int32)[::2]), InvalidArgumentError,
     "slot_mapping: expected a contiguous"),
    ("kv_pos short", lambda a: a.__setitem__(8, a[8][:-1]), InvalidTypeError, "kv_pos: expected shape"),
    ("kv_pos int64", lambda a: a.__setitem__(8, a[8].long()), InvalidTypeError, "kv_pos: expected dtype"),
    ("start negative", _set(2, torch.tensor([25, -1])), InvalidArgumentError, "mirror_starts: expected starts >= 0"),
    ("start past end", _set(2, torch.tensor([31, 2])), InvalidArgumentError,
     r"mirror_starts: expected start \+ num_tokens <= len\(slots\)"),
    ("lens negative", _set(3, torch.tensor([10, -3])), InvalidArgumentError, "num_tokens: expected counts >= 0"),
    ("overlap", _set(2, torch.tensor([25, 6])), InvalidArgumentError, "non-overlapping"),
    ("overlap, same start", _set(2, torch.tensor([2, 2])), InvalidArgumentError, "non-overlapping"),
    ("new > length", _set(4, torch.tensor([11, 0])), InvalidArgumentError, "new_token_counts: expected 0 <="),
    ("new negative", _set(4, torch.tensor([0, -1])), InvalidArgumentError, "new_token_counts: expected 0 <="),
    ("alive PAD slot", lambda a: (a[0].__setitem__(2, PAD), a[1].__setitem__(2, 1)), InvalidArgumentError,
     "alive token of the batch to have a slot"),
    ("nnz overflow", lambda a: (a.__setitem__(5, torch.zeros(3, dtype=torch.int32)),
                                a.__setitem__(8, torch.zeros(3, dtype=torch.int32))),
     InvalidArgumentError, "kv_indices: expected capacity"),
    ("tokens overflow", _set(7, torch.zeros(2, dtype=torch.int32)), InvalidArgumentError,
     "slot_mapping: expected capacity"),
]


@pytest.mark.parametrize("name,mutate,exc,match", BAD_ARGS, ids=[b[0] for b in BAD_ARGS])
def test_bad_arguments_raise_and_leave_buffers_unchanged(name, mutate, exc, match):
    args = _valid_args()
    mutate(args)
    before = [t.clone() for t in args[5:]]
    with pytest.raises(exc, match=match):
        ops.build_slot_lists(*args[:8], kv_pos=args[8])
    for b, t in zip(before, args[5:]):
        assert torch.equal(b, t)


def test_a_gap_or_an_empty_range_inside_another_is_no_overlap():
    args = _valid_args()
    args[2] = torch.tensor([25, 2, 30, 35])  # request 2: empty range inside request 0's
    args[3] = torch.tensor([10, 20, 0, 5])
    args[4] = torch.tensor([1, 2, 0, 5])
    ops.build_slot_lists(*args[:8], kv_pos=args[8])
    assert args[6].tolist()[:5] == torch.cumsum(torch.tensor(
        [0] + [int(args[1][s : s + n].sum()) for s, n in ((25, 10), (2, 20), (30, 0), (35, 5))]), 0).tolist()


@pytest.mark.parametrize("bad", [3, -1, 2.0])
def test_bad_num_reqs(bad):
    args = _valid_args()
    with pytest.raises((InvalidArgumentError, InvalidTypeError), match="num_reqs: expected"):
        ops.build_slot_lists(*args[:8], num_reqs=bad)


@pytest.mark.skipif(not HAS_EXT, reason="vtoken._C not built")
def test_cpp_op_checks_contents_and_dtypes():
    args = _valid_args()
    before = [t.clone() for t in args[5:]]
    op = torch.ops.vtoken.build_slot_lists
    with pytest.raises(RuntimeError, match="mirror_starts: expected non-overlapping token ranges"):
        op(*args[:2], torch.tensor([25, 6]), *args[3:], 2)
    with pytest.raises(RuntimeError, match="mirror_starts: expected start \\+ num_tokens <= len"):
        op(*args[:2], torch.tensor([31, 2]), *args[3:], 2)
    with pytest.raises(RuntimeError, match="new_token_counts: expected 0 <="):
        op(*args[:4], torch.tensor([11, 0]), *args[5:], 2)
    with pytest.raises(RuntimeError, match="kv_indices: expected dtype int32"):
        op(*args[:5], args[5].long(), *args[6:], 2)
    with pytest.raises(RuntimeError, match="kv_pos: expected 40 elements"):
        op(*args[:8], args[8][:-1], 2)
    with pytest.raises(RuntimeError, match="num_reqs: expected num_reqs <="):
        op(*args, 3)
    for b, t in zip(before, args[5:]):
        assert torch.equal(b, t)


@pytest.mark.skipif(not HAS_EXT, reason="vtoken._C not built")
@pytest.mark.parametrize("with_pos", [True, False])
def test_opcheck(with_pos):
    reqs = random_requests([30, 0, 50], 0.5, 1)
    slots, alive, starts, lens = Batch(reqs, gap=3, seed=1).tensors()
    counts = torch.tensor([2, 0, 1])
    bufs = poisoned_buffers(64, 5, 8)
    kv_pos = bufs[3] if with_pos else None
    torch.library.opcheck(torch.ops.vtoken.build_slot_lists.default,
                          (slots, alive, starts, lens, counts, *bufs[:3], kv_pos, 3))


# ----------------------------------------------------------------- Triton AOT


def _aot_kernels():
    """(label, kernel, signature, constexprs) for every kernel, as the launchers call them."""
    ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
    out = []
    for lens, cnt in (("*i64", "*i64"), ("*i32", "*i32"), ("*i64", "*i32")):
        out.append((f"batch_prefix {lens} {cnt}", tk._batch_prefix_kernel,
                    {"starts_ptr": "*i64", "num_tokens_ptr": lens, "new_counts_ptr": cnt, "ws_start_ptr": "*i64",
                     "ws_vstart_ptr": "*i64", "ws_kstart_ptr": "*i64", **ints("mirror_len", "num_reqs")},
                    {"RBLOCK": tk.RBLOCK}))
    out.append(("span_count", tk._span_count_kernel,
                {"alive_ptr": "*i8", "start_ptr": "*i64", "vstart_ptr": "*i64", "span_counts_ptr": "*i64",
                 **ints("num_reqs", "tiles_per_span", "search_iters")}, {"BLOCK": tk.BLOCK}))
    for has_pos in (True, False):
        out.append((f"build has_pos={has_pos}", tk._build_slot_lists_kernel,
                    {"slots_ptr": "*i32", "alive_ptr": "*i8", "start_ptr": "*i64", "vstart_ptr": "*i64",
                     "kstart_ptr": "*i64", "span_counts_ptr": "*i64", "kv_indices_ptr": "*i32",
                     "kv_indptr_ptr": "*i32", "slot_mapping_ptr": "*i32", "kv_pos_ptr": "*i32",
                     **ints("num_reqs", "max_reqs", "nnz_max", "max_tokens", "num_spans", "tiles_per_span",
                            "search_iters")},
                    {"HAS_POS": has_pos, "BLOCK": tk.BLOCK, "RBLOCK": tk.RBLOCK, "PAD_BLOCK": tk.PAD_BLOCK}))
    return out


def _aot_compile_all() -> None:
    """Compile every kernel for every AOT arch; run in a process without TRITON_INTERPRET (see aot_helpers)."""
    for arch in AOT_ARCHS:
        for label, kernel, signature, constexprs in _aot_kernels():
            num_warps = 4 if label.startswith("batch_prefix") else tk.NUM_WARPS
            compile_kernel(kernel, signature, constexprs, arch, {"num_warps": num_warps}, label=label)


def test_aot_compile_for_sm90_sm80():
    """Compile every kernel for sm_90 and sm_80 (no GPU): catches what the interpreter tolerates.

    One fresh process without TRITON_INTERPRET compiles them all (see aot_helpers).
    """
    compiled = compile_module_in_fresh_process("test_build_slot_lists")
    assert compiled == expected_compiles(label for label, *_ in _aot_kernels())


# ----------------------------------------------------------------- GPU


def _gpu_backends():
    out = ["torch", "triton"]
    if extension_runs_on_gpu():
        out.append("cuda")
    return out


def _run_any(backend, *args):
    """``args`` as the op takes them: (slots, alive, starts, lens, counts, idx, indptr, mapping, kv_pos, n)."""
    if backend == "cuda":
        torch.ops.vtoken.build_slot_lists(*args)
    else:
        run_backend(backend, *args[:5], args[5:9], args[9])


@pytest.mark.gpu
@pytest.mark.parametrize("density", [0.0, 0.5, 1.0])
def test_gpu_backends_match_oracle(density):
    lengths = [4096 + 17 * i for i in range(64)] + [1, 0, 70000] + [13] * 300
    reqs = random_requests(lengths, density, 11)
    k = new_counts_for(reqs, 11, max_new=300)
    slots, alive, starts, lens = Batch(reqs, gap=40, left_out=5000, seed=11).tensors(device="cuda")
    counts = torch.tensor(k, device="cuda")
    nnz_max, max_reqs, max_tokens = sizes(reqs, k, extra=(1001, 9, 77))
    want = oracle(reqs, k, nnz_max, max_reqs, max_tokens)
    for backend in _gpu_backends():
        bufs = poisoned_buffers(nnz_max, max_reqs, max_tokens, device="cuda")
        _run_any(backend, slots, alive, starts, lens, counts, *bufs, len(reqs))
        torch.cuda.synchronize()
        assert as_lists(bufs) == want, backend


@pytest.mark.gpu
def test_gpu_graph_replay_after_in_place_edits():
    """A captured build replayed after in-place edits of the mirror and of the batch's order."""
    rng = random.Random(5)
    reqs = random_requests([rng.randint(0, 5000) for _ in range(40)], 0.7, 5)
    k = new_counts_for(reqs, 5)
    nnz_max, max_reqs, max_tokens = 400_000, 48, 40_000
    for backend in ("triton", "cuda") if extension_runs_on_gpu() else ("triton",):
        batch = Batch(reqs, gap=30, left_out=100, seed=5)
        slots, alive, starts, lens = batch.tensors(device="cuda")
        counts = torch.tensor(k, device="cuda")
        bufs = poisoned_buffers(nnz_max, max_reqs, max_tokens, device="cuda")
        args = (slots, alive, starts, lens, counts, *bufs, len(reqs))
        _run_any(backend, *args)  # warm up / compile
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            _run_any(backend, *args)
        # Evict in place (same mirror addresses), reverse the batch order, poison, replay.
        edited = [(list(s), list(a)) for s, a in reqs]
        for r in range(0, len(edited), 3):
            a = edited[r][1]
            for i in range(0, len(a), 2):
                a[i] = 0
            alive[batch.starts[r] : batch.starts[r] + len(a)] = torch.tensor(a, dtype=torch.int8, device="cuda")
        starts.copy_(torch.tensor(batch.starts[::-1], device="cuda"))
        lens.copy_(torch.tensor([len(s) for s, _ in edited[::-1]], device="cuda"))
        counts.copy_(torch.tensor(k[::-1], device="cuda"))
        for b in bufs:
            b.fill_(POISON)
        g.replay()
        torch.cuda.synchronize()
        assert as_lists(bufs) == oracle(edited[::-1], k[::-1], nnz_max, max_reqs, max_tokens), backend
