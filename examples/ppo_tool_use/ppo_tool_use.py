"""PPO with masked GAE on a toy tool-use environment, in TorchRL.

The agent writes one token per step into a transcript that it shares with the environment:
the prompt, the tool's answers and the closing text are written by the environment
(``loss_mask == 0``), the tool calls and the answer by the agent (``loss_mask == 1``). The
reward arrives on the last, masked step. :func:`train` reads top to bottom:

1. check the options, open the run folder (or reopen it to resume);
2. seed; build the networks, the loss (:class:`masked_rl.MaskedClipPPOLoss`, TorchRL's
   ``ClipPPOLoss`` on the trainable steps only, with :class:`masked_rl.MaskedGAE` or TorchRL's
   plain ``GAE`` as value estimator), the optimizer, the collector, the replay buffer, the
   logger;
3. loop over collected ``[num_envs, T]`` batches: estimate the advantages on the full batch
   (the estimator needs the time structure and the rewards of masked steps), put only the
   trainable steps in the replay buffer and take clipped-gradient Adam steps on its
   minibatches for a few epochs, log, and every ``eval_every`` frames evaluate the greedy
   policy and checkpoint;
4. write the summary.

The first Ctrl-C (SIGINT) stops the loop at the end of the current batch; the run then writes a
checkpoint and a summary marked ``"interrupted"`` and :func:`main` exits with status 130.
``--resume RUN_DIR`` continues from the last checkpoint (see :func:`train` for what is
bit-exact).

Run ``python ppo_tool_use.py --help`` from this folder (or ``masked-rl train --help``) for the
options, documented in ``config.py``.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
import tqdm
from tensordict import TensorDictBase
from torchrl.collectors import Collector, MultiSyncCollector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.data.replay_buffers.samplers import SamplerWithoutReplacement
from torchrl.record.loggers import get_logger

from masked_rl import CompleteEpisodes, MaskedClipPPOLoss, SkipMaskedSteps
from masked_rl.loss import training_step_masks

if __package__:  # imported, e.g. by `masked-rl train` (masked_rl_examples.ppo_tool_use)
    from . import utils
    from .baselines import PlainGAE, TerminalOnlyGAE, ZeroedGAE
    from .config import (CHECKPOINT_FILE, CONFIG_FILE, SUMMARY_FILE, Config,
                         EvalCommand, TrainCommand, changed_options, check_config,
                         RunFolderError, check_fresh_run_folder, parse_train_command)
else:  # run as a script from this folder: python ppo_tool_use.py
    import utils
    from baselines import PlainGAE, TerminalOnlyGAE, ZeroedGAE
    from config import (CHECKPOINT_FILE, CONFIG_FILE, SUMMARY_FILE, Config,
                        EvalCommand, TrainCommand, changed_options, check_config,
                        RunFolderError, check_fresh_run_folder, parse_train_command)

SUCCESS_THRESHOLD = 0.9
"""Greedy success rate that counts as solved (``frames_to_threshold`` in the summary)."""
EVAL_SEED_OFFSET = 1_000_003
"""Evaluation episodes are seeded with ``seed + EVAL_SEED_OFFSET``, apart from training's."""


@dataclass
class Progress:
    """Where a run stands; saved in every checkpoint, restored on resume."""

    frames: int = 0
    """Environment steps collected and trained on."""
    batches: int = 0
    skipped_updates: int = 0
    """Batches without a trainable step, hence without an update."""
    next_eval: int = 0
    """Frame count at which the next evaluation (and checkpoint) is due."""
    wall_time_s: float = 0.0
    """Wall time of the run so far, over all of its processes."""
    eval_time_s: float = 0.0
    history: list[dict] = field(default_factory=list)
    """One ``{"frames", "success_rate", "wall_time_s"}`` per greedy evaluation."""


# --- the steps of a run ----------------------------------------------------------------------


