"""examples/context_parallel.py runs under torchrun with two gloo processes and agrees."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed_worker import run_torchrun

REPO = Path(__file__).resolve().parents[2]


def test_context_parallel_example_under_torchrun():
    result = run_torchrun(REPO / "examples" / "context_parallel.py", "--steps", "301")
    assert result.returncode == 0, result.stderr[-3000:]
    errors = re.findall(r"rank (\d)/2: \d+ of 301 steps per row, .*? single process ([0-9.e+-]+)", result.stdout)
    assert sorted(rank for rank, _ in errors) == ["0", "1"], result.stdout
    assert all(float(error) < 1e-10 for _, error in errors)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_launch_past_its_timeout_leaves_no_worker_behind(tmp_path):
    marker = tmp_path / "hangs_in_a_collective.py"  # a unique path: found in the workers' argv
    marker.write_text("import time\ntime.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_torchrun(marker, timeout_s=10)
    time.sleep(1)
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _argv_has(pid, str(marker))]
    assert left == [], f"processes still running {marker}: {left}"


def _argv_has(pid: str, text: str) -> bool:
    try:
        return text in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:  # the process ended meanwhile
        return False
