"""The embedded engine on a GPU: CUDA-graph decode with relocation, the hooks' overhead, the paired demo, NVML.

Four parts, each written to ``bench/results/engine.json`` as soon as it ends
(a run cut short by a timeout keeps what finished):

(a) **graph_vs_eager** — correctness. The same requests are served twice by
    :class:`vtoken.engine.Engine` in ``vtoken`` mode with a live H2O policy
    (evict 50%) and reclamation eager enough to relocate: once with the decode
    step replayed from CUDA graphs (relocation runs outside the graph, on the
    relocation stream), once eagerly. PASS when the greedy tokens are
    identical, relocation really happened in both (relocated tokens > 0) and
    the graph run replayed graphs on every decode step (the eager run none).
    The model is fp32 with ``init_std`` 0.05 (0.02 makes greedy outputs
    repeat one token, which would make the comparison vacuous), and every
    request has the same length, so each decode batch equals a captured graph
    size: graph and eager then launch identical kernels and the comparison is
    exact (a padded graph batch changes the attention's kv split, and an
    H2O score near-tie would then pick other victims and diverge for a
    reason that is not a bug; tests/test_engine_runner.py checks padded
    batches). Also reported: decode ms/step in both runs (host wall clock per
    engine step, which ends with the greedy tokens' device->host copy).
(b) **hooks_overhead** — the indirection's cost. Two :class:`ModelRunner`
    over the same model and prompts decode in lockstep (alternating which
    goes first): one with no reclamation hooks at all (``native``), one with
    a ``vtoken``-mode :class:`ReclamationManager` and its per-step hooks
    (``admission_budget``, ``before_forward``, ``maybe_plan``, ``launch``,
    ``commit``) at the default trigger settings and no eviction, so nothing
    is ever reclaimed. Per-step wall time (the step ends with the tokens'
    device->host copy, as in the engine), median over many steps; the
    overhead is the median of the paired per-step differences over the
    native median (goal <= 0.5%). The hooks' own host time is timed too.
(c) **demo** — ``vtoken demo --model-preset gpu`` in-process
    (:func:`vtoken.experiments.demo.run_demo` with the demo's default sizes:
    8 requests x (128 + 256) tokens, H2O 50%, one recorded victim trace),
    reusing the model built for (b); its table is printed as the CLI prints it.
(d) **nvml** — GPU memory used and utilization sampled by NVML
    (``nvidia-ml-py``'s ``pynvml``) every 0.1 s in a background thread, per
    part. NVML's utilization is the fraction of its own sample window (1/6 s
    to 1 s, by product) in which a kernel was running; memory used is the
    whole device's (every process, the CUDA context included).

GPU sizes: (a) a 8-layer fp32 Llama (hidden 1024, 16/4 heads, vocab 32000),
16 requests x (384 + 192) tokens; (b) and (c) the ``gpu`` preset (TinyLlama-1.1B
shape, random bf16 weights), (b) at 32 requests x 512-token prompts, 300 timed
decode steps per mode after 20 warm-up steps.

``--quick`` (and any run without CUDA): the tiny preset at toy sizes on the
CPU, so the script is exercised without a GPU: (a) runs eagerly only (no CUDA
graphs on CPU) and reports SKIP, (b) times the same protocol (CPU times are
noisy; not a measure of the goal), (c) runs a small demo, (d) is skipped.

Exit status: 1 if a part failed (FAIL or an error), else 0.

    python bench/bench_engine.py            # GPU
    python bench/bench_engine.py --quick    # CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import traceback
from contextlib import contextmanager

import numpy as np
import torch

from common import print_table, write_json

# NOTE: the debug flag adds invariant hashes and host syncs to every step; timings need it off.
os.environ["VTOKEN_DEBUG_INVARIANTS"] = "0"

from vtoken.engine.model import LlamaModel, ModelConfig  # noqa: E402
from vtoken.engine.runner import ModelRunner, RunnerConfig  # noqa: E402
from vtoken.engine.scheduler import Engine, EngineConfig  # noqa: E402
from vtoken.experiments.common import (  # noqa: E402
    EAGER_RECLAIM, ModelSpec, fit_num_blocks, full_blocks, make_prompts, policy_config,
)
from vtoken.experiments.demo import DemoConfig, format_demo, run_demo  # noqa: E402
from vtoken.reclamation.manager import ReclaimConfig, ReclamationManager  # noqa: E402

# (a)'s model: fp32 so graph vs eager is compared at full precision; init_std 0.05 keeps greedy
# outputs diverse at hidden 1024 (0.02 repeated one token in a CPU check, 0.05 gave 24 distinct of 24).
MID_FP32 = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16,
                num_kv_heads=4, init_std=0.05, dtype="float32")


# The flat rows of the JSON ``summary`` (bench/summarize.py's short table); full rows go to ``details``.
SUMMARY_KEYS = (
    "part", "result", "outputs_identical", "relocated_tokens", "graph_replays", "graph_decode_ms", "eager_decode_ms",
    "native_ms_per_step", "vtoken_ms_per_step", "overhead_pct", "hooks_host_us", "goal_met",
    "naive_retained_per_req", "vtoken_retained_per_req", "naive_utilization", "vtoken_utilization",
    "native_max_concurrency", "naive_max_concurrency", "vtoken_max_concurrency", "distinct_tokens",
    "note", "error", "part_s",
)


def sizes(quick: bool) -> dict:
    if quick:
        return dict(
            a_model="tiny", a_reqs=4, a_prompt=64, a_output=64, a_block=16,
            b_model="tiny", b_reqs=4, b_prompt=32, b_steps=60, b_warmup=5, b_block=16,
            demo=dict(requests=4, prompt_len=64, output_len=64, num_blocks=64),
        )
    return dict(
        a_model="mid_fp32", a_reqs=16, a_prompt=384, a_output=192, a_block=16,
        b_model="gpu", b_reqs=32, b_prompt=512, b_steps=300, b_warmup=20, b_block=16,
        demo={},  # the demo's defaults
    )


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- (d) NVML
class NvmlSampler:
    """Samples the device's memory used and utilization with NVML in a background thread, tagged by phase."""

    def __init__(self, device, interval_s: float = 0.1):
        self.device, self.interval_s = device, interval_s
        self.samples: list = []  # (phase, mem_used_MiB, gpu_util_pct, mem_util_pct, power_W)
        self.reason = None
        self.info: dict = {}
        self._phase = None
        self._stop = threading.Event()
        self._thread = None
        self._nvml = None
        self._handle = None
        self._torch_peak: dict = {}
        if device.type != "cuda":
            self.reason = "no CUDA device"
            return
        try:
            import pynvml
        except ImportError:
            self.reason = "nvidia-ml-py (pynvml) is not installed"
            return
        try:
            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle, how = self._find_handle(pynvml)
            name = pynvml.nvmlDeviceGetName(self._handle)
            mem = pynvml.nvmlDeviceGetMemoryInfo(self._handle)
            self.info = {"nvml_device": name.decode() if isinstance(name, bytes) else str(name),
                         "matched_by": how, "mem_total_MiB": round(mem.total / 2**20),
                         "driver": _s(pynvml.nvmlSystemGetDriverVersion())}
            self._read()  # fails here, not in the thread, if a query is unsupported (e.g. MIG utilization)
        except Exception as e:  # noqa: BLE001 - any NVML failure disables sampling, never the benchmark
            self.reason = f"NVML unavailable: {type(e).__name__}: {e}"
            self._handle = None

    def _find_handle(self, nv):
        """The NVML handle of torch's device: matched by UUID, else by index."""
        idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
        try:
            want = str(torch.cuda.get_device_properties(idx).uuid).lower()
            want = want.split("-", 1)[1] if want.startswith(("gpu-", "mig-")) else want
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                got = _s(nv.nvmlDeviceGetUUID(h)).lower()
                if got.split("-", 1)[-1] == want:
                    return h, "uuid"
        except Exception:  # noqa: BLE001 - older torch without .uuid: fall back to the index
            pass
        return nv.nvmlDeviceGetHandleByIndex(idx), "index (CUDA_VISIBLE_DEVICES may remap it)"

    def _read(self):
        nv, h = self._nvml, self._handle
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        util = nv.nvmlDeviceGetUtilizationRates(h)
        try:
            power = nv.nvmlDeviceGetPowerUsage(h) / 1e3
        except Exception:  # noqa: BLE001 - power is optional
            power = None
        return mem.used / 2**20, float(util.gpu), float(util.memory), power

    @property
    def available(self) -> bool:
        return self._handle is not None

    def start(self) -> None:
        if not self.available:
            return

        def loop():
            while not self._stop.wait(self.interval_s):
                try:
                    self.samples.append((self._phase, *self._read()))
                except Exception as e:  # noqa: BLE001
                    self.reason = f"NVML sampling stopped: {type(e).__name__}: {e}"
                    return

        self._thread = threading.Thread(target=loop, name="nvml-sampler", daemon=True)
        self._thread.start()

    @contextmanager
    def phase(self, name: str):
        self._phase = name
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            if self.device.type == "cuda":
                self._torch_peak[name] = torch.cuda.max_memory_allocated(self.device) / 2**20
            self._phase = None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass

    def rows(self) -> list:
        """One row per phase: samples, memory used (max, mean), GPU utilization (mean, max), power (mean)."""
        out, samples = [], list(self.samples)  # the sampler thread may append meanwhile
        for name in dict.fromkeys(s[0] for s in samples if s[0] is not None):
            ss = [s for s in samples if s[0] == name]
            mem, util = [s[1] for s in ss], [s[2] for s in ss]
            power = [s[4] for s in ss if s[4] is not None]
            out.append({
                "part": "nvml", "phase": name, "samples": len(ss),
                "mem_used_max_MiB": round(max(mem)), "mem_used_mean_MiB": round(statistics.mean(mem)),
                "gpu_util_mean_pct": round(statistics.mean(util), 1), "gpu_util_max_pct": max(util),
                "mem_util_mean_pct": round(statistics.mean(s[3] for s in ss), 1),
                "power_mean_W": round(statistics.mean(power), 1) if power else None,
                "torch_max_alloc_MiB": round(self._torch_peak.get(name, 0.0)),
            })
        return out


