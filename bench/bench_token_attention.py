"""Benchmark token_attention: decode (and a prefill chunk) over token-indexed slots.

GPU (default when CUDA is present): realistic decode sizes (e.g. 64 requests x
4K live tokens, 32 q heads / 8 kv heads, head_dim 128, bf16, vLLM 0.32 flash
layout, block size 16). The live tokens sit in randomly placed blocks with 12
of 16 offsets live (the state after token eviction, before compaction).
Reported per row, all timed in this run with CUDA events (do_bench):

* ``kv_GBps``: K+V bytes read per second (the bytes that bound decode);
* ``frac_sdpa``: SDPA time / token_attention time, with SDPA (GQA-aware, and
  on K/V expanded to the q heads; the faster one) run on the same K/V already
  gathered into a dense ``[R, Hkv, L, D]`` tensor: the fraction of dense SDPA's
  bandwidth on the same bytes (goal >= 0.70);
* ``frac_copy``: (all bytes read + written) / time over the measured D2D copy
  bandwidth (read + write counted).

KV bytes with scores (every mode): ``kv_read_ratio`` = bytes the kernels read
from the KV cache with scores on / with scores off, counted by construction of
the kernels (:func:`kv_bytes_read`): the main kernel reads K and V of every
listed, non-PAD key once per (query tile, kv head), for keys up to the tile's
causal bound (decode: one tile per request, all its keys); the decode score
pass reads stored fp32 logits, no K; the prefill score pass reads K of every
listed key once per (request, kv head). ``aux_ratio`` adds the logits written
and read back (decode) and the lse to the numerator. ``old_kv_read_ratio`` is
the design this replaces (a second pass re-reading K, decode too). Goal:
``kv_read_ratio <= 1.05``. On the GPU the same cases are timed with scores off,
with ``return_key_scores`` and with ``score_out`` (``us_ratio_*``).

``--quick`` (and any run without CUDA): small sizes on the CPU. The Triton
interpreter is meaningless for speed, so the CPU run times the torch reference
(a per-request gather + attention) against SDPA on dense K/V gathered
beforehand, and checks that the Triton kernel (interpreter) matches the
reference once.

``--scores-only`` (GPU): only the scores on / off rows and the byte counts.

Usage: ``python bench/bench_token_attention.py [--quick] [--scores-only]``; writes
``bench/results/token_attention.json``.
"""
from __future__ import annotations

import argparse
import math

from common import (
    copy_bandwidth_gbs,
    gbs,
    on_gpu,
    prepare_kernel_env,
    print_table,
    time_fn,
    write_json,
)

prepare_kernel_env()  # before vtoken / triton imports
import torch  # noqa: E402

from vtoken.layout import KVLayout, kv_cache_shape  # noqa: E402
from vtoken.reference import token_attention as ref_mod  # noqa: E402
from vtoken.reference.token_attention import token_attention as ref_attention  # noqa: E402
from vtoken.device import ops  # noqa: E402
from vtoken_kernels import contracts  # noqa: E402
from vtoken_kernels.token_attention import _auto_splits, _config  # noqa: E402
from vtoken_kernels.token_attention import token_attention as tri_attention  # noqa: E402

F = torch.nn.functional
LIVE_PER_BLOCK = 12  # of 16: tokens left live per block after eviction


