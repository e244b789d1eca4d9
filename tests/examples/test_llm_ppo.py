"""Smoke runs of ``masked-rl llm-train`` / ``llm-compare``: each estimator end to end in seconds,
checkpoint and resume, Ctrl-C, and one-line option errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from masked_rl_examples.llm_ppo.config import LLMConfig, parse_llm_train_command
from masked_rl_examples.llm_ppo.llm_ppo import build, task_config, train

TINY = dict(tokens=150, episodes_per_batch=8, group_size=4, eval_episodes=8, eval_every=100,
            epochs=1, minibatch_size=4, hidden_size=16, num_heads=2, progress_bar=False)


def _cfg(tmp_path, **kwargs) -> LLMConfig:
    return LLMConfig(**{**TINY, "output": str(tmp_path), **kwargs})


@pytest.mark.parametrize("estimator", ["masked", "grpo", "plain"])
def test_train_runs_each_estimator_and_writes_its_run_folder(tmp_path, estimator):
    cfg = _cfg(tmp_path, estimator=estimator)
    summary = train(cfg)
    run_dir = tmp_path / f"{estimator}-seed0"
    assert summary["status"] == "completed" and summary["tokens"] >= cfg.tokens
    assert summary["episodes"] == summary["iterations"] * 8
    assert [h["tokens"] for h in summary["history"]][0] == 0  # the untrained policy first
    assert summary["history"][-1]["tokens"] == summary["tokens"]
    # Each evaluation is a whole number of the eval episodes, logged as the CSV's last row.
    assert summary["final_success_rate"] == summary["history"][-1]["success_rate"]
    assert all((h["success_rate"] * cfg.eval_episodes).is_integer() for h in summary["history"])
    last = (run_dir / "scalars" / "eval" / "success_rate.csv").read_text().split()[-1]
    assert float(last.split(",")[1]) == summary["final_success_rate"]
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    assert (run_dir / "checkpoint.pt").is_file()
    rows = (run_dir / "scalars" / "train" / "episode_return.csv").read_text().splitlines()
    assert len(rows) == summary["iterations"]
    assert (run_dir / "scalars" / "train" / "loss_objective.csv").is_file()
    if estimator != "grpo":
        assert (run_dir / "scalars" / "train" / "loss_critic.csv").is_file()


@pytest.mark.parametrize("estimator", ["masked", "plain"])
def test_critic_is_a_head_on_the_policy_trunk_or_a_model_of_its_own(tmp_path, estimator):
    for critic in ("shared", "separate"):
        cfg = _cfg(tmp_path / critic, estimator=estimator, critic=critic)
        _, model, _, estimator_module, _ = build(cfg)
        trained = {id(p) for p in estimator_module.parameters()}
        policy = {id(p) for p in model.parameters()}
        head = {id(p) for p in estimator_module.critic.head.parameters()}
        assert policy <= trained and head <= trained
        if critic == "shared":  # the policy's trunk and one linear head, nothing else
            assert estimator_module.critic.model is model
            assert trained == policy | head
        else:
            assert not {id(p) for p in estimator_module.critic.model.parameters()} & policy
            assert len(trained) > len(policy | head)
        if estimator == "masked":
            assert estimator_module.loss_module.shares_trunk == (critic == "shared")
        summary = train(cfg)
        assert summary["status"] == "completed"
        assert (tmp_path / critic / f"{estimator}-seed0" / "scalars" / "train" /
                "loss_critic.csv").is_file()


@pytest.mark.parametrize("estimator", ["masked", "plain"])
def test_critic_tokens_choose_where_the_value_loss_is_taken(tmp_path, estimator):
    """``auto``: the assistant tokens for masked, every token for plain; ``every`` for masked is
    MaskedGAE's targets at masked tokens too (the advantages unchanged)."""
    expected = {"auto": "trainable" if estimator == "masked" else "every",
                "trainable": "trainable",
                "every": "targets" if estimator == "masked" else "every"}
    for critic_tokens, loss_tokens in expected.items():
        cfg = _cfg(tmp_path / critic_tokens, estimator=estimator, critic_tokens=critic_tokens)
        _, _, _, estimator_module, _ = build(cfg)
        assert estimator_module.loss_module.critic_tokens == loss_tokens
        if estimator == "masked":
            assert estimator_module.gae.masked_value_targets == (loss_tokens == "targets")
    summary = train(cfg)  # the last: a dense critic, end to end
    assert summary["status"] == "completed"


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    straight = train(_cfg(tmp_path / "a", tokens=300))
    first = train(_cfg(tmp_path / "b", tokens=150))
    assert first["tokens"] < straight["tokens"]
    resumed = train(_cfg(tmp_path / "b", tokens=300), resume=True)
    assert resumed["tokens"] == straight["tokens"]
    assert [h["success_rate"] for h in resumed["history"]] == [
        h["success_rate"] for h in straight["history"]]
    weights = [torch.load(p / "masked-seed0" / "checkpoint.pt", weights_only=True)["estimator"]
               for p in (tmp_path / "a", tmp_path / "b")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    # the CSV log holds each iteration once
    steps = [int(line.split(",")[0]) for line in (
        tmp_path / "b" / "masked-seed0" / "scalars" / "train" / "episode_return.csv"
    ).read_text().splitlines()]
    assert steps == sorted(set(steps)) and len(steps) == straight["iterations"]


def test_resume_refuses_other_options(tmp_path):
    train(_cfg(tmp_path))
    with pytest.raises(ValueError, match="lr differ"):
        train(_cfg(tmp_path, lr=0.5), resume=True)
    with pytest.raises(ValueError, match="normalize_advantage differ"):
        train(_cfg(tmp_path, normalize_advantage=True), resume=True)


def test_resume_ignores_options_the_estimator_never_reads(tmp_path):
    """grpo reads no critic option, masked and plain no group size: changing those cannot
    change the run, so it resumes."""
    train(_cfg(tmp_path, estimator="grpo", tokens=100))
    resumed = train(_cfg(tmp_path, estimator="grpo", normalize_advantage=True, critic_coeff=0.3,
                         critic="separate", lmbda=0.5), resume=True)
    assert resumed["status"] == "completed" and resumed["tokens"] >= TINY["tokens"]
    train(_cfg(tmp_path, tokens=100))
    assert train(_cfg(tmp_path, group_size=2), resume=True)["status"] == "completed"
    with pytest.raises(ValueError, match="group_size differ"):
        train(_cfg(tmp_path, estimator="grpo", group_size=2), resume=True)


def _masked_rl(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "masked_rl_examples.cli", *args],
                          capture_output=True, text=True, timeout=300, **kwargs)


