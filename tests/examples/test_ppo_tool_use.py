"""The PPO tool-use recipe: its pieces, a seeded learning run, interruption and resume, and
smoke runs of every command."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import gymnasium
import pytest
import torch

from masked_rl_examples.ppo_tool_use import compare
from masked_rl_examples.ppo_tool_use import ppo_tool_use as recipe
from masked_rl_examples.ppo_tool_use.config import Config, parse_eval_command, parse_train_command
from masked_rl_examples.ppo_tool_use.utils import (
    TokenWindowEncoder,
    evaluate,
    finished_episodes,
    make_actor_critic,
    make_env,
)

REPO = Path(__file__).resolve().parents[2]
ENV_ID = "MaskedRL/ToolUse-v0"
# A tiny budget: a few batches of 8 environments, evaluation on 8 episodes.
TINY = ["--frames", "1024", "--num-envs", "8", "--frames-per-batch", "512",
        "--minibatch-size", "64", "--epochs", "1", "--eval-every", "512", "--eval-episodes", "8",
        "--no-progress-bar", "--threads", "1"]
TINY_CONFIG = dict(frames=1024, num_envs=8, frames_per_batch=512, minibatch_size=64, epochs=1,
                   eval_every=512, eval_episodes=8, progress_bar=False, threads=1)


# --- pieces ---------------------------------------------------------------------------------


def test_token_window_encoder_shapes():
    net = TokenWindowEncoder(vocab_size=17, window=64, embed_dim=4, hidden=16, layers=2)
    assert net(torch.zeros(5, 3, 64, dtype=torch.long)).shape == (5, 3, 16)


@pytest.mark.parametrize("shared", [True, False])
def test_env_actor_and_statistics_on_a_rollout(shared):
    env = make_env(ENV_ID, 4)
    actor, critic = make_actor_critic(env, embed_dim=4, hidden=16, layers=1, shared=shared)
    env.set_seed(0)
    rollout = env.rollout(200, actor, break_when_any_done=False)
    assert rollout.batch_size == (4, 200)
    assert rollout["loss_mask"].dtype == torch.int8
    assert critic(rollout)["state_value"].shape == (4, 200, 1)
    stats = finished_episodes(rollout)
    done = rollout["next", "done"].squeeze(-1)
    assert stats["episodes"] == int(done.sum()) >= 4
    # Against a plain loop over the rows: the success flags of the steps that ended an episode.
    flags = [bool(rollout["next", "is_success"][b, t]) for b in range(4) for t in range(200)
             if done[b, t]]
    assert stats["success_rate"] == sum(flags) / len(flags)
    assert stats["reward_per_episode"] >= 0
    result = evaluate(actor, env, seed=1, max_steps=80)
    assert result == evaluate(actor, env, seed=1, max_steps=80)  # the same tasks every time
    env.close()


# --- learning -------------------------------------------------------------------------------

# The default task takes a million frames or more; the learning test uses a small variant of the
# same environment (one lookup of 2 keys, 4-token tool answers): the same skills (call the asked
# key, copy the value out of the tool's answer across masked steps), about 10 steps an episode.
def register_tiny(env_id: str, response_len: int, window: int, max_steps: int) -> str:
    """Register a one-lookup, 2-key variant of ``ToolUseEnv`` once; returns its id."""
    if env_id not in gymnasium.registry:
        gymnasium.register(
            id=env_id,
            entry_point="masked_rl_envs.tool_use:ToolUseEnv",
            kwargs=dict(n_keys=2, n_values=2, n_queries=1, response_len=response_len,
                        closing_len=1, window=window, max_steps=max_steps),
        )
    return env_id


TINY_ID = register_tiny("MaskedRLTest/ToolUseTiny-v0", response_len=4, window=16, max_steps=24)


def test_seeded_training_beats_a_random_policy(tmp_path):
    """A short seeded run reaches a greedy success rate no policy that guesses can reach.

    Without reading the tool's answer, the best an agent can do is to guess one of the 2 values
    (success 1/2); an untrained greedy policy scores about 0.
    """
    cfg = Config(env=TINY_ID, frames=98_304, seed=0, output=str(tmp_path), progress_bar=False,
                 threads=1, num_envs=32, frames_per_batch=2048, eval_every=8192,
                 eval_episodes=64)
    summary = recipe.train(cfg)
    history = [round(h["success_rate"], 2) for h in summary["history"]]
    assert history[0] < 0.5, history
    assert summary["final_success_rate"] >= 0.9, history



# The long-output configuration at reduced scale: the tiny task with 32-token tool outputs (the
# answer is copied across 33 masked steps); the window holds the transcript up to the answer.
TINY_LONG_ID = register_tiny("MaskedRLTest/ToolUseTinyLong-v0", response_len=32, window=44,
                             max_steps=80)


def test_seeded_training_learns_through_long_tool_outputs(tmp_path):
    """With 32-token tool outputs the recipe still learns to look the value up and copy it.

    Answering without the lookup scores 1/2 at best; the run must pass 90 %. What it takes is
    batches that hold enough episodes: 32 x 512 steps (about 400 episodes a batch) got seeds
    0-3 to 100 % within 18 batches; 32 x 128 steps (about 100) got only seed 0 there in 48.
    """
    cfg = Config(env=TINY_LONG_ID, frames=327_680, seed=0, output=str(tmp_path), progress_bar=False,
                 threads=1, num_envs=32, frames_per_batch=16384, eval_every=32768, eval_episodes=64)
    summary = recipe.train(cfg)
    history = [round(h["success_rate"], 2) for h in summary["history"]]
    assert history[0] < 0.5, history
    assert summary["final_success_rate"] >= 0.9, history


# --- interruption and resume ----------------------------------------------------------------

# Eight batches, an evaluation and a checkpoint every two.
RESUME_CONFIG = dict(TINY_CONFIG, frames=4096, epochs=2, eval_every=1024)


def at_batch(monkeypatch, number: int, action) -> None:
    """Run ``action()`` while the recipe processes its ``number``-th batch (1-based)."""
    original = recipe.end_truncated_episodes
    batches = []

    def end_truncated_episodes_then_act(batch):
        original(batch)
        batches.append(batch)
        if len(batches) == number:
            action()

    monkeypatch.setattr(recipe, "end_truncated_episodes", end_truncated_episodes_then_act)


def send_sigint():
    os.kill(os.getpid(), signal.SIGINT)


def run_record(run_dir: Path) -> dict:
    """What must not depend on interruptions: final weights, optimizer, history, logs."""
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    summary = json.loads((run_dir / "summary.json").read_text())
    logs = {str(p.relative_to(run_dir)): p.read_text()
            for p in sorted((run_dir / "scalars").rglob("*.csv")) if "time" not in p.parts}
    return {
        "actor": checkpoint["actor"], "critic": checkpoint["critic"],
        "optimizer_state": checkpoint["optimizer"]["state"],
        "history": [(h["frames"], h["success_rate"]) for h in summary["history"]],
        "summary": {k: summary[k] for k in ("status", "frames", "batches", "skipped_updates",
                                            "final_success_rate")},
        "logs": logs,
    }


def assert_same_run(a: dict, b: dict) -> None:
    for part in ("actor", "critic"):
        assert a[part].keys() == b[part].keys()
        for name in a[part]:
            assert torch.equal(a[part][name], b[part][name]), (part, name)
    for index, state in a["optimizer_state"].items():
        for name, value in state.items():
            assert torch.equal(value, b["optimizer_state"][index][name]), (index, name)
    assert a["history"] == b["history"] and a["summary"] == b["summary"]
    assert a["logs"] == b["logs"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    output = tmp_path_factory.mktemp("uninterrupted")
    summary = recipe.train(Config(**RESUME_CONFIG, output=str(output)))
    assert summary["status"] == "completed" and summary["frames"] == 4096
    return run_record(Path(summary["run_dir"]))


def test_interrupted_then_resumed_run_is_bit_identical(tmp_path, monkeypatch, uninterrupted):
    cfg = Config(**RESUME_CONFIG, output=str(tmp_path))
    at_batch(monkeypatch, 3, send_sigint)  # between two evaluations: a checkpoint of its own
    stopped = recipe.train(cfg)
    assert (stopped["status"], stopped["frames"], stopped["total_frames"]) == (
        "interrupted", 1536, 4096)
    run_dir = cfg.run_dir()
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["progress"]["frames"] == 1536
    monkeypatch.undo()
    resumed = recipe.train(cfg, resume=True)
    assert resumed["status"] == "completed"
    assert_same_run(run_record(run_dir), uninterrupted)


def test_crash_while_checkpointing_keeps_the_last_checkpoint_and_resume_goes_on_from_it(
        tmp_path, monkeypatch, uninterrupted):
    """A failure inside ``torch.save`` (as a kill would leave it) cannot corrupt the checkpoint;
    the resumed run drops the log lines written after it and ends as if nothing happened."""
    cfg = Config(**RESUME_CONFIG, output=str(tmp_path))
    run_dir = cfg.run_dir()
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text('{"status": "interrupted"}')  # an earlier run's
    real_save = torch.save
    saves = []

    def save_then_die_on_the_fourth(obj, f):  # checkpoints at 0, 1024, 2048, 3072 frames
        saves.append(obj["progress"]["frames"])
        if len(saves) == 4:
            f.write(b"the first bytes of a checkpoint")
            raise OSError("killed while writing")
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", save_then_die_on_the_fourth)
    with pytest.raises(OSError, match="killed while writing"):
        recipe.train(cfg)
    monkeypatch.undo()
    assert saves == [0, 1024, 2048, 3072]
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert checkpoint["progress"]["frames"] == 2048
    assert sorted(p.name for p in run_dir.iterdir() if p.is_file()) == [
        ".lock", "checkpoint.pt", "config.json"]  # no temporary file, no stale summary
    loss_log = (run_dir / "scalars" / "train" / "loss_objective.csv").read_text()
    assert loss_log.splitlines()[-1].startswith("3072,")
    recipe.train(cfg, resume=True)
    assert_same_run(run_record(run_dir), uninterrupted)


def test_a_batch_without_trainable_steps_skips_its_update(tmp_path, monkeypatch):
    original = recipe.training_steps
    calls = []

    def nothing_trainable_in_the_first_batch(batch, cfg):
        calls.append(batch)
        trainable, critic_only = original(batch, cfg)
        return (trainable[:0], critic_only) if len(calls) == 1 else (trainable, critic_only)

    monkeypatch.setattr(recipe, "training_steps", nothing_trainable_in_the_first_batch)
    summary = recipe.train(Config(**TINY_CONFIG, output=str(tmp_path)))
    assert (summary["status"], summary["batches"], summary["skipped_updates"]) == (
        "completed", 2, 1)
    scalars = Path(summary["run_dir"]) / "scalars" / "train"
    assert (scalars / "update_skipped.csv").read_text() == "512,1.0\n1024,0.0\n"

    def read(name):
        return [line.split(",") for line in (scalars / f"{name}.csv").read_text().split()]

    assert [step for step, _ in read("loss_objective")] == ["1024"]
    for name in ("episodes_cut_share", "bootstrap_masked_share"):
        # Logged for the skipped batch too, a share of it.
        assert [step for step, _ in read(name)] == ["512", "1024"], name
        assert all(0 <= float(value) <= 1 for _, value in read(name)), name


# --- commands -------------------------------------------------------------------------------


def run(args, cwd, expect=0, timeout=300):
    env = {**os.environ, "RL_WARNINGS": "False"}
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == expect, result.stdout + result.stderr
    return result.stdout


def check_run_folder(run_dir: Path, status="completed", min_frames=1024):
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == status
    assert summary["frames"] >= min_frames
    last = (run_dir / "scalars" / "eval" / "success_rate.csv").read_text().split()[-1]
    assert float(last.split(",")[1]) == summary["final_success_rate"]
    for name in ("eval/success_rate", "train/loss_objective", "train/clip_fraction",
                 "train/episodes_cut_share", "train/bootstrap_masked_share", "time/fps"):
        assert (run_dir / "scalars" / f"{name}.csv").is_file(), name
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert {"actor", "critic", "optimizer", "config", "progress"} <= set(checkpoint)
    return summary


def test_masked_rl_train_and_eval_smoke(tmp_path):
    out = run(["masked-rl", "train", *TINY, "--output", str(tmp_path), "--seed", "3"], tmp_path)
    assert "final greedy success" in out
    run_dir = tmp_path / "masked-seed3"
    summary = check_run_folder(run_dir)
    # By default eval replays the run's own evaluation: the same success rate.
    out = run(["masked-rl", "eval", str(run_dir), "--render"], tmp_path)
    assert f"greedy success {summary['final_success_rate']:.1%} over 8 episodes" in out
    assert out.splitlines()[-1].startswith("[<bos>")  # the transcript of one greedy episode


def test_eval_command_options(tmp_path, capsys):
    summary = recipe.train(Config(**TINY_CONFIG, output=str(tmp_path)))
    checkpoint = Path(summary["run_dir"]) / "checkpoint.pt"
    command = parse_eval_command([str(checkpoint), "--episodes", "3", "--seed", "11"])
    assert recipe.run_eval_command(command) == 0
    out = capsys.readouterr().out
    assert "checkpoint at 1024 frames" in out and "over 3 episodes (seed 11)" in out


def test_eval_renders_a_run_with_overridden_tool_output_length(tmp_path, capsys):
    """``--response-len`` overrides the id's step budget too: the transcript plays under it."""
    summary = recipe.train(Config(**TINY_CONFIG, response_len=12, output=str(tmp_path)))
    command = parse_eval_command([summary["run_dir"], "--render"])
    assert recipe.run_eval_command(command) == 0
    out = capsys.readouterr().out
    assert f"greedy success {summary['final_success_rate']:.1%} over 8 episodes" in out
    transcript = out.splitlines()[-1]
    outputs = re.findall(r"\[((?:RESULT|ERROR) [^\]]*)\]", transcript)  # the last may be cut
    assert transcript.startswith("[<bos>") and len(outputs) > 1, transcript
    assert {len(output.split()) for output in outputs[:-1]} == {12}, transcript


