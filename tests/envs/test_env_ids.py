"""The long-distance ids: their configuration, the oracle solves them, check_env, fresh-interpreter make."""

import subprocess
import sys

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import masked_rl_envs
from masked_rl_envs import (
    CLOSING64_KWARGS,
    LONG64_KWARGS,
    LONG256_KWARGS,
    OraclePolicy,
    ToolUseEnv,
)


def oracle_steps(response_len, closing_len, n_queries=2):
    """Prompt, one-token calls and their responses, ANSWER and the values, closing block."""
    return (1 + n_queries) + n_queries * (1 + response_len) + (1 + n_queries) + closing_len


# env id, its kwargs, oracle steps, oracle return (terminal 1.0 plus the lookup bonuses)
IDS = [
    ("MaskedRL/ToolUseClosing64-v0", CLOSING64_KWARGS, oracle_steps(16, 64), 1.2),
    ("MaskedRL/ToolUseLong64-v0", LONG64_KWARGS, oracle_steps(64, 4), 1.0),
    ("MaskedRL/ToolUseLong256-v0", LONG256_KWARGS, oracle_steps(256, 4), 1.2),
]


def run_oracle(env, seed, wasted_turns=0):
    """One episode: ``wasted_turns`` malformed turns first, then the oracle."""
    policy = OraclePolicy.from_env(env)
    obs, _ = env.reset(seed=seed)
    rewards, masks, wasted = [], [], 0
    while True:
        mask = int(obs["loss_mask"][0])
        masks.append(mask)
        action = policy(obs)
        if mask and wasted < wasted_turns:
            action, wasted = env.unwrapped.grammar.value(0), wasted + 1  # an error block
        obs, reward, terminated, truncated, info = env.step(action)
        rewards.append(reward)
        if terminated or truncated:
            return rewards, masks, terminated, info


@pytest.mark.parametrize("env_id, kwargs, steps, episode_return", IDS)
def test_oracle_solves_the_long_ids(env_id, kwargs, steps, episode_return):
    env = gym.make(env_id)
    assert gym.spec(env_id).kwargs == kwargs
    for seed in range(5):
        rewards, masks, terminated, info = run_oracle(env, seed)
        assert terminated and info["is_success"]
        assert len(rewards) == steps and sum(masks) == 5
        assert rewards[-1] == 1.0 and sum(rewards) == pytest.approx(episode_return)


@pytest.mark.parametrize("env_id, kwargs, steps, episode_return", IDS)
def test_budget_leaves_room_for_two_wasted_turns(env_id, kwargs, steps, episode_return):
    env = gym.make(env_id)
    rewards, masks, terminated, info = run_oracle(env, seed=0, wasted_turns=2)
    assert terminated and info["is_success"]
    assert len(rewards) == steps + 2 * (1 + env.unwrapped.grammar.response_len)
    # The oracle rereads the prompt when it answers (it raises if the window no longer reaches
    # it): the window holds everything up to the closing block.
    assert env.unwrapped.window >= env.unwrapped.max_steps - env.unwrapped.grammar.closing_len


def test_closing64_puts_the_terminal_reward_64_masked_steps_after_the_answer():
    env = gym.make("MaskedRL/ToolUseClosing64-v0")
    rewards, masks, terminated, _ = run_oracle(env, seed=3)
    last_agent_step = max(i for i, m in enumerate(masks) if m)
    assert len(rewards) - 1 - last_agent_step == 64
    assert not any(masks[last_agent_step + 1 :]) and rewards[-1] == 1.0
    assert env.unwrapped.render_mode is None
    closing = gym.make("MaskedRL/ToolUseClosing64-v0", render_mode="ansi")
    run_oracle(closing, seed=3)
    assert closing.unwrapped.render().endswith("[" + " ".join(["<eos>"] * 64) + "]")