@pytest.mark.parametrize("args, message", [
    (["--lr", "-1"], "lr must be a finite number > 0, got -1.0"),
    (["--estimator", "ppo"], "argument --estimator: invalid choice: 'ppo'"),
    (["--critic", "both"], "argument --critic: invalid choice: 'both'"),
    (["--critic-tokens", "all"], "argument --critic-tokens: invalid choice: 'all'"),
    (["--call-cost", "-0.1"], "call_cost must be a finite number >= 0, got -0.1"),
    (["--estimator", "grpo", "--group-size", "3"], "episodes_per_batch must be a multiple of "
                                                   "group_size=3 for grpo, got 64"),
    (["--n-queries", "5"], "n_queries must be <= n_keys=4, got 5"),
    (["--device", "cuda:7"], "device: 'cuda:7'"),
])
def test_option_errors_are_one_line(args, message):
    result = _masked_rl("llm-train", *args)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert result.stderr.startswith("masked-rl llm-train: error: ")


def test_resume_option_errors(tmp_path):
    with pytest.raises(SystemExit):
        parse_llm_train_command(["--resume", str(tmp_path)])
    train(_cfg(tmp_path))
    with pytest.raises(SystemExit):
        parse_llm_train_command(["--resume", str(tmp_path / "masked-seed0"), "--lr", "0.1"])
    command = parse_llm_train_command(["--resume", str(tmp_path / "masked-seed0"),
                                       "--tokens", "400"])
    assert command.resume and command.config.tokens == 400 and command.config.hidden_size == 16


