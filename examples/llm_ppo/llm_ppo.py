"""``masked-rl llm-train``: token-level PPO with masked GAE on the chat tool-use task.

One iteration: a batch of episodes played on TorchRL's ``ChatEnv`` by a ``TransformersWrapper``
(sampling), a scoring pass over the final transcripts (old log-probs and the assistant mask, one
forward per transcript), the estimator's advantages (:mod:`.estimators`), then ``epochs`` passes
of minibatch updates. The budget is counted in sampled tokens. Greedy success over seeded
evaluation episodes is measured every ``eval_every`` tokens, where a checkpoint is written.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import tqdm
from torchrl.record.loggers import get_logger

from masked_rl_envs.chat_tool_use import ChatToolUseConfig, make_chat_tool_use_env
from masked_rl_envs.llm_factories import make_model, make_tokenizer
from masked_rl_examples.ppo_tool_use import utils as classic_utils
from masked_rl_examples.ppo_tool_use.config import RunFolderError, check_fresh_run_folder

from .config import (CHECKPOINT_FILE, CONFIG_FILE, SUMMARY_FILE, LLMConfig, LLMEvalCommand,
                     LLMTrainCommand, changed_options)
from .estimators import make_estimator
from .rollout import (episode_statistics, evaluate, make_wrappers, render_episode, rollout,
                      score, trim_left_padding)

SUCCESS_THRESHOLD = 0.9
EVAL_SEED_OFFSET = 1_000_003
"""Evaluation tasks are drawn with ``seed + EVAL_SEED_OFFSET``, apart from training's."""


@dataclass
class Progress:
    """Where a run stands; saved in every checkpoint, restored on resume."""

    tokens: int = 0
    """Sampled tokens so far (the budget's unit)."""
    episodes: int = 0
    iterations: int = 0
    next_eval: int = 0
    wall_time_s: float = 0.0
    eval_time_s: float = 0.0
    history: list[dict] = field(default_factory=list)
    """One ``{"tokens", "episodes", "success_rate", "wall_time_s"}`` per greedy evaluation."""


def task_config(cfg: LLMConfig) -> ChatToolUseConfig:
    return ChatToolUseConfig(n_keys=cfg.n_keys, n_values=cfg.n_values, n_queries=cfg.n_queries,
                             response_len=cfg.response_len, max_turns=cfg.max_turns,
                             lookup_reward=cfg.lookup_reward, call_cost=cfg.call_cost,
                             partial_credit=cfg.partial_credit)


def build(cfg: LLMConfig):
    """Tokenizer, model, wrappers, estimator and optimizer of a run (seeded by ``cfg.seed``)."""
    tokenizer = make_tokenizer(n_keys=cfg.n_keys, n_values=cfg.n_values, n_filler=1)
    model = make_model(tokenizer, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                       num_heads=cfg.num_heads, seed=cfg.seed,
                       max_position_embeddings=max_transcript_tokens(cfg))
    model = model.to(cfg.device).eval()  # no dropout in the config; eval() keeps it explicit
    wrappers = make_wrappers(model, tokenizer, max_new_tokens=cfg.max_new_tokens,
                             temperature=cfg.temperature, device=cfg.device)
    estimator = make_estimator(cfg, model, tokenizer, wrappers)
    optimizer = torch.optim.Adam(estimator.parameters(), lr=cfg.lr)
    return tokenizer, model, wrappers, estimator, optimizer


def max_transcript_tokens(cfg: LLMConfig) -> int:
    """An upper bound on a transcript's length in tokens (the model's position budget)."""
    prompt = 5 + cfg.n_queries  # <|im_start|> user \n keys <|im_end|> \n
    turn = 5 + cfg.max_new_tokens
    tool = 5 + cfg.response_len
    return prompt + cfg.max_turns * (turn + tool) + 8


