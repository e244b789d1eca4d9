"""``masked-rl llm-bench`` end to end on a tiny model: the table, the CSV and the JSON agree."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys

from masked_rl_benchmarks.llm import PHASES, VARIANTS


def test_llm_bench_times_each_iteration_and_writes_csv_and_json(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "masked_rl_examples.cli", "llm-bench", "--episodes", "8",
         "--iterations", "1", "--epochs", "1", "--hidden-size", "16", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(open(tmp_path / "llm_bench.csv")))
    assert [r["iteration"] for r in rows] == list(VARIANTS)
    table = result.stdout.splitlines()
    for row in rows:
        phases = sum(float(row[p]) for p in PHASES)
        assert math.isclose(float(row["iteration_s"]), phases, rel_tol=1e-9)
        assert math.isclose(float(row["tokens_per_s"]), float(row["tokens"]) / phases,
                            rel_tol=1e-9)
        assert 0 < float(row["estimator_share"]) < 1
        line = next(line for line in table if line.startswith(row["iteration"] + " "))
        assert f"{float(row['tokens_per_s']):.0f}" in line.split()
    for label in ("ppo, shared critic", "ppo, separate critic"):
        assert any(line.startswith(f"{label}: estimate = adapter") for line in table)
    saved = json.loads((tmp_path / "llm_bench.json").read_text())
    assert [r["iteration"] for r in saved["rows"]] == list(VARIANTS)


def test_llm_bench_option_errors_are_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "masked_rl_examples.cli", "llm-bench", "--episodes", "12"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "--episodes must be a multiple of 8 (GRPO's group size), got 12" in result.stderr