def _s(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


# ----------------------------------------------------------------------------- models
def build_model(which: str, device) -> tuple:
    """(model, description, build seconds)."""
    t0 = time.perf_counter()
    if which == "mid_fp32":
        model = LlamaModel(ModelConfig(**MID_FP32, seed=0), device=device)
        desc = "fp32 Llama (8 layers, hidden 1024, 16/4 heads, vocab 32000, init_std 0.05)"
    else:
        spec = ModelSpec(preset=which, device=str(device))
        model = spec.build()
        desc = spec.describe(model)
    _sync(device)
    return model, desc, time.perf_counter() - t0


class _Prebuilt(ModelSpec):
    """A :class:`ModelSpec` whose ``build()`` returns a model already built from the same preset."""

    def build(self):
        return self._model


# ----------------------------------------------------------------------------- (a)
def part_graph_vs_eager(sz, device, graphs: bool) -> dict:
    model, desc, build_s = build_model(sz["a_model"], device)
    R, P, O, S = sz["a_reqs"], sz["a_prompt"], sz["a_output"], sz["a_block"]
    prompts = make_prompts(R, P, model.config.vocab_size, seed=1)
    engine_cfg = dict(num_blocks=fit_num_blocks(R, full_blocks(P, O, S), S), block_size=S, max_num_reqs=R,
                      max_num_tokens=R * P, reclaim=dict(EAGER_RECLAIM))
    pcfg = policy_config("h2o", 0.5)

    def run(graph: bool) -> dict:
        eng = Engine(model, EngineConfig(mode="vtoken", policy="h2o", policy_config=dict(pcfg), cuda_graph=graph,
                                         history=None, **engine_cfg))  # the median reads every decode step
        _sync(device)
        t0 = time.perf_counter()
        out = eng.generate(prompts, O)
        _sync(device)
        seconds = time.perf_counter() - t0
        s = eng.summary()
        decode = [st.seconds * 1e3 for st in eng.stats if st.kind == "decode"]
        return {"outputs": [list(r.output) for r in out], "relocated": s["relocated_tokens"],
                "reclaimed_blocks": s["reclaimed_blocks"], "replays": eng.runner.num_graph_replays,
                "decode_steps": len(decode), "decode_ms": statistics.median(decode), "seconds": seconds,
                "preemptions": s["preemptions"]}

    eager = run(False)
    n_tok = sum(len(o) for o in eager["outputs"])
    distinct = len({t for o in eager["outputs"] for t in o})
    row = {"part": "graph_vs_eager", "model": desc, "requests": R, "prompt": P, "output": O,
           "relocated_tokens": eager["relocated"], "reclaimed_blocks": eager["reclaimed_blocks"],
           "eager_decode_ms": eager["decode_ms"], "distinct_tokens": distinct, "tokens": n_tok,
           "build_s": build_s}
    if not graphs:
        row.update(result="SKIP", note="no CUDA graphs on CPU: eager run only (relocation checked)")
        if eager["relocated"] <= 0:
            row.update(result="FAIL", note="no relocation happened in the eager vtoken run")
        print(f"\n[graph_vs_eager] {row['result']}: {row['note']} "
              f"({eager['relocated']} tokens relocated, {n_tok} tokens)")
        return row
    graph = run(True)
    same = graph["outputs"] == eager["outputs"]
    first_diff = None
    if not same:
        first_diff = next(((i, j) for i, (g, e) in enumerate(zip(graph["outputs"], eager["outputs"]))
                           for j in range(min(len(g), len(e))) if g[j] != e[j]), "lengths")
    ok = (same and graph["relocated"] > 0 and eager["relocated"] > 0 and graph["replays"] == graph["decode_steps"]
          and eager["replays"] == 0 and graph["preemptions"] == eager["preemptions"] == 0)
    row.update(result="PASS" if ok else "FAIL", outputs_identical=same, graph_relocated_tokens=graph["relocated"],
               graph_replays=graph["replays"], decode_steps=graph["decode_steps"], graph_decode_ms=graph["decode_ms"],
               graph_speedup=eager["decode_ms"] / graph["decode_ms"], first_difference=str(first_diff))
    print(f"\n[graph_vs_eager] {row['result']}: CUDA-graph decode vs eager, vtoken mode with relocation: "
          f"outputs {'IDENTICAL' if same else f'DIFFERENT (first at request/step {first_diff})'} "
          f"({n_tok} tokens, {distinct} distinct); relocated {graph['relocated']} (graph) / {eager['relocated']} "
          f"(eager) tokens; {graph['replays']} graph replays over {graph['decode_steps']} decode steps; "
          f"decode {graph['decode_ms']:.2f} ms/step (graph) vs {eager['decode_ms']:.2f} (eager)")
    return row


# ----------------------------------------------------------------------------- (b)
def part_hooks_overhead(sz, device, model, desc) -> dict:
    R, P, S = sz["b_reqs"], sz["b_prompt"], sz["b_block"]
    steps, warm = sz["b_steps"], sz["b_warmup"]
    per_req = -(-(P + steps + warm + 1) // S)
    num_blocks = int(R * per_req * 1.1) + 64  # + the vtoken headroom reserve (2% by default)
    rcfg = RunnerConfig(num_blocks=num_blocks, block_size=S, max_num_reqs=R, max_num_tokens=R * P,
                        graph_batch_sizes=(R,))
    native = ModelRunner(model, rcfg)
    vt = ModelRunner(model, rcfg)
    # The engine's defaults: trigger checked every 8 steps; with no eviction it never fires.
    mgr = ReclamationManager(vt.table, ReclaimConfig(mode="vtoken", check_invariants=False),
                             kv_caches=vt.kv_caches, layout=vt.layout, mirror=vt.mirror, device=vt.device)
    vt.reclaimer = mgr
    reqs = list(range(R))
    prompts = make_prompts(R, P, model.config.vocab_size, seed=2)
    firsts = []
    for runner in (native, vt):
        for r in reqs:
            runner.add_request(r)
        firsts.append(runner.prefill(reqs, prompts).next_tokens())
    native.warmup()  # captures the one graph size, R (every decode batch: same lengths, lockstep)
    vt.warmup()
    nxt = firsts[0]
    t_nat, t_vt, t_hooks = [], [], []
    tokens_equal = bool(np.array_equal(firsts[0], firsts[1]))

    def step_native(tok):
        t0 = time.perf_counter()
        out = native.decode(reqs, tok).next_tokens()
        return out, time.perf_counter() - t0, 0.0

    def step_vtoken(tok):
        t0 = time.perf_counter()
        mgr.admission_budget()
        mgr.before_forward()
        t1 = time.perf_counter()
        out = vt.decode(reqs, tok).next_tokens()
        t2 = time.perf_counter()
        mgr.launch(mgr.maybe_plan())
        mgr.commit()
        t3 = time.perf_counter()
        return out, t3 - t0, (t1 - t0) + (t3 - t2)

    for i in range(warm + steps):
        res = {}
        for name, fn in ((("native", step_native), ("vtoken", step_vtoken)) if i % 2 == 0
                         else (("vtoken", step_vtoken), ("native", step_native))):
            res[name] = fn(nxt)
        tokens_equal &= bool(np.array_equal(res["native"][0], res["vtoken"][0]))
        if i >= warm:
            t_nat.append(res["native"][1] * 1e3)
            t_vt.append(res["vtoken"][1] * 1e3)
            t_hooks.append(res["vtoken"][2] * 1e6)
        nxt = res["native"][0]
    _sync(device)
    med_nat, med_vt = statistics.median(t_nat), statistics.median(t_vt)
    paired = statistics.median(v - n for v, n in zip(t_vt, t_nat))
    rec = mgr.metrics.summary()
    q = lambda xs, p: float(np.percentile(xs, p))  # noqa: E731
    row = {
        "part": "hooks_overhead", "model": desc, "requests": R, "prompt": P, "steps": steps,
        "graphs": bool(native.use_graph), "native_ms_per_step": med_nat, "vtoken_ms_per_step": med_vt,
        "native_p20_p80_ms": f"{q(t_nat, 20):.3f}/{q(t_nat, 80):.3f}",
        "vtoken_p20_p80_ms": f"{q(t_vt, 20):.3f}/{q(t_vt, 80):.3f}",
        "overhead_pct": 100.0 * paired / med_nat,
        "overhead_pct_unpaired": 100.0 * (med_vt - med_nat) / med_nat,
        "hooks_host_us": statistics.median(t_hooks),
        "hooks_host_pct": 100.0 * statistics.median(t_hooks) / 1e3 / med_nat,
        "goal_pct": 0.5, "plans": rec.get("plans", 0), "tokens_equal": tokens_equal,
    }
    row["goal_met"] = row["overhead_pct"] <= row["goal_pct"]
    print(f"\n[hooks_overhead] vtoken hooks (no eviction) vs native: {med_vt:.3f} vs {med_nat:.3f} ms/step "
          f"(median of {steps} steps each, lockstep), overhead {row['overhead_pct']:+.2f}% (paired median), "
          f"hooks' host time {row['hooks_host_us']:.1f} us/step = {row['hooks_host_pct']:.2f}% of a step; "
          f"goal <= 0.5%: {'met' if row['goal_met'] else 'NOT met'}"
          + ("" if device.type == "cuda" else " (CPU timings: noise, not a measure of the goal)"))
    return row


# ----------------------------------------------------------------------------- (c)
def part_demo(sz, device, model, quick: bool) -> dict:
    spec = _Prebuilt(preset="tiny" if quick else "gpu", device=str(device))
    spec._model = model
    cfg = DemoConfig(model=spec, **sz["demo"])
    res = run_demo(cfg)
    print()
    print(format_demo(res))
    m = res.modes
    vt_out = m["vtoken"].outputs
    row = {"part": "demo", "model": res.model, "requests": cfg.requests, "prompt": cfg.prompt_len,
           "output": cfg.output_len, "outputs_identical": res.outputs_identical,
           "result": "PASS" if res.outputs_identical else "FAIL",
           "distinct_tokens": len({t for o in vt_out for t in o}), "seconds": res.seconds}
    for mode in ("native", "naive", "vtoken"):
        r = m[mode]
        row[f"{mode}_retained_per_req"] = r.retained_blocks_per_request
        row[f"{mode}_utilization"] = r.utilization
        row[f"{mode}_max_concurrency"] = r.max_concurrency
        row[f"{mode}_tokens_per_s"] = r.tokens_per_s
    row["vtoken_relocated_tokens"] = m["vtoken"].summary["relocated_tokens"]
    return row, res.to_dict()


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CPU smoke run at toy sizes (also the default without CUDA)")
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    if not gpu:
        torch.set_num_threads(1)  # the tiny model's ops are too small to share (see experiments.common)
        if not args.quick:
            print("no CUDA device: running the --quick CPU benchmark")
    sz = sizes(quick=not gpu)
    t_start = time.perf_counter()
    sampler = NvmlSampler(device)
    sampler.start()
    print(f"device: {torch.cuda.get_device_name(device) if gpu else 'cpu'}; torch {torch.__version__}; "
          f"NVML: {'sampling every 0.1 s' if sampler.available else 'off (' + str(sampler.reason) + ')'}")
    summary, details, failed = [], {}, []

    def save():
        nvml = sampler.rows()
        rows = summary + [{k: r[k] for k in ("part", "phase", "mem_used_max_MiB", "gpu_util_mean_pct",
                                             "gpu_util_max_pct")} for r in nvml]
        if not sampler.available:
            rows.append({"part": "nvml", "result": "SKIP", "note": sampler.reason})
        payload = {"summary": rows, "details": details, "device_type": device.type, "quick": not gpu,
                   "nvml": {**sampler.info, "status": "ok" if sampler.available else sampler.reason, "per_part": nvml},
                   "seconds": time.perf_counter() - t_start}
        # numpy scalars (and anything else json cannot take) as plain values, so a save never fails
        plain = json.loads(json.dumps(payload, default=lambda o: o.item() if hasattr(o, "item") else str(o)))
        write_json("engine", plain)

    def run_part(name, fn):
        t0 = time.perf_counter()
        print(f"\n--- ({name}) ---", flush=True)
        try:
            with sampler.phase(name):
                out = fn()
        except Exception as e:  # noqa: BLE001 - one part's failure must not hide the others' results
            traceback.print_exc()
            row = {"part": name, "result": "ERROR", "error": f"{type(e).__name__}: {e}"[:300]}
            out = None
        else:
            row, detail = out if isinstance(out, tuple) else (out, None)
            if detail is not None:
                details[name] = {"result": detail}
        row["part_s"] = time.perf_counter() - t0
        if row.get("result") in ("FAIL", "ERROR"):
            failed.append(name)
        details.setdefault(name, {})["row"] = row
        summary.append({k: row[k] for k in SUMMARY_KEYS if k in row})
        save()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return out

    run_part("graph_vs_eager", lambda: part_graph_vs_eager(sz, device, graphs=gpu))
    shared = {}

    def overhead():
        model, desc, build_s = build_model(sz["b_model"], device)
        shared.update(model=model, desc=desc)
        print(f"model: {desc} (built in {build_s:.1f} s)")
        row = part_hooks_overhead(sz, device, model, desc)
        row["build_s"] = build_s
        return row

    run_part("hooks_overhead", overhead)

    def demo():
        if "model" not in shared:  # (b) failed before building it
            shared["model"] = build_model(sz["b_model"], device)[0]
        return part_demo(sz, device, shared["model"], quick=not gpu)

    run_part("demo", demo)
    sampler.stop()
    save()

    print_table("engine benchmark summary", [{k: v for k, v in r.items() if k not in ("note", "error")}
                                             for r in summary])
    nvml_rows = sampler.rows()
    if nvml_rows:
        print_table("NVML per part (memory used: whole device)", [
            {k: r[k] for k in ("phase", "samples", "mem_used_max_MiB", "gpu_util_mean_pct", "gpu_util_max_pct",
                               "power_mean_W", "torch_max_alloc_MiB")} for r in nvml_rows])
    else:
        print(f"\nNVML: skipped ({sampler.reason})")
    a = next((r for r in summary if r["part"] == "graph_vs_eager"), {})
    print(f"\ngraph_vs_eager: {a.get('result', 'ERROR')}")
    print(f"total {time.perf_counter() - t_start:.1f} s; wrote bench/results/engine.json"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
