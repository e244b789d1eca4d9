"""Environment, networks and evaluation of the PPO tool-use recipe."""

from __future__ import annotations

import gymnasium as gym
import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.envs import EnvBase
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import ActorValueOperator, ProbabilisticActor, ValueOperator

from masked_rl_envs import make_torchrl_env


# --- environment ---------------------------------------------------------------------------


def make_env(env_id: str, num_envs: int, device: str = "cpu") -> EnvBase:
    """``num_envs`` copies of ``env_id`` as one TorchRL env with batch size ``[num_envs]``.

    :func:`masked_rl_envs.make_torchrl_env` with a synchronous gymnasium vector env: the toy
    environments step in microseconds, so stepping them in turn in this process is several
    times faster than one subprocess per env. Keys per step: ``"tokens"`` ``[W]``,
    ``"loss_mask"`` int8 ``[1]`` (1 when the action of this step is the agent's),
    ``"is_success"``, ``"num_agent_tokens"``, ``"num_tool_calls"``, ``"action"`` (a token id),
    ``("next", "reward")``.
    """
    return make_torchrl_env(env_id, num_envs=num_envs, device=device, vectorization="sync")


def episode_step_limit(env_id: str) -> int:
    """The most steps an episode of ``env_id`` can take (its ``max_steps``)."""
    env = gym.make(env_id)
    try:
        return int(env.unwrapped.max_steps)
    finally:
        env.close()


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

    Shapes: ``tokens`` ``[*B, W]`` (int64) -> ``[*B, hidden]``.
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
        return self.mlp(self.embed(tokens))


def make_actor_critic(env: EnvBase, embed_dim: int, hidden: int, layers: int,
                      shared: bool = True, device="cpu"):
    """A categorical policy over the next token and a critic, both reading ``"tokens"``.

    With ``shared``, one :class:`TokenWindowEncoder` feeds both heads (TorchRL's
    ``ActorValueOperator``, as in its Atari PPO recipe); the critic's loss then also shapes the
    features the policy reads.
    """
    vocab_size = env.action_spec.space.n
    window = env.observation_spec["tokens"].shape[-1]

    def encoder():
        return TokenWindowEncoder(vocab_size, window, embed_dim, hidden, layers)

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
        "success_rate": batch["next", "is_success"][done].float().mean().item(),
        "reward_per_episode": batch["next", "reward"].sum().item() / int(done.sum()),
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
    if rollout.ndim == 1:  # a single, unbatched environment
        rollout = rollout.unsqueeze(0)
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