def open_run_dir(run_dir: Path, cfg: Config, resume: bool, overwrite: bool = False) -> dict | None:
    """Prepare ``run_dir``; returns the checkpoint to resume from (``None`` for a fresh run).

    No summary stays from an earlier attempt: one appears only when this run completes or is
    interrupted. A fresh run also drops the folder's earlier checkpoint and logs; it refuses a
    folder holding a finished run unless ``overwrite`` (``RunFolderError``).
    """
    checkpoint = None
    if not resume:
        check_fresh_run_folder(run_dir, overwrite)
    if resume:
        checkpoint = torch.load(run_dir / CHECKPOINT_FILE, map_location="cpu", weights_only=True)
        changed = changed_options(Config(**checkpoint["config"]), cfg)
        if changed:
            raise ValueError(f"cannot resume {str(run_dir)!r} with other options than its "
                             f"checkpoint's: {', '.join(changed)} differ")
    else:
        (run_dir / CHECKPOINT_FILE).unlink(missing_ok=True)
        for logs in ("scalars", "texts"):  # TorchRL's CSV logger appends to what it finds
            shutil.rmtree(run_dir / logs, ignore_errors=True)
    (run_dir / SUMMARY_FILE).unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    utils.write_text_atomically(json.dumps(asdict(cfg), indent=2), run_dir / CONFIG_FILE)
    return checkpoint


def set_value_estimator(loss: MaskedClipPPOLoss, cfg: Config) -> None:
    """Install the ``--estimator`` on ``loss``; each is one line per value of ``ESTIMATORS``."""
    gae = dict(gamma=cfg.gamma, lmbda=cfg.lmbda)
    critic = loss.critic_network
    if cfg.estimator == "masked":  # masked_rl.MaskedGAE: GAE over the trainable steps
        loss.make_value_estimator(**gae, masked_value_targets=cfg.masked_value_targets)
    elif cfg.estimator == "plain":  # TorchRL's GAE (every step a transition), critic once per step
        loss.make_value_estimator(PlainGAE(**gae, value_network=critic))
    elif cfg.estimator == "zeroed":  # values and rewards multiplied by the mask, then GAE
        loss.make_value_estimator(ZeroedGAE(**gae, value_network=critic))
    elif cfg.estimator == "terminal-only":  # the reference system: terminal reward only
        loss.make_value_estimator(TerminalOnlyGAE(**gae, value_network=critic,
                                                  masked_value_targets=cfg.masked_value_targets))
    else:
        raise ValueError(f"no value estimator for estimator={cfg.estimator!r}")


def critic_on_masked_steps(cfg: Config) -> bool:
    """Whether the critic also learns steps without an action: ``plain`` reads its critic at
    every step (so it learns every step), ``masked`` and ``terminal-only`` with
    ``--masked-value-targets``; ``zeroed`` multiplies masked values by 0 (trainable steps only)."""
    return cfg.estimator == "plain" or (
        cfg.masked_value_targets and cfg.estimator in ("masked", "terminal-only"))


def make_loss(cfg: Config, actor, critic) -> MaskedClipPPOLoss:
    loss = MaskedClipPPOLoss(
        actor,
        critic,
        clip_epsilon=cfg.clip_epsilon,
        entropy_coeff=cfg.entropy_coeff,
        critic_coeff=cfg.critic_coeff,
        loss_critic_type="l2",
        normalize_advantage=cfg.normalize_advantage,
        masked_value_targets=critic_on_masked_steps(cfg),
    )
    set_value_estimator(loss, cfg)
    return loss


