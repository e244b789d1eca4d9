"""``MaskedGAE``: TorchRL's ``GAE`` over the trainable steps of each episode."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
from tensordict import TensorDictBase
from tensordict.nn import dispatch, skip_existing
from tensordict.utils import NestedKey
from torch import Tensor
from torchrl.objectives.utils import hold_out_net
from torchrl.objectives.value import GAE
from torchrl.objectives.value.advantages import (
    _self_set_grad_enabled,
    _self_set_skip_existing,
    _standardize_by_group,
)

from masked_rl.distributed import LAYOUTS as CP_LAYOUTS
from masked_rl.distributed import cp_masked_generalized_advantage_estimate
from masked_rl._checks import _check_discount, check_loss_mask
from masked_rl.functional import masked_generalized_advantage_estimate
from masked_rl.statistics import masked_standardize

__all__ = ["MaskedGAE"]

VALUE_STEPS = ("read", "all")


class MaskedGAE(GAE):
    """Generalized Advantage Estimation over the trainable steps of each episode.

    A drop-in :class:`~torchrl.objectives.value.GAE` for token streams that mix the
    policy's own steps (``loss_mask == 1``) with steps it never chose (prompt tokens,
    tool results, observations; ``loss_mask == 0``). Each episode is compressed to its
    trainable steps and GAE runs on that subsequence (the semantics of
    :func:`~masked_rl.masked_generalized_advantage_estimate`):

    - a reward on a masked step is credited, undiscounted, to the last trainable step
      before it (rewards before an episode's first trainable step are dropped);
    - the advantage carry crosses a masked gap with exactly one ``gamma * lmbda``;
    - an episode's last trainable step bootstraps from ``0`` if the episode terminated,
      else from ``("next", "state_value")`` at the episode's last step;
    - advantage and value target are exactly ``0`` at masked steps, and nothing stored
      at a masked step but its reward can change any output (NaN and inf included);
    - ``average_gae=True`` standardises with statistics over trainable steps only;
      masked steps stay ``0``;
    - with an all-ones mask the output equals :class:`~torchrl.objectives.value.GAE`'s.

    Downstream, masked steps must also get no gradient: reduce the PPO loss over
    trainable steps only (:class:`masked_rl.MaskedClipPPOLoss` and the other masked losses of
    :mod:`masked_rl.loss` do it).

    Args and keyword args are those of :class:`~torchrl.objectives.value.GAE` and keep
    their meaning (``value_network`` or precomputed ``"state_value"`` /
    ``("next", "state_value")``, ``average_gae``, ``group_key``, ``differentiable``,
    ``skip_existing``, ``shifted``, ``device``, ``time_dim``, ``auto_reset_env``, value
    chunking). ``skip_existing=True`` reads ``"state_value"`` and ``("next", "state_value")``
    where the input holds them (neither recomputed nor overwritten), as ``GAE`` does. TorchRL's
    ``vectorized`` is refused: the estimator is always exact (no filter truncation), one
    compiled pass over each row on the CPU, vectorized elsewhere.

    Keyword Args:
        masked_value_targets (bool): also write value targets at masked steps and the bool
            ``value_target_mask`` entry saying which steps carry one (see
            :func:`~masked_rl.masked_generalized_advantage_estimate`). A critic trained on them
            gives meaningful bootstraps where a collector cuts a row, or an episode is truncated,
            inside a masked block. Advantages are unchanged. Defaults to ``False``.
        cp_group (ProcessGroup, optional): context parallelism: the input is this rank's slice
            ``[*B, T_local]`` of rows split over ``cp_group`` (``torch.distributed.group.WORLD``
            for every rank), and the outputs are its slice of the full rows' (one small
            ``all_gather`` per call; see
            :func:`~masked_rl.distributed.cp_masked_generalized_advantage_estimate`; it refuses
            values that require grad: with ``differentiable=True``, pass detached parameters, as
            the PPO losses do). Defaults to ``None`` (whole rows on every rank).
        cp_layout (str): ``"contiguous"`` or ``"zigzag"`` (Megatron's). Defaults to
            ``"contiguous"``.
        cp_chunk_lengths (list of int, optional): chunk lengths in row order, for rows not cut
            evenly (see :func:`~masked_rl.distributed.cp_chunk_lengths`).
        dp_group (ProcessGroup, optional): ``average_gae`` statistics over the trainable steps of
            every rank of this data-parallel group too (with ``cp_group``: over the CP x DP
            grid); also used by a masked PPO loss's ``normalize_advantage``. Defaults to ``None``.
        value_steps (str): where ``value_network`` runs. ``"read"`` (default): only on the steps
            the rule reads, ``V`` at trainable steps and ``V'`` at trainable steps and at
            episode ends that do not terminate (a row's last step included), in two calls on
            flat ``[n]`` batches of those steps; ``"state_value"`` and ``("next",
            "state_value")`` are written with NaN everywhere else. In token streams with 2-5 %
            trainable steps this skips 95-98 % of the critic's work. ``"all"``: on every step,
            as ``GAE`` does. ``"read"`` runs on every step anyway with
            ``masked_value_targets=True`` (the critic then trains on masked steps, and a PPO
            loss's ``clip_value`` reads the stored values there), with ``shifted=True`` (TorchRL's
            single call over the shifted observations), with ``auto_reset_env=True`` and for a
            recurrent ``value_network`` (``"is_init"`` among its in_keys: its state runs along
            time). Precomputed values (``value_network=None``) are read as given.

    Tensor keys (``set_keys``): those of ``GAE`` plus ``loss_mask`` (default
    ``"loss_mask"``), read at the root of the input tensordict with shape ``[*B, T]`` or
    ``[*B, T, 1]``; bool, or integers / floats holding only ``0`` and ``1`` (TorchRL's
    Gymnasium wrapper delivers int8); and ``value_target_mask`` (default
    ``"value_target_mask"``), written with ``masked_value_targets=True``, bool ``[*B, T, 1]``.

    See ``docs/semantics.md`` for the rules with worked cases.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from masked_rl import MaskedGAE
        >>> B, T = 2, 6
        >>> done = torch.zeros(B, T, 1, dtype=torch.bool); done[:, -1] = True
        >>> reward = torch.zeros(B, T, 1); reward[:, -1] = 1.0   # terminal reward on a masked step
        >>> td = TensorDict({
        ...     "loss_mask": torch.tensor([[0, 1, 1, 0, 0, 0], [0, 0, 1, 0, 1, 0]], dtype=torch.int8),
        ...     "state_value": torch.zeros(B, T, 1),
        ...     "next": {"reward": reward, "done": done, "terminated": done,
        ...              "state_value": torch.zeros(B, T, 1)},
        ... }, batch_size=[B, T])
        >>> td = MaskedGAE(gamma=1.0, lmbda=0.5, value_network=None)(td)
        >>> td["advantage"].squeeze(-1)
        tensor([[0.0000, 0.5000, 1.0000, 0.0000, 0.0000, 0.0000],
                [0.0000, 0.0000, 0.5000, 0.0000, 1.0000, 0.0000]])
    """

    @dataclass
    class _AcceptedKeys(GAE._AcceptedKeys):
        """TorchRL's GAE keys plus ``loss_mask``.

        TorchRL's ``set_keys`` only accepts names found in this class's own ``__dict__``,
        so the inherited keys are declared again (same defaults as ``GAE``).

        Attributes:
            loss_mask (NestedKey): root key of the per-step flag, ``1`` where the step is the
                policy's own and trains, ``0`` where it was written by the environment.
                Defaults to ``"loss_mask"``.
        """

        advantage: NestedKey = "advantage"
        value_target: NestedKey = "value_target"
        value: NestedKey = "state_value"
        reward: NestedKey = "reward"
        done: NestedKey = "done"
        terminated: NestedKey = "terminated"
        steps_to_next_obs: NestedKey = "steps_to_next_obs"
        sample_log_prob: NestedKey | None = None
        loss_mask: NestedKey = "loss_mask"
        value_target_mask: NestedKey = "value_target_mask"

    default_keys = _AcceptedKeys

    def __init__(self, *, masked_value_targets: bool = False, cp_group=None,
                 cp_layout: str = "contiguous", cp_chunk_lengths=None, dp_group=None,
                 value_steps: str = "read", **kwargs):
        if "vectorized" in kwargs:
            raise TypeError("MaskedGAE takes no vectorized argument: it always computes the exact "
                            "masked recursion (compiled on the CPU, vectorized elsewhere)")
        for name in ("gamma", "lmbda"):  # at construction, not first at forward
            if name in kwargs:
                _check_discount(name, kwargs[name])
        super().__init__(**kwargs)
        if not isinstance(masked_value_targets, bool):
            raise TypeError(f"masked_value_targets must be a bool, got {masked_value_targets!r}")
        self.masked_value_targets = masked_value_targets
        if value_steps not in VALUE_STEPS:
            raise ValueError(f"value_steps must be one of {VALUE_STEPS}, got {value_steps!r}")
        self.value_steps = value_steps
        if cp_layout not in CP_LAYOUTS:
            raise ValueError(f"cp_layout must be one of {CP_LAYOUTS}, got {cp_layout!r}")
        # Process groups are per-estimator arguments, never module-level state.
        self.cp_group, self.cp_layout, self.cp_chunk_lengths = cp_group, cp_layout, cp_chunk_lengths
        self.dp_group = dp_group

    @property
    def statistics_groups(self) -> list:
        """The groups whose trainable steps ``average_gae`` (and a masked PPO loss's
        ``normalize_advantage``) standardise over: ``cp_group`` and ``dp_group`` when given."""
        return [group for group in (self.cp_group, self.dp_group) if group is not None]

    @property
    def loss_mask_key(self) -> NestedKey:
        return self.tensor_keys.loss_mask

    @property
    def in_keys(self):
        in_keys = super().in_keys
        if self.tensor_keys.loss_mask not in in_keys:
            in_keys = [*in_keys, self.tensor_keys.loss_mask]
        return in_keys

    @property
    def out_keys(self):
        out_keys = super().out_keys
        if self.masked_value_targets and self.tensor_keys.value_target_mask not in out_keys:
            out_keys = [*out_keys, self.tensor_keys.value_target_mask]
        return out_keys

    @_self_set_skip_existing
    @_self_set_grad_enabled
    @dispatch
    def forward(
        self,
        tensordict: TensorDictBase,
        *,
        params: TensorDictBase | None = None,
        target_params: TensorDictBase | None = None,
        time_dim: int | None = None,
    ) -> TensorDictBase:
        """Writes ``"advantage"`` and ``"value_target"`` (``[*B, T, 1]``, ``0`` at masked steps;
        with ``masked_value_targets``, targets at masked steps too and ``"value_target_mask"``).

        Args:
            tensordict (TensorDictBase): a ``[*B, T]`` rollout with the ``loss_mask``,
                ``("next", "reward")``, ``("next", "done")``, ``("next", "terminated")``
                entries and either the value network's inputs or ``"state_value"`` and
                ``("next", "state_value")``.

        Keyword Args:
            params, target_params: functional value-network parameters, as in ``GAE``.
            time_dim (int, optional): overrides the estimator's ``time_dim``.
        """
        advantage, value_target, has_target = self._estimate(tensordict, params, target_params, time_dim)
        tensordict.set(self.tensor_keys.advantage, advantage)
        tensordict.set(self.tensor_keys.value_target, value_target)
        if has_target is not None:
            tensordict.set(self.tensor_keys.value_target_mask, has_target)
        return tensordict

    def value_estimate(
        self,
        tensordict: TensorDictBase,
        params: TensorDictBase | None = None,
        target_params: TensorDictBase | None = None,
        time_dim: int | None = None,
        **kwargs,
    ) -> Tensor:
        """Returns the value target (``0`` where a step carries none) without writing to ``tensordict``."""
        return self._estimate(tensordict, params, target_params, time_dim, standardize=False)[1]

    # -- internals ------------------------------------------------------------

    @staticmethod
    def _require(tensordict: TensorDictBase, key: NestedKey, hint: str = "") -> Tensor:
        value = tensordict.get(key, None)
        if value is None:
            raise KeyError(
                f"MaskedGAE needs the key {key!r} in the input tensordict{hint}; "
                f"found keys {sorted(map(str, tensordict.keys(True, True)))}"
            )
        return value

    def _values(
        self,
        tensordict: TensorDictBase,
        params: TensorDictBase | None,
        target_params: TensorDictBase | None,
        time_dim: int,
    ) -> tuple[Tensor, Tensor]:
        """``V`` and ``V'`` from the value network, or read from the tensordict."""
        value_key = self.tensor_keys.value
        if self.value_network is None:
            hint = " (no value_network was given, so values must be precomputed)"
            return (
                self._require(tensordict, value_key, hint),
                self._require(tensordict, ("next", value_key), hint),
            )
        # From GAE.forward (TorchRL 0.14.1), to the _call_value_nets call: the same parameters
        # and the same call; test_advantages checks the outputs against GAE's.
        if params is not None:
            params = params.detach()
            if target_params is None:
                target_params = params.clone(False)
        frozen = params is None and target_params is None
        with hold_out_net(self.value_network) if frozen else nullcontext():
            if self._reads_only():
                return self._values_at_reads(tensordict, params, target_params, time_dim)
            value, next_value, valid = self._call_value_nets(
                data=tensordict,
                params=params,
                next_params=target_params,
                single_call=self.shifted,
                value_key=value_key,
                detach_next=True,
                vmap_randomness=self.vmap_randomness,
            )
        if valid is not None:
            tensordict.set("shifted_valid", valid)
        return value, next_value

    def _reads_only(self) -> bool:
        """Whether ``value_network`` runs only where the rule reads (``value_steps``)."""
        recurrent = "is_init" in getattr(self.value_network, "in_keys", ())
        # auto_reset_env folds V into every step's reward (a product with the truncation flag).
        return (self.value_steps == "read" and not self.masked_value_targets and not recurrent
                and not self.auto_reset_env and not self.shifted)

    def _values_at_reads(
        self,
        tensordict: TensorDictBase,
        params: TensorDictBase | None,
        target_params: TensorDictBase | None,
        time_dim: int,
    ) -> tuple[Tensor, Tensor]:
        """``V`` at trainable steps and ``V'`` at trainable steps and non-terminal episode ends.

        That is every entry :func:`~masked_rl.masked_generalized_advantage_estimate` reads: the
        deltas read ``V`` at trainable steps, and a bootstrap reads ``V`` at the next trainable
        step, ``V'`` at the step itself when the next one is trainable too, or ``V'`` at the
        episode's last step ``e`` (a truncation, or a row's last step) unless it terminated.
        Under ``cp_group`` a rank's last step is also read (its row may continue elsewhere).
        Every other entry is NaN, which the rule never reads.
        """
        keys = self.tensor_keys
        reward = self._require(tensordict, ("next", keys.reward))
        mask = check_loss_mask(self._require(tensordict, keys.loss_mask), reward, key=keys.loss_mask)
        steps = tensordict.batch_size
        trainable = mask.reshape(steps)
        done = self._require(tensordict, ("next", keys.done)).reshape(steps).bool()
        terminated = tensordict.get(("next", keys.terminated), None)
        terminated = done if terminated is None else terminated.reshape(steps).bool()
        end = done.clone()
        if end.shape[time_dim]:
            end.select(time_dim, -1).fill_(True)  # every row's last step ends an episode
        next_read = trainable | (end & ~terminated)
        values = []
        for data, where, these_params in ((tensordict, trainable, params),
                                          (tensordict.get("next"), next_read, target_params)):
            stored = data.get(keys.value, None) if skip_existing() else None
            if stored is None:  # as GAE (its value network skips existing outputs): stored wins
                stored = self._evaluate_at(data, where, these_params)
                data.set(keys.value, stored)
            values.append(stored)
        return values[0], values[1]

    def _evaluate_at(self, data: TensorDictBase, where: Tensor,
                     params: TensorDictBase | None) -> Tensor:
        """The value network on the steps ``where`` ([*B, T] bool) of ``data``; NaN elsewhere."""
        network = self.value_network
        steps = data.select(*network.in_keys, strict=False)[where]
        if params is None:
            value = network(steps).get(self.tensor_keys.value)
        else:  # detached parameters (``to_module`` wraps them back as Parameters)
            with params.to_module(network):
                value = network(steps).get(self.tensor_keys.value).detach()
        full = torch.full((*where.shape, *value.shape[1:]), float("nan"), dtype=value.dtype,
                          device=value.device)
        full[where] = value
        return full

    def _estimate(
        self,
        tensordict: TensorDictBase,
        params: TensorDictBase | None,
        target_params: TensorDictBase | None,
        time_dim: int | None,
        *,
        standardize: bool = True,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(advantage, value_target, value_target_mask or None)``."""
        if tensordict.batch_dims < 1:
            raise RuntimeError(
                "Expected the input tensordict to have at least one (time) dimension, got "
                f"batch_size {list(tensordict.batch_size)}"
            )
        keys = self.tensor_keys
        if tensordict.get(keys.steps_to_next_obs, None) is not None:
            raise ValueError(
                f"MaskedGAE does not support per-step discounting ({keys.steps_to_next_obs!r} "
                "is present, e.g. from a MultiStep transform): the masked recursion needs one "
                "gamma for the whole batch"
            )
        time_dim = self._get_time_dim(time_dim, tensordict)
        value, next_value = self._values(tensordict, params, target_params, time_dim)
        # From GAE.forward (TorchRL 0.14.1), to the auto_reset_env block (checked against GAE
        # with shifted=True and auto_reset_env=True in test_advantages).
        valid = tensordict.get("shifted_valid", None)
        data = self._prepare_shifted_tensordict(tensordict, valid, time_dim)
        reward = self._require(data, ("next", keys.reward))
        done = self._require(data, ("next", keys.done))
        terminated = data.get(("next", keys.terminated), done)
        reward, done, terminated = self._prepare_signals(reward, done, terminated, value)
        if self.auto_reset_env:
            truncated = self._broadcast_optional(self._require(tensordict, ("next", "truncated")), value)
            reward = reward + self.gamma.to(reward.device) * value * truncated
            terminated = done
        # Ours from here: the mask joins the call, and standardisation uses trainable steps.
        mask = check_loss_mask(self._require(tensordict, keys.loss_mask), reward, key=keys.loss_mask)
        if valid is not None:
            mask = mask & self._expand_to_match(valid, mask)
        estimate = masked_generalized_advantage_estimate
        if self.cp_group is not None:
            estimate = partial(cp_masked_generalized_advantage_estimate, group=self.cp_group,
                               layout=self.cp_layout, chunk_lengths=self.cp_chunk_lengths)
        advantage, value_target, *has_target = estimate(
            self.gamma, self.lmbda, value, next_value, reward, done, terminated, mask,
            time_dim=time_dim, masked_value_targets=self.masked_value_targets,
        )
        if standardize and self.average_gae:
            groups = self._group_ids(tensordict)
            if groups is None:
                advantage = masked_standardize(advantage, mask, group=self.statistics_groups or None)
            elif self.statistics_groups:
                raise ValueError("average_gae with a group_key is not supported with cp_group or dp_group")
            else:
                full_mask = mask.expand_as(advantage)
                advantage = torch.where(
                    full_mask, _standardize_by_group(advantage, groups, full_mask), 0.0
                )
        return advantage, value_target, has_target[0] if has_target else None