def read_checkpoint(path: Path) -> dict:
    """A checkpoint of this recipe; ``ValueError`` (one line, naming the file) for any file that
    is not one: truncated, another format, other keys."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # no code runs on load
        LLMConfig(**state["config"])
        return state
    except Exception as err:  # noqa: BLE001  (any unreadable file is the same user error)
        first_line = str(err).splitlines()[0] if str(err) else ""
        raise ValueError(f"{str(path)!r} is not an llm-train checkpoint: "
                         f"{type(err).__name__}: {first_line}") from None


def open_run_dir(run_dir: Path, cfg: LLMConfig, resume: bool, overwrite: bool = False) -> dict | None:
    """Prepare ``run_dir``; the checkpoint to resume from (``None`` for a fresh run). A fresh
    run refuses a folder holding a finished run unless ``overwrite`` (``RunFolderError``), then
    drops the folder's earlier checkpoint and logs."""
    checkpoint = None
    if not resume:
        check_fresh_run_folder(run_dir, overwrite, budget_option="--tokens")
    if resume:
        checkpoint = read_checkpoint(run_dir / CHECKPOINT_FILE)
        changed = changed_options(LLMConfig(**checkpoint["config"]), cfg)
        if changed:
            raise ValueError(f"cannot resume {str(run_dir)!r} with other options than its "
                             f"checkpoint's: {', '.join(changed)} differ")
    else:
        (run_dir / CHECKPOINT_FILE).unlink(missing_ok=True)
        for logs in ("scalars", "texts"):
            shutil.rmtree(run_dir / logs, ignore_errors=True)
    (run_dir / SUMMARY_FILE).unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    classic_utils.write_text_atomically(json.dumps(asdict(cfg), indent=2), run_dir / CONFIG_FILE)
    return checkpoint


def make_logger(cfg: LLMConfig, run_dir: Path, progress: Progress):
    if cfg.logger == "none":
        return None
    classic_utils.truncate_csv_scalars(run_dir, progress.tokens)
    logger = get_logger("csv", logger_name=str(run_dir.parent), experiment_name=run_dir.name)
    if not progress.history:
        logger.log_hparams(asdict(cfg))
    return logger


def log(logger, values: dict, step: int) -> None:
    if logger is not None:
        for name, value in values.items():
            logger.log_scalar(name, float(value), step=step)


def evaluate_greedy(cfg, wrappers, tokenizer, progress: Progress, logger) -> float:
    start = time.perf_counter()
    result = evaluate(wrappers.greedy, task_config(cfg), episodes=cfg.eval_episodes,
                      seed=cfg.seed + EVAL_SEED_OFFSET, pad_token_id=tokenizer.pad_token_id,
                      tokenizer=tokenizer)
    progress.eval_time_s += time.perf_counter() - start
    progress.history.append({"tokens": progress.tokens, "episodes": progress.episodes,
                             "success_rate": result["success_rate"],
                             "wall_time_s": progress.wall_time_s})
    log(logger, {f"eval/{k}": v for k, v in result.items()}, progress.tokens)
    return result["success_rate"]


def update(estimator, optimizer, data, cfg: LLMConfig, generator: torch.Generator) -> dict:
    """``epochs`` passes of minibatch gradient steps over the batch's episodes; returns the
    last minibatch's loss terms."""
    batch = data.batch_size[0]
    stats = {}
    for _ in range(cfg.epochs):
        order = torch.randperm(batch, generator=generator)
        for start in range(0, batch, cfg.minibatch_size):
            minibatch = trim_left_padding(data[order[start:start + cfg.minibatch_size]])
            losses = estimator.loss(minibatch)
            total = sum(v for k, v in losses.items() if k.startswith("loss_") and v is not None)
            optimizer.zero_grad(set_to_none=True)
            total.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(estimator.parameters(), cfg.max_grad_norm)
            optimizer.step()
            stats = {k: float(v.detach()) for k, v in losses.items()
                     if v is not None and torch.is_tensor(v) and v.numel() == 1}
            stats["grad_norm"] = float(grad_norm)
    return stats


def save_checkpoint(run_dir, cfg, progress, stateful: dict, env, generator) -> None:
    state = {
        "config": asdict(cfg),
        "progress": asdict(progress),
        **{name: part.state_dict() for name, part in stateful.items()},
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        "minibatch_rng": generator.get_state(),
        "tasks": env.transform.generator_state(),
    }
    classic_utils.save_atomically(state, run_dir / CHECKPOINT_FILE)


