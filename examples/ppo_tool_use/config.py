"""Options of the PPO tool-use recipe: the ``Config`` dataclass, the command lines, the checks.

This module imports neither torch nor TorchRL, so ``--help`` and every option error come back
at once: ``masked-rl train --help`` builds its parser here and imports the training code only
once the options are known to be good.

- :class:`Config`: one field per training option, each with a docstring.
- :func:`parse_train_command`, :func:`parse_compare_command`, :func:`parse_eval_command`: the
  command lines of ``masked-rl train``, ``compare`` and ``eval`` (explicit ``argparse``). Every
  error is one line, ``<prog>: error: <what>``, exit status 2, printed before anything is
  created: range errors come from ``Config.__post_init__``, the rest from
  :func:`check_config` (the environment id, the device, the logger backend, the output folder,
  rows long enough to hold a trainable step).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import tempfile
from dataclasses import dataclass, fields, replace
from pathlib import Path

ESTIMATORS = ("masked", "plain", "zeroed", "terminal-only")
"""Values of ``--estimator``: see ``set_value_estimator`` in ``ppo_tool_use.py``."""
ENCODERS = ("mlp", "attention")
"""Values of ``--encoder``: see ``make_actor_critic`` in ``utils.py``."""
BACKENDS = ("batched", "gym")
"""Values of ``--backend``: see ``make_env`` in ``utils.py``."""
ENV_OVERRIDES = ("response_len", "closing_len")
"""``ToolUseEnv`` arguments a run may override (``--response-len``, ``--closing-len``)."""
LOGGERS = ("csv", "tensorboard", "wandb", "mlflow", "none")
"""Values of ``--logger``: TorchRL logger backends (``none``: no logger)."""
RUNTIME_FIELDS = ("output", "progress_bar", "threads")
"""Fields that do not change what a run computes (``threads`` only up to floating-point
summation order): ``compare`` ignores them when it matches an existing run folder."""
RESUME_OPTIONS = ("frames", "progress_bar", "threads")
"""The only options ``train --resume`` accepts: a resumed run keeps its saved configuration,
except that ``frames`` may grow (a finished run is extended)."""
MAX_SEED = 2**32 - 1
MAX_LEADING_STEPS = 100_000


@dataclass
class Config:
    """Every option of one training run (``masked-rl train --help`` lists them as flags)."""

    # --- run ---------------------------------------------------------------------------------
    env: str = "MaskedRL/ToolUse-v0"
    """Gymnasium id of the environment (any registered id whose observations carry a
    ``"loss_mask"``: ``MaskedRL/ToolUse-v0``, ``MaskedRL/ToolUseHard-v0``, ...)."""
    estimator: str = "masked"
    """Advantage estimator, one of :data:`ESTIMATORS`: ``masked`` (masked_rl.MaskedGAE),
    ``plain`` (TorchRL's GAE, every step a transition, critic trained on every step), ``zeroed``
    (values and rewards multiplied by the mask, then TorchRL's GAE) or ``terminal-only`` (the
    reference system: GAE on trainable steps, the terminal reward moved to the last one)."""
    response_len: int | None = None
    """Override the tool-output length of a ``MaskedRL/ToolUse*`` id (None: the id's); the window
    grows to hold the transcript up to the answer and the step budget to fit the oracle, each
    with two wasted turns (``Config.env_kwargs``)."""
    closing_len: int | None = None
    """Override the closing-block length of a ``MaskedRL/ToolUse*`` id (None: the id's), with the
    window and step budget grown as for ``response_len``."""
    frames: int = 2_000_000
    """Environment steps to train for, masked steps included (rounded up to whole batches)."""
    seed: int = 0
    """Seed of torch, the training environments and the evaluation episodes, in [0, 2**32)."""
    device: str = "cpu"
    """Device of the networks and the loss (the environments run on the CPU)."""
    output: str = "runs/ppo_tool_use"
    """Parent folder of the run folder ``<estimator>-seed<seed>`` (metrics, checkpoint, summary)."""
    threads: int | None = None
    """torch intra-op threads, >= 1 (None: torch's default)."""
    progress_bar: bool = True
    """Show a tqdm progress bar over frames."""
    logger: str = "csv"
    """TorchRL logger backend, one of :data:`LOGGERS`."""

    # --- collection ----------------------------------------------------------------------------
    num_envs: int = 128
    """Environments stepped together (a synchronous gymnasium vector env per worker)."""
    workers: int = 1
    """Collector processes; above 1, TorchRL's MultiSyncCollector splits num_envs over them."""
    backend: str = "batched"
    """Environment implementation, one of :data:`BACKENDS`: ``batched`` (tensor ops over all
    environments, masked_rl_envs.ToolUseBatchedEnv, several times faster) or ``gym`` (gymnasium's
    vector env in TorchRL's GymWrapper)."""
    skip_masked_steps: bool = True
    """Collect with masked_rl.SkipMaskedSteps: the policy network runs on trainable steps only."""
    complete_episodes: bool = True
    """masked_rl.CompleteEpisodes: each row's unfinished episode is held back and estimated with
    the next batch, so no episode is cut at a batch end (no bootstrap inside a masked block)."""
    frames_per_batch: int = 16384
    """Environment steps per collected batch (per PPO iteration), ``num_envs`` rows of
    ``frames_per_batch / num_envs`` steps; about 1 in 10 is trainable. Long rows matter: a row
    cut mid-episode bootstraps from the critic instead of carrying the reward back."""

    # --- PPO -----------------------------------------------------------------------------------
    gamma: float = 0.99
    """Discount factor, in [0, 1] (TorchRL's default)."""
    lmbda: float = 0.95
    """GAE trace decay, in [0, 1] (TorchRL's default)."""
    epochs: int = 8
    """Passes over each batch's trainable steps (advantages are estimated once per batch)."""
    minibatch_size: int = 256
    """Trainable steps per gradient step (masked steps never enter the replay buffer)."""
    lr: float = 2e-3
    """Adam learning rate, > 0."""
    anneal_lr: bool = False
    """Decay the learning rate linearly to 0 over the run, batch by batch (CleanRL's PPO): each
    batch's updates use ``lr * (1 - frames before the batch / total frames)``."""
    max_grad_norm: float = 0.5
    """Gradient-norm clipping threshold, > 0."""
    clip_epsilon: float = 0.2
    """PPO ratio clipping, >= 0."""
    entropy_coeff: float = 0.01
    """Weight of the entropy bonus, >= 0."""
    critic_coeff: float = 0.5
    """Weight of the critic (squared error) loss, >= 0."""
    normalize_advantage: bool = True
    """Standardise advantages per minibatch (statistics over trainable steps only)."""
    masked_value_targets: bool = False
    """``masked`` and ``terminal-only``: also write value targets at masked steps and train the
    critic on them (docs/semantics.md); ``plain`` always trains its critic on every step."""
    critic_extra_steps: int = 256
    """Steps that train the critic only (a value target, no action) added at random to each
    minibatch, when the estimator has any (``plain``, or ``--masked-value-targets``)."""
    bootstrap_truncated: bool = False
    """Bootstrap from the critic when an episode hits the step budget (TorchRL's default).
    Off: running out of steps ends the episode like any failure."""

    # --- networks ------------------------------------------------------------------------------
    encoder: str = "mlp"
    """Token-window encoder, one of :data:`ENCODERS`: ``mlp`` (embeddings concatenated position
    by position, tanh MLP) or ``attention`` (learned queries attending over the window)."""
    embed_dim: int = 8
    """Token embedding size; the window's embeddings are concatenated position by position."""
    hidden: int = 64
    """Hidden units per layer of the token-window encoder."""
    layers: int = 1
    """Hidden (tanh) layers of the token-window encoder."""
    shared: bool = True
    """One encoder for the policy and the critic (TorchRL's ActorValueOperator); else one each."""

    # --- evaluation and checkpoints ------------------------------------------------------------
    eval_every: int = 81_920
    """Frames between greedy evaluations (and checkpoints)."""
    eval_episodes: int = 100
    """Greedy episodes per evaluation (the same seeded tasks every time)."""

    def __post_init__(self):
        """Range checks that need nothing but the values (see :func:`check_config` for the rest)."""
        _require_choice("estimator", self.estimator, ESTIMATORS)
        _require_choice("logger", self.logger, LOGGERS)
        _require_choice("encoder", self.encoder, ENCODERS)
        _require_choice("backend", self.backend, BACKENDS)
        for name in ENV_OVERRIDES:
            if getattr(self, name) is not None:
                _require_int(name, getattr(self, name), 4 if name == "response_len" else 1)
        _require_int("critic_extra_steps", self.critic_extra_steps, 0)
        for name in ("env", "device", "output"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        for name in ("frames", "num_envs", "workers", "frames_per_batch", "epochs",
                     "minibatch_size", "eval_episodes", "eval_every", "embed_dim", "hidden",
                     "layers"):
            _require_int(name, getattr(self, name), 1)
        _require_int("seed", self.seed, 0, MAX_SEED)
        if self.threads is not None:
            _require_int("threads", self.threads, 1)
        for name in ("lr", "max_grad_norm"):
            _require_float(name, getattr(self, name), 0.0, math.inf, low_open=True)
        for name in ("clip_epsilon", "entropy_coeff", "critic_coeff"):
            _require_float(name, getattr(self, name), 0.0, math.inf)
        for name in ("gamma", "lmbda"):
            _require_float(name, getattr(self, name), 0.0, 1.0)
        for name in ("progress_bar", "normalize_advantage", "anneal_lr", "bootstrap_truncated", "shared",
                     "skip_masked_steps", "complete_episodes", "masked_value_targets"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.num_envs % self.workers:
            raise ValueError(
                f"num_envs ({self.num_envs}) must be a multiple of workers ({self.workers})"
            )
        if self.frames_per_batch % self.num_envs:
            raise ValueError(
                f"frames_per_batch ({self.frames_per_batch}) must be a multiple of num_envs "
                f"({self.num_envs})"
            )

    @property
    def total_frames(self) -> int:
        """``frames`` rounded up to whole batches: what a run actually trains for."""
        return -(-self.frames // self.frames_per_batch) * self.frames_per_batch

    @property
    def steps_per_row(self) -> int:
        """Length ``T`` of a collected row: ``frames_per_batch / num_envs``."""
        return self.frames_per_batch // self.num_envs

    def env_kwargs(self) -> dict:
        """Constructor arguments overriding the id's (empty without ``response_len`` /
        ``closing_len``): those given, and a window and step budget that fit them."""
        overrides = {name: getattr(self, name) for name in ENV_OVERRIDES
                     if getattr(self, name) is not None}
        if not overrides:
            return {}
        import inspect

        import gymnasium as gym

        import masked_rl_envs  # noqa: F401  (registers the ids)
        from masked_rl_envs import ToolUseEnv

        spec = gym.spec(self.env.rpartition(":")[2])
        defaults = {name: p.default for name, p in inspect.signature(ToolUseEnv).parameters.items()}
        merged = {**defaults, **spec.kwargs, **overrides}
        queries, turn = merged["n_queries"], (2 if merged["call_prefix"] else 1) + merged["response_len"]
        # The oracle's transcript up to its answer, plus two wasted turns: what the window must
        # hold to answer; the budget adds the closing block.
        before_closing = 2 * (1 + queries) + (queries + 2) * turn
        budget = before_closing + merged["closing_len"]
        return {**overrides, "window": max(merged["window"], before_closing), "max_steps": budget}

    def run_dir(self) -> Path:
        """The run folder of a fresh run: ``<output>/<estimator>-seed<seed>``."""
        return Path(self.output) / f"{self.estimator}-seed{self.seed}"


def _require_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def _require_int(name, value, low, high=None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        expected = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {expected}, got {value}")


def _require_float(name, value, low, high, low_open=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    too_low = value <= low if low_open else value < low
    if not math.isfinite(value) or too_low or value > high:
        if high == math.inf:
            expected = f"a finite number {'>' if low_open else '>='} {low:g}"
        else:
            expected = f"in [{low:g}, {high:g}]"
        raise ValueError(f"{name} must be {expected}, got {value}")


# --- checks that look outside the values ------------------------------------------------------


def leading_environment_steps(env_id: str, **env_kwargs) -> int:
    """Steps an episode of ``env_id`` takes before its first trainable step (the prompt).

    Plays one episode from ``reset(seed=0)`` until its observation's ``"loss_mask"`` is 1;
    actions on masked steps are ignored by the environment, so any action will do.
    """
    import gymnasium as gym
    import numpy as np

    env = gym.make(env_id, **env_kwargs)
    try:
        obs, _ = env.reset(seed=0)
        if not isinstance(obs, dict) or "loss_mask" not in obs:
            raise ValueError(
                f"env {env_id!r} must have dict observations with a 'loss_mask' entry, "
                f"got {type(obs).__name__} observations"
            )
        for steps in range(MAX_LEADING_STEPS):
            if int(np.asarray(obs["loss_mask"]).reshape(-1)[0]):
                return steps
            obs, _, terminated, truncated, _ = env.step(0)
            if terminated or truncated:
                raise ValueError(f"env {env_id!r} ended an episode without a trainable step")
        raise ValueError(f"env {env_id!r} has no trainable step in its first "
                         f"{MAX_LEADING_STEPS} steps")
    finally:
        env.close()


def check_config(cfg: Config, run_dir: Path | None = None) -> None:
    """Everything about ``cfg`` that its values alone cannot tell; raises ``ValueError``.

    The environment id is registered and its rows of ``cfg.steps_per_row`` steps can hold a
    trainable step; the device exists; the logger backend is installed; the run folder
    (``run_dir``, default ``cfg.run_dir()``) can be created or written. Creates nothing.
    """
    import gymnasium as gym

    import masked_rl_envs  # noqa: F401  (registers the MaskedRL ids)

    module, _, env_id = cfg.env.rpartition(":")  # gymnasium's "module:Namespace/Name-v0"
    if module:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ValueError(f"env: cannot import {module!r} for {cfg.env!r}: {err}") from None
    if env_id not in gym.registry:
        known = ", ".join(sorted(i for i in gym.registry if i.startswith("MaskedRL/")))
        raise ValueError(f"env: unknown environment id {cfg.env!r} (registered: {known})")
    overrides = [name for name in ENV_OVERRIDES if getattr(cfg, name) is not None]
    if overrides and "ToolUseEnv" not in str(gym.spec(env_id).entry_point):
        raise ValueError(f"{', '.join(map(_flag, overrides))}: only for MaskedRL/ToolUse* ids, "
                         f"got env {cfg.env!r}")
    leading = leading_environment_steps(cfg.env, **cfg.env_kwargs())
    if cfg.steps_per_row <= leading:
        raise ValueError(
            f"rows of frames_per_batch / num_envs = {cfg.frames_per_batch} / {cfg.num_envs} = "
            f"{cfg.steps_per_row} steps cannot hold a trainable step: every episode of "
            f"{cfg.env} starts with {leading} environment-written steps; use frames_per_batch "
            f">= {(leading + 1) * cfg.num_envs}"
        )
    check_device(cfg.device)
    if cfg.logger not in ("csv", "none"):
        if importlib.util.find_spec(cfg.logger) is None:
            raise ValueError(f"logger: {cfg.logger!r} needs the {cfg.logger} package installed")
    check_writable_folder("output", run_dir if run_dir is not None else cfg.run_dir())


def check_device(device: str) -> None:
    """``device`` names a device torch can use here (``cpu``, ``cuda``, ``cuda:N``, ``mps``)."""
    if device == "cpu":  # no need to import torch for the common case
        return
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"device: expected cpu, cuda or cuda:N, got {device!r}") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} asked for, but CUDA is not available here")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(
                f"device: {device!r} asked for, but there are {torch.cuda.device_count()} "
                "CUDA devices"
            )
    elif parsed.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device: {device!r} asked for, but MPS is not available here")
    elif parsed.type != "cpu":
        raise ValueError(f"device: expected cpu, cuda or cuda:N, got {device!r}")


def check_writable_folder(name: str, folder: Path) -> None:
    """``folder`` is a writable folder, or can be created as one; leaves nothing behind."""
    folder = Path(folder).absolute()
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(
            f"{name}: {str(existing)!r} is a file, cannot hold the folder {str(folder)!r}")
    try:  # a real write: os.access says yes to root on read-only file systems
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise ValueError(f"{name}: cannot write to {str(existing)!r} ({err.strerror})") from None


# --- command lines ----------------------------------------------------------------------------


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``<prog>: error: <message>`` (exit 2)."""

    def __init__(self, *args, **kwargs):
        # No abbreviations: `--estimator` must not silently mean compare's `--estimators`.
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_options(parser: argparse.ArgumentParser, defaults: Config, skip=()) -> None:
    """One option per :class:`Config` field (``entropy_coeff`` -> ``--entropy-coeff``).

    Options are not given defaults here: :func:`config_from_options` overlays the options
    that were given onto ``defaults``, so a command also knows which ones the user set.
    """
    s = argparse.SUPPRESS
    helps = {
        "env": "Gymnasium id of the environment",
        "estimator": "advantage estimator",
        "frames": "environment steps to train for, masked steps included (rounded up to "
                  "whole batches)",
        "seed": "seed of torch, the training environments and the evaluation episodes",
        "device": "device of the networks and the loss: cpu, cuda, cuda:N",
        "output": "parent folder of the run folder <estimator>-seed<seed>",
        "threads": "torch intra-op threads, >= 1 (default: torch's choice)",
        "progress_bar": "show a progress bar over frames",
        "logger": "TorchRL logger backend",
        "num_envs": "environments stepped together",
        "workers": "collector processes (TorchRL MultiSyncCollector above 1)",
        "frames_per_batch": "environment steps per batch: num_envs rows of "
                            "frames_per_batch / num_envs steps",
        "gamma": "discount factor, in [0, 1]",
        "lmbda": "GAE trace decay, in [0, 1]",
        "epochs": "passes over each batch's trainable steps",
        "minibatch_size": "trainable steps per gradient step",
        "lr": "Adam learning rate, > 0",
        "anneal_lr": "decay the learning rate linearly to 0 over the run (CleanRL's PPO)",
        "max_grad_norm": "gradient-norm clipping threshold, > 0",
        "clip_epsilon": "PPO ratio clipping, >= 0",
        "entropy_coeff": "weight of the entropy bonus, >= 0",
        "critic_coeff": "weight of the critic loss, >= 0",
        "normalize_advantage": "standardise advantages per minibatch (trainable steps only)",
        "bootstrap_truncated": "bootstrap from the critic when an episode runs out of steps",
        "embed_dim": "token embedding size",
        "hidden": "hidden units per encoder layer",
        "layers": "hidden layers of the encoder",
        "shared": "one encoder for the policy and the critic",
        "eval_every": "frames between greedy evaluations and checkpoints",
        "response_len": "override the id's tool-output length (window and budget grow to fit)",
        "closing_len": "override the id's closing-block length (window and budget grow to fit)",
        "backend": "environment implementation",
        "skip_masked_steps": "run the policy network on trainable steps only while collecting",
        "complete_episodes": "estimate each episode whole: hold back the unfinished one of each "
                             "row for the next batch",
        "masked_value_targets": "masked / terminal-only: train the critic on value targets at "
                                "masked steps too",
        "critic_extra_steps": "critic-only steps (a value target, no action) added to each "
                              "minibatch",
        "encoder": "token-window encoder",
        "eval_episodes": "greedy episodes per evaluation",
    }
    choices = {"estimator": ESTIMATORS, "logger": LOGGERS, "encoder": ENCODERS,
               "backend": BACKENDS}
    for field in fields(Config):
        if field.name in skip:
            continue
        default = getattr(defaults, field.name)
        help_text = f"{helps[field.name]} (default: {default})"
        if isinstance(default, bool):
            parser.add_argument(_flag(field.name), action=argparse.BooleanOptionalAction,
                                default=s, help=help_text)
        elif field.name in choices:
            parser.add_argument(_flag(field.name), choices=choices[field.name], default=s,
                                help=help_text)
        else:
            kind = int if field.name in ("threads", *ENV_OVERRIDES) else type(default)
            parser.add_argument(_flag(field.name), type=kind, default=s, help=help_text,
                                metavar=field.name.upper())


def config_from_options(parser, defaults: Config, given: dict) -> Config:
    """``defaults`` with the given options set; a bad value is a one-line parser error."""
    try:
        return replace(defaults, **given)
    except ValueError as err:
        parser.error(str(err))


@dataclass
class TrainCommand:
    """What ``masked-rl train`` was asked: a fresh run, or the continuation of ``run_dir``."""

    config: Config
    run_dir: Path
    resume: bool
    overwrite: bool = False
    """Replace the finished run ``run_dir`` holds (a fresh run refuses it otherwise)."""


CONFIG_FILE = "config.json"
CHECKPOINT_FILE = "checkpoint.pt"
SUMMARY_FILE = "summary.json"


def changed_options(saved: Config, cfg: Config) -> list[str]:
    """The fields in which ``cfg`` differs from ``saved``, ``RUNTIME_FIELDS`` aside. More
    ``frames`` than saved is not a change: the run goes on from its checkpoint and trains as a
    run started with the larger budget (its history keeps the evaluation at the old budget's
    end, an extra point when that end is off the ``eval_every`` schedule)."""
    return [f.name for f in fields(Config)
            if f.name not in RUNTIME_FIELDS and getattr(saved, f.name) != getattr(cfg, f.name)
            and not (f.name == "frames" and cfg.frames > saved.frames)]


def read_run_config(run_dir: Path) -> Config:
    """The :class:`Config` a run folder was started with (its ``config.json``)."""
    path = Path(run_dir) / CONFIG_FILE
    try:
        return Config(**json.loads(path.read_text()))
    except FileNotFoundError:
        raise ValueError(f"{str(run_dir)!r} is not a run folder: it has no {CONFIG_FILE}") from None
    except (TypeError, json.JSONDecodeError) as err:
        raise ValueError(f"{str(path)!r} does not hold a run configuration: {err}") from None


def read_checkpoint(path: Path) -> tuple[dict, Config]:
    """A checkpoint of this recipe and its :class:`Config`; ``ValueError`` (one line, naming
    the file) for any file that is not one: truncated, another format, other keys."""
    import torch  # only now: --help and the option checks answer without it

    try:
        # weights_only: tensors and plain containers, nothing that runs code when loaded.
        state = torch.load(path, map_location="cpu", weights_only=True)
        return state, Config(**state["config"])
    except Exception as err:  # noqa: BLE001  (any unreadable file is the same user error)
        first_line = str(err).splitlines()[0] if str(err) else ""
        raise ValueError(f"{str(path)!r} is not a checkpoint of this recipe: "
                         f"{type(err).__name__}: {first_line}") from None


class RunFolderError(ValueError):
    """A run folder that cannot be written: another process holds it, or it holds a finished
    run that a fresh run would replace."""


def check_fresh_run_folder(run_dir: Path, overwrite: bool, budget_option: str = "--frames") -> None:
    """Refuse a fresh run into a folder holding a finished run, unless ``overwrite``."""
    path = Path(run_dir) / SUMMARY_FILE
    if overwrite or not path.is_file():
        return
    try:
        status = json.loads(path.read_text()).get("status")
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
        status = None  # not a summary this recipe wrote: no finished run to protect
    if status == "completed":
        raise RunFolderError(
            f"{str(run_dir)!r} holds a finished run: pass --overwrite to replace it, --resume "
            f"{str(run_dir)} {budget_option} N to extend it, or another --output")


def train_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog=prog,
        description="PPO with masked GAE on a toy tool-use environment (TorchRL). The first "
        "Ctrl-C stops at the end of the current batch, writes a checkpoint and a summary marked "
        "interrupted, and exits with status 130; --resume RUN_DIR continues such a run "
        "(--resume RUN_DIR --frames N extends a finished one to N frames).",
    )
    parser.add_argument("--resume", metavar="RUN_DIR", type=Path, default=argparse.SUPPRESS,
                        help="continue the run in RUN_DIR from its last checkpoint, with its saved "
                        f"options (only {', '.join(map(_flag, RESUME_OPTIONS))} may be given)")
    parser.add_argument("--overwrite", action="store_true", default=argparse.SUPPRESS,
                        help="replace the finished run the run folder holds (refused otherwise)")
    add_config_options(parser, Config())
    return parser


def parse_train_command(argv: list[str] | None = None, prog: str | None = None) -> TrainCommand:
    """The options of ``masked-rl train``, checked (one-line error and exit 2 otherwise)."""
    parser = train_parser(prog)
    given = vars(parser.parse_args(argv))
    resume = given.pop("resume", None)
    overwrite = given.pop("overwrite", False)
    if resume is None:
        cfg = config_from_options(parser, Config(), given)
        run_dir = cfg.run_dir()
        try:
            check_fresh_run_folder(run_dir, overwrite)
        except ValueError as err:
            parser.error(str(err))
    else:
        if overwrite:
            parser.error("--overwrite starts a fresh run; --resume continues one: give one")
        not_allowed = sorted(set(given) - set(RESUME_OPTIONS))
        if not_allowed:
            parser.error(f"--resume continues a run with its saved options; "
                         f"{', '.join(map(_flag, not_allowed))} cannot be changed")
        run_dir = resume
        if not (run_dir / CHECKPOINT_FILE).is_file():
            parser.error(f"--resume: {str(run_dir)!r} holds no {CHECKPOINT_FILE}")
        try:
            saved = read_run_config(run_dir)
            _, checkpointed = read_checkpoint(run_dir / CHECKPOINT_FILE)
        except ValueError as err:
            parser.error(f"--resume: {err}")
        edited = changed_options(checkpointed, saved)
        if edited:
            parser.error(f"--resume: {str(run_dir / CONFIG_FILE)!r} does not match the run's "
                         f"{CHECKPOINT_FILE} ({', '.join(edited)} differ): was it edited?")
        cfg = config_from_options(parser, saved, given)
    try:
        check_config(cfg, run_dir)
    except ValueError as err:
        parser.error(str(err))
    return TrainCommand(cfg, Path(run_dir), resume is not None, overwrite)


DEFAULT_COMPARE_FRAMES = 1_400_000
"""Frames per run of ``masked-rl compare`` (6 runs on 2 cores in under 15 minutes)."""


SWEEPABLE = {"closing-len": "closing_len", "response-len": "response_len"}
"""``--sweep`` parameters: the masked distance credit must cross (see ``Config``)."""


@dataclass
class CompareCommand:
    """What ``masked-rl compare`` was asked: one run per (estimator, seed) from ``base``, and per
    value of the swept parameter if ``sweep`` is ``(Config field, values)``."""

    base: Config
    seeds: list[int]
    jobs: int
    estimators: tuple[str, ...] = ("masked", "plain")
    sweep: tuple[str, tuple[int, ...]] | None = None
    sweep_frames: tuple[int, ...] | None = None
    """Frames per run at each swept value (``None``: ``base.frames`` at every value)."""
    report: bool = False
    """Train nothing: write the outputs from the runs ``--output`` already holds."""


def parse_sweep(text: str) -> tuple[str, tuple[int, ...]]:
    """``"closing-len=4,64,256"`` -> ``("closing_len", (4, 64, 256))``; ``ValueError`` otherwise."""
    name, _, values = text.partition("=")
    if name not in SWEEPABLE or not values:
        raise ValueError(f"--sweep must be NAME=V1,V2,... with NAME one of "
                         f"{', '.join(SWEEPABLE)}, got {text!r}")
    try:
        numbers = tuple(int(v) for v in values.split(","))
    except ValueError:
        raise ValueError(f"--sweep values must be integers, got {values!r}") from None
    if len(set(numbers)) != len(numbers):
        raise ValueError(f"--sweep values must be distinct, got {values!r}")
    return SWEEPABLE[name], numbers


def compare_defaults() -> Config:
    return Config(frames=DEFAULT_COMPARE_FRAMES, output="runs/compare", progress_bar=False)


def parse_compare_command(argv: list[str] | None = None, prog: str | None = None) -> CompareCommand:
    """The options of ``masked-rl compare``, checked (one-line error and exit 2 otherwise)."""
    parser = OneLineErrorParser(
        prog=prog,
        description="PPO with masked GAE vs TorchRL's plain GAE over several seeds: a table, "
        "summary.csv, curves.csv and curves.png. Every training option of `train` applies to "
        "both arms. Re-running the same command skips the finished runs and resumes the "
        "interrupted ones (Ctrl-C stops every run at the end of its batch, exit status 130); "
        "with a larger --frames it extends the finished runs.",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="distinct seeds, each trained with every estimator (default: 0 1 2)")
    parser.add_argument("--jobs", type=int, default=2,
                        help="runs trained in parallel processes (default: 2)")
    parser.add_argument("--estimators", nargs="+", choices=ESTIMATORS, default=["masked", "plain"],
                        help="estimators to compare (default: masked plain)")
    parser.add_argument("--sweep", metavar="NAME=V1,V2,...", default=None,
                        help=f"also train every estimator and seed at each value of NAME (one of "
                        f"{', '.join(SWEEPABLE)}: the masked distance credit must cross); writes "
                        "sweep.csv and sweep.png, runs in <output>/<NAME>=<V>/")
    parser.add_argument("--sweep-frames", metavar="F1,F2,...", default=None,
                        help="frames per run at each --sweep value, in order (default: --frames "
                        "at every value): longer episodes need more frames for as many decisions")
    parser.add_argument("--report", action="store_true",
                        help="train nothing: write the table, CSVs and figure from the finished "
                        "runs --output holds, and name the runs not finished or not started")
    defaults = compare_defaults()
    add_config_options(parser, defaults, skip=("estimator", "seed", *SWEEPABLE.values()))
    args = vars(parser.parse_args(argv))
    seeds, jobs, report = args.pop("seeds"), args.pop("jobs"), args.pop("report")
    estimators, sweep = tuple(args.pop("estimators")), args.pop("sweep")
    sweep_frames = args.pop("sweep_frames")
    if len(set(estimators)) != len(estimators):
        parser.error(f"--estimators must be distinct, got {' '.join(estimators)}")
    if sweep is not None:
        try:
            sweep = parse_sweep(sweep)
        except ValueError as err:
            parser.error(str(err))
    if sweep_frames is not None:
        if sweep is None:
            parser.error("--sweep-frames needs --sweep")
        try:
            sweep_frames = tuple(int(v) for v in sweep_frames.split(","))
        except ValueError:
            parser.error(f"--sweep-frames must be integers, got {sweep_frames!r}")
        if len(sweep_frames) != len(sweep[1]) or min(sweep_frames) < 1:
            parser.error(f"--sweep-frames needs one positive frame count per --sweep value "
                         f"({len(sweep[1])}), got {','.join(map(str, sweep_frames))}")
    if jobs < 1:
        parser.error(f"--jobs must be >= 1, got {jobs}")
    if len(set(seeds)) != len(seeds):
        parser.error(f"--seeds must be distinct (each seed is one run folder), got "
                     f"{' '.join(map(str, seeds))}")
    if jobs > 1 and "threads" not in args:
        args["threads"] = 1  # one torch thread per run: the runs share the cores
    base = config_from_options(parser, defaults, args)
    for seed in seeds:
        config_from_options(parser, base, {"seed": seed})
    try:
        # Everything but the seed, the estimator and the swept value is shared by the runs.
        for i, value in enumerate(sweep[1] if sweep else (None,)):
            point = base if value is None else config_from_options(parser, base, {sweep[0]: value})
            if sweep_frames is not None:
                point = config_from_options(parser, point, {"frames": sweep_frames[i]})
            check_config(point, run_dir=Path(base.output))
    except ValueError as err:
        parser.error(str(err))
    return CompareCommand(base, list(seeds), jobs, estimators, sweep, sweep_frames, report)


@dataclass
class EvalCommand:
    """What ``masked-rl eval`` was asked: ``state`` is the loaded checkpoint."""

    checkpoint: Path
    state: dict
    config: Config
    episodes: int
    seed: int | None
    render: bool
    device: str


def add_eval_arguments(parser: argparse.ArgumentParser, checkpoint_file: str) -> None:
    """The arguments ``masked-rl eval`` and ``llm-eval`` share: the run folder or checkpoint,
    ``--episodes``, ``--seed`` and ``--device``."""
    parser.add_argument("path", metavar="RUN_DIR_OR_CHECKPOINT", type=Path,
                        help=f"a run folder (its {checkpoint_file}) or a checkpoint file")
    parser.add_argument("--episodes", type=int, default=None,
                        help="greedy episodes (default: the run's --eval-episodes)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the episodes (default: the seed of the run's own "
                        "evaluations, so the last checkpoint reproduces its last "
                        "eval/success_rate)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: the run's)")


def find_checkpoint(parser: argparse.ArgumentParser, path: Path, checkpoint_file: str) -> Path:
    """The checkpoint ``path`` names (a run folder's ``checkpoint_file``, or the file itself);
    a one-line parser error when there is none."""
    checkpoint = path / checkpoint_file if path.is_dir() else path
    if not checkpoint.is_file():
        parser.error(f"{str(path)!r} is neither a run folder with a {checkpoint_file} nor a "
                     "checkpoint file")
    return checkpoint


def parse_eval_command(argv: list[str] | None = None, prog: str | None = None) -> EvalCommand:
    """The options of ``masked-rl eval``, checked (one-line error and exit 2 otherwise)."""
    parser = OneLineErrorParser(
        prog=prog,
        description="Greedy success rate of a trained policy over N seeded episodes; --render "
        "also prints the transcript of one greedy episode.",
    )
    add_eval_arguments(parser, CHECKPOINT_FILE)
    parser.add_argument("--render", action="store_true",
                        help="print the transcript of one greedy episode (seeded with --seed)")
    args = parser.parse_args(argv)
    checkpoint = find_checkpoint(parser, args.path, CHECKPOINT_FILE)
    try:
        state, cfg = read_checkpoint(checkpoint)
    except ValueError as err:
        parser.error(str(err))
    if args.episodes is not None and args.episodes < 1:
        parser.error(f"--episodes must be >= 1, got {args.episodes}")
    if args.seed is not None and not 0 <= args.seed <= MAX_SEED:
        parser.error(f"--seed must be in [0, {MAX_SEED}], got {args.seed}")
    device = args.device or cfg.device
    try:
        check_device(device)
    except ValueError as err:
        parser.error(str(err))
    return EvalCommand(checkpoint, state, cfg, args.episodes or cfg.eval_episodes, args.seed,
                       args.render, device)
