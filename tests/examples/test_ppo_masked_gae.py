"""The one-file recipe: it runs as a script with a tiny budget, and its options are its Config."""

import subprocess
import sys
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "ppo_masked_gae.py"
TINY = ["--total-frames", "2048", "--frames-per-batch", "1024", "--num-envs", "16",
        "--eval-episodes", "8", "--eval-every", "1024", "--epochs", "1", "--minibatch-size", "64"]


def test_runs_as_a_script_with_a_tiny_budget():
    # -W error::FutureWarning: TorchRL's "missing InitTracker" warning would fail the run.
    result = subprocess.run([sys.executable, "-W", "error::FutureWarning", str(RECIPE), *TINY],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[1] for line in lines[:-1]] == ["1,024", "2,048"]  # one eval per batch
    assert lines[-1].startswith("MaskedRL/ToolUse-v0: final greedy success ")
    assert lines[-1].endswith(" s") and "after 2,048 frames" in lines[-1]
    assert "[torchrl][INFO]" not in result.stdout + result.stderr


def test_config_fields_are_flags_with_their_docstrings():
    sys.path.insert(0, str(RECIPE.parent))
    try:
        import ppo_masked_gae
    finally:
        sys.path.remove(str(RECIPE.parent))
    cfg = ppo_masked_gae.parse_config(["--total-frames", "20000", "--lr", "0.001"])
    assert (cfg.total_frames, cfg.lr, cfg.seed) == (20000, 0.001, 0)
    docs = ppo_masked_gae._field_docstrings(ppo_masked_gae.Config)
    assert set(docs) == {f.name for f in __import__("dataclasses").fields(ppo_masked_gae.Config)}
    assert docs["lr"] == "Adam learning rate."
    with pytest.raises(SystemExit):
        ppo_masked_gae.parse_config(["--num-envs", "-3"])


def test_imports_nothing_from_the_harness():
    text = RECIPE.read_text()
    assert "ppo_tool_use" not in text.replace("examples/ppo_tool_use/", "")
    assert len(text.splitlines()) <= 320