def write_summary(run_dir: Path, cfg: LLMConfig, progress: Progress, status: str) -> dict:
    history = progress.history
    reached = next((h for h in history if h["success_rate"] >= SUCCESS_THRESHOLD), None)
    summary = {
        "status": status,
        "config": asdict(cfg),
        "final_success_rate": history[-1]["success_rate"],
        "tokens_to_threshold": None if reached is None else reached["tokens"],
        "time_to_threshold_s": None if reached is None else reached["wall_time_s"],
        "success_threshold": SUCCESS_THRESHOLD,
        "tokens": progress.tokens,
        "episodes": progress.episodes,
        "iterations": progress.iterations,
        "wall_time_s": progress.wall_time_s,
        "history": history,
        "run_dir": str(run_dir),
    }
    classic_utils.write_text_atomically(json.dumps(summary, indent=2), run_dir / SUMMARY_FILE)
    return summary


def train(cfg: LLMConfig, *, run_dir: Path | None = None, resume: bool = False,
          overwrite: bool = False) -> dict:
    """Train one run; returns the summary also written to ``<run_dir>/summary.json``.

    ``"status"`` is ``"completed"``, or ``"interrupted"`` after a SIGINT (the run stops after
    the iteration it is in and checkpoints). With ``resume`` the run continues from
    ``<run_dir>/checkpoint.pt``: the model, critic and optimizer, the torch generators (sampling
    and minibatch order), the task generator and the counters are restored, and the CSV log is
    cut back to the checkpoint, so on the CPU with the same thread count a resumed run makes the
    same iterations as one never stopped.

    One process at a time writes a run folder (``RunFolderError`` naming the holder's pid
    otherwise); a fresh run refuses a folder holding a finished run unless ``overwrite``.
    """
    run_dir = Path(run_dir) if run_dir is not None else cfg.run_dir()
    with classic_utils.run_folder_lock(run_dir):  # one writer per folder
        return _train(cfg, run_dir, open_run_dir(run_dir, cfg, resume, overwrite))


def _train(cfg: LLMConfig, run_dir: Path, checkpoint: dict | None) -> dict:
    """:func:`train`, in a folder opened and locked."""
    started = time.perf_counter()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tokenizer, model, wrappers, estimator, optimizer = build(cfg)
    env = make_chat_tool_use_env(cfg.episodes_per_batch, task_config(cfg), tokenizer=tokenizer,
                                 seed=cfg.seed, group_size=cfg.batch_group_size)
    generator = torch.Generator().manual_seed(cfg.seed)
    stateful = {"estimator": estimator, "optimizer": optimizer}
    progress = Progress()
    if checkpoint is not None:
        for name, part in stateful.items():
            part.load_state_dict(checkpoint[name])
        progress = Progress(**checkpoint["progress"])
        torch.set_rng_state(checkpoint["torch_rng"])
        if checkpoint["cuda_rng"] is not None:
            torch.cuda.set_rng_state_all(checkpoint["cuda_rng"])
        generator.set_state(checkpoint["minibatch_rng"])
        env.transform.set_generator_state(checkpoint["tasks"])
    wall_time_before = progress.wall_time_s
    logger = make_logger(cfg, run_dir, progress)
    bar = tqdm.tqdm(total=cfg.tokens, initial=min(progress.tokens, cfg.tokens), unit="tok",
                    disable=not cfg.progress_bar, desc=f"{cfg.estimator} seed {cfg.seed}")
    interrupt = classic_utils.StopOnInterrupt()
    try:
        with interrupt:
            if not progress.history:
                evaluate_greedy(cfg, wrappers, tokenizer, progress, logger)
                progress.next_eval = cfg.eval_every
                save_checkpoint(run_dir, cfg, progress, stateful, env, generator)
            while progress.tokens < cfg.tokens and not interrupt.requested:
                t0 = time.perf_counter()
                batch = rollout(env, wrappers.sample, tokenizer.pad_token_id)
                t1 = time.perf_counter()
                data = score(wrappers.score, batch.history)
                estimator.prepare(data, batch)
                t2 = time.perf_counter()
                stats = update(estimator, optimizer, data, cfg, generator)
                t3 = time.perf_counter()
                progress.tokens += batch.sampled_tokens
                progress.episodes += len(batch.success)
                progress.iterations += 1
                progress.wall_time_s = wall_time_before + time.perf_counter() - started
                values = {f"train/{k}": v for k, v in stats.items()}
                values.update({
                    "train/success_rate": batch.success.float().mean(),
                    "train/episode_return": batch.returns.mean(),
                    "train/num_turns": batch.num_turns.float().mean(),
                    "train/trainable_tokens": data["masks", "all_assistant_mask"].sum(),
                    "time/rollout": t1 - t0, "time/score_estimate": t2 - t1,
                    "time/update": t3 - t2, "time/total": progress.wall_time_s,
                })
                log(logger, values, progress.tokens)
                if progress.tokens >= progress.next_eval or progress.tokens >= cfg.tokens:
                    evaluate_greedy(cfg, wrappers, tokenizer, progress, logger)
                    while progress.next_eval <= progress.tokens:
                        progress.next_eval += cfg.eval_every
                    save_checkpoint(run_dir, cfg, progress, stateful, env, generator)
                bar.update(min(progress.tokens, cfg.tokens) - bar.n)
                bar.set_postfix(train_success=f"{batch.success.float().mean():.2f}",
                                eval_success=f"{progress.history[-1]['success_rate']:.2f}")
        progress.wall_time_s = wall_time_before + time.perf_counter() - started
        if interrupt.requested:
            save_checkpoint(run_dir, cfg, progress, stateful, env, generator)
    finally:
        bar.close()
    return write_summary(run_dir, cfg, progress, "interrupted" if interrupt.requested
                         else "completed")


