"""Print a short table from benchmark JSON files (gpu_check.sh prints its own, from its one report).

Arguments: JSON files and/or folders of them (default: bench/results). Each
benchmark JSON may carry a ``summary`` list of flat rows; otherwise its
top-level scalar fields are shown. Each file's first line names the device it
ran on (and ``quick`` for a CPU smoke run).
"""
import glob
import json
import os
import sys


def _files(paths):
    for p in paths:
        if os.path.isdir(p):
            yield from sorted(glob.glob(os.path.join(p, "*.json")))
        else:
            yield p


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def main(paths) -> None:
    for path in _files(paths):
        name = os.path.splitext(os.path.basename(path))[0]
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            print(f"{name:>20}: unreadable ({type(e).__name__}: {e})")
            continue
        rows = data.get("summary")
        if not rows:
            skip = ("date", "device")
            rows = [{k: v for k, v in data.items() if isinstance(v, (int, float, str)) and k not in skip}]
        quick = data.get("quick") is True or data.get("mode") == "cpu-quick"
        print(f"{name:>20}  [{data.get('device', '?')}{', quick' if quick else ''}, {data.get('date', '?')}]")
        for row in rows:
            print(f"{'':>20}  " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items()))


if __name__ == "__main__":
    main(sys.argv[1:] or [os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")])
