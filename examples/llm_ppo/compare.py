"""``masked-rl llm-compare``: masked PPO vs GRPO vs plain token GAE, same model, seeds and budget.

One run per (estimator, seed), one after the other (each run uses one torch thread by default;
the machine's other core keeps the generation responsive), in ``<output>/<estimator>-seed<seed>``.
A finished run (its ``summary.json`` says ``completed`` with the asked budget) is skipped, an
interrupted one resumed, so re-running the same command continues a comparison. Writes
``summary.csv`` (one row per run), ``curves.csv`` (greedy success per evaluation) and
``curves.png`` in ``--output`` and prints a table; ``--report`` writes them from the runs the
folder holds without training.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from masked_rl_examples.ppo_tool_use import utils as classic_utils

from .config import CHECKPOINT_FILE, SUMMARY_FILE, LLMCompareCommand, LLMConfig, changed_options
from .llm_ppo import SUCCESS_THRESHOLD, train

SUMMARY_COLUMNS = ("estimator", "seed", "status", "final_success_rate", "tokens_to_threshold",
                   "time_to_threshold_s", "tokens", "episodes", "wall_time_s")


def plan(cfg: LLMConfig) -> tuple[str, dict | None]:
    """``("done", summary)``, ``("resume", summary or None)`` or ``("fresh", None)`` for
    ``cfg``'s run; a resumed run's summary is that of its interruption, or of a smaller budget.

    Raises ValueError where the folder holds a run made with other options (those its
    estimator reads): its results are not ``cfg``'s.
    """
    run_dir = cfg.run_dir()
    summary_path = run_dir / SUMMARY_FILE
    summary = None
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        changed = changed_options(LLMConfig(**summary["config"]), cfg)
        if changed:
            raise ValueError(f"{str(run_dir)!r} holds a run made with other options "
                             f"({', '.join(changed)} differ): choose another --output")
        if summary["status"] == "completed" and summary["tokens"] >= cfg.tokens:
            return "done", summary
    if (run_dir / CHECKPOINT_FILE).is_file():
        return "resume", summary
    return "fresh", None


def _csv(header, rows) -> str:
    lines = [",".join(header)]
    lines += [",".join("" if v is None else str(v) for v in row) for row in rows]
    return "\n".join(lines) + "\n"


def write_outputs(summaries: list[dict], output: Path) -> tuple[Path, Path, Path]:
    output.mkdir(parents=True, exist_ok=True)
    rows = [[s["config"]["estimator"], s["config"]["seed"]] + [s[c] for c in SUMMARY_COLUMNS[2:]]
            for s in summaries]
    summary_csv = output / "summary.csv"
    classic_utils.write_text_atomically(_csv(SUMMARY_COLUMNS, rows), summary_csv)
    curve_rows = [[s["config"]["estimator"], s["config"]["seed"], h["tokens"], h["episodes"],
                   h["success_rate"], h["wall_time_s"]] for s in summaries for h in s["history"]]
    curves_csv = output / "curves.csv"
    classic_utils.write_text_atomically(
        _csv(("estimator", "seed", "tokens", "episodes", "success_rate", "wall_time_s"),
             curve_rows), curves_csv)
    return summary_csv, curves_csv, plot(summaries, output / "curves.png")


def plot(summaries: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    estimators = list(dict.fromkeys(s["config"]["estimator"] for s in summaries))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, estimator in zip(colors, estimators):
        runs = [s for s in summaries if s["config"]["estimator"] == estimator]
        for i, s in enumerate(runs):
            ax.plot([h["tokens"] for h in s["history"]],
                    [h["success_rate"] for h in s["history"]], color=color, alpha=0.8,
                    label=f"{estimator} ({len(runs)} seeds)" if i == 0 else None)
    ax.axhline(SUCCESS_THRESHOLD, color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("sampled tokens")
    ax.set_ylabel("greedy success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Chat tool-use task, tiny Llama from scratch: " + " vs ".join(estimators))
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    fig.savefig(temporary, dpi=120)
    plt.close(fig)
    os.replace(temporary, path)
    return path


def table(summaries: list[dict]) -> str:
    """One line per estimator: runs reaching the threshold, median tokens and time to it, final
    greedy success (mean, min)."""
    lines = [f"{'estimator':<10} {'solved':>7} {'tokens to 90% (median)':>23} "
             f"{'time to 90% (median)':>21} {'final success mean/min':>23}"]
    for estimator in dict.fromkeys(s["config"]["estimator"] for s in summaries):
        runs = [s for s in summaries if s["config"]["estimator"] == estimator]
        solved = [s for s in runs if s["tokens_to_threshold"] is not None]
        tokens = (f"{statistics.median(s['tokens_to_threshold'] for s in solved):,.0f}"
                  if solved else "never")
        seconds = (f"{statistics.median(s['time_to_threshold_s'] for s in solved):.0f} s"
                   if solved else "-")
        finals = [s["final_success_rate"] for s in runs]
        lines.append(f"{estimator:<10} {len(solved):>3}/{len(runs):<3} {tokens:>23} {seconds:>21} "
                     f"{statistics.mean(finals):>15.1%} / {min(finals):.1%}")
    return "\n".join(lines)


def report(command: LLMCompareCommand) -> int:
    """``--report``: the outputs from the runs already in the folder; nothing is trained."""
    summaries, missing, unfinished = [], [], []
    for estimator in command.estimators:
        for seed in command.seeds:
            cfg = replace(command.base, estimator=estimator, seed=seed)
            state, summary = plan(cfg)
            name = f"{estimator}-seed{seed}"
            if state == "done":
                summaries.append(summary)
            elif state == "resume":  # left out: its figures are not those of the asked budget
                reached = (f"{summary['tokens']:,} of {cfg.tokens:,} tokens" if summary
                           else "a checkpoint, no summary")
                unfinished.append(f"{name} ({reached})")
            else:
                missing.append(name)
    left_out = classic_utils.runs_left_out(unfinished, missing)
    if not summaries:
        print(f"masked-rl llm-compare: error: {command.base.output!r} holds no finished run of "
              f"this comparison (nothing to report{''.join('; ' + line for line in left_out)})",
              file=sys.stderr)
        return 2
    paths = write_outputs(summaries, Path(command.base.output))
    print(table(summaries))
    for line in left_out:
        print(line)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def run_llm_compare_command(command: LLMCompareCommand) -> int:
    try:
        return report(command) if command.report else _run(command)
    except ValueError as err:  # a folder of other runs: one line, no traceback
        print(f"masked-rl llm-compare: error: {err}", file=sys.stderr)
        return 2


def _run(command: LLMCompareCommand) -> int:
    summaries = []
    for estimator in command.estimators:
        for seed in command.seeds:
            cfg = replace(command.base, estimator=estimator, seed=seed)
            state, summary = plan(cfg)
            if state != "done":
                summary = train(cfg, resume=state == "resume")
            summaries.append(summary)
            if summary["status"] == "interrupted":
                print(f"interrupted in {summary['run_dir']}; re-run the same command to "
                      "continue", flush=True)
                write_outputs(summaries, Path(command.base.output))
                return 130
    paths = write_outputs(summaries, Path(command.base.output))
    print(table(summaries))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
