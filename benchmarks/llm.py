"""``masked-rl llm-bench``: one token-level PPO iteration (each critic) against one GRPO iteration.

Both on the chat tool-use task with the recipe's model and batch (``masked-rl llm-train``'s
defaults unless overridden): rollout (generation on TorchRL's ``ChatEnv``), scoring pass,
estimate, update (``--epochs`` passes of minibatch steps). Reported per phase, in sampled tokens
per second of the whole iteration, and the estimator's share: for PPO the adapter
(``transcript_steps``), the critic's no-grad forward and ``MaskedGAE`` itself; for GRPO the
group-relative advantage. A table on stdout, ``llm_bench.csv`` and ``llm_bench.json`` in
``--out``.

Options are parsed without importing torch (``--help`` and errors come back at once).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

from masked_rl_examples.ppo_tool_use.config import (OneLineErrorParser, check_device,
                                                    check_writable_folder)

VARIANTS = {
    "ppo, shared critic": dict(estimator="masked", critic="shared"),
    "ppo, separate critic": dict(estimator="masked", critic="separate"),
    "grpo": dict(estimator="grpo"),
}
"""The iterations compared: masked-GAE PPO with each critic of ``masked-rl llm-train``
(``--critic shared``: a value head on the policy's trunk; ``separate``: a second model of the
policy's size) and TorchRL's GRPOLoss."""
PHASES = ("rollout", "score", "estimate", "update")


def parse_llm_bench_args(argv=None, prog=None) -> argparse.Namespace:
    parser = OneLineErrorParser(prog=prog, description=__doc__.split("\n\n")[1].replace("\n", " "))
    parser.add_argument("--episodes", type=int, default=64,
                        help="episodes per iteration (default: 64, llm-train's batch)")
    parser.add_argument("--iterations", type=int, default=3,
                        help="timed iterations per estimator, after one untimed (default: 3)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="update passes per iteration (default: llm-train's)")
    parser.add_argument("--hidden-size", type=int, default=None,
                        help="model width (default: llm-train's)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (default: cpu)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default: 1, as llm-train)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench_results"),
                        help="folder for llm_bench.csv and llm_bench.json (default: bench_results)")
    args = parser.parse_args(argv)
    for name in ("episodes", "iterations", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    for name in ("epochs", "hidden_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.episodes % 8:
        parser.error(f"--episodes must be a multiple of 8 (GRPO's group size), got {args.episodes}")
    try:
        check_device(args.device)
        check_writable_folder("--out", args.out)
    except ValueError as err:
        parser.error(str(err))
    return args


def _sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _iteration(cfg, parts, env, generator) -> dict:
    """One timed iteration: seconds per phase and the estimator's breakdown."""
    import torch

    from masked_rl.llm import transcript_steps
    from masked_rl_examples.llm_ppo.estimators import group_relative_advantage
    from masked_rl_examples.llm_ppo.llm_ppo import update
    from masked_rl_examples.llm_ppo.rollout import rollout, score

    tokenizer, model, wrappers, estimator, optimizer = parts
    times = {}
    clock = time.perf_counter
    start = clock()
    batch = rollout(env, wrappers.sample, tokenizer.pad_token_id)
    _sync(cfg.device)
    times["rollout"] = clock() - start
    start = clock()
    data = score(wrappers.score, batch.history)
    _sync(cfg.device)
    times["score"] = clock() - start
    start = clock()
    estimator.prepare(data, batch)
    _sync(cfg.device)
    times["estimate"] = clock() - start
    start = clock()
    update(estimator, optimizer, data, cfg, generator)
    _sync(cfg.device)
    times["update"] = clock() - start
    # The estimator's parts, timed again on the same batch (prepare runs them in one call).
    with torch.no_grad():
        if cfg.estimator == "masked":
            start = clock()
            steps = transcript_steps(data, terminated=batch.terminated,
                                     turn_reward=batch.turn_rewards, mode="history",
                                     end_of_turn_token_id=tokenizer.eos_token_id)
            _sync(cfg.device)
            times["adapter"] = clock() - start
            start = clock()
            value, next_value = estimator.critic(steps["tokens"], steps["attention_mask"])
            _sync(cfg.device)
            times["critic"] = clock() - start
            steps["state_value"], steps["next", "state_value"] = value, next_value
            start = clock()
            estimator.gae(steps)
            _sync(cfg.device)
            times["advantage"] = clock() - start
        else:
            start = clock()
            group_relative_advantage(batch.returns, cfg.group_size)
            times["advantage"] = clock() - start
    times["tokens"] = batch.sampled_tokens
    times["transcript_tokens"] = int(data["masks", "all_attention_mask"].sum())
    return times


def run(args: argparse.Namespace) -> int:
    import torch

    from masked_rl_envs.chat_tool_use import make_chat_tool_use_env
    from masked_rl_examples.llm_ppo.config import LLMConfig
    from masked_rl_examples.llm_ppo.llm_ppo import build, task_config

    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"masked-rl llm-bench: {os.cpu_count()} CPUs, load average {load:.1f} before the run, "
          f"device {args.device}, {args.threads} thread(s)", file=sys.stderr)
    rows = []
    for label, variant in VARIANTS.items():
        overrides = {**variant, "episodes_per_batch": args.episodes, "seed": args.seed,
                     "device": args.device}
        if args.epochs is not None:
            overrides["epochs"] = args.epochs
        if args.hidden_size is not None:
            overrides["hidden_size"] = args.hidden_size
        cfg = LLMConfig(**overrides)
        torch.manual_seed(cfg.seed)
        parts = build(cfg)
        env = make_chat_tool_use_env(cfg.episodes_per_batch, task_config(cfg),
                                     tokenizer=parts[0], seed=cfg.seed,
                                     group_size=cfg.batch_group_size)
        generator = torch.Generator().manual_seed(cfg.seed)
        _iteration(cfg, parts, env, generator)  # warm-up: first calls compile and allocate
        measured = [_iteration(cfg, parts, env, generator) for _ in range(args.iterations)]
        row = {"iteration": label, "episodes": args.episodes, "device": args.device}
        for key in measured[0]:
            row[key] = sum(m[key] for m in measured) / len(measured)
        row["iteration_s"] = sum(row[p] for p in PHASES)
        row["tokens_per_s"] = row["tokens"] / row["iteration_s"]
        row["estimator_share"] = row["advantage"] / row["iteration_s"]
        rows.append(row)
    print(_table(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    fields = sorted({k for row in rows for k in row}, key=lambda k: list(rows[0]).index(k)
                    if k in rows[0] else len(rows[0]))
    with open(args.out / "llm_bench.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    (args.out / "llm_bench.json").write_text(json.dumps(dict(
        rows=rows, load_average_before=load, cpus=os.cpu_count(),
        args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}),
        indent=1))
    return 0


def _table(rows: list[dict]) -> str:
    head = (f"{'iteration':<21} {'tokens/s':>9} {'iter s':>7} {'rollout':>8} {'score':>7} "
            f"{'estimate':>9} {'update':>7} {'GAE/adv. ms':>12} {'share':>7}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['iteration']:<21} {r['tokens_per_s']:>9.0f} {r['iteration_s']:>7.2f} "
                     f"{r['rollout']:>8.2f} {r['score']:>7.2f} {r['estimate']:>9.3f} "
                     f"{r['update']:>7.2f} {1e3 * r['advantage']:>12.2f} "
                     f"{r['estimator_share']:>7.2%}")
    for ppo in (r for r in rows if r["iteration"].startswith("ppo")):
        lines.append(f"{ppo['iteration']}: estimate = adapter {1e3 * ppo['adapter']:.1f} ms + "
                     f"critic forward {1e3 * ppo['critic']:.1f} ms + MaskedGAE "
                     f"{1e3 * ppo['advantage']:.2f} ms; sampled tokens per iteration: "
                     f"{ppo['tokens']:.0f} (transcripts {ppo['transcript_tokens']:.0f} tokens)")
    return "\n".join(lines)