def run_llm_eval_command(command: LLMEvalCommand) -> int:
    """Run ``masked-rl llm-eval``: greedy success over seeded episodes, and transcripts."""
    cfg, state = command.config, command.state
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    tokenizer, _, wrappers, estimator, _ = build(cfg)
    estimator.load_state_dict(state["estimator"])
    seed = cfg.seed + EVAL_SEED_OFFSET if command.seed is None else command.seed
    env = make_chat_tool_use_env(command.episodes, task_config(cfg), tokenizer=tokenizer, seed=seed)
    result = rollout(env, wrappers.greedy, tokenizer.pad_token_id)
    stats = episode_statistics(result)
    print(f"{cfg.estimator}, seed {cfg.seed}, checkpoint at {state['progress']['tokens']} sampled "
          f"tokens: greedy success {stats['success_rate']:.1%} over {command.episodes} episodes "
          f"(seed {seed}), mean return {stats['episode_return']:.3f}, "
          f"{stats['num_turns']:.2f} turns and {stats['num_tool_calls']:.2f} tool calls an episode")
    tables, queries = env.transform.tables, env.transform.queries
    for index in range(command.render):
        table = " ".join(f"k{k}=v{v}" for k, v in enumerate(tables[index]))
        asked = " ".join(f"k{k}" for k in queries[index])
        print(f"\nepisode {index}: table {table}; asked {asked}\n{render_episode(result, index)}")
    return 0


def run_llm_train_command(command: LLMTrainCommand) -> int:
    """Run ``masked-rl llm-train``; returns the exit status (130 when interrupted)."""
    cfg = command.config
    try:
        summary = train(cfg, run_dir=command.run_dir, resume=command.resume,
                        overwrite=command.overwrite)
    except (RunFolderError, OSError, ValueError) as err:
        message = classic_utils.run_error_message(err, command.run_dir, "masked-rl llm-train")
        if message is None:
            raise
        print(f"masked-rl llm-train: error: {message}", file=sys.stderr)
        return 2
    reached = summary["tokens_to_threshold"]
    print(
        f"{cfg.estimator}, seed {cfg.seed}: final greedy success "
        f"{summary['final_success_rate']:.1%} after {summary['tokens']} sampled tokens "
        f"({summary['episodes']} episodes), {SUCCESS_THRESHOLD:.0%} reached at "
        f"{'never' if reached is None else f'{reached} tokens'}, "
        f"{summary['wall_time_s']:.0f} s; metrics and checkpoint in {summary['run_dir']}"
    )
    if summary["status"] == "interrupted":
        print(f"interrupted after {summary['tokens']} of {cfg.tokens} tokens; continue with: "
              f"masked-rl llm-train --resume {summary['run_dir']}", file=sys.stderr)
        return 130
    return 0
