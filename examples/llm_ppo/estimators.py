"""The three estimators ``masked-rl llm-train`` compares, each a loss plus a ``prepare`` step.

``prepare(data, rollout)`` writes ``"advantage"`` ``[B, T, 1]`` (dense, aligned with the
left-padded ``("tokens", "full")`` of the scoring pass, 0 off the assistant mask) and, for the
critic-based ones, ``"value_target"``; ``loss(minibatch)`` returns the loss terms.

- ``grpo``: TorchRL's ``GRPOLoss`` (``masking_strategy="rlhf"``: the assistant tokens) with the
  group-relative advantage ``(R - mean_group(R)) / (std_group(R) + eps)`` of each episode's
  return ``R``, over the ``group_size`` samples of one task, written on every assistant token of
  the episode. (A dense left-aligned ``[B, T, 1]`` advantage: TorchRL reads a ragged one with
  right padding while its log-probs are left-padded.) No critic.
- ``masked``: masked_rl.llm: the adapter to the ``[B, T]`` step layout, the token critic,
  MaskedGAE over the assistant tokens and TokenPPOLoss.
- ``plain``: the same critic and loss with TorchRL's GAE over every token (prompt, tool and
  template tokens are transitions too, each discounted by ``gamma * lmbda``).
"""

from __future__ import annotations

import torch
from torch import nn
from torchrl.objectives.llm import GRPOLoss

GROUP_STD_EPS = 1e-6


def group_relative_advantage(returns: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[B]`` returns -> ``[B]`` advantages standardised within consecutive groups.

    >>> group_relative_advantage(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2)
    tensor([ 0.7071, -0.7071,  0.0000,  0.0000])
    """
    grouped = returns.view(-1, group_size)
    centred = grouped - grouped.mean(-1, keepdim=True)
    return (centred / (grouped.std(-1, keepdim=True) + GROUP_STD_EPS)).reshape(-1)


class GRPOEstimator(nn.Module):
    """TorchRL's ``GRPOLoss`` on the scoring wrapper, with the group-relative advantage."""

    def __init__(self, cfg, wrappers):
        super().__init__()
        self.group_size = cfg.group_size
        self.loss_module = GRPOLoss(
            wrappers.score, clip_epsilon=cfg.clip_epsilon, masking_strategy="rlhf",
            entropy_bonus=cfg.entropy_coeff > 0, entropy_coeff=cfg.entropy_coeff,
        )

    def prepare(self, data, rollout) -> None:
        mask = data["masks", "all_assistant_mask"]
        advantage = group_relative_advantage(rollout.returns, self.group_size)
        data["advantage"] = (advantage[:, None] * mask).unsqueeze(-1)

    def loss(self, minibatch) -> dict:
        out = self.loss_module(minibatch)
        terms = {"loss_objective": out.loss_objective, "clip_fraction": out.clip_fraction,
                 "kl_approx": out.kl_approx}
        if out.loss_entropy is not None:
            terms["loss_entropy"] = out.loss_entropy
        return terms


def make_estimator(cfg, model, tokenizer, wrappers) -> nn.Module:
    """The estimator of ``cfg.estimator`` for ``model``; its ``parameters()`` are what the
    optimizer trains (the policy's, plus the critic's)."""
    if cfg.estimator == "grpo":
        return GRPOEstimator(cfg, wrappers)
    from .critic_estimators import make_critic_estimator

    return make_critic_estimator(cfg, model, tokenizer, wrappers)
