"""Collection speed of the PPO recipe: a TorchRL ``Collector`` over the gymnasium stack or the
batched tensor env, with and without ``SkipMaskedSteps``.

    python -m masked_rl_benchmarks.collector                  # frames/s table, v0 and the long ids
    python -m masked_rl_benchmarks.collector --split          # and where each batch's time goes
    python -m masked_rl_benchmarks.collector --envs MaskedRL/ToolUseLong256-v0 --batches 5
    python -m masked_rl_benchmarks.collector --backends batched --tokens-dtype int32

The recipe's shape: ``make_torchrl_env(env_id, num_envs=128, backend=...)`` (``gym``: a
synchronous gymnasium vector env of ``ToolUseEnv`` under TorchRL's ``GymWrapper``; ``batched``:
:class:`masked_rl_envs.ToolUseBatchedEnv`, tokens stored as ``--tokens-dtype``), batches of
16384 frames, the recipe's shared MLP actor (``make_actor_critic`` with its default sizes),
random exploration. Per environment id, one collector per backend and policy (the actor on
every step; the actor wrapped in :class:`masked_rl.policy.SkipMaskedSteps`) take turns, one
batch each per round, after one warm-up batch each; the table gives the median frames per
second over the rounds and the ratio of each to the gym backend with the same policy.
``--split`` times each batch's parts with wrappers around the calls (a microsecond or so per
call): the policy, TorchRL's ``step_and_maybe_reset`` (everything environment-side), within it
the environment proper (the gymnasium vector env's ``step``, or ``ToolUseBatchedEnv._step`` and
``_reset``), and within the vector env every ``ToolUseEnv.step`` and ``reset``; the
collector's own work (policy input and output plumbing, stacking the batch) is the rest.
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
BACKENDS = ("gym", "batched")
TOKENS_DTYPES = {"int64": torch.int64, "int32": torch.int32}  # what nn.Embedding takes
ENV_PART = "env (gym vector step | batched _step + _reset)"
PARTS = ("batch", "policy", "TorchRL step_and_maybe_reset", ENV_PART, "ToolUseEnv.step + reset")


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


def _collector(env_id, actor, backend, policy, args, timer=None):
    kwargs = {"tokens_dtype": TOKENS_DTYPES[args.tokens_dtype]} if backend == "batched" else {}
    env = make_torchrl_env(env_id, num_envs=args.num_envs, backend=backend, seed=args.seed, **kwargs)
    policy = SkipMaskedSteps(actor) if policy == "SkipMaskedSteps" else actor
    collector = Collector(env, policy, frames_per_batch=args.frames_per_batch, total_frames=-1,
                          auto_register_policy_transforms=False)
    collector.set_seed(args.seed)
    if timer is not None:  # instance attributes: what the collector, GymWrapper and EnvBase call
        env.step_and_maybe_reset = timer.wrap("TorchRL step_and_maybe_reset", env.step_and_maybe_reset)
        if backend == "gym":
            env._env.step = timer.wrap(ENV_PART, env._env.step)
        else:
            env._step = timer.wrap(ENV_PART, env._step)
            env._reset = timer.wrap(ENV_PART, env._reset)
        collector._wrapped_policy.forward = timer.wrap("policy", collector._wrapped_policy.forward)
    return collector, iter(collector)


def measure(env_id, args):
    """``{(backend, policy): [frames/s per round]}``, with ``--split``
    ``{(backend, policy): {part: s/batch}}``, and the fraction of trainable steps."""
    torch.manual_seed(args.seed)
    cfg = Config()
    probe = make_torchrl_env(env_id, seed=args.seed)
    actor, _ = make_actor_critic(probe, cfg.embed_dim, cfg.hidden, cfg.layers, cfg.shared)
    probe.close()
    configs = [(backend, policy) for backend in args.backends for policy in args.policies]
    timers = {config: _Timer() for config in configs}
    # One copy of the actor per collector (same weights), so each timer sees its own calls.
    collectors = {
        config: _collector(env_id, copy.deepcopy(actor), *config, args,
                           timers[config] if args.split else None)
        for config in configs
    }
    fps = {config: [] for config in configs}
    trainable = []
    try:
        for config, (_, iterator) in collectors.items():  # warm-up batch
            next(iterator)
            timers[config].seconds.clear()
        for _ in range(args.batches):
            for config, (_, iterator) in collectors.items():
                timed_gym = args.split and config[0] == "gym"
                with _timed_tool_use_env(timers[config]) if timed_gym else nullcontext():
                    start = time.perf_counter()
                    batch = next(iterator)
                    seconds = time.perf_counter() - start
                timers[config].seconds["batch"] += seconds
                fps[config].append(batch.numel() / seconds)
                trainable.append(batch["loss_mask"].float().mean().item())
    finally:
        for collector, _ in collectors.values():
            collector.shutdown()
    split = {config: {part: s / args.batches for part, s in timer.seconds.items()}
             for config, timer in timers.items()}
    return fps, split, statistics.mean(trainable)


def _parser():
    parser = argparse.ArgumentParser(prog="python -m masked_rl_benchmarks.collector",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--envs", nargs="+", default=list(ENV_IDS), help="environment ids")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                        help="make_torchrl_env backends")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                        help="the actor on every step, or wrapped in SkipMaskedSteps")
    parser.add_argument("--tokens-dtype", choices=list(TOKENS_DTYPES), default="int64",
                        help="dtype of the batched env's tokens")
    parser.add_argument("--num-envs", type=int, default=128, help="environments per collector")
    parser.add_argument("--frames-per-batch", type=int, default=16384, help="frames per batch")
    parser.add_argument("--batches", type=int, default=3, help="timed batches per collector")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0, help="seed of torch and the environments")
    parser.add_argument("--split", action="store_true", help="also print where each batch's time goes")
    return parser


def _name(config):
    backend, policy = config
    return f"{backend}, {policy}"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for name in ("num_envs", "frames_per_batch", "batches", "threads"):
        if getattr(args, name) < 1:
            _parser().error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.frames_per_batch % args.num_envs:
        _parser().error(f"--frames-per-batch ({args.frames_per_batch}) must be a multiple of "
                        f"--num-envs ({args.num_envs})")
    args.backends = list(dict.fromkeys(args.backends))
    args.policies = list(dict.fromkeys(args.policies))
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.num_envs} envs x {args.frames_per_batch // args.num_envs} steps per batch, "
          f"{args.batches} timed batches per collector, {args.threads} torch thread(s), "
          f"batched tokens {args.tokens_dtype}, load average {load:.1f} on {os.cpu_count()} cores")
    configs = [(backend, policy) for backend in args.backends for policy in args.policies]
    print(f"{'environment':<20} {'trainable':>9}  {'collector':<34} {'frames/s':>10} {'x gym':>6}")
    splits = []
    for env_id in args.envs:
        fps, split, trainable = measure(env_id, args)
        median = {config: statistics.median(fps[config]) for config in configs}
        for backend, policy in configs:
            # The speed-up over the gymnasium stack with the same policy.
            gym = median.get(("gym", policy))
            ratio = f"{median[backend, policy] / gym:>6.2f}" if gym else f"{'':>6}"
            print(f"{env_id.removeprefix('MaskedRL/'):<20} {trainable:>9.1%}  "
                  f"{_name((backend, policy)):<34} {median[backend, policy]:>8.0f}/s {ratio}".rstrip(),
                  flush=True)
        splits.append((env_id, split))
    if args.split:
        print("\nseconds per batch (mean over the timed batches):")
        print(f"{'environment':<20} {'collector':<34} " + " ".join(f"{p[:22]:>22}" for p in PARTS)
              + f" {'collector (rest)':>17}")
        for env_id, split in splits:
            for config in configs:
                s = split[config]
                rest = s["batch"] - s["policy"] - s["TorchRL step_and_maybe_reset"]
                print(f"{env_id.removeprefix('MaskedRL/'):<20} {_name(config):<34} "
                      + " ".join(f"{s.get(p, 0.0):>22.3f}" for p in PARTS) + f" {rest:>17.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
