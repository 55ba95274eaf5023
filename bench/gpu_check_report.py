"""The one JSON of a gpu_check.sh run, its validation and its short table.

``python bench/gpu_check_report.py WORK --budget S --wall S [--dry-run] [--out FILE]``
reads what the steps left in ``WORK`` (``steps.jsonl``: one line per step;
``counts_<step>.jsonl``: pytest outcomes, see ``pytest_counts``; the
benchmarks' JSON files; ``demo.json``; the sanitizer logs), adds the
machine (commit, GPU, driver, nvcc, torch, Triton), writes
``WORK/gpu_check.json`` (or ``--out``), checks it with :func:`validate` and
prints the table. Exit status 1 when the report does not validate.

``--validate FILE`` only checks an existing report (the dry-run test uses it).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytest_counts import OUTCOMES, tally  # noqa: E402

SCHEMA = "vtoken-gpu-check/1"
STATUSES = ("passed", "failed", "timed_out", "skipped", "over_budget")  # skipped: a stated reason, not a failure
FAILING = ("failed", "timed_out", "over_budget")
MACHINE_FIELDS = ("commit", "gpu", "driver", "nvcc", "torch", "triton", "cuda_runtime", "python")
PYTEST_STEPS = ("pytest_gpu", "pytest_suite")
# Every figure the report carries; a figure the run could not measure is null, with the reason in figures_missing.
FIGURES = (
    "copy_GBps",  # D2D copy, read + write, measured in the compact_kv step
    "compact_kv_frac_copy_cuda",  # min over the >= 64 MiB cases, CUDA graph replay
    "compact_kv_frac_copy_triton",
    "build_slot_lists_256x4k_us_cuda",  # 256 requests x 4K live tokens, decode, graph replay
    "build_slot_lists_256x4k_us_triton",
    "token_attention_key_scores_time_ratio",  # decode 64 x 4K: return_key_scores / scores off
    "token_attention_score_out_time_ratio",  # decode 64 x 4K: score_out / scores off
    "token_attention_kv_read_ratio",  # decode, by construction of the kernels
    "decision_loop",  # per (policy, size): host and device us per step, graphed and eager
    "sanitizer_memcheck_errors",
    "sanitizer_racecheck_hazards",
    "sanitizer_launches",  # "matched/launched" by sanitize_kernels.py under memcheck
    "demo_outputs_identical",  # SmolLM2 demo: naive == vtoken, token for token
    "demo_model",
)


def _run(cmd) -> str | None:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout.strip() if p.returncode == 0 and p.stdout.strip() else None


def machine(root: str) -> dict:
    """Commit, GPU, driver, nvcc, torch, Triton, CUDA runtime and Python of this machine (None where absent)."""
    commit = _run(["git", "-C", root, "rev-parse", "HEAD"])
    if commit and _run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"]):
        commit += "-dirty"
    commit = commit or os.environ.get("VTOKEN_GPU_CHECK_COMMIT") or "unknown (no git checkout; set VTOKEN_GPU_CHECK_COMMIT)"
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    gpu, driver = (None, None)
    if smi:
        gpu, _, driver = smi.splitlines()[0].partition(", ")
    nvcc = None
    cuda_home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    for exe in ("nvcc", os.path.join(cuda_home, "bin", "nvcc")):
        out = _run([exe, "--version"])
        if out:
            m = re.search(r"release ([\d.]+), V([\d.]+)", out)
            nvcc = m.group(2) if m else out.splitlines()[-1]
            break
    import torch
    import triton

    if gpu is None and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name()
    return {"commit": commit, "gpu": gpu, "driver": driver, "nvcc": nvcc, "torch": torch.__version__,
            "triton": triton.__version__, "cuda_runtime": torch.version.cuda, "python": platform.python_version()}


def _load(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _steps(work: str) -> list[dict]:
    steps = []
    path = os.path.join(work, "steps.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            steps = [json.loads(line) for line in f if line.strip()]
    return steps


def _sanitizer(work: str, tool: str):
    """(errors or hazards reported, "matched/launched") from a compute-sanitizer step's log; None if absent."""
    try:
        with open(os.path.join(work, f"sanitize_{tool}.log")) as f:
            text = f.read()
    except OSError:
        return None, None
    m = (re.search(r"RACECHECK SUMMARY: (\d+) hazard", text) if tool == "racecheck" else None) or \
        re.search(r"ERROR SUMMARY: (\d+) error", text)
    launches = re.search(r"(\d+)/(\d+) launches match", text)
    return (int(m.group(1)) if m else None), (f"{launches.group(1)}/{launches.group(2)}" if launches else None)


