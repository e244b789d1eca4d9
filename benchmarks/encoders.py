"""Cost of the recipe's token-window encoders: the MLP and the attention encoder.

    python -m masked_rl_benchmarks.encoders              # windows 64, 140, 272, 1040
    python -m masked_rl_benchmarks.encoders --windows 1040 --rounds 5

Per window length ``W`` (v0: 64, ToolUseClosing64: 140, ToolUseLong64: 272, ToolUseLong256:
1040) and encoder, the median over ``--rounds`` interleaved rounds of three calls on random
tokens (vocabulary 17), the recipe's sizes (MLP: embed 8, hidden 64, 1 layer; attention:
embed 16, 4 heads, 2 rounds, hidden 64, 1 layer):

- ``16384 windows``: one forward pass without gradients over a 16384-step batch, what a value
  estimator pays per batch for one critic pass (TorchRL's GAE makes two: root and ``"next"``);
- ``collector step``: a forward pass on 10 windows, what the collector pays per step with
  ``SkipMaskedSteps`` (about 7% of 128 environments are at a trainable step on v0);
- ``minibatch``: forward and backward on 256 windows, one PPO gradient step's encoder work.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from masked_rl_examples.ppo_tool_use.encoders import AttentionWindowEncoder
from masked_rl_examples.ppo_tool_use.utils import TokenWindowEncoder

VOCAB = 17


def encoders(window: int) -> dict[str, torch.nn.Module]:
    return {
        "mlp": TokenWindowEncoder(VOCAB, window, 8, 64, 1),
        "attention": AttentionWindowEncoder(VOCAB, window, 16, 64, 1),
    }


def _seconds(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def measure(window: int, rounds: int, seed: int = 0) -> dict[str, dict[str, float]]:
    """``{encoder: {"16384 windows": s, "collector step": s, "minibatch": s}}``, medians."""
    torch.manual_seed(seed)
    models = encoders(window)
    batch, step, minibatch = (torch.randint(VOCAB, (n, window)) for n in (16384, 10, 256))

    @torch.no_grad()
    def estimate(model):
        model(batch)

    @torch.no_grad()
    def collect(model):
        for _ in range(20):
            model(step)

    def train(model):
        model.zero_grad()
        model(minibatch).sum().backward()

    calls = {"16384 windows": estimate, "collector step": collect, "minibatch": train}
    samples = {name: {call: [] for call in calls} for name in models}
    order = [(name, call) for name in models for call in calls]
    for name, call in order:  # warm-up
        calls[call](models[name])
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for name, call in order:
            seconds = _seconds(lambda: calls[call](models[name]))
            samples[name][call].append(seconds / (20 if call == "collector step" else 1))
    return {name: {call: statistics.median(v) for call, v in by_call.items()}
            for name, by_call in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m masked_rl_benchmarks.encoders",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, nargs="+", default=[64, 140, 272, 1040])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.threads < 1 or min(args.windows) < 1:
        parser.error("--rounds, --threads and --windows must be >= 1")
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.threads} torch thread(s), load average {load:.1f} on {os.cpu_count()} cores")
    print(f"{'W':>5} {'encoder':<10} {'16384 windows (ms)':>19} {'collector step (us)':>20} "
          f"{'minibatch 256 fwd+bwd (ms)':>27}")
    for window in args.windows:
        for name, t in measure(window, args.rounds).items():
            print(f"{window:>5} {name:<10} {t['16384 windows'] * 1e3:>19.1f} "
                  f"{t['collector step'] * 1e6:>20.0f} {t['minibatch'] * 1e3:>27.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
