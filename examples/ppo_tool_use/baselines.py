"""Baseline advantage estimators for the reference experiment: what other systems do with masked steps.

Each is a TorchRL value estimator, installed with ``loss.make_value_estimator(instance)``, that
writes ``"advantage"`` and ``"value_target"`` from the same inputs as :class:`masked_rl.MaskedGAE`
(a ``[*B, T]`` rollout with ``"loss_mask"``, ``("next", "reward")``, ``("next", "done")``,
``("next", "terminated")`` and the critic's inputs, or precomputed ``"state_value"`` and
``("next", "state_value")``). Both rewrite some inputs of an existing estimator on a shallow copy
of the rollout (the caller's tensors are never modified) and write the results back:

- :class:`PlainGAE` (``plain``): TorchRL's ``GAE``, every step a transition, with the critic run
  once per step it reads instead of twice per step of the batch;
- :class:`ZeroedGAE` (``zeroed``): each episode's terminal reward moved to its last trainable
  step (the outcome reward on the last response token), values and rewards multiplied by the
  mask, then TorchRL's plain ``GAE`` over every step;
- :class:`TerminalOnlyGAE` (``terminal-only``): :class:`masked_rl.MaskedGAE` with every masked
  reward dropped except each episode's terminal one, and zero bootstrap at every episode end.

The fourth estimator of the experiment needs no code here: ``masked`` is
:class:`masked_rl.MaskedGAE`.

This module imports only torch, tensordict, torchrl and masked_rl: copy it with the recipe.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torch import Tensor
from torchrl.objectives.value import GAE

from masked_rl import MaskedGAE
from masked_rl.functional import check_loss_mask

__all__ = ["PlainGAE", "TerminalOnlyGAE", "ZeroedGAE"]


def _required(tensordict: TensorDictBase, key: NestedKey, estimator: str) -> Tensor:
    value = tensordict.get(key, None)
    if value is None:
        raise KeyError(
            f"{estimator} needs the key {key!r} in the input tensordict; found keys "
            f"{sorted(map(str, tensordict.keys(True, True)))}"
        )
    return value


def _write_back(tensordict: TensorDictBase, inputs: TensorDictBase, rewritten: set) -> None:
    """Copy into ``tensordict`` every entry the estimator wrote into ``inputs``, its shallow copy."""
    for key in inputs.keys(True, True):
        if key in rewritten:
            continue
        value = inputs.get(key)
        if tensordict.get(key, None) is not value:
            tensordict.set(key, value)


class PlainGAE(GAE):
    """``plain``: TorchRL's :class:`~torchrl.objectives.value.GAE` (every step a transition), its
    critic run once per step it reads.

    ``GAE`` runs the value network on every step's observation and again on every next
    observation: two passes over the whole ``[*B, T]`` batch. On a token stream with long tool
    outputs, and on :class:`masked_rl.CompleteEpisodes`' ``[*B, P + T]`` output (held-back steps
    and padding included), that is most of an update's time. This estimator computes the same
    advantages and value targets from fewer calls:

    - ``V[t]`` at every valid step: ``("collector", "mask")`` where present (the steps of whole
      episodes), else every step; ``V = 0`` elsewhere (no valid step's result reads it);
    - ``V'[t]`` where GAE reads it (valid and not terminated): copied from ``V[t + 1]`` when the
      next observation is step ``t + 1``'s observation (every value-network input equal), run
      on the network only where it is not (a row's last step, a truncation); ``V' = 0`` elsewhere.

    On the valid steps the results equal ``GAE``'s (tests check it on collected batches). With
    ``shifted=True``, functional ``params``, or a recurrent critic (``"is_init"``), it is ``GAE``
    unchanged. Arguments and keyword arguments are ``GAE``'s.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.modules import ValueOperator
        >>> from torchrl.objectives.value import GAE
        >>> from masked_rl_examples.ppo_tool_use.baselines import PlainGAE
        >>> obs = torch.arange(6.0).view(1, 6, 1)      # one row: obs[t + 1] is next obs[t]
        >>> done = torch.zeros(1, 5, 1, dtype=torch.bool); done[0, -1] = True
        >>> td = TensorDict({"observation": obs[:, :5], "next": {
        ...     "observation": obs[:, 1:], "reward": torch.ones(1, 5, 1), "done": done,
        ...     "terminated": done}}, batch_size=[1, 5])
        >>> calls = []
        >>> critic = ValueOperator(torch.nn.Linear(1, 1), in_keys=["observation"])
        >>> _ = critic.register_forward_hook(lambda m, i, o: calls.append(i[0].numel()))
        >>> with torch.no_grad():
        ...     plain = PlainGAE(gamma=0.9, lmbda=0.8, value_network=critic)(td.clone())
        ...     reference = GAE(gamma=0.9, lmbda=0.8, value_network=critic)(td.clone())
        >>> torch.allclose(plain["advantage"], reference["advantage"]), calls[0]  # 5 windows, not 10
        (True, 5)
    """

    def _value_reads(self, data: TensorDictBase, valid: Tensor) -> tuple[Tensor, Tensor]:
        """``(steps whose V is read, steps whose V' is read)``, ``[*B, T]`` bool each."""
        terminated = data.get(("next", self.tensor_keys.terminated), None)
        if terminated is None:
            terminated = _required(data, ("next", self.tensor_keys.done), type(self).__name__)
        return valid, valid & ~terminated.reshape(valid.shape).bool()

    def _call_value_nets(self, data: TensorDictBase, params, next_params, single_call: bool,
                         value_key: NestedKey, detach_next: bool, vmap_randomness: str = "error",
                         *, value_net=None):
        value_net = self.value_network if value_net is None else value_net
        in_keys = list(value_net.in_keys)
        if single_call or params is not None or next_params is not None or "is_init" in in_keys:
            return super()._call_value_nets(data, params, next_params, single_call, value_key,
                                            detach_next, vmap_randomness, value_net=value_net)
        steps = data.batch_size
        time_dim = list(data.names).index("time") if "time" in data.names else data.ndim - 1
        valid = data.get(("collector", "mask"), None)
        valid = torch.ones(steps, dtype=torch.bool, device=data.device) if valid is None \
            else valid.reshape(steps).bool()
        root_reads, next_reads = self._value_reads(data, valid)
        root, after = data.select(*in_keys), data.get("next").select(*in_keys)
        value = _evaluate(value_net, root, root_reads, value_key)
        # V'[t] is V[t + 1] where next obs [t] is obs [t + 1] (every input equal) and V[t + 1]
        # was computed; compared only where both are read.
        horizon = steps[time_dim]
        follows = torch.zeros_like(next_reads)
        candidates = (next_reads.narrow(time_dim, 0, horizon - 1)
                      & root_reads.narrow(time_dim, 1, horizon - 1))
        pairs = (after.narrow(time_dim, 0, horizon - 1)[candidates],
                 root.narrow(time_dim, 1, horizon - 1)[candidates])
        same = torch.ones(pairs[0].shape, dtype=torch.bool, device=data.device)
        for key in pairs[0].keys(True, True):  # [N, *F] each (N may be 0)
            equal = pairs[0].get(key) == pairs[1].get(key)
            same &= equal.flatten(1).all(-1) if equal.ndim > 1 else equal
        follows.narrow(time_dim, 0, horizon - 1)[candidates] = same
        next_value = _evaluate(value_net, after, next_reads & ~follows, value_key)
        shifted = torch.cat((value.narrow(time_dim, 1, horizon - 1),
                             torch.zeros_like(value.narrow(time_dim, 0, 1))), time_dim)
        next_value = torch.where(_expand(next_reads & follows, value), shifted, next_value)
        data.set(value_key, value)
        data.set(("next", value_key), next_value)
        return value, next_value.detach() if detach_next else next_value, None


def _expand(mask: Tensor, like: Tensor) -> Tensor:
    return mask.reshape(*mask.shape, *(1,) * (like.ndim - mask.ndim))


def _evaluate(network, data: TensorDictBase, where: Tensor, value_key: NestedKey) -> Tensor:
    """The value network on the steps ``where`` ([*B, T] bool) of ``data``; 0 elsewhere."""
    value = network(data[where]).get(value_key)
    full = value.new_zeros((*where.shape, *value.shape[1:]))
    full[where] = value
    return full


class ZeroedGAE(PlainGAE):
    """``zeroed``, the common "mask the tensors" approach of LLM RL: the outcome reward on the last
    response token, values and rewards multiplied by the mask, then TorchRL's plain GAE over every
    step; its value targets are meaningful on trainable steps only.

    With ``m[t]`` the ``loss_mask`` of step ``t`` and ``m'[t]`` that of the observation it reaches
    (``("next", "loss_mask")``, ``m[t + 1]`` inside an episode): the reward of an episode's last
    step ``e`` (``done[e]``), when ``e`` is masked, is moved to the episode's last trainable step
    (as systems that put the outcome reward on the last generated token do; an episode without a
    trainable step keeps it where it is). Then TorchRL's :class:`~torchrl.objectives.value.GAE`
    runs on ``V[t] * m[t]``, ``V'[t] * m'[t]`` and ``r[t] * m[t]``: every step is a transition (one
    ``gamma * lmbda`` per step, masked or not), a masked step's value is 0 and every other reward
    of a masked step (a tool output's shaping bonus, say) is dropped. Advantages at masked steps are not 0 in general (a PPO loss over
    trainable steps ignores them). The critic's value at masked observations never enters (it is
    multiplied by 0, and, as in :class:`PlainGAE`, the critic runs only where its value is kept),
    so train it on trainable steps only: there its target ``A + V`` is the GAE return.

    Arguments and keyword arguments are :class:`~torchrl.objectives.value.GAE`'s; the tensor
    keys are :class:`masked_rl.MaskedGAE`'s (``set_keys(loss_mask=...)`` renames the mask, read
    at the root and under ``"next"``, shape ``[*B, T]`` or ``[*B, T, 1]``, bool or 0 / 1).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from masked_rl_examples.ppo_tool_use.baselines import ZeroedGAE
        >>> mask = torch.tensor([[1, 0, 0, 1, 0]])
        >>> done = torch.zeros(1, 5, 1, dtype=torch.bool); done[0, -1] = True
        >>> reward = torch.tensor([[[0.0], [0.5], [0.0], [0.0], [1.0]]])   # both on masked steps
        >>> # The terminal 1.0 moves to step 3, the 0.5 is dropped, masked values count as 0.
        >>> td = TensorDict({
        ...     "loss_mask": mask, "state_value": torch.ones(1, 5, 1),
        ...     "next": {"loss_mask": torch.tensor([[0, 0, 1, 0, 0]]), "reward": reward,
        ...              "done": done, "terminated": done, "state_value": torch.ones(1, 5, 1)},
        ... }, batch_size=[1, 5])
        >>> ZeroedGAE(gamma=1.0, lmbda=1.0, value_network=None)(td)["advantage"].squeeze(-1)
        tensor([[0., 1., 1., 0., 0.]])
    """

    default_keys = MaskedGAE.default_keys
    _AcceptedKeys = MaskedGAE._AcceptedKeys

    @property
    def in_keys(self):
        keys = self.tensor_keys
        return [*super().in_keys, keys.loss_mask, ("next", keys.loss_mask)]

    def _masks(self, data: TensorDictBase, value: Tensor) -> tuple[Tensor, Tensor]:
        """``m`` and ``m'`` as ``value``'s dtype, broadcastable to ``value`` (``[*B, T, 1]``)."""
        key = self.tensor_keys.loss_mask
        root = _required(data, key, type(self).__name__)
        after = _required(data, ("next", key), type(self).__name__)
        return (
            check_loss_mask(root, value, key=key).to(value.dtype),
            check_loss_mask(after, value, key=("next", key)).to(value.dtype),
        )

    def _value_reads(self, data: TensorDictBase, valid: Tensor) -> tuple[Tensor, Tensor]:
        # The critic runs only where its output is not multiplied by 0.
        root_reads, next_reads = super()._value_reads(data, valid)
        like = valid.unsqueeze(-1).float()  # [*B, T, 1], as the values
        mask, next_mask = (m.reshape(valid.shape).bool() for m in self._masks(data, like))
        return root_reads & mask, next_reads & next_mask

    def _call_value_nets(self, data: TensorDictBase, *args, **kwargs):
        # The critic's outputs, multiplied by the mask of the observation each one is read at.
        value, next_value, valid = super()._call_value_nets(data, *args, **kwargs)
        mask, next_mask = self._masks(data, value)
        return value * mask, next_value * next_mask, valid

    def _rewritten(self, tensordict: TensorDictBase) -> tuple[TensorDictBase, set]:
        keys = self.tensor_keys
        inputs = tensordict.copy()
        reward = _required(tensordict, ("next", keys.reward), type(self).__name__)
        done = _required(tensordict, ("next", keys.done), type(self).__name__)
        mask, _ = self._masks(tensordict, reward)
        moved = _terminal_reward_on_last_action(reward, mask.bool(), done.bool(), self.time_dim or -2)
        inputs.set(("next", keys.reward), moved * mask)
        rewritten = {("next", keys.reward)}
        if self.value_network is None:  # precomputed values: zero them here
            value = _required(tensordict, keys.value, type(self).__name__)
            next_value = _required(tensordict, ("next", keys.value), type(self).__name__)
            mask, next_mask = self._masks(tensordict, value)
            inputs.set(keys.value, value * mask)
            inputs.set(("next", keys.value), next_value * next_mask)
            rewritten |= {keys.value, ("next", keys.value)}
        return inputs, rewritten

    def forward(self, tensordict: TensorDictBase, **kwargs) -> TensorDictBase:
        """Writes ``"advantage"`` and ``"value_target"`` (``[*B, T, 1]``); keyword arguments as ``GAE``."""
        inputs, rewritten = self._rewritten(tensordict)
        super().forward(inputs, **kwargs)
        _write_back(tensordict, inputs, rewritten)
        return tensordict

    def value_estimate(self, tensordict: TensorDictBase, *args, **kwargs) -> Tensor:
        """The value target, without writing to ``tensordict``."""
        return super().value_estimate(self._rewritten(tensordict)[0], *args, **kwargs)


def _terminal_reward_on_last_action(reward: Tensor, mask: Tensor, done: Tensor, time_dim: int) -> Tensor:
    """``reward`` with each episode's reward on a masked last step moved to its last trainable step.

    All ``[*B, T, 1]``; episodes end at ``done``. An episode without a trainable step keeps it.
    """
    reward, mask, done = (x.movedim(time_dim, -1) for x in (reward, mask.expand_as(reward), done))
    steps = torch.arange(reward.shape[-1], device=reward.device).expand_as(reward)
    starts = torch.cat((torch.ones_like(done[..., :1]), done[..., :-1]), -1)
    episode_start = torch.where(starts, steps, 0).cummax(-1).values
    last_action = torch.where(mask, steps, -1).cummax(-1).values
    moving = done & ~mask & (last_action >= episode_start)
    moved = torch.where(moving, 0.0, reward).scatter_add(
        -1, last_action.clamp_min(0), torch.where(moving, reward, 0.0))
    return moved.movedim(-1, time_dim)


class TerminalOnlyGAE(MaskedGAE):
    """``terminal-only``, the reference system's semantics: GAE on the trainable steps with each
    episode's terminal reward moved to its last trainable step, every other masked reward dropped,
    and zero bootstrap at every episode end; its value targets are meaningful on trainable steps only.

    Per episode with trainable steps ``t_1 < ... < t_K`` (as in :class:`masked_rl.MaskedGAE`,
    one ``gamma * lmbda`` per trainable transition):

    - ``R_j = r[t_j]`` (rewards on trainable steps are kept), plus, for ``j = K``, the reward of
      the episode's last step ``e`` if the episode ended there (``done[e]``, terminated or
      truncated) and ``e`` is masked. Every other reward of a masked step is dropped (a shaping
      bonus on a tool output, for example), and so are all rewards of an episode without a
      trainable step.
    - bootstrap after ``t_K``: ``0`` at an episode end, whether terminated or truncated; at a
      row cut by the collector (not an episode end), ``V'`` of the row's last step, as every
      TorchRL estimator does (the reference system has no cuts).

    It is :class:`~masked_rl.MaskedGAE` run on ``r' = r`` where ``loss_mask`` or ``done`` else
    ``0`` (masked GAE credits the kept terminal reward to the last trainable step before it)
    and ``terminated' = done``; every ``MaskedGAE`` argument keeps its meaning. Advantages and
    value targets are 0 at masked steps; train the critic on trainable steps (the reference
    system's critic). With ``masked_value_targets=True`` the masked steps get ``MaskedGAE``'s
    extension targets for ``r'`` and ``terminated'`` (and ``value_target_mask``), consistent
    with these rules, for a critic that must also bootstrap cut rows.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from masked_rl_examples.ppo_tool_use.baselines import TerminalOnlyGAE
        >>> done = torch.zeros(1, 5, 1, dtype=torch.bool); done[0, -1] = True
        >>> reward = torch.tensor([[[0.0], [0.5], [0.0], [0.0], [1.0]]])   # both on masked steps
        >>> td = TensorDict({
        ...     "loss_mask": torch.tensor([[1, 0, 0, 1, 0]]), "state_value": torch.zeros(1, 5, 1),
        ...     "next": {"reward": reward, "done": done, "terminated": torch.zeros_like(done),
        ...              "state_value": torch.full((1, 5, 1), 7.0)},
        ... }, batch_size=[1, 5])
        >>> TerminalOnlyGAE(gamma=1.0, lmbda=1.0, value_network=None)(td)["advantage"].squeeze(-1)
        tensor([[1., 0., 0., 1., 0.]])
    """

    def _rewritten(self, tensordict: TensorDictBase) -> tuple[TensorDictBase, set]:
        keys = self.tensor_keys
        name = type(self).__name__
        reward = _required(tensordict, ("next", keys.reward), name)
        done = _required(tensordict, ("next", keys.done), name)
        mask = check_loss_mask(_required(tensordict, keys.loss_mask, name), reward, key=keys.loss_mask)
        inputs = tensordict.copy()
        inputs.set(("next", keys.reward), torch.where(mask | done.bool(), reward, 0.0))
        inputs.set(("next", keys.terminated), done)
        return inputs, {("next", keys.reward), ("next", keys.terminated)}

    def forward(self, tensordict: TensorDictBase, **kwargs) -> TensorDictBase:
        """Writes ``"advantage"`` and ``"value_target"`` (``[*B, T, 1]``, 0 at masked steps)."""
        inputs, rewritten = self._rewritten(tensordict)
        super().forward(inputs, **kwargs)
        _write_back(tensordict, inputs, rewritten)
        return tensordict

    def value_estimate(self, tensordict: TensorDictBase, *args, **kwargs) -> Tensor:
        """The value target (0 at masked steps), without writing to ``tensordict``."""
        return super().value_estimate(self._rewritten(tensordict)[0], *args, **kwargs)
