"""Pieces of the PPO tool-use recipe: environments, networks, statistics, evaluation, and what
makes a run safe to stop and resume (interruption, atomic files, checkpointed state)."""

from __future__ import annotations

import errno
import os
import pickle
import random
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors import Collector
from torchrl.envs import EnvBase
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import ActorValueOperator, ProbabilisticActor, ValueOperator

from masked_rl import SkipMaskedSteps
from masked_rl_envs import ToolUseBatchedEnv, make_torchrl_env

if __package__:  # imported, e.g. by `masked-rl train` (masked_rl_examples.ppo_tool_use)
    from .config import RunFolderError
    from .encoders import AttentionWindowEncoder
else:  # run as a script from this folder
    from config import RunFolderError
    from encoders import AttentionWindowEncoder


# --- environment ---------------------------------------------------------------------------


def make_env(env_id: str, num_envs: int, device: str = "cpu", *, backend: str = "batched",
             **env_kwargs) -> EnvBase:
    """``num_envs`` copies of ``env_id`` as one TorchRL env with batch size ``[num_envs]``.

    :func:`masked_rl_envs.make_torchrl_env`: ``backend="batched"`` steps every environment at
    once with tensor ops (``masked_rl_envs.ToolUseBatchedEnv``, several times faster; its
    ``"tokens"`` are uint8 when the vocabulary fits);
    ``"gym"`` uses a synchronous gymnasium vector env (the toy environments step in
    microseconds, so stepping them in turn in this process beats one subprocess per env).
    ``env_kwargs`` override the id's constructor arguments. Keys per step: ``"tokens"`` ``[W]``,
    ``"loss_mask"`` int8 ``[1]`` (1 when the action of this step is the agent's),
    ``"is_success"``, ``"num_agent_tokens"``, ``"num_tool_calls"``, ``"action"`` (a token id),
    ``("next", "reward")``.
    """
    if backend == "batched":
        # One byte per token when the vocabulary fits (8x less than int64 for every window the
        # collector, the held-back episodes and the checkpoint copy); the encoders cast.
        probe = gym.make(env_id, **env_kwargs)
        vocab_size = probe.unwrapped.grammar.vocab_size
        probe.close()
        tokens_dtype = torch.uint8 if vocab_size <= 256 else torch.int64
        return make_torchrl_env(env_id, num_envs=num_envs, device=device, backend="batched",
                                tokens_dtype=tokens_dtype, **env_kwargs)
    return make_torchrl_env(env_id, num_envs=num_envs, device=device, vectorization="sync",
                            **env_kwargs)


def episode_step_limit(env_id: str, **env_kwargs) -> int:
    """The most steps an episode of ``env_id`` can take: its registered ``max_episode_steps``
    (gymnasium's TimeLimit), or the ``max_steps`` that ``env_kwargs`` override it with."""
    if "max_steps" in env_kwargs:
        return int(env_kwargs["max_steps"])
    limit = gym.spec(env_id.rpartition(":")[2]).max_episode_steps
    if limit is None:  # an id registered without a TimeLimit: the environment's own budget
        probe = gym.make(env_id, **env_kwargs)
        limit = probe.unwrapped.max_steps
        probe.close()
    return int(limit)


# --- networks ------------------------------------------------------------------------------


def _init(layer: nn.Linear, std: float) -> nn.Linear:
    """Orthogonal weights, zero bias (the usual PPO initialisation)."""
    nn.init.orthogonal_(layer.weight, gain=std)
    nn.init.zeros_(layer.bias)
    return layer


class TokenWindowEncoder(nn.Module):
    """Features of the observation window: embed every token, concatenate, tanh MLP.

    Concatenating the window position by position gives each position its own first-layer
    weights, so "copy the token 3 positions back" or "answer the value after the first RESULT"
    is one linear feature of the input: what the toy tool-use tasks ask (their blocks have
    fixed lengths, so every token of interest sits at a fixed offset from the window's end).

    Args:
        vocab_size (int): token ids are in ``[0, vocab_size)``.
        window (int): observation length ``W``.
        embed_dim (int): embedding size per token.
        hidden (int): hidden units per layer.
        layers (int): hidden layers.

    Shapes: ``tokens`` ``[*B, W]`` (any integer dtype) -> ``[*B, hidden]``.
    """

    def __init__(self, vocab_size: int, window: int, embed_dim: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim)
        sizes = [window * embed_dim] + [hidden] * layers
        body = [nn.Flatten(-2)]
        for n_in, n_out in zip(sizes[:-1], sizes[1:]):
            body += [_init(nn.Linear(n_in, n_out), 2**0.5), nn.Tanh()]
        self.mlp = nn.Sequential(*body)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(tokens.long()))


