"""A pytest plugin for gpu_check.sh: test outcomes counted as they happen, so a run cut by its time cap still counts.

Load it with ``-p pytest_counts`` (``bench/`` on ``PYTHONPATH``) and name the
output in ``VTOKEN_PYTEST_COUNTS``: one JSON line ``{"collected": n}`` once
collection is done, then one line ``{"outcome": ...}`` per test as it
finishes. :func:`tally` turns the file into counts. Under pytest-xdist only
the controller writes (the workers' reports reach it through the same hook).
"""
from __future__ import annotations

import json
import os

import pytest

OUTCOMES = ("passed", "failed", "skipped", "errors", "xfailed", "xpassed")


def _out(config):
    path = os.environ.get("VTOKEN_PYTEST_COUNTS")
    if not path or hasattr(config, "workerinput"):  # an xdist worker: the controller writes
        return None
    return path


def _write(config, record: dict) -> None:
    path = _out(config)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def pytest_collection_finish(session):
    if not hasattr(session.config, "workerinput"):
        _write(session.config, {"collected": len(session.items)})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    # NOTE: every worker collects the whole selection (tally takes the largest count).
    _write(node.config, {"collected": len(ids), "node": node.gateway.id})


_config = None


def pytest_configure(config):
    global _config
    _config = config


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and not report.passed) or \
            (report.when == "teardown" and report.failed):
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        elif report.when != "call" and report.failed:
            outcome = "errors"
        else:
            outcome = report.outcome
        _write(_config, {"outcome": outcome, "when": report.when, "test": report.nodeid})


def tally(path: str) -> dict:
    """Counts from a plugin output file: collected, each outcome, and ``not_run`` (collected, no outcome)."""
    counts = {"collected": None, **{k: 0 for k in OUTCOMES}}
    tests = set()
    if not os.path.exists(path):
        return counts | {"not_run": None}
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:  # a line cut by a kill
                continue
            if "collected" in rec:  # xdist: one record per worker, each the whole selection
                counts["collected"] = max(counts["collected"] or 0, rec["collected"])
            elif rec.get("outcome") in OUTCOMES:
                counts[rec["outcome"]] += 1
                tests.add(rec["test"])
    counts["not_run"] = None if counts["collected"] is None else max(counts["collected"] - len(tests), 0)
    return counts
