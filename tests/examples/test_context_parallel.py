"""examples/context_parallel.py runs under torchrun with two gloo processes and agrees."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_context_parallel_example_under_torchrun():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(REPO / "examples" / "context_parallel.py"), "--steps", "301"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    errors = re.findall(r"rank (\d)/2: \d+ of 301 steps per row, .*? single process ([0-9.e+-]+)", result.stdout)
    assert sorted(rank for rank, _ in errors) == ["0", "1"], result.stdout
    assert all(float(error) < 1e-10 for _, error in errors)
