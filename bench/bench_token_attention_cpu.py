"""Benchmark token_attention on the CPU: vtoken's C++ kernel vs the torch reference and vLLM's CPU_ATTN.

One decode step of one layer on the same batch, timed in one process:

* ``ref``: the torch reference (:mod:`vtoken.reference.token_attention`, a per-request loop);
* ``cpp``: ``torch.ops.vtoken.token_attention`` called directly (the kernel alone);
* ``ops``: :func:`vtoken.device.ops.token_attention` (contract checks, CPU content checks included,
  then the kernel): what the vLLM backend pays per layer;
* ``plan``: :func:`vtoken.device.ops.plan_token_attention` once, ``run`` timed (per-layer cost of a
  planned step);
* ``cpp_scores``: the kernel with ``return_key_scores`` (what an H2O / TOVA step pays);
* ``vllm``: vLLM's CPU_ATTN kernel (``torch.ops._C.cpu_attention_with_kv_cache`` with the
  scheduler metadata its metadata builder makes), on the same K/V written by its own
  ``cpu_attn_reshape_and_cache`` into its own cache; only when ``vllm`` imports (run it with
  the vLLM venv's python: vtoken._C built against the same torch loads there too).

Batch: ``--reqs`` requests with context lengths drawn in ``[--min-len, --max-len]``, every
request's blocks (block size 32, vLLM CPU's granularity) shuffled over the pool like an
allocator leaves them; all tokens live (no eviction), so both kernels read the same bytes.
Shapes: SmolLM2-135M (9 q / 3 kv heads, head_dim 64) and a larger GQA shape (32 / 8, 128).

The machine may be shared: every method is timed ``--rounds`` times, interleaved, each
round the median of ``--rep`` calls; reported are the median over rounds and the ratios
``vtoken / vllm`` per round (median). The outputs of ``cpp`` and ``vllm`` are compared
(max abs difference) so both time the same computation.

Usage: ``python bench/bench_token_attention_cpu.py [--threads 1,2] [--rounds 5]``; writes
``bench/results/token_attention_cpu.json``.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from common import prepare_kernel_env, print_table, write_json

prepare_kernel_env()

from vtoken.device import ops  # noqa: E402
from vtoken.layout import KVLayout, kv_cache_shape  # noqa: E402
from vtoken.reference.token_attention import token_attention as ref_attention  # noqa: E402
from vtoken_kernels.contracts import layout_op_args  # noqa: E402

BLOCK = 32
SHAPES = [("smollm2-135m", 9, 3, 64), ("gqa-32-8-128", 32, 8, 128)]


def vllm_ops():
    """vLLM's custom-op wrappers, or None when vLLM is not importable here."""
    try:
        from vllm import _custom_ops
    except ImportError:
        return None
    return _custom_ops


def make_batch(num_reqs, min_len, max_len, hq, hk, d, dtype, seed):
    """K/V of every token, the shared block table and vtoken's cache + slot lists."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lens = [rng.randint(min_len, max_len) for _ in range(num_reqs)]
    blocks_per = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(blocks_per) + 4
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    table = torch.zeros(num_reqs, max(blocks_per), dtype=torch.int32)
    slots = []
    cursor = 0
    for r, (n, nb) in enumerate(zip(lens, blocks_per)):
        table[r, :nb] = torch.tensor(perm[cursor:cursor + nb], dtype=torch.int32)
        cursor += nb
        slots += [int(table[r, t // BLOCK]) * BLOCK + t % BLOCK for t in range(n)]
    total = sum(lens)
    k = torch.randn(total, hk, d, generator=gen).to(dtype)
    v = torch.randn(total, hk, d, generator=gen).to(dtype)
    q = torch.randn(num_reqs, hq, d, generator=gen).to(dtype)
    cache = torch.zeros(kv_cache_shape("vllm_fused", num_blocks, BLOCK, hk, d), dtype=dtype)
    layout = KVLayout.from_tensor(cache, "vllm_fused")
    s = torch.tensor(slots, dtype=torch.int64)
    view = layout.canonical_view(cache)
    view[s // BLOCK, s % BLOCK, 0] = k
    view[s // BLOCK, s % BLOCK, 1] = v
    kv_indices = torch.tensor(slots, dtype=torch.int32)
    kv_indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return dict(lens=lens, table=table, slots=s, k=k, v=v, q=q, cache=cache, layout=layout,
                kv_indices=kv_indices, kv_indptr=kv_indptr, num_blocks=num_blocks)


def vllm_case(vo, b, hq, hk, d, dtype):
    """vLLM's cache (written by its own reshape_and_cache) and a ready decode call."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, BLOCK, d, "auto")
    cache = torch.zeros(kv_cache_shape("vllm_fused", b["num_blocks"], BLOCK, hk, d), dtype=dtype)
    kv = cache.view(b["num_blocks"], hk, 2 * BLOCK, d)
    key_cache, value_cache = kv.chunk(2, dim=2)
    vo.cpu_attn_reshape_and_cache(b["k"], b["v"], key_cache, value_cache, b["slots"], isa)
    n = len(b["lens"])
    qsl = torch.arange(n + 1, dtype=torch.int32)
    seq_lens = torch.tensor(b["lens"], dtype=torch.int32)
    meta = vo.cpu_attn_get_scheduler_metadata(
        num_reqs=n, num_heads=hq, num_kv_heads=hk, head_dim=d, seq_lens=seq_lens, dtype=dtype,
        query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=True)
    out = torch.empty_like(b["q"])

    def run():
        vo.cpu_attention_with_kv_cache(
            query=b["q"], key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=qsl,
            seq_lens=seq_lens, scale=d ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=b["table"], softcap=0.0, scheduler_metadata=meta, s_aux=None)
        return out

    return run, isa