def make_collector(cfg: Config, policy, progress: Progress, snapshot: dict | None):
    """The collector of the remaining frames: one process, or TorchRL's multi-process one.

    A resumed single-process collector gets its environments back mid-episode
    (``snapshot``); a multi-process one starts fresh episodes, seeded from the frame count.
    """
    frames = cfg.total_frames - progress.frames
    if cfg.workers == 1:
        collector = Collector(
            utils.make_env(cfg.env, cfg.num_envs, cfg.device, backend=cfg.backend,
                           **cfg.env_kwargs()),
            policy,
            frames_per_batch=cfg.frames_per_batch,
            total_frames=frames,
            device=cfg.device,
            auto_register_policy_transforms=False,  # a feed-forward policy: nothing to add
        )
    else:
        make_worker_env = partial(utils.make_env, cfg.env, cfg.num_envs // cfg.workers, "cpu",
                                  backend=cfg.backend, **cfg.env_kwargs())
        with utils.sigint_ignored():  # the workers leave Ctrl-C to this process
            collector = MultiSyncCollector(
                [make_worker_env] * cfg.workers,
                policy,
                frames_per_batch=cfg.frames_per_batch,
                total_frames=frames,
                storing_device=cfg.device,
                auto_register_policy_transforms=False,
            )
    if snapshot is not None:
        utils.restore_collector(collector, snapshot)
    else:
        collector.set_seed((cfg.seed + progress.frames) % 2**32)
    return collector


def make_replay_buffer(cfg: Config) -> ReplayBuffer:
    return ReplayBuffer(
        storage=LazyTensorStorage(cfg.frames_per_batch, device=cfg.device),
        sampler=SamplerWithoutReplacement(),
        batch_size=cfg.minibatch_size,
    )


def make_logger(cfg: Config, run_dir: Path, progress: Progress):
    """A TorchRL logger writing under ``run_dir``; a resumed CSV log loses what the previous
    process logged after its checkpoint."""
    if cfg.logger == "none":
        return None
    if cfg.logger == "csv":
        utils.truncate_csv_scalars(run_dir, progress.frames)
    logger = get_logger(cfg.logger, logger_name=str(run_dir.parent), experiment_name=run_dir.name)
    if not progress.history:
        logger.log_hparams(asdict(cfg))
    return logger


def log(logger, values: dict, step: int) -> None:
    if logger is not None:
        for name, value in values.items():
            logger.log_scalar(name, value, step=step)


def log_batch(logger, batch: TensorDictBase, stats: dict | None, progress: Progress,
              times: dict) -> dict:
    """Log a batch under ``train/`` and ``time/``; returns its finished-episode statistics.

    ``train/``: the update's loss statistics (none for a skipped update), ``update_skipped``,
    the finished episodes (success rate, reward, tokens, tool calls), ``episodes_cut_share``
    and ``bootstrap_masked_share`` (:func:`utils.cut_statistics`), ``trainable_steps``.
    """
    episodes = utils.finished_episodes(batch)
    values = {f"train/{k}": v for k, v in (stats or {}).items()}
    values.update({f"train/{k}": v for k, v in episodes.items()})
    values.update({f"train/{k}": v for k, v in utils.cut_statistics(batch).items()})
    values["train/trainable_steps"] = float(batch["loss_mask"].sum())
    values["train/update_skipped"] = float(stats is None)
    values.update(times)
    values.update({"time/eval": progress.eval_time_s, "time/total": progress.wall_time_s,
                   "time/fps": progress.frames / progress.wall_time_s})
    log(logger, values, progress.frames)
    return episodes


def end_truncated_episodes(batch: TensorDictBase) -> None:
    """Running out of steps ends the episode like any failure (``--no-bootstrap-truncated``).

    A bootstrap would read the critic at the last, masked observation, a mid-tool-output
    window it is never trained on; in our runs its guess kept "call tools until the budget runs
    out" looking as good as answering.
    """
    batch["next", "terminated"] = batch["next", "done"].clone()


def estimate_advantages(loss: MaskedClipPPOLoss, batch: TensorDictBase, cfg: Config) -> None:
    """Advantages and value targets once per batch, on the full ``[num_envs, T]`` batch, from
    the critic that collected it. ``plain``'s targets are meaningful at every step: its
    ``value_target_mask`` is all true (the loss trains its critic there)."""
    with torch.no_grad():
        loss.value_estimator(batch)
    if cfg.estimator == "plain" and critic_on_masked_steps(cfg):
        batch["value_target_mask"] = torch.ones(batch.batch_size, dtype=torch.bool,
                                                device=batch.device)


