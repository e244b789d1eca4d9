"""The PPO tool-use recipe: its pieces, a seeded learning run, and smoke runs of every command."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import gymnasium
import pytest
import torch

from masked_rl_examples.ppo_tool_use.config import Config, field_docs, parse_config
from masked_rl_examples.ppo_tool_use.ppo_tool_use import train
from masked_rl_examples.ppo_tool_use.utils import (
    TokenWindowEncoder,
    evaluate,
    finished_episodes,
    make_actor_critic,
    make_env,
)

REPO = Path(__file__).resolve().parents[2]
ENV_ID = "MaskedRL/ToolUse-v0"
# A tiny budget: a few batches of 16 environments, evaluation on 8 episodes.
TINY = ["--frames", "1024", "--num-envs", "8", "--frames-per-batch", "512",
        "--minibatch-size", "64", "--epochs", "1", "--eval-every", "512", "--eval-episodes", "8",
        "--no-progress-bar", "--threads", "1"]


# --- pieces ---------------------------------------------------------------------------------


def test_every_config_field_has_a_docstring():
    docs = field_docs()
    assert {f.name for f in fields(Config)} == set(docs)
    assert all(docs.values())


def test_every_config_field_is_an_option():
    cfg = parse_config(["--frames", "123", "--estimator", "plain", "--no-normalize-advantage",
                        "--entropy-coeff", "0.5"])
    assert (cfg.frames, cfg.estimator, cfg.normalize_advantage, cfg.entropy_coeff) == (
        123, "plain", False, 0.5)


@pytest.mark.parametrize(
    "kwargs, match",
    [({"estimator": "gae"}, "estimator"), ({"num_envs": 6, "workers": 4}, "multiple of workers"),
     ({"frames_per_batch": 100}, "multiple of num_envs"), ({"epochs": 0}, "epochs")],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Config(**kwargs)


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
    assert stats["episodes"] >= 4 and 0 <= stats["success_rate"] <= 1
    assert stats["reward_per_episode"] >= 0
    result = evaluate(actor, env, seed=1, max_steps=80)
    assert result == evaluate(actor, env, seed=1, max_steps=80)  # the same tasks every time
    env.close()


# --- learning -------------------------------------------------------------------------------

# The default task takes a million frames or more; the learning test uses a small variant of the
# same environment (one lookup of 2 keys, 4-token tool answers): the same skills (call the asked
# key, copy the value out of the tool's answer across masked steps), about 10 steps an episode.
TINY_ID = "MaskedRLTest/ToolUseTiny-v0"
if TINY_ID not in gymnasium.registry:
    gymnasium.register(
        id=TINY_ID,
        entry_point="masked_rl_envs.tool_use:ToolUseEnv",
        kwargs=dict(n_keys=2, n_values=2, n_queries=1, response_len=4, closing_len=1, window=16,
                    max_steps=24),
    )


def test_seeded_training_beats_a_random_policy(tmp_path):
    """A short seeded run reaches a greedy success rate no policy that guesses can reach.

    Without reading the tool's answer, the best an agent can do is to guess one of the 2 values
    (success 1/2); an untrained greedy policy scores about 0.
    """
    cfg = Config(env=TINY_ID, frames=98_304, seed=0, output=str(tmp_path), progress_bar=False,
                 threads=1, num_envs=32, frames_per_batch=2048, eval_every=8192,
                 eval_episodes=64)
    summary = train(cfg)
    history = [round(h["success_rate"], 2) for h in summary["history"]]
    assert history[0] < 0.5, history
    assert summary["final_success_rate"] >= 0.9, history


# --- commands -------------------------------------------------------------------------------


def run(args, cwd):
    env = {**os.environ, "RL_WARNINGS": "False"}
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def check_run_folder(run_dir: Path):
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["frames"] >= 1024 and 0 <= summary["final_success_rate"] <= 1
    assert (run_dir / "checkpoint.pt").is_file()
    for name in ("eval/success_rate", "train/loss_objective", "train/clip_fraction",
                 "time/fps"):
        assert (run_dir / "scalars" / f"{name}.csv").is_file(), name
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert {"actor", "critic", "optimizer", "config", "frames"} <= set(checkpoint)


def test_masked_rl_train_smoke(tmp_path):
    out = run(["masked-rl", "train", *TINY, "--output", str(tmp_path), "--seed", "3"], tmp_path)
    assert "final greedy success" in out
    check_run_folder(tmp_path / "masked-seed3")


def test_recipe_script_smoke_plain_estimator_and_workers(tmp_path):
    script = REPO / "examples" / "ppo_tool_use" / "ppo_tool_use.py"
    run([sys.executable, str(script), *TINY, "--estimator", "plain", "--workers", "2",
         "--output", str(tmp_path)], tmp_path)
    check_run_folder(tmp_path / "plain-seed0")


def test_masked_rl_compare_smoke(tmp_path):
    out = run(["masked-rl", "compare", *TINY, "--seeds", "5", "--jobs", "2",
               "--output", str(tmp_path)], tmp_path)
    assert "| masked |" in out and "| plain |" in out and "frames to 90%" in out
    with (tmp_path / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["estimator"], r["seed"]) for r in rows) == [("masked", "5"), ("plain", "5")]
    assert (tmp_path / "curves.csv").stat().st_size > 0
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