def make_actor_critic(env: EnvBase, embed_dim: int, hidden: int, layers: int,
                      shared: bool = True, device="cpu", encoder: str = "mlp"):
    """A categorical policy over the next token and a critic, both reading ``"tokens"``.

    ``encoder``: ``"mlp"`` (:class:`TokenWindowEncoder`) or ``"attention"``
    (:class:`encoders.AttentionWindowEncoder`). With ``shared``, one encoder feeds both heads
    (TorchRL's ``ActorValueOperator``, as in its Atari PPO recipe); the critic's loss then also
    shapes the features the policy reads.
    """
    vocab_size = env.action_spec.space.n
    window = env.observation_spec["tokens"].shape[-1]
    encoder_class = {"mlp": TokenWindowEncoder, "attention": AttentionWindowEncoder}[encoder]

    def encoder():
        return encoder_class(vocab_size, window, embed_dim, hidden, layers)

    def policy_head(in_keys, module):
        return ProbabilisticActor(
            TensorDictModule(module, in_keys=in_keys, out_keys=["logits"]),
            in_keys=["logits"],
            spec=env.full_action_spec["action"],
            distribution_class=torch.distributions.Categorical,
            return_log_prob=True,
        )

    # A small output layer makes the initial policy uniform over tokens.
    policy_out = _init(nn.Linear(hidden, vocab_size), 0.01)
    value_out = _init(nn.Linear(hidden, 1), 1.0)
    if shared:
        operator = ActorValueOperator(
            TensorDictModule(encoder(), in_keys=["tokens"], out_keys=["features"]),
            policy_head(["features"], policy_out),
            ValueOperator(value_out, in_keys=["features"]),
        )
        actor, critic = operator.get_policy_operator(), operator.get_value_operator()
    else:
        actor = policy_head(["tokens"], nn.Sequential(encoder(), policy_out))
        critic = ValueOperator(nn.Sequential(encoder(), value_out), in_keys=["tokens"])
    return actor.to(device), critic.to(device)


# --- statistics ----------------------------------------------------------------------------


def finished_episodes(batch: TensorDictBase) -> dict[str, float]:
    """Success rate, agent tokens and tool calls of the episodes that ended in a batch.

    ``reward_per_episode`` is the batch's total reward over the episodes that ended in it: the
    mean return, up to the episodes cut by the batch's ends (a TorchRL ``RewardSum`` transform
    would be exact, for about a fifth more collection time).
    """
    done = batch["next", "done"].squeeze(-1)
    if not done.any():
        return {"episodes": 0}
    return {
        "episodes": int(done.sum()),
        "success_rate": batch["next", "is_success"][done].double().mean().item(),
        "reward_per_episode": batch["next", "reward"].sum().item() / int(done.sum()),
        "agent_tokens": batch["next", "num_agent_tokens"][done].float().mean().item(),
        "tool_calls": batch["next", "num_tool_calls"][done].float().mean().item(),
    }


@torch.no_grad()
def evaluate(actor, env: EnvBase, *, seed: int, max_steps: int) -> dict[str, float]:
    """Greedy (argmax) success rate on the first episode of each of ``env``'s environments.

    ``env.set_seed(seed)`` first, so every evaluation plays the same tasks. The actor runs on
    the agent's steps only (:class:`masked_rl.SkipMaskedSteps`: the same greedy actions there;
    the environment ignores the others), which on 256-token tool outputs is 0.5 % of the steps.
    """
    env.set_seed(seed)
    policy = actor if isinstance(actor, SkipMaskedSteps) else SkipMaskedSteps(actor)
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        rollout = env.rollout(max_steps, policy, break_when_any_done=False)
    if rollout.ndim == 1:  # a single, unbatched environment
        rollout = rollout.unsqueeze(0)
    done = rollout["next", "done"].squeeze(-1)
    first_end = done.int().argmax(-1)  # every env ends an episode within max_steps
    rows = torch.arange(done.shape[0])
    reward = rollout["next", "reward"].squeeze(-1)
    steps = torch.arange(done.shape[1]).unsqueeze(0)
    episode_return = torch.where(steps <= first_end.unsqueeze(-1), reward, 0.0).sum(-1)
    return {
        # float64: 90 successes of 100 are 0.9, not float32's 0.8999999762 < 0.9 (the threshold)
        "success_rate": rollout["next", "is_success"][rows, first_end].double().mean().item(),
        "episode_return": episode_return.mean().item(),
        "episode_length": (first_end + 1).float().mean().item(),
    }