def training_steps(batch: TensorDictBase, cfg: Config) -> tuple[TensorDictBase, TensorDictBase | None]:
    """The steps that train: ``(trainable steps, critic-only steps or None)``, each a flat batch.

    Critic-only steps carry a value target but no action (``value_target_mask`` without
    ``loss_mask``); they exist when :func:`critic_on_masked_steps`. Steps that
    :class:`masked_rl.CompleteEpisodes` holds back for the next batch are in neither.
    """
    trainable, has_target = training_step_masks(
        batch, value_target_mask_key="value_target_mask" if critic_on_masked_steps(cfg) else None)
    return batch[trainable], None if has_target is None else batch[has_target & ~trainable]


def annealed_lr(cfg: Config, frames_before: int) -> float:
    """``--anneal-lr``: the learning rate of the batch collected after ``frames_before`` frames.

    >>> cfg = Config(lr=1e-3, frames=64 * 16384, frames_per_batch=16384, anneal_lr=True)
    >>> annealed_lr(cfg, 0), annealed_lr(cfg, 16 * 16384), annealed_lr(cfg, 63 * 16384)
    (0.001, 0.00075, 1.5625e-05)
    """
    return cfg.lr * max(0.0, 1.0 - frames_before / cfg.total_frames)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def update(loss, optimizer, buffer: ReplayBuffer, steps: tuple[TensorDictBase, TensorDictBase | None],
           cfg: Config) -> dict | None:
    """``cfg.epochs`` passes of clipped-gradient Adam steps over the trainable steps in minibatches.

    ``steps`` is :func:`training_steps`'s pair: each minibatch of trainable steps gets
    ``cfg.critic_extra_steps`` critic-only steps drawn at random (torch's generator). Returns
    the mean of each loss statistic, or ``None`` (no update) when there is no trainable step.
    """
    trainable, critic_only = steps
    if not trainable["loss_mask"].any():
        return None
    extra = 0 if critic_only is None else min(cfg.critic_extra_steps, critic_only.shape[0])
    buffer.empty()
    buffer.extend(trainable)
    stats = defaultdict(list)
    for _ in range(cfg.epochs):
        for minibatch in buffer:
            if extra:
                drawn = torch.randint(critic_only.shape[0], (extra,), device=critic_only.device)
                minibatch = torch.cat((minibatch, critic_only[drawn]))
            out = loss(minibatch)
            total = out["loss_objective"] + out["loss_entropy"] + out["loss_critic"]
            optimizer.zero_grad()
            total.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(loss.parameters(), cfg.max_grad_norm)
            optimizer.step()
            for key in ("loss_objective", "loss_critic", "loss_entropy", "entropy",
                        "clip_fraction", "kl_approx", "ESS", "explained_variance"):
                stats[key].append(out[key].detach().float().mean().item())
            stats["grad_norm"].append(grad_norm.item())
    return {key: sum(values) / len(values) for key, values in stats.items()}


def evaluate_greedy(actor, eval_env, cfg: Config, progress: Progress, logger,
                    max_steps: int) -> float:
    """Greedy success on the evaluation tasks, added to the history and the log."""
    start = time.perf_counter()
    result = utils.evaluate(actor, eval_env, seed=cfg.seed + EVAL_SEED_OFFSET, max_steps=max_steps)
    progress.eval_time_s += time.perf_counter() - start
    progress.history.append({"frames": progress.frames, "success_rate": result["success_rate"],
                             "wall_time_s": progress.wall_time_s})
    log(logger, {f"eval/{k}": v for k, v in result.items()}, progress.frames)
    return result["success_rate"]


