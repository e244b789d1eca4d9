"""PPO with masked GAE on a toy tool-use environment: the whole recipe in one file.

    python examples/ppo_masked_gae.py                       # defaults: MaskedRL/ToolUse-v0
    python examples/ppo_masked_gae.py --total-frames 20000  # any Config field is a flag

The agent writes one token per step into a transcript it shares with the environment. The
prompt, the tool's answers and the closing text are the environment's (``loss_mask == 0``), the
tool calls and the answer the agent's (``loss_mask == 1``); the reward arrives on the last step,
a masked one. :class:`masked_rl.MaskedClipPPOLoss` is TorchRL's ``ClipPPOLoss`` on the agent's
steps, with :class:`masked_rl.MaskedGAE` (GAE over the agent's steps of each episode) as its
value estimator. The steps: config, seeding, environments, actor and critic, loss, collector,
replay buffer, training loop, greedy evaluation.

Needs only the installed packages ``masked_rl`` and ``masked_rl_envs``. The full harness
(``masked-rl train`` / ``compare``: baselines, resume, sweeps, logging) builds on the same
pieces in ``examples/ppo_tool_use/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from dataclasses import dataclass

import gymnasium
import torch
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.data.replay_buffers.samplers import SamplerWithoutReplacement
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import ActorValueOperator, ProbabilisticActor, ValueOperator

import masked_rl_envs
from masked_rl import CompleteEpisodes, MaskedClipPPOLoss, SkipMaskedSteps, select_trainable_steps


@dataclass
class Config:
    env_id: str = "MaskedRL/ToolUse-v0"
    """Gymnasium id of a masked_rl_envs tool-use environment."""
    seed: int = 0
    """Seed of torch, the training environments and the evaluation tasks."""
    total_frames: int = 2_000_000
    """Environment steps to train for, masked steps included (rounded up to whole batches)."""
    num_envs: int = 128
    """Environments stepped together (one tensor-batched env)."""
    frames_per_batch: int = 16_384
    """Steps per collected batch (num_envs rows of frames_per_batch / num_envs steps)."""
    epochs: int = 8
    """Passes over each batch's trainable steps."""
    minibatch_size: int = 256
    """Trainable steps per gradient step (masked steps never enter the buffer)."""
    lr: float = 2e-3
    """Adam learning rate."""
    max_grad_norm: float = 0.5
    """Gradient-norm clipping threshold."""
    gamma: float = 0.99
    """Discount factor."""
    lmbda: float = 0.95
    """GAE trace decay."""
    clip_epsilon: float = 0.2
    """PPO ratio clipping."""
    entropy_coeff: float = 0.01
    """Weight of the entropy bonus."""
    critic_coeff: float = 0.5
    """Weight of the critic's squared-error loss."""
    embed_dim: int = 8
    """Token embedding size."""
    hidden: int = 64
    """Hidden units of the shared encoder."""
    eval_every: int = 163_840
    """Frames between greedy evaluations."""
    eval_episodes: int = 100
    """Greedy episodes per evaluation (the same seeded tasks each time)."""
    threads: int = 0
    """torch intra-op threads (0: torch's default)."""


def parse_config(argv: list[str] | None = None) -> Config:
    """A ``--field-name`` flag per :class:`Config` field, its docstring as help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    helps = _field_docstrings(Config)
    for field in dataclasses.fields(Config):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default),
                            default=field.default, help=f"{helps.get(field.name, '')} "
                                                        f"(default: {field.default})")
    args = parser.parse_args(argv)
    for name, value in vars(args).items():
        if isinstance(value, (int, float)) and value < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    return Config(**vars(args))


def _field_docstrings(cls) -> dict[str, str]:
    # A field's docstring is the string expression on the line after it; read them from source.
    import ast
    import inspect

    body = ast.parse(inspect.getsource(cls)).body[0].body
    return {a.target.id: b.value.value for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant)}


def make_env(cfg: Config, num_envs: int):
    """``num_envs`` copies of the environment, stepped together with tensor ops (batch [N])."""
    return masked_rl_envs.make_torchrl_env(cfg.env_id, num_envs=num_envs, backend="batched")


class TokenWindowEncoder(nn.Module):
    """Embed each token of the window ``[*B, W]``, concatenate them, one tanh layer -> ``[*B, H]``.

    Concatenating keeps each position's own weights: "the value 3 tokens back" is one linear
    feature, which is what these fixed-layout transcripts ask for.
    """

    def __init__(self, vocab_size: int, window: int, embed_dim: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.layer = nn.Linear(window * embed_dim, hidden)
        nn.init.orthogonal_(self.layer.weight, gain=2**0.5)
        nn.init.zeros_(self.layer.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layer(self.embed(tokens.long()).flatten(-2)))


def make_actor_critic(cfg: Config, env):
    """A categorical policy over the next token and a critic, sharing one encoder."""
    vocab_size = env.action_spec.space.n
    window = env.observation_spec["tokens"].shape[-1]
    policy_out, value_out = nn.Linear(cfg.hidden, vocab_size), nn.Linear(cfg.hidden, 1)
    nn.init.orthogonal_(policy_out.weight, gain=0.01)  # a near-uniform initial policy
    nn.init.orthogonal_(value_out.weight, gain=1.0)
    for layer in (policy_out, value_out):
        nn.init.zeros_(layer.bias)
    operator = ActorValueOperator(
        TensorDictModule(TokenWindowEncoder(vocab_size, window, cfg.embed_dim, cfg.hidden),
                         in_keys=["tokens"], out_keys=["features"]),
        ProbabilisticActor(
            TensorDictModule(policy_out, in_keys=["features"], out_keys=["logits"]),
            in_keys=["logits"], spec=env.full_action_spec["action"],
            distribution_class=torch.distributions.Categorical, return_log_prob=True,
        ),
        ValueOperator(value_out, in_keys=["features"]),
    )
    return operator.get_policy_operator(), operator.get_value_operator()


@torch.no_grad()
def greedy_success(actor, env, seed: int, max_steps: int) -> float:
    """Share of ``env``'s environments whose first greedy episode succeeds (same tasks per seed)."""
    env.set_seed(seed)
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        rollout = env.rollout(max_steps, SkipMaskedSteps(actor), break_when_any_done=False)
    done = rollout["next", "done"].squeeze(-1)
    first_end = done.int().argmax(-1)  # every episode ends within max_steps (the time limit)
    success = rollout["next", "is_success"][torch.arange(done.shape[0]), first_end]
    return success.double().mean().item()


