"""Benchmark compact_kv: one launch relocating tokens across every layer.

GPU (default when CUDA is present): realistic caches (32 layers, 8 KV heads,
head_dim 128, block size 16; vLLM 0.32's FlashAttention layout ``vllm_fused``
and FlashInfer NHD; bf16 and fp8; plus a 61-layer MLA cache), with >= 64 MiB of
token data moved per call. Sources are scattered over the cache, destinations
fill fresh blocks in order, as a reclamation plan does. Timed in this run with
CUDA events (``do_bench``), each row gives:

* ``GBps``: bytes read + written per second (2 x the token bytes moved);
* ``frac_copy``: that over the measured D2D ``torch`` copy bandwidth (read +
  write counted), the goal being >= 0.85;
* ``x_index_copy`` / ``x_gather_scatter``: speedup over the baselines in the
  same run: a loop of per-token ``index_copy_`` (per move and layer, moves on
  the host as a naive implementation has them), and per-layer torch
  advanced-indexing gather/scatter (``tokens[dst] = tokens[src]``).

compact_kv (CUDA extension and Triton) is timed both eagerly and replayed from
a CUDA graph (``*_graph``): eager timing includes the Python launch overhead,
the graph replay is the kernel alone (how the reclamation stream runs it).

``--quick`` (and any run without CUDA): small sizes on the CPU, medians and
ratios against the baselines timed in the same process; the C++ CPU op and the
torch reference are timed. The Triton interpreter is meaningless for speed, so
the CPU run only checks once that Triton matches the reference.

Usage: ``python bench/bench_compact_kv.py [--quick]``; writes
``bench/results/compact_kv.json``.
"""
from __future__ import annotations

import argparse
import os
import random

