"""Environment, networks and evaluation of the PPO tool-use recipe."""

from __future__ import annotations

import gymnasium as gym
import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.envs import EnvBase, GymWrapper
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import ProbabilisticActor, ValueOperator

import masked_rl_envs  # noqa: F401  (registers the MaskedRL/* ids, also in collector workers)


# --- environment ---------------------------------------------------------------------------


def make_env(env_id: str, num_envs: int, device: str = "cpu") -> EnvBase:
    """``num_envs`` copies of ``env_id`` as one TorchRL env with batch size ``[num_envs]``.

    A synchronous gymnasium vector env: the toy environments step in microseconds, so one
    process stepping them in turn is several times faster than one subprocess per env
    (gymnasium's ``AsyncVectorEnv``, which ``GymEnv(num_envs=...)`` builds). TorchRL needs the
    ``SAME_STEP`` auto-reset mode of gymnasium 1.x. Keys per step: ``"tokens"`` ``[W]``,
    ``"loss_mask"`` int8 ``[1]`` (1 when the action of this step is the agent's),
    ``"is_success"``, ``"action"`` (a token id), ``("next", "reward")``.
    """
    vector_env = gym.make_vec(
        env_id,
        num_envs=num_envs,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
    )
    return GymWrapper(vector_env, categorical_action_encoding=True, device=device)


def episode_step_limit(env_id: str) -> int:
    """The most steps an episode of ``env_id`` can take (its ``max_steps``)."""
    env = gym.make(env_id)
    try:
        return int(env.unwrapped.max_steps)
    finally:
        env.close()


# --- networks ------------------------------------------------------------------------------


class TokenWindowMLP(nn.Module):
    """An MLP over the observation window: embed every token, concatenate, two layers.

    Concatenating the window position by position gives each position its own first-layer
    weights, so "copy the token 3 positions back" or "answer the value after the first RESULT"
    is one linear feature of the input: what the toy tool-use tasks ask (their blocks have
    fixed lengths, so every token of interest sits at a fixed offset from the window's end).

    Args:
        vocab_size (int): token ids are in ``[0, vocab_size)``.
        window (int): observation length ``W``.
        embed_dim (int): embedding size per token.
        hidden (int): hidden units.
        out_features (int): output size (``vocab_size`` logits, or ``1`` value).
        out_std (float): init std of the output layer (small for an initially uniform policy).

    Shapes: ``tokens`` ``[*B, W]`` (int64) -> ``[*B, out_features]``.
    """

    def __init__(self, vocab_size: int, window: int, embed_dim: int, hidden: int,
                 out_features: int, out_std: float = 1.0):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.mlp = nn.Sequential(
            nn.Flatten(-2),
            nn.Linear(window * embed_dim, hidden),
            nn.Tanh(),
            nn.Linear(hidden, out_features),
        )
        nn.init.orthogonal_(self.mlp[1].weight, gain=2**0.5)
        nn.init.zeros_(self.mlp[1].bias)
        nn.init.orthogonal_(self.mlp[3].weight, gain=out_std)
        nn.init.zeros_(self.mlp[3].bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(tokens))


def make_actor_critic(env: EnvBase, embed_dim: int, hidden: int, device="cpu"):
    """A categorical policy over the next token and a critic, both reading ``"tokens"``."""
    vocab_size = env.action_spec.space.n
    window = env.observation_spec["tokens"].shape[-1]
    policy_net = TokenWindowMLP(vocab_size, window, embed_dim, hidden, vocab_size, out_std=0.01)
    actor = ProbabilisticActor(
        TensorDictModule(policy_net, in_keys=["tokens"], out_keys=["logits"]),
        in_keys=["logits"],
        spec=env.full_action_spec["action"],
        distribution_class=torch.distributions.Categorical,
        return_log_prob=True,
    )
    critic = ValueOperator(
        TokenWindowMLP(vocab_size, window, embed_dim, hidden, 1, out_std=1.0), in_keys=["tokens"]
    )
    return actor.to(device), critic.to(device)


# --- statistics ----------------------------------------------------------------------------


def finished_episodes(batch: TensorDictBase) -> dict[str, float]:
    """Success rate, agent tokens and tool calls of the episodes that ended in a batch."""
    done = batch["next", "done"].squeeze(-1)
    if not done.any():
        return {"episodes": 0}
    return {
        "episodes": int(done.sum()),
        "success_rate": batch["next", "is_success"][done].float().mean().item(),
        "agent_tokens": batch["next", "num_agent_tokens"][done].float().mean().item(),
        "tool_calls": batch["next", "num_tool_calls"][done].float().mean().item(),
    }


@torch.no_grad()
def evaluate(actor, env: EnvBase, *, seed: int, max_steps: int) -> dict[str, float]:
    """Greedy (argmax) success rate on the first episode of each of ``env``'s environments.

    ``env.set_seed(seed)`` first, so every evaluation plays the same tasks.
    """
    env.set_seed(seed)
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        rollout = env.rollout(max_steps, actor, break_when_any_done=False)
    done = rollout["next", "done"].squeeze(-1)
    first_end = done.int().argmax(-1)  # every env ends an episode within max_steps
    rows = torch.arange(done.shape[0])
    reward = rollout["next", "reward"].squeeze(-1)
    steps = torch.arange(done.shape[1]).unsqueeze(0)
    episode_return = torch.where(steps <= first_end.unsqueeze(-1), reward, 0.0).sum(-1)
    return {
        "success_rate": rollout["next", "is_success"][rows, first_end].float().mean().item(),
        "episode_return": episode_return.mean().item(),
        "episode_length": (first_end + 1).float().mean().item(),
    }
