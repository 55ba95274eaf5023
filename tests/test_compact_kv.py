"""compact_kv: every backend against an independent byte-level oracle.

All layers of a test are carved out of one random "arena" of bytes, with gaps
between them. The random bytes are the poison: every destination row starts
as junk, and the whole arena (destination rows, untouched rows, the gaps
between layers) is compared bit for bit with the oracle, which copies rows one
(move, layer, kv, head) at a time through ``KVLayout.slot_offset`` /
``row_offset``, independently of the kernels' row merging.

Backends: the torch reference, Triton (interpreter on CPU), the C++ CPU op
``torch.ops.vtoken.compact_kv`` (when ``vtoken._C`` is built), the CUDA
kernel's index math emulated on CPU (test-only ops from ``csrc/testing/``,
built here) and, on GPU, the CUDA op and Triton against the reference.
"""
from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import random
import re
import shutil
import tempfile

import numpy as np
import pytest
import torch

from aot_helpers import AOT_ARCHS, compile_kernel, compile_module_in_fresh_process, expected_compiles
from kernel_device import device_for, extension_runs_on_gpu
from vtoken.device import ops
from vtoken.errors import InvalidArgumentError, InvalidTypeError
from vtoken.layout import KVLayout
from vtoken.reference import compact_kv as ref
from vtoken_kernels import contracts

HAS_EXT = ops.extension_loaded() and hasattr(torch.ops.vtoken, "compact_kv")
needs_ext = pytest.mark.skipif(not HAS_EXT, reason="vtoken._C is not built")

# vLLM 0.32's FlashAttention backend (vllm/v1/attention/backends/flash_attn.py,
# FlashAttentionImpl.forward) documents
#     kv_cache: shape = [num_blocks, num_kv_heads, block_size, 2 * head_size]
# and splits it with kv_cache.transpose(1, 2).split(head_size, dim=-1): K in the
# first head_size of the last dim, V in the second. That is KVLayout
# "vllm_fused". vLLM 0.32 allocates it with one of the physical stride orders of
# vllm/v1/kv_cache_layout.py (LBHNC, LBNHC, BLHNC, ...); the variants
# vllm_fused (LBHNC), vllm_fused_lbnhc and vllm_fused_blhnc below cover them.
VLLM_032_FLASH_ATTN_LAYOUT = "vllm_fused"
VLLM_032_FLASH_ATTN_SHAPE_DOC = "[num_blocks, num_kv_heads, block_size, 2 * head_size]"

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)

VARIANTS = [
    "vllm_flash",  # [2, num_blocks, block_size, H, D]
    "vllm_fused",  # [num_blocks, H, block_size, 2*D], vLLM 0.32 FlashAttention, LBHNC order
    "vllm_fused_lbnhc",  # same logical shape, physical [num_blocks, block_size, H, 2*D]
    "vllm_fused_blhnc",  # same logical shape, blocks outermost with layers interleaved
    "nhd",  # FlashInfer [num_blocks, 2, block_size, H, D]
    "hnd",  # FlashInfer [num_blocks, 2, H, block_size, D]
    "mla",  # [num_blocks, block_size, D]
    "nhd_padded",  # nhd with a padded head stride: rows that do not merge
    "split_kv",  # K and V in separate [num_blocks, block_size, H, D] tensors per layer
]

# (num_blocks, block_size, num_heads, head_dim, num_layers, num_moves, seed)
CASES = [
    (6, 16, 2, 64, 3, 20, 0),
    (5, 3, 3, 20, 2, 7, 1),  # odd sizes: 40/80-byte rows, block size 3
    (9, 1, 1, 8, 1, 4, 2),  # block size 1, one head, one layer
    (4, 7, 5, 1, 4, 13, 3),  # head_dim 1
]
CASE_IDS = ["nb{}-bs{}-h{}-d{}-L{}-M{}-s{}".format(*c) for c in CASES]


# ----------------------------------------------------------------- fixtures


class Arena:
    """One byte buffer holding every layer's cache, with random gaps between layers."""

    def __init__(self, nbytes: int, device, gen: torch.Generator):
        self.buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).to(device)
        self.cursor = 0
        self.rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))

    def take(self, shape, dtype, misalign: bool = False) -> torch.Tensor:
        esize = torch.empty(0, dtype=dtype).element_size()
        self.cursor += 16 * self.rng.randint(1, 4) + (esize if misalign else 0)
        n = int(np.prod(shape)) * esize
        t = self.buf[self.cursor : self.cursor + n].view(dtype).view(shape)
        self.cursor += n
        return t

    def snapshot(self) -> np.ndarray:
        return self.buf.cpu().numpy().copy()


