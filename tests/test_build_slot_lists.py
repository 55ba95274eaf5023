"""build_slot_lists / append_slot_lists: every backend against a plain-Python oracle.

The oracle walks each request's tokens with Python lists; it shares no code
with the torch reference or the kernels. Every output buffer is poisoned with
a sentinel that is neither a slot nor PAD before a build, and compared whole
and exactly, so every element (PAD tails and the kv_indptr tail included) is
proven written.

Backends: the torch reference, Triton (interpreter on CPU, plus a run with
tiny tiles so that requests span many tiles and spans many tiles), the C++
CPU op ``torch.ops.vtoken.*`` (when ``vtoken._C`` is built), ``vtoken.ops``,
and on GPU the CUDA op and Triton, including CUDA-graph replay.
"""
from __future__ import annotations

import random

import pytest
import torch

from vtoken import ops
from vtoken.errors import InvalidArgumentError, InvalidTypeError
from vtoken.reference import build_slot_lists as ref
import vtoken_kernels.build_slot_lists as tk

from aot_helpers import AOT_ARCHS, compile_kernel, compile_module_in_fresh_process, expected_compiles

HAS_EXT = ops.extension_loaded() and hasattr(torch.ops.vtoken, "build_slot_lists")
POISON = -77  # neither a slot nor PAD
PAD = -1

# Per-request token counts. Tiles are 4096 tokens (tk.BLOCK): [5, 9000, 3]
# puts one request across three tiles; [4096, 4097, 1] ends on tile edges.
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


