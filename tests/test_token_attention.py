"""token_attention: Triton (interpreter on CPU) vs a float64 torch oracle.

Tolerance table (|triton - oracle| <= atol + rtol * |oracle|, per dtype). The
inputs handed to both are the same fp16/bf16/fp32 values, so the only error is
what the kernel rounds, with unit roundoff u of the dtype:

* the output is rounded to the dtype once: rtol = 2u;
* P is rounded to the K/V dtype before P @ V (flash attention does this to use
  the tensor cores): sum_j |delta p_j| |v_j| <= u * max|v|, so atol = 2u * max|v|
  (max over the listed V rows of the case);
* q.k and the softmax run in fp32 (and exp2 is ``ex2.approx`` on the GPU):
  relative errors ~1e-6, which sets fp32's floor: u is taken as 2^-16 there, a
  margin over the summation-order error of a few hundred fp32 terms.

Key scores are fp32 sums of probabilities computed from the same inputs with
fp32 arithmetic for every dtype (P is never rounded to the K/V dtype there), so
one bound serves all dtypes: rtol 1e-4, atol 1e-5 per unit of probability mass
(probabilities are <= 1 and their error is relative ~1e-6).
"""
from __future__ import annotations

import random
import zlib

import pytest
import torch
import triton

from aot_helpers import AOT_ARCHS, compile_kernel, compile_module_in_fresh_process, expected_compiles
from kernel_device import KERNEL_DEVICE
from vtoken.device import ops
from vtoken.errors import InvalidArgumentError, InvalidTypeError
from vtoken.layout import KVLayout, kv_cache_shape
from vtoken.reference.token_attention import token_attention as ref_attention
from vtoken_kernels import contracts
from vtoken_kernels import token_attention as tri_mod
from vtoken_kernels.token_attention import token_attention as tri_attention

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LAYOUTS = ["vllm_flash", "vllm_fused", "nhd", "hnd"]  # vllm_flash: vLLM 0.32 FlashAttention [2, nb, S, H, D]
# (head_dim, num_kv_heads, GQA group). Group 1 = MHA, 4 = GQA; one non-power-of-2 head_dim.
HEAD_CASES = [(64, 2, 1), (128, 1, 4), (256, 1, 4), (96, 2, 1)]
UNIT_ROUNDOFF = {torch.float32: 2.0**-16, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
KEY_SCORE_TOL = dict(rtol=1e-4, atol=1e-5)
DEV = KERNEL_DEVICE  # every tensor of these tests, oracles included (tests/kernel_device.py)
# The decode and prefill matrices take the device as a parameter, gpu-marked where a GPU is, so that
# bench/gpu_check.sh's `-m gpu` step runs them on CUDA tensors (the compiled kernels).
DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else ["cpu"]
# vtoken.device.ops backends on the test device: "cuda" is the extension's C++ CPU kernel when vtoken._C has it
# (CPU tensors only: on a GPU machine DEV is CUDA and Triton compiles).
OPS_BACKENDS = ["triton", "torch"] + (["cuda"] if DEV == "cpu" and ops.has_extension_op("token_attention") else [])


# ---------------------------------------------------------------- helpers


def make_cache(layout_name, num_blocks, block_size, num_kv_heads, head_dim, dtype, gen, device=DEV):
    shape = kv_cache_shape(layout_name, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    return cache, KVLayout.from_tensor(cache, layout_name)


def make_lists(lens, num_slots, pad_tail, rng, device=DEV):
    """Random unique slots, request r gets lens[r] of them; PAD tail of pad_tail entries."""
    slots = rng.sample(range(num_slots), sum(lens))
    idx = torch.tensor(slots + [-1] * pad_tail, dtype=torch.int32, device=device)
    ptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return idx, ptr


def slot_rows(cache, layout):
    """Canonical [num_blocks, block_size, 2, H, D] view to read / poison slots."""
    return layout.canonical_view(cache)


def poison_unlisted(cache, layout, kv_indices, value):
    """Fill every slot that is not in ``kv_indices`` with ``value``; return the count."""
    listed = set(int(s) for s in kv_indices.tolist() if s >= 0)
    view = slot_rows(cache, layout)
    n = 0
    for s in range(layout.num_slots):
        if s not in listed:
            view[s // layout.block_size, s % layout.block_size] = value
            n += 1
    return n


def v_absmax(cache, layout, kv_indices):
    s = kv_indices[kv_indices >= 0].long()
    view = slot_rows(cache, layout)
    if s.numel() == 0:
        return 1.0
    return float(view[s // layout.block_size, s % layout.block_size, 1].float().abs().max())


def assert_close_to_oracle(out, oracle, dtype, vmax):
    u = UNIT_ROUNDOFF[dtype]
    torch.testing.assert_close(out.double(), oracle, rtol=2 * u, atol=2 * u * vmax)


def assert_scores_close(ks, oracle_ks, mass=1.0):
    torch.testing.assert_close(ks.double(), oracle_ks, rtol=KEY_SCORE_TOL["rtol"], atol=KEY_SCORE_TOL["atol"] * mass)


# ---------------------------------------------------------------- decode


@pytest.mark.parametrize("head_case", HEAD_CASES, ids=lambda c: f"D{c[0]}-kv{c[1]}-g{c[2]}")
@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_decode_matches_oracle(device, dtype, layout_name, head_case):
    head_dim, num_kv_heads, group = head_case
    seed = zlib.crc32(f"decode {dtype} {layout_name} {head_case}".encode())
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    block_size = [16, 5, 1, 16][LAYOUTS.index(layout_name)]
    num_blocks = 160 // block_size
    cache, lay = make_cache(layout_name, num_blocks, block_size, num_kv_heads, head_dim, dtype, gen, device=device)
    lens = [1, 67, 0, 23]  # odd sizes; 67 > one BLOCK_N tile; 0 = a request with no live token
    idx, ptr = make_lists(lens, lay.num_slots, pad_tail=5, rng=rng, device=device)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen).to(device=device, dtype=dtype)
    out, ks = tri_attention(q, cache, lay, idx, ptr, return_key_scores=True)
    oracle, oracle_ks = ref_attention(q, cache, lay, idx, ptr, return_key_scores=True, compute_dtype=torch.float64)
    assert out.dtype == dtype and ks.dtype == torch.float32 and ks.shape == (idx.numel(), num_kv_heads)
    assert_close_to_oracle(out, oracle, dtype, v_absmax(cache, lay, idx))
    assert_scores_close(ks, oracle_ks, mass=group)
    assert torch.equal(out[2], torch.zeros_like(out[2])), "a request with no live token outputs zeros"


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_split_matches_oracle(dtype, num_splits):
    """Flash-decoding: kv range split across programs, merged by the reduce kernel."""
    gen, rng = torch.Generator().manual_seed(num_splits), random.Random(num_splits)
    cache, lay = make_cache("nhd", 24, 16, 2, 64, dtype, gen)
    lens = [150, 1, 0, 65, 130]  # splits that are empty, partial, and several tiles long
    idx, ptr = make_lists(lens, lay.num_slots, pad_tail=3, rng=rng)
    q = torch.randn(len(lens), 8, 64, generator=gen).to(DEV).to(dtype)
    out, ks = tri_attention(q, cache, lay, idx, ptr, return_key_scores=True, num_splits=num_splits)
    one, ks_one = tri_attention(q, cache, lay, idx, ptr, return_key_scores=True, num_splits=1)
    oracle, oracle_ks = ref_attention(q, cache, lay, idx, ptr, return_key_scores=True, compute_dtype=torch.float64)
    vmax = v_absmax(cache, lay, idx)
    assert_close_to_oracle(out, oracle, dtype, vmax)
    assert_close_to_oracle(one, oracle, dtype, vmax)
    assert_scores_close(ks, oracle_ks, mass=4)
    assert_scores_close(ks_one, oracle_ks, mass=4)


# ---------------------------------------------------------------- varlen prefill


@pytest.mark.parametrize("head_case", HEAD_CASES[:3], ids=lambda c: f"D{c[0]}-kv{c[1]}-g{c[2]}")
@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_prefill_matches_oracle(device, dtype, layout_name, head_case):
    head_dim, num_kv_heads, group = head_case
    seed = zlib.crc32(f"prefill {dtype} {layout_name} {head_case}".encode())
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    block_size = [16, 5, 1, 16][LAYOUTS.index(layout_name)]
    cache, lay = make_cache(layout_name, 200 // block_size, block_size, num_kv_heads, head_dim, dtype, gen, device=device)
    # (n_live, n_new): chunk after past tokens, whole prompt (no past), a decode-like
    # step, a request with nothing new, and a chunk longer than one query tile at group 1.
    reqs = [(40, 9), (13, 13), (30, 1), (7, 0), (80, 70 if group == 1 else 20)]
    idx, ptr = make_lists([r[0] for r in reqs], lay.num_slots, pad_tail=4, rng=rng, device=device)
    q_indptr = torch.tensor([0] + torch.tensor([r[1] for r in reqs]).cumsum(0).tolist(), dtype=torch.int32,
                            device=device)
    q = torch.randn(int(q_indptr[-1]), num_kv_heads * group, head_dim, generator=gen).to(device=device, dtype=dtype)
    out, ks = tri_attention(q, cache, lay, idx, ptr, q_indptr, return_key_scores=True)
    oracle, oracle_ks = ref_attention(q, cache, lay, idx, ptr, q_indptr, return_key_scores=True, compute_dtype=torch.float64)
    assert_close_to_oracle(out, oracle, dtype, v_absmax(cache, lay, idx))
    assert_scores_close(ks, oracle_ks, mass=group * 70)


def test_prefill_is_causal_within_the_chunk():
    """Query i of the chunk ignores chunk keys after it: changing a later key's K/V leaves it unchanged."""
    gen, rng = torch.Generator().manual_seed(5), random.Random(5)
    cache, lay = make_cache("vllm_flash", 8, 16, 1, 64, torch.float32, gen)
    idx, ptr = make_lists([20], lay.num_slots, pad_tail=0, rng=rng)
    q_indptr = torch.tensor([0, 6], dtype=torch.int32, device=DEV)  # the last 6 list entries are the chunk
    q = torch.randn(6, 2, 64, generator=gen).to(DEV)
    before = tri_attention(q, cache, lay, idx, ptr, q_indptr)
    last = int(idx[19])
    slot_rows(cache, lay)[last // 16, last % 16] = 1e4  # the K/V of the chunk's last token
    after = tri_attention(q, cache, lay, idx, ptr, q_indptr)
    assert torch.equal(before[:5], after[:5]), "queries 0..4 must not see the 6th chunk token"
    assert not torch.equal(before[5], after[5]), "query 5 must see its own token"


def test_decode_equals_prefill_with_one_query_per_request():
    gen, rng = torch.Generator().manual_seed(9), random.Random(9)
    cache, lay = make_cache("hnd", 12, 16, 2, 128, torch.float16, gen)
    idx, ptr = make_lists([5, 50, 17], lay.num_slots, pad_tail=2, rng=rng)
    q = torch.randn(3, 8, 128, generator=gen).to(DEV).half()
    dec, ks_dec = tri_attention(q, cache, lay, idx, ptr, return_key_scores=True)
    pre, ks_pre = tri_attention(q, cache, lay, idx, ptr, torch.arange(4, dtype=torch.int32, device=DEV),
                                return_key_scores=True)
    torch.testing.assert_close(dec, pre, rtol=0, atol=2e-3)  # same math, different tiling of padded rows
    torch.testing.assert_close(ks_dec, ks_pre, **KEY_SCORE_TOL)


# ---------------------------------------------------------------- probability sums


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_key_scores_sum_to_query_mass(mode):
    """Per request and kv head, key scores sum to (#queries with a key) * group, like the oracle."""
    gen, rng = torch.Generator().manual_seed(3), random.Random(3)
    group, num_kv_heads = 4, 2
    cache, lay = make_cache("vllm_fused", 16, 16, num_kv_heads, 64, torch.bfloat16, gen)
    lens = [33, 0, 90, 1]
    idx, ptr = make_lists(lens, lay.num_slots, pad_tail=6, rng=rng)
    if mode == "decode":
        q_indptr, n_new = None, [1, 1, 1, 1]
    else:
        n_new = [5, 0, 12, 1]
        q_indptr = torch.tensor([0] + torch.tensor(n_new).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q = torch.randn(sum(n_new), num_kv_heads * group, 64, generator=gen).to(DEV).bfloat16()
    _, ks = tri_attention(q, cache, lay, idx, ptr, q_indptr, return_key_scores=True)
    _, oracle_ks = ref_attention(q, cache, lay, idx, ptr, q_indptr, return_key_scores=True, compute_dtype=torch.float64)
    for r, n in enumerate(lens):
        a, b = int(ptr[r]), int(ptr[r + 1])
        mass = (n_new[r] if n > 0 else 0) * group
        expected = torch.full((num_kv_heads,), float(mass), dtype=torch.float64, device=DEV)
        torch.testing.assert_close(ks[a:b].double().sum(0), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(oracle_ks[a:b].sum(0), expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(ks[int(ptr[-1]):], torch.zeros_like(ks[int(ptr[-1]):])), "rows past kv_indptr[-1] are 0"


# ---------------------------------------------------------------- PAD and dead tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_entries_past_indptr_end_are_ignored(dtype):
    """Entries past kv_indptr[-1] (PAD, or stale slots of poisoned data) are never read."""
    gen, rng = torch.Generator().manual_seed(11), random.Random(11)
    cache, lay = make_cache("nhd", 10, 16, 2, 64, dtype, gen)
    lens = [12, 31]
    slots = rng.sample(range(lay.num_slots), sum(lens) + 8)
    listed, stale = slots[: sum(lens)], slots[sum(lens) :]
    ptr = torch.tensor([0, 12, 43], dtype=torch.int32, device=DEV)
    q = torch.randn(2, 4, 64, generator=gen).to(DEV).to(dtype)
    pad = torch.tensor(listed + [-1] * 8, dtype=torch.int32, device=DEV)
    out_pad, ks_pad = tri_attention(q, cache, lay, pad, ptr, return_key_scores=True)
    view = slot_rows(cache, lay)
    for s in stale:
        view[s // 16, s % 16] = float("nan")
    stale_tail = torch.tensor(listed + stale, dtype=torch.int32, device=DEV)
    out_stale, ks_stale = tri_attention(q, cache, lay, stale_tail, ptr, return_key_scores=True)
    assert torch.equal(out_pad, out_stale)
    assert torch.equal(ks_pad, ks_stale)
    assert torch.equal(ks_stale[43:], torch.zeros(8, 2, device=DEV))


def test_pad_inside_a_request_is_masked():
    """A PAD entry inside a range contributes nothing and scores 0; otherwise same as the list without it."""
    gen, rng = torch.Generator().manual_seed(12), random.Random(12)
    cache, lay = make_cache("vllm_flash", 10, 16, 1, 64, torch.float32, gen)
    slots = rng.sample(range(lay.num_slots), 30)
    with_pad = torch.tensor(slots[:10] + [-1] + slots[10:20] + [-1, -1] + slots[20:], dtype=torch.int32, device=DEV)
    ptr_pad = torch.tensor([0, 11, 33], dtype=torch.int32, device=DEV)
    packed = torch.tensor(slots, dtype=torch.int32, device=DEV)
    ptr = torch.tensor([0, 10, 30], dtype=torch.int32, device=DEV)
    q = torch.randn(2, 2, 64, generator=gen).to(DEV)
    out_pad, ks_pad = tri_attention(q, cache, lay, with_pad, ptr_pad, return_key_scores=True)
    out, ks = tri_attention(q, cache, lay, packed, ptr, return_key_scores=True)
    torch.testing.assert_close(out_pad, out, rtol=1e-6, atol=1e-6)
    keep = with_pad >= 0
    torch.testing.assert_close(ks_pad[keep], ks, **KEY_SCORE_TOL)
    assert torch.equal(ks_pad[~keep], torch.zeros(3, 1, device=DEV))
    ref_pad = ref_attention(q, cache, lay, with_pad, ptr_pad, compute_dtype=torch.float64)
    torch.testing.assert_close(out_pad.double(), ref_pad, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), 6e4])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_dead_tokens_never_influence_the_output(mode, poison):
    """Unlisted slots (dead tokens, inside live blocks too) are never read: poisoning them changes no bit."""
    gen, rng = torch.Generator().manual_seed(13), random.Random(13)
    cache, lay = make_cache("vllm_fused", 8, 16, 2, 64, torch.float16, gen)
    # Live tokens scattered over every block, so each block holds dead and live tokens.
    idx, ptr = make_lists([20, 37], lay.num_slots, pad_tail=4, rng=rng)
    q_indptr = None if mode == "decode" else torch.tensor([0, 4, 11], dtype=torch.int32, device=DEV)
    q = torch.randn(2 if mode == "decode" else 11, 8, 64, generator=gen).to(DEV).half()
    clean, ks_clean = tri_attention(q, cache, lay, idx, ptr, q_indptr, return_key_scores=True)
    assert poison_unlisted(cache, lay, idx, poison) == lay.num_slots - 57
    dirty, ks_dirty = tri_attention(q, cache, lay, idx, ptr, q_indptr, return_key_scores=True)
    assert torch.isfinite(dirty).all()
    assert torch.equal(clean.view(torch.int16), dirty.view(torch.int16))
    assert torch.equal(ks_clean, ks_dirty)
    ref_dirty = ref_attention(q, cache, lay, idx, ptr, q_indptr, compute_dtype=torch.float64)
    assert torch.isfinite(ref_dirty).all()


# ---------------------------------------------------------------- non-finite inputs
# The NaN contract of the reference's module docstring, written out as an independent oracle of
# WHICH rows and key scores are NaN; every backend must produce exactly that mask, and agree
# with the float64 oracle everywhere else.

NONFINITE = ["q", "k", "v_nan", "v_inf"]
NF_GROUP, NF_KV_HEADS, NF_DIM = 2, 2, 32
NF_LENS = [12, 20, 0]  # listed keys per request; the last request has none
NF_KEY = 15  # list position (in request 1) of the poisoned key
NF_HEAD = 1  # poisoned kv head (query heads 2 and 3)


def _nonfinite_case(mode, where, dtype):
    """(q, cache, layout, kv_indices, kv_indptr, q_indptr, n_new) with one poisoned value."""
    gen, rng = torch.Generator().manual_seed(41), random.Random(41)
    cache, lay = make_cache("nhd", 8, 16, NF_KV_HEADS, NF_DIM, dtype, gen)
    n_new = [1, 1, 1] if mode == "decode" else [4, 6, 0]
    idx, ptr = make_lists(NF_LENS, lay.num_slots, pad_tail=3, rng=rng)
    q_indptr = None if mode == "decode" else torch.tensor([0, 4, 10, 10], dtype=torch.int32, device=DEV)
    q = torch.randn(sum(n_new), NF_KV_HEADS * NF_GROUP, NF_DIM, generator=gen).to(DEV).to(dtype)
    if where == "q":
        q[sum(n_new[:2]) - 1, NF_HEAD * NF_GROUP + 1, 5] = float("nan")  # request 1's last query
        if mode == "decode":
            q[2, 0, 0] = float("nan")  # request 2 attends nothing: zeros whatever q holds
    else:
        slot = int(idx[NF_LENS[0] + NF_KEY])
        kv, value = {"k": (0, float("nan")), "v_nan": (1, float("nan")), "v_inf": (1, float("inf"))}[where]
        slot_rows(cache, lay)[slot // 16, slot % 16, kv, NF_HEAD, 3] = value
    return q, cache, lay, idx, ptr, q_indptr, n_new


def _nonfinite_oracle(where, n_new, num_q_heads, nnz_max):
    """Boolean masks (out rows [num_q, Hq], key scores [nnz_max, Hkv]) that must be NaN."""
    out = torch.zeros(sum(n_new), num_q_heads, dtype=torch.bool, device=DEV)
    ks = torch.zeros(nnz_max, NF_KV_HEADS, dtype=torch.bool, device=DEV)
    for r, n_live in enumerate(NF_LENS):
        q0, k0 = sum(n_new[:r]), sum(NF_LENS[:r])
        for i in range(n_new[r]):
            attended = range(k0, k0 + max(0, min(n_live, n_live - n_new[r] + i + 1)))
            for h in range(num_q_heads):
                g = h // NF_GROUP
                key_in = g == NF_HEAD and r == 1 and k0 + NF_KEY in attended
                bad_score = (where == "q" and (q0 + i, h) == (sum(n_new[:2]) - 1, NF_HEAD * NF_GROUP + 1)) or (
                    where == "k" and key_in
                )
                if len(attended) and (bad_score or (where.startswith("v") and key_in)):
                    out[q0 + i, h] = True
                if len(attended) and bad_score:
                    ks[list(attended), g] = True
    return out, ks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("where", NONFINITE)
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_nonfinite_inputs_propagate_the_same_in_every_backend(mode, where, dtype, monkeypatch):
    """A NaN in q, or a NaN in K / non-finite V of an attended key, makes exactly the rows that read it NaN."""
    q, cache, lay, idx, ptr, q_indptr, n_new = _nonfinite_case(mode, where, dtype)
    want_out, want_ks = _nonfinite_oracle(where, n_new, q.shape[1], idx.numel())
    assert want_out.any() and not want_out.all()  # the case poisons some rows, not all
    results = {}
    for backend in OPS_BACKENDS:
        monkeypatch.setenv("VTOKEN_BACKEND", backend)
        results[backend] = ops.token_attention(q, cache, lay, idx, ptr, q_indptr, return_key_scores=True)
    if mode == "decode":  # flash-decoding: the poisoned key lands in one of three splits
        results["triton-split"] = tri_attention(q, cache, lay, idx, ptr, return_key_scores=True, num_splits=3)
    oracle, oracle_ks = ref_attention(q, cache, lay, idx, ptr, q_indptr, return_key_scores=True,
                                      compute_dtype=torch.float64)
    results["oracle"] = (oracle, oracle_ks)
    # score_out: an entry is NaN exactly when one of its key's kv-head scores is.
    kv_pos = torch.arange(idx.numel(), dtype=torch.int32, device=DEV)
    starts = torch.zeros(len(NF_LENS), dtype=torch.int64, device=DEV)
    for backend in OPS_BACKENDS:
        monkeypatch.setenv("VTOKEN_BACKEND", backend)
        buf = torch.zeros(idx.numel(), device=DEV)
        ops.token_attention(q, cache, lay, idx, ptr, q_indptr, score_out=buf, mirror_starts=starts, kv_pos=kv_pos)
        assert torch.equal(torch.isnan(buf), want_ks.any(1)), backend
    vmax = float(torch.nan_to_num(slot_rows(cache, lay)[..., 1, :, :].float(), nan=0, posinf=0).abs().max())
    for name, (out, ks) in results.items():
        assert torch.equal(torch.isnan(out), want_out[:, :, None].expand_as(out)), name
        assert torch.equal(torch.isnan(ks), want_ks), name
        if name != "oracle":
            ok = ~want_out
            assert_close_to_oracle(out[ok], oracle[ok], dtype, vmax)
            assert_scores_close(ks[~want_ks], oracle_ks[~want_ks], mass=NF_GROUP * max(n_new))
    if where == "q" and mode == "decode":
        for out, _ in results.values():
            assert torch.equal(out[2], torch.zeros_like(out[2])), "a row that attends nothing outputs zeros"


# ---------------------------------------------------------------- per-token score buffer (score_out)
# score_out[mirror_starts[r] + kv_pos[j]] += key mass (all query heads, all the step's queries).
# Untouched entries are poisoned with -0.0 and compared bit for bit: adding anything, even +0.0,
# turns -0.0 into +0.0 or another value, so an extra write cannot hide.

SCORE_GROUPS = [1, 2, 4, 8]
NEG_ZERO_BITS = -(2**31)  # int32 view of float32 -0.0


def make_mirror(lens, idx, ptr, rng, *, extra_reqs=2, device=DEV):
    """(mirror_starts int64, kv_pos int32, touched bool [mirror_size], mirror_size).

    Request r owns a mirror segment with dead positions between its live ones and
    a gap before the next; live entries get sorted random positions, PAD entries
    inside a range point at a dead position (a trap), the PAD tail is -1.
    """
    starts, pos, cursor = [], [], 3
    touched_pos = []
    for r, n in enumerate(lens):
        seg = 2 * n + 3
        starts.append(cursor)
        live = sorted(rng.sample(range(seg), n))
        dead = [p for p in range(seg) if p not in set(live)]
        a = int(ptr[r])
        for k, p in enumerate(live):
            if int(idx[a + k]) >= 0:
                pos.append(p)
                touched_pos.append(cursor + p)
            else:
                pos.append(dead[0])
        cursor += seg + 5
    pos += [-1] * (idx.numel() - len(pos))
    size = cursor + 4
    touched = torch.zeros(size, dtype=torch.bool, device=device)
    touched[touched_pos] = True
    mirror_starts = torch.tensor(starts + [10**6] * extra_reqs, dtype=torch.int64, device=device)
    return mirror_starts, torch.tensor(pos, dtype=torch.int32, device=device), touched, size


def poisoned_scores(touched, gen):
    """-0.0 everywhere untouched, random values where a key lands."""
    buf = torch.full((touched.numel(),), -0.0, device=touched.device)
    buf[touched] = torch.rand(int(touched.sum()), generator=gen).to(touched.device) * 10
    return buf


def expected_scores(before, touched, oracle_ks, idx, ptr, mirror_starts, kv_pos):
    """float64 ``before + per-entry mass`` (oracle key scores summed over kv heads)."""
    want = before.double().clone()
    for r in range(ptr.numel() - 1):
        for j in range(int(ptr[r]), int(ptr[r + 1])):
            if int(idx[j]) >= 0:
                want[int(mirror_starts[r]) + int(kv_pos[j])] += float(oracle_ks[j].sum())
    return want


def assert_untouched_bits(buf, touched):
    assert torch.equal(buf.view(torch.int32)[~touched], torch.full_like(buf.view(torch.int32)[~touched], NEG_ZERO_BITS))


@pytest.mark.parametrize("group", SCORE_GROUPS)
@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_score_out_matches_reference(dtype, mode, group):
    """Triton and the torch reference add the oracle's per-key mass at exactly the right entries."""
    seed = zlib.crc32(f"score_out {dtype} {mode} {group}".encode())
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    num_kv_heads = 2 if group < 8 else 1
    cache, lay = make_cache("vllm_flash", 12, 16, num_kv_heads, 64, dtype, gen)
    lens = [1, 70, 0, 23]  # odd sizes; 70 > one BLOCK_N tile; an empty request
    slots = rng.sample(range(lay.num_slots), sum(lens))
    slots[30] = -1  # a PAD inside request 1's range
    idx = torch.tensor(slots + [-1] * 5, dtype=torch.int32, device=DEV)
    ptr = torch.tensor([0, 1, 71, 71, 94], dtype=torch.int32, device=DEV)
    q_indptr, n_q = None, len(lens)
    if mode == "prefill":
        q_indptr, n_q = torch.tensor([0, 1, 10, 10, 23], dtype=torch.int32, device=DEV), 23
    q = torch.randn(n_q, num_kv_heads * group, 64, generator=gen).to(DEV).to(dtype)
    starts, pos, touched, size = make_mirror(lens, idx, ptr, rng)
    before = poisoned_scores(touched, gen)
    _, oracle_ks = ref_attention(q, cache, lay, idx, ptr, q_indptr, return_key_scores=True, compute_dtype=torch.float64)
    want = expected_scores(before, touched, oracle_ks, idx, ptr, starts, pos)
    mass = group * (9 if mode == "prefill" else 1)
    for name, fn in (("triton", tri_attention), ("torch", ref_attention)):
        buf = before.clone()
        res = fn(q, cache, lay, idx, ptr, q_indptr, score_out=buf, mirror_starts=starts, kv_pos=pos)
        assert isinstance(res, torch.Tensor), name
        assert_untouched_bits(buf, touched)
        torch.testing.assert_close(buf.double()[touched], want[touched], rtol=KEY_SCORE_TOL["rtol"],
                                   atol=KEY_SCORE_TOL["atol"] * mass * num_kv_heads, msg=name)
    # Dead tokens: poisoning every unlisted slot changes no bit of the accumulated scores.
    clean = before.clone()
    tri_attention(q, cache, lay, idx, ptr, q_indptr, score_out=clean, mirror_starts=starts, kv_pos=pos)
    poison_unlisted(cache, lay, idx, float("nan"))
    dirty = before.clone()
    tri_attention(q, cache, lay, idx, ptr, q_indptr, score_out=dirty, mirror_starts=starts, kv_pos=pos)
    assert torch.equal(clean.view(torch.int32), dirty.view(torch.int32))


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_score_out_over_layers_is_the_sum_of_single_calls(mode, monkeypatch):
    """One plan, several layers: the buffer holds the sum of each layer's single call, bit for bit."""
    gen, rng = torch.Generator().manual_seed(51), random.Random(51)
    layers = [make_cache("nhd", 8, 16, 2, 64, torch.float16, gen) for _ in range(3)]
    lay = layers[0][1]
    lens = [40, 3, 66]
    idx, ptr = make_lists(lens, lay.num_slots, pad_tail=4, rng=rng)
    q_indptr, n_q = (None, 3) if mode == "decode" else (torch.tensor([0, 5, 8, 20], dtype=torch.int32, device=DEV), 20)
    qs = [torch.randn(n_q, 8, 64, generator=gen).to(DEV).half() for _ in layers]
    starts, pos, touched, size = make_mirror(lens, idx, ptr, rng)
    for backend in OPS_BACKENDS:
        monkeypatch.setenv("VTOKEN_BACKEND", backend)
        step = ops.plan_token_attention(lay, idx, ptr, q_indptr, num_q_heads=8, dtype=torch.float16,
                                        num_q_tokens=n_q, scores=True, mirror_starts=starts, kv_pos=pos)
        acc = torch.full((size,), -0.0, device=DEV)
        acc[touched] = 0.0
        singles, outs = [], []
        for q, (cache, _) in zip(qs, layers):
            outs.append(step.run(q, cache, score_out=acc))
            one = torch.zeros(size, device=DEV)
            o1, ks = ops.token_attention(q, cache, lay, idx, ptr, q_indptr, return_key_scores=True,
                                         score_out=one, mirror_starts=starts, kv_pos=pos)
            assert torch.equal(o1, outs[-1]), backend
            singles.append(one)
            torch.testing.assert_close(one[starts[1] + pos[40:43].long()], ks[40:43].sum(1), rtol=1e-6, atol=1e-6)
        want = torch.zeros(size, device=DEV)
        for one in singles:
            want += one  # the same fp32 adds in the same order as the accumulating runs
        assert_untouched_bits(acc, touched)
        assert torch.equal(acc[touched], want[touched]), backend


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_plan_with_a_preallocated_workspace_equals_one_that_allocates(mode, monkeypatch):
    """workspace=: the Triton plan's float workspaces are views of it (poisoned first), the results bit-identical."""
    monkeypatch.setenv("VTOKEN_BACKEND", "triton")  # on CPU tensors dispatch would pick the C++ kernel
    gen, rng = torch.Generator().manual_seed(53), random.Random(53)
    cache, lay = make_cache("vllm_fused", 8, 16, 2, 64, torch.float32, gen)
    lens = [40, 3, 66]
    idx, ptr = make_lists(lens, lay.num_slots, pad_tail=5, rng=rng)
    q_indptr, n_q = (None, 3) if mode == "decode" else (torch.tensor([0, 5, 8, 20], dtype=torch.int32, device=DEV), 20)
    q = torch.randn(n_q, 8, 64, generator=gen).to(DEV)
    starts, pos, touched, size = make_mirror(lens, idx, ptr, rng)
    n = tri_mod.workspace_numel(num_q_tokens=n_q, num_q_heads=8, nnz_max=idx.numel(), head_dim=64, max_reqs=3,
                                scores=True, device=DEV)
    if DEV == "cpu":
        assert n == 1 + n_q * 8 + 8 * idx.numel()  # CPU: one split, no partials
    ws = torch.full((n + 7,), float("nan"), device=DEV)
    runs = []
    for workspace in (None, ws):
        step = ops.plan_token_attention(lay, idx, ptr, q_indptr, num_q_heads=8, dtype=torch.float32,
                                        num_q_tokens=n_q, scores=True, mirror_starts=starts, kv_pos=pos,
                                        workspace=workspace)
        acc = torch.zeros(size, device=DEV)
        runs.append((step.run(q, cache, score_out=acc), acc))
        if workspace is not None:
            assert step.plan.lse.untyped_storage().data_ptr() == ws.untyped_storage().data_ptr()
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    with pytest.raises(InvalidArgumentError, match=r"workspace: expected at least \d+ float32 elements, got 4"):
        ops.plan_token_attention(lay, idx, ptr, q_indptr, num_q_heads=8, dtype=torch.float32, num_q_tokens=n_q,
                                 scores=True, mirror_starts=starts, kv_pos=pos, workspace=torch.zeros(4, device=DEV))
    with pytest.raises(InvalidArgumentError, match="workspace: expected a 1-D float32 tensor"):
        ops.plan_token_attention(lay, idx, ptr, q_indptr, num_q_heads=8, dtype=torch.float32, num_q_tokens=n_q,
                                 workspace=torch.zeros(n, dtype=torch.float16, device=DEV))


def test_plan_runs_with_lists_overwritten_in_place():
    """A decode plan keeps its index tensors: overwriting them in place and running again equals a fresh call."""
    gen, rng = torch.Generator().manual_seed(52), random.Random(52)
    cache, lay = make_cache("hnd", 10, 16, 2, 64, torch.bfloat16, gen)
    nnz_max = 90
    idx = torch.full((nnz_max,), -1, dtype=torch.int32, device=DEV)
    ptr = torch.zeros(4, dtype=torch.int32, device=DEV)
    starts = torch.tensor([0, 100, 200], dtype=torch.int64, device=DEV)
    pos = torch.full((nnz_max,), -1, dtype=torch.int32, device=DEV)
    q = torch.randn(3, 8, 64, generator=gen).to(DEV).bfloat16()
    step = ops.plan_token_attention(lay, idx, ptr, num_q_heads=8, dtype=torch.bfloat16, scores=True,
                                    mirror_starts=starts, kv_pos=pos)
    out = torch.empty_like(q)
    for lens in ([10, 50, 1], [0, 80, 7]):
        i, p = make_lists(lens, lay.num_slots, pad_tail=nnz_max - sum(lens), rng=rng)
        idx.copy_(i)
        ptr.copy_(p)
        pos.copy_(torch.tensor([k for n in lens for k in range(n)] + [-1] * (nnz_max - sum(lens)), dtype=torch.int32,
                               device=DEV))
        buf, fresh_buf = torch.zeros(300, device=DEV), torch.zeros(300, device=DEV)
        got = step.run(q, cache, out=out, score_out=buf)
        fresh = ops.token_attention(q, cache, lay, idx.clone(), ptr.clone(), score_out=fresh_buf,
                                    mirror_starts=starts, kv_pos=pos.clone())
        assert got is out and torch.equal(out, fresh)
        assert torch.equal(buf, fresh_buf)
        for r, n in enumerate(lens):
            torch.testing.assert_close(buf[100 * r: 100 * r + n].sum(), torch.tensor(8.0 if n else 0.0, device=DEV),
                                       rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- arguments


def test_out_scale_and_strided_q():
    """``out`` is written in place; q may be a strided view (e.g. a slice of a fused qkv)."""
    gen, rng = torch.Generator().manual_seed(21), random.Random(21)
    cache, lay = make_cache("nhd", 6, 16, 2, 64, torch.float32, gen)
    idx, ptr = make_lists([9, 40], lay.num_slots, pad_tail=0, rng=rng)
    qkv = torch.randn(2, 12, 64, generator=gen).to(DEV)
    q = qkv[:, :4]  # stride(0) = 12 * 64
    out_buf = torch.full((2, 8, 64), float("nan"), device=DEV)
    out = out_buf[:, ::2]  # a strided output view
    got = tri_attention(q, cache, lay, idx, ptr, scale=0.3, out=out)
    assert got is out
    oracle = ref_attention(q.contiguous(), cache, lay, idx, ptr, scale=0.3, compute_dtype=torch.float64)
    torch.testing.assert_close(out.double(), oracle, rtol=2e-5, atol=2e-5)
    assert torch.isnan(out_buf[:, 1::2]).all(), "only the out view is written"
    ref_out = torch.empty(2, 4, 64, device=DEV)
    assert ref_attention(q, cache, lay, idx, ptr, scale=0.3, out=ref_out) is ref_out


def test_ops_dispatch(monkeypatch):
    gen, rng = torch.Generator().manual_seed(22), random.Random(22)
    cache, lay = make_cache("vllm_flash", 6, 16, 2, 64, torch.float32, gen)
    idx, ptr = make_lists([9, 40], lay.num_slots, pad_tail=3, rng=rng)
    q = torch.randn(2, 4, 64, generator=gen).to(DEV)
    results = {}
    for backend in OPS_BACKENDS:
        monkeypatch.setenv("VTOKEN_BACKEND", backend)
        assert ops.select_backend("token_attention", q.device, has_cuda_impl=True) == backend
        results[backend] = ops.token_attention(q, cache, lay, idx, ptr, return_key_scores=True)
    if "cuda" not in OPS_BACKENDS:  # no extension op: forcing it raises
        monkeypatch.setenv("VTOKEN_BACKEND", "cuda")
        with pytest.raises(InvalidArgumentError, match="VTOKEN_BACKEND=cuda"):
            ops.token_attention(q, cache, lay, idx, ptr)
    monkeypatch.delenv("VTOKEN_BACKEND")
    assert isinstance(ops.token_attention(q, cache, lay, idx, ptr), torch.Tensor)
    for backend in OPS_BACKENDS[1:]:
        torch.testing.assert_close(results["triton"][0], results[backend][0], rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(results["triton"][1], results[backend][1], **KEY_SCORE_TOL)


def _valid_args():
    gen = torch.Generator().manual_seed(0)
    cache, lay = make_cache("nhd", 4, 16, 2, 64, torch.float16, gen)
    q = torch.randn(2, 4, 64, generator=gen).to(DEV).half()
    idx = torch.tensor([1, 2, 3, 40, -1], dtype=torch.int32, device=DEV)
    ptr = torch.tensor([0, 3, 4], dtype=torch.int32, device=DEV)
    return dict(q=q, kv_cache=cache, layout=lay, kv_indices=idx, kv_indptr=ptr)


def _mla_layout():
    t = torch.zeros(kv_cache_shape("mla", 4, 16, 1, 64), dtype=torch.float16, device=DEV)
    return KVLayout.from_tensor(t, "mla")


def _hnd_layout():
    """An hnd layout of the same sizes as _valid_args's nhd cache: same elements, another order."""
    t = torch.zeros(kv_cache_shape("hnd", 4, 16, 2, 64), dtype=torch.float16, device=DEV)
    return KVLayout.from_tensor(t, "hnd")


BAD_ARGS = [
    # (id, overrides, error type, message regex)
    ("q-not-tensor", dict(q=[[1.0]]), InvalidTypeError, "q: expected a torch.Tensor"),
    ("q-2d", dict(q=torch.zeros(2, 256, dtype=torch.float16)), InvalidTypeError, "q: expected 3 dims"),
    ("q-int", dict(q=torch.zeros(2, 4, 64, dtype=torch.int32)), InvalidTypeError, "q: expected dtype"),
    ("q-head-dim", dict(q=torch.zeros(2, 4, 32, dtype=torch.float16)), InvalidArgumentError, "q: expected head_dim == layout.head_dim"),
    ("q-gqa", dict(q=torch.zeros(2, 3, 64, dtype=torch.float16)), InvalidArgumentError, "divisible by num_kv_heads"),
    ("q-decode-count", dict(q=torch.zeros(3, 4, 64, dtype=torch.float16)), InvalidTypeError, "one query per request"),
    ("cache-dtype", dict(kv_cache="f32"), InvalidTypeError, "kv_cache: expected dtype"),
    ("cache-small", dict(kv_cache="small"), InvalidArgumentError, "kv_cache: expected a tensor spanning"),
    ("layout-type", dict(layout="nhd"), InvalidTypeError, "layout: expected a vtoken.layout.KVLayout"),
    ("layout-mla", dict(layout="mla"), InvalidArgumentError, "layout: expected num_kv == 2"),
    ("layout-hnd-on-nhd", dict(layout="hnd"), InvalidArgumentError,
     "layout: expected a layout that addresses the cache tensor of shape .* dim for dim"),
    ("indices-int64", dict(kv_indices=torch.tensor([1, 2, 3, 4], dtype=torch.int64)), InvalidTypeError, "kv_indices: expected dtype"),
    ("indptr-2d", dict(kv_indptr=torch.zeros(1, 3, dtype=torch.int32)), InvalidTypeError, "kv_indptr: expected 1 dims"),
    ("indptr-empty", dict(kv_indptr=torch.zeros(0, dtype=torch.int32)), InvalidTypeError, "kv_indptr: expected num_reqs"),
    ("indptr-decreasing", dict(kv_indptr=torch.tensor([0, 3, 2], dtype=torch.int32)), InvalidArgumentError, "kv_indptr: expected a non-decreasing"),
    ("indptr-past-end", dict(kv_indptr=torch.tensor([0, 3, 6], dtype=torch.int32)), InvalidArgumentError, "kv_indptr: expected a last entry <= len"),
    ("slot-out-of-range", dict(kv_indices=torch.tensor([1, 2, 64, 40, -1], dtype=torch.int32)), InvalidArgumentError, r"kv_indices: expected slots in \[0, 64\)"),
    ("q-indptr-len", dict(q_indptr=torch.tensor([0, 2], dtype=torch.int32)), InvalidTypeError, "q_indptr: expected len"),
    ("q-indptr-dtype", dict(q_indptr=torch.tensor([0, 1, 2], dtype=torch.int64)), InvalidTypeError, "q_indptr: expected dtype"),
    ("q-indptr-end", dict(q_indptr=torch.tensor([0, 1, 3], dtype=torch.int32)), InvalidArgumentError, r"q_indptr: expected a last entry <= q.shape\[0\]"),
    ("q-indptr-too-many", dict(q_indptr=torch.tensor([0, 0, 2], dtype=torch.int32)), InvalidArgumentError, r"request 1's new queries \(2\) <= its listed slots \(1\)"),
    ("scale-neg", dict(scale=-1.0), InvalidArgumentError, "scale: expected a finite float > 0"),
    ("scale-nan", dict(scale=float("nan")), InvalidArgumentError, "scale: expected a finite float > 0"),
    ("out-shape", dict(out=torch.zeros(2, 4, 32, dtype=torch.float16)), InvalidTypeError, "out: expected shape"),
    ("out-dtype", dict(out=torch.zeros(2, 4, 64, dtype=torch.float32)), InvalidTypeError, "out: expected dtype"),
    ("score-no-pos", dict(score_out=torch.zeros(8)), InvalidArgumentError, "score_out: expected mirror_starts and kv_pos"),
    ("score-dtype", dict(score_out=torch.zeros(8, dtype=torch.float16), mirror_starts="ok", kv_pos="ok"),
     InvalidTypeError, "score_out: expected dtype"),
    ("starts-only", dict(mirror_starts="ok"), InvalidArgumentError, "mirror_starts: expected mirror_starts and kv_pos both"),
    ("starts-short", dict(score_out=torch.zeros(8), mirror_starts=torch.zeros(1, dtype=torch.int64), kv_pos="ok"),
     InvalidTypeError, r"mirror_starts: expected >= num_reqs \(2\) entries"),
    ("starts-int32", dict(score_out=torch.zeros(8), mirror_starts=torch.zeros(2, dtype=torch.int32), kv_pos="ok"),
     InvalidTypeError, "mirror_starts: expected dtype"),
    ("pos-len", dict(score_out=torch.zeros(8), mirror_starts="ok", kv_pos=torch.zeros(4, dtype=torch.int32)),
     InvalidTypeError, r"kv_pos: expected shape \(5,\)"),
    ("pos-out-of-range", dict(score_out=torch.zeros(3), mirror_starts="ok", kv_pos="ok"),
     InvalidArgumentError, r"kv_pos: expected mirror_starts\[r\] \+ kv_pos\[j\] in \[0, len\(score_out\) = 3\)"),
    ("pos-duplicate", dict(score_out=torch.zeros(8), mirror_starts="ok", kv_pos=torch.tensor([0, 1, 1, 0, 0], dtype=torch.int32)),
     InvalidArgumentError, "kv_pos: expected unique destinations"),
]
VALID_STARTS = torch.tensor([0, 3], dtype=torch.int64, device=DEV)  # request 0 at 0..2, request 1 at 3
VALID_POS = torch.tensor([0, 1, 2, 0, -1], dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("backend", OPS_BACKENDS)
@pytest.mark.parametrize("case", BAD_ARGS, ids=[c[0] for c in BAD_ARGS])
def test_bad_arguments_raise_typed_errors(case, backend, monkeypatch):
    """vtoken.device.ops checks the contract once, before any backend runs."""
    monkeypatch.setenv("VTOKEN_BACKEND", backend)
    _, overrides, err, match = case
    args = _valid_args()
    kwargs = {}
    for k, v in overrides.items():
        if k == "kv_cache" and v == "f32":
            v = args["kv_cache"].float()
        elif k == "kv_cache" and v == "small":
            v = args["kv_cache"][:2]
        elif k == "layout" and v == "mla":
            v = _mla_layout()
        elif k == "layout" and v == "hnd":
            v = _hnd_layout()
        elif k == "mirror_starts" and isinstance(v, str):
            v = VALID_STARTS
        elif k == "kv_pos" and isinstance(v, str):
            v = VALID_POS
        elif isinstance(v, torch.Tensor):
            v = v.to(DEV)  # BAD_ARGS is built at import, on the CPU
        if k in ("q_indptr", "scale", "out", "score_out", "mirror_starts", "kv_pos"):
            kwargs[k] = v
        else:
            args[k] = v
    guard = torch.full((2, 4, 64), 7.0, dtype=torch.float16, device=DEV)
    if "out" not in kwargs:
        kwargs["out"] = guard
    with pytest.raises(err, match=match):
        ops.token_attention(args["q"], args["kv_cache"], args["layout"], args["kv_indices"], args["kv_indptr"], **kwargs)
    assert torch.equal(guard, torch.full_like(guard, 7.0)), "a rejected call must not write out"


def test_plan_run_checks_the_layer_against_the_plan():
    """plan_token_attention validates the step once; run refuses a layer that does not match it."""
    a = _valid_args()
    step = ops.plan_token_attention(a["layout"], a["kv_indices"], a["kv_indptr"], num_q_heads=4, dtype=torch.float16)
    out = step.run(a["q"], a["kv_cache"])
    assert torch.equal(out, ops.token_attention(a["q"], a["kv_cache"], a["layout"], a["kv_indices"], a["kv_indptr"]))
    with pytest.raises(InvalidTypeError, match=r"q: expected shape \(2, 4, 64\) as planned"):
        step.run(torch.zeros(2, 2, 64, dtype=torch.float16, device=DEV), a["kv_cache"])
    with pytest.raises(InvalidArgumentError, match="expected a plan built with scores=True"):
        step.run(a["q"], a["kv_cache"], return_key_scores=True)
    with pytest.raises(InvalidArgumentError, match="score_out: expected mirror_starts and kv_pos"):
        step.run(a["q"], a["kv_cache"], score_out=torch.zeros(4, device=DEV))
    with pytest.raises(InvalidTypeError, match="kv_cache: expected dtype"):
        step.run(a["q"], a["kv_cache"].float())
    with pytest.raises(InvalidArgumentError, match="num_q_tokens: expected an int with q_indptr"):
        ops.plan_token_attention(a["layout"], a["kv_indices"], a["kv_indptr"],
                                 torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV),
                                 num_q_heads=4, dtype=torch.float16)
    with pytest.raises(InvalidArgumentError, match="q: expected num_q_heads divisible"):
        ops.plan_token_attention(a["layout"], a["kv_indices"], a["kv_indptr"], num_q_heads=3, dtype=torch.float16)


def test_num_splits_argument_is_validated():
    a = _valid_args()
    with pytest.raises(InvalidArgumentError, match="num_splits: expected an int >= 1"):
        tri_attention(a["q"], a["kv_cache"], a["layout"], a["kv_indices"], a["kv_indptr"], num_splits=0)


def test_empty_batch():
    a = _valid_args()
    q = torch.zeros(0, 4, 64, dtype=torch.float16, device=DEV)
    ptr = torch.zeros(1, dtype=torch.int32, device=DEV)
    out, ks = tri_attention(q, a["kv_cache"], a["layout"], a["kv_indices"], ptr, return_key_scores=True)
    assert out.shape == (0, 4, 64) and torch.equal(ks, torch.zeros(5, 2, device=DEV))



def test_prefill_score_splits_fill_an_h200_for_one_long_prompt():
    """One long prompt gets about two waves of programs (132 SMs), past the decode cap of 32."""
    assert tri_mod.score_splits_for(132, 1, 32768, 64) == 264
    assert tri_mod.score_splits_for(132, 1, 32768, 64) > tri_mod.MAX_SPLITS
    assert tri_mod.score_splits_for(132, 1, 640, 64) == 10  # never less than one key tile per split
    assert tri_mod.score_splits_for(132, 512, 512 * 4096, 64) == 1  # many requests fill the GPU alone
    assert tri_mod.score_splits_for(132, 1, 10, 64) == 1


@pytest.mark.parametrize("splits", [2, 5, 64])
def test_prefill_score_splits_give_the_same_bits(splits):
    """Each split owns whole key tiles: key_scores and score_out are bit-identical for any split count."""
    gen, rng = torch.Generator().manual_seed(splits), random.Random(splits)
    cache, lay = make_cache("vllm_flash", 32, 16, 2, 64, torch.float16, gen)
    lens = [300, 7, 0, 150]  # 300 keys: 5 tiles of 64, so splits cut inside, at and past the tiles
    idx, ptr = make_lists(lens, lay.num_slots, pad_tail=3, rng=rng)
    q_indptr = torch.tensor([0, 40, 47, 47, 60], dtype=torch.int32)
    q = torch.randn(60, 4, 64, generator=gen).half()
    starts, pos, touched, size = make_mirror(lens, idx, ptr, rng)
    a = contracts.token_attention_sizes(q, lay, idx, ptr, q_indptr, None)
    results = []
    for n in (1, splits):
        plan = tri_mod.TokenAttentionPlan(a, lay, idx, ptr, q_indptr, dtype=q.dtype, device=q.device, scores=True,
                                          mirror_starts=starts, kv_pos=pos)
        plan.score_splits = n  # what score_splits_for picks on a GPU; the interpreter picks 1
        buf = torch.full((size,), float("nan"))
        buf[touched] = 0.0
        out, ks = plan.run(q, cache, return_key_scores=True, score_out=buf)
        results.append((out, ks, buf))
    (o1, k1, b1), (on, kn, bn) = results
    assert torch.equal(o1, on)
    assert torch.equal(k1.view(torch.int32), kn.view(torch.int32))
    assert torch.equal(b1.view(torch.int32), bn.view(torch.int32))
    assert bool(torch.isnan(bn[~touched]).all()) and bool(torch.isfinite(bn[touched]).all())
    assert float(kn[:300].sum()) > 0 and float(kn[307:457].sum()) > 0  # both long requests scored


# ---------------------------------------------------------------- AOT compile (sm_90, sm_80)

_TL = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _aot_specs():
    """The launcher's real configs (from _config): decode / prefill x dtypes x head dims.

    Every dtype, head dim, decode and prefill, split and not: the main kernel six
    times, the decode logit-score kernel and the prefill key-score kernel where
    scores are on, the reduce kernel per split case.
    """
    specs = []
    for decode, dtype, head_dim, group, split, scores in [
        (True, torch.bfloat16, 128, 4, True, True),
        (True, torch.float16, 64, 1, False, False),
        (True, torch.float32, 256, 8, True, False),
        (True, torch.float16, 96, 2, False, True),
        (False, torch.bfloat16, 128, 4, False, False),
        (False, torch.float16, 256, 2, False, True),
        (False, torch.float32, 64, 1, False, True),
    ]:
        a = contracts.TokenAttentionArgs(
            num_reqs=4, num_q_tokens=4, num_q_heads=8 * group, num_kv_heads=8, head_dim=head_dim, group=group,
            nnz_max=64, scale=1.0, decode=decode,
        )
        cfg = tri_mod._config(a)
        dt = _TL[dtype]
        common = dict(
            HEAD_DIM=head_dim, GROUP=group, GROUP_P=cfg["GROUP_P"], BLOCK_Q=cfg["BLOCK_Q"], BLOCK_N=cfg["BLOCK_N"],
            BLOCK_D=cfg["BLOCK_D"], BLOCK_SIZE=16, IS_DECODE=decode,
            DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", DOT_UPCAST=False,
        )
        idx_ptrs = {n: "*i32" for n in ("kv_indices_ptr", "kv_indptr_ptr", "q_indptr_ptr", "tile_req_ptr", "tile_q0_ptr")}
        tag = f"{'decode' if decode else 'prefill'}-{dt}-D{head_dim}-g{group}"
        specs.append(dict(
            id=f"main-{tag}{'-split' if split else ''}", kernel="_token_attention_kernel", num_warps=cfg["num_warps"],
            constexprs=dict(common, SPLIT=split, WRITE_LSE=True, WRITE_LOGITS=scores and decode),
            types=dict(idx_ptrs, q_ptr=f"*{dt}", kv_ptr=f"*{dt}", out_ptr=f"*{dt}", lse_ptr="*fp32",
                       mid_o_ptr="*fp32", mid_lse_ptr="*fp32", logits_ptr="*fp32", qk_scale="fp32"),
        ))
        score_ptrs = dict(mirror_starts_ptr="*i64", kv_pos_ptr="*i32", key_scores_ptr="*fp32", score_out_ptr="*fp32")
        if scores and decode:
            specs.append(dict(
                id=f"logit_scores-{tag}", kernel="_token_attention_logit_scores_kernel", num_warps=4,
                constexprs=dict(GROUP=group, GROUP_P=triton.next_power_of_2(group), BLOCK_N=cfg["BLOCK_N"],
                                KEY_SCORES=True, SCORE_OUT=True),
                types=dict(**idx_ptrs, **score_ptrs, logits_ptr="*fp32", lse_ptr="*fp32"),
            ))
        elif scores:
            specs.append(dict(
                id=f"key_scores-{tag}", kernel="_token_attention_key_scores_kernel", num_warps=cfg["num_warps"],
                constexprs=dict(common, KEY_SCORES=True, SCORE_OUT=True),
                types=dict(**idx_ptrs, **score_ptrs, q_ptr=f"*{dt}", kv_ptr=f"*{dt}", lse_ptr="*fp32", qk_scale="fp32"),
            ))
        if split:
            specs.append(dict(
                id=f"reduce-{tag}", kernel="_token_attention_reduce_kernel", num_warps=4,
                constexprs=dict(HEAD_DIM=head_dim, BLOCK_D=cfg["BLOCK_D"], SPLITS_P=32, WRITE_LSE=True),
                types=dict(mid_o_ptr="*fp32", mid_lse_ptr="*fp32", out_ptr=f"*{dt}", lse_ptr="*fp32"),
            ))
    return specs


# Max shared memory per block (opt-in): A100 (sm_80) 163 KiB, H100/H200 (sm_90) 227 KiB.
_SMEM_LIMIT = {80: 163 * 1024, 90: 227 * 1024}


def _aot_compile_all() -> None:
    """Compile every spec for every AOT arch; run in a process without TRITON_INTERPRET (see aot_helpers)."""
    for arch in AOT_ARCHS:
        for spec in _aot_specs():
            fn = getattr(tri_mod, spec["kernel"])
            signature = {n: spec["types"].get(n, "i32") for n in fn.arg_names if n not in spec["constexprs"]}
            compiled = compile_kernel(fn, signature, spec["constexprs"], arch, {"num_warps": spec["num_warps"]},
                                      label=spec["id"])
            assert compiled.metadata.shared <= _SMEM_LIMIT[arch], (spec["id"], arch, compiled.metadata.shared)


def test_aot_compile_for_sm90_sm80():
    """Compile every Triton kernel (the launcher's configs) for sm_90 and sm_80 without a GPU.

    One fresh process without TRITON_INTERPRET compiles them all (see
    aot_helpers); the interpreter tolerates code the compiler rejects.
    """
    compiled = compile_module_in_fresh_process("test_token_attention")
    assert compiled == expected_compiles(spec["id"] for spec in _aot_specs())


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_decode_and_prefill_match_oracle(dtype):
    dev = torch.device("cuda")
    gen, rng = torch.Generator().manual_seed(31), random.Random(31)
    cache, lay = make_cache("vllm_flash", 256, 16, 8, 128, dtype, gen, device=dev)
    lens = [1, 700, 0, 2048, 333]
    idx, ptr = make_lists(lens, lay.num_slots, pad_tail=100, rng=rng, device=dev)
    vmax = v_absmax(cache, lay, idx)
    q = torch.randn(len(lens), 32, 128, generator=gen).to(dev, dtype)
    oracle, oracle_ks = ref_attention(q, cache, lay, idx, ptr, return_key_scores=True, compute_dtype=torch.float64)
    for splits in (None, 1, 7):
        out, ks = tri_attention(q, cache, lay, idx, ptr, return_key_scores=True, num_splits=splits)
        assert_close_to_oracle(out, oracle, dtype, vmax)
        assert_scores_close(ks, oracle_ks, mass=4)
    n_new = [1, 100, 0, 300, 333]
    q_indptr = torch.tensor([0] + torch.tensor(n_new).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    qp = torch.randn(sum(n_new), 32, 128, generator=gen).to(dev, dtype)
    out, ks = tri_attention(qp, cache, lay, idx, ptr, q_indptr, return_key_scores=True)
    oracle, oracle_ks = ref_attention(qp, cache, lay, idx, ptr, q_indptr, return_key_scores=True, compute_dtype=torch.float64)
    assert_close_to_oracle(out, oracle, dtype, vmax)
    assert_scores_close(ks, oracle_ks, mass=4 * 333)


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_with_overwritten_lists():
    """Decode captured in a CUDA graph; slot lists overwritten in place between replays."""
    dev = torch.device("cuda")
    gen, rng = torch.Generator().manual_seed(32), random.Random(32)
    cache, lay = make_cache("nhd", 128, 16, 8, 128, torch.bfloat16, gen, device=dev)
    nnz_max = 1500
    idx = torch.full((nnz_max,), -1, dtype=torch.int32, device=dev)
    ptr = torch.zeros(5, dtype=torch.int32, device=dev)
    q = torch.randn(4, 32, 128, generator=gen).to(dev, torch.bfloat16)
    out = torch.empty_like(q)

    def fill(lens):
        i, p = make_lists(lens, lay.num_slots, pad_tail=nnz_max - sum(lens), rng=rng, device=dev)
        idx.copy_(i)
        ptr.copy_(p)

    fill([10, 300, 1, 900])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            tri_attention(q, cache, lay, idx, ptr, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tri_attention(q, cache, lay, idx, ptr, out=out)
    for lens in ([10, 300, 1, 900], [0, 1200, 64, 5]):
        fill(lens)
        g.replay()
        torch.cuda.synchronize()
        expected = tri_attention(q, cache, lay, idx, ptr)
        assert torch.equal(out, expected)


def test_a_planned_run_checks_where_scores_go_like_the_one_shot_op():
    """Out-of-range or repeated score destinations are refused per run, score_out untouched (CPU tensors)."""
    a = _valid_args()
    starts = torch.tensor([0, 10], dtype=torch.int64, device=DEV)
    for kv_pos, match in ((torch.tensor([0, 1, 1, 0, -1], dtype=torch.int32, device=DEV), "unique destinations"),
                          (torch.tensor([0, 1, 2, 9, -1], dtype=torch.int32, device=DEV), r"in \[0, len\(score_out\)")):
        step = ops.plan_token_attention(a["layout"], a["kv_indices"], a["kv_indptr"], num_q_heads=4,
                                        dtype=torch.float16, scores=True, mirror_starts=starts, kv_pos=kv_pos)
        score_out = torch.full((16,), -0.0, device=DEV)
        before = score_out.clone()
        with pytest.raises(InvalidArgumentError, match=match):
            step.run(a["q"], a["kv_cache"], score_out=score_out)
        assert torch.equal(score_out, before) and torch.equal(score_out.signbit(), before.signbit())
