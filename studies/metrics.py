"""The range and median of every number a run logged over its RL steps.

    python studies/metrics.py [RUN_FOLDER]      # RUN_FOLDER/metrics.jsonl; runs/train when omitted

RUN_FOLDER is read from the directory you are in, else from the repository root. A missing folder,
a missing or corrupt metrics.jsonl: one line, exit code 2.

Prints, for each key of metrics.jsonl (s_mean, clip_tokens, clip_ceiling, reward, ...), its lowest
value, 10th percentile, median, 90th percentile and highest over the RL steps. It serves the
reading of a run (tutorial.md, "Reading the metrics"): what a normal value of each metric is,
before one looks at a single step's.
"""
from __future__ import annotations

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # gspo_minimal, studies

from studies import common  # noqa: E402
from studies.common import TRAIN_DIR, Parser, cli, fail, given_path  # noqa: E402


def read_records(folder: str) -> list[dict]:
    """Every record of FOLDER/metrics.jsonl; a missing or corrupt file fails in one line."""
    if not os.path.isdir(folder):
        elsewhere = os.path.realpath(common.started_in) != os.path.realpath(common.ROOT)
        looked = f" (neither in {common.started_in} nor in {common.ROOT})" \
            if elsewhere and not os.path.isabs(folder) else ""
        fail(f"no run folder {folder}{looked}")
    path = os.path.join(folder, "metrics.jsonl")
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as err:
        fail(f"cannot read {path}: {err.strerror}")
    records = []
    for n, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("stage"), str):
            fail(f"{path}, line {n}: not a metrics record (a JSON object with a stage)")
        records.append(record)
    return records


def metric_stats(folder: str = TRAIN_DIR) -> dict:
    """Lowest, 10th percentile, median, 90th percentile and highest of every number that
    metrics.jsonl logs over a run's RL steps (tutorial.md section 8 quotes them)."""
    rl = [r for r in read_records(folder) if r["stage"] == "rl"]
    stats = {}
    for key in dict.fromkeys(k for r in rl for k in r):          # every key, in first-seen order
        values = sorted(r[key] for r in rl if isinstance(r.get(key), (int, float)))
        if key in ("step", "elapsed") or not values:
            continue
        q = statistics.quantiles(values, n=10) if len(values) > 1 else values * 9
        stats[key] = {"min": values[0], "p10": q[0], "median": statistics.median(values),
                      "p90": q[-1], "max": values[-1], "steps": len(values)}
    print(f"{folder}/metrics.jsonl, {len(rl)} RL steps")
    print(f"{'metric':18s} {'min':>10s} {'p10':>10s} {'median':>10s} {'p90':>10s} {'max':>10s}")
    for key, s in stats.items():
        print(f"{key:18s} " + " ".join(f"{s[k]:10.4g}" for k in ("min", "p10", "median", "p90", "max")))
    return stats


@cli
def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", default=TRAIN_DIR, help="run folder (default: runs/train)")
    metric_stats(given_path(parser.parse_args(argv).folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