def build_caches(variant, dtype, nb, bs, h, d, num_layers, *, device="cpu", seed=0, misalign=False):
    """Return (arena, kv_caches, layout) for a layout variant."""
    esize = torch.empty(0, dtype=dtype).element_size()
    per_layer = 2 * nb * bs * h * (d + 3) * esize + 256
    gen = torch.Generator().manual_seed(seed)
    arena = Arena(num_layers * per_layer * 2 + 4096, device, gen)
    caches = []
    if variant == "vllm_fused_blhnc":
        full = arena.take((nb, num_layers, h, bs, 2 * d), dtype)
        caches = [full[:, layer] for layer in range(num_layers)]
        return arena, caches, KVLayout.from_tensor(caches[0], "vllm_fused")
    for layer in range(num_layers):
        mis = misalign and layer % 2 == 1
        if variant in ("vllm_flash", "vllm_fused", "nhd", "hnd", "mla"):
            from vtoken.layout import kv_cache_shape

            caches.append(arena.take(kv_cache_shape(variant, nb, bs, h, d), dtype, mis))
        elif variant == "vllm_fused_lbnhc":
            caches.append(arena.take((nb, bs, h, 2 * d), dtype, mis).transpose(1, 2))
        elif variant == "nhd_padded":
            caches.append(arena.take((nb, 2, bs, h, d + 3), dtype, mis)[..., :d])
        elif variant == "split_kv":
            caches.append(arena.take((nb, bs, h, d), dtype, mis))
            caches.append(arena.take((nb, bs, h, d), dtype, mis))
        else:
            raise AssertionError(variant)
    if variant == "split_kv":
        st = caches[0].stride()
        return arena, caches, KVLayout("nhd", nb, bs, 1, h, d, st[0], st[1], 0, st[2])
    name = {"nhd_padded": "nhd", "vllm_fused_lbnhc": "vllm_fused"}.get(variant, variant)
    return arena, caches, KVLayout.from_tensor(caches[0], name)


def random_moves(num_slots, num_moves, seed, *, pad_fraction=0.25, device="cpu"):
    """Unique destinations disjoint from the sources, with some PAD on either side."""
    rng = random.Random(seed)
    slots = rng.sample(range(num_slots), 2 * num_moves)
    src, dst = slots[:num_moves], slots[num_moves:]
    for i in rng.sample(range(num_moves), int(num_moves * pad_fraction)):
        if rng.random() < 0.5:
            src[i] = -1
        else:
            dst[i] = -1
    as_t = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return as_t(src), as_t(dst)


def oracle(before: np.ndarray, arena: Arena, caches, layout: KVLayout, src, dst) -> np.ndarray:
    """Expected arena bytes: copy each (move, layer, kv, head) row, skipping PAD / out of range."""
    out = before.copy()
    esize = caches[0].element_size()
    row = layout.head_dim * esize
    for t in caches:
        base = t.data_ptr() - arena.buf.data_ptr()
        for s, d in zip(src.tolist(), dst.tolist()):
            if not (0 <= s < layout.num_slots and 0 <= d < layout.num_slots):
                continue
            for kv in range(layout.num_kv):
                for head in range(layout.num_heads):
                    r = layout.row_offset(kv, head)
                    so = base + (layout.slot_offset(s) + r) * esize
                    do = base + (layout.slot_offset(d) + r) * esize
                    out[do : do + row] = before[so : so + row]
    return out


def run_backend(backend, caches, layout, src, dst, validate=None):
    """The contract once (as vtoken.device.ops does), then the backend itself."""
    contracts.check_compact_kv_args(caches, layout, src, dst, validate=validate)
    if backend == "torch":
        ref.compact_kv(caches, layout, src, dst)
    elif backend == "triton":
        from vtoken_kernels.compact_kv import compact_kv

        compact_kv(caches, layout, src, dst)
    elif backend in ("cpp", "cuda_emulated"):
        if validate:
            contracts.check_slot_contract(layout, src, dst)
        op = torch.ops.vtoken.compact_kv if backend == "cpp" else cuda_emulation_ops().compact_kv_cuda_emulated
        op(caches, src, dst, *contracts.layout_op_args(layout))
    else:
        raise AssertionError(backend)


@functools.lru_cache(maxsize=1)
def cuda_emulation_ops():
    """``torch.ops.vtoken_testing``: csrc/testing/ built into a CPU extension of its own, once per process.

    The shipped vtoken._C leaves these test-only ops out. The extension needs
    the C++ toolchain that built vtoken._C, hence ``needs_ext`` on its users.
    """
    from torch.utils.cpp_extension import load

    csrc = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
    build_dir = tempfile.mkdtemp(prefix="vtoken_testing_ops_")
    atexit.register(shutil.rmtree, build_dir, ignore_errors=True)
    load(name="vtoken_testing_ops", sources=[os.path.join(csrc, "testing", "compact_kv_emulated.cpp")],
         extra_include_paths=[csrc], extra_cflags=["-O2"], build_directory=build_dir, is_python_module=False)
    return torch.ops.vtoken_testing


# cuda_emulated: the CUDA kernel's grid, vector numbering, addressing and
# access-width choice run thread by thread on the CPU (alignment asserted).
BACKENDS = ["torch", "triton", pytest.param("cpp", marks=needs_ext), pytest.param("cuda_emulated", marks=needs_ext)]


def assert_arena_equal(actual: np.ndarray, expected: np.ndarray):
    diff = np.flatnonzero(actual != expected)
    assert diff.size == 0, f"{diff.size} bytes differ, first at byte {diff[:8].tolist()}"