from common import (
    bench_device,
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

from vtoken.device import ops  # noqa: E402
from vtoken.layout import KVLayout, kv_cache_shape  # noqa: E402
from vtoken.reference import compact_kv as ref  # noqa: E402
from vtoken_kernels import contracts  # noqa: E402
from vtoken_kernels.compact_kv import compact_kv as triton_compact_kv  # noqa: E402

MiB = 1 << 20
# Per-token index_copy_ baseline: 2 launches per (move, layer); skipped above
# this many (move, layer) pairs to keep the run short.
MAX_LOOP_PAIRS = 40_000


def make_case(layout_name, dtype, num_layers, num_heads, head_dim, num_moves, device, *, block_size=16, seed=0):
    """Caches (one tensor per layer), layout and moves: scattered sources -> fresh blocks in order."""
    num_slots_needed = 4 * num_moves
    num_blocks = -(-num_slots_needed // block_size) + 1
    shape = kv_cache_shape(layout_name, num_blocks, block_size, num_heads, head_dim)
    storage = torch.uint8 if dtype == "fp8" else dtype
    caches = []
    for _ in range(num_layers):
        t = torch.empty(shape, dtype=storage, device=device)
        contracts.int_view(t).random_(0, 100)
        caches.append(t)
    layout = KVLayout.from_tensor(caches[0], layout_name)
    rng = random.Random(seed)
    # Destinations: the first blocks, filled in order; sources: random slots elsewhere.
    first_src_slot = -(-num_moves // block_size) * block_size
    dst = list(range(num_moves))
    src = rng.sample(range(first_src_slot, layout.num_slots), num_moves)
    as_t = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return caches, layout, as_t(src), as_t(dst)


def token_views(caches, layout):
    """``[num_blocks, block_size, num_kv, H, D]`` int views of every layer (as the reference)."""
    size = (layout.num_blocks, layout.block_size, layout.num_kv, layout.num_heads, layout.head_dim)
    stride = (layout.stride_block, layout.stride_offset, layout.stride_kv, layout.stride_head, 1)
    return [contracts.int_view(t).as_strided(size, stride, contracts.int_view(t).storage_offset()) for t in caches]


def gather_scatter_fn(caches, layout, src, dst):
    """Per-layer torch advanced indexing: ``tokens[dst] = tokens[src]`` (2 launches per layer)."""
    views = token_views(caches, layout)
    bs = layout.block_size
    sb, so, db, do = src.long() // bs, src.long() % bs, dst.long() // bs, dst.long() % bs

    def run():
        for v in views:
            v[db, do] = v[sb, so]

    return run


def index_copy_loop_fn(caches, layout, src, dst):
    """A loop of per-token ``index_copy_`` over moves and layers (host-side move list)."""
    views = token_views(caches, layout)
    bs = layout.block_size
    moves = [(s // bs, s % bs, d // bs, d % bs) for s, d in zip(src.tolist(), dst.tolist())]
    offsets = torch.arange(bs, device=src.device)
    idx = [offsets[i : i + 1] for i in range(bs)]

    def run():
        for sblk, soff, dblk, doff in moves:
            for v in views:
                v[dblk].index_copy_(0, idx[doff], v[sblk].index_select(0, idx[soff]))

    return run


def time_graph_or_none(fn):
    """Median µs of ``fn`` replayed from a CUDA graph, or None if it cannot be captured."""
    from common import time_graph

    try:
        return time_graph(fn)["median_us"]
    except RuntimeError as e:  # not capturable (e.g. a sync inside)
        print(f"  (graph capture failed: {str(e).splitlines()[0]})")
        return None


def bench_gpu(copy_gbs):
    device = bench_device()
    configs = [
        # layout, dtype, layers, kv heads, head_dim, moves
        ("vllm_fused", torch.bfloat16, 32, 8, 128, 512),  # 64 MiB moved
        ("vllm_fused", torch.bfloat16, 32, 8, 128, 2048),  # 256 MiB
        ("nhd", torch.bfloat16, 32, 8, 128, 512),
        ("vllm_fused", "fp8", 32, 8, 128, 1024),  # fp8 stored as uint8, 64 MiB
        ("mla", torch.bfloat16, 61, 1, 576, 1024),  # DeepSeek-style latent, ~69 MiB
    ]
    rows = []
    for layout_name, dtype, num_layers, num_heads, head_dim, num_moves in configs:
        caches, layout, src, dst = make_case(layout_name, dtype, num_layers, num_heads, head_dim, num_moves, device)
        esize = caches[0].element_size()
        moved = num_moves * num_layers * layout.rows_per_token * layout.head_dim * esize
        nbytes = 2 * moved
        args = contracts.layout_op_args(layout)
        times = {}
        if ops.has_extension_op("compact_kv"):
            cuda_fn = lambda: torch.ops.vtoken.compact_kv(caches, src, dst, *args)  # noqa: E731
            times["cuda_ext"] = time_fn(cuda_fn)["median_us"]
            times["cuda_ext_graph"] = time_graph_or_none(cuda_fn)
        tri_fn = lambda: triton_compact_kv(caches, layout, src, dst)  # noqa: E731
        times["triton"] = time_fn(tri_fn)["median_us"]
        times["triton_graph"] = time_graph_or_none(tri_fn)
        gs_fn = gather_scatter_fn(caches, layout, src, dst)
        times["gather_scatter"] = time_fn(gs_fn)["median_us"]
        times["gather_scatter_graph"] = time_graph_or_none(gs_fn)
        if num_moves * num_layers <= MAX_LOOP_PAIRS:
            times["index_copy_loop"] = time_fn(index_copy_loop_fn(caches, layout, src, dst))["median_us"]
        base_loop = times.get("index_copy_loop")
        base_gs = min(t for k, t in times.items() if k.startswith("gather_scatter") and t)
        for method, us in times.items():
            if us is None:
                continue
            rows.append({
                "method": method,
                "layout": layout_name,
                "dtype": str(dtype).replace("torch.", ""),
                "layers": num_layers,
                "moves": num_moves,
                "MiB_moved": round(moved / MiB, 1),
                "us": round(us, 2),
                "GBps": round(gbs(nbytes, us), 1),
                "frac_copy": round(gbs(nbytes, us) / copy_gbs, 3),
                "x_index_copy": round(base_loop / us, 1) if base_loop else None,
                "x_gather_scatter": round(base_gs / us, 2),
            })
        del caches
        torch.cuda.empty_cache()
    return rows


def bench_cpu(quick):
    device = torch.device("cpu")
    configs = [("vllm_fused", torch.float16, 4, 2, 64, 64), ("mla", torch.float16, 4, 1, 64, 64)]
    if not quick:
        configs += [("vllm_fused", torch.bfloat16, 8, 4, 128, 512), ("nhd", torch.float32, 8, 4, 128, 512)]
    rows = []
    for layout_name, dtype, num_layers, num_heads, head_dim, num_moves in configs:
        caches, layout, src, dst = make_case(layout_name, dtype, num_layers, num_heads, head_dim, num_moves, device)
        esize = caches[0].element_size()
        moved = num_moves * num_layers * layout.rows_per_token * layout.head_dim * esize
        times = {}
        if ops.has_extension_op("compact_kv"):
            args = contracts.layout_op_args(layout)
            times["cpp_cpu_op"] = time_fn(lambda: torch.ops.vtoken.compact_kv(caches, src, dst, *args))["median_us"]
        times["torch_reference"] = time_fn(lambda: ref.compact_kv(caches, layout, src, dst))["median_us"]
        times["gather_scatter"] = time_fn(gather_scatter_fn(caches, layout, src, dst))["median_us"]
        times["index_copy_loop"] = time_fn(index_copy_loop_fn(caches, layout, src, dst), warmup=1, rep=5)["median_us"]
        for method, us in times.items():
            rows.append({
                "method": method,
                "layout": layout_name,
                "dtype": str(dtype).replace("torch.", ""),
                "layers": num_layers,
                "moves": num_moves,
                "MiB_moved": round(moved / MiB, 2),
                "us": round(us, 1),
                "GBps": round(gbs(2 * moved, us), 2),
                "x_index_copy": round(times["index_copy_loop"] / us, 1),
                "x_gather_scatter": round(times["gather_scatter"] / us, 2),
            })
    # Triton under the interpreter: correctness once, no timing.
    caches, layout, src, dst = make_case("vllm_fused", torch.float16, 2, 2, 16, 8, device, seed=1)
    expected = [t.clone() for t in caches]
    ref.compact_kv(expected, layout, src, dst)
    triton_compact_kv(caches, layout, src, dst)
    triton_ok = all(torch.equal(contracts.int_view(a), contracts.int_view(b)) for a, b in zip(caches, expected))
    return rows, triton_ok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small CPU-sized run")
    args = parser.parse_args(argv)
    copy_gbs = copy_bandwidth_gbs()
    payload = {"copy_bandwidth_gbs": round(copy_gbs, 1), "torch": torch.__version__,
               "extension": ops.extension_loaded()}
    if on_gpu() and not args.quick:
        rows = bench_gpu(copy_gbs)
        title = f"compact_kv on {torch.cuda.get_device_name()} (D2D copy {copy_gbs:.0f} GB/s, read+write)"
        best = [r for r in rows if r["method"] in ("cuda_ext_graph", "triton_graph")]
        payload["summary"] = [
            {k: r[k] for k in ("method", "layout", "dtype", "moves", "MiB_moved", "GBps", "frac_copy",
                               "x_gather_scatter")}
            for r in best if r["MiB_moved"] >= 64
        ]
    else:
        rows, triton_ok = bench_cpu(args.quick)
        payload["triton_interpreter_matches_reference"] = triton_ok
        # NOTE: on a loaded machine OpenMP-parallel ops (advanced indexing,
        # at::parallel_for) slow down sharply; the load is recorded with them.
        payload["loadavg_1min"] = round(os.getloadavg()[0], 2)
        payload["cpu_threads"] = torch.get_num_threads()
        title = f"compact_kv on CPU ({torch.get_num_threads()} threads; memcpy {copy_gbs:.1f} GB/s, context only)"
        payload["summary"] = [
            {k: r[k] for k in ("method", "layout", "moves", "us", "x_index_copy", "x_gather_scatter")}
            for r in rows if r["method"] == "cpp_cpu_op"
        ]
    payload["rows"] = rows
    print_table(title, rows)
    if "triton_interpreter_matches_reference" in payload:
        print(f"Triton (interpreter) matches the reference: {payload['triton_interpreter_matches_reference']}")
    print("wrote", write_json("compact_kv", payload))


if __name__ == "__main__":
    main()
