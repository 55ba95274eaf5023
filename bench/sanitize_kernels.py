"""Launch every CUDA and Triton kernel of vtoken once at small sizes, each checked against its torch reference.

The program ``bench/gpu_check.sh`` runs under compute-sanitizer (memcheck,
then racecheck): small sizes keep the sanitizer's slowdown to seconds, and
the sizes still cover the kernels' tails (odd lengths, PAD entries, requests
with no live token, several tiles, split decode). Every launch writes into
poisoned outputs and must equal the reference exactly (copy and index
kernels) or within the tolerance of tests/test_token_attention.py
(attention: 2u relative, 2u x max|V| absolute; key scores 1e-4 / 1e-5 per
unit of mass).

Without CUDA (``gpu_check.sh --dry-run``): the same launches on CPU tensors,
the C++ CPU ops and Triton's interpreter, to check the plumbing.

Prints one line per launch; exit status 1 on any mismatch.
"""
from __future__ import annotations

import os
import sys

from common import bench_device, prepare_kernel_env

prepare_kernel_env()  # before vtoken / triton imports
import torch  # noqa: E402

import bench_block_live_counts as blc  # noqa: E402
import bench_build_slot_lists as bsl  # noqa: E402
import bench_compact_kv as ckv  # noqa: E402
import bench_token_attention as ta  # noqa: E402
from vtoken.device import ops  # noqa: E402
from vtoken.reference import compact_kv as ref_compact  # noqa: E402
from vtoken_kernels import contracts  # noqa: E402
from vtoken_kernels.compact_kv import compact_kv as triton_compact_kv  # noqa: E402

UNIT_ROUNDOFF = {torch.float32: 2.0**-16, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
failures: list[str] = []


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def report(name: str, fn) -> None:
    """Run one launch-and-check; a mismatch is recorded, the other launches still run."""
    try:
        fn()
    except AssertionError as e:
        failures.append(f"{name}: {e}")
        print(f"FAIL {name}: {e}", flush=True)
        return
    print(f"ok   {name}", flush=True)


def check_compact_kv(device, backend: str) -> None:
    # 3 layers, 37 moves (not a multiple of any tile), sources scattered, destinations in order.
    caches, layout, src, dst = ckv.make_case("vllm_fused", torch.float16, 3, 2, 64, 37, device, seed=3)
    want = [t.clone() for t in caches]
    ref_compact.compact_kv(want, layout, src, dst)
    if backend == "triton":
        triton_compact_kv(caches, layout, src, dst)
    else:
        torch.ops.vtoken.compact_kv(caches, src, dst, *contracts.layout_op_args(layout))
    sync(device)
    for got, exp in zip(caches, want):
        assert torch.equal(contracts.int_view(got), contracts.int_view(exp)), "cache differs from the reference"


def check_build_slot_lists(device, backend: str) -> None:
    c = bsl.Case(5, 37, 0.5, 3, device, seed=2)  # odd live count, half the mirror dead, 3 new tokens each
    fns = dict(bsl.backends(device))
    name = {"ext": "cuda" if device.type == "cuda" else "cpp"}.get(backend, backend)
    if name == "triton" and device.type != "cuda":  # the bench lists Triton on CUDA only
        fns["triton"] = lambda c: bsl.tk.build_slot_lists(*c.args())
    bsl.check_against_reference(c, fns[name])  # poisons the buffers, compares every element


def check_block_live_counts(device, backend: str) -> None:
    c = blc.Case(301, 23, 0.6, device, seed=4)  # PAD every 13th slot, 80% of the blocks allocated
    fns = dict(blc.backends(device))
    name = {"ext": "cuda" if device.type == "cuda" else "cpp"}.get(backend, backend)
    if name == "triton" and device.type != "cuda":
        fns["triton"] = lambda c: blc.tk.block_live_counts(c.slots, c.alive, c.num_blocks, c.block_size, c.allocated)
    blc.check(c, fns[name])


def check_token_attention(device, mode: str) -> None:
    dtype, hq, hkv, d = torch.float16, 8, 2, 64
    num_reqs, live = 3, 37
    cache, lay, idx, ptr = ta.make_case(num_reqs, live, hq, hkv, d, dtype, device, seed=5)
    g = torch.Generator().manual_seed(6)
    kw, q_indptr = {}, None
    if mode == "prefill":
        n_new = 5  # causal within the chunk: the last 5 keys of each request are its queries' own
        q_indptr = (torch.arange(num_reqs + 1) * n_new).to(device=device, dtype=torch.int32)
        q = torch.randn(num_reqs * n_new, hq, d, generator=g).to(device=device, dtype=dtype)
    else:
        q = torch.randn(num_reqs, hq, d, generator=g).to(device=device, dtype=dtype)
        if mode == "decode split":
            kw["num_splits"] = 3
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    _, ks = ta.tri_attention(q, cache, lay, idx, ptr, q_indptr, return_key_scores=True, out=out, **kw)
    oracle, oracle_ks = ta.ref_attention(q, cache, lay, idx, ptr, q_indptr, return_key_scores=True,
                                         compute_dtype=torch.float64)
    sync(device)
    u = UNIT_ROUNDOFF[dtype]
    s = idx.long()
    vmax = float(lay.canonical_view(cache)[s // lay.block_size, s % lay.block_size, 1].float().abs().max())
    try:
        torch.testing.assert_close(out.double(), oracle, rtol=2 * u, atol=2 * u * vmax)
        torch.testing.assert_close(ks.double(), oracle_ks, rtol=1e-4, atol=1e-5 * (hq // hkv))
    except AssertionError as e:
        raise AssertionError(str(e).splitlines()[0]) from None


def main() -> int:
    device = bench_device()
    ext = ops.extension_loaded() and (device.type == "cpu" or ops.extension_runs_on(device))
    triton = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    print(f"sanitize_kernels on {device} (vtoken._C: {'yes' if ext else 'no'}, "
          f"Triton: {'compiled' if device.type == 'cuda' else 'interpreter' if triton else 'no'})", flush=True)
    launches = []
    for op, fn in (("compact_kv", check_compact_kv), ("build_slot_lists", check_build_slot_lists),
                   ("block_live_counts", check_block_live_counts)):
        if ext and ops.has_extension_op(op):
            launches.append((f"{op} [vtoken._C]", fn, "ext"))
        if triton:
            launches.append((f"{op} [triton]", fn, "triton"))
    if triton:
        for mode in ("decode", "decode split", "prefill"):
            launches.append((f"token_attention {mode} [triton]", check_token_attention, mode))
    if not launches:
        print("no kernel to launch: neither vtoken._C nor Triton is usable here")
        return 1
    for name, fn, arg in launches:
        report(name, lambda: fn(device, arg))
    print(f"{len(launches) - len(failures)}/{len(launches)} launches match their reference", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
