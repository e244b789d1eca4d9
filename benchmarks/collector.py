"""Collection speed of the PPO recipe: a TorchRL ``Collector`` with and without ``SkipMaskedSteps``.

    python -m masked_rl_benchmarks.collector                  # frames/s table, v0 and the long ids
    python -m masked_rl_benchmarks.collector --split          # and where each batch's time goes
    python -m masked_rl_benchmarks.collector --envs MaskedRL/ToolUseLong256-v0 --batches 5

The recipe's shape: ``make_torchrl_env(env_id, num_envs=128, vectorization="sync")``, batches
of 16384 frames, the recipe's shared MLP actor (``make_actor_critic`` with its default sizes),
random exploration. Per environment id, the two collectors (the actor on every step; the actor
wrapped in :class:`masked_rl.policy.SkipMaskedSteps`) take turns, one batch each per round, after
one warm-up batch each; the table gives the median frames per second over the rounds and its
ratio. ``--split`` times each batch's parts with wrappers around the calls (a microsecond or
so per call): the policy, TorchRL's ``step_and_maybe_reset`` (everything environment-side),
within it the gymnasium vector env's ``step``, and within that every ``ToolUseEnv.step`` and
``reset``; the collector's own work is the rest of the batch.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch
from torchrl.collectors import Collector

from masked_rl.policy import SkipMaskedSteps
from masked_rl_envs import ToolUseEnv, make_torchrl_env
from masked_rl_examples.ppo_tool_use.config import Config
from masked_rl_examples.ppo_tool_use.utils import make_actor_critic

ENV_IDS = ("MaskedRL/ToolUse-v0", "MaskedRL/ToolUseLong64-v0", "MaskedRL/ToolUseLong256-v0")
POLICIES = ("every step", "SkipMaskedSteps")


class _Timer:
    """Seconds spent in the wrapped calls, per name."""

    def __init__(self):
        self.seconds = defaultdict(float)

    def wrap(self, name, function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed


@contextmanager
def _timed_tool_use_env(timer):
    """Time every ``ToolUseEnv.step`` and ``reset`` (class attributes, restored on exit)."""
    original = ToolUseEnv.step, ToolUseEnv.reset
    ToolUseEnv.step = timer.wrap("ToolUseEnv.step + reset", original[0])
    ToolUseEnv.reset = timer.wrap("ToolUseEnv.step + reset", original[1])
    try:
        yield
    finally:
        ToolUseEnv.step, ToolUseEnv.reset = original


def _collector(env_id, actor, wrap, args, timer=None):
    env = make_torchrl_env(env_id, num_envs=args.num_envs, vectorization="sync", seed=args.seed)
    policy = SkipMaskedSteps(actor) if wrap else actor
    collector = Collector(env, policy, frames_per_batch=args.frames_per_batch, total_frames=-1,
                          auto_register_policy_transforms=False)
    collector.set_seed(args.seed)
    if timer is not None:  # instance attributes: what the collector and GymWrapper call
        env.step_and_maybe_reset = timer.wrap("TorchRL step_and_maybe_reset", env.step_and_maybe_reset)
        env._env.step = timer.wrap("gymnasium vector step", env._env.step)
        collector._wrapped_policy.forward = timer.wrap("policy", collector._wrapped_policy.forward)
    return collector, iter(collector)


def measure(env_id, args):
    """``{policy name: [frames/s per round]}`` and, with ``--split``, ``{policy: {part: s/batch}}``."""
    torch.manual_seed(args.seed)
    cfg = Config()
    probe = make_torchrl_env(env_id, seed=args.seed)
    actor, _ = make_actor_critic(probe, cfg.embed_dim, cfg.hidden, cfg.layers, cfg.shared)
    probe.close()
    timers = {name: _Timer() for name in POLICIES}
    # One copy of the actor per collector (same weights), so each timer sees its own calls.
    collectors = {
        name: _collector(env_id, copy.deepcopy(actor), name == "SkipMaskedSteps", args,
                         timers[name] if args.split else None)
        for name in POLICIES
    }
    fps = {name: [] for name in POLICIES}
    trainable = []
    try:
        for name, (_, iterator) in collectors.items():  # warm-up batch
            next(iterator)
            timers[name].seconds.clear()
        for _ in range(args.batches):
            for name, (_, iterator) in collectors.items():
                with _timed_tool_use_env(timers[name]) if args.split else nullcontext():
                    start = time.perf_counter()
                    batch = next(iterator)
                    seconds = time.perf_counter() - start
                timers[name].seconds["batch"] += seconds
                fps[name].append(batch.numel() / seconds)
                trainable.append(batch["loss_mask"].float().mean().item())
    finally:
        for collector, _ in collectors.values():
            collector.shutdown()
    split = {name: {part: s / args.batches for part, s in timer.seconds.items()}
             for name, timer in timers.items()}
    return fps, split, statistics.mean(trainable)


def _parser():
    parser = argparse.ArgumentParser(prog="python -m masked_rl_benchmarks.collector",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--envs", nargs="+", default=list(ENV_IDS), help="environment ids")
    parser.add_argument("--num-envs", type=int, default=128, help="environments per collector")
    parser.add_argument("--frames-per-batch", type=int, default=16384, help="frames per batch")
    parser.add_argument("--batches", type=int, default=3, help="timed batches per collector")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0, help="seed of torch and the environments")
    parser.add_argument("--split", action="store_true", help="also print where each batch's time goes")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for name in ("num_envs", "frames_per_batch", "batches", "threads"):
        if getattr(args, name) < 1:
            _parser().error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.frames_per_batch % args.num_envs:
        _parser().error(f"--frames-per-batch ({args.frames_per_batch}) must be a multiple of "
                        f"--num-envs ({args.num_envs})")
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.num_envs} envs x {args.frames_per_batch // args.num_envs} steps per batch, "
          f"{args.batches} timed batches per policy, {args.threads} torch thread(s), "
          f"load average {load:.1f} on {os.cpu_count()} cores")
    header = f"{'environment':<28} {'trainable':>9} {'every step':>12} {'SkipMaskedSteps':>16} {'ratio':>6}"
    rows, splits = [], []
    for env_id in args.envs:
        fps, split, trainable = measure(env_id, args)
        plain, skip = (statistics.median(fps[name]) for name in POLICIES)
        rows.append(f"{env_id.removeprefix('MaskedRL/'):<28} {trainable:>9.1%} {plain:>10.0f}/s "
                    f"{skip:>14.0f}/s {skip / plain:>6.2f}")
        print(rows[-1], flush=True)
        splits.append((env_id, split))
    if args.split:
        print("\nseconds per batch (mean over the timed batches):")
        parts = ["batch", "policy", "TorchRL step_and_maybe_reset", "gymnasium vector step",
                 "ToolUseEnv.step + reset"]
        print(f"{'environment':<28} {'policy':<16} " + " ".join(f"{p[:22]:>22}" for p in parts)
              + f" {'collector (rest)':>17}")
        for env_id, split in splits:
            for name in POLICIES:
                s = split[name]
                rest = s["batch"] - s["policy"] - s["TorchRL step_and_maybe_reset"]
                print(f"{env_id.removeprefix('MaskedRL/'):<28} {name:<16} "
                      + " ".join(f"{s.get(p, 0.0):>22.3f}" for p in parts) + f" {rest:>17.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
