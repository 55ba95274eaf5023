"""Serving benchmark: vLLM's OpenAI server, vanilla / naive / vtoken on the same KV budget, vLLM's own client.

For each mode it starts ``python -m vllm.entrypoints.openai.api_server`` on
vtoken's export of SmolLM2-135M-Instruct with the same KV cache
(``--num-gpu-blocks-override``), drives it with ``vllm bench serve``'s client
(``vllm.benchmarks.serve``: random prompts and outputs of fixed lengths,
``--ignore-eos``, bounded concurrency) and polls ``/metrics`` during the run
for the peak of ``vllm:num_requests_running`` and the preemptions. Modes:

- ``vanilla``: no connector (vLLM's own CPU attention), full KV;
- ``naive``: vtoken's connector, policy eviction, a block freed once all dead;
- ``vtoken``: the same eviction plus reclamation (relocation into holes).

Writes ``bench/results/serve.json`` and prints a dated markdown table::

    python bench/bench_serve.py            # the configuration in bench/RESULTS.md
    python bench/bench_serve.py --quick    # a smoke run (~1 min per mode on CPU)

Run it with the vLLM venv's Python and ``PYTHONPATH=python:.``; naive and
vtoken need vtoken's ``vllm.general_plugins`` entry point in that Python
(``pip install -e .`` there; the run refuses to start without it, since vLLM's
CPU_ATTN would attend their holed block lists). The CPU
build's ``vllm`` console script cannot start (it asks for the "vllm"
distribution), hence the module entry points.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from vllm_server_helper import Server, free_port, metric, server_command  # noqa: E402

RESULTS_DIR = os.path.join(HERE, "results")
MODES = ("vanilla", "naive", "vtoken")
NAME = "smollm2"
# vLLM's `vllm bench serve`, without the console script.
CLIENT = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
          "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); add_cli_args(p); "
          "main(p.parse_args(sys.argv[1:]))")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke configuration (fewer, shorter requests)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--num-blocks", type=int, default=64, help="KV cache blocks, every mode (block size 32)")
    p.add_argument("--input-len", type=int, default=320)
    p.add_argument("--output-len", type=int, default=160)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--policy", default="h2o")
    p.add_argument("--budget", type=float, default=0.5)
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "serve.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.input_len, args.output_len, args.max_concurrency = 8, 256, 64, 8
        args.num_blocks = 32
    return args


def extra_config(mode: str, args) -> dict | None:
    if mode == "vanilla":
        return None
    return {"mode": mode, "policy": args.policy,
            "policy_config": {"budget": args.budget, "sink": args.sink, "window": args.window}}


def client_command(port: int, model_dir: str, result_file: str, args) -> list[str]:
    return [sys.executable, "-c", CLIENT, "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
            "--endpoint", "/v1/completions", "--model", NAME, "--tokenizer", model_dir,
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio", "0", "--ignore-eos",
            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
            "--request-rate", "inf", "--seed", "0", "--temperature", "0",
            "--percentile-metrics", "ttft,tpot", "--metric-percentiles", "50,99", "--disable-tqdm",
            "--save-result", "--result-dir", os.path.dirname(result_file),
            "--result-filename", os.path.basename(result_file)]


def run_mode(mode: str, model_dir: str, args) -> dict:
    port = free_port()
    server = Server(server_command(model_dir, port, extra=extra_config(mode, args), num_blocks=args.num_blocks,
                                   # vLLM refuses a max_model_len the KV cache cannot hold for one request.
                                   max_model_len=args.input_len + args.output_len + 64, max_num_seqs=args.max_concurrency, served_name=NAME), port)
    try:
        t0 = time.perf_counter()
        server.wait_ready(args.start_timeout)
        start_s = time.perf_counter() - t0
        m0 = server.metrics()
        running, stop = [], threading.Event()

        def poll():
            while not stop.is_set():
                m = server.metrics()
                running.append(metric(m, "vllm:num_requests_running"))
                time.sleep(0.25)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        with tempfile.TemporaryDirectory() as tmp:
            result_file = os.path.join(tmp, f"{mode}.json")
            proc = subprocess.run(client_command(port, model_dir, result_file, args), capture_output=True, text=True)
            stop.set()
            poller.join(10)
            if proc.returncode != 0:
                raise RuntimeError(f"bench client failed for {mode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            with open(result_file) as f:
                res = json.load(f)
        m1 = server.metrics()
    finally:
        server.stop()
    return {
        "mode": mode, "server_start_s": round(start_s, 1),
        "completed": res["completed"], "duration_s": res["duration"],
        "peak_running": max(running) if running else None,
        "preemptions": metric(m1, "vllm:num_preemptions_total") - metric(m0, "vllm:num_preemptions_total"),
        "request_throughput": res["request_throughput"], "output_throughput": res["output_throughput"],
        "p50_ttft_ms": res["p50_ttft_ms"], "p99_ttft_ms": res["p99_ttft_ms"],
        "p50_tpot_ms": res["p50_tpot_ms"], "p99_tpot_ms": res["p99_tpot_ms"],
    }


def table(rows: list[dict]) -> str:
    head = ("| mode | peak running | preemptions | req/s | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
            "| completed |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['peak_running']:.0f} | {r['preemptions']:.0f} | "
                     f"{r['request_throughput']:.3f} | {r['output_throughput']:.2f} | "
                     f"{r['p50_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | {r['p50_tpot_ms']:.0f} / "
                     f"{r['p99_tpot_ms']:.0f} | {r['completed']} |")
    return "\n".join(lines)


def check_plugin(modes) -> None:
    """Refuse naive / vtoken without vtoken's vLLM plugin: vLLM's CPU_ATTN would attend their holed block lists."""
    from importlib.metadata import entry_points

    if set(modes) - {"vanilla"} and "vtoken" not in {e.name for e in entry_points(group="vllm.general_plugins")}:
        raise SystemExit("vtoken's vllm.general_plugins entry point is not installed in this Python (pip install -e . "
                         "into the vLLM venv, docs/vllm.md): naive / vtoken would run on vLLM's CPU_ATTN")


def main(argv=None) -> None:
    args = parse_args(argv)
    check_plugin(args.modes.split(","))
    os.environ.setdefault("VTOKEN_DEBUG_INVARIANTS", "0")
    from vtoken.checkpoints.loader import exported_dir

    model_dir = exported_dir("smollm2")
    rows = [run_mode(m, model_dir, args) for m in args.modes.split(",")]
    by = {r["mode"]: r for r in rows}
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["python", "bench/bench_serve.py", *(argv if argv is not None else sys.argv[1:])]),
           "config": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}
    if "naive" in by and "vtoken" in by:
        out["vtoken_over_naive"] = {
            "peak_running": by["vtoken"]["peak_running"] / by["naive"]["peak_running"],
            "output_throughput": by["vtoken"]["output_throughput"] / by["naive"]["output_throughput"],
        }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"## {out['date'][:10]} serving benchmark, `{out['command']}`")
    print(f"config: {json.dumps(out['config'])}")
    print(table(rows))
    if "vtoken_over_naive" in out:
        print("vtoken / naive:", json.dumps({k: round(v, 3) for k, v in out["vtoken_over_naive"].items()}))


if __name__ == "__main__":
    main()
