"""Masked GAE against TorchRL's plain GAE: the same PPO recipe, seeds and budget.

Every arm runs :func:`ppo_tool_use.train` with identical settings (losses over trainable steps
only, TorchRL's default ``gamma=0.99, lmbda=0.95``, every other hyper-parameter from
:class:`config.Config`); only the value estimator differs. Runs go to ``--jobs`` worker
processes. Output, under ``--output``: one run folder per (estimator, seed), ``summary.csv``
(one row per run), ``curves.csv`` (greedy success at every evaluation) and ``curves.png``.

Resumable: :func:`plan_runs` looks at each run folder first. A finished run with the same
options is reused, an interrupted one (a checkpoint without a finished summary) is resumed, a
finished one with fewer ``--frames`` is extended from its checkpoint to the new budget, and a
folder holding a run with other options is an error before anything runs. The first
Ctrl-C stops every run at the end of its batch (each writes its checkpoint and an interrupted
summary) and exits with status 130; the same command then picks up where it stopped.

``--report`` trains nothing: it writes the same outputs from the runs the folder holds, an
interrupted run at the frames it reached, and names the runs not started or not finished (a long
comparison runs in pieces, and each piece's figures can be committed as it ends).

Run ``python compare.py --help`` from this folder, or ``masked-rl compare --help``.
"""

from __future__ import annotations

import csv
import io
import json
import multiprocessing
import os
import signal
import statistics
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path

import tqdm

if __package__:  # imported, e.g. by `masked-rl compare` (masked_rl_examples.ppo_tool_use)
    from . import utils
    from .config import (CHECKPOINT_FILE, CONFIG_FILE, SUMMARY_FILE, CompareCommand, Config,
                         changed_options, parse_compare_command, read_run_config)
    from .config import RunFolderError
    from .ppo_tool_use import SUCCESS_THRESHOLD, train
else:  # run as a script from this folder: python compare.py
    import utils
    from config import (CHECKPOINT_FILE, CONFIG_FILE, SUMMARY_FILE, CompareCommand, Config,
                        changed_options, parse_compare_command, read_run_config)
    from config import RunFolderError
    from ppo_tool_use import SUCCESS_THRESHOLD, train


@dataclass
class PlannedRun:
    """One run of the comparison and what its folder already holds."""

    config: Config
    run_dir: Path
    state: str
    """``"fresh"`` (train from scratch), ``"resume"`` (from its checkpoint) or ``"done"``."""
    summary: dict | None = None
    """The summary the folder holds: the finished run's (``state == "done"``), else that of a
    run interrupted or finished with fewer frames, or ``None``."""


def plan_run(cfg: Config, run_dir: Path) -> PlannedRun:
    """What to do for ``cfg`` in ``run_dir``.

    ``ValueError`` if ``run_dir`` holds a run with other options.
    """
    if not (run_dir / CONFIG_FILE).is_file():
        return PlannedRun(cfg, run_dir, "fresh")
    changed = changed_options(read_run_config(run_dir), cfg)
    if changed:
        raise ValueError(f"{str(run_dir)!r} holds a run with other options ({', '.join(changed)} "
                         "differ): use another --output, or delete that folder")
    summary_path = run_dir / SUMMARY_FILE
    summary = None
    if summary_path.is_file():
        try:
            summary = json.loads(summary_path.read_text())
            finished = summary["status"] == "completed"
            total_frames = int(summary["total_frames"])
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{str(summary_path)!r} is not a run summary ({type(err).__name__}: "
                             f"{err}): delete it to resume the run from its checkpoint") from None
        if finished and total_frames >= cfg.total_frames:
            return PlannedRun(cfg, run_dir, "done", summary)
    if (run_dir / CHECKPOINT_FILE).is_file():
        return PlannedRun(cfg, run_dir, "resume", summary)
    return PlannedRun(cfg, run_dir, "fresh", summary)


def sweep_points(command: CompareCommand) -> list[tuple[int | None, Config]]:
    """``(swept value, base configuration)`` per point: one point ``(None, base)`` without
    ``--sweep``, else one per value, each with its own output folder ``<output>/<NAME>=<V>``."""
    if command.sweep is None:
        return [(None, command.base)]
    name, values = command.sweep
    flag = name.replace("_", "-")
    frames = command.sweep_frames or (command.base.frames,) * len(values)
    return [(value, replace(command.base, **{name: value}, frames=value_frames,
                            output=str(Path(command.base.output) / f"{flag}={value}")))
            for value, value_frames in zip(values, frames)]


