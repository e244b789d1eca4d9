"""Run folders under odd but legal use: two writers, a finished run, a resumed multi-worker
run, damaged files, a full disk, and a signal that kills ``compare``'s parent."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from masked_rl import CompleteEpisodes
from masked_rl_examples.ppo_tool_use import compare, utils
from masked_rl_examples.ppo_tool_use import ppo_tool_use as recipe
from masked_rl_examples.ppo_tool_use.config import (Config, RunFolderError, parse_compare_command,
                                                    parse_train_command)

TINY = ["--frames", "1024", "--num-envs", "8", "--frames-per-batch", "512",
        "--minibatch-size", "64", "--epochs", "1", "--eval-every", "512", "--eval-episodes", "8",
        "--no-progress-bar", "--threads", "1", "--logger", "none"]
TINY_CONFIG = dict(frames=1024, num_envs=8, frames_per_batch=512, minibatch_size=64, epochs=1,
                   eval_every=512, eval_episodes=8, progress_bar=False, threads=1, logger="none")


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished tiny run's folder (copy it before changing it)."""
    output = tmp_path_factory.mktemp("finished")
    summary = recipe.train(Config(**TINY_CONFIG, output=str(output)))
    assert summary["status"] == "completed"
    return Path(summary["run_dir"])


def copy_run(run_dir: Path, tmp_path: Path) -> Path:
    import shutil

    target = tmp_path / "runs" / run_dir.name
    shutil.copytree(run_dir, target)
    return target


def test_a_second_writer_gets_a_one_line_error_naming_the_folder_and_the_holder(tmp_path, capsys):
    command = parse_train_command([*TINY, "--output", str(tmp_path)])
    with utils.run_folder_lock(command.run_dir):  # another run holds the folder
        assert recipe.run_train_command(command) == 2
        err = one_line_error(capsys)
        assert str(command.run_dir) in err and f"pid {os.getpid()}" in err
        with pytest.raises(RunFolderError):
            recipe.train(command.config)
        assert not (command.run_dir / "config.json").exists()  # nothing written by the loser
    assert recipe.run_train_command(command) == 0  # released: the folder is free again