# ----------------------------------------------------------------- exactness


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_compact_kv_matches_oracle(backend, variant, dtype, case):
    dev = device_for(backend)
    nb, bs, h, d, num_layers, num_moves, seed = case
    arena, caches, layout = build_caches(variant, dtype, nb, bs, h, d, num_layers, seed=seed, misalign=seed % 2 == 1,
                                         device=dev)
    src, dst = random_moves(layout.num_slots, num_moves, seed, device=dev)
    before = arena.snapshot()
    run_backend(backend, caches, layout, src, dst, validate=True)
    expected = oracle(before, arena, caches, layout, src, dst)
    assert_arena_equal(arena.snapshot(), expected)
    # The moves really copied something (not a vacuous pass).
    assert (expected != before).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_pad_only_and_empty_leave_memory_identical(backend):
    dev = device_for(backend)
    arena, caches, layout = build_caches("nhd", torch.bfloat16, 4, 8, 2, 16, 2, device=dev)
    before = arena.snapshot()
    pad = torch.full((9,), -1, dtype=torch.int32, device=dev)
    slots = torch.arange(9, dtype=torch.int32, device=dev)
    run_backend(backend, caches, layout, pad, slots)
    run_backend(backend, caches, layout, slots, pad)
    empty = torch.empty(0, dtype=torch.int32, device=dev)
    run_backend(backend, caches, layout, empty, empty)
    assert_arena_equal(arena.snapshot(), before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_payloads_copied_bit_exactly(backend):
    """fp16 / fp32 NaNs with distinct payloads survive (no float round trip)."""
    dev = device_for(backend)
    for dtype, nan_bits in ((torch.float16, [0x7C01, 0xFE77, 0x7D55]), (torch.float32, [0x7F800001, 0xFFC12345])):
        arena, caches, layout = build_caches("hnd", dtype, 3, 4, 1, len(nan_bits), 1, device=dev)
        ints = contracts.int_view(caches[0])
        ints[0, 0, 0, 1] = torch.tensor(nan_bits, dtype=torch.int64, device=dev).to(ints.dtype)  # slot 1 K row
        src, dst = (torch.tensor([x], dtype=torch.int32, device=dev) for x in (1, 9))
        run_backend(backend, caches, layout, src, dst)
        assert torch.equal(ints[2, 0, 0, 1], ints[0, 0, 0, 1])  # slot 9 = block 2, offset 1


@pytest.mark.parametrize("backend", ["cuda", "triton", "torch"])
def test_ops_dispatch_every_backend(backend, monkeypatch):
    dev = device_for(backend)
    if backend == "cuda" and not HAS_EXT:
        pytest.skip("vtoken._C is not built")
    monkeypatch.setenv("VTOKEN_BACKEND", backend)
    arena, caches, layout = build_caches("vllm_fused", torch.float16, 6, 16, 2, 32, 3, seed=5, device=dev)
    src, dst = random_moves(layout.num_slots, 17, 5, device=dev)
    before = arena.snapshot()
    ops.compact_kv(caches, layout, src, dst)
    assert_arena_equal(arena.snapshot(), oracle(before, arena, caches, layout, src, dst))


def test_token_rows_merges_contiguous_dims():
    """(rows, n_inner, stride_outer, stride_inner, row_len) per layout (nb=4, bs=16, H=2, D=8)."""
    _, caches, layout = build_caches("nhd", torch.float16, 4, 16, 2, 8, 1)
    assert contracts.token_rows(layout) == (2, 2, 0, 16 * 2 * 8, 2 * 8)  # K, V rows of H*D
    _, caches, layout = build_caches("vllm_fused", torch.float16, 4, 16, 2, 8, 1)
    assert contracts.token_rows(layout) == (2, 2, 0, 16 * 2 * 8, 2 * 8)  # one row of 2*D per head
    _, caches, layout = build_caches("hnd", torch.float16, 4, 16, 2, 8, 1)
    assert contracts.token_rows(layout) == (4, 4, 0, 16 * 8, 8)  # kv and head fold into one dim
    _, caches, layout = build_caches("mla", torch.float16, 4, 16, 2, 8, 1)
    assert contracts.token_rows(layout) == (1, 1, 0, 0, 8)
    _, caches, layout = build_caches("nhd_padded", torch.float16, 4, 16, 2, 8, 1)
    assert contracts.token_rows(layout) == (4, 2, 16 * 2 * 11, 11, 8)  # two dims, no merge


def test_vllm_032_flash_attention_layout_is_vllm_fused():
    """The layout named for vLLM 0.32 matches the installed vLLM source (when installed)."""
    _, caches, layout = build_caches(VLLM_032_FLASH_ATTN_LAYOUT, torch.float16, 4, 16, 2, 8, 1)
    assert tuple(caches[0].shape) == (4, 2, 16, 2 * 8)  # [num_blocks, H, block_size, 2*D]
    assert (layout.num_kv, layout.stride_kv) == (2, 8)  # K then V inside the last dim
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm is not installed; the layout above is taken from vLLM 0.32's flash_attn.py")
    path = os.path.join(list(spec.submodule_search_locations)[0], "v1", "attention", "backends", "flash_attn.py")
    src = open(path).read()
    assert VLLM_032_FLASH_ATTN_SHAPE_DOC in src
    assert "kv_cache.transpose(1, 2).split(self.head_size, dim=-1)" in src


# ----------------------------------------------------------------- contract


CONTRACT_BREAKS = [
    ("dst_out_of_range", lambda n: ([0, 1], [2, n]), r"dst_slots\[1\]: expected -1 \(PAD\) or a slot in \[0, \d+\), got \d+"),
    ("src_out_of_range", lambda n: ([n + 5, 1], [2, 3]), r"src_slots\[0\]: expected -1 \(PAD\) or a slot in \[0, \d+\), got \d+"),
    ("src_below_pad", lambda n: ([0, -2], [2, 3]), r"src_slots\[1\]: expected -1 \(PAD\) or a slot in \[0, \d+\), got -2"),
    ("duplicate_dst", lambda n: ([0, 1], [5, 5]), r"expected unique destinations, got slot 5 2 times"),
    ("dst_is_a_src", lambda n: ([0, 1], [1, 7]), r"expected destinations disjoint from the sources, got slot 1"),
]


@pytest.mark.parametrize("name,make,match", CONTRACT_BREAKS, ids=[c[0] for c in CONTRACT_BREAKS])
@pytest.mark.parametrize("backend", ["cuda", "triton", "torch"])
def test_contract_violation_raises_and_leaves_memory(backend, name, make, match, monkeypatch):
    dev = device_for(backend)
    if backend == "cuda" and not HAS_EXT:
        pytest.skip("vtoken._C is not built")
    monkeypatch.setenv("VTOKEN_BACKEND", backend)
    arena, caches, layout = build_caches("nhd", torch.float16, 4, 4, 2, 8, 2, device=dev)
    s, d = make(layout.num_slots)
    src, dst = torch.tensor(s, dtype=torch.int32, device=dev), torch.tensor(d, dtype=torch.int32, device=dev)
    before = arena.snapshot()
    with pytest.raises(InvalidArgumentError, match=match):
        ops.compact_kv(caches, layout, src, dst, validate=True)
    assert_arena_equal(arena.snapshot(), before)
    # validate=None follows VTOKEN_DEBUG_INVARIANTS.
    monkeypatch.setenv("VTOKEN_DEBUG_INVARIANTS", "1")
    with pytest.raises(InvalidArgumentError, match=match):
        ops.compact_kv(caches, layout, src, dst)
    assert_arena_equal(arena.snapshot(), before)


@pytest.mark.parametrize("backend", ["cuda", "triton", "torch"])
def test_unvalidated_out_of_range_moves_are_skipped(backend, monkeypatch):
    """With validation off, a move with an out-of-range slot never writes (memory safety)."""
    dev = device_for(backend)
    if backend == "cuda" and not HAS_EXT:
        pytest.skip("vtoken._C is not built")
    monkeypatch.setenv("VTOKEN_BACKEND", backend)
    monkeypatch.setenv("VTOKEN_DEBUG_INVARIANTS", "0")
    arena, caches, layout = build_caches("hnd", torch.float32, 4, 4, 2, 8, 2, device=dev)
    n = layout.num_slots
    src = torch.tensor([0, n, 3, -7, 2**31 - 1], dtype=torch.int32, device=dev)
    dst = torch.tensor([n + 1, 5, 6, 8, 9], dtype=torch.int32, device=dev)
    before = arena.snapshot()
    ops.compact_kv(caches, layout, src, dst)  # validate=None -> off
    expected = oracle(before, arena, caches, layout, src, dst)
    assert_arena_equal(arena.snapshot(), expected)
    assert (expected != before).any()  # the one valid move (3 -> 6) happened


def test_structural_errors():
    arena, caches, layout = build_caches("nhd", torch.float16, 4, 4, 2, 8, 2)
    before = arena.snapshot()
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    with pytest.raises(InvalidTypeError, match=r"src_slots: expected dtype in \[torch.int32\], got torch.int64"):
        ops.compact_kv(caches, layout, torch.tensor([0]), i32([1]))
    with pytest.raises(InvalidTypeError, match=r"dst_slots: expected 1 entries like src_slots, got 2"):
        ops.compact_kv(caches, layout, i32([0]), i32([1, 2]))
    with pytest.raises(InvalidTypeError, match=r"dst_slots: expected 1 dims"):
        ops.compact_kv(caches, layout, i32([0]), i32([[1]]))
    with pytest.raises(InvalidTypeError, match=r"kv_caches\[1\]: expected shape .* like layer 0"):
        ops.compact_kv([caches[0], caches[1][:2]], layout, i32([0]), i32([1]))
    with pytest.raises(InvalidTypeError, match=r"kv_caches\[1\]: expected dtype"):
        ops.compact_kv([caches[0], caches[1].view(torch.int16)], layout, i32([0]), i32([1]))
    with pytest.raises(InvalidTypeError, match=r"kv_caches\[0\]: expected dtype in"):
        ops.compact_kv([torch.zeros(4, 2, 4, 2, 8, dtype=torch.float64)], layout, i32([0]), i32([1]))
    with pytest.raises(InvalidArgumentError, match=r"layout: expected a layout that addresses the cache tensor"):
        bigger = KVLayout("nhd", 8, 4, 2, 2, 8, *[layout.stride_block, layout.stride_offset, layout.stride_kv, layout.stride_head])
        ops.compact_kv(caches, bigger, i32([0]), i32([1]))
    with pytest.raises(InvalidTypeError, match=r"kv_caches: expected a list of tensors"):
        ops.compact_kv(caches[0], layout, i32([0]), i32([1]))
    with pytest.raises(InvalidArgumentError, match=r"kv_caches: expected at least one layer"):
        ops.compact_kv([], layout, i32([0]), i32([1]))
    with pytest.raises(InvalidTypeError, match=r"layout: expected a vtoken.layout.KVLayout"):
        ops.compact_kv(caches, "nhd", i32([0]), i32([1]))
    assert_arena_equal(arena.snapshot(), before)


# (layout name, cache name): same sizes, another dim order. With block_size 4, 3 heads and 2
# (K, V) all different, the layout addresses exactly the cache's elements (bounds alone accept
# it) in the wrong order. Dims of equal size that swap cannot be told apart from the tensor.
LAYOUT_MISMATCHES = [("hnd", "nhd"), ("nhd", "hnd"), ("vllm_fused", "nhd"), ("vllm_flash", "hnd")]


@pytest.mark.parametrize("layout_name,cache_name", LAYOUT_MISMATCHES, ids=[f"{a}-on-{b}" for a, b in LAYOUT_MISMATCHES])
@pytest.mark.parametrize("backend", ["cuda", "triton", "torch"])
def test_layout_of_another_dim_order_is_rejected(backend, layout_name, cache_name, monkeypatch):
    dev = device_for(backend)
    if backend == "cuda" and not HAS_EXT:
        pytest.skip("vtoken._C is not built")
    from vtoken.layout import kv_cache_shape

    monkeypatch.setenv("VTOKEN_BACKEND", backend)
    arena, caches, right = build_caches(cache_name, torch.float16, 4, 4, 3, 8, 3, device=dev)
    wrong = KVLayout.from_tensor(torch.empty(kv_cache_shape(layout_name, 4, 4, 3, 8), dtype=torch.float16), layout_name)
    assert wrong.num_slots == right.num_slots and contracts.layout_extent(wrong) == caches[0].numel()
    src, dst = random_moves(wrong.num_slots, 6, 8, device=dev)
    before = arena.snapshot()
    for validate in (True, False):
        with pytest.raises(InvalidArgumentError, match=r"layout: expected a layout that addresses the cache tensor "
                                                       r"of shape .* dim for dim, got KVLayout\(name='" + layout_name):
            ops.compact_kv(caches, wrong, src, dst, validate=validate)
    assert_arena_equal(arena.snapshot(), before)
    ops.compact_kv(caches, right, src, dst)  # the cache's own layout passes the same check
    assert_arena_equal(arena.snapshot(), oracle(before, arena, caches, right, src, dst))


# ----------------------------------------------------------------- the C++ op


@needs_ext
def test_extension_registers_op():
    assert ops.extension_loaded()
    schema = str(torch.ops.vtoken.compact_kv.default._schema)
    assert schema.startswith("vtoken::compact_kv(Tensor(a!)[] kv_caches, Tensor src_slots, Tensor dst_slots")
    assert ops.select_backend("compact_kv", torch.device("cpu")) in ("cuda",) or os.environ.get("VTOKEN_BACKEND")


@needs_ext
def test_cpp_op_rejects_bad_arguments():
    arena, caches, layout = build_caches("nhd", torch.float16, 4, 4, 2, 8, 2)
    args = contracts.layout_op_args(layout)
    before = arena.snapshot()
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    with pytest.raises(RuntimeError, match=r"src_slots: expected dtype int32, got Long"):
        torch.ops.vtoken.compact_kv(caches, torch.tensor([0]), i32([1]), *args)
    with pytest.raises(RuntimeError, match=r"dst_slots: expected 1 entries like src_slots, got 2"):
        torch.ops.vtoken.compact_kv(caches, i32([0]), i32([1, 2]), *args)
    with pytest.raises(RuntimeError, match=r"kv_caches\[1\]: expected shape"):
        torch.ops.vtoken.compact_kv([caches[0], caches[1][:2]], i32([0]), i32([1]), *args)
    with pytest.raises(RuntimeError, match=r"layout: expected a layout that addresses the cache tensor"):
        torch.ops.vtoken.compact_kv(caches, i32([0]), i32([1]), 8, *args[1:])
    with pytest.raises(RuntimeError, match=r"expected at least one layer"):
        torch.ops.vtoken.compact_kv([], i32([0]), i32([1]), *args)
    assert_arena_equal(arena.snapshot(), before)


@needs_ext
@pytest.mark.parametrize(
    "variant,dtype,head_dim,misalign,vec_bytes",
    [
        ("nhd", torch.float16, 64, False, 16),
        ("nhd", torch.float16, 64, True, 2),  # layer 1 starts one element off
        ("vllm_fused", torch.bfloat16, 20, False, 16),  # 80-byte rows, 16-byte aligned strides
        ("hnd", torch.float16, 20, False, 8),  # 40-byte rows
        ("mla", torch.float32, 3, False, 4),
        ("nhd_padded", torch.float8_e4m3fn if hasattr(torch, "float8_e4m3fn") else torch.uint8, 8, False, 1),
    ],
)
def test_cuda_access_width(variant, dtype, head_dim, misalign, vec_bytes):
    """The CUDA kernel uses the widest access that every row start allows."""
    _, caches, layout = build_caches(variant, dtype, 4, 16, 2, head_dim, 2, misalign=misalign)
    src, dst = random_moves(layout.num_slots, 5, 0)
    width, threads, blocks = cuda_emulation_ops().compact_kv_cuda_config(caches, src, dst, *contracts.layout_op_args(layout))
    assert width == vec_bytes
    assert threads % 32 == 0 and 32 <= threads <= 256
    vectors = 2 * layout.rows_per_token * layout.head_dim * caches[0].element_size() // width
    assert blocks == 5 * -(-vectors // (threads * 4))  # moves x chunks of threads x kUnroll vectors


@needs_ext
def test_cuda_emulated_more_layers_than_one_launch_holds():
    """300 layers: the CUDA path splits into launches of 256 layer pointers."""
    arena, caches, layout = build_caches("mla", torch.bfloat16, 6, 4, 1, 8, 300, seed=4)
    src, dst = random_moves(layout.num_slots, 7, 4)
    before = arena.snapshot()
    cuda_emulation_ops().compact_kv_cuda_emulated(caches, src, dst, *contracts.layout_op_args(layout))
    assert_arena_equal(arena.snapshot(), oracle(before, arena, caches, layout, src, dst))


@needs_ext
def test_shipped_extension_has_no_test_ops():
    """vtoken._C registers the ops, not the test-only CUDA emulation (csrc/testing/, built by these tests)."""
    shipped = {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("vtoken::")}
    assert "vtoken::compact_kv" in shipped
    assert not {n for n in shipped if "emulated" in n or "cuda_config" in n or n.startswith("vtoken::_")}, shipped
    assert not hasattr(torch.ops.vtoken, "_compact_kv_cuda_emulated")
    assert not hasattr(torch.ops.vtoken, "compact_kv_cuda_emulated")


@needs_ext
@pytest.mark.parametrize("variant,dtype", [("nhd", torch.float16), ("mla", torch.float32), ("vllm_fused_lbnhc", torch.bfloat16)])
def test_opcheck(variant, dtype):
    _, caches, layout = build_caches(variant, dtype, 5, 4, 2, 8, 3)
    src, dst = random_moves(layout.num_slots, 6, 11)
    torch.library.opcheck(torch.ops.vtoken.compact_kv.default, (caches, src, dst, *contracts.layout_op_args(layout)))


@needs_ext
def test_meta_kernel_accepts_meta_tensors():
    caches = [torch.empty(4, 2, 4, 2, 8, dtype=torch.float16, device="meta") for _ in range(2)]
    slots = torch.empty(3, dtype=torch.int32, device="meta")
    layout = KVLayout.from_tensor(caches[0], "nhd")
    assert torch.ops.vtoken.compact_kv(caches, slots, slots, *contracts.layout_op_args(layout)) is None
    with pytest.raises(RuntimeError, match=r"src_slots: expected dtype int32"):
        torch.ops.vtoken.compact_kv(caches, slots.long(), slots, *contracts.layout_op_args(layout))


# ----------------------------------------------------------------- Triton AOT


def _aot_specs():
    """The launcher's real (args, constexprs, options) for every variant and element size."""
    from vtoken_kernels import compact_kv as tk

    specs = []
    # Every variant once, the three element sizes in rotation (nhd gets fp16).
    for i, variant in enumerate(VARIANTS):
        for dtype in [(torch.float16, torch.float32, torch.uint8)[i % 3]]:
            _, caches, layout = build_caches(variant, dtype, 4, 16, 2, 64, 2)
            specs.append((f"{variant}-{dtype}", tk._launch_args(caches, layout, *[torch.zeros(1, dtype=torch.int32)] * 2)))
    return specs


def _aot_compile_all() -> None:
    """Compile every spec for every AOT arch; run in a process without TRITON_INTERPRET (see aot_helpers)."""
    from vtoken_kernels import compact_kv as tk

    kernel = tk._compact_kv_kernel
    tl_int = {torch.uint8: "*u8", torch.int16: "*i16", torch.int32: "*i32"}
    for arch in AOT_ARCHS:
        for spec_id, (args, constexprs, options) in _aot_specs():
            signature = {}
            for name, value in zip(kernel.arg_names, args):
                if isinstance(value, torch.Tensor):
                    signature[name] = tl_int.get(value.dtype, "*i64")
                else:
                    signature[name] = "i64" if abs(value) >= 2**31 else "i32"
            # Tensors from the caching allocator are 16-byte aligned: mark them so.
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
                     if signature.get(n, "").startswith("*")}
            compiled = compile_kernel(kernel, signature, constexprs, arch, options, label=spec_id, attrs=attrs)
            if spec_id == "nhd-torch.float16":
                # ALIGN=8 int16 elements: the row copy uses 16-byte vector accesses.
                assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", compiled.asm["ptx"]), spec_id
                assert re.search(r"st\.global(\.\w+)*\.v4\.b32", compiled.asm["ptx"]), spec_id


def test_aot_compile_for_sm90_sm80():
    """Compile the kernel with the launcher's configs for sm_90 and sm_80, no GPU needed.

    One fresh process without TRITON_INTERPRET compiles them all (see aot_helpers).
    """
    compiled = compile_module_in_fresh_process("test_compact_kv")
    assert compiled == expected_compiles(spec_id for spec_id, _ in _aot_specs())


# ----------------------------------------------------------------- layer-offset cache


def test_layer_offsets_cache_stays_bounded_and_exact(monkeypatch):
    """Many distinct sets of caches: the offsets cache never exceeds its size, every launch stays exact."""
    from vtoken_kernels import compact_kv as kmod

    monkeypatch.setattr(kmod, "_OFFSETS_CACHE", type(kmod._OFFSETS_CACHE)())
    n_sets = 2 * kmod._OFFSETS_CACHE_SIZE + 3
    keys = set()
    for seed in range(n_sets):  # random gaps between layers: a distinct relative layout (key) per set
        dev = device_for("triton")
        arena, caches, layout = build_caches("nhd", torch.float16, 4, 4, 1, 8, 5, device=dev, seed=100 + seed)
        src, dst = random_moves(layout.num_slots, 5, seed, device=dev)
        before = arena.snapshot()
        run_backend("triton", caches, layout, src, dst, validate=True)
        assert_arena_equal(arena.snapshot(), oracle(before, arena, caches, layout, src, dst))
        assert len(kmod._OFFSETS_CACHE) <= kmod._OFFSETS_CACHE_SIZE
        keys.add(next(reversed(kmod._OFFSETS_CACHE)))
    assert len(keys) > kmod._OFFSETS_CACHE_SIZE + 2  # the bound was really exercised
    assert len(kmod._OFFSETS_CACHE) == kmod._OFFSETS_CACHE_SIZE
    for (device, values), entry in kmod._OFFSETS_CACHE.items():  # an entry holds exactly its key
        assert entry.tensor.device == device and entry.tensor.dtype == torch.int64
        assert entry.tensor.tolist() == list(values)


def test_layer_offsets_cache_hit_is_lru_and_keyed_by_relative_layout(monkeypatch):
    """A hit refreshes the entry (the least recently used one goes); caches with the same layer spacing share one."""
    from vtoken_kernels import compact_kv as kmod

    monkeypatch.setattr(kmod, "_OFFSETS_CACHE_SIZE", 2)
    monkeypatch.setattr(kmod, "_OFFSETS_CACHE", type(kmod._OFFSETS_CACHE)())
    buf = torch.zeros(64, dtype=torch.int16)
    a, b, c = ([buf[o: o + 4], buf[o + gap: o + gap + 4]] for o, gap in ((0, 8), (0, 16), (0, 24)))
    shifted = [buf[4:8], buf[12:16]]  # a's layers 8 elements apart, at other addresses
    ta = kmod._layer_offsets(a)
    kmod._layer_offsets(b)
    assert kmod._layer_offsets(shifted) is ta  # same key: (device, (0, 8))
    kmod._layer_offsets(c)  # evicts b, the least recently used
    assert [v for _, v in kmod._OFFSETS_CACHE] == [(0, 8), (0, 24)]
    assert ta.tolist() == [0, 8]


class _FakeEvent:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done


def test_evicted_staging_lives_until_its_copy_completed(monkeypatch):
    """An entry evicted while its H2D copy may be in flight keeps its pinned staging until the event completes."""
    from vtoken_kernels import compact_kv as kmod

    monkeypatch.setattr(kmod, "_RETIRED_STAGING", type(kmod._RETIRED_STAGING)())
    pending, done = _FakeEvent(), _FakeEvent()
    done.done = True
    staging = [torch.arange(3), torch.arange(4)]
    kmod._retire(kmod._Offsets(torch.arange(3), pending, staging[0]))
    kmod._retire(kmod._Offsets(torch.arange(4), done, staging[1]))  # completed: released at once
    assert [s for _, s in kmod._RETIRED_STAGING] == [staging[0]]
    kmod._poll_retired()
    assert [s for _, s in kmod._RETIRED_STAGING] == [staging[0]]  # still in flight: kept
    pending.done = True
    kmod._poll_retired()
    assert len(kmod._RETIRED_STAGING) == 0


# ----------------------------------------------------------------- GPU


GPU_VARIANTS = ["vllm_flash", "vllm_fused", "vllm_fused_blhnc", "nhd", "hnd", "mla", "nhd_padded", "split_kv"]
# fp16 and bf16 share the int16 kernels: one of them; misaligned layers (one
# element off) force the narrower CUDA accesses on three layouts.
GPU_CASES = [(v, dt, False) for v in GPU_VARIANTS for dt in DTYPES if dt != torch.float16] + [
    (v, torch.float16, True) for v in ("nhd", "vllm_fused", "mla")
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant,dtype,misalign", GPU_CASES, ids=lambda x: str(x))
def test_gpu_cuda_and_triton_match_reference(variant, dtype, misalign):
    from vtoken_kernels.compact_kv import compact_kv as triton_compact_kv

    results = {}
    for backend in ("torch", "triton", "cuda"):
        if backend == "cuda" and not extension_runs_on_gpu():
            continue
        arena, caches, layout = build_caches(variant, dtype, 64, 16, 4, 128, 5, device="cuda", seed=3, misalign=misalign)
        src, dst = random_moves(layout.num_slots, 300, 3, device="cuda")
        contracts.check_compact_kv_args(caches, layout, src, dst, validate=True)
        if backend == "torch":
            ref.compact_kv(caches, layout, src, dst)
        elif backend == "triton":
            triton_compact_kv(caches, layout, src, dst)
        else:
            torch.ops.vtoken.compact_kv(caches, src, dst, *contracts.layout_op_args(layout))
        torch.cuda.synchronize()
        results[backend] = arena.snapshot()
    for backend, got in results.items():
        assert_arena_equal(got, results["torch"])


@pytest.mark.gpu
@pytest.mark.skipif(not extension_runs_on_gpu(), reason="vtoken._C is not built or cannot run on this GPU")
def test_gpu_more_layers_than_one_launch_holds():
    """300 layers take two launches of the CUDA kernel (256 base pointers each)."""
    arena, caches, layout = build_caches("mla", torch.bfloat16, 8, 4, 1, 64, 300, device="cuda", seed=4)
    src, dst = random_moves(layout.num_slots, 10, 4, device="cuda")
    before = arena.snapshot()
    torch.ops.vtoken.compact_kv(caches, src, dst, *contracts.layout_op_args(layout))
    torch.cuda.synchronize()
    assert_arena_equal(arena.snapshot(), oracle(before, arena, caches, layout, src.cpu(), dst.cpu()))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_cuda_graph_replays_padded_buffer(backend, monkeypatch):
    """A fixed-address, PAD-padded move buffer captured once replays new moves."""
    if backend == "cuda" and not extension_runs_on_gpu():
        pytest.skip("vtoken._C is not built or cannot run on this GPU")
    monkeypatch.setenv("VTOKEN_BACKEND", backend)
    arena, caches, layout = build_caches("vllm_fused", torch.float16, 32, 16, 4, 64, 4, device="cuda", seed=6)
    src_buf = torch.full((64,), -1, dtype=torch.int32, device="cuda")
    dst_buf = torch.full((64,), -1, dtype=torch.int32, device="cuda")
    ops.compact_kv(caches, layout, src_buf, dst_buf, validate=False)  # warm up (JIT, offsets cache)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.compact_kv(caches, layout, src_buf, dst_buf, validate=False)
    for seed in (1, 2):
        src, dst = random_moves(layout.num_slots, 40, seed, device="cuda")
        src_buf.fill_(-1)
        dst_buf.fill_(-1)
        src_buf[:40].copy_(src)
        dst_buf[:40].copy_(dst)
        torch.cuda.synchronize()
        before = arena.snapshot()
        graph.replay()
        torch.cuda.synchronize()
        assert_arena_equal(arena.snapshot(), oracle(before, arena, caches, layout, src.cpu(), dst.cpu()))


@pytest.mark.gpu
def test_gpu_triton_first_launch_on_new_caches_does_not_sync(monkeypatch):
    """The layer offsets of a new set of caches go up by an async copy: no host sync, under sync debug mode."""
    from vtoken_kernels import compact_kv as kmod

    warm = build_caches("nhd", torch.float16, 8, 16, 2, 64, 3, device="cuda", seed=8)
    src, dst = random_moves(warm[2].num_slots, 20, 8, device="cuda")
    kmod.compact_kv(warm[1], warm[2], src, dst)  # JIT compile outside the check
    monkeypatch.setattr(kmod, "_OFFSETS_CACHE", type(kmod._OFFSETS_CACHE)())  # the next launch misses
    arena, caches, layout = build_caches("nhd", torch.float16, 8, 16, 2, 64, 3, device="cuda", seed=9)
    torch.cuda.synchronize()
    before = arena.snapshot()
    stream = torch.cuda.Stream()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(stream):  # a side stream, as the relocation stream
            kmod.compact_kv(caches, layout, src, dst)
        kmod.compact_kv(caches, layout, torch.full_like(src, -1), dst)  # a hit from another stream (PAD only)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert_arena_equal(arena.snapshot(), oracle(before, arena, caches, layout, src.cpu(), dst.cpu()))
    (entry,) = kmod._OFFSETS_CACHE.values()  # uploaded once, asynchronously, and waited on by both streams
    assert entry.event is not None and entry.staging.is_pinned() and len(entry.streams) == 2