def make_case(num_reqs, live, num_q_heads, num_kv_heads, head_dim, dtype, device, *, block_size=16, seed=0):
    """Cache, layout and slot lists: each request's live tokens in random blocks, 12/16 live."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    per_block = min(LIVE_PER_BLOCK, block_size)
    blocks_per_req = math.ceil(live / per_block)
    num_blocks = num_reqs * blocks_per_req + 8
    shape = kv_cache_shape("vllm_flash", num_blocks, block_size, num_kv_heads, head_dim)
    gd = torch.Generator(device=device).manual_seed(seed)
    cache = torch.randn(shape, generator=gd, device=device, dtype=dtype)
    layout = KVLayout.from_tensor(cache, "vllm_flash")
    blocks = torch.randperm(num_blocks, generator=g)[: num_reqs * blocks_per_req]
    offs = torch.rand(blocks.numel(), block_size, generator=g).argsort(1)[:, :per_block].sort(1).values
    slots = (blocks[:, None] * block_size + offs).view(num_reqs, -1)[:, :live].reshape(-1)
    kv_indices = slots.to(device=device, dtype=torch.int32)
    kv_indptr = (torch.arange(num_reqs + 1) * live).to(device=device, dtype=torch.int32)
    return cache, layout, kv_indices, kv_indptr


def dense_kv(cache, layout, kv_indices, num_reqs, live):
    """K, V gathered into dense [R, Hkv, L, D] tensors (the SDPA baseline's input)."""
    view = layout.canonical_view(cache)
    s = kv_indices.long()
    k = view[s // layout.block_size, s % layout.block_size, 0]  # [R*L, Hkv, D]
    v = view[s // layout.block_size, s % layout.block_size, 1]
    shape = (num_reqs, live, layout.num_heads, layout.head_dim)
    return k.view(shape).transpose(1, 2).contiguous(), v.view(shape).transpose(1, 2).contiguous()


def sdpa_baselines(q4, k, v, group, *, causal_offset=None):
    """{name: fn} SDPA on dense K/V: GQA-aware, and on K/V expanded to the q heads."""
    mask = None
    if causal_offset is not None:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(q4.shape[2], k.shape[2])
    ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    candidates = {
        "sdpa_gqa": lambda: F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, enable_gqa=True),
        "sdpa_expanded": lambda: F.scaled_dot_product_attention(q4, ke, ve, attn_mask=mask),
    }
    fns = {}
    for name, fn in candidates.items():
        try:
            fn()
            fns[name] = fn
        except (TypeError, RuntimeError) as e:  # older torch without enable_gqa, or no kernel for the mask
            print(f"  {name} unavailable: {type(e).__name__}: {str(e)[:160]}")
    return fns


def best_baseline(fns, **kw):
    """(name, median µs) of the fastest baseline, or ("n/a", nan) when none ran."""
    times = {name: time_fn(fn, **kw)["median_us"] for name, fn in fns.items()}
    if not times:
        return "n/a", float("nan")
    best = min(times, key=times.get)
    return best, times[best]


def gpu_rows(copy_gbs: float) -> list[dict]:
    dev, dt = torch.device("cuda"), torch.bfloat16
    hq, hkv, d = 32, 8, 128
    group = hq // hkv
    elem = torch.finfo(dt).bits // 8
    rows = []
    decode_cases = [
        ("decode", 64, 4096, False),
        ("decode", 256, 1024, False),
        ("decode (split)", 8, 32768, False),
        ("decode+scores", 64, 4096, True),
    ]
    for label, num_reqs, live, scores in decode_cases:
        cache, lay, idx, ptr = make_case(num_reqs, live, hq, hkv, d, dt, dev)
        q = torch.randn(num_reqs, hq, d, device=dev, dtype=dt)
        out = torch.empty_like(q)
        splits = _auto_splits(dev, num_reqs, hkv, idx.numel())
        t = time_fn(lambda: tri_attention(q, cache, lay, idx, ptr, out=out, return_key_scores=scores))
        k, v = dense_kv(cache, lay, idx, num_reqs, live)
        best, base_us = best_baseline(sdpa_baselines(q[:, :, None], k, v, group))
        # Correctness at benchmark size, against SDPA on the dense gather (same bytes).
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        ref = F.scaled_dot_product_attention(q[:, :, None], ke, ve)
        del ke, ve
        err = (out.float() - ref[:, :, 0].float()).abs().max().item()
        kv_bytes = 2 * num_reqs * live * hkv * d * elem
        # With scores, decode reads K once; the score pass reads the fp32 logits written by the main pass.
        aux = (2 * idx.numel() * hq * 4 + idx.numel() * hkv * 4) if scores else 0
        total = kv_bytes + 2 * q.numel() * elem + idx.numel() * 4 + aux
        rows.append({
            "case": label, "reqs": num_reqs, "live": live, "splits": splits if "decode" in label else 1,
            "us": round(t["median_us"], 1), "kv_GBps": round(gbs(kv_bytes, t["median_us"]), 1),
            "sdpa_us": round(base_us, 1), "sdpa": best,
            "frac_sdpa": round(base_us / t["median_us"], 3),
            "frac_copy": round(gbs(total, t["median_us"]) / copy_gbs, 3),
            "max_err_vs_sdpa": float(f"{err:.3g}"),
        })
        del cache, k, v
        torch.cuda.empty_cache()

    # Prefill chunk: 4 requests, 3584 past + 512 new tokens each (causal within the chunk).
    num_reqs, live, n_new = 4, 4096, 512
    cache, lay, idx, ptr = make_case(num_reqs, live, hq, hkv, d, dt, dev, seed=1)
    q = torch.randn(num_reqs * n_new, hq, d, device=dev, dtype=dt)
    q_indptr = (torch.arange(num_reqs + 1, device=dev) * n_new).to(torch.int32)
    out = torch.empty_like(q)
    t = time_fn(lambda: tri_attention(q, cache, lay, idx, ptr, q_indptr, out=out))
    k, v = dense_kv(cache, lay, idx, num_reqs, live)
    q4 = q.view(num_reqs, n_new, hq, d).transpose(1, 2)
    best, base_us = best_baseline(sdpa_baselines(q4, k, v, group, causal_offset=live - n_new))
    keys_seen = num_reqs * sum(live - n_new + i + 1 for i in range(n_new))
    flops = 4 * hq * d * keys_seen
    rows.append({
        "case": "prefill chunk", "reqs": num_reqs, "live": live, "splits": 1,
        "us": round(t["median_us"], 1), "kv_GBps": round(gbs(2 * num_reqs * live * hkv * d * elem, t["median_us"]), 1),
        "sdpa_us": round(base_us, 1), "sdpa": best, "frac_sdpa": round(base_us / t["median_us"], 3),
        "frac_copy": None, "TFLOPs": round(flops / (t["median_us"] * 1e-6) / 1e12, 1),
    })
    return rows


def kv_bytes_read(lens, n_new, num_q_heads, num_kv_heads, head_dim, elem, *, scores: bool) -> dict:
    """Bytes read from the KV cache (and score workspaces) by construction of the kernels.

    ``lens``: listed non-PAD keys per request; ``n_new``: queries per request, or
    None for decode. Returns {"kv": KV-cache bytes, "aux": logits + lse bytes,
    "old_kv": KV bytes of the replaced design (scores re-read K in decode too)}.
    """
    group = num_q_heads // num_kv_heads
    decode = n_new is None
    a = contracts.TokenAttentionArgs(num_reqs=len(lens), num_q_tokens=len(lens) if decode else sum(n_new),
                                     num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                     group=group, nnz_max=sum(lens), scale=1.0, decode=decode)
    row = head_dim * elem  # one key's K (or V) row of one kv head
    main_keys = 0  # (key, kv head) pairs the main kernel loads, per kv head
    for r, n_live in enumerate(lens):
        if decode:
            main_keys += n_live
            continue
        bq = _config(a)["BLOCK_Q"]
        for q0 in range(0, n_new[r], bq):
            q_last = min(q0 + bq, n_new[r]) - 1
            main_keys += min(n_live, n_live - n_new[r] + q_last + 1)
    main = 2 * row * main_keys * num_kv_heads
    score_kv = 0 if (decode or not scores) else row * sum(lens) * num_kv_heads
    old_score_kv = row * sum(lens) * num_kv_heads if scores else 0
    aux = 0
    if scores:
        aux += 4 * a.num_q_tokens * num_q_heads * 2  # lse written, read back
        if decode:
            aux += 4 * sum(lens) * num_q_heads * 2  # logits written by the main pass, read by the score pass
    return {"kv": main + score_kv, "aux": aux, "old_kv": main + old_score_kv, "main_kv": main}


def kv_read_rows() -> list[dict]:
    """kv_read_ratio per case (no timing: bytes counted from the kernels' construction)."""
    rows = []
    d, elem = 128, 2
    for case, hq, hkv, lens, n_new in [
        ("decode 64x4096 g4", 32, 8, [4096] * 64, None),
        ("decode 8x32768 g4", 32, 8, [32768] * 8, None),
        ("decode 64x4096 g8", 64, 8, [4096] * 64, None),
        ("decode 64x4096 g1", 32, 32, [4096] * 64, None),
        ("prefill 4x(3584+512) g4", 32, 8, [4096] * 4, [512] * 4),
        ("prefill 16x(1008+16) g4", 32, 8, [1024] * 16, [16] * 16),
    ]:
        off = kv_bytes_read(lens, n_new, hq, hkv, d, elem, scores=False)
        on = kv_bytes_read(lens, n_new, hq, hkv, d, elem, scores=True)
        rows.append({
            "case": case, "kv_read_ratio": round(on["kv"] / off["kv"], 4),
            "aux_ratio": round((on["kv"] + on["aux"]) / off["kv"], 4),
            "old_kv_read_ratio": round(on["old_kv"] / off["kv"], 4),
        })
    return rows


def gpu_score_rows() -> list[dict]:
    """Decode and prefill timed with scores off, return_key_scores, and score_out (one plan per case)."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    hq, hkv, d = 32, 8, 128
    rows = []
    for label, num_reqs, live, n_new in [("decode", 64, 4096, None), ("decode (split)", 8, 32768, None),
                                         ("prefill chunk", 4, 4096, 512)]:
        cache, lay, idx, ptr = make_case(num_reqs, live, hq, hkv, d, dt, dev)
        n_q = num_reqs if n_new is None else num_reqs * n_new
        q_indptr = None if n_new is None else (torch.arange(num_reqs + 1, device=dev) * n_new).to(torch.int32)
        q = torch.randn(n_q, hq, d, device=dev, dtype=dt)
        out = torch.empty_like(q)
        starts = (torch.arange(num_reqs, device=dev) * live).to(torch.int64)
        pos = torch.arange(live, device=dev, dtype=torch.int32).repeat(num_reqs)
        score_out = torch.zeros(num_reqs * live, device=dev)
        step = ops.plan_token_attention(lay, idx, ptr, q_indptr, num_q_heads=hq, dtype=dt, num_q_tokens=n_q,
                                        scores=True, mirror_starts=starts, kv_pos=pos)
        t_off = time_fn(lambda: step.run(q, cache, out=out))["median_us"]
        t_ks = time_fn(lambda: step.run(q, cache, out=out, return_key_scores=True))["median_us"]
        t_so = time_fn(lambda: step.run(q, cache, out=out, score_out=score_out))["median_us"]
        b = kv_bytes_read([live] * num_reqs, None if n_new is None else [n_new] * num_reqs, hq, hkv, d, 2, scores=True)
        b_off = kv_bytes_read([live] * num_reqs, None if n_new is None else [n_new] * num_reqs, hq, hkv, d, 2,
                              scores=False)
        rows.append({
            "case": label, "reqs": num_reqs, "live": live, "us_no_scores": round(t_off, 1),
            "us_key_scores": round(t_ks, 1), "us_score_out": round(t_so, 1),
            "us_ratio_score_out": round(t_so / t_off, 3), "us_ratio_key_scores": round(t_ks / t_off, 3),
            "kv_read_ratio": round(b["kv"] / b_off["kv"], 4),
        })
        del cache
        torch.cuda.empty_cache()
    return rows


def cpu_rows() -> list[dict]:
    """Torch reference vs SDPA on dense K/V (CPU wall clock); Triton interpreter checked for correctness only."""
    dt = torch.float32
    hq, hkv, d = 8, 2, 64
    group = hq // hkv
    rows = []
    for num_reqs, live in [(4, 256), (8, 512)]:
        cache, lay, idx, ptr = make_case(num_reqs, live, hq, hkv, d, dt, torch.device("cpu"))
        q = torch.randn(num_reqs, hq, d)
        t_ref = time_fn(lambda: ref_attention(q, cache, lay, idx, ptr), warmup=2, rep=10)
        k, v = dense_kv(cache, lay, idx, num_reqs, live)
        best, base_us = best_baseline(sdpa_baselines(q[:, :, None], k, v, group), warmup=2, rep=10)
        tri = tri_attention(q, cache, lay, idx, ptr)
        ref = ref_attention(q, cache, lay, idx, ptr, compute_dtype=torch.float64)
        rows.append({
            "case": "decode (CPU)", "reqs": num_reqs, "live": live,
            "ref_us": round(t_ref["median_us"], 1), "sdpa_us": round(base_us, 1), "sdpa": best,
            "sdpa_over_ref": round(base_us / t_ref["median_us"], 3),
            "triton_interp_max_err": float(f"{(tri.double() - ref).abs().max().item():.3g}"),
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small CPU run (also the default without CUDA)")
    ap.add_argument("--scores-only", action="store_true",
                    help="GPU: only the scores on / off timings and byte counts (no SDPA comparison; gpu_check.sh)")
    args = ap.parse_args()
    if on_gpu() and not args.quick:
        copy = copy_bandwidth_gbs()
        rows = [] if args.scores_only else gpu_rows(copy)
        if rows:
            print_table(f"token_attention on {torch.cuda.get_device_name()} (bf16, 32q/8kv heads, D=128); "
                        f"D2D copy {copy:.0f} GB/s", rows)
        summary = [{k: r[k] for k in ("case", "reqs", "live", "us", "kv_GBps", "frac_sdpa", "frac_copy")} for r in rows]
        kv_rows = kv_read_rows()
        print_table("KV bytes read with scores / without (by construction of the kernels)", kv_rows)
        score_rows = gpu_score_rows()
        print_table("scores on vs off, same plan (bf16, 32q/8kv heads, D=128)", score_rows)
        summary = summary or [{k: r[k] for k in ("case", "us_ratio_key_scores", "us_ratio_score_out", "kv_read_ratio")}
                              for r in score_rows]
        write_json("token_attention", {"mode": "gpu", "copy_GBps": copy, "rows": rows, "summary": summary,
                                       "kv_read": kv_rows, "scores": score_rows})
        return
    if not on_gpu() and not args.quick:
        print("no CUDA device: running the --quick CPU benchmark")
    rows = cpu_rows()
    print_table("token_attention on CPU: torch reference vs SDPA on dense K/V (fp32, 8q/2kv heads, D=64). "
                "CPU wall clock; the Triton interpreter is not timed (meaningless for speed)", rows)
    summary = [{k: r[k] for k in ("case", "reqs", "live", "ref_us", "sdpa_us", "sdpa_over_ref")} for r in rows]
    kv_rows = kv_read_rows()
    print_table("KV bytes read with scores / without (by construction of the kernels)", kv_rows)
    write_json("token_attention", {"mode": "cpu-quick", "rows": rows, "summary": summary, "kv_read": kv_rows})


if __name__ == "__main__":
    main()
