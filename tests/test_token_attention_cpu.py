"""token_attention's C++ CPU kernel (``torch.ops.vtoken.token_attention``) vs the float64 oracle.

Every code path the CPU has (``cpu_isa`` 0 = baseline x86-64, 1 = AVX2, 2 =
AVX-512) runs the same matrix. Tolerances (|cpu - oracle| <= atol + rtol *
|oracle|), with u the unit roundoff of the dtype:

* fp16 / bf16: the output is rounded to the dtype once (rtol 2u); q.k, the
  softmax and P @ V run in fp32 and P is never rounded to the dtype, so the
  fp32 error below is negligible next to that rounding;
* fp32: the sums run in another order than the oracle's (16-lane partial sums
  and a tree) and exp is a degree-7 polynomial (~1 ulp), a relative error of a
  few fp32 ulps per term: rtol = atol = 2^-17 (~8e-6, ~60 ulps), tighter than
  the Triton test's 2^-15 because nothing here uses an approximate exp2;
* key scores: fp32 probability sums, the Triton test's bound (rtol 1e-4, atol
  1e-5 per unit of probability mass).

Outputs and key scores are poisoned (NaN) before each run, so an element the
kernel fails to write shows up as a NaN the oracle does not have.
"""
from __future__ import annotations

import random
import zlib

import pytest
import torch

from test_token_attention import (
    KEY_SCORE_TOL,
    make_cache,
    make_lists,
    make_mirror,
    poison_unlisted,
    poisoned_scores,
    expected_scores,
    assert_untouched_bits,
)
from vtoken.device import ops
from vtoken.errors import InvalidArgumentError
from vtoken.reference.token_attention import token_attention as ref_attention
from vtoken_kernels import contracts

