"""block_live_counts: every backend against a plain-Python oracle, exactly.

Counts are compared element for element; F is compared bit for bit with the
oracle's ``float32(1 - live / (N * S))`` (Python floats are IEEE doubles, the
expression every backend evaluates). Backends: the torch reference, Triton
(interpreter on CPU), the C++ CPU op (when ``vtoken._C`` is built),
``vtoken.device.ops``, and on GPU the CUDA op (both its global-atomic and its
shared-memory histogram) and Triton.
"""
from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

from vtoken.device import ops
from vtoken.errors import InvalidArgumentError, InvalidTypeError
from vtoken.reference import block_live_counts as ref
import vtoken_kernels.block_live_counts as tk

from aot_helpers import AOT_ARCHS, compile_kernel, compile_module_in_fresh_process, expected_compiles
from kernel_device import device_for, extension_runs_on_gpu

HAS_EXT = ops.extension_loaded() and hasattr(torch.ops.vtoken, "block_live_counts")
PAD = -1

# (num_blocks, block_size, num_tokens)
SHAPES = [
    (1, 1, 1),
    (37, 16, 300),
    (5000, 16, 9001),  # more tokens than one Triton program (4096)
    (3, 1024, 3001),  # few huge blocks: heavy atomic contention
    (70001, 16, 20011),  # more blocks than tokens
    (10, 4, 0),  # no tokens
    (0, 16, 0),  # no blocks
]
DENSITIES = [0.0, 0.5, 1.0]
ALLOCATED = ["none", "random", "all", "empty"]
SEEDS = [0, 1]


def make_inputs(num_blocks, block_size, num_tokens, density, seed, *, unique=True, pad_every=7,
                alive_dtype=torch.int8, allocated="random", device="cpu"):
    rng = random.Random(seed)
    num_slots = num_blocks * block_size
    if unique:
        slots = rng.sample(range(num_slots), num_tokens)
    else:
        slots = [rng.randrange(num_slots) for _ in range(num_tokens)]
    if pad_every:
        slots = [PAD if i % pad_every == 3 else s for i, s in enumerate(slots)]
    alive = [int(rng.random() < density) for _ in range(num_tokens)]
    if allocated == "none":
        alloc = None
    else:
        p = {"random": 0.6, "all": 1.0, "empty": 0.0}[allocated]
        alloc = [int(rng.random() < p) for _ in range(num_blocks)]
    t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    return (
        t(slots, torch.int32),
        t(alive, torch.int8).to(alive_dtype),
        None if alloc is None else t(alloc, torch.int8).to(torch.bool if seed % 2 else torch.int8),
    )