def plan_runs(command: CompareCommand) -> list[PlannedRun]:
    """One run per (swept value, seed, estimator), in a fixed order; checks every folder before
    any run."""
    runs = []
    for _, base in sweep_points(command):
        for seed in command.seeds:
            for estimator in command.estimators:
                cfg = replace(base, estimator=estimator, seed=seed)
                runs.append(plan_run(cfg, cfg.run_dir()))
    return runs


_stopping = None  # in a worker process: the event set when the comparison is stopping


def _init_worker(stopping, parent_pid: int) -> None:
    global _stopping
    _stopping = stopping
    # Outside train() (which handles it), a Ctrl-C must not kill the worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    utils.die_with_parent(parent_pid)


def _end_workers_and_exit(signum, frame) -> None:
    """SIGTERM / SIGHUP in the parent: end the workers too, then exit ``128 + signum``.

    Otherwise they would train on, orphaned, and a rerun of the same command would resume their
    folders while they still write them."""
    for child in multiprocessing.active_children():
        child.terminate()
    raise SystemExit(128 + signum)


def train_planned(run: PlannedRun) -> dict | None:
    """Train (or resume) one run; ``None`` if the comparison stopped before it started."""
    if _stopping is not None and _stopping.is_set():
        return None
    return train(run.config, run_dir=run.run_dir, resume=run.state == "resume")


def run_all(runs: list[PlannedRun], jobs: int) -> tuple[list[dict | None], bool]:
    """Summaries of ``runs`` (``None`` for runs never started) and whether a SIGINT stopped them."""
    summaries = [run.summary for run in runs]
    todo = [i for i, run in enumerate(runs) if run.state != "done"]
    bar = tqdm.tqdm(total=len(todo), unit="run", desc="compare")
    with utils.StopOnInterrupt() as interrupt:
        if jobs == 1:
            for i in todo:
                if interrupt.requested:
                    break
                summaries[i] = train_planned(runs[i])  # train() handles SIGINT while it runs
                bar.update()
                if summaries[i]["status"] == "interrupted":
                    break
        elif todo:
            # spawn: a fresh interpreter per worker (forking a process that holds torch threads
            # and collector state is fragile).
            context = multiprocessing.get_context("spawn")
            stopping = context.Event()
            previous = {signum: signal.signal(signum, _end_workers_and_exit)
                        for signum in (signal.SIGTERM, signal.SIGHUP)}
            try:
                summaries, failure = _run_in_pool(context, stopping, runs, todo, jobs,
                                                  summaries, bar, interrupt)
            finally:
                for signum, handler in previous.items():
                    signal.signal(signum, handler)
            if failure is not None:
                bar.close()
                raise failure
    bar.close()
    interrupted = interrupt.requested or any(
        s is None or s["status"] == "interrupted" for s in summaries)
    return summaries, interrupted


def _run_in_pool(context, stopping, runs, todo, jobs, summaries, bar, interrupt):
    """``run_all`` on ``jobs`` worker processes; returns ``(summaries, first exception)``.

    A run that fails stops the others like a Ctrl-C (each checkpoints at the end of its batch),
    so the error is reported once every worker is done, not behind runs that go on training.
    """
    failure = None
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_init_worker,
                             initargs=(stopping, os.getpid())) as pool:
        with utils.sigint_ignored():  # the workers start ignoring Ctrl-C
            futures = {pool.submit(train_planned, runs[i]): i for i in todo}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            for future in done:
                if future.cancelled():
                    continue
                if future.exception() is not None:
                    failure = failure or future.exception()
                    continue
                summaries[futures[future]] = future.result()
                bar.update()
            if (interrupt.requested or failure is not None) and not stopping.is_set():
                # A terminal's Ctrl-C reaches the workers too; `kill -INT <this pid>`
                # does not: pass it on. Runs not started yet see `stopping` and skip.
                stopping.set()
                for future in pending:
                    future.cancel()
                for child in multiprocessing.active_children():
                    os.kill(child.pid, signal.SIGINT)
    return summaries, failure


def _fmt_frames(frames: int | None) -> str:
    return "never" if frames is None else f"{frames:,}"


