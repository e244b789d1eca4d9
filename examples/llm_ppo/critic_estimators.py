"""The two critic-based estimators of ``masked-rl llm-train``: masked GAE and plain token GAE.

Both use masked_rl.llm's token critic (``V[t]`` read at position ``t - 1``): a scalar head on the
policy's trunk (``--critic shared``, the default) or on a separate causal model of the policy's
size (``--critic separate``), and ``TokenPPOLoss`` for the policy term at the assistant tokens;
they differ in the advantage:

- ``masked``: :func:`masked_rl.llm.compute_token_advantages`: the adapter (rewards on each turn's
  closing token, done/terminated at the transcript's end) and ``MaskedGAE`` over the assistant
  tokens only; the critic is trained on the assistant tokens' value targets (with
  ``--critic-tokens every``, on MaskedGAE's targets at every token: a dense critic beside the
  same advantages).
- ``plain``: the same steps through TorchRL's ``GAE``: every real token is a transition (prompt,
  tool and template tokens included, each one more ``gamma * lmbda`` between two decisions), and
  the critic is trained on every real token's value target, as TorchRL's GAE expects (with
  ``--critic-tokens trainable``, on the assistant tokens only).
"""

from __future__ import annotations

import torch
from torch import nn
from torchrl.objectives.value import GAE

from masked_rl import MaskedGAE
from masked_rl.llm import TokenCritic, TokenPPOLoss, compute_token_advantages, transcript_steps

from masked_rl_envs.llm_factories import make_model


def _critic(cfg, model, tokenizer) -> TokenCritic:
    if cfg.critic == "shared":  # TokenPPOLoss then reads logits and values from one forward
        return TokenCritic(model)
    trunk = make_model(tokenizer, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                       num_heads=cfg.num_heads, seed=cfg.seed + 1).model
    return TokenCritic(trunk.to(cfg.device).eval())


class MaskedEstimator(nn.Module):
    dense_critic_tokens = "targets"
    """``TokenPPOLoss``'s ``critic_tokens`` for a dense critic: where this estimator's targets are."""

    def __init__(self, cfg, model, tokenizer):
        super().__init__()
        self.policy = model
        self.critic = _critic(cfg, model, tokenizer)
        self.gae = self._estimator(cfg)
        self.loss_module = TokenPPOLoss(
            model, self.critic, clip_epsilon=cfg.clip_epsilon, critic_coeff=cfg.critic_coeff,
            critic_tokens=self.dense_critic_tokens if cfg.dense_critic else "trainable",
            entropy_coeff=cfg.entropy_coeff, normalize_advantage=cfg.normalize_advantage)
        self.eos = tokenizer.eos_token_id
        self.end_of_turn_action = cfg.end_of_turn_action
        self.bootstrap_truncated = cfg.bootstrap_truncated

    def _estimator(self, cfg):
        return MaskedGAE(gamma=cfg.gamma, lmbda=cfg.lmbda, value_network=None,
                         masked_value_targets=cfg.dense_critic)

    def terminated(self, rollout) -> torch.Tensor:
        """``[B]``: the episodes whose value after the transcript is 0 (all of them, unless
        ``bootstrap_truncated``)."""
        if self.bootstrap_truncated:
            return rollout.terminated
        return torch.ones_like(rollout.terminated)

    def prepare(self, data, rollout) -> None:
        compute_token_advantages(data, self.critic, self.gae, terminated=self.terminated(rollout),
                                 turn_reward=rollout.turn_rewards, mode="history",
                                 end_of_turn_token_id=self.eos,
                                 end_of_turn_action=self.end_of_turn_action)

    def loss(self, minibatch) -> dict:
        out = self.loss_module(minibatch)
        return {k: out[k] for k in out.keys()}


class PlainEstimator(MaskedEstimator):
    """TorchRL's GAE over every token; the policy term at the assistant tokens, the value loss
    at every real token (``critic_tokens="every"``, from the policy term's forward when the
    critic shares the trunk)."""

    dense_critic_tokens = "every"

    def _estimator(self, cfg):
        return GAE(gamma=cfg.gamma, lmbda=cfg.lmbda, value_network=None)

    def prepare(self, data, rollout) -> None:
        steps = transcript_steps(data, terminated=self.terminated(rollout),
                                 turn_reward=rollout.turn_rewards, mode="history",
                                 end_of_turn_token_id=self.eos,
                                 end_of_turn_action=self.end_of_turn_action)
        with torch.no_grad():
            value, next_value = self.critic(steps["tokens"], steps["attention_mask"])
        steps["state_value"], steps["next", "state_value"] = value, next_value
        self.gae(steps)
        data.set("loss_mask", steps["loss_mask"])
        data.set("advantage", torch.where(steps["loss_mask"].unsqueeze(-1),
                                          steps["advantage"], 0.0))
        data.set("value_target", steps["value_target"])


def make_critic_estimator(cfg, model, tokenizer, wrappers) -> nn.Module:
    return {"masked": MaskedEstimator, "plain": PlainEstimator}[cfg.estimator](cfg, model, tokenizer)
