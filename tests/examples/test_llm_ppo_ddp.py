"""examples/llm_ppo_ddp.py: DDP on two gloo processes gives one process's gradients, and the
per-rank mean (no dp_group) does not."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from distributed_worker import run_torchrun

REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("transformers")


def _run(*extra):
    result = run_torchrun(REPO / "examples" / "llm_ppo_ddp.py", "--iterations", "2",
                          "--episodes", "4", *extra)
    found = re.search(r"batch ([0-9.e+-]+) of the largest gradient \((matches|DIFFERS)", result.stdout)
    assert found, result.stdout[-2000:] + result.stderr[-3000:]
    counts = re.findall(r"trainable tokens per rank \[(\d+), (\d+)\]", result.stdout)
    return result.returncode, float(found.group(1)), counts


def test_ddp_with_dp_group_matches_one_process():
    code, difference, counts = _run()
    assert code == 0 and difference < 1e-4
    assert len(counts) == 2


def test_without_dp_group_the_check_fails():
    code, difference, counts = _run("--no-dp-group")
    assert any(a != b for a, b in counts), "equal counts: the check cannot bite"
    assert code == 1 and difference > 1e-3
