"""Configuration of the PPO tool-use recipe: one dataclass, one docstring per field.

Every field is also a command-line option (``frames`` -> ``--frames``, ``entropy_coeff`` ->
``--entropy-coeff``), with its docstring as help: see :func:`parse_config`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
from dataclasses import dataclass


@dataclass
class Config:
    # --- run ---------------------------------------------------------------------------------
    env: str = "MaskedRL/ToolUse-v0"
    """Gymnasium id of the environment (``MaskedRL/ToolUse-v0`` or ``MaskedRL/ToolUseHard-v0``)."""
    estimator: str = "masked"
    """Advantage estimator: ``masked`` (masked_rl.MaskedGAE) or ``plain`` (TorchRL's GAE)."""
    frames: int = 2_000_000
    """Environment steps to train for, masked steps included (rounded up to whole batches)."""
    seed: int = 0
    """Seed of torch, the training environments and the evaluation episodes."""
    device: str = "cpu"
    """Device of the networks and the loss (the environments run on the CPU)."""
    output: str = "runs/ppo_tool_use"
    """Folder for the metrics (CSV), the checkpoint and the final summary."""
    threads: int = 0
    """torch intra-op threads (0: torch's default)."""
    progress_bar: bool = True
    """Show a tqdm progress bar over frames."""
    logger: str = "csv"
    """TorchRL logger backend: ``csv``, ``tensorboard``, ``wandb``, ``mlflow`` or ``none``."""

    # --- collection ----------------------------------------------------------------------------
    num_envs: int = 128
    """Environments stepped together (a synchronous gymnasium vector env per worker)."""
    workers: int = 1
    """Collector processes; above 1, TorchRL's MultiSyncCollector splits num_envs over them."""
    frames_per_batch: int = 16384
    """Environment steps per collected batch (per PPO iteration), ``num_envs`` rows of
    ``frames_per_batch / num_envs`` steps; about 1 in 10 is trainable. Long rows matter: a row
    cut mid-episode bootstraps from the critic instead of carrying the reward back."""

    # --- PPO -----------------------------------------------------------------------------------
    gamma: float = 0.99
    """Discount factor (TorchRL's default)."""
    lmbda: float = 0.95
    """GAE trace decay (TorchRL's default)."""
    epochs: int = 8
    """Passes over each batch's trainable steps (advantages are estimated once per batch)."""
    minibatch_size: int = 256
    """Trainable steps per gradient step (masked steps never enter the replay buffer)."""
    lr: float = 2e-3
    """Adam learning rate."""
    max_grad_norm: float = 0.5
    """Gradient-norm clipping threshold."""
    clip_epsilon: float = 0.2
    """PPO ratio clipping."""
    entropy_coeff: float = 0.01
    """Weight of the entropy bonus."""
    critic_coeff: float = 0.5
    """Weight of the critic (squared error) loss."""
    normalize_advantage: bool = True
    """Standardise advantages per minibatch (statistics over trainable steps only)."""
    bootstrap_truncated: bool = False
    """Bootstrap from the critic when an episode hits the step budget (TorchRL's default).
    Off: running out of steps ends the episode like any failure."""

    # --- networks ------------------------------------------------------------------------------
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
        if self.estimator not in ("masked", "plain"):
            raise ValueError(f"estimator must be 'masked' or 'plain', got {self.estimator!r}")
        for name in ("frames", "num_envs", "workers", "frames_per_batch", "epochs",
                     "minibatch_size", "eval_episodes", "eval_every", "embed_dim", "hidden",
                     "layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_envs % self.workers:
            raise ValueError(
                f"num_envs ({self.num_envs}) must be a multiple of workers ({self.workers})"
            )
        if self.frames_per_batch % self.num_envs:
            raise ValueError(
                f"frames_per_batch ({self.frames_per_batch}) must be a multiple of num_envs "
                f"({self.num_envs})"
            )


def field_docs(cls: type = Config) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source."""
    tree = ast.parse(inspect.getsource(cls))
    docs, previous = {}, None
    for node in tree.body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            previous = node.target.id
        elif previous and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            docs[previous] = inspect.cleandoc(node.value.value)
            previous = None
        else:
            previous = None
    return docs


def add_config_arguments(parser: argparse.ArgumentParser, defaults: Config, skip=()) -> None:
    """One ``--option`` per field of ``Config``, with its docstring as help."""
    docs = field_docs()
    for field in dataclasses.fields(Config):
        if field.name in skip:
            continue
        default = getattr(defaults, field.name)
        flag = "--" + field.name.replace("_", "-")
        help_text = f"{docs.get(field.name, '')} (default: {default})"
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
        else:
            parser.add_argument(flag, type=type(default), default=default, help=help_text,
                                metavar=field.name.upper())


def parse_config(argv: list[str] | None = None, *, prog: str | None = None) -> Config:
    """A ``Config`` from command-line options (``--frames 200000 --estimator plain``)."""
    parser = argparse.ArgumentParser(
        prog=prog, description="PPO with masked GAE on a toy tool-use environment (TorchRL)."
    )
    add_config_arguments(parser, Config())
    args = parser.parse_args(argv)
    try:
        return Config(**vars(args))
    except ValueError as err:
        parser.error(str(err))