def test_ctrl_c_checkpoints_and_resume_finishes(tmp_path):
    options = ["--tokens", "100000", "--episodes-per-batch", "8", "--eval-episodes", "8",
               "--eval-every", "100", "--epochs", "1", "--minibatch-size", "8",
               "--hidden-size", "16", "--num-heads", "2", "--no-progress-bar",
               "--output", str(tmp_path)]
    process = subprocess.Popen([sys.executable, "-m", "masked_rl_examples.cli", "llm-train",
                                *options], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    run_dir = tmp_path / "masked-seed0"
    deadline = time.monotonic() + 240
    while not (run_dir / "scalars" / "train" / "episode_return.csv").is_file():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.2)
    os.kill(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=240)
    assert process.returncode == 130, stderr
    assert f"masked-rl llm-train --resume {run_dir}" in stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["tokens"] < 100000
    result = _masked_rl("llm-train", "--resume", str(run_dir), "--tokens",
                        str(summary["tokens"] + 50))
    assert result.returncode == 0, result.stderr
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


def test_compare_one_seed_writes_table_csvs_png_and_resumes(tmp_path):
    args = ["llm-compare", "--seeds", "0", "--estimators", "masked", "grpo", "--output",
            str(tmp_path)] + [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()
                              if k != "progress_bar"]
    result = _masked_rl(*args)
    assert result.returncode == 0, result.stderr
    assert "masked" in result.stdout and "grpo" in result.stdout and "solved" in result.stdout
    summary_rows = (tmp_path / "summary.csv").read_text().splitlines()
    assert summary_rows[0].startswith("estimator,seed,status,final_success_rate")
    assert [r.split(",")[:3] for r in summary_rows[1:]] == [
        ["masked", "0", "completed"], ["grpo", "0", "completed"]]
    curves = (tmp_path / "curves.csv").read_text().splitlines()
    assert curves[0] == "estimator,seed,tokens,episodes,success_rate,wall_time_s"
    assert len(curves) > 3
    assert (tmp_path / "curves.png").stat().st_size > 1000
    # a second call finds both runs finished and trains nothing
    mtime = (tmp_path / "masked-seed0" / "checkpoint.pt").stat().st_mtime_ns
    again = _masked_rl(*args)
    assert again.returncode == 0 and again.stdout == result.stdout
    assert (tmp_path / "masked-seed0" / "checkpoint.pt").stat().st_mtime_ns == mtime
    # --report trains nothing: the outputs from the runs the folder holds, the others named
    (tmp_path / "summary.csv").unlink()
    report = _masked_rl(*args[:2], "1", *args[2:], "--report")
    assert report.returncode == 0, report.stderr
    assert report.stdout.startswith(result.stdout.split("\nwrote ")[0])
    assert "not started: masked-seed1, grpo-seed1" in report.stdout
    assert "not finished" not in report.stdout
    assert (tmp_path / "summary.csv").read_text().splitlines() == summary_rows
    assert not (tmp_path / "masked-seed1").exists()
    assert (tmp_path / "masked-seed0" / "checkpoint.pt").stat().st_mtime_ns == mtime
    # a larger budget than the runs had: not finished, so left out of every figure; with none
    # finished there is nothing to report, and the one-line error names what the folder holds
    larger = _masked_rl(*args, "--tokens", "100000", "--report")
    assert larger.returncode == 2 and larger.stderr.count("\n") == 1, larger.stderr
    assert "holds no finished run of this comparison" in larger.stderr
    assert "not finished, left out: masked-seed0 (" in larger.stderr and " of 100,000 tokens)" in larger.stderr
    assert (tmp_path / "summary.csv").read_text().splitlines() == summary_rows
    empty = _masked_rl("llm-compare", "--report", "--output", str(tmp_path / "empty"))
    assert empty.returncode == 2 and empty.stderr.count("\n") == 1
    assert "holds no finished run" in empty.stderr
    # a finished run made with other options is refused, not reported as this command's;
    # an option the estimator never reads (grpo has no critic) leaves its run valid
    other = _masked_rl(*args, "--critic-coeff", "0.3")
    assert other.returncode == 2 and other.stderr.count("\n") == 1, other.stderr
    assert "masked-seed0' holds a run made with other options (critic_coeff differ)" in other.stderr
    grpo_only = [a for a in args if a != "masked"]
    unread = _masked_rl(*grpo_only, "--critic-coeff", "0.3", "--report")
    assert unread.returncode == 0 and "not finished" not in unread.stdout, unread.stderr


