"""``masked-rl llm-train`` run folders: one writer at a time, a finished run is not replaced
without ``--overwrite``, and unreadable checkpoints or configurations are one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from masked_rl_examples.llm_ppo.config import LLMConfig
from masked_rl_examples.llm_ppo.llm_ppo import train
from masked_rl_examples.ppo_tool_use.config import RunFolderError
from masked_rl_examples.ppo_tool_use.utils import run_folder_lock

TINY = dict(tokens=100, episodes_per_batch=4, group_size=4, eval_episodes=4, eval_every=100,
            epochs=1, minibatch_size=4, hidden_size=16, num_heads=2, progress_bar=False)
CLI_TINY = ["--tokens", "100", "--episodes-per-batch", "4", "--eval-episodes", "4",
            "--epochs", "1", "--minibatch-size", "4", "--hidden-size", "16", "--num-heads", "2",
            "--no-progress-bar"]


def _cfg(tmp_path, **kwargs) -> LLMConfig:
    return LLMConfig(**{**TINY, "output": str(tmp_path), **kwargs})


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "masked_rl_examples.cli", "llm-train", *args],
                          capture_output=True, text=True, timeout=300)


def _one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("masked-rl llm-train: error: ")
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def test_a_second_writer_is_refused_and_the_folder_is_untouched(tmp_path):
    run_dir = tmp_path / "masked-seed0"
    with run_folder_lock(run_dir):
        with pytest.raises(RunFolderError, match="is in use by another run"):
            train(_cfg(tmp_path))
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]


def test_a_finished_run_is_kept_unless_overwrite(tmp_path):
    first = train(_cfg(tmp_path))
    run_dir = tmp_path / "masked-seed0"
    summary = (run_dir / "summary.json").read_text()
    with pytest.raises(RunFolderError, match="holds a finished run: pass --overwrite"):
        train(_cfg(tmp_path))
    assert (run_dir / "summary.json").read_text() == summary
    second = train(_cfg(tmp_path), overwrite=True)
    same = lambda history: [(h["tokens"], h["success_rate"]) for h in history]  # noqa: E731
    assert second["status"] == "completed" and same(second["history"]) == same(first["history"])


def test_cli_errors_on_run_folders_are_one_line(tmp_path):
    run_dir = tmp_path / "masked-seed0"
    assert _cli(*CLI_TINY, "--output", str(tmp_path)).returncode == 0
    _one_line_error(_cli(*CLI_TINY, "--output", str(tmp_path)), "holds a finished run",
                    f"--resume {run_dir} --tokens N")
    _one_line_error(_cli("--resume", str(run_dir), "--overwrite"), "cannot be combined")
    checkpoint = run_dir / "checkpoint.pt"
    checkpoint.write_bytes(checkpoint.read_bytes()[:1000])  # truncated
    _one_line_error(_cli("--resume", str(run_dir), "--tokens", "200"), str(checkpoint),
                    "is not an llm-train checkpoint")
    config = run_dir / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "lr": -3}))
    _one_line_error(_cli("--resume", str(run_dir)), "config.json", "lr must be")