def save_checkpoint(run_dir: Path, cfg: Config, progress: Progress, stateful: dict,
                    collector) -> None:
    """Everything :func:`train` needs to carry on from here, written atomically.

    ``stateful`` names the objects whose ``state_dict()`` is kept (networks, optimizer, ...).
    Loadable with ``torch.load(..., weights_only=True)`` (what ``masked-rl eval`` does), so
    every state must be tensors and plain containers; the environments' and the host
    generators' states are pickled bytes, unpickled only by ``--resume``.
    """
    state = {
        "config": asdict(cfg),
        "progress": asdict(progress),
        **{name: part.state_dict() for name, part in stateful.items()},
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        "host_rng": utils.host_random_state(),
        "collector": utils.collector_snapshot(collector),
    }
    utils.save_atomically(state, run_dir / CHECKPOINT_FILE)


def write_summary(run_dir: Path, cfg: Config, progress: Progress, status: str) -> dict:
    history = progress.history
    summary = {
        "status": status,
        "config": asdict(cfg),
        "final_success_rate": history[-1]["success_rate"],
        "frames_to_threshold": next(
            (h["frames"] for h in history if h["success_rate"] >= SUCCESS_THRESHOLD), None),
        "success_threshold": SUCCESS_THRESHOLD,
        "frames": progress.frames,
        "total_frames": cfg.total_frames,
        "batches": progress.batches,
        "skipped_updates": progress.skipped_updates,
        "wall_time_s": progress.wall_time_s,
        "history": history,
        "run_dir": str(run_dir),
    }
    utils.write_text_atomically(json.dumps(summary, indent=2), run_dir / SUMMARY_FILE)
    return summary


# --- the run ---------------------------------------------------------------------------------


def train(cfg: Config, *, run_dir: Path | None = None, resume: bool = False,
          overwrite: bool = False) -> dict:
    """Train one PPO agent; returns the summary also written to ``<run_dir>/summary.json``.

    ``run_dir`` defaults to ``cfg.run_dir()``. The summary's ``"status"`` is ``"completed"``,
    or ``"interrupted"`` after a SIGINT (the run stops at the end of the batch it is in and
    checkpoints there). Checkpoints are also written, atomically, at every evaluation.

    One process at a time writes a run folder (``RunFolderError`` naming the holder's pid
    otherwise); a fresh run refuses a folder holding a finished run unless ``overwrite``.

    With ``resume``, the run continues from ``<run_dir>/checkpoint.pt`` (``cfg`` must be the
    run's configuration, up to ``RUNTIME_FIELDS``). With ``workers == 1`` the continuation is
    bit-exact: the same batches, updates, evaluations and final weights as a run never stopped
    (same torch build, device and thread count), because the checkpoint holds the networks, the
    optimizer, the torch, NumPy and Python generators, every environment mid-episode and the
    collector's current observation, the frame counters and the evaluation history, and the CSV
    log is cut back to the checkpoint. Not bit-exact: ``workers > 1`` (the environments live in
    the worker processes, so a resumed run starts fresh episodes, seeded from the frame count,
    and drops the unfinished episodes that ``CompleteEpisodes`` held back);
    a CUDA device, whose kernels are not all deterministic; a different thread count (the order
    of floating-point sums); timings; other logger backends, which keep what was logged after
    the checkpoint.
    """
    run_dir = Path(run_dir) if run_dir is not None else cfg.run_dir()
    check_config(cfg, run_dir)
    with utils.run_folder_lock(run_dir):  # one writer per folder
        return _train(cfg, run_dir, open_run_dir(run_dir, cfg, resume, overwrite))