FIGURE_STEPS = (("copy_GBps", "bench_compact_kv"), ("compact_kv", "bench_compact_kv"),
                ("build_slot_lists", "bench_build_slot_lists"), ("token_attention", "bench_token_attention"),
                ("decision_loop", "bench_decision_loop"), ("sanitizer_racecheck", "sanitize_racecheck"),
                ("sanitizer", "sanitize_memcheck"), ("demo", "demo"))


def _step_of(figure: str) -> str:
    """The step that measures ``figure``."""
    return next(step for prefix, step in FIGURE_STEPS if figure.startswith(prefix))


def figures(work: str, steps: list[dict] = ()) -> tuple[dict, dict]:
    """(figures, figures_missing): every name of FIGURES, null with a reason where not measured."""
    fig = {k: None for k in FIGURES}
    ck = _load(os.path.join(work, "compact_kv.json")) or {}
    fig["copy_GBps"] = ck.get("copy_bandwidth_gbs")
    for method, key in (("cuda_ext_graph", "compact_kv_frac_copy_cuda"), ("triton_graph", "compact_kv_frac_copy_triton")):
        fr = [r["frac_copy"] for r in ck.get("summary") or [] if r.get("method") == method and "frac_copy" in r]
        fig[key] = min(fr) if fr else None
    bsl = _load(os.path.join(work, "build_slot_lists.json")) or {}
    for r in bsl.get("summary") or []:
        if r.get("case", "").startswith("256x4096 dead=0 new=1") and r.get("backend") in ("cuda", "triton"):
            fig[f"build_slot_lists_256x4k_us_{r['backend']}"] = r["us"]
    ta = _load(os.path.join(work, "token_attention.json")) or {}
    for r in ta.get("scores") or []:
        if r.get("case") == "decode":
            fig["token_attention_key_scores_time_ratio"] = r.get("us_ratio_key_scores")
            fig["token_attention_score_out_time_ratio"] = r.get("us_ratio_score_out")
    for r in ta.get("kv_read") or []:
        if str(r.get("case", "")).startswith("decode"):
            fig["token_attention_kv_read_ratio"] = r.get("kv_read_ratio")
            break
    dl = _load(os.path.join(work, "decision_loop.json")) or {}
    if dl.get("rows"):
        fig["decision_loop"] = [
            {"policy": r["policy"], "live": r["live_per_req"], "reqs": r["reqs"],
             "host_us_graph": r["host_us_per_step"] if "host_us_per_step_eager" in r else None,
             "device_us_graph": r["device_us_per_step"] if "device_us_per_step_eager" in r else None,
             "host_us_eager": r.get("host_us_per_step_eager", r["host_us_per_step"]),
             "device_us_eager": r.get("device_us_per_step_eager", r["device_us_per_step"]),
             "baseline_host_us": r["baseline_host_us_per_step"], "device": r["device"]}
            for r in dl["rows"]]
    fig["sanitizer_memcheck_errors"], fig["sanitizer_launches"] = _sanitizer(work, "memcheck")
    fig["sanitizer_racecheck_hazards"], _ = _sanitizer(work, "racecheck")
    demo = _load(os.path.join(work, "demo.json")) or {}
    fig["demo_outputs_identical"] = demo.get("outputs_identical")
    fig["demo_model"] = demo.get("model")
    by_name = {st["name"]: st for st in steps}
    missing = {}
    for k, v in fig.items():
        if v is None:
            st = by_name.get(_step_of(k))
            if st is None:
                missing[k] = f"step {_step_of(k)} did not run"
            elif st["status"] != "passed":
                missing[k] = f"step {st['name']} {st['status']}: {st.get('reason')}"
            else:
                missing[k] = f"not measured by step {st['name']}'s variant ({st.get('mode') or 'default'})"
    return fig, missing


def build(work: str, *, dry_run: bool, budget: int, wall: float, root: str) -> dict:
    steps = _steps(work)
    tests = {}
    for s in steps:
        if s["name"] in PYTEST_STEPS:
            tests[s["name"]] = {**tally(os.path.join(work, f"counts_{s['name']}.jsonl")), "mode": s.get("mode", "")}
    fig, missing = figures(work, steps)
    benchmarks = {}
    for name in ("compact_kv", "build_slot_lists", "token_attention", "decision_loop"):
        data = _load(os.path.join(work, f"{name}.json"))
        if data is not None:
            benchmarks[name] = {k: data.get(k) for k in ("device", "mode", "quick", "summary") if k in data}
    report = {
        "schema": SCHEMA,
        "dry_run": dry_run,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **machine(root),
        "budget_s": budget,
        "wall_s": round(wall, 1),
        "steps": steps,
        "tests": tests,
        "figures": fig,
        "figures_missing": missing,
        "benchmarks": benchmarks,
    }
    report["ok"] = bool(steps) and not any(s["status"] in FAILING for s in steps)
    return report


