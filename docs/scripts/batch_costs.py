"""Per-batch cost of recipe runs, from their run folders: one CSV row per run and batch.

    python docs/scripts/batch_costs.py OUT.csv RUN_DIR [RUN_DIR ...]

Reads each run's ``scalars/time/{collect,update}.csv`` and ``scalars/train/{trainable_steps,
episodes,tool_calls}.csv`` (the recipe's CSV logger, one row per batch, keyed by frames) and
``scalars/eval/success_rate.csv``, finished or not, and writes ``run, frames, collect_s,
update_s, trainable_steps, episodes, tool_calls, eval_success`` (``eval_success`` empty where no
evaluation followed that batch). A resumed run logs each batch once: the recipe cuts its logs
back to the checkpoint it resumes from.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

COLUMNS = {"collect_s": "time/collect.csv", "update_s": "time/update.csv",
           "trainable_steps": "train/trainable_steps.csv", "episodes": "train/episodes.csv",
           "tool_calls": "train/tool_calls.csv", "eval_success": "eval/success_rate.csv"}


def read_scalar(path: Path) -> dict[int, float]:
    """``{frames: value}`` of one logger CSV (a header row, if any, is skipped)."""
    with path.open() as f:
        return {int(float(row[0])): float(row[1]) for row in csv.reader(f) if row and row[0][:1].isdigit()}


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: " + __doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out, run_dirs = Path(argv[0]), [Path(d).resolve() for d in argv[1:]]
    rows = []
    for run in run_dirs:
        scalars = {name: read_scalar(run / "scalars" / rel) for name, rel in COLUMNS.items()}
        for frames in sorted(scalars["update_s"]):
            rows.append({"run": f"{run.parent.name}/{run.name}", "frames": frames,
                         **{name: values.get(frames, "") for name, values in scalars.items()}})
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["run", "frames", *COLUMNS], lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out} ({len(rows)} batches of {len(run_dirs)} runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