def _train(cfg: Config, run_dir: Path, checkpoint: dict | None) -> dict:
    """:func:`train`, in a folder opened and locked."""
    started = time.perf_counter()

    # Seeding, networks, loss, optimizer.
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    eval_env = utils.make_env(cfg.env, cfg.eval_episodes, cfg.device, backend=cfg.backend,
                              **cfg.env_kwargs())
    max_episode_steps = utils.episode_step_limit(cfg.env, **cfg.env_kwargs())
    actor, critic = utils.make_actor_critic(
        eval_env, cfg.embed_dim, cfg.hidden, cfg.layers, cfg.shared, cfg.device, cfg.encoder
    )
    loss = make_loss(cfg, actor, critic)
    optimizer = torch.optim.Adam(loss.parameters(), lr=cfg.lr)
    complete = CompleteEpisodes()
    stateful = {"actor": actor, "critic": critic, "optimizer": optimizer,  # in checkpoints
                "complete_episodes": complete}
    progress = Progress()
    if checkpoint is not None:
        for name, part in stateful.items():
            part.load_state_dict(checkpoint[name])
        progress = Progress(**checkpoint["progress"])
        if checkpoint["collector"] is None:
            # A multi-process collector restarts its environments on fresh episodes: the
            # held-back fragments would be joined onto them, their actions credited with the
            # new episodes' rewards.
            complete.reset()
    wall_time_before = progress.wall_time_s

    # Collector (none left to build when resuming a finished run), replay buffer, logger.
    collector = None
    if progress.frames < cfg.total_frames:
        policy = SkipMaskedSteps(actor) if cfg.skip_masked_steps else actor
        collector = make_collector(cfg, policy, progress,
                                   checkpoint["collector"] if checkpoint is not None else None)
    buffer = make_replay_buffer(cfg)
    logger = make_logger(cfg, run_dir, progress)
    if checkpoint is not None:  # last: building the pieces above draws random numbers
        torch.set_rng_state(checkpoint["torch_rng"])
        if checkpoint["cuda_rng"] is not None:
            torch.cuda.set_rng_state_all(checkpoint["cuda_rng"])
        utils.set_host_random_state(checkpoint["host_rng"])
    bar = tqdm.tqdm(total=cfg.total_frames, initial=progress.frames, unit="frames",
                    disable=not cfg.progress_bar, desc=f"{cfg.estimator} seed {cfg.seed}")

    interrupt = utils.StopOnInterrupt()
    try:
        with interrupt:
            if not progress.history:  # the untrained policy, and a first checkpoint
                evaluate_greedy(actor, eval_env, cfg, progress, logger, max_episode_steps)
                progress.next_eval = cfg.eval_every
                save_checkpoint(run_dir, cfg, progress, stateful, collector)
            collect_start = time.perf_counter()
            for batch in collector or ():
                # Collect.
                collect_time = time.perf_counter() - collect_start
                progress.frames += batch.numel()
                progress.batches += 1
                # Estimate.
                update_start = time.perf_counter()
                if not cfg.bootstrap_truncated:
                    end_truncated_episodes(batch)
                # (with --complete-episodes: whole episodes, the unfinished ones held back)
                whole = complete(batch) if cfg.complete_episodes else batch
                estimate_advantages(loss, whole, cfg)
                # Update.
                if cfg.anneal_lr:
                    set_learning_rate(optimizer, annealed_lr(cfg, progress.frames - batch.numel()))
                stats = update(loss, optimizer, buffer, training_steps(whole, cfg), cfg)
                if stats is None:
                    progress.skipped_updates += 1
                collector.update_policy_weights_()
                update_time = time.perf_counter() - update_start
                # Log.
                progress.wall_time_s = wall_time_before + time.perf_counter() - started
                episodes = log_batch(logger, batch, stats, progress,
                                     {"time/collect": collect_time, "time/update": update_time})
                # Evaluate and checkpoint.
                if progress.frames >= progress.next_eval or progress.frames >= cfg.total_frames:
                    evaluate_greedy(actor, eval_env, cfg, progress, logger, max_episode_steps)
                    while progress.next_eval <= progress.frames:
                        progress.next_eval += cfg.eval_every
                    save_checkpoint(run_dir, cfg, progress, stateful, collector)
                bar.update(batch.numel())
                bar.set_postfix(train_success=f"{episodes.get('success_rate', float('nan')):.2f}",
                                eval_success=f"{progress.history[-1]['success_rate']:.2f}")
                if interrupt.requested:
                    break
                collect_start = time.perf_counter()
        progress.wall_time_s = wall_time_before + time.perf_counter() - started
        if interrupt.requested:
            save_checkpoint(run_dir, cfg, progress, stateful, collector)
    finally:
        bar.close()
        if collector is not None:
            # Workers exit by themselves once told to close, but a worker's interpreter can
            # take seconds to tear torch down; by 80% of the timeout TorchRL terminates them.
            collector.shutdown(timeout=2.0)
            # Freed now, not at interpreter exit: when an exception propagates, its traceback
            # keeps this frame alive, and TorchRL's weight-sync objects then deadlock in their
            # __del__ during interpreter finalization.
            collector = None
        eval_env.close()
    status = "interrupted" if interrupt.requested else "completed"
    return write_summary(run_dir, cfg, progress, status)