def test_the_lock_is_held_across_processes_and_dies_with_its_holder(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from masked_rl_examples.ppo_tool_use import utils\n"
         f"with utils.run_folder_lock({str(tmp_path)!r}):\n"
         "    print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderError, match=f"pid {holder.pid}"):
            with utils.run_folder_lock(tmp_path):
                pass
    finally:
        holder.kill()
        holder.wait()
    with utils.run_folder_lock(tmp_path):  # a SIGKILLed holder leaves no stale lock
        pass


def test_a_fresh_train_refuses_a_finished_run_unless_overwrite(finished, tmp_path, capsys):
    run_dir = copy_run(finished, tmp_path)
    argv = [*TINY, "--output", str(run_dir.parent)]
    with pytest.raises(SystemExit) as exit_info:
        parse_train_command(argv, prog="masked-rl train")
    assert exit_info.value.code == 2
    err = one_line_error(capsys)
    assert "holds a finished run" in err and "--overwrite" in err and str(run_dir) in err
    with pytest.raises(RunFolderError, match="holds a finished run"):
        recipe.train(Config(**TINY_CONFIG, output=str(run_dir.parent)))
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    command = parse_train_command([*argv, "--overwrite"])
    assert command.overwrite and recipe.run_train_command(command) == 0


def test_resume_with_a_truncated_checkpoint_is_a_one_line_error(finished, tmp_path, capsys):
    run_dir = copy_run(finished, tmp_path)
    checkpoint = run_dir / "checkpoint.pt"
    checkpoint.write_bytes(checkpoint.read_bytes()[:1000])
    with pytest.raises(SystemExit) as exit_info:
        parse_train_command(["--resume", str(run_dir)], prog="masked-rl train")
    assert exit_info.value.code == 2
    err = one_line_error(capsys)
    assert str(checkpoint) in err and "is not a checkpoint of this recipe" in err


@pytest.mark.parametrize("field, value, message", [
    ("lr", 0.001, "does not match the run's checkpoint.pt (lr differ)"),
    ("lr", -1, "lr must be a finite number > 0, got -1"),
    ("estimator", "nope", "estimator must be one of"),
])
def test_resume_with_a_hand_edited_config_is_a_one_line_error(finished, tmp_path, capsys, field,
                                                               value, message):
    run_dir = copy_run(finished, tmp_path)
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(SystemExit) as exit_info:
        parse_train_command(["--resume", str(run_dir)], prog="masked-rl train")
    assert exit_info.value.code == 2
    assert message in one_line_error(capsys)


def test_a_full_disk_mid_run_is_a_one_line_error_and_keeps_the_last_checkpoint(tmp_path, capsys,
                                                                               monkeypatch):
    command = parse_train_command([*TINY, "--output", str(tmp_path)])
    real_save, saves = torch.save, []

    def save_until_the_disk_fills(obj, f):  # checkpoints at 0, 512 and 1024 frames
        saves.append(obj["progress"]["frames"])
        if len(saves) == 3:
            f.write(b"the first bytes")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", save_until_the_disk_fills)
    assert recipe.run_train_command(command) == 2
    monkeypatch.undo()
    err = one_line_error(capsys)
    assert "No space left on device" in err and f"--resume {command.run_dir}" in err
    state = torch.load(command.run_dir / "checkpoint.pt", weights_only=True)
    assert state["progress"]["frames"] == 512
    assert sorted(p.name for p in command.run_dir.iterdir()) == [".lock", "checkpoint.pt",
                                                                 "config.json"]
    assert recipe.run_train_command(parse_train_command(["--resume", str(command.run_dir)])) == 0


def test_compare_names_a_truncated_summary_in_a_one_line_error(tmp_path, capsys):
    argv = [*TINY, "--seeds", "0", "--estimators", "masked", "--jobs", "1",
            "--output", str(tmp_path)]
    assert compare.run_compare_command(parse_compare_command(argv)) == 0
    summary = tmp_path / "masked-seed0" / "summary.json"
    summary.write_text(summary.read_text()[:40])
    capsys.readouterr()
    assert compare.run_compare_command(parse_compare_command(argv)) == 2
    err = one_line_error(capsys)
    assert str(summary) in err and "is not a run summary" in err


def test_resuming_a_multi_worker_run_never_joins_held_fragments_onto_fresh_episodes(
        tmp_path, monkeypatch):
    """The workers restart on fresh episodes, so what ``CompleteEpisodes`` held back at the
    checkpoint belongs to episodes that will never continue: it must not be prepended."""
    cfg = Config(**TINY_CONFIG, workers=2, output=str(tmp_path))
    recipe.train(cfg)
    held = torch.load(cfg.run_dir() / "checkpoint.pt", weights_only=True)["complete_episodes"]
    assert held["held_valid"] is not None and held["held_valid"].any()  # something was held
    seen = []
    real_call = CompleteEpisodes.__call__

    def record_then_call(self, batch):
        seen.append(self.held_steps)
        return real_call(self, batch)

    monkeypatch.setattr(CompleteEpisodes, "__call__", record_then_call)
    summary = recipe.train(replace(cfg, frames=2048), resume=True)
    assert summary["frames"] == 2048 and seen[0] == 0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL],
                         ids=["SIGTERM", "SIGHUP", "SIGKILL"])
def test_killing_compare_ends_its_workers(tmp_path, signum):
    args = [sys.executable, "-m", "masked_rl_examples.cli", "compare", *TINY,
            "--frames", "10000000", "--seeds", "0", "--jobs", "2", "--output", str(tmp_path)]
    parent = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env={**os.environ, "RL_WARNINGS": "False"}, start_new_session=True)
    deadline = time.monotonic() + 240
    while True:  # both runs training: each has written its first checkpoint
        assert parent.poll() is None, parent.communicate()[1]
        assert time.monotonic() < deadline, "the runs did not start within 240 s"
        if len(list(tmp_path.glob("*/checkpoint.pt"))) == 2:
            break
        time.sleep(0.2)
    children = Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
    workers = [int(pid) for pid in children
               if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(workers) == 2, children
    os.kill(parent.pid, signum)
    parent.communicate(timeout=60)
    assert parent.returncode != 0
    deadline = time.monotonic() + 30
    alive = workers
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if Path(f"/proc/{pid}").exists()
                 and "zombie" not in Path(f"/proc/{pid}/status").read_text()]
        time.sleep(0.2)
    for pid in alive:  # don't leave them behind if the test fails
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"workers {alive} outlived compare's parent ({signal.Signals(signum).name})"