def greedy_transcript(actor, env_id: str, *, seed: int, device="cpu", **env_kwargs) -> str:
    """The rendered transcript of one greedy episode of ``env_id`` (``env_kwargs`` override the
    id's constructor arguments, a ``max_steps`` among them).

    A gymnasium environment, seeded like :func:`evaluate`: with ``backend="gym"`` it is the
    first of the episodes that ``evaluate`` plays with the same ``seed`` (the batched backend
    draws its tasks from torch's generator instead of NumPy's).
    """
    max_steps = episode_step_limit(env_id, **env_kwargs)
    env = make_torchrl_env(env_id, num_envs=1, device=device, render_mode="ansi", **env_kwargs)
    try:
        env.set_seed(seed)
        with torch.no_grad(), set_exploration_type(ExplorationType.DETERMINISTIC):
            env.rollout(max_steps, actor)  # stops at the end of the episode
        return env.render()
    finally:
        env.close()


def cut_statistics(batch: TensorDictBase) -> dict[str, float]:
    """How much of a batch's advantage estimation leans on the critic at the batch's cuts.

    ``batch`` is ``[*B, T]`` (rows of ``T`` steps) with ``("next", "done")``,
    ``("next", "terminated")`` and ``("next", "loss_mask")``. An episode of the batch is a
    stretch of a row between done flags (the fragments at either end of a row included); it is
    *cut* when the row ends before it does. Where an episode's advantages need the value of the
    observation after its last step (a *bootstrap read*: at a cut, and at a truncation,
    ``done`` without ``terminated``; the recipe turns truncations into terminations unless
    ``--bootstrap-truncated``), the read is *masked* when that observation has ``loss_mask``
    0: the agent does not act there, so a critic trained on trainable steps only never learned
    its value. (A truncated episode's final observation always has ``loss_mask`` 0.)

    Returns ``episodes_cut_share`` (cut episodes / episodes) and, when the batch has bootstrap
    reads, ``bootstrap_masked_share`` (masked reads / reads).
    """
    done = batch["next", "done"].squeeze(-1).bool()
    terminated = batch["next", "terminated"].squeeze(-1).bool()
    next_masked = batch["next", "loss_mask"].squeeze(-1) == 0
    cut = torch.zeros_like(done)
    cut[..., -1] = ~done[..., -1]
    reads = cut | (done & ~terminated)
    stats = {"episodes_cut_share": (cut.sum() / (done.sum() + cut.sum())).item()}
    if reads.any():
        stats["bootstrap_masked_share"] = ((reads & next_masked).sum() / reads.sum()).item()
    return stats


# --- stopping and resuming ----------------------------------------------------------------------


class StopOnInterrupt:
    """Within a ``with`` block, SIGINT (Ctrl-C) sets ``requested`` instead of raising.

    The training loop reads ``requested`` between batches, so a run stops at a consistent
    point (a finished update) and can checkpoint it. Every further SIGINT only sets it again:
    the stop is bounded by one batch. Outside the main thread (where Python does not deliver
    signals) the block changes nothing.
    """

    def __init__(self):
        self.requested = False
        self._installed = False

    def _request(self, signum, frame):
        self.requested = True

    def __enter__(self) -> StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._request)
            self._installed = True
        return self

    def __exit__(self, *exc_info):
        if self._installed:
            # None: a handler not installed from Python; the closest is Python's default.
            signal.signal(signal.SIGINT, signal.default_int_handler if self._previous is None
                          else self._previous)
            self._installed = False


@contextmanager
def sigint_ignored():
    """SIGINT ignored while the block runs, and by every process started inside it.

    A Ctrl-C in a terminal goes to the whole process group: collector workers would die
    mid-batch (and the main process then wait for them forever). A process spawned while SIGINT
    is ignored inherits that, and Python keeps an inherited ignored SIGINT ignored, so such
    workers leave the stop to the main process, which shuts them down.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        # None: a handler not installed from Python; the closest is Python's default. (Not
        # `previous or ...`: SIG_DFL is 0, falsy.)
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)


LOCK_FILE = ".lock"
"""The file in a run folder that :func:`run_folder_lock` locks and writes its holder's pid in."""


@contextmanager
def run_folder_lock(run_dir: Path):
    """Hold ``run_dir`` for this process while the block runs; ``RunFolderError`` naming the
    folder and the holder's pid if another process (or another ``train`` in this one) holds it.

    ``fcntl.flock`` on ``<run_dir>/.lock``: the kernel drops the lock when its holder exits,
    however it exits (a SIGKILL included), so no stale lock outlives a crash.
    """
    import fcntl

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / LOCK_FILE, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            raise RunFolderError(f"{str(run_dir)!r} is in use by another run (pid {holder}): "
                                 "wait for it to end, or use another --output") from None
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        try:
            yield
        finally:
            lock.truncate(0)
            fcntl.flock(lock, fcntl.LOCK_UN)


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel send this process SIGTERM when its parent ends, however it ends.

    Linux's ``prctl(PR_SET_PDEATHSIG)``; elsewhere nothing (the parent's SIGTERM handler still
    ends its workers). Exits at once if the parent is already gone.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before the call above
        os._exit(1)


