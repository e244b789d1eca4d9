"""Throughput of the environments, and the success rate of a uniformly random policy.

    python -m masked_rl_envs.speed                        # steps/s table, MaskedRL/ToolUse-v0
    python -m masked_rl_envs.speed --random-episodes 100000

Every row steps the environment with uniformly random actions (masked steps included: they
are environment steps too) and reports total environment steps per second of wall time,
startup excluded. TorchRL rows use ``make_torchrl_env`` and ``env.rollout`` without a policy
(``batched``: ``backend="batched"``, :class:`~masked_rl_envs.ToolUseBatchedEnv`).
Collection with the recipe's policy, with and without ``masked_rl.policy.SkipMaskedSteps``, and
where a collector's time goes: ``python -m masked_rl_benchmarks.collector --split``.
"""

from __future__ import annotations

import argparse
import time

import gymnasium as gym
import numpy as np

import masked_rl_envs


def _gym_loop(env_id: str, steps: int) -> tuple[int, float]:
    env = gym.make(env_id)
    env.reset(seed=0)
    env.action_space.seed(0)
    start = time.perf_counter()
    for _ in range(steps):
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        if terminated or truncated:
            env.reset()
    return steps, time.perf_counter() - start


def _vector_loop(env_id: str, steps: int, num_envs: int, mode: str) -> tuple[int, float]:
    envs = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode=mode)
    try:
        envs.reset(seed=0)
        envs.action_space.seed(0)
        envs.step(envs.action_space.sample())  # async: workers warm
        start = time.perf_counter()
        for _ in range(steps // num_envs):
            envs.step(envs.action_space.sample())  # sub-envs auto-reset
        return steps // num_envs * num_envs, time.perf_counter() - start
    finally:
        envs.close()


def _torchrl_rollout(env_id: str, steps: int, **kwargs) -> tuple[int, float]:
    import torch

    torch.manual_seed(0)
    env = masked_rl_envs.make_torchrl_env(env_id, seed=0, **kwargs)
    try:
        batch = max(1, env.batch_size.numel())
        env.rollout(10, break_when_any_done=False)  # warm-up
        start = time.perf_counter()
        env.rollout(steps // batch, break_when_any_done=False)
        return steps // batch * batch, time.perf_counter() - start
    finally:
        env.close()


def random_success_rate(env_id: str, episodes: int, seed: int = 0) -> tuple[int, int]:
    """Successes of a uniformly random policy over ``episodes`` seeded episodes."""
    env = gym.make(env_id).unwrapped  # no wrapper checks: only the count matters here
    rng = np.random.default_rng(seed)
    n = env.action_space.n
    successes = 0
    for episode in range(episodes):
        env.reset(seed=seed + episode)
        done = False
        while not done:
            _, _, terminated, truncated, info = env.step(int(rng.integers(n)))
            done = terminated or truncated
        successes += bool(info["is_success"])
    return successes, episodes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m masked_rl_envs.speed", description=__doc__.split("\n")[0])
    parser.add_argument("--env", default="MaskedRL/ToolUse-v0", help="environment id")
    parser.add_argument("--steps", type=int, default=40_000, help="environment steps per row")
    parser.add_argument(
        "--random-episodes",
        type=int,
        default=0,
        help="instead of the table: measure a random policy's success rate on both ids",
    )
    args = parser.parse_args(argv)

    if args.random_episodes:
        for env_id in ("MaskedRL/ToolUse-v0", "MaskedRL/ToolUseHard-v0"):
            successes, episodes = random_success_rate(env_id, args.random_episodes)
            print(f"{env_id:<26} random policy: {successes}/{episodes} = {successes / episodes:.4%}")
        return

    rows = [
        ("gymnasium.make, 1 env", lambda: _gym_loop(args.env, args.steps)),
        ("gymnasium vector sync, 8 envs", lambda: _vector_loop(args.env, args.steps, 8, "sync")),
        ("gymnasium vector async, 8 envs", lambda: _vector_loop(args.env, args.steps, 8, "async")),
        ("TorchRL GymEnv, 1 env", lambda: _torchrl_rollout(args.env, args.steps // 4)),
        ("TorchRL vector sync, 8 envs", lambda: _torchrl_rollout(args.env, args.steps, num_envs=8)),
        ("TorchRL vector sync, 128 envs", lambda: _torchrl_rollout(args.env, args.steps, num_envs=128)),
        (
            "TorchRL batched, 8 envs",
            lambda: _torchrl_rollout(args.env, args.steps, num_envs=8, backend="batched"),
        ),
        (
            "TorchRL batched, 128 envs",
            lambda: _torchrl_rollout(args.env, args.steps, num_envs=128, backend="batched"),
        ),
        (
            "TorchRL vector async, 8 envs",
            lambda: _torchrl_rollout(args.env, args.steps, num_envs=8, vectorization="async"),
        ),
        ("TorchRL ParallelEnv, 2 workers x 1", lambda: _torchrl_rollout(args.env, args.steps // 4, workers=2)),
        (
            "TorchRL ParallelEnv, 2 workers x 8 sync",
            lambda: _torchrl_rollout(args.env, args.steps, workers=2, num_envs=8),
        ),
    ]
    print(f"{args.env}, uniformly random actions")
    print(f"{'setup':<40} {'steps':>8} {'seconds':>8} {'steps/s':>9}")
    for name, run in rows:
        steps, seconds = run()
        print(f"{name:<40} {steps:>8} {seconds:>8.2f} {steps / seconds:>9.0f}", flush=True)


if __name__ == "__main__":
    main()