def test_recipe_script_from_its_folder_with_workers_stops_on_ctrl_c_and_resumes(tmp_path):
    """The script runs from its own folder; a terminal's Ctrl-C (SIGINT to the process group)
    with ``--workers 2`` stops it within seconds, exit status 130, workers gone, checkpoint
    and summary marked interrupted; ``masked-rl train --resume`` then finishes the run."""
    args = [sys.executable, "ppo_tool_use.py", "--frames", "3072", "--num-envs", "8",
            "--frames-per-batch", "256", "--minibatch-size", "64", "--epochs", "1",
            "--eval-every", "1024", "--eval-episodes", "8", "--no-progress-bar", "--threads",
            "1", "--estimator", "plain", "--workers", "2", "--output", str(tmp_path)]
    process = subprocess.Popen(args, cwd=REPO / "examples" / "ppo_tool_use",
                               env={**os.environ, "RL_WARNINGS": "False"},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    run_dir = tmp_path / "plain-seed0"
    batches_log = run_dir / "scalars" / "train" / "trainable_steps.csv"
    deadline = time.monotonic() + 240
    while not (batches_log.is_file() and len(batches_log.read_text().split()) >= 2):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no batch after 240 s"
        time.sleep(0.1)
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    workers = [pid for pid in children  # not multiprocessing's resource tracker
               if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(workers) == 2, children
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    sent = time.monotonic()
    stdout, stderr = process.communicate(timeout=120)
    stopped_after = time.monotonic() - sent
    assert process.returncode == 130, stdout + stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert "continue with: masked-rl train --resume" in stderr
    assert stopped_after < 30, stopped_after  # a batch and the shutdown; seconds on an idle box
    for pid in workers:  # gone, or a zombie waiting for init
        status = Path(f"/proc/{pid}/status")
        assert not status.exists() or "zombie" in status.read_text(), pid
    summary = check_run_folder(run_dir, status="interrupted", min_frames=512)
    assert summary["frames"] < 3072

    run(["masked-rl", "train", "--resume", str(run_dir), "--no-progress-bar"], tmp_path)
    summary = check_run_folder(run_dir)
    assert summary["frames"] == 3072 and summary["config"]["workers"] == 2


def test_masked_rl_compare_smoke_and_rerun(tmp_path):
    args = ["masked-rl", "compare", *TINY, "--frames", "600", "--seeds", "5", "--jobs", "2",
            "--output", str(tmp_path)]
    out = run(args, tmp_path)
    assert "| masked |" in out and "| plain |" in out and "frames to 90%" in out
    assert "1,024 frames per run (--frames 600 rounded up to whole batches of 512)" in out
    with (tmp_path / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["estimator"], r["seed"], r["frames"]) for r in rows) == [
        ("masked", "5", "1024"), ("plain", "5", "1024")]
    assert (tmp_path / "curves.csv").stat().st_size > 0
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    # The same command again: both runs are finished, nothing is trained again.
    summary_csv = (tmp_path / "summary.csv").read_text()
    out = run(args, tmp_path)
    assert "reusing 2 finished run(s), resuming 0, starting 0" in out
    assert (tmp_path / "summary.csv").read_text() == summary_csv
    # With a larger budget the finished runs are extended from their checkpoints.
    out = run([*args, "--frames", "1536"], tmp_path)
    assert "reusing 0 finished run(s), resuming 2, starting 0" in out
    with (tmp_path / "summary.csv").open() as f:
        assert sorted(r["frames"] for r in csv.DictReader(f)) == ["1536", "1536"]


def test_compare_resumes_what_an_interruption_left(tmp_path, monkeypatch, capsys):
    argv = [*TINY, "--frames", "2048", "--seeds", "7", "--jobs", "1", "--output", str(tmp_path)]
    at_batch(monkeypatch, 6, send_sigint)  # 4 batches a run: in the second (plain, seed 7)
    assert compare.main(argv) == 130
    assert "re-run the same command" in capsys.readouterr().err
    assert not (tmp_path / "summary.csv").exists()
    monkeypatch.undo()
    # --report trains nothing: the outputs from the finished runs, the interrupted one named and
    # left out (its figures are those of fewer frames than the others').
    interrupted = json.loads((tmp_path / "plain-seed7" / "summary.json").read_text())
    assert interrupted["status"] == "interrupted" and interrupted["frames"] < 2048
    checkpoint = (tmp_path / "plain-seed7" / "checkpoint.pt").read_bytes()
    assert compare.main([*argv, "--report"]) == 0
    out = capsys.readouterr().out
    assert f"not finished, left out: plain-seed7 ({interrupted['frames']:,} of 2,048 frames)" in out
    assert "| masked | 7 |" in out and "| plain |" not in out
    with (tmp_path / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["estimator"], int(r["frames"])) for r in rows] == [("masked", 2048)]
    finished = json.loads((tmp_path / "masked-seed7" / "summary.json").read_text())
    with (tmp_path / "curves.csv").open() as f:
        curves = list(csv.DictReader(f))
    assert {r["estimator"] for r in curves} == {"masked"}
    assert len(curves) == len(finished["history"])
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "plain-seed7" / "checkpoint.pt").read_bytes() == checkpoint
    # Nothing finished to report: a one-line error naming what the folder holds.
    assert compare.main([*argv, "--estimators", "plain", "--seeds", "7", "8", "--report"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no finished run of this comparison" in err
    assert "not finished, left out: plain-seed7" in err and "not started: plain-seed8" in err
    assert compare.main([*argv, "--report", "--output", str(tmp_path / "empty")]) == 2
    assert "holds no finished run" in capsys.readouterr().err
    assert compare.main(argv) == 0
    assert "reusing 1 finished run(s), resuming 1, starting 0" in capsys.readouterr().out
    for name in ("masked-seed7", "plain-seed7"):
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert (summary["status"], summary["frames"]) == ("completed", 2048)
    # A folder that holds a run with other options is an error before anything runs (a larger
    # --frames is not one: it extends the runs), and so is a smaller budget.
    assert compare.main([*argv, "--lr", "0.001"]) == 2
    assert "holds a run with other options (lr differ)" in capsys.readouterr().err
    assert compare.main([*argv, "--frames", "1024"]) == 2
    assert "holds a run with other options (frames differ)" in capsys.readouterr().err


def test_an_error_during_training_with_workers_exits_instead_of_hanging(tmp_path):
    """An exception raised mid-run with --workers 2 reaches the top and the process exits (TorchRL's
    weight-sync objects used to deadlock at interpreter exit when the traceback kept them alive)."""
    script = (
        "from masked_rl_examples.ppo_tool_use import ppo_tool_use as recipe\n"
        "from masked_rl_examples.ppo_tool_use.config import Config\n"
        "def boom(*args, **kwargs): raise RuntimeError('boom')\n"
        "recipe.estimate_advantages = boom\n"
        "if __name__ == '__main__':\n"
        f"    recipe.train(Config(**{dict(TINY_CONFIG, workers=2, output=str(tmp_path))!r}))\n"
    )
    path = tmp_path / "boom.py"
    path.write_text(script)
    result = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "RuntimeError: boom" in result.stderr


# --- estimators, critic targets, whole episodes, sweeps -------------------------------------


@pytest.mark.parametrize("estimator, masked_value_targets", [
    ("masked", False), ("masked", True), ("plain", False), ("zeroed", False),
    ("terminal-only", False), ("terminal-only", True)])
def test_every_estimator_trains(tmp_path, estimator, masked_value_targets):
    cfg = Config(**TINY_CONFIG, output=str(tmp_path), estimator=estimator,
                 masked_value_targets=masked_value_targets, critic_extra_steps=32)
    summary = recipe.train(cfg)
    assert summary["status"] == "completed" and summary["skipped_updates"] < summary["batches"]
    critic = recipe.critic_on_masked_steps(cfg)
    assert critic == (estimator == "plain" or masked_value_targets)


def test_training_steps_and_the_critic_only_steps(tmp_path):
    """The replay buffer gets the trainable steps of whole episodes; the critic-only steps are
    masked steps that carry a value target (every valid masked step for plain)."""
    cfg = Config(**TINY_CONFIG, output=str(tmp_path), estimator="plain")
    env = make_env(TINY_ID, 8)
    actor, critic = make_actor_critic(env, 4, 16, 1)
    loss = recipe.make_loss(cfg, actor, critic)
    from torchrl.collectors import Collector
    from masked_rl import CompleteEpisodes
    collector = Collector(env, actor, frames_per_batch=256, total_frames=512,
                          auto_register_policy_transforms=False)  # feed-forward: none needed
    complete = CompleteEpisodes()
    for batch in collector:
        whole = complete(batch)
        recipe.estimate_advantages(loss, whole, cfg)
        trainable, critic_only = recipe.training_steps(whole, cfg)
        valid = whole["collector", "mask"]
        masked = whole["loss_mask"].squeeze(-1) == 0
        assert trainable.shape[0] == int(whole["loss_mask"].sum())
        assert critic_only.shape[0] == int((valid & masked).sum())
        assert (critic_only["loss_mask"] == 0).all()
    collector.shutdown()


def test_env_overrides_grow_window_and_budget():
    cfg = Config(env="MaskedRL/ToolUse-v0", closing_len=64)
    kwargs = cfg.env_kwargs()
    # v0: 2 queries, one-token calls, 16-token responses: 6 + (2 + 2) * 17 = 74 steps before the
    # closing block (two wasted turns included), then 64.
    assert kwargs == {"closing_len": 64, "window": 74, "max_steps": 138}
    assert Config(response_len=64).env_kwargs() == {"response_len": 64, "window": 266, "max_steps": 270}
    assert Config().env_kwargs() == {}
    with pytest.raises(ValueError, match="closing_len must be >= 1"):
        Config(closing_len=0)


@pytest.mark.parametrize("successes, trials", [(0, 3), (1, 3), (3, 3), (2, 5), (5, 5), (7, 10)])
def test_wilson_interval_is_the_set_of_proportions_the_score_test_keeps(successes, trials):
    """Against its definition, on a grid: the p with |k/n - p| <= 1.96 * sqrt(p (1 - p) / n)."""
    share = successes / trials
    kept = [i / 100_000 for i in range(100_001)
            if abs(share - i / 100_000) <= 1.959964 * (i / 100_000 * (1 - i / 100_000) / trials) ** 0.5]
    low, high = compare.wilson_interval(successes, trials)
    assert low == pytest.approx(min(kept), abs=2e-5) and high == pytest.approx(max(kept), abs=2e-5)
    with pytest.raises(ValueError, match="need 0 <= successes <= trials"):
        compare.wilson_interval(4, 3)


def test_compare_sweep_writes_table_csv_and_figure(tmp_path, capsys):
    argv = [*TINY, "--env", TINY_ID, "--frames", "512", "--seeds", "3", "--jobs", "1",
            "--estimators", "masked", "zeroed", "--sweep", "closing-len=1,3", "--sweep-frames",
            "512,1024", "--output", str(tmp_path)]
    assert compare.main(argv) == 0
    out = capsys.readouterr().out
    assert "| closing-len | estimator |" in out and "| 3 | **zeroed (mean)** |" in out
    assert "(0/1 runs, 95 % CI 0%-79%)" in out  # a tiny budget: no run reaches 90 %
    with (tmp_path / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["closing_len"], r["estimator"]) for r in rows] == [
        ("1", "masked"), ("1", "zeroed"), ("3", "masked"), ("3", "zeroed")]
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    for value in (1, 3):
        config = json.loads((tmp_path / f"closing-len={value}" / "masked-seed3" / "config.json")
                            .read_text())
        assert config["closing_len"] == value
        assert config["frames"] == {1: 512, 3: 1024}[value]
    assert [int(r["frames"]) for r in rows] == [512, 512, 1024, 1024]
    for bad, message in ((["--sweep-frames", "512"], "one positive frame count per --sweep value"),
                         (["--sweep-frames", "a,b"], "--sweep-frames must be integers")):
        with pytest.raises(SystemExit):
            compare.main([*argv, *bad])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare.main([*argv, "--sweep", "window=1,2"])
    assert "--sweep must be NAME=V1,V2,..." in capsys.readouterr().err


def test_a_finished_run_extended_to_more_frames_equals_a_run_with_that_budget(tmp_path, uninterrupted):
    """``train --resume RUN --frames N`` (and ``compare`` with a larger ``--frames``) goes on
    from the checkpoint: 2048 frames then 2048 more train exactly as 4096 from the start (the
    old end, 2048, is on the evaluation schedule, so even the history is the same)."""
    short = Config(**dict(RESUME_CONFIG, frames=2048), output=str(tmp_path))
    first = recipe.train(short)
    assert (first["status"], first["frames"]) == ("completed", 2048)
    run_dir = short.run_dir()
    command = parse_train_command(["--resume", str(run_dir), "--frames", "4096"])
    assert command.resume and command.config.frames == 4096
    extended = recipe.train(command.config, run_dir=command.run_dir, resume=True)
    assert (extended["status"], extended["frames"], extended["total_frames"]) == ("completed", 4096, 4096)
    assert_same_run(run_record(run_dir), uninterrupted)
    # Fewer frames than the run has is a changed option, as any other.
    with pytest.raises(ValueError, match="frames differ"):
        recipe.train(Config(**dict(RESUME_CONFIG, frames=1024), output=str(tmp_path)), resume=True)


def test_anneal_lr_decays_the_rate_linearly_batch_by_batch(tmp_path, monkeypatch):
    """``--anneal-lr``: batch k of n trains with ``lr * (1 - k / n)``; off, every batch has ``lr``."""
    rates = {}
    real_update = recipe.update

    def recording_update(loss, optimizer, *args, **kwargs):
        rates.setdefault(kwargs.get("cfg", args[-1]).anneal_lr, []).append(
            optimizer.param_groups[0]["lr"])
        return real_update(loss, optimizer, *args, **kwargs)

    monkeypatch.setattr(recipe, "update", recording_update)
    base = dict(TINY_CONFIG, frames=2048, eval_every=2048, lr=1e-3)
    annealed = recipe.train(Config(**base, output=str(tmp_path / "on"), anneal_lr=True))
    constant = recipe.train(Config(**base, output=str(tmp_path / "off")))
    assert rates[True] == pytest.approx([1e-3, 0.75e-3, 0.5e-3, 0.25e-3])
    assert rates[False] == [1e-3] * 4
    weights = [torch.load(Path(s["run_dir"]) / "checkpoint.pt", weights_only=True)["actor"]
               for s in (annealed, constant)]
    assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_batch_costs_script_reads_an_unfinished_and_a_resumed_run(tmp_path, monkeypatch):
    """``docs/scripts/batch_costs.py`` (the per-batch cost table of docs/experiments.md): one row
    per batch from the run folder's logs, unfinished runs included, evaluations where they ran."""
    script = Path(__file__).parents[2] / "docs" / "scripts" / "batch_costs.py"
    cfg = Config(**RESUME_CONFIG, output=str(tmp_path))
    at_batch(monkeypatch, 3, send_sigint)
    assert recipe.train(cfg)["status"] == "interrupted"

    def table() -> list[dict]:
        out = tmp_path / "costs.csv"
        done = subprocess.run([sys.executable, str(script), str(out), str(cfg.run_dir())],
                              capture_output=True, text=True, check=True)
        assert done.stdout.startswith(f"wrote {out}")
        with out.open() as f:
            return list(csv.DictReader(f))

    partial = table()
    assert [int(r["frames"]) for r in partial] == [512, 1024, 1536]
    assert {r["run"] for r in partial} == {f"{tmp_path.name}/{cfg.run_dir().name}"}
    assert all(float(r["update_s"]) > 0 and float(r["trainable_steps"]) > 0 for r in partial)
    monkeypatch.undo()
    assert recipe.train(cfg, resume=True)["status"] == "completed"
    rows = table()
    assert [int(r["frames"]) for r in rows] == list(range(512, 4097, 512))
    assert [int(r["frames"]) for r in rows if r["eval_success"]] == [1024, 2048, 3072, 4096]
    usage = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert usage.returncode == 2 and usage.stderr.startswith("usage: ")