def groups(summaries: list[dict], swept: str | None) -> dict[tuple, list[dict]]:
    """The runs of each (swept value, estimator), in order of appearance."""
    out: dict[tuple, list[dict]] = {}
    for s in summaries:
        value = s["config"][swept] if swept else None
        out.setdefault((value, s["config"]["estimator"]), []).append(s)
    return out


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``successes / trials``: every ``p`` with
    ``|successes / trials - p| <= z * sqrt(p * (1 - p) / trials)``, ``z`` the normal quantile.

    Examples:
        >>> from masked_rl_examples.ppo_tool_use.compare import wilson_interval
        >>> [round(x, 3) for x in wilson_interval(5, 5)], [round(x, 3) for x in wilson_interval(1, 3)]
        ([0.566, 1.0], [0.061, 0.792])
    """
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"need 0 <= successes <= trials and trials >= 1, got {successes}/{trials}")
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    share, spread = successes / trials, z * z / trials
    center = (share + spread / 2) / (1 + spread)
    half = z / (1 + spread) * (share * (1 - share) / trials + spread / (4 * trials)) ** 0.5
    return max(0.0, center - half), min(1.0, center + half)


def group_statistics(runs: list[dict]) -> dict:
    """Final greedy success (mean, std, min, max), runs reaching the threshold with the 95 %
    Wilson interval of that share, and their mean frames to it, over ``runs``."""
    success = [s["final_success_rate"] for s in runs]
    reached = [s["frames_to_threshold"] for s in runs if s["frames_to_threshold"] is not None]
    low, high = wilson_interval(len(reached), len(runs))
    return {
        "seeds": len(runs),
        "success_mean": statistics.mean(success),
        "success_std": statistics.stdev(success) if len(success) > 1 else 0.0,
        "success_min": min(success),
        "success_max": max(success),
        "runs_reaching_threshold": len(reached),
        "reaching_share_ci95_low": low,
        "reaching_share_ci95_high": high,
        "frames_to_threshold_mean": statistics.mean(reached) if reached else None,
        "wall_time_s_mean": statistics.mean(s["wall_time_s"] for s in runs),
    }


def table(summaries: list[dict], swept: str | None = None) -> str:
    """Per-run rows, then one mean row per estimator (per swept value with ``--sweep``)."""
    pct = f"{SUCCESS_THRESHOLD:.0%}"
    head = f"| {swept.replace('_', '-')} " if swept else ""
    align = "---:|" if swept else ""
    lines = [f"{head}| estimator | seed | final greedy success | frames to {pct} | wall time (s) |",
             f"|{align}---|---:|---:|---:|---:|"]

    def first(s):
        return f"| {s['config'][swept]} " if swept else ""

    for s in summaries:
        cfg = s["config"]
        lines.append(
            f"{first(s)}| {cfg['estimator']} | {cfg['seed']} | {s['final_success_rate']:.1%} | "
            f"{_fmt_frames(s['frames_to_threshold'])} | {s['wall_time_s']:.0f} |"
        )
    for (value, estimator), runs in groups(summaries, swept).items():
        g = group_statistics(runs)
        spread = f" ± {g['success_std']:.1%}" if g["seeds"] > 1 else ""
        share = (f"{g['runs_reaching_threshold']}/{g['seeds']} runs, 95 % CI "
                 f"{g['reaching_share_ci95_low']:.0%}-{g['reaching_share_ci95_high']:.0%}")
        frames = (f"{g['frames_to_threshold_mean']:,.0f} ({share})" if g["runs_reaching_threshold"]
                  else f"never ({share})")
        lead = f"| {value} " if swept else ""
        lines.append(
            f"{lead}| **{estimator} (mean)** | {g['seeds']} seeds | {g['success_mean']:.1%}"
            f"{spread} | {frames} | {g['wall_time_s_mean']:.0f} |"
        )
    return "\n".join(lines)


def _csv_text(header: list[str], rows) -> str:
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return text.getvalue()


def write_csvs(summaries: list[dict], output: Path, swept: str | None = None) -> tuple[Path, Path]:
    """``summary.csv`` (a row per run) and ``curves.csv`` (a row per evaluation); with a sweep,
    both start with the swept parameter's column."""
    summary_path, curves_path = output / "summary.csv", output / "curves.csv"
    lead = [swept] if swept else []

    def value(s):
        return [s["config"][swept]] if swept else []

    utils.write_text_atomically(_csv_text(
        [*lead, "estimator", "seed", "frames", "final_success_rate", "frames_to_threshold",
         "success_threshold", "wall_time_s", "run_dir"],
        ([*value(s), s["config"]["estimator"], s["config"]["seed"], s["frames"],
          s["final_success_rate"], s["frames_to_threshold"] or "", s["success_threshold"],
          round(s["wall_time_s"], 1), s["run_dir"]] for s in summaries),
    ), summary_path)
    utils.write_text_atomically(_csv_text(
        [*lead, "estimator", "seed", "frames", "success_rate", "wall_time_s"],
        ([*value(s), s["config"]["estimator"], s["config"]["seed"], point["frames"],
          point["success_rate"], round(point["wall_time_s"], 1)]
         for s in summaries for point in s["history"]),
    ), curves_path)
    return summary_path, curves_path