def oracle(slots, alive, num_blocks, block_size, allocated):
    s, a = slots.tolist(), alive.to(torch.int8).tolist()
    hist = Counter(x // block_size for x, live in zip(s, a) if live and 0 <= x < num_blocks * block_size)
    counts = [hist.get(b, 0) for b in range(num_blocks)]
    alloc = [1] * num_blocks if allocated is None else allocated.to(torch.int8).tolist()
    n = sum(1 for x in alloc if x)
    live = sum(c for c, x in zip(counts, alloc) if x)
    f = np.float32(1.0 - live / (n * block_size)) if n else np.float32(0.0)
    return counts, f


def run_backend(backend, slots, alive, num_blocks, block_size, allocated):
    """A backend itself, without the contract (vtoken.device.ops checks it once, before dispatching)."""
    if backend == "torch":
        return ref.block_live_counts(slots, alive, num_blocks, block_size, allocated)
    if backend == "triton":
        return tk.block_live_counts(slots, alive, num_blocks, block_size, allocated)
    if backend in ("cpp", "cuda"):
        return torch.ops.vtoken.block_live_counts(slots, alive, allocated, num_blocks, block_size)
    raise AssertionError(backend)


def assert_matches(got, want, device="cpu"):
    counts, f = got
    want_counts, want_f = want
    assert counts.dtype == torch.int32 and counts.device.type == device
    assert counts.cpu().tolist() == want_counts
    assert f.dtype == torch.float32 and f.shape == () and f.device.type == device
    assert f.cpu().view(torch.int32).item() == np.array(want_f, dtype=np.float32).view(np.int32).item(), (
        float(f), float(want_f))


BACKENDS = ["torch", "triton", pytest.param("cpp", marks=pytest.mark.skipif(not HAS_EXT, reason="vtoken._C not built"))]


def test_oracle_on_a_hand_example():
    slots = torch.tensor([0, 1, 17, PAD, 40], dtype=torch.int32)
    alive = torch.tensor([1, 0, 1, 1, 1], dtype=torch.int8)
    counts, f = oracle(slots, alive, 3, 16, torch.tensor([1, 1, 0]))
    assert counts == [1, 1, 1] and f == np.float32(1 - 2 / 32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("allocated", ALLOCATED)
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{b}x{s}-{t}" for b, s, t in SHAPES])
def test_matches_oracle(shape, density, allocated, backend):
    for seed in SEEDS:
        slots, alive, alloc = make_inputs(*shape, density, seed, allocated=allocated,
                                          alive_dtype=(torch.int8, torch.bool)[seed], device=device_for(backend))
        assert_matches(run_backend(backend, slots, alive, *shape[:2], alloc), oracle(slots, alive, *shape[:2], alloc),
                       device_for(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicate_slots_and_contention(backend):
    """Slots drawn with replacement (not a valid table state, but the histogram must still be exact)."""
    slots, alive, alloc = make_inputs(2, 64, 9000, 0.9, 3, unique=False, device=device_for(backend))
    assert_matches(run_backend(backend, slots, alive, 2, 64, alloc), oracle(slots, alive, 2, 64, alloc),
                   device_for(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_slots_are_skipped_by_the_kernels(backend):
    """Without content checks, live slots outside [0, N*S) (other than PAD) count nowhere."""
    slots, alive, alloc = make_inputs(50, 16, 400, 1.0, 4, device=device_for(backend))
    slots[::5] = 50 * 16 + torch.arange(0, 400, 5, dtype=torch.int32)
    slots[1::5] = -2 - torch.arange(0, 399, 5, dtype=torch.int32)
    before = (slots.clone(), alive.clone(), alloc.clone())
    assert_matches(run_backend(backend, slots, alive, 50, 16, alloc), oracle(slots, alive, 50, 16, alloc),
                   device_for(backend))
    assert all(torch.equal(x, y) for x, y in zip(before, (slots, alive, alloc)))


def _ops_backends():
    return ["torch", "triton"] + (["cuda"] if HAS_EXT else [])


@pytest.mark.parametrize("backend", _ops_backends())
def test_ops_dispatch(backend, monkeypatch):
    monkeypatch.setenv("VTOKEN_BACKEND", backend)
    slots, alive, alloc = make_inputs(301, 16, 2003, 0.5, 5, device=device_for(backend))
    want = device_for(backend)
    assert_matches(ops.block_live_counts(slots, alive, 301, 16, alloc), oracle(slots, alive, 301, 16, alloc), want)
    assert_matches(ops.block_live_counts(slots, alive, 301, 16), oracle(slots, alive, 301, 16, None), want)


def _valid(device="cpu"):
    slots, alive, alloc = make_inputs(20, 16, 100, 0.5, 6, device=device)
    return [slots, alive, 20, 16, alloc]


BAD_ARGS = [
    ("slots int64", lambda a: a.__setitem__(0, a[0].long()), InvalidTypeError, "slots: expected dtype"),
    ("slots 2-D", lambda a: a.__setitem__(0, a[0].view(10, 10)), InvalidTypeError, "slots: expected 1 dims"),
    ("alive float", lambda a: a.__setitem__(1, a[1].float()), InvalidTypeError, "alive: expected dtype"),
    ("alive short", lambda a: a.__setitem__(1, a[1][:-1]), InvalidTypeError, "alive: expected shape"),
    ("slots strided", lambda a: (a.__setitem__(0, torch.zeros(200, dtype=torch.int32, device=a[1].device)[::2])),
     InvalidArgumentError,
     "slots: expected a contiguous"),
    ("num_blocks < 0", lambda a: a.__setitem__(2, -1), InvalidArgumentError, "num_blocks: expected >= 0"),
    ("num_blocks float", lambda a: a.__setitem__(2, 20.0), InvalidTypeError, "num_blocks: expected an int"),
    ("block_size 0", lambda a: a.__setitem__(3, 0), InvalidArgumentError, "block_size: expected >= 1"),
    ("too many slots", lambda a: (a.__setitem__(2, 2**28), a.__setitem__(4, None)), InvalidArgumentError,
     "expected <= 2\\*\\*31"),
    ("allocated size", lambda a: a.__setitem__(4, a[4][:-1]), InvalidTypeError, "allocated: expected shape"),
    ("allocated int32", lambda a: a.__setitem__(4, a[4].int()), InvalidTypeError, "allocated: expected dtype"),
    ("live slot out of range", lambda a: (a[0].__setitem__(0, 20 * 16), a[1].__setitem__(0, 1)),
     InvalidArgumentError, "slots: expected alive slots in"),
    ("live slot negative", lambda a: (a[0].__setitem__(0, -5), a[1].__setitem__(0, 1)), InvalidArgumentError,
     "slots: expected alive slots in"),
]


@pytest.mark.parametrize("backend", _ops_backends())
@pytest.mark.parametrize("name,mutate,exc,match", BAD_ARGS, ids=[b[0] for b in BAD_ARGS])
def test_bad_arguments_raise(name, mutate, exc, match, backend, monkeypatch):
    monkeypatch.setenv("VTOKEN_BACKEND", backend)
    args = _valid(device_for(backend))
    mutate(args)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(exc, match=match):
        ops.block_live_counts(*args)
    for b, a in zip(before, args):
        assert torch.equal(b, a) if isinstance(a, torch.Tensor) else b == a


@pytest.mark.skipif(not HAS_EXT, reason="vtoken._C not built")
def test_cpp_op_checks():
    slots, alive, _, _, alloc = _valid()
    with pytest.raises(RuntimeError, match="slots: expected dtype int32"):
        torch.ops.vtoken.block_live_counts(slots.long(), alive, alloc, 20, 16)
    with pytest.raises(RuntimeError, match=r"allocated: expected num_blocks \(21\) elements"):
        torch.ops.vtoken.block_live_counts(slots, alive, alloc, 21, 16)
    with pytest.raises(RuntimeError, match="block_size: expected >= 1"):
        torch.ops.vtoken.block_live_counts(slots, alive, None, 20, 0)


@pytest.mark.skipif(not HAS_EXT, reason="vtoken._C not built")
@pytest.mark.parametrize("with_alloc", [False, True])
def test_opcheck(with_alloc):
    slots, alive, _, _, alloc = _valid()
    torch.library.opcheck(torch.ops.vtoken.block_live_counts.default,
                          (slots, alive, alloc if with_alloc else None, 20, 16))


def _aot_specs():
    """(label, kernel, signature, constexprs) for both kernels, as the launcher calls them."""
    return [
        (f"counts-alloc{has_alloc}", tk._block_live_counts_kernel,
         {"slots_ptr": "*i32", "alive_ptr": "*i8", "allocated_ptr": "*i8", "counts_ptr": "*i32", "acc_ptr": "*i64",
          "num_tokens": "i32", "num_blocks": "i32", "block_size": "i32"},
         {"HAS_ALLOC": has_alloc, "BLOCK": tk.BLOCK})
        for has_alloc in (True, False)
    ] + [("waste_ratio", tk._waste_ratio_kernel, {"acc_ptr": "*i64", "f_ptr": "*fp32", "block_size": "i32"}, {})]


def _aot_compile_all() -> None:
    """Compile both kernels for every AOT arch; run in a process without TRITON_INTERPRET (see aot_helpers)."""
    for arch in AOT_ARCHS:
        for label, kernel, signature, constexprs in _aot_specs():
            compiled = compile_kernel(kernel, signature, constexprs, arch, {"num_warps": tk.NUM_WARPS}, label=label)
            if label.startswith("counts"):
                assert "atom.global" in compiled.asm["ptx"] or "red.global" in compiled.asm["ptx"], label


def test_aot_compile_for_sm90_sm80():
    """Compile the kernels for sm_90 and sm_80 (no GPU), in one fresh process without TRITON_INTERPRET."""
    compiled = compile_module_in_fresh_process("test_block_live_counts")
    assert compiled == expected_compiles(label for label, *_ in _aot_specs())


# ----------------------------------------------------------------- GPU


def _gpu_backends():
    return ["torch", "triton"] + (["cuda"] if extension_runs_on_gpu() else [])


# (num_blocks, block_size, num_tokens): the first takes the CUDA shared-memory
# histogram (num_blocks <= 8192, >= 4 tokens per bin per CTA: large blocks),
# the others the global-atomic one.
GPU_SHAPES = [(1000, 4096, 2_000_000), (100_000, 16, 1_000_000), (4096, 16, 3000)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=[f"{b}x{s}-{t}" for b, s, t in GPU_SHAPES])
@pytest.mark.parametrize("density", [0.0, 0.5, 1.0])
def test_gpu_backends_match_reference(shape, density):
    nb, bs, t = shape
    g = torch.Generator().manual_seed(7)
    slots = torch.randperm(nb * bs, generator=g)[:t].to(torch.int32)
    slots[::11] = PAD
    alive = (torch.rand(t, generator=g) < density).to(torch.int8)
    alloc = torch.rand(nb, generator=g) < 0.7
    want = ref.block_live_counts(slots, alive, nb, bs, alloc)
    want = (want[0].tolist(), np.float32(want[1].item()))
    dev = [x.cuda() for x in (slots, alive, alloc)]
    for backend in _gpu_backends():
        got = run_backend(backend, dev[0], dev[1], nb, bs, dev[2])
        torch.cuda.synchronize()
        assert_matches(got, want, device="cuda")


@pytest.mark.gpu
def test_gpu_graph_capture_no_sync():
    """F stays on the device and the op replays in a CUDA graph."""
    slots, alive, alloc = make_inputs(500, 16, 6000, 0.5, 8, device="cuda")
    for backend in ("triton", "cuda") if extension_runs_on_gpu() else ("triton",):
        run_backend(backend, slots, alive, 500, 16, alloc)  # warm up / compile
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            counts, f = run_backend(backend, slots, alive, 500, 16, alloc)
        alive.copy_(1 - alive)  # change the input in place, then replay
        graph.replay()
        torch.cuda.synchronize()
        assert_matches((counts, f), oracle(slots.cpu(), alive.cpu(), 500, 16, alloc.cpu()), device="cuda")
        alive.copy_(1 - alive)