def test_long64_has_no_lookup_bonus_and_long256_has_it():
    env64, env256 = gym.make("MaskedRL/ToolUseLong64-v0"), gym.make("MaskedRL/ToolUseLong256-v0")
    rewards64, *_ = run_oracle(env64, seed=1)
    rewards256, *_ = run_oracle(env256, seed=1)
    assert [r for r in rewards64 if r] == [1.0]
    assert [r for r in rewards256 if r] == [0.1, 0.1, 1.0]


@pytest.mark.parametrize("env_id", [env_id for env_id, *_ in IDS])
def test_check_env(env_id):
    check_env(gym.make(env_id, render_mode="ansi").unwrapped)


def test_make_the_long_ids_from_a_fresh_interpreter():
    code = (
        "import gymnasium as gym\n"
        "for name in ('ToolUseClosing64', 'ToolUseLong64', 'ToolUseLong256'):\n"
        "    env = gym.make(f'masked_rl_envs:MaskedRL/{name}-v0')\n"
        "    obs, info = env.reset(seed=0)\n"
        "    print(obs['tokens'].shape[0], env.unwrapped.max_steps)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.split() == ["74", "138", "272", "272", "1040", "1040"]


def test_torchrl_rollout_on_a_long_id():
    env = masked_rl_envs.make_torchrl_env("MaskedRL/ToolUseLong64-v0", num_envs=2, seed=0)
    policy = OraclePolicy.from_id("MaskedRL/ToolUseLong64-v0").as_module()
    td = env.rollout(oracle_steps(64, 4), policy, break_when_any_done=False)
    assert td["tokens"].shape == (2, 140, 272)
    assert td["next", "terminated"][:, -1].all() and td["next", "is_success"][:, -1].all()


def test_kwargs_are_exported():
    assert {"CLOSING64_KWARGS", "LONG64_KWARGS", "LONG256_KWARGS"} <= set(masked_rl_envs.__all__)
    assert ToolUseEnv(**LONG256_KWARGS).grammar.response_len == 256


ALL_IDS = ["MaskedRL/ToolUse-v0", "MaskedRL/ToolUseHard-v0", "MaskedRL/ToolUseClosing64-v0",
           "MaskedRL/ToolUseLong64-v0", "MaskedRL/ToolUseLong256-v0"]


@pytest.mark.parametrize("env_id", ALL_IDS)
def test_ids_registered_with_their_step_budget_as_time_limit(env_id):
    import inspect

    spec = gym.spec(env_id)
    budget = spec.kwargs.get("max_steps", inspect.signature(ToolUseEnv).parameters["max_steps"].default)
    assert spec.max_episode_steps == budget
    env = gym.make(env_id)
    assert isinstance(env, gym.wrappers.TimeLimit) or any(
        isinstance(w, gym.wrappers.TimeLimit) for w in _wrappers(env))
    assert env.unwrapped.max_steps == spec.max_episode_steps


def _wrappers(env):
    while isinstance(env, gym.Wrapper):
        yield env
        env = env.env


@pytest.mark.parametrize("backend", ["gym", "batched"])
def test_episodes_that_never_answer_truncate_at_the_budget_with_an_override(backend):
    """The TimeLimit follows a ``max_steps`` override (it would cut at the id's 80 steps) and
    the gym and batched backends end a never-answering episode at the same step."""
    import torch

    budget = 120
    env = masked_rl_envs.make_torchrl_env("MaskedRL/ToolUse-v0", num_envs=2, backend=backend,
                                          max_steps=budget, seed=0)
    # Action 0 (<pad>) at every agent step: a malformed turn each time, never an answer.
    rollout = env.rollout(budget + 5, lambda td: td.set("action", torch.zeros(td.batch_size, dtype=torch.int64)),
                          break_when_any_done=False)
    done = rollout["next", "done"].squeeze(-1)
    first = done.int().argmax(-1)
    assert done.any(-1).all() and (first + 1).tolist() == [budget, budget]
    assert rollout["next", "truncated"].squeeze(-1)[0, budget - 1]
    assert not rollout["next", "terminated"].squeeze(-1)[0, budget - 1]
