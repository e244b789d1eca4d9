"""Options of ``masked-rl llm-train`` and ``masked-rl llm-compare``, parsed and checked.

This module imports neither torch nor TorchRL nor transformers, so ``--help`` and every option
error come back at once; the commands import the training code only after parsing.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

from masked_rl_examples.ppo_tool_use.config import (OneLineErrorParser, _flag,
                                                    add_eval_arguments, check_device,
                                                    check_writable_folder, find_checkpoint)

ESTIMATORS = ("masked", "grpo", "plain")
CRITICS = ("separate", "shared")
CRITIC_TOKENS = ("auto", "trainable", "every")
LOGGERS = ("csv", "none")
MAX_SEED = 2**32 - 1
CONFIG_FILE = "config.json"
CHECKPOINT_FILE = "checkpoint.pt"
SUMMARY_FILE = "summary.json"


@dataclass(frozen=True)
class LLMConfig:
    """Every option of one ``masked-rl llm-train`` run (``--help`` lists them as flags)."""

    # --- run ---------------------------------------------------------------------------------
    estimator: str = "masked"
    """``masked``: masked GAE over the assistant tokens (masked_rl.llm: adapter, token critic,
    MaskedGAE, TokenPPOLoss); ``grpo``: TorchRL's GRPOLoss with the group-relative advantage
    (``group_size`` samples of each task); ``plain``: TorchRL's GAE with every token a
    transition (prompt, tool and template tokens included), same critic and loss as masked."""
    tokens: int = 340_000
    """Budget in sampled tokens (every generated token, end-of-turn tokens included; whole
    batches, so a run may end a batch past it). 340k is about 28 minutes of a masked run with
    two runs side by side on 2 cores."""
    seed: int = 0
    """Seed of the model's initialisation, torch's sampling and the training tasks."""
    device: str = "cpu"
    output: str = "runs/llm_ppo"
    """Parent folder of the run folder ``<estimator>-seed<seed>``."""
    threads: int | None = 1
    """torch intra-op threads (None: torch's default). One is fastest for these tiny models (4x
    faster than two on a loaded 2-core machine)."""
    progress_bar: bool = True
    logger: str = "csv"

    # --- task (masked_rl_envs.chat_tool_use) ---------------------------------------------------
    n_keys: int = 4
    n_values: int = 4
    n_queries: int = 2
    response_len: int = 8
    """Words per tool message."""
    max_turns: int = 5
    lookup_reward: float = 0.5
    """Reward for looking up the next queried key (the environment's default is 0.1; at 0.1 the
    policy settled on answering at once, measured: 1 turn, greedy success 5 % at 200k tokens)."""
    call_cost: float = 0.0
    """Reward subtracted for each tool message (a served lookup or an error)."""
    partial_credit: bool = True

    # --- model (masked_rl_envs.llm_factories) --------------------------------------------------
    hidden_size: int = 128
    """Width of the policy and the critic. Copying a looked-up value into the answer is an
    induction-style circuit: taught by teacher forcing on oracle transcripts, a 2-layer model
    of width 64 needs about 650 steps of 32 transcripts to find it, width 128 about 200."""
    num_layers: int = 2
    num_heads: int = 4
    max_new_tokens: int = 4
    """Tokens an assistant turn may generate (``answer v v`` plus ``<|im_end|>`` fits 4)."""
    temperature: float = 1.0
    end_of_turn_action: bool = True
    """masked, plain: each assistant turn's closing ``<|im_end|>`` is an action (trained), not
    only the content tokens of TorchRL's assistant mask. Off, the stop decision is never
    trained, and a policy that drifts to empty turns has no trainable token left to recover."""

    critic: str = "shared"
    """masked, plain: ``shared`` (default): a value head on the policy's trunk (one forward for
    logits and values; the value loss also trains the trunk); ``separate``: a critic model of
    the policy's size (its own forward and backward in every step). Measured with the other
    defaults: shared, 100 % greedy from 270k tokens on seed 0 (25 % and 15 % at 340k on seeds 1
    and 2), the update 1.25 s an iteration; separate, 3-8 % at 150k tokens on 3 seeds, the
    update 2.3 s an iteration (docs/experiments.md)."""

    critic_tokens: str = "auto"
    """masked, plain: where the critic's value loss is taken. ``trainable``: the assistant
    tokens (the actions); ``every``: every real token (masked: ``MaskedGAE``'s targets at
    masked tokens too, ``masked_value_targets=True``; the advantages are unchanged);
    ``auto``: ``trainable`` for masked, ``every`` for plain (TorchRL's GAE has a target at
    every token)."""

    # --- optimisation --------------------------------------------------------------------------
    episodes_per_batch: int = 64
    """Episodes per iteration (rollout, estimate, update)."""
    group_size: int = 8
    """grpo: samples of each task per batch (the group of the group-relative advantage);
    episodes_per_batch / group_size distinct tasks per batch. Other estimators: 1."""
    epochs: int = 4
    minibatch_size: int = 32
    """Episodes per gradient step."""
    lr: float = 3e-4
    """At 1e-3 the tiny model moves so far per iteration that 50-90 % of the trainable tokens'
    ratios are clipped."""
    max_grad_norm: float = 1.0
    clip_epsilon: float = 0.2
    entropy_coeff: float = 0.01
    normalize_advantage: bool = False
    """masked, plain: standardise the advantages over each minibatch's trainable tokens (as
    CleanRL's and Stable-Baselines3's PPO). Off by default: measured on seeds 0-2 after the head
    fix with ``critic_coeff=0.5`` (docs/experiments.md), it changes which seeds masked GAE learns, not how many (2/3 both
    ways), and plain GAE drops from 3/3 seeds to 1/3."""
    critic_coeff: float = 0.1
    """masked, plain: weight of the value loss. With the shared critic it also sets how hard the
    value loss pulls on the policy's trunk and how much of the clipped gradient norm it takes.
    Measured on seeds 0-2 (docs/experiments.md): masked GAE solved 2/3 seeds at 0.5 (seed 2 at
    chance) and 3/3 at 0.1, sooner on seeds 0 and 1; plain GAE the other way round, 3/3 at 0.5
    and 2/3 at 0.1. Before the head fix, 2.0 made masked seeds 1 and 2 worse."""
    bootstrap_truncated: bool = False
    """masked, plain: bootstrap from ``V'`` where the turn budget cut an episode (TorchRL's
    truncation). Off (default), the budget ends the episode with value 0: the transcript shows
    how many turns were used, so the budget is part of the state, and ``V'`` after a transcript's
    last token is a value the critic is never trained on."""
    gamma: float = 1.0
    lmbda: float = 0.95
    eval_every: int = 10_000
    """Sampled tokens between greedy evaluations and checkpoints."""
    eval_episodes: int = 128

    def __post_init__(self):
        _choice("estimator", self.estimator, ESTIMATORS)
        _choice("logger", self.logger, LOGGERS)
        _choice("critic", self.critic, CRITICS)
        _choice("critic_tokens", self.critic_tokens, CRITIC_TOKENS)
        for name, low in (("tokens", 1), ("n_keys", 1), ("n_values", 1), ("n_queries", 1),
                          ("response_len", 2), ("max_turns", 1), ("hidden_size", 4),
                          ("num_layers", 1), ("num_heads", 1), ("max_new_tokens", 1),
                          ("episodes_per_batch", 1), ("group_size", 1), ("epochs", 1),
                          ("minibatch_size", 1), ("eval_every", 1), ("eval_episodes", 1)):
            _int(name, getattr(self, name), low)
        _int("seed", self.seed, 0, MAX_SEED)
        if self.threads is not None:
            _int("threads", self.threads, 1)
        for name, low, high, low_open in (("lookup_reward", 0, math.inf, False),
                                          ("call_cost", 0, math.inf, False),
                                          ("temperature", 0, math.inf, True),
                                          ("lr", 0, math.inf, True),
                                          ("max_grad_norm", 0, math.inf, True),
                                          ("clip_epsilon", 0, math.inf, False),
                                          ("entropy_coeff", 0, math.inf, False),
                                          ("critic_coeff", 0, math.inf, False),
                                          ("gamma", 0, 1, False), ("lmbda", 0, 1, False)):
            _float(name, getattr(self, name), low, high, low_open)
        if self.n_queries > self.n_keys:
            raise ValueError(f"n_queries must be <= n_keys={self.n_keys}, got {self.n_queries}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size must be divisible by num_heads={self.num_heads}, "
                             f"got {self.hidden_size}")
        if self.estimator == "grpo":
            if self.group_size < 2:
                raise ValueError(f"group_size must be >= 2 for grpo (a group-relative "
                                 f"advantage needs a group), got {self.group_size}")
            if self.episodes_per_batch % self.group_size:
                raise ValueError(
                    f"episodes_per_batch must be a multiple of group_size={self.group_size} "
                    f"for grpo, got {self.episodes_per_batch}")

    @property
    def batch_group_size(self) -> int:
        """Samples per task in a training batch: ``group_size`` for grpo, else 1."""
        return self.group_size if self.estimator == "grpo" else 1

    @property
    def dense_critic(self) -> bool:
        """masked, plain: whether the value loss covers every real token (``critic_tokens``)."""
        if self.critic_tokens == "auto":
            return self.estimator == "plain"
        return self.critic_tokens == "every"

    def run_dir(self) -> Path:
        return Path(self.output) / f"{self.estimator}-seed{self.seed}"


RUNTIME_FIELDS = ("output", "threads", "progress_bar", "device", "tokens")
"""Fields a resumed run may change (a larger ``tokens`` extends a finished run, a smaller one
ends an interrupted run sooner)."""


_CHOICES = {"estimator": ESTIMATORS, "logger": LOGGERS, "critic": CRITICS,
            "critic_tokens": CRITIC_TOKENS}


def _choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def _int(name, value, low, high=None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        expected = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {expected}, got {value}")


def _float(name, value, low, high, low_open):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or (value <= low if low_open else value < low) or value > high:
        bound = f"> {low:g}" if low_open else f">= {low:g}"
        expected = f"a finite number {bound}" if high == math.inf else f"in [{low:g}, {high:g}]"
        raise ValueError(f"{name} must be {expected}, got {value}")


CRITIC_FIELDS = ("end_of_turn_action", "critic", "critic_tokens", "normalize_advantage",
                 "critic_coeff", "bootstrap_truncated", "gamma", "lmbda")
"""Fields only the critic-based estimators (masked, plain) read."""
GRPO_FIELDS = ("group_size",)
"""Fields only grpo reads."""


def unread_fields(estimator: str) -> tuple[str, ...]:
    """The options ``estimator``'s run never reads (changing them cannot change the run)."""
    return CRITIC_FIELDS if estimator == "grpo" else GRPO_FIELDS


