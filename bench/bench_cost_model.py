"""Calibration of the H200 roofline behind ``vtoken sla --cost-model h200``: measured / modeled step time.

The real :class:`~vtoken.engine.Engine` (native mode: its schedule does not
depend on the forward) serves ``B`` requests of ``P`` prompt + ``O`` output
tokens on a random-weight Llama of the ``gpu`` preset's shape (TinyLlama-1.1B:
22 layers, hidden 2048, 32/4 heads, head_dim 64, FFN 5632, vocab 32000, bf16;
decode from CUDA graphs, captured before timing). Every engine step is timed
on the host with ``torch.cuda.synchronize()`` before and after. The same
workload on a trace engine (:func:`vtoken.engine.trace_runner.trace_engine`:
the same scheduling, no forward) gives each step's composition, and
:meth:`H200Roofline.batch_seconds` of the same shape its modeled time. The
two schedules are checked equal step for step (kind, batch, new tokens,
blocks) before any ratio is reported.

Per ``B``: the prefill step(s) and the decode steps, measured and modeled
milliseconds and measured / modeled (decode: totals, and the median of the
per-step ratios). A ratio near 1 on an H200 says the roofline's parameters
(HBM bandwidth, FLOP rate x MFU, the 1.5 ms step overhead, which dominates a
small model's decode step) hold for this engine; on another GPU the ratio
compares that GPU to the H200 model.

``--quick`` (and any run without CUDA): the tiny preset (float32) at toy sizes
on the CPU, to exercise the script; its ratio compares a CPU to an H200, which
says nothing.

    python bench/bench_cost_model.py            # GPU: B = 1, 16, 64, P = 1024, O = 64
    python bench/bench_cost_model.py --quick    # CPU smoke run
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import prepare_kernel_env, print_table, write_json  # noqa: E402

prepare_kernel_env()

from vtoken import cdiv  # noqa: E402
from vtoken.engine.model import LlamaModel, ModelConfig  # noqa: E402
from vtoken.engine.scheduler import Engine, EngineConfig  # noqa: E402
from vtoken.engine.trace_runner import trace_engine  # noqa: E402
from vtoken.experiments.common import MODEL_PRESETS, make_prompts  # noqa: E402
from vtoken.experiments.cost_model import H200Roofline, ModelShape  # noqa: E402

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GPU_SIZES = dict(batches=(1, 16, 64), prompt_len=1024, output_len=64)
QUICK_SIZES = dict(batches=(1, 4), prompt_len=32, output_len=8)


def model_shape(name: str, c: ModelConfig) -> ModelShape:
    """The roofline's view of a :class:`ModelConfig`."""
    return ModelShape(name, c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
                      c.head_dim, c.vocab_size, tied_embeddings=c.tie_word_embeddings,
                      dtype_bytes=DTYPE_BYTES[c.dtype])


def engine_config(B: int, P: int, O: int, S: int = 16) -> EngineConfig:
    # every prompt in one prefill step; a pool that holds every request whole (native never preempts)
    return EngineConfig(mode="native", num_blocks=B * cdiv(P + O, S) + 1, block_size=S, max_num_reqs=B,
                        max_num_tokens=max(B * P, P + O), decision="host",
                        history=None)  # stats_rows compares every step


def stats_rows(eng) -> list:
    return [(s.kind, s.num_reqs, s.num_tokens, s.allocated_blocks, s.preempted) for s in eng.stats]


def measure(model, B: int, P: int, O: int, sync) -> tuple:
    """The real engine's per-step seconds (synchronized) and its step rows."""
    prompts = make_prompts(B, P, model.config.vocab_size, seed=B)
    warm = Engine(model, engine_config(B, P, O))  # compiles every kernel of both phases before timing
    warm.generate(prompts, 2)
    eng = Engine(model, engine_config(B, P, O))
    for p in prompts:
        eng.add_request(p, O)
    seconds = []
    while eng.has_work():
        sync()
        t0 = time.perf_counter()
        eng.step()
        sync()
        seconds.append(time.perf_counter() - t0)
    return np.asarray(seconds), stats_rows(eng)


def modeled(shape: ModelShape, B: int, P: int, O: int, vocab: int, roofline: H200Roofline) -> tuple:
    """The roofline's per-step seconds for the trace engine's schedule of the same workload, and its step rows."""
    eng = trace_engine(engine_config(B, P, O), vocab_size=vocab)
    for p in make_prompts(B, P, vocab, seed=B):
        eng.add_request(p, O)
    steps = []
    while eng.has_work():
        eng.step()
        steps.append(sum(roofline.batch_seconds(shape, f.past, f.new) for f in eng.runner.take_forwards()))
    return np.asarray(steps), stats_rows(eng)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CPU smoke run at toy sizes (also without CUDA)")
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if gpu else "cpu")
    preset = "gpu" if gpu else "tiny"
    sizes = GPU_SIZES if gpu else QUICK_SIZES
    t_start = time.perf_counter()
    cfg = ModelConfig(**MODEL_PRESETS[preset])
    model = LlamaModel(cfg, device=device)
    shape = model_shape(f"{preset} preset", cfg)
    roofline = H200Roofline()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    P, O = sizes["prompt_len"], sizes["output_len"]
    summary, failed = [], []
    for B in sizes["batches"]:
        real_s, real_rows = measure(model, B, P, O, sync)
        model_s, model_rows = modeled(shape, B, P, O, cfg.vocab_size, roofline)
        if real_rows != model_rows:
            failed.append(B)
            summary.append({"batch": B, "phase": "schedule", "note": "trace schedule != engine schedule: no ratio"})
            continue
        kinds = np.array([r[0] for r in real_rows])
        for phase in ("prefill", "decode"):
            sel = kinds == phase
            if not sel.any():
                continue
            row = {"batch": B, "phase": phase, "steps": int(sel.sum()),
                   "measured_ms": 1e3 * float(real_s[sel].sum()), "modeled_ms": 1e3 * float(model_s[sel].sum())}
            row["measured_over_modeled"] = row["measured_ms"] / row["modeled_ms"]
            # per step (medians): what a decode step costs, the quantity the modeled SLA sweeps rest on
            row["measured_ms_per_step"] = 1e3 * float(np.median(real_s[sel]))
            row["modeled_ms_per_step"] = 1e3 * float(np.median(model_s[sel]))
            row["median_step_ratio"] = float(np.median(real_s[sel] / model_s[sel]))
            summary.append(row)
    print(f"measured (this engine on {torch.cuda.get_device_name() if gpu else 'cpu'}) / modeled (H200 roofline: "
          f"{roofline.hbm_bandwidth / 1e12:g} TB/s, {roofline.flops_rate / 1e12:g} TFLOP/s x {roofline.mfu:g}, "
          f"{1e3 * roofline.step_overhead:g} ms per step), {shape.name}, P={P}, O={O}")
    print_table("cost model calibration", summary)
    write_json("cost_model", {"summary": summary, "quick": not gpu, "prompt_len": P, "output_len": O,
                              "shape": dataclasses.asdict(shape), "roofline": dataclasses.asdict(roofline),
                              "seconds": time.perf_counter() - t_start})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
