"""Masked GAE against TorchRL's plain GAE: the same PPO recipe, seeds and budget.

Both arms run :func:`~masked_rl_examples.ppo_tool_use.ppo_tool_use.train` with identical
settings (losses over trainable steps only, TorchRL's default ``gamma=0.99, lmbda=0.95``,
every other hyper-parameter from :class:`~masked_rl_examples.ppo_tool_use.config.Config`);
only the value estimator differs. Runs go to ``--jobs`` worker processes. Output, under
``--output``: one run folder per (estimator, seed), ``summary.csv`` (one row per run),
``curves.csv`` (greedy success at every evaluation) and ``curves.png``.
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from pathlib import Path

import tqdm

from masked_rl_examples.ppo_tool_use.config import Config, add_config_arguments
from masked_rl_examples.ppo_tool_use.ppo_tool_use import SUCCESS_THRESHOLD, train

ESTIMATORS = ("masked", "plain")
DEFAULT_FRAMES = 1_400_000
"""Frames per run of ``masked-rl compare`` (6 runs on 2 cores in under 15 minutes)."""


def _train_quietly(cfg: Config) -> dict:
    return train(cfg)


def run_all(base: Config, seeds: list[int], jobs: int) -> list[dict]:
    """Train every (estimator, seed) pair; returns their summaries, in a fixed order."""
    configs = [replace(base, estimator=e, seed=s) for s in seeds for e in ESTIMATORS]
    if jobs == 1:
        return [train(cfg) for cfg in tqdm.tqdm(configs, unit="run", desc="compare")]
    summaries = {}
    # spawn: a fresh interpreter per worker (forking a process that holds torch threads and
    # collector state is fragile).
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = {pool.submit(_train_quietly, cfg): i for i, cfg in enumerate(configs)}
        for future in tqdm.tqdm(as_completed(futures), total=len(futures), unit="run",
                                desc="compare"):
            summaries[futures[future]] = future.result()
    return [summaries[i] for i in range(len(configs))]


def _fmt_frames(frames: int | None) -> str:
    return "never" if frames is None else f"{frames:,}"


def table(summaries: list[dict]) -> str:
    """Per-run rows, then one mean row per estimator."""
    pct = f"{SUCCESS_THRESHOLD:.0%}"
    header = f"| estimator | seed | final greedy success | frames to {pct} | wall time (s) |"
    lines = [header, "|---|---:|---:|---:|---:|"]
    for s in summaries:
        cfg = s["config"]
        lines.append(
            f"| {cfg['estimator']} | {cfg['seed']} | {s['final_success_rate']:.1%} | "
            f"{_fmt_frames(s['frames_to_threshold'])} | {s['wall_time_s']:.0f} |"
        )
    for estimator in ESTIMATORS:
        runs = [s for s in summaries if s["config"]["estimator"] == estimator]
        if not runs:
            continue
        success = [s["final_success_rate"] for s in runs]
        reached = [s["frames_to_threshold"] for s in runs if s["frames_to_threshold"] is not None]
        spread = f" ± {statistics.stdev(success):.1%}" if len(success) > 1 else ""
        frames = (
            f"{statistics.mean(reached):,.0f} ({len(reached)}/{len(runs)} runs)" if reached
            else f"never (0/{len(runs)} runs)"
        )
        wall = statistics.mean(s["wall_time_s"] for s in runs)
        lines.append(
            f"| **{estimator} (mean)** | {len(runs)} seeds | {statistics.mean(success):.1%}"
            f"{spread} | {frames} | {wall:.0f} |"
        )
    return "\n".join(lines)


def write_csvs(summaries: list[dict], output: Path) -> tuple[Path, Path]:
    summary_path, curves_path = output / "summary.csv", output / "curves.csv"
    with summary_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["estimator", "seed", "frames", "final_success_rate",
                         "frames_to_threshold", "success_threshold", "wall_time_s", "run_dir"])
        for s in summaries:
            writer.writerow([s["config"]["estimator"], s["config"]["seed"], s["frames"],
                             s["final_success_rate"], s["frames_to_threshold"] or "",
                             s["success_threshold"], round(s["wall_time_s"], 1), s["run_dir"]])
    with curves_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["estimator", "seed", "frames", "success_rate", "wall_time_s"])
        for s in summaries:
            for point in s["history"]:
                writer.writerow([s["config"]["estimator"], s["config"]["seed"], point["frames"],
                                 point["success_rate"], round(point["wall_time_s"], 1)])
    return summary_path, curves_path


def plot(summaries: list[dict], path: Path, env_id: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"masked": "tab:blue", "plain": "tab:orange"}
    for estimator in ESTIMATORS:
        runs = [s for s in summaries if s["config"]["estimator"] == estimator]
        for i, s in enumerate(runs):
            frames = [p["frames"] for p in s["history"]]
            success = [p["success_rate"] for p in s["history"]]
            label = f"{estimator} GAE ({len(runs)} seeds)" if i == 0 else None
            ax.plot(frames, success, color=colors[estimator], alpha=0.8, label=label)
    ax.axhline(SUCCESS_THRESHOLD, color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("environment frames (masked steps included)")
    ax.set_ylabel("greedy success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"PPO on {env_id}: masked vs plain GAE")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="PPO with masked GAE vs TorchRL's plain GAE over several seeds: a table, "
        "summary.csv, curves.csv and curves.png. Every training option of `train` applies "
        "to both arms.",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="seeds, each trained with both estimators (default: 0 1 2)")
    parser.add_argument("--jobs", type=int, default=2,
                        help="runs trained in parallel processes (default: 2)")
    defaults = Config(frames=DEFAULT_FRAMES, output="runs/compare", progress_bar=False)
    add_config_arguments(parser, defaults, skip=("estimator", "seed"))
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    options = {k: v for k, v in vars(args).items() if k not in ("seeds", "jobs")}
    if args.jobs > 1 and not options["threads"]:
        options["threads"] = 1  # one torch thread per run: the runs share the cores
    try:
        base = Config(**options)
    except ValueError as err:
        parser.error(str(err))

    output = Path(base.output)
    output.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    summaries = run_all(base, args.seeds, args.jobs)
    wall = time.perf_counter() - start
    summary_path, curves_path = write_csvs(summaries, output)
    png = plot(summaries, output / "curves.png", base.env)
    print(f"\nPPO on {base.env}, {base.frames:,} frames per run, gamma={base.gamma}, "
          f"lmbda={base.lmbda}, seeds {' '.join(map(str, args.seeds))}:\n")
    print(table(summaries))
    print(f"\nTotal wall time {wall:.0f} s ({args.jobs} parallel jobs). "
          f"Wrote {summary_path}, {curves_path} and {png}.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