class Mirror:
    """A device-mirror-like batch: per-request token lists laid out in one array.

    ``slack`` dead entries (alive 0, random or PAD slots) follow each request,
    as in :class:`vtoken.buffers.DeviceMirror`; ``lead`` / ``tail`` alive
    tokens of other requests sit outside the batch's range and must be ignored.
    """

    def __init__(self, reqs, *, slack=0, lead=0, tail=0, seed=0):
        self.reqs = reqs  # list of (slots list, alive list)
        self.slack, self.lead, self.tail, self.seed = slack, lead, tail, seed

    def tensors(self, *, offsets_dtype=torch.int64, alive_dtype=torch.int8, device="cpu"):
        rng = random.Random(self.seed)
        slots, alive = [], []
        junk = lambda n: [rng.choice([PAD, rng.randrange(1 << 20)]) for _ in range(n)]  # noqa: E731
        slots += junk(self.lead)
        alive += [1] * self.lead
        offsets = [self.lead]
        for s, a in self.reqs:
            slots += s
            alive += a
            offsets.append(len(slots))  # the slack after r is the front of r+1's range
            slots += junk(self.slack)
            alive += [0] * self.slack
        slots += junk(self.tail)
        alive += [1] * self.tail
        return (
            torch.tensor(slots, dtype=torch.int32, device=device),
            torch.tensor(alive, dtype=torch.int8, device=device).to(alive_dtype),
            torch.tensor(offsets, dtype=offsets_dtype, device=device),
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
    """kv_indices / kv_indptr / slot_mapping of a full build, in plain Python."""
    indices, indptr, mapping = [], [0], []
    for (s, a), k in zip(reqs, new_counts):
        indices += [x for x, alive in zip(s, a) if alive]
        indptr.append(min(len(indices), nnz_max))
        mapping += s[len(s) - k :]
    indptr += [indptr[-1]] * (max_reqs + 1 - len(indptr))
    indices = indices[:nnz_max] + [PAD] * (nnz_max - len(indices))
    mapping = mapping[:max_tokens] + [PAD] * (max_tokens - len(mapping))
    return indices, indptr, mapping


def poisoned_buffers(nnz_max, max_reqs, max_tokens, device="cpu"):
    return tuple(torch.full((n,), POISON, dtype=torch.int32, device=device) for n in (nnz_max, max_reqs + 1, max_tokens))


def sizes(reqs, new_counts, extra=(7, 3, 5)):
    live = sum(sum(a) for _, a in reqs)
    return live + extra[0], len(reqs) + extra[1], sum(new_counts) + extra[2]


def as_lists(bufs):
    return tuple(b.cpu().tolist() for b in bufs)


def run_backend(backend, op, slots, alive, offsets, counts, bufs, num_reqs):
    if backend == "torch":
        getattr(ref, op)(slots, alive, offsets, counts, *bufs, num_reqs, content_checks=False)
    elif backend == "triton":
        getattr(tk, op)(slots, alive, offsets, counts, *bufs, num_reqs, content_checks=False)
    elif backend == "cpp":
        getattr(torch.ops.vtoken, op)(slots, alive, offsets, counts, *bufs, num_reqs)
    else:
        raise AssertionError(backend)


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
    assert oracle(reqs, [1, 2], 6, 3, 4) == ([5, 7, 20, 21, PAD, PAD], [0, 2, 4, 4], [7, 20, 21, PAD])
    # Overflow: entries past capacity dropped, kv_indptr saturates.
    assert oracle(reqs, [1, 2], 3, 2, 2) == ([5, 7, 20], [0, 2, 3], [7, 20])


# ----------------------------------------------------------------- full build


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("case", list(LENGTHS))
def test_build_matches_oracle(case, density, seed, backend):
    reqs = random_requests(LENGTHS[case], density, seed)
    k = new_counts_for(reqs, seed)
    mirror = Mirror(reqs, slack=seed * 3, lead=seed * 5, tail=2, seed=seed)
    slots, alive, offsets = mirror.tensors(
        offsets_dtype=(torch.int64, torch.int32)[seed % 2], alive_dtype=(torch.int8, torch.bool)[seed % 2]
    )
    counts = torch.tensor(k, dtype=(torch.int32, torch.int64)[seed % 2])
    nnz_max, max_reqs, max_tokens = sizes(reqs, k)
    bufs = poisoned_buffers(nnz_max, max_reqs, max_tokens)
    run_backend(backend, "build_slot_lists", slots, alive, offsets, counts, bufs, len(reqs))
    assert as_lists(bufs) == oracle(reqs, k, nnz_max, max_reqs, max_tokens)


@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("case", ["long_middle", "many_small"])
def test_triton_many_tiles_per_span(case, density, tiny_tiles):
    """tiles_per_span > 1 and multi-chunk prefix loads (tiny tiles, same semantics)."""
    reqs = random_requests(LENGTHS[case], density, 3)
    k = new_counts_for(reqs, 3, max_new=400)
    slots, alive, offsets = Mirror(reqs, slack=2, lead=3, tail=1, seed=3).tensors()
    nnz_max, max_reqs, max_tokens = sizes(reqs, k, extra=(300, 20, 700))
    num_spans, tiles_per_span = tk.plan_spans(slots.numel())
    assert num_spans <= tk.MAX_SPANS and tiles_per_span > 1
    bufs = poisoned_buffers(nnz_max, max_reqs, max_tokens)
    tk.build_slot_lists(slots, alive, offsets, torch.tensor(k), *bufs, len(reqs), content_checks=False)
    assert as_lists(bufs) == oracle(reqs, k, nnz_max, max_reqs, max_tokens)


@pytest.mark.parametrize("backend", BACKENDS)
def test_num_reqs_uses_a_prefix_of_the_batch(backend):
    reqs = random_requests([40, 7, 300, 9], 0.6, 5)
    k = new_counts_for(reqs, 5)
    slots, alive, offsets = Mirror(reqs, seed=5).tensors()
    nnz_max, max_reqs, max_tokens = sizes(reqs, k)
    bufs = poisoned_buffers(nnz_max, max_reqs, max_tokens)
    run_backend(backend, "build_slot_lists", slots, alive, offsets, torch.tensor(k), bufs, 2)
    assert as_lists(bufs) == oracle(reqs[:2], k[:2], nnz_max, max_reqs, max_tokens)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_requests_and_empty_mirror(backend):
    bufs = poisoned_buffers(5, 3, 4)
    empty = torch.zeros(0, dtype=torch.int32)
    run_backend(backend, "build_slot_lists", empty, empty.to(torch.int8), torch.zeros(1, dtype=torch.int64),
                torch.zeros(0, dtype=torch.int64), bufs, 0)
    assert as_lists(bufs) == ([PAD] * 5, [0] * 4, [PAD] * 4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["long_middle", "many_small"])
def test_overflow_saturates_without_writing_out_of_bounds(case, backend):
    """Capacity is the caller's contract; past it entries are dropped, never written out of bounds."""
    reqs = random_requests(LENGTHS[case], 0.7, 9)
    k = new_counts_for(reqs, 9)
    slots, alive, offsets = Mirror(reqs, seed=9).tensors()
    live = sum(sum(a) for _, a in reqs)
    nnz_max, max_reqs, max_tokens = live // 2 + 1, len(reqs), max(sum(k) // 2, 1)
    guard = 11
    arena = [torch.full((n + 2 * guard,), POISON, dtype=torch.int32) for n in (nnz_max, max_reqs + 1, max_tokens)]
    bufs = tuple(a[guard:-guard] for a in arena)
    run_backend(backend, "build_slot_lists", slots, alive, offsets, torch.tensor(k), bufs, len(reqs))
    assert as_lists(bufs) == oracle(reqs, k, nnz_max, max_reqs, max_tokens)
    for a in arena:  # the guard bands around each buffer are untouched
        assert (a[:guard] == POISON).all() and (a[-guard:] == POISON).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_pad_slots_of_dead_and_new_tokens_are_copied_verbatim(backend):
    """Dead tokens may carry PAD; a new token's PAD slot goes to slot_mapping as PAD (skipped by writers)."""
    reqs = [([PAD, 3, PAD, 9], [0, 1, 0, 0]), ([PAD, 40, 41], [0, 1, 1])]
    k = [2, 2]
    slots, alive, offsets = Mirror(reqs).tensors()
    bufs = poisoned_buffers(4, 3, 5)
    run_backend(backend, "build_slot_lists", slots, alive, offsets, torch.tensor(k), bufs, 2)
    assert as_lists(bufs) == ([3, 40, 41, PAD], [0, 1, 3, 3], [PAD, 9, 40, 41, PAD])


# ----------------------------------------------------------------- append fast path


def _append_round(reqs, rng, *, allow_new_request):
    """Append 0..3 tokens per request (sometimes hundreds), mostly alive; maybe add a request."""
    counts = []
    next_slot = 1 + max((max(s) for s, _ in reqs if s), default=0)
    for s, a in reqs:
        n = rng.choice([0, 1, 1, 2, 3, rng.randint(100, 700)])
        s += list(range(next_slot, next_slot + n))
        a += [int(rng.random() < 0.9) for _ in range(n)]
        next_slot += n
        counts.append(n)
    if allow_new_request and rng.random() < 0.5:
        n = rng.randint(1, 50)
        reqs.append((list(range(next_slot, next_slot + n)), [1] * n))
        counts.append(n)
    return counts


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_append_rounds_equal_a_full_rebuild(backend, seed, request):
    rng = random.Random(seed)
    reqs = random_requests([rng.randint(0, 600) for _ in range(rng.randint(1, 9))], 0.6, seed)
    nnz_max, max_reqs, max_tokens = 60000, 16, 12000  # no overflow: the precondition needs a complete build
    slots, alive, offsets = Mirror(reqs, slack=seed, seed=seed).tensors()
    k = [0] * len(reqs)
    bufs = poisoned_buffers(nnz_max, max_reqs, max_tokens)
    ref.build_slot_lists(slots, alive, offsets, torch.tensor(k), *bufs, len(reqs))
    for rnd in range(4):
        k = _append_round(reqs, rng, allow_new_request=len(reqs) < max_reqs)
        slots, alive, offsets = Mirror(reqs, slack=seed, seed=seed + rnd).tensors()
        counts = torch.tensor(k, dtype=torch.int32)
        ref.validate_append_precondition(slots, alive, offsets, counts, bufs[0], bufs[1], len(reqs))
        run_backend(backend, "append_slot_lists", slots, alive, offsets, counts, bufs, len(reqs))
        assert as_lists(bufs) == oracle(reqs, k, nnz_max, max_reqs, max_tokens), f"round {rnd}"


def test_triton_append_with_tiny_tiles(tiny_tiles):
    """Multi-tile in-place moves and staged heads longer than a tile."""
    rng = random.Random(7)
    reqs = random_requests([300, 5, 900, 0, 450], 0.8, 7)
    nnz_max, max_reqs, max_tokens = 9000, 8, 4000
    slots, alive, offsets = Mirror(reqs, seed=7).tensors()
    bufs = poisoned_buffers(nnz_max, max_reqs, max_tokens)
    tk.build_slot_lists(slots, alive, offsets, torch.zeros(len(reqs), dtype=torch.int64), *bufs, len(reqs))
    for rnd in range(3):
        k = _append_round(reqs, rng, allow_new_request=True)
        slots, alive, offsets = Mirror(reqs, seed=7).tensors()
        tk.append_slot_lists(slots, alive, offsets, torch.tensor(k), *bufs, len(reqs), content_checks=False)
        assert as_lists(bufs) == oracle(reqs, k, nnz_max, max_reqs, max_tokens), f"round {rnd}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_append_that_overflows_equals_a_saturated_rebuild(backend):
    reqs = random_requests([30, 40, 20], 1.0, 4)
    nnz_max, max_reqs, max_tokens = 95, 3, 12
    slots, alive, offsets = Mirror(reqs).tensors()
    bufs = poisoned_buffers(nnz_max, max_reqs, max_tokens)
    ref.build_slot_lists(slots, alive, offsets, torch.zeros(3, dtype=torch.int64), *bufs, 3)
    k = [2, 2, 2]
    for (s, a) in reqs:
        s += [1000 + len(s), 2000 + len(s)]
        a += [1, 1]
    slots, alive, offsets = Mirror(reqs).tensors()
    run_backend(backend, "append_slot_lists", slots, alive, offsets, torch.tensor(k), bufs, 3)
    assert as_lists(bufs) == oracle(reqs, k, nnz_max, max_reqs, max_tokens)


def test_append_precondition_check_catches_an_eviction():
    reqs = random_requests([20, 20], 1.0, 2)
    slots, alive, offsets = Mirror(reqs).tensors()
    bufs = poisoned_buffers(50, 2, 4)
    ref.build_slot_lists(slots, alive, offsets, torch.zeros(2, dtype=torch.int64), *bufs, 2)
    alive[3] = 0  # an eviction since the last build: the append path does not apply
    with pytest.raises(InvalidArgumentError, match="append precondition"):
        ref.validate_append_precondition(slots, alive, offsets, torch.zeros(2, dtype=torch.int64), bufs[0], bufs[1], 2)


# ----------------------------------------------------------------- vtoken.ops


def _ops_backends():
    out = ["torch", "triton"]
    if HAS_EXT:
        out.append("cuda")
    return out


@pytest.mark.parametrize("backend", _ops_backends())
def test_ops_dispatch_build_and_append(backend, monkeypatch):
    monkeypatch.setenv("VTOKEN_BACKEND", backend)
    reqs = random_requests([70, 3, 4500], 0.5, 6)
    k = new_counts_for(reqs, 6)
    slots, alive, offsets = Mirror(reqs, slack=2, seed=6).tensors(alive_dtype=torch.bool)
    nnz_max, max_reqs, max_tokens = sizes(reqs, k)
    nnz_max += 40
    bufs = poisoned_buffers(nnz_max, max_reqs, max_tokens)
    ops.build_slot_lists(slots, alive, offsets, torch.tensor(k), *bufs)
    assert as_lists(bufs) == oracle(reqs, k, nnz_max, max_reqs, max_tokens)
    k = [1, 0, 2]
    for (s, a), n in zip(reqs, k):
        s += list(range(90000 + len(s), 90000 + len(s) + n))
        a += [1] * n
    slots, alive, offsets = Mirror(reqs, slack=2, seed=6).tensors(alive_dtype=torch.bool)
    ops.append_slot_lists(slots, alive, offsets, torch.tensor(k), *bufs)  # debug precondition check runs (conftest)
    assert as_lists(bufs) == oracle(reqs, k, nnz_max, max_reqs, max_tokens)


# ----------------------------------------------------------------- errors


def _valid_args():
    reqs = random_requests([10, 20], 0.5, 8)
    slots, alive, offsets = Mirror(reqs).tensors()
    counts = torch.tensor([1, 2])
    return [slots, alive, offsets, counts, *poisoned_buffers(40, 4, 8)]


BAD_ARGS = [
    ("slots int64", lambda a: a.__setitem__(0, a[0].long()), InvalidTypeError, "slots: expected dtype"),
    ("alive float", lambda a: a.__setitem__(1, a[1].float()), InvalidTypeError, "alive: expected dtype"),
    ("alive short", lambda a: a.__setitem__(1, a[1][:-1]), InvalidTypeError, "alive: expected shape"),
    ("offsets float", lambda a: a.__setitem__(2, a[2].float()), InvalidTypeError, "mirror_offsets: expected dtype"),
    ("counts short", lambda a: a.__setitem__(3, a[3][:1]), InvalidTypeError, "new_token_counts: expected at least"),
    ("indices int64", lambda a: a.__setitem__(4, a[4].long()), InvalidTypeError, "kv_indices: expected dtype"),
    ("indices 2-D", lambda a: a.__setitem__(4, a[4].view(2, -1)), InvalidTypeError, "kv_indices: expected 1 dims"),
    ("indptr short", lambda a: a.__setitem__(5, a[5][:2]), InvalidTypeError, "kv_indptr: expected at least"),
    ("mapping strided", lambda a: a.__setitem__(6, torch.zeros(16, dtype=torch.int32)[::2]), InvalidArgumentError,
     "slot_mapping: expected a contiguous"),
    ("offsets decreasing", lambda a: a.__setitem__(2, torch.tensor([0, 12, 10])), InvalidArgumentError,
     "non-decreasing"),
    ("offsets past end", lambda a: a.__setitem__(2, torch.tensor([0, 10, 31])), InvalidArgumentError,
     "last entry <= len"),
    ("new > length", lambda a: a.__setitem__(3, torch.tensor([11, 0])), InvalidArgumentError,
     "new_token_counts: expected 0 <="),
    ("alive PAD slot", lambda a: (a[0].__setitem__(0, PAD), a[1].__setitem__(0, 1)), InvalidArgumentError,
     "alive token to have a slot"),
    ("nnz overflow", lambda a: a.__setitem__(4, torch.zeros(3, dtype=torch.int32)), InvalidArgumentError,
     "kv_indices: expected capacity"),
    ("tokens overflow", lambda a: a.__setitem__(6, torch.zeros(2, dtype=torch.int32)), InvalidArgumentError,
     "slot_mapping: expected capacity"),
]


@pytest.mark.parametrize("op", ["build_slot_lists", "append_slot_lists"])
@pytest.mark.parametrize("name,mutate,exc,match", BAD_ARGS, ids=[b[0] for b in BAD_ARGS])
def test_bad_arguments_raise_and_leave_buffers_unchanged(name, mutate, exc, match, op):
    args = _valid_args()
    mutate(args)
    before = [t.clone() for t in args[4:]]
    with pytest.raises(exc, match=match):
        getattr(ops, op)(*args)
    for b, t in zip(before, args[4:]):
        assert torch.equal(b, t)


@pytest.mark.parametrize("bad", [5, -1, 2.0])
def test_bad_num_reqs(bad):
    args = _valid_args()
    with pytest.raises((InvalidArgumentError, InvalidTypeError), match="num_reqs: expected"):
        ops.build_slot_lists(*args, num_reqs=bad)


@pytest.mark.skipif(not HAS_EXT, reason="vtoken._C not built")
def test_cpp_op_checks_contents_and_dtypes():
    args = _valid_args()
    before = [t.clone() for t in args[4:]]
    with pytest.raises(RuntimeError, match="mirror_offsets: expected a non-decreasing array"):
        torch.ops.vtoken.build_slot_lists(*args[:2], torch.tensor([0, 12, 10]), *args[3:], 2)
    with pytest.raises(RuntimeError, match="kv_indices: expected dtype int32"):
        torch.ops.vtoken.append_slot_lists(*args[:4], args[4].long(), *args[5:], 2)
    with pytest.raises(RuntimeError, match="num_reqs: expected num_reqs <="):
        torch.ops.vtoken.build_slot_lists(*args, 3)
    for b, t in zip(before, args[4:]):
        assert torch.equal(b, t)


@pytest.mark.skipif(not HAS_EXT, reason="vtoken._C not built")
@pytest.mark.parametrize("op", ["build_slot_lists", "append_slot_lists"])
def test_opcheck(op):
    reqs = random_requests([30, 0, 50], 0.5, 1)
    slots, alive, offsets = Mirror(reqs).tensors()
    counts = torch.tensor([0, 0, 0])
    bufs = poisoned_buffers(64, 5, 8)
    # append's precondition: the buffers hold a build of the same (unchanged) mirror.
    ref.build_slot_lists(slots, alive, offsets, counts, *bufs, 3)
    torch.library.opcheck(getattr(torch.ops.vtoken, op).default, (slots, alive, offsets, counts, *bufs, 3))


# ----------------------------------------------------------------- Triton AOT


def _aot_kernels():
    """(label, kernel, signature, constexprs) for every kernel, as the launchers call them."""
    ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
    blocks = {"BLOCK": tk.BLOCK, "RBLOCK": tk.RBLOCK, "PAD_BLOCK": tk.PAD_BLOCK}
    out = []
    for off in ("*i64", "*i32"):
        out.append((f"span_count-{off[1:]}", tk._span_count_kernel,
                    {"alive_ptr": "*i8", "offsets_ptr": off, "span_counts_ptr": "*i32",
                     **ints("num_tokens", "num_reqs", "tiles_per_span")}, {"BLOCK": tk.BLOCK}))
        out.append((f"build-{off[1:]}", tk._build_slot_lists_kernel,
                    {"slots_ptr": "*i32", "alive_ptr": "*i8", "offsets_ptr": off, "new_counts_ptr": off,
                     "span_counts_ptr": "*i32", "kv_indices_ptr": "*i32", "kv_indptr_ptr": "*i32",
                     "slot_mapping_ptr": "*i32",
                     **ints("num_tokens", "num_reqs", "max_reqs", "nnz_max", "max_tokens", "num_spans",
                            "tiles_per_span")}, blocks))
        out.append((f"append_stage-{off[1:]}", tk._append_stage_kernel,
                    {"alive_ptr": "*i8", "offsets_ptr": off, "new_counts_ptr": off, "kv_indices_ptr": "*i32",
                     "kv_indptr_ptr": "*i32", "ws_counts_ptr": "*i32", "ws_indptr_ptr": "*i32",
                     "ws_stage_ptr": "*i32", **ints("num_tokens", "num_reqs", "nnz_max")},
                    {"BLOCK": tk.BLOCK, "RBLOCK": tk.RBLOCK}))
        out.append((f"append_place-{off[1:]}", tk._append_place_kernel,
                    {"slots_ptr": "*i32", "alive_ptr": "*i8", "offsets_ptr": off, "new_counts_ptr": off,
                     "ws_counts_ptr": "*i32", "ws_indptr_ptr": "*i32", "ws_stage_ptr": "*i32",
                     "kv_indices_ptr": "*i32", "kv_indptr_ptr": "*i32", "slot_mapping_ptr": "*i32",
                     **ints("num_tokens", "num_reqs", "max_reqs", "nnz_max", "max_tokens")}, blocks))
    return out


def _aot_compile_all() -> None:
    """Compile every kernel for every AOT arch; run in a process without TRITON_INTERPRET (see aot_helpers)."""
    for arch in AOT_ARCHS:
        for label, kernel, signature, constexprs in _aot_kernels():
            compiled = compile_kernel(kernel, signature, constexprs, arch, {"num_warps": tk.NUM_WARPS}, label=label)
            if label.startswith("append_place"):
                # The in-place move's CTA barrier survived compilation.
                assert "bar.sync" in compiled.asm["ptx"] or "barrier.sync" in compiled.asm["ptx"], label


def test_aot_compile_for_sm90_sm80():
    """Compile every kernel for sm_90 and sm_80 (no GPU): catches what the interpreter tolerates.

    One fresh process without TRITON_INTERPRET compiles them all (see aot_helpers).
    """
    compiled = compile_module_in_fresh_process("test_build_slot_lists")
    assert compiled == expected_compiles(label for label, *_ in _aot_kernels())


# ----------------------------------------------------------------- GPU


def _gpu_backends():
    out = ["torch", "triton"]
    if HAS_EXT:
        out.append("cuda")
    return out


def _run_any(backend, op, *args):
    if backend == "cuda":
        getattr(torch.ops.vtoken, op)(*args)
    else:
        run_backend(backend, op, *args[:4], args[4:7], args[7])


@pytest.mark.gpu
@pytest.mark.parametrize("density", [0.0, 0.5, 1.0])
def test_gpu_backends_match_oracle(density):
    lengths = [4096 + 17 * i for i in range(64)] + [1, 0, 70000]
    reqs = random_requests(lengths, density, 11)
    k = new_counts_for(reqs, 11, max_new=300)
    m = Mirror(reqs, slack=5, lead=9, tail=4, seed=11)
    slots, alive, offsets = m.tensors(device="cuda")
    counts = torch.tensor(k, device="cuda")
    nnz_max, max_reqs, max_tokens = sizes(reqs, k, extra=(1001, 9, 77))
    want = oracle(reqs, k, nnz_max, max_reqs, max_tokens)
    for backend in _gpu_backends():
        bufs = poisoned_buffers(nnz_max, max_reqs, max_tokens, device="cuda")
        _run_any(backend, "build_slot_lists", slots, alive, offsets, counts, *bufs, len(reqs))
        torch.cuda.synchronize()
        assert as_lists(bufs) == want, backend


@pytest.mark.gpu
def test_gpu_append_rounds_and_graph_replay():
    """Append rounds on every GPU backend, then a captured build replayed after in-place mirror edits."""
    rng = random.Random(5)
    reqs0 = random_requests([rng.randint(0, 5000) for _ in range(40)], 0.7, 5)
    nnz_max, max_reqs, max_tokens = 400_000, 48, 40_000
    for backend in _gpu_backends():
        reqs = [(list(s), list(a)) for s, a in reqs0]
        rng = random.Random(6)
        slots, alive, offsets = Mirror(reqs, slack=3).tensors(device="cuda")
        bufs = poisoned_buffers(nnz_max, max_reqs, max_tokens, device="cuda")
        ref.build_slot_lists(slots, alive, offsets, torch.zeros(len(reqs), device="cuda", dtype=torch.int64),
                             *bufs, len(reqs), content_checks=False)
        for rnd in range(3):
            k = _append_round(reqs, rng, allow_new_request=True)
            slots, alive, offsets = Mirror(reqs, slack=3).tensors(device="cuda")
            counts = torch.tensor(k, device="cuda")
            _run_any(backend, "append_slot_lists", slots, alive, offsets, counts, *bufs, len(reqs))
            torch.cuda.synchronize()
            assert as_lists(bufs) == oracle(reqs, k, nnz_max, max_reqs, max_tokens), (backend, rnd)

    for backend in ("triton", "cuda") if HAS_EXT else ("triton",):
        reqs = [(list(s), list(a)) for s, a in reqs0]
        k = new_counts_for(reqs, 5)
        slots, alive, offsets = Mirror(reqs).tensors(device="cuda")
        counts = torch.tensor(k, device="cuda")
        bufs = poisoned_buffers(nnz_max, max_reqs, max_tokens, device="cuda")
        g = torch.cuda.CUDAGraph()
        _run_any(backend, "build_slot_lists", slots, alive, offsets, counts, *bufs, len(reqs))  # warm up / compile
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            _run_any(backend, "build_slot_lists", slots, alive, offsets, counts, *bufs, len(reqs))
        # Evict in place (same mirror addresses), poison, replay.
        for r in range(0, len(reqs), 3):
            s, a = reqs[r]
            for i in range(0, len(a), 2):
                a[i] = 0
        alive.copy_(Mirror(reqs).tensors(device="cuda")[1])
        for b in bufs:
            b.fill_(POISON)
        g.replay()
        torch.cuda.synchronize()
        assert as_lists(bufs) == oracle(reqs, k, nnz_max, max_reqs, max_tokens), backend