def train(cfg: Config) -> dict:
    """Train one agent; returns ``{"final_success", "history", "wall_time_s", "frames"}``."""
    started = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    max_episode_steps = gymnasium.spec(cfg.env_id).max_episode_steps

    # Environments, networks, loss, optimizer.
    eval_env = make_env(cfg, cfg.eval_episodes)
    actor, critic = make_actor_critic(cfg, eval_env)
    loss = MaskedClipPPOLoss(actor, critic, clip_epsilon=cfg.clip_epsilon,
                             entropy_coeff=cfg.entropy_coeff, critic_coeff=cfg.critic_coeff,
                             loss_critic_type="l2", normalize_advantage=True)
    loss.make_value_estimator(gamma=cfg.gamma, lmbda=cfg.lmbda)  # masked_rl.MaskedGAE
    optimizer = torch.optim.Adam(loss.parameters(), lr=cfg.lr)

    # Collector: the policy network runs on the agent's steps only (SkipMaskedSteps).
    total_frames = -(-cfg.total_frames // cfg.frames_per_batch) * cfg.frames_per_batch  # whole batches
    collector = Collector(make_env(cfg, cfg.num_envs), SkipMaskedSteps(actor),
                          frames_per_batch=cfg.frames_per_batch, total_frames=total_frames,
                          auto_register_policy_transforms=False)  # feed-forward: none needed
    collector.set_seed(cfg.seed)
    # Each row's unfinished episode waits for the next batch: no episode is cut at a batch end,
    # so no advantage bootstraps from the critic in the middle of a tool output.
    complete = CompleteEpisodes()
    buffer = ReplayBuffer(storage=LazyTensorStorage(cfg.frames_per_batch),
                          sampler=SamplerWithoutReplacement(), batch_size=cfg.minibatch_size)

    history, frames, next_eval = [], 0, 0
    eval_seed = cfg.seed + 1_000_003  # evaluation tasks apart from the training ones
    for batch in collector:
        frames += batch.numel()
        # Running out of steps ends an episode like a failure: no bootstrap from the critic.
        batch["next", "terminated"] = batch["next", "done"].clone()
        whole = complete(batch)
        with torch.no_grad():  # advantages once per batch, on the full [num_envs, T] rows
            loss.value_estimator(whole)
        trainable = select_trainable_steps(whole)
        if trainable.numel():
            buffer.empty()
            buffer.extend(trainable)
            for _ in range(cfg.epochs):
                for minibatch in buffer:
                    out = loss(minibatch)
                    total = out["loss_objective"] + out["loss_entropy"] + out["loss_critic"]
                    optimizer.zero_grad()
                    total.backward()
                    nn.utils.clip_grad_norm_(loss.parameters(), cfg.max_grad_norm)
                    optimizer.step()
        collector.update_policy_weights_()
        if frames >= next_eval or frames >= total_frames:
            success = greedy_success(actor, eval_env, eval_seed, max_episode_steps)
            history.append({"frames": frames, "success_rate": success})
            print(f"frames {frames:>9,}  greedy success {success:6.1%}  "
                  f"{time.perf_counter() - started:6.0f} s", flush=True)
            next_eval += cfg.eval_every
    collector.shutdown()
    eval_env.close()
    return {"final_success": history[-1]["success_rate"] if history else None,
            "history": history, "wall_time_s": time.perf_counter() - started, "frames": frames}


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    logging.getLogger("torchrl").setLevel(logging.WARNING)  # no INFO lines between ours
    result = train(cfg)
    print(f"{cfg.env_id}: final greedy success {result['final_success']:.1%} after "
          f"{result['frames']:,} frames, {result['wall_time_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