def write_sweep_csv(summaries: list[dict], output: Path, swept: str) -> Path:
    """``sweep.csv``: one row per (swept value, estimator) with :func:`group_statistics`."""
    path = output / "sweep.csv"
    rows = []
    for (value, estimator), runs in groups(summaries, swept).items():
        g = group_statistics(runs)
        rows.append([value, estimator, runs[0]["frames"], *(("" if v is None else round(v, 4) if isinstance(v, float)
                                          else v) for v in g.values())])
    fields = list(group_statistics(summaries[:1]))
    utils.write_text_atomically(_csv_text([swept, "estimator", "frames", *fields], rows), path)
    return path


def plot_sweep(summaries: list[dict], path: Path, swept: str, env_id: str) -> Path:
    """Final greedy success and frames to the threshold against the swept masked distance, one
    line per estimator (mean over seeds, shaded min to max, a dot per seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_group = groups(summaries, swept)
    estimators = list(dict.fromkeys(e for _, e in by_group))
    values = sorted({v for v, _ in by_group})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, estimator in zip(colors, estimators):
        runs = [by_group[(v, estimator)] for v in values if (v, estimator) in by_group]
        xs = [r[0]["config"][swept] for r in runs]
        stats = [group_statistics(r) for r in runs]
        left.plot(xs, [g["success_mean"] for g in stats], "-o", color=color, label=estimator)
        left.fill_between(xs, [g["success_min"] for g in stats], [g["success_max"] for g in stats],
                          color=color, alpha=0.15)
        for x, r in zip(xs, runs):
            left.scatter([x] * len(r), [s["final_success_rate"] for s in r], color=color, s=10,
                         alpha=0.6)
            reached = [s["frames_to_threshold"] for s in r if s["frames_to_threshold"] is not None]
            right.scatter([x] * len(reached), reached, color=color, s=10, alpha=0.6)
        means = [(x, g["frames_to_threshold_mean"]) for x, g in zip(xs, stats)
                 if g["frames_to_threshold_mean"] is not None]
        if means:
            right.plot(*zip(*means), "-o", color=color,
                       label=f"{estimator} ({sum(g['runs_reaching_threshold'] for g in stats)}/"
                             f"{sum(g['seeds'] for g in stats)} runs reached)")
    for ax in (left, right):
        ax.set_xlim(min(values) / 1.5, max(values) * 1.5)  # set even where no run got there
        ax.set_xscale("log", base=2)
        ax.set_xticks(values, [str(v) for v in values])
        ax.set_xlabel(f"{swept.replace('_', ' ')} (masked tokens credit must cross)")
        ax.grid(alpha=0.3)
    left.axhline(SUCCESS_THRESHOLD, color="gray", linestyle=":", linewidth=1)
    left.set_ylim(-0.02, 1.02)
    left.set_ylabel("final greedy success (mean, min-max over seeds)")
    right.set_ylabel(f"frames to {SUCCESS_THRESHOLD:.0%} greedy success (runs that got there)")
    utils.legend(left, loc="lower left")
    utils.legend(right, loc="upper left", fontsize=8)  # empty where no run reached the threshold
    fig.suptitle(f"PPO on {env_id}: estimators against the masked distance")
    fig.tight_layout()
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    fig.savefig(temporary, dpi=120)
    plt.close(fig)
    os.replace(temporary, path)
    return path


def plot(summaries: list[dict], path: Path, env_id: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    estimators = list(dict.fromkeys(s["config"]["estimator"] for s in summaries))
    for color, estimator in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], estimators):
        runs = [s for s in summaries if s["config"]["estimator"] == estimator]
        for i, s in enumerate(runs):
            frames = [p["frames"] for p in s["history"]]
            success = [p["success_rate"] for p in s["history"]]
            label = f"{estimator} GAE ({len(runs)} seeds)" if i == 0 else None
            ax.plot(frames, success, color=color, alpha=0.8, label=label)
    ax.axhline(SUCCESS_THRESHOLD, color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("environment frames (masked steps included)")
    ax.set_ylabel("greedy success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"PPO on {env_id}: {' vs '.join(estimators)} GAE")
    utils.legend(ax, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    fig.savefig(temporary, dpi=120)
    plt.close(fig)
    os.replace(temporary, path)
    return path


def write_outputs(command: CompareCommand, summaries: list[dict]) -> list[Path]:
    """``summary.csv``, ``curves.csv`` and ``curves.png`` (with a sweep also ``sweep.csv`` and
    ``sweep.png``) in ``--output``; prints the table."""
    base = command.base
    swept = command.sweep[0] if command.sweep else None
    output = Path(base.output)
    written = list(write_csvs(summaries, output, swept))
    if swept:
        written += [write_sweep_csv(summaries, output, swept),
                    plot_sweep(summaries, output / "sweep.png", swept, base.env)]
    else:
        written.append(plot(summaries, output / "curves.png", base.env))
    frames = sorted({s["frames"] for s in summaries})
    asked = sorted(set(command.sweep_frames or (base.frames,)))
    option = ("--sweep-frames " + ",".join(map(str, command.sweep_frames)) if command.sweep_frames
              else f"--frames {base.frames:,}")
    rounded = (f" ({option} rounded up to whole batches of {base.frames_per_batch:,})"
               if frames != asked and not command.report else "")
    print(f"\nPPO on {base.env}, {' / '.join(f'{f:,}' for f in frames)} frames per run{rounded}, "
          f"gamma={base.gamma}, lmbda={base.lmbda}, seeds {' '.join(map(str, command.seeds))}:\n")
    print(table(summaries, swept))
    return written


def report(command: CompareCommand) -> int:
    """``--report``: the outputs from the runs already in ``--output``; nothing is trained."""
    try:
        runs = plan_runs(command)  # a folder holding other options is an error here too
    except ValueError as err:
        print(f"masked-rl compare: error: {err}", file=sys.stderr)
        return 2
    summaries, unfinished, missing = [], [], []
    for run in runs:
        name = str(run.run_dir.relative_to(command.base.output))
        if run.state == "done":
            summaries.append(run.summary)
        elif run.state == "resume":  # left out: its figures are not those of the asked budget
            reached = (f"{run.summary['frames']:,} of {run.config.total_frames:,} frames"
                       if run.summary else "a checkpoint, no summary")
            unfinished.append(f"{name} ({reached})")
        else:
            missing.append(name)
    left_out = utils.runs_left_out(unfinished, missing)
    if not summaries:
        print(f"masked-rl compare: error: {command.base.output!r} holds no finished run of this "
              f"comparison (nothing to report{''.join('; ' + line for line in left_out)})",
              file=sys.stderr)
        return 2
    written = write_outputs(command, summaries)
    for line in left_out:
        print(f"\n{line}")
    print(f"\nWrote {', '.join(map(str, written))}.")
    return 0


def run_compare_command(command: CompareCommand) -> int:
    """Run ``masked-rl compare``; returns the exit status (130 when interrupted)."""
    if command.report:
        return report(command)
    base = command.base
    try:
        runs = plan_runs(command)
    except ValueError as err:
        print(f"masked-rl compare: error: {err}", file=sys.stderr)
        return 2
    reused = sum(run.state == "done" for run in runs)
    resumed = sum(run.state == "resume" for run in runs)
    if reused or resumed:
        print(f"{base.output}: reusing {reused} finished run(s), resuming {resumed}, "
              f"starting {len(runs) - reused - resumed}")
    Path(base.output).mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        summaries, interrupted = run_all(runs, command.jobs)
    except (RunFolderError, OSError) as err:
        message = utils.run_error_message(err, Path(getattr(err, "filename", None) or base.output))
        if message is None:
            raise
        print(f"masked-rl compare: error: {message}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - start
    if interrupted:
        finished = sum(s is not None and s["status"] == "completed" for s in summaries)
        print(f"\ninterrupted: {finished} of {len(runs)} runs finished; re-run the same command "
              "to resume the others", file=sys.stderr)
        return 130
    written = write_outputs(command, summaries)
    print(f"\nTotal wall time {wall:.0f} s ({command.jobs} parallel jobs). "
          f"Wrote {', '.join(map(str, written))}.")
    return 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``masked-rl compare``, or this file run as a script."""
    return run_compare_command(parse_compare_command(argv, prog))


if __name__ == "__main__":
    raise SystemExit(main())