# --- commands --------------------------------------------------------------------------------


def run_train_command(command: TrainCommand) -> int:
    """Run ``masked-rl train``; returns the exit status (130 when interrupted)."""
    cfg = command.config
    try:
        summary = train(cfg, run_dir=command.run_dir, resume=command.resume,
                        overwrite=command.overwrite)
    except (RunFolderError, OSError) as err:
        message = utils.run_error_message(err, command.run_dir)
        if message is None:
            raise
        print(f"masked-rl train: error: {message}", file=sys.stderr)
        return 2
    solved = summary["frames_to_threshold"]
    print(
        f"{cfg.estimator} GAE, seed {cfg.seed}: final greedy success "
        f"{summary['final_success_rate']:.1%} after {summary['frames']} frames, "
        f"{SUCCESS_THRESHOLD:.0%} reached at "
        f"{'never' if solved is None else f'{solved} frames'}, "
        f"{summary['wall_time_s']:.0f} s; metrics and checkpoint in {summary['run_dir']}"
    )
    if summary["status"] == "interrupted":
        print(f"interrupted after {summary['frames']} of {summary['total_frames']} frames; "
              f"continue with: masked-rl train --resume {summary['run_dir']}", file=sys.stderr)
        return 130
    return 0


def run_eval_command(command: EvalCommand) -> int:
    """Run ``masked-rl eval``: greedy success over seeded episodes, and a transcript."""
    cfg, checkpoint = command.config, command.state
    env = utils.make_env(cfg.env, command.episodes, command.device, backend=cfg.backend,
                         **cfg.env_kwargs())
    actor, _ = utils.make_actor_critic(env, cfg.embed_dim, cfg.hidden, cfg.layers, cfg.shared,
                                       command.device, cfg.encoder)
    actor.load_state_dict(checkpoint["actor"])
    seed = cfg.seed + EVAL_SEED_OFFSET if command.seed is None else command.seed
    max_steps = utils.episode_step_limit(cfg.env, **cfg.env_kwargs())
    result = utils.evaluate(actor, env, seed=seed, max_steps=max_steps)
    env.close()
    print(f"{cfg.env}, {cfg.estimator} GAE, seed {cfg.seed}, checkpoint at "
          f"{checkpoint['progress']['frames']} frames: greedy success "
          f"{result['success_rate']:.1%} over {command.episodes} episodes (seed {seed}), "
          f"mean return {result['episode_return']:.3f}, mean length "
          f"{result['episode_length']:.1f} steps")
    if command.render:
        print(utils.greedy_transcript(actor, cfg.env, seed=seed, device=command.device,
                                      **cfg.env_kwargs()))
    return 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``masked-rl train``, or this file run as a script."""
    return run_train_command(parse_train_command(argv, prog))


if __name__ == "__main__":
    raise SystemExit(main())
