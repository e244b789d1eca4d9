"""PPO with masked GAE on a toy tool-use environment, in TorchRL.

The agent writes one token per step into a transcript that it shares with the environment:
the prompt, the tool's answers and the closing text are written by the environment
(``loss_mask == 0``), the tool calls and the answer by the agent (``loss_mask == 1``). The
reward arrives on the last, masked step. Read top to bottom:

1. seeding, environments (a vector env per collector worker), policy and critic;
2. the loss: :class:`masked_rl.MaskedClipPPOLoss`, TorchRL's ``ClipPPOLoss`` computed on the
   trainable steps only, with :class:`masked_rl.MaskedGAE` (``--estimator masked``) or
   TorchRL's plain ``GAE`` (``--estimator plain``, the baseline) as value estimator;
3. the loop: collect a batch of ``[num_envs, T]`` steps; estimate the advantages on the full
   batch (the estimator needs the time structure and the rewards of masked steps); put only
   the *trainable* steps in a replay buffer and take clipped-gradient Adam steps on its
   minibatches for a few epochs; evaluate the greedy policy and checkpoint every
   ``eval_every`` frames; log to ``train/``, ``eval/`` and ``time/`` with a TorchRL logger.

Run ``python examples/ppo_tool_use/ppo_tool_use.py --help`` (or ``masked-rl train --help``)
for the options, documented in ``config.py``.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import defaultdict
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
import tqdm
from torchrl.collectors import Collector, MultiSyncCollector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.data.replay_buffers.samplers import SamplerWithoutReplacement
from torchrl.objectives.value import GAE
from torchrl.record.loggers import get_logger

from masked_rl import MaskedClipPPOLoss
from masked_rl.loss import select_trainable_steps
from masked_rl_examples.ppo_tool_use.config import Config, parse_config
from masked_rl_examples.ppo_tool_use.utils import (
    episode_step_limit,
    evaluate,
    finished_episodes,
    make_actor_critic,
    make_env,
)

SUCCESS_THRESHOLD = 0.9
"""Greedy success rate that counts as solved (``frames_to_threshold`` in the summary)."""


def train(cfg: Config) -> dict:
    """Train one PPO agent; returns the summary also written to ``<run dir>/summary.json``."""
    run_dir = Path(cfg.output) / f"{cfg.estimator}-seed{cfg.seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(run_dir / "scalars", ignore_errors=True)  # the CSV logger appends otherwise

    # --- seeding, environments, networks -------------------------------------------------------
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    eval_env = make_env(cfg.env, cfg.eval_episodes, cfg.device)
    max_episode_steps = episode_step_limit(cfg.env)
    actor, critic = make_actor_critic(
        eval_env, cfg.embed_dim, cfg.hidden, cfg.layers, cfg.shared, cfg.device
    )

    # --- loss: PPO over the trainable steps, masked or plain GAE -------------------------------
    loss = MaskedClipPPOLoss(
        actor,
        critic,
        clip_epsilon=cfg.clip_epsilon,
        entropy_coeff=cfg.entropy_coeff,
        critic_coeff=cfg.critic_coeff,
        loss_critic_type="l2",
        normalize_advantage=cfg.normalize_advantage,
    )
    if cfg.estimator == "masked":
        loss.make_value_estimator(gamma=cfg.gamma, lmbda=cfg.lmbda)
    else:
        loss.make_value_estimator(GAE(gamma=cfg.gamma, lmbda=cfg.lmbda, value_network=critic))

    # --- collector: one process, or TorchRL's multi-process collector --------------------------
    total_frames = -(-cfg.frames // cfg.frames_per_batch) * cfg.frames_per_batch  # whole batches
    if cfg.workers == 1:
        collector = Collector(
            make_env(cfg.env, cfg.num_envs, cfg.device),
            actor,
            frames_per_batch=cfg.frames_per_batch,
            total_frames=total_frames,
            device=cfg.device,
            auto_register_policy_transforms=False,  # a feed-forward policy: nothing to add
        )
    else:
        make_worker_env = partial(make_env, cfg.env, cfg.num_envs // cfg.workers, "cpu")
        collector = MultiSyncCollector(
            [make_worker_env] * cfg.workers,
            actor,
            frames_per_batch=cfg.frames_per_batch,
            total_frames=total_frames,
            storing_device=cfg.device,
            auto_register_policy_transforms=False,
        )
    collector.set_seed(cfg.seed)

    # --- replay buffer of trainable steps, optimizer, logger -----------------------------------
    buffer = ReplayBuffer(
        storage=LazyTensorStorage(cfg.frames_per_batch, device=cfg.device),
        sampler=SamplerWithoutReplacement(),
        batch_size=cfg.minibatch_size,
    )
    optimizer = torch.optim.Adam(loss.parameters(), lr=cfg.lr)
    logger = None
    if cfg.logger != "none":
        logger = get_logger(cfg.logger, logger_name=str(run_dir.parent),
                            experiment_name=run_dir.name)
        logger.log_hparams(asdict(cfg))

    def log(values: dict, step: int) -> None:
        if logger is not None:
            for name, value in values.items():
                logger.log_scalar(name, value, step=step)

    def save_checkpoint(frames: int) -> None:
        torch.save(
            {
                "actor": actor.state_dict(),
                "critic": critic.state_dict(),
                "optimizer": optimizer.state_dict(),
                "config": asdict(cfg),
                "frames": frames,
            },
            run_dir / "checkpoint.pt",
        )

    history = []  # (frames, greedy success rate, wall seconds)
    start = time.perf_counter()
    eval_time = 0.0

    def evaluate_and_checkpoint(frames: int) -> float:
        nonlocal eval_time
        t0 = time.perf_counter()
        result = evaluate(actor, eval_env, seed=cfg.seed + 1_000_003, max_steps=max_episode_steps)
        save_checkpoint(frames)
        eval_time += time.perf_counter() - t0
        history.append((frames, result["success_rate"], time.perf_counter() - start))
        log({f"eval/{k}": v for k, v in result.items()}, frames)
        return result["success_rate"]

    # --- training loop -------------------------------------------------------------------------
    frames, next_eval = 0, 0
    success = evaluate_and_checkpoint(frames)
    next_eval += cfg.eval_every
    progress = tqdm.tqdm(total=total_frames, unit="frames", disable=not cfg.progress_bar,
                         desc=f"{cfg.estimator} seed {cfg.seed}")
    collect_start = time.perf_counter()
    for batch in collector:
        collect_time = time.perf_counter() - collect_start
        frames += batch.numel()
        update_start = time.perf_counter()
        if not cfg.bootstrap_truncated:
            # Running out of steps ends the episode like any failure. (A bootstrap would read
            # the critic at the last, masked observation, a mid-tool-output window it is never
            # trained on; in our runs its guess kept "call tools until the budget runs out"
            # looking as good as answering.)
            batch["next", "terminated"] = batch["next", "done"].clone()
        # Advantages once per batch, from the critic that collected it, on the full
        # [num_envs, T] batch; then only the trainable steps go to the replay buffer.
        with torch.no_grad():
            loss.value_estimator(batch)
        buffer.empty()
        buffer.extend(select_trainable_steps(batch))
        stats = defaultdict(list)
        for _ in range(cfg.epochs):
            for minibatch in buffer:
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
        collector.update_policy_weights_()
        update_time = time.perf_counter() - update_start

        episodes = finished_episodes(batch)
        log({f"train/{k}": sum(v) / len(v) for k, v in stats.items()}, frames)
        log({f"train/{k}": v for k, v in episodes.items()}, frames)
        log({"train/trainable_steps": float(batch["loss_mask"].sum())}, frames)
        elapsed = time.perf_counter() - start
        log({"time/collect": collect_time, "time/update": update_time, "time/eval": eval_time,
             "time/total": elapsed, "time/fps": frames / elapsed}, frames)
        if frames >= next_eval or frames >= total_frames:
            success = evaluate_and_checkpoint(frames)
            while next_eval <= frames:
                next_eval += cfg.eval_every
        progress.update(batch.numel())
        progress.set_postfix(train_success=f"{episodes.get('success_rate', float('nan')):.2f}",
                             eval_success=f"{success:.2f}")
        collect_start = time.perf_counter()
    progress.close()
    collector.shutdown()
    eval_env.close()

    frames_to_threshold = next((f for f, s, _ in history if s >= SUCCESS_THRESHOLD), None)
    summary = {
        "config": asdict(cfg),
        "final_success_rate": history[-1][1],
        "frames_to_threshold": frames_to_threshold,
        "success_threshold": SUCCESS_THRESHOLD,
        "frames": frames,
        "wall_time_s": time.perf_counter() - start,
        "history": [{"frames": f, "success_rate": s, "wall_time_s": t} for f, s, t in history],
        "run_dir": str(run_dir),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    cfg = parse_config(argv, prog=prog)
    summary = train(cfg)
    solved = summary["frames_to_threshold"]
    print(
        f"{cfg.estimator} GAE, seed {cfg.seed}: final greedy success "
        f"{summary['final_success_rate']:.1%} after {summary['frames']} frames, "
        f"{SUCCESS_THRESHOLD:.0%} reached at "
        f"{'never' if solved is None else f'{solved} frames'}, "
        f"{summary['wall_time_s']:.0f} s; metrics and checkpoint in {summary['run_dir']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