needs_op = pytest.mark.skipif(not ops.has_extension_op("token_attention"),
                              reason="vtoken._C with token_attention is not built")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (head_dim, num_kv_heads, group): SmolLM2 (64, 3 kv, 3), odd sizes (80, 40 = not whole 16-lane
# vectors), MHA, GQA 4 and 8.
HEAD_CASES = [(64, 3, 3), (80, 2, 1), (40, 1, 4), (128, 2, 4), (96, 1, 8)]
OUT_TOL = {torch.float32: (2.0**-17, 2.0**-17), torch.float16: (2 * 2.0**-11, 2.0**-11),
           torch.bfloat16: (2 * 2.0**-8, 2.0**-8)}


def isas():
    """Every cpu_isa this CPU runs (the op rejects the others)."""
    if not ops.has_extension_op("token_attention"):
        return [0]
    return [i for i in (0, 1, 2) if _isa_runs(i)]


def _isa_runs(isa):
    from vtoken.layout import KVLayout, kv_cache_shape

    cache = torch.zeros(kv_cache_shape("nhd", 1, 2, 1, 16))
    lay = KVLayout.from_tensor(cache, "nhd")
    try:
        cpu_attention(torch.zeros(1, 1, 16), cache, lay, torch.tensor([0], dtype=torch.int32),
                      torch.tensor([0, 1], dtype=torch.int32), isa=isa)
    except RuntimeError as e:
        assert "cpu_isa" in str(e)
        return False
    return True


def cpu_attention(q, cache, lay, idx, ptr, q_indptr=None, *, scale=None, scores=False, score_out=None,
                  mirror_starts=None, kv_pos=None, isa=-1):
    """The op called directly, with NaN-poisoned outputs."""
    out = torch.full_like(q, float("nan"))
    ks = torch.full((idx.numel(), lay.num_heads), float("nan")) if (scores or score_out is not None) else None
    scale = q.shape[2] ** -0.5 if scale is None else scale
    torch.ops.vtoken.token_attention(q, cache, idx, ptr, q_indptr, out, ks, score_out, mirror_starts, kv_pos, scale,
                                     *contracts.layout_op_args(lay), cpu_isa=isa)
    return out, ks


def assert_out_close(out, oracle, dtype):
    rtol, atol = OUT_TOL[dtype]
    assert not torch.isnan(out).any(), "an output element was not written"
    torch.testing.assert_close(out.double(), oracle, rtol=rtol, atol=atol)


def assert_ks_close(ks, oracle_ks, mass):
    assert not torch.isnan(ks).any(), "a key score was not written"
    torch.testing.assert_close(ks.double(), oracle_ks, rtol=KEY_SCORE_TOL["rtol"], atol=KEY_SCORE_TOL["atol"] * mass)


def _case(mode, dtype, head_case, layout_name, seed_text):
    head_dim, num_kv_heads, group = head_case
    seed = zlib.crc32(seed_text.encode())
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    block_size = {"vllm_fused": 16, "nhd": 5, "hnd": 16, "vllm_flash": 1}[layout_name]
    cache, lay = make_cache(layout_name, 240 // block_size, block_size, num_kv_heads, head_dim, dtype, gen,
                            device="cpu")  # the C++ kernel takes CPU tensors, also on a GPU machine
    # Request lengths: 1, one that spans several 16-key chunks (odd), empty, one PAD inside a range.
    lens = [1, 67, 0, 23, 40]
    slots = rng.sample(range(lay.num_slots), sum(lens))
    slots[1 + 30] = -1  # a PAD inside request 1's range
    idx = torch.tensor(slots + [-1] * 5, dtype=torch.int32)  # PAD tail past kv_indptr[-1]
    ptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    if mode == "decode":
        q_indptr, n_q = None, len(lens)
    else:  # (n_new per request): a decode-like row, a chunk after past tokens, none, whole prompt, a long chunk
        n_new = [1, 9, 0, 23, 35]
        q_indptr = torch.tensor([0] + torch.tensor(n_new).cumsum(0).tolist(), dtype=torch.int32)
        n_q = sum(n_new)
    q = torch.randn(n_q, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return q, cache, lay, idx, ptr, q_indptr, rng, gen


@needs_op
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("head_case", HEAD_CASES, ids=lambda c: f"D{c[0]}-kv{c[1]}-g{c[2]}")
@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_oracle(dtype, mode, head_case, isa):
    layout_name = ["vllm_fused", "nhd", "hnd", "vllm_flash"][zlib.crc32(str(head_case).encode()) % 4]
    q, cache, lay, idx, ptr, q_indptr, _, _ = _case(mode, dtype, head_case, layout_name, f"{dtype}{mode}{head_case}")
    oracle, oracle_ks = ref_attention(q, cache, lay, idx, ptr, q_indptr, return_key_scores=True,
                                      compute_dtype=torch.float64)
    out, ks = cpu_attention(q, cache, lay, idx, ptr, q_indptr, scores=True, isa=isa)
    assert_out_close(out, oracle, dtype)
    assert_ks_close(ks, oracle_ks, mass=head_case[2] * (35 if mode == "prefill" else 1))
    assert torch.equal(ks[idx.numel() - 5:], torch.zeros(5, lay.num_heads)), "PAD tail scores 0"
    assert torch.equal(ks[31], torch.zeros(lay.num_heads)), "a PAD inside a range scores 0"
    out_no_scores, none = cpu_attention(q, cache, lay, idx, ptr, q_indptr, isa=isa)
    assert none is None
    assert torch.equal(out_no_scores, out), "key scores do not change the output"
    if isa != isas()[0]:  # the code paths agree with each other, not only with the oracle
        base, base_ks = cpu_attention(q, cache, lay, idx, ptr, q_indptr, scores=True, isa=isas()[0])
        torch.testing.assert_close(out, base, rtol=OUT_TOL[dtype][0], atol=OUT_TOL[dtype][1])


@needs_op
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_score_out_accumulates_like_the_oracle(dtype, mode, isa):
    """score_out[mirror_starts[r] + kv_pos[j]] += key mass; untouched entries keep their -0.0 bits."""
    q, cache, lay, idx, ptr, q_indptr, rng, gen = _case(mode, dtype, (64, 2, 4), "nhd", f"score {dtype}{mode}")
    lens = (ptr[1:] - ptr[:-1]).tolist()
    starts, pos, touched, size = make_mirror(lens, idx, ptr, rng, device="cpu")
    if mode == "prefill":  # a request with no new query adds nothing: not touched
        for j in range(int(ptr[2]), int(ptr[3])):
            touched[int(starts[2]) + int(pos[j])] = False
    before = poisoned_scores(touched, gen)
    _, oracle_ks = ref_attention(q, cache, lay, idx, ptr, q_indptr, return_key_scores=True,
                                 compute_dtype=torch.float64)
    want = expected_scores(before, touched, oracle_ks, idx, ptr, starts, pos)
    buf = before.clone()
    cpu_attention(q, cache, lay, idx, ptr, q_indptr, score_out=buf, mirror_starts=starts, kv_pos=pos, isa=isa)
    assert_untouched_bits(buf, touched)
    mass = 4 * 2 * (35 if mode == "prefill" else 1)
    torch.testing.assert_close(buf.double()[touched], want[touched], rtol=KEY_SCORE_TOL["rtol"],
                               atol=KEY_SCORE_TOL["atol"] * mass)


@needs_op
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_unlisted_slots_and_entries_past_indptr_are_never_read(mode):
    """NaN in every unlisted slot and in stale entries past kv_indptr[-1] changes no bit."""
    q, cache, lay, idx, ptr, q_indptr, rng, _ = _case(mode, torch.float16, (64, 2, 2), "vllm_fused", f"dead {mode}")
    listed = set(int(s) for s in idx.tolist() if s >= 0)
    stale = [s for s in range(lay.num_slots) if s not in listed][:5]
    clean, ks_clean = cpu_attention(q, cache, lay, idx, ptr, q_indptr, scores=True)
    poison_unlisted(cache, lay, idx, float("nan"))
    idx_stale = idx.clone()
    idx_stale[-5:] = torch.tensor(stale, dtype=torch.int32)
    dirty, ks_dirty = cpu_attention(q, cache, lay, idx_stale, ptr, q_indptr, scores=True)
    assert torch.equal(clean.view(torch.int16), dirty.view(torch.int16))
    assert torch.equal(ks_clean, ks_dirty)


@needs_op
def test_query_rows_of_no_request_are_zeros():
    """Prefill rows outside [q_indptr[0], q_indptr[-1]) and rows of a request with no key output 0, like the reference."""
    q, cache, lay, idx, ptr, _, _, _ = _case("prefill", torch.float32, (64, 2, 2), "nhd", "uncovered")
    q_indptr = torch.tensor([2, 3, 5, 5, 6, 9], dtype=torch.int32)  # rows 0, 1 and 9.. belong to no request
    q = torch.randn(12, 4, 64)
    out, _ = cpu_attention(q, cache, lay, idx, ptr, q_indptr)
    oracle = ref_attention(q, cache, lay, idx, ptr, q_indptr, compute_dtype=torch.float64)
    assert_out_close(out, oracle, torch.float32)
    assert torch.equal(out[:2], torch.zeros(2, 4, 64)) and torch.equal(out[9:], torch.zeros(3, 4, 64))


@needs_op
def test_strided_q_and_out():
    q, cache, lay, idx, ptr, _, _, gen = _case("decode", torch.bfloat16, (64, 2, 2), "hnd", "strided")
    qkv = torch.randn(q.shape[0], 12, 64, generator=gen).bfloat16()
    qs = qkv[:, 2:6]
    out_buf = torch.full((q.shape[0], 8, 64), 7.0, dtype=torch.bfloat16)
    out = out_buf[:, ::2]
    torch.ops.vtoken.token_attention(qs, cache, idx, ptr, None, out, None, None, None, None, 0.3,
                                     *contracts.layout_op_args(lay))
    oracle = ref_attention(qs.contiguous(), cache, lay, idx, ptr, scale=0.3, compute_dtype=torch.float64)
    assert_out_close(out, oracle, torch.bfloat16)
    assert torch.equal(out_buf[:, 1::2], torch.full_like(out_buf[:, 1::2], 7.0)), "only the out view is written"


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(dtype):
    q, cache, lay, idx, ptr, q_indptr, rng, _ = _case("prefill", dtype, (64, 2, 2), "nhd", "opcheck")
    lens = (ptr[1:] - ptr[:-1]).tolist()
    starts, pos, _, size = make_mirror(lens, idx, ptr, rng, device="cpu")
    out = torch.empty_like(q)
    ks = torch.empty(idx.numel(), 2)
    score_out = torch.zeros(size)
    args = (q, cache, idx, ptr, q_indptr, out, ks, score_out, starts, pos, 0.125, *contracts.layout_op_args(lay))
    torch.library.opcheck(torch.ops.vtoken.token_attention.default, args)
    dec = _case("decode", dtype, (64, 2, 2), "nhd", "opcheck")
    torch.library.opcheck(torch.ops.vtoken.token_attention.default,
                          (dec[0], dec[1], dec[3], dec[4], None, torch.empty_like(dec[0]), None, None, None, None,
                           0.125, *contracts.layout_op_args(dec[2])))


@needs_op
def test_op_rejects_bad_arguments_without_writing():
    q, cache, lay, idx, ptr, _, _, _ = _case("decode", torch.float16, (64, 2, 2), "nhd", "bad")
    out = torch.full_like(q, 7.0)
    lay_args = contracts.layout_op_args(lay)
    cases = [
        (dict(q=q.float()), "kv_cache: expected dtype"),
        (dict(idx=idx.long()), "kv_indices: expected dtype Int"),
        (dict(ptr=ptr[:3]), "one query per request"),
        (dict(scale=float("nan")), "scale: expected a finite float > 0"),
        (dict(cache=cache[:1]), "kv_cache: expected a tensor spanning the layout"),
        (dict(isa=7), "cpu_isa: expected -1 or 0"),
    ]
    for over, match in cases:
        a = dict(q=q, cache=cache, idx=idx, ptr=ptr, scale=0.1, isa=-1) | over
        with pytest.raises(RuntimeError, match=match):
            torch.ops.vtoken.token_attention(a["q"], a["cache"], a["idx"], a["ptr"], None, out, None, None, None, None,
                                             a["scale"], *lay_args, cpu_isa=a["isa"])
        assert torch.equal(out, torch.full_like(out, 7.0)), match


@needs_op
def test_meta_kernel_accepts_meta_tensors():
    q = torch.empty(3, 4, 64, dtype=torch.float16, device="meta")
    cache = torch.empty(4, 2, 16, 2, 64, dtype=torch.float16, device="meta")
    idx = torch.empty(9, dtype=torch.int32, device="meta")
    ptr = torch.empty(4, dtype=torch.int32, device="meta")
    from vtoken.layout import KVLayout

    lay_args = contracts.layout_op_args(KVLayout.from_tensor(cache, "nhd"))
    assert torch.ops.vtoken.token_attention(q, cache, idx, ptr, None, torch.empty_like(q), None, None, None, None,
                                            0.1, *lay_args) is None
    with pytest.raises(RuntimeError, match="kv_indptr: expected dtype Int"):
        torch.ops.vtoken.token_attention(q, cache, idx, ptr.long(), None, torch.empty_like(q), None, None, None,
                                         None, 0.1, *lay_args)


@needs_op
def test_ops_picks_the_cpu_kernel_for_cpu_tensors(monkeypatch):
    """vtoken.device.ops: the extension first on CPU tensors (one-shot and planned), VTOKEN_BACKEND still forces."""
    monkeypatch.delenv("VTOKEN_BACKEND", raising=False)
    assert ops.select_backend("token_attention", torch.device("cpu"),
                              has_cuda_impl=ops._attention_ext_runs_on(torch.device("cpu"))) == "cuda"
    q, cache, lay, idx, ptr, q_indptr, _, _ = _case("prefill", torch.float32, (64, 2, 2), "nhd", "dispatch")
    step = ops.plan_token_attention(lay, idx, ptr, q_indptr, num_q_heads=4, dtype=torch.float32,
                                    num_q_tokens=q.shape[0], scores=True)
    assert isinstance(step.plan, ops.TokenAttentionExtensionPlan)
    got, ks = ops.token_attention(q, cache, lay, idx, ptr, q_indptr, return_key_scores=True)
    direct, direct_ks = cpu_attention(q, cache, lay, idx, ptr, q_indptr, scores=True)
    assert torch.equal(got, direct) and torch.equal(ks, direct_ks)
    planned, planned_ks = step.run(q, cache, return_key_scores=True)
    assert torch.equal(planned, direct) and torch.equal(planned_ks, direct_ks)
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    assert ops.select_backend("token_attention", q.device, has_cuda_impl=True) == "torch"
    ref = ops.token_attention(q, cache, lay, idx, ptr, q_indptr)
    assert_out_close(got, ref.double(), torch.float32)


@needs_op
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_threads_give_bit_identical_results(mode):
    """Units are shared out dynamically over threads; each output element and key score has one writer."""
    q, cache, lay, idx, ptr, q_indptr, rng, _ = _case(mode, torch.bfloat16, (64, 3, 3), "vllm_fused", f"thr {mode}")
    lens = (ptr[1:] - ptr[:-1]).tolist()
    starts, pos, _, size = make_mirror(lens, idx, ptr, rng, device="cpu")
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            buf = torch.zeros(size)
            out, ks = cpu_attention(q, cache, lay, idx, ptr, q_indptr, score_out=buf, mirror_starts=starts, kv_pos=pos)
            results.append((out, ks, buf))
    finally:
        torch.set_num_threads(threads)
    for out, ks, buf in results[1:]:
        assert torch.equal(out.view(torch.int16), results[0][0].view(torch.int16))
        assert torch.equal(ks, results[0][1]) and torch.equal(buf, results[0][2])


@needs_op
def test_plan_with_a_preallocated_workspace_is_a_view_of_it_and_bit_identical(monkeypatch):
    """The C++ kernel's plan takes its key-score workspace from the caller's buffer, as the Triton plan does."""
    monkeypatch.delenv("VTOKEN_BACKEND", raising=False)
    q, cache, lay, idx, ptr, q_indptr, _, _ = _case("prefill", torch.float32, (64, 2, 2), "nhd", "workspace")
    starts, pos, _, size = make_mirror([int(ptr[r + 1] - ptr[r]) for r in range(ptr.numel() - 1)], idx, ptr,
                                       random.Random(7), device="cpu")
    need = idx.numel() * 2
    ws = torch.full((need + 5,), float("nan"))
    runs = []
    for workspace in (None, ws):
        step = ops.plan_token_attention(lay, idx, ptr, q_indptr, num_q_heads=4, dtype=torch.float32,
                                        num_q_tokens=q.shape[0], scores=True, mirror_starts=starts, kv_pos=pos,
                                        workspace=workspace)
        assert isinstance(step.plan, ops.TokenAttentionExtensionPlan)
        acc = torch.zeros(size)
        runs.append((step.run(q, cache, score_out=acc), acc))
    assert step.plan.workspace.untyped_storage().data_ptr() == ws.untyped_storage().data_ptr()
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    small = torch.zeros(4)  # lists grown past the caller's workspace: a buffer of the plan's own, same bits
    step = ops.plan_token_attention(lay, idx, ptr, q_indptr, num_q_heads=4, dtype=torch.float32,
                                    num_q_tokens=q.shape[0], scores=True, mirror_starts=starts, kv_pos=pos,
                                    workspace=small)
    acc = torch.zeros(size)
    assert torch.equal(step.run(q, cache, score_out=acc), runs[0][0]) and torch.equal(acc, runs[0][1])
    assert step.plan.workspace.numel() == need and torch.equal(small, torch.zeros(4))
    with pytest.raises(InvalidArgumentError, match="workspace: expected a 1-D float32 tensor"):
        ops.plan_token_attention(lay, idx, ptr, q_indptr, num_q_heads=4, dtype=torch.float32,
                                 num_q_tokens=q.shape[0], scores=True, workspace=torch.zeros(need, dtype=torch.float16))