def changed_options(saved: LLMConfig, cfg: LLMConfig) -> list[str]:
    """The options of ``cfg`` that differ from a saved run's and that its estimator reads."""
    ignored = set(RUNTIME_FIELDS) | set(unread_fields(cfg.estimator))
    return [f.name for f in fields(LLMConfig)
            if f.name not in ignored and getattr(saved, f.name) != getattr(cfg, f.name)]


def read_run_config(run_dir: Path) -> LLMConfig:
    path = Path(run_dir) / CONFIG_FILE
    try:
        return LLMConfig(**json.loads(path.read_text()))
    except FileNotFoundError:
        raise ValueError(f"{str(run_dir)!r} is not a run folder: it has no {CONFIG_FILE}") from None
    except (TypeError, ValueError) as err:
        raise ValueError(f"{str(path)!r} does not hold an llm-train configuration: {err}") from None


def add_options(parser: argparse.ArgumentParser, defaults: LLMConfig, skip=()) -> None:
    """One option per :class:`LLMConfig` field, without argparse defaults (only the given
    options are overlaid onto ``defaults``)."""
    for field in fields(LLMConfig):
        if field.name in skip:
            continue
        default = getattr(defaults, field.name)
        help_text = f"(default: {default})"
        if isinstance(default, bool):
            parser.add_argument(_flag(field.name), action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        elif field.name in _CHOICES:
            parser.add_argument(_flag(field.name), default=argparse.SUPPRESS, help=help_text,
                                choices=_CHOICES[field.name])
        else:
            kind = int if field.name == "threads" else type(default)
            parser.add_argument(_flag(field.name), type=kind, default=argparse.SUPPRESS,
                                help=help_text, metavar=field.name.upper())


def _overlay(parser, base: LLMConfig, given: dict) -> LLMConfig:
    try:
        return replace(base, **given)
    except ValueError as err:
        parser.error(str(err))


def _check_outside(parser, cfg: LLMConfig, run_dir: Path) -> None:
    try:
        check_device(cfg.device)
        check_writable_folder("output", run_dir)
    except ValueError as err:
        parser.error(str(err))


@dataclass
class LLMTrainCommand:
    config: LLMConfig
    run_dir: Path
    resume: bool
    overwrite: bool = False


def parse_llm_train_command(argv=None, prog=None) -> LLMTrainCommand:
    """The options of ``masked-rl llm-train``, checked (one-line error and exit 2 otherwise)."""
    parser = OneLineErrorParser(
        prog=prog,
        description="Token-level PPO with masked GAE (or GRPO, or plain token GAE) on the chat "
        "tool-use task, a tiny LlamaForCausalLM trained from scratch on TorchRL's LLM stack. "
        "The first Ctrl-C stops after the current iteration, checkpoints and exits with status "
        "130; --resume RUN_DIR continues (--resume RUN_DIR --tokens N extends a finished run).",
    )
    parser.add_argument("--resume", metavar="RUN_DIR", type=Path, default=argparse.SUPPRESS,
                        help="continue the run in RUN_DIR from its checkpoint, with its options")
    parser.add_argument("--overwrite", action="store_true", default=argparse.SUPPRESS,
                        help="replace the finished run the run folder holds (refused otherwise)")
    add_options(parser, LLMConfig())
    given = vars(parser.parse_args(argv))
    resume = given.pop("resume", None)
    overwrite = given.pop("overwrite", False)
    if overwrite and resume is not None:
        parser.error("--overwrite starts a fresh run; it cannot be combined with --resume")
    if resume is None:
        cfg = _overlay(parser, LLMConfig(), given)
        run_dir = cfg.run_dir()
    else:
        not_allowed = sorted(set(given) - set(RUNTIME_FIELDS))
        if not_allowed:
            parser.error(f"--resume continues a run with its saved options; "
                         f"{', '.join(map(_flag, not_allowed))} cannot be changed")
        run_dir = resume
        if not (run_dir / CHECKPOINT_FILE).is_file():
            parser.error(f"--resume: {str(run_dir)!r} holds no {CHECKPOINT_FILE}")
        try:
            saved = read_run_config(run_dir)
        except ValueError as err:
            parser.error(f"--resume: {err}")
        cfg = _overlay(parser, saved, given)
    _check_outside(parser, cfg, run_dir)
    return LLMTrainCommand(cfg, Path(run_dir), resume is not None, overwrite)


@dataclass
class LLMCompareCommand:
    base: LLMConfig
    seeds: list[int]
    estimators: tuple[str, ...]
    report: bool = False


def parse_llm_compare_command(argv=None, prog=None) -> LLMCompareCommand:
    """The options of ``masked-rl llm-compare``, checked."""
    parser = OneLineErrorParser(
        prog=prog,
        description="masked PPO vs GRPO vs plain token GAE on the chat tool-use task, same model, "
        "seeds and sampled-token budget: a table, summary.csv, curves.csv and curves.png in "
        "--output. Runs one after the other; re-running the same command skips finished runs "
        "and resumes interrupted ones (Ctrl-C: exit status 130).",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="distinct seeds, each trained with every estimator (default: 0 1 2)")
    parser.add_argument("--estimators", nargs="+", choices=ESTIMATORS, default=list(ESTIMATORS),
                        help="estimators to compare (default: masked grpo plain)")
    parser.add_argument("--report", action="store_true",
                        help="train nothing: write the table, CSVs and figure from the finished "
                        "runs --output holds, and name the runs not finished or not started")
    defaults = LLMConfig(output="runs/llm_compare", progress_bar=False)
    add_options(parser, defaults, skip=("estimator", "seed"))
    args = vars(parser.parse_args(argv))
    seeds, estimators = args.pop("seeds"), tuple(args.pop("estimators"))
    report = args.pop("report")
    if len(set(estimators)) != len(estimators):
        parser.error(f"--estimators must be distinct, got {' '.join(estimators)}")
    if len(set(seeds)) != len(seeds):
        parser.error(f"--seeds must be distinct, got {' '.join(map(str, seeds))}")
    base = _overlay(parser, defaults, args)
    for estimator in estimators:
        for seed in seeds:
            _overlay(parser, base, {"estimator": estimator, "seed": seed})
    _check_outside(parser, base, Path(base.output))
    return LLMCompareCommand(base, list(seeds), estimators, report)



@dataclass
class LLMEvalCommand:
    """What ``masked-rl llm-eval`` was asked: ``state`` is the loaded checkpoint."""

    checkpoint: Path
    state: dict
    config: LLMConfig
    episodes: int
    seed: int | None
    render: int
    device: str


def parse_llm_eval_command(argv=None, prog=None) -> LLMEvalCommand:
    """The options of ``masked-rl llm-eval``, checked (one-line error and exit 2 otherwise)."""
    parser = OneLineErrorParser(
        prog=prog,
        description="Greedy success of an llm-train checkpoint over N seeded episodes of its "
        "task; --render K also prints the first K transcripts.",
    )
    add_eval_arguments(parser, CHECKPOINT_FILE)
    parser.add_argument("--render", type=int, default=0, metavar="K",
                        help="print the transcripts of the first K episodes (default: 0)")
    args = parser.parse_args(argv)
    checkpoint = find_checkpoint(parser, args.path, CHECKPOINT_FILE)
    from .llm_ppo import read_checkpoint  # torch, only once the options are known to be sound

    try:
        state = read_checkpoint(checkpoint)
    except ValueError as err:
        parser.error(str(err))
    cfg = LLMConfig(**state["config"])
    episodes = cfg.eval_episodes if args.episodes is None else args.episodes
    if episodes < 1:
        parser.error(f"--episodes must be >= 1, got {episodes}")
    if args.seed is not None and not 0 <= args.seed <= MAX_SEED:
        parser.error(f"--seed must be in [0, {MAX_SEED}], got {args.seed}")
    if not 0 <= args.render <= episodes:
        parser.error(f"--render must be in [0, --episodes={episodes}], got {args.render}")
    device = args.device or cfg.device
    try:
        check_device(device)
    except ValueError as err:
        parser.error(str(err))
    return LLMEvalCommand(checkpoint, state, replace(cfg, device=device), episodes, args.seed,
                          args.render, device)