def median_us(fn, rep):
    ts = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def bench_shape(name, hq, hk, d, args, vo):
    dtype = getattr(torch, args.dtype)
    b = make_batch(args.reqs, args.min_len, args.max_len, hq, hk, d, dtype, seed=hq * 1000 + d)
    q, cache, lay, idx, ptr = b["q"], b["cache"], b["layout"], b["kv_indices"], b["kv_indptr"]
    out, ks = torch.empty_like(q), torch.empty(idx.numel(), hk)
    scale = d ** -0.5
    lay_args = layout_op_args(lay)
    step = ops.plan_token_attention(lay, idx, ptr, num_q_heads=hq, dtype=dtype, scale=scale)
    fns = {
        "cpp": lambda: torch.ops.vtoken.token_attention(q, cache, idx, ptr, None, out, None, None, None, None,
                                                        scale, *lay_args),
        "cpp_scores": lambda: torch.ops.vtoken.token_attention(q, cache, idx, ptr, None, out, ks, None, None, None,
                                                               scale, *lay_args),
        "ops": lambda: ops.token_attention(q, cache, lay, idx, ptr, scale=scale, out=out),
        "plan": lambda: step.run(q, cache, out=out),
        "ref": lambda: ref_attention(q, cache, lay, idx, ptr, scale=scale),
    }
    isa, diff = None, None
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        if vo is not None:
            # NOTE: vLLM's scheduler metadata is built for the current thread count.
            fns["vllm"], isa = vllm_case(vo, b, hq, hk, d, dtype)
            fns["cpp"]()
            diff = float((out.float() - fns["vllm"]().float()).abs().max())
        for fn in fns.values():
            fn()  # warm-up (thread pool, scratch buffers)
        rounds = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, fn in fns.items():
                rounds[k].append(median_us(fn, 1 if k == "ref" else args.rep))
        row = {"shape": name, "dtype": args.dtype, "threads": threads, "reqs": args.reqs,
               "keys": int(ptr[-1]), "vllm_isa": isa}
        for k, ts in rounds.items():
            row[f"{k}_us"] = round(statistics.median(ts), 1)
        row["ref_over_cpp"] = round(statistics.median(r / c for r, c in zip(rounds["ref"], rounds["cpp"])), 2)
        if "vllm" in rounds:
            for k in ("cpp", "ops", "plan", "cpp_scores"):
                row[f"{k}_over_vllm"] = round(statistics.median(a / v for a, v in zip(rounds[k], rounds["vllm"])), 2)
            row["max_abs_diff_vs_vllm"] = diff
        rows.append(row)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", default="1,2", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rep", type=int, default=5)
    p.add_argument("--reqs", type=int, default=32)
    p.add_argument("--min-len", type=int, default=1024)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    args = p.parse_args()
    if not ops.has_extension_op("token_attention"):
        raise SystemExit("vtoken._C with token_attention is not built (python setup.py build_ext --inplace)")
    vo = vllm_ops()
    if vo is None:
        print("vllm is not importable here: vLLM's CPU_ATTN is not timed (use the vLLM venv's python)")
    rows = []
    for name, hq, hk, d in SHAPES:
        if name in args.shapes.split(","):
            rows += bench_shape(name, hq, hk, d, args, vo)
    print_table("token_attention CPU decode, one layer (median us over rounds; ratios per round)", rows)
    print("written", write_json("token_attention_cpu", {"args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