def validate(report: dict) -> list[str]:
    """What is missing or malformed in a report (empty when it is complete)."""
    errs = []
    for k in ("schema", "dry_run", "date", *MACHINE_FIELDS, "budget_s", "wall_s", "steps", "tests", "figures",
              "figures_missing", "benchmarks", "ok"):
        if k not in report:
            errs.append(f"missing field {k!r}")
    if report.get("schema") != SCHEMA:
        errs.append(f"schema: expected {SCHEMA!r}, got {report.get('schema')!r}")
    for k in ("commit", "torch", "triton", "python"):
        if not isinstance(report.get(k), str) or not report.get(k):
            errs.append(f"{k}: expected a non-empty string, got {report.get(k)!r}")
    if report.get("dry_run") is False:
        for k in ("gpu", "driver", "nvcc"):
            if not isinstance(report.get(k), str) or not report.get(k):
                errs.append(f"{k}: expected a non-empty string on a GPU run, got {report.get(k)!r}")
    names = set()
    for s in report.get("steps") or []:
        names.add(s.get("name"))
        if s.get("status") not in STATUSES:
            errs.append(f"step {s.get('name')!r}: status expected one of {STATUSES}, got {s.get('status')!r}")
        if not isinstance(s.get("seconds"), (int, float)):
            errs.append(f"step {s.get('name')!r}: seconds expected a number, got {s.get('seconds')!r}")
        if s.get("status") in ("skipped", "over_budget", "timed_out", "failed") and not s.get("reason"):
            errs.append(f"step {s.get('name')!r}: {s.get('status')} without a reason")
    for name in PYTEST_STEPS:
        if name in names and name not in (report.get("tests") or {}):
            errs.append(f"tests: no counts for step {name!r}")
    for name, counts in (report.get("tests") or {}).items():
        for k in ("collected", *OUTCOMES, "not_run", "mode"):
            if k not in counts:
                errs.append(f"tests[{name!r}]: missing {k!r}")
    for k in FIGURES:
        if k not in (report.get("figures") or {}):
            errs.append(f"figures: missing {k!r}")
        elif report["figures"][k] is None and k not in (report.get("figures_missing") or {}):
            errs.append(f"figures[{k!r}] is null without a reason in figures_missing")
    return errs


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return f"{len(v)} rows"
    return "-" if v is None else str(v)


def table(report: dict) -> str:
    lines = [f"gpu_check{' (DRY RUN: CPU variants)' if report['dry_run'] else ''}: {report['wall_s']} s of "
             f"{report['budget_s']} s, commit {report['commit']}",
             f"  gpu {report['gpu']}, driver {report['driver']}, nvcc {report['nvcc']}, torch {report['torch']}, "
             f"triton {report['triton']}"]
    for s in report["steps"]:
        lim = f"/{s['limit_s']}" if s.get("limit_s") is not None else ""
        lines.append(f"  {s['name']:<22} {s['status']:<11} {s['seconds']:>6.1f}{lim:<5} s  {s.get('reason') or s.get('mode') or ''}")
    for name, c in report["tests"].items():
        counts = ", ".join(f"{k} {c[k]}" for k in ("collected", *OUTCOMES, "not_run") if c.get(k))
        lines.append(f"  tests {name}: {counts or 'none'} [{c['mode']}]")
    for k, v in report["figures"].items():
        if isinstance(v, list):
            for r in v:
                lines.append(f"  {k}: " + ", ".join(f"{a}={_fmt(b)}" for a, b in r.items()))
        else:
            lines.append(f"  {k}: {_fmt(v)}")
    lines.append(f"  => {'OK' if report['ok'] else 'FAILED'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", nargs="?", help="the run's work folder")
    ap.add_argument("--budget", type=int, default=0)
    ap.add_argument("--wall", type=float, default=0.0)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--validate", metavar="FILE", help="only validate an existing report")
    args = ap.parse_args(argv)
    if args.validate:
        errs = validate(_load(args.validate) or {})
        print("\n".join(errs) or f"{args.validate}: valid")
        return 1 if errs else 0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    report = build(args.work, dry_run=args.dry_run, budget=args.budget, wall=args.wall, root=root)
    out = args.out or os.path.join(args.work, "gpu_check.json")
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(table(report))
    errs = validate(report)
    if errs:
        print("report does not validate:\n  " + "\n  ".join(errs))
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
