"""bench/gpu_check.sh --dry-run on the CPU: every step's plumbing, and the one JSON it writes, field by field.

NOTE: the tests carry no gpu mark, so the script's GPU step (``-m gpu``) never
runs them; in its whole-suite step (``VTOKEN_GPU_CHECK_ACTIVE`` set) they skip
themselves, since the script is already running.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from gpu_check_report import FIGURES, MACHINE_FIELDS, STATUSES, validate  # noqa: E402
from pytest_counts import OUTCOMES  # noqa: E402

STEPS = ("build", "pytest_suite", "pytest_gpu", "sanitize_memcheck", "sanitize_racecheck", "bench_compact_kv",
         "bench_build_slot_lists", "bench_token_attention", "bench_decision_loop", "demo")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    if os.environ.get("VTOKEN_GPU_CHECK_ACTIVE"):
        pytest.skip("inside a gpu_check.sh run: the script is already running")
    work = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "PYTHON": sys.executable, "VTOKEN_GPU_CHECK_WORK": str(work), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("VTOKEN_GPU_CHECK_DRY", None)
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    with open(work / "gpu_check.json") as f:
        return proc, json.load(f), work


def test_dry_run_passes_and_its_report_validates(dry_run):
    proc, report, _ = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert validate(report) == []
    assert report["dry_run"] is True and report["ok"] is True
    for k in MACHINE_FIELDS:
        assert k in report
    assert report["torch"] and report["triton"] and report["commit"]
    assert "=> OK" in proc.stdout  # the table, printed last


def test_every_step_is_recorded_with_status_seconds_and_reason(dry_run):
    _, report, work = dry_run
    steps = {s["name"]: s for s in report["steps"]}
    assert set(steps) == set(STEPS)
    for s in steps.values():
        assert s["status"] in STATUSES and isinstance(s["seconds"], (int, float)) and "mode" in s
        assert s["status"] in ("passed", "skipped"), s
        if s["status"] == "skipped":
            assert s["reason"]
    assert steps["sanitize_racecheck"]["status"] == "skipped" and "GPU" in steps["sanitize_racecheck"]["reason"]
    for name in STEPS:
        if steps[name]["status"] == "passed" and name != "pytest_suite":  # the suite writes its log in the background
            assert (work / f"{name}.log").exists()


def test_test_counts_say_what_ran(dry_run):
    _, report, _ = dry_run
    suite, gpu = report["tests"]["pytest_suite"], report["tests"]["pytest_gpu"]
    for counts in (suite, gpu):
        assert set(OUTCOMES) | {"collected", "not_run", "mode"} <= set(counts)
    # The dry run counts the suite without running it, and says so.
    assert suite["collected"] > 1000 and suite["passed"] == 0 and suite["not_run"] == suite["collected"]
    assert "collect-only" in suite["mode"]
    # The gpu tests are collected and skipped on the CPU; none failed.
    assert gpu["collected"] > 0 and gpu["skipped"] == gpu["collected"] and gpu["failed"] == gpu["errors"] == 0


def test_figures_are_all_present_and_unmeasured_ones_say_why(dry_run):
    _, report, _ = dry_run
    fig, missing = report["figures"], report["figures_missing"]
    assert set(FIGURES) == set(fig)
    assert all(k in missing for k, v in fig.items() if v is None)
    # What a CPU run does measure: the copy baseline, the byte-count ratio, the loop, the driver, the demo.
    assert fig["copy_GBps"] > 0
    assert fig["token_attention_kv_read_ratio"] == pytest.approx(1.0, abs=0.05)
    assert fig["sanitizer_launches"] and fig["sanitizer_launches"].split("/")[0] == fig["sanitizer_launches"].split("/")[1]
    assert {r["policy"] for r in fig["decision_loop"]} == {"h2o", "streamingllm"}
    assert fig["demo_outputs_identical"] is True
    # GPU-only figures stay null on the CPU: never a number that was not measured.
    for k in ("compact_kv_frac_copy_cuda", "build_slot_lists_256x4k_us_cuda", "token_attention_key_scores_time_ratio",
              "sanitizer_memcheck_errors", "sanitizer_racecheck_hazards"):
        assert fig[k] is None
    assert missing["sanitizer_racecheck_hazards"].startswith("step sanitize_racecheck skipped: ")
    assert "--quick" in missing["compact_kv_frac_copy_cuda"]


def test_validate_names_what_is_missing():
    errs = validate({"schema": "vtoken-gpu-check/1", "dry_run": False, "steps": [{"name": "demo", "status": "ok"}],
                     "figures": {}})
    assert any("commit" in e for e in errs) and any("gpu" in e for e in errs)
    assert any("status expected" in e for e in errs) and any("seconds" in e for e in errs)
    assert any("copy_GBps" in e for e in errs)