def test_config_defaults_are_valid_and_checked():
    cfg = LLMConfig()
    assert cfg.batch_group_size == 1 and replace(cfg, estimator="grpo").batch_group_size == 8
    with pytest.raises(ValueError, match="group_size must be >= 2 for grpo"):
        LLMConfig(estimator="grpo", group_size=1)
    with pytest.raises(ValueError, match="hidden_size must be divisible by num_heads=4, got 30"):
        LLMConfig(hidden_size=30)


def test_task_options_reach_the_environment():
    cfg = LLMConfig(call_cost=0.25, lookup_reward=0.3, max_turns=4, response_len=6)
    task = task_config(cfg)
    assert (task.call_cost, task.lookup_reward, task.max_turns, task.response_len) == (
        0.25, 0.3, 4, 6)
    assert task.oracle_return == 1.0 + 2 * (0.3 - 0.25)


@pytest.mark.parametrize("restrict", [True, False])
def test_the_trained_distribution_is_the_one_generation_samples(restrict):
    """Generation never samples the suppressed ids (``bad_words_ids``); the losses read the
    model's own log-probs. With the restricted head (the default) the two are one distribution;
    with Llama's plain head the scored log-probs of the very tokens sampled differ from the
    sampler's (the mass on never-sampled ids is in them) - the bug this head fixed."""
    from masked_rl_envs.llm_factories import make_model, make_tokenizer, suppressed_token_ids

    tok = make_tokenizer(n_keys=4, n_values=4, n_filler=1)
    model = make_model(tok, hidden_size=16, num_layers=1, num_heads=2, seed=0,
                       restrict_vocabulary=restrict).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "k1 k3"}], tokenize=True,
                                     add_generation_prompt=True, return_dict=True,
                                     return_tensors="pt")["input_ids"].repeat(16, 1)
    torch.manual_seed(0)
    out = model.generate(prompt, do_sample=True, max_new_tokens=4, top_k=len(tok),
                         bad_words_ids=[[i] for i in suppressed_token_ids(tok)],
                         output_scores=True, return_dict_in_generate=True,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    sampled = out.sequences[:, prompt.shape[1]:]
    sampler = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, sampled[..., None])[..., 0]
    with torch.no_grad():
        logits = model(out.sequences).logits[:, prompt.shape[1] - 1:-1]
    scored = logits.log_softmax(-1).gather(-1, sampled[..., None])[..., 0]
    real = torch.isfinite(sampler)  # HF fills a finished row with pad (-inf under the processors)
    assert real[:, 0].all()
    mass_off = logits.softmax(-1)[..., suppressed_token_ids(tok)].sum(-1)
    if restrict:
        torch.testing.assert_close(scored[real], sampler[real], atol=1e-5, rtol=0)
        assert float(mass_off.max()) == 0.0
    else:
        assert (scored[real] - sampler[real]).abs().max() > 0.05
        assert float(mass_off.min()) > 0.05
