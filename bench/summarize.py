"""Print a short table from bench/results/*.json (the last step of gpu_check.sh).

Each benchmark JSON may carry a ``summary`` list of flat rows; otherwise its
top-level scalar fields are shown.
"""
import glob
import json
import os
import sys


def main(folder: str) -> None:
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            data = json.load(f)
        name = os.path.splitext(os.path.basename(path))[0]
        rows = data.get("summary")
        if not rows:
            rows = [{k: v for k, v in data.items() if isinstance(v, (int, float, str)) and k not in ("date",)}]
        for row in rows:
            fields = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
            print(f"{name:>20}: {fields}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results"))