def _replace_atomically(path: Path, write) -> None:
    """``write(file)`` into a temporary file beside ``path``, then rename it onto ``path``.

    A crash or a kill at any point leaves either the old file or the new one, never a part.
    """
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def save_atomically(obj, path: Path) -> None:
    """``torch.save(obj, path)`` that never leaves a partly written ``path``."""
    _replace_atomically(path, lambda f: torch.save(obj, f))


def write_text_atomically(text: str, path: Path) -> None:
    """``path.write_text(text)`` that never leaves a partly written ``path``."""
    _replace_atomically(path, lambda f: f.write(text.encode()))


def host_random_state() -> bytes:
    """The state of NumPy's and Python's global generators, pickled (torch's is a tensor)."""
    return pickle.dumps({"numpy": np.random.get_state(), "python": random.getstate()})


def set_host_random_state(state: bytes) -> None:
    states = pickle.loads(state)
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])


def collector_snapshot(collector) -> dict | None:
    """What a single-process ``Collector`` over :func:`make_env` needs to carry on exactly.

    The state of every environment mid-episode (the gymnasium environments' attributes, or the
    batched environment's :meth:`~masked_rl_envs.ToolUseBatchedEnv.episode_state`) and the
    collector's current observation, which TorchRL keeps in its private ``_carrier``:
    TorchRL 0.14 has no public way to restore a collector mid-episode (its ``load_state_dict``
    starts fresh episodes). ``None`` for a multi-process collector, whose environments live
    in its workers.
    """
    if not isinstance(collector, Collector):
        return None
    env = collector.env
    if isinstance(env, ToolUseBatchedEnv):
        environments = env.episode_state()
    else:
        environments = pickle.dumps([vars(e) for e in env.unwrapped.get_attr("unwrapped")])
    return {"environments": environments, "carrier": collector._carrier.to_dict()}


def restore_collector(collector, snapshot: dict) -> None:
    """Undo :func:`collector_snapshot` on a newly built collector over the same environments."""
    env = collector.env
    if isinstance(env, ToolUseBatchedEnv):
        env.set_episode_state(snapshot["environments"])
    else:
        environments = env.unwrapped.get_attr("unwrapped")
        states = pickle.loads(snapshot["environments"])
        if len(states) != len(environments):
            raise ValueError(f"the snapshot holds {len(states)} environments, the collector "
                             f"{len(environments)}")
        for e, state in zip(environments, states):
            e.__dict__.update(state)
    carrier = collector._carrier
    carrier.update(TensorDict(snapshot["carrier"], batch_size=carrier.batch_size,
                              device=carrier.device))


def truncate_csv_scalars(log_dir: Path, last_step: int) -> None:
    """Drop the rows logged after ``last_step`` from a TorchRL ``CSVLogger`` folder.

    A resumed run logs again what its previous process logged after the checkpoint.
    """
    for path in sorted((Path(log_dir) / "scalars").rglob("*.csv")):
        lines = path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if int(line.split(",", 1)[0]) <= last_step]
        if len(kept) < len(lines):
            write_text_atomically("".join(kept), path)


def run_error_message(err: Exception, run_dir: Path, command: str = "masked-rl train") -> str | None:
    """The one line a user needs for an error that stops a run: another writer holds its folder,
    or the disk is full (the atomic writes keep the last checkpoint whole; resume from it).
    ``None`` for anything else, a bug whose traceback should show. (``RunFolderError`` is a
    ``ValueError``: the callers catch it, not any ``ValueError``.)"""
    if isinstance(err, ValueError):
        return str(err)
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"{os.strerror(err.errno)} while writing to {str(run_dir)!r}: the last "
                f"checkpoint there is intact; free some space and continue with "
                f"{command} --resume {run_dir}")
    return None


def legend(ax, **kwargs) -> None:
    """``ax.legend(**kwargs)`` where ``ax`` has labelled lines or points; nothing otherwise
    (matplotlib warns on an empty legend, e.g. a panel where no run reached the threshold)."""
    handles, _ = ax.get_legend_handles_labels()
    if handles:
        ax.legend(**kwargs)


def runs_left_out(unfinished: list[str], missing: list[str]) -> list[str]:
    """``["not finished, left out: a, b", "not started: c"]`` (only the kinds that occur): the
    runs of a comparison that its ``--report`` cannot count, one line per kind."""
    return [f"{what}: {', '.join(names)}" for what, names in
            (("not finished, left out", unfinished), ("not started", missing)) if names]
