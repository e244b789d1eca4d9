"""PPO losses of TorchRL that train on the policy's own steps only.

A token stream mixes the policy's steps (``loss_mask == 1``) with steps it never chose
(prompt, tool output; ``loss_mask == 0``). Masked GAE gives the masked steps exactly
zero advantage, but that is not enough: a stock TorchRL PPO loss would still average its
policy, entropy and critic terms over *every* step, pull the critic towards ``0`` at masked
steps, standardise advantages with statistics diluted by the masked zeros, and report
``clip_fraction`` or ``kl_approx`` over actions the environment ignored. Here one forward
(:meth:`MaskedPPOLossMixin.forward`) serves the three masked losses, :class:`MaskedClipPPOLoss`,
:class:`MaskedKLPENPPOLoss` and :class:`MaskedPPOLoss` (TorchRL's ``ClipPPOLoss``,
``KLPENPPOLoss`` and ``PPOLoss`` with the mixin in front):

1. the loss mask is read and validated once (bool, or ``0`` / ``1`` numbers);
2. if the input has no advantage yet, the value estimator runs on the full ``[*B, T]``
   batch (it needs the time structure, and the masked steps' rewards);
3. the trainable steps are selected (:func:`select_trainable_steps`), a flat ``[N]`` batch,
   and the unchanged TorchRL loss runs on them;
4. with ``masked_value_targets=True``, the critic term is computed instead on every step
   that carries a value target (``value_target_mask``, written by
   ``MaskedGAE(masked_value_targets=True)``): trainable steps and the masked steps of
   episodes with one. The policy and entropy terms stay on the trainable steps.

So the policy and entropy terms are means over trainable steps, ``normalize_advantage``
and the policy statistics use trainable steps only, a masked step gets exactly zero gradient
from the policy and entropy terms (whatever it stores: NaN log-probs, out-of-range actions),
and from the critic too unless ``masked_value_targets`` asks the critic to learn it. With
``reduction="none"`` the per-step outputs have shape ``[N]``.

The rules and a worked case are in ``docs/semantics.md`` ("The loss side").
The trainable-step flag is the tensor key ``loss_mask`` (``tensor_keys.loss_mask``, default
``"loss_mask"``, renamed with ``set_keys(loss_mask=...)``). TorchRL's own
:attr:`~torchrl.objectives.LossModule.loss_mask_key` keeps its meaning, the *validity* entries
(``"auto"``: ``("collector", "mask")`` and ``"shifted_valid"`` where present; a key; or ``None``):
a step trains only if it is trainable *and* valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import dispatch
from tensordict.utils import NestedKey
from torchrl.objectives import ClipPPOLoss, KLPENPPOLoss, PPOLoss
from torchrl.objectives.utils import ValueEstimators, default_value_kwargs
from torchrl.objectives.value import ValueEstimatorBase

from masked_rl.advantages import MaskedGAE
from masked_rl._checks import check_loss_mask
from masked_rl.reduction import REDUCTIONS, masked_mean
from masked_rl.statistics import masked_standardize

__all__ = [
    "MaskedClipPPOLoss",
    "MaskedKLPENPPOLoss",
    "MaskedPPOLoss",
    "MaskedPPOLossMixin",
    "attach_masked_gae",
    "select_trainable_steps",
    "training_step_masks",
]

# TorchRL's own validity entries (its ``loss_mask_key="auto"``): padding from split
# trajectories and the shifted value estimation's invalid last steps.
_VALIDITY_KEYS = (("collector", "mask"), "shifted_valid")
# With reduction="token_mean" / "sequence_mean": each step's flat position in the input batch.
_STEP_INDEX = ("_masked_rl", "step_index")

_RENAMED_KEY = (
    "loss_mask_key is TorchRL's validity-mask setting (LossModule.loss_mask_key: 'auto', None or "
    "a key), not the trainable-step flag: name that with loss.set_keys(loss_mask=...)"
)


def _step_mask(tensordict: TensorDictBase, key: NestedKey, *, what: str) -> torch.Tensor:
    """``tensordict[key]`` validated as a per-step flag: a bool tensor of shape ``batch_size``."""
    flag = tensordict.get(key, None)
    if flag is None:
        raise KeyError(
            f"expected the {what} {key!r} in the input tensordict, "
            f"found keys {sorted(map(str, tensordict.keys(True, True)))}"
        )
    # A shape-only reference: check_loss_mask accepts [*B] and [*B, 1] against [*B, 1].
    reference = torch.empty((*tensordict.batch_size, 1), device="meta")
    return check_loss_mask(flag, reference, key=key).squeeze(-1)


def training_step_masks(
    tensordict: TensorDictBase,
    loss_mask_key: NestedKey = "loss_mask",
    value_target_mask_key: NestedKey | None = None,
    validity_keys: tuple[NestedKey, ...] = _VALIDITY_KEYS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The bool ``[*B]`` masks of the steps that train: ``(policy steps, critic steps or None)``.

    The one place the masked losses and :func:`select_trainable_steps` decide which steps
    train. A step trains the policy if ``tensordict[loss_mask_key]`` is ``1`` and it is valid
    (``validity_keys``, where present: by default TorchRL's ``("collector", "mask")`` and
    ``"shifted_valid"``, what a loss's ``loss_mask_key="auto"`` reads); with
    ``value_target_mask_key``, a step trains the critic if it carries a value target there
    and is valid (``None``: the critic trains on the policy's steps). Flags have shape ``[*B]``
    or ``[*B, 1]`` and hold bool or ``0`` / ``1`` numbers; anything else raises a
    ``ValueError`` naming the key.
    """
    trainable = _step_mask(tensordict, loss_mask_key, what="loss mask (1 where the step is the policy's own)")
    has_target = None
    if value_target_mask_key is not None:
        has_target = _step_mask(
            tensordict, value_target_mask_key,
            what="value target mask (written by MaskedGAE(masked_value_targets=True))",
        )
    for key in validity_keys:
        if key in tensordict.keys(include_nested=True):
            valid = _step_mask(tensordict, key, what="validity mask")
            trainable = trainable & valid
            if has_target is not None:
                has_target = has_target & valid
    return trainable, has_target


def select_trainable_steps(
    tensordict: TensorDictBase, loss_mask_key: NestedKey = "loss_mask"
) -> TensorDictBase:
    """The steps of ``tensordict`` that train the policy, as a flat ``[N]`` tensordict.

    Those with ``loss_mask == 1`` that are valid (:func:`training_step_masks`).
    ``tensordict[loss_mask_key]`` must have shape ``[*B]`` or ``[*B, 1]`` (``*B`` the batch
    size) and hold bool or ``0`` / ``1`` numbers. Every entry is indexed, nested ones included.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> td = TensorDict({"loss_mask": torch.tensor([[0, 1, 1], [1, 0, 0]], dtype=torch.int8),
        ...                  "x": torch.arange(6).view(2, 3)}, batch_size=[2, 3])
        >>> select_trainable_steps(td)["x"]
        tensor([1, 2, 3])
    """
    return tensordict[training_step_masks(tensordict, loss_mask_key)[0]]


class MaskedPPOLossMixin:
    """The constructor and forward shared by every masked PPO loss; see :mod:`masked_rl.loss`.

    Mixed in before a TorchRL PPO loss class, with the class's ``_AcceptedKeys`` extended by
    ``loss_mask`` and ``value_target_mask``: :class:`MaskedClipPPOLoss`,
    :class:`MaskedKLPENPPOLoss`, :class:`MaskedPPOLoss`.

    Keyword Args:
        masked_value_targets (bool): the default ``MaskedGAE`` also writes value targets at
            masked steps, and the critic term is a mean over every step carrying one
            (``value_target_mask``) instead of the trainable steps. Defaults to ``False``.
        cp_group, cp_layout, cp_chunk_lengths, dp_group: passed to the default ``MaskedGAE``
            (context parallelism: the input is this rank's slice of every row); with a group,
            ``normalize_advantage`` standardises over the trainable steps of every rank of
            ``cp_group`` and ``dp_group``. Default: none, whole rows on every rank.
        reduction (str): the TorchRL loss's (``"mean"``, the default, ``"sum"``, ``"none"``:
            over this rank's trainable steps), or, for data parallelism,
            ``"token_mean"`` / ``"sequence_mean"``: each ``loss_*`` term is
            :func:`masked_rl.reduction.masked_mean` of its per-step values over the ranks of
            ``dp_group`` (and ``cp_group``; ``"sequence_mean"`` needs whole rows), so that a
            DDP step averaging gradients over those ranks has the gradient of the mean over
            every rank's trainable steps (or sequences), whatever the split. One
            ``all_reduce`` of one number per term and group. Without a group: this rank's
            token (or sequence) mean. A rank's ``loss_*`` value is then its share times the
            number of ranks (see ``masked_mean``).
        Every other argument is the TorchRL loss's.
    """

    def __init__(self, *args, masked_value_targets: bool = False, cp_group=None,
                 cp_layout: str = "contiguous", cp_chunk_lengths=None, dp_group=None, **kwargs):
        if "loss_mask_key" in kwargs:  # TorchRL's PPO losses would swallow it unread
            raise TypeError(_RENAMED_KEY)
        # Read by the default estimator, built on first use.
        self.masked_value_targets = bool(masked_value_targets)
        self.cp_group, self.cp_layout, self.cp_chunk_lengths = cp_group, cp_layout, cp_chunk_lengths
        self.dp_group = dp_group
        super().__init__(*args, **kwargs)

    def _loss_mask_keys(self) -> tuple[NestedKey, ...]:
        # TorchRL's reduction masks: none, every step handed to the stock loss is trainable and
        # valid (the validity entries, TorchRL's own resolution of loss_mask_key, are folded into
        # the selection: _validity_keys).
        return ()

    def _validity_keys(self) -> tuple[NestedKey, ...]:
        return super()._loss_mask_keys()

    def make_value_estimator(self, value_type: ValueEstimators | str | None = None, **hyperparams):
        """As in TorchRL, except that ``None`` and ``ValueEstimators.GAE`` (or ``"gae"``) build a
        :class:`~masked_rl.MaskedGAE` wired to this loss's critic and keys. Any other estimator
        (an instance, e.g. TorchRL's ``GAE`` for a baseline, or another enum) is installed as is."""
        is_estimator = isinstance(value_type, ValueEstimatorBase) or (
            isinstance(value_type, type) and issubclass(value_type, ValueEstimatorBase)
        )
        if value_type is not None and (is_estimator or not _names_gae(value_type)):
            return super().make_value_estimator(value_type, **hyperparams)
        hyperparams = {**default_value_kwargs(ValueEstimators.GAE), **hyperparams}
        hyperparams.setdefault("masked_value_targets", self.masked_value_targets)
        for name in ("cp_group", "cp_layout", "cp_chunk_lengths", "dp_group"):
            hyperparams.setdefault(name, getattr(self, name))
        estimator = MaskedGAE.for_loss(self, **hyperparams)
        super().make_value_estimator(estimator)
        self._forward_value_estimator_keys()  # the loss's key names, as TorchRL does for its own
        return self

    def _forward_value_estimator_keys(self, **kwargs) -> None:
        super()._forward_value_estimator_keys(**kwargs)
        estimator = getattr(self, "_value_estimator", None)
        if isinstance(estimator, MaskedGAE):
            estimator.set_keys(
                loss_mask=self.tensor_keys.loss_mask,
                value_target_mask=self.tensor_keys.value_target_mask,
            )

    def _set_in_keys(self):
        super()._set_in_keys()
        if self.tensor_keys.loss_mask not in self._in_keys:
            self._in_keys.append(self.tensor_keys.loss_mask)

    def _standardize_advantage(self, advantage: torch.Tensor, tensordict: TensorDictBase) -> torch.Tensor:
        """``normalize_advantage``: TorchRL's, or with a :class:`~masked_rl.MaskedGAE` estimator
        holding a ``cp_group`` or ``dp_group``, over the steps of every rank of those groups
        (float64 statistics; TorchRL's reductions accumulate half precision in float32)."""
        estimator = getattr(self, "_value_estimator", None)
        groups = estimator.statistics_groups if isinstance(estimator, MaskedGAE) else []
        if not groups:
            return super()._standardize_advantage(advantage, tensordict)
        if self.normalize_advantage_exclude_dims:
            raise ValueError("normalize_advantage_exclude_dims is not supported with cp_group or dp_group")
        # Every step handed to the stock loss is trainable and valid; TorchRL's std clamp.
        everywhere = torch.ones_like(advantage, dtype=torch.bool)
        return masked_standardize(advantage, everywhere, eps=torch.finfo(torch.float).resolution,
                                  group=groups)

    def _selected_steps(self, tensordict: TensorDictBase) -> tuple[TensorDictBase, TensorDictBase | None]:
        """Steps 1-4 of :mod:`masked_rl.loss`: ``(policy steps, critic steps or None)``."""
        keys = self.tensor_keys
        tensordict = tensordict.clone(False)  # as TorchRL: never write into the caller's data
        trainable = _step_mask(tensordict, keys.loss_mask, what="loss mask (1 where the step is the policy's own)")
        tensordict.set(keys.loss_mask, trainable.unsqueeze(-1))  # validated once: bool from here on
        if tensordict.get(keys.advantage, None) is None:
            if self.critic_network is None:
                raise RuntimeError(
                    "the input has no advantage and the loss has no critic to estimate it: "
                    f"write {keys.advantage!r} first, or give the loss a critic"
                )
            # The same call as TorchRL's PPO forward, so the estimator sees the same parameters.
            self.value_estimator(
                tensordict,
                params=self._cached_critic_network_params_detached,
                target_params=self.target_critic_network_params,
            )
            if self.advantage_norm is not None and self.training:
                # TorchRL updates the return statistics when its forward runs the estimator; the
                # stock forward below sees the advantage present, so the update is made here.
                self.advantage_norm.update(tensordict.get(keys.value_target)[trainable])
        if self.reduction in REDUCTIONS:  # each selected step's flat position, to reduce by row
            tensordict.set(_STEP_INDEX, torch.arange(tensordict.numel(), device=tensordict.device)
                           .view(tensordict.batch_size))
        trainable, has_target = training_step_masks(
            tensordict, keys.loss_mask, keys.value_target_mask if self.masked_value_targets else None,
            self._validity_keys())
        critic_steps = None if has_target is None else tensordict[has_target]
        policy_steps = tensordict[trainable]
        if policy_steps.batch_size.numel() == 0 and (critic_steps is None or critic_steps.batch_size.numel() == 0):
            raise ValueError(
                f"the batch has no trainable step ({keys.loss_mask!r} is 0 everywhere): "
                "there is nothing for the PPO loss to train on"
            )
        return policy_steps, critic_steps

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """The stock loss's outputs, computed over the trainable steps of ``tensordict``.

        Args:
            tensordict (TensorDictBase): a ``[*B, T]`` rollout (the estimator runs if the advantage
                is missing), or any batch of steps that already holds the advantage and the value
                target (e.g. a replay-buffer minibatch, with ``value_target_mask`` under
                ``masked_value_targets``).

        With ``masked_value_targets``, a batch whose steps all carry targets but none trains the
        policy gives ``loss_objective`` and ``loss_entropy`` of ``0`` and the critic's outputs only.
        """
        reduction = self.reduction
        if reduction not in REDUCTIONS:
            return self._loss_on_steps(*self._selected_steps(tensordict))
        if reduction == "sequence_mean" and (self.cp_group is not None or tensordict.batch_dims < 2):
            raise ValueError(
                "reduction='sequence_mean' needs whole [*B, T] rows on each rank (no cp_group), "
                f"got batch_size {list(tensordict.batch_size)} and cp_group={self.cp_group!r}"
            )
        policy_steps, critic_steps = self._selected_steps(tensordict)
        self.reduction = "none"  # per-step terms from the stock loss, reduced below
        try:
            out = self._loss_on_steps(policy_steps, critic_steps)
        finally:
            self.reduction = reduction
        groups = [g for g in (self.cp_group, self.dp_group) if g is not None] or None
        shape = tensordict.batch_size
        for name in ("loss_objective", "loss_entropy", "loss_critic"):
            if name not in out.keys():  # the same on every rank: each term makes its collective
                continue
            steps = critic_steps if name == "loss_critic" and critic_steps is not None else policy_steps
            index = steps.get(_STEP_INDEX).reshape(-1)
            # [: 0] of the 0-d zero a rank without policy steps gets (masked_value_targets).
            per_step = out.get(name).reshape(-1)[: index.numel()]
            rows = per_step.new_zeros(shape.numel()).index_add(0, index, per_step)
            flags = torch.zeros(shape.numel(), dtype=torch.bool, device=index.device)
            flags[index] = True
            out.set(name, masked_mean(rows.view(shape), flags.view(shape), reduction=reduction,
                                      group=groups))
        return out

    def _loss_on_steps(self, policy_steps: TensorDictBase, critic_steps: TensorDictBase | None) -> TensorDictBase:
        if critic_steps is None:
            return super().forward(policy_steps)
        if policy_steps.batch_size.numel() == 0:
            zero = torch.zeros((), device=critic_steps.device)
            out = TensorDict({"loss_objective": zero})
            if self.entropy_bonus:
                out.set("loss_entropy", zero.clone())
        else:
            out = super().forward(policy_steps)
        if self._has_critic:
            loss_critic, value_clip_fraction, explained_variance = self.loss_critic(critic_steps)
            out.set("loss_critic", self._reduce_loss(loss_critic, critic_steps).squeeze(-1))
            for name, stat in (("value_clip_fraction", value_clip_fraction),
                               ("explained_variance", explained_variance)):
                if stat is not None:
                    out.set(name, stat)
        return out


def _names_gae(value_type: ValueEstimators | str) -> bool:
    """``ValueEstimators.GAE``, or its name as a string (``"gae"``, ``"GAE"``), as TorchRL accepts."""
    if isinstance(value_type, ValueEstimators):
        return value_type == ValueEstimators.GAE
    return isinstance(value_type, str) and value_type.lower() == "gae"


def attach_masked_gae(
    loss: MaskedPPOLossMixin,
    *,
    gamma: float,
    lmbda: float,
    masked_value_targets: bool | None = None,
    **gae_kwargs,
) -> MaskedGAE:
    """Install a :class:`~masked_rl.MaskedGAE` with these settings on a masked PPO loss.

    The same as ``loss.make_value_estimator(ValueEstimators.GAE, gamma=..., lmbda=...,
    **gae_kwargs)``: the estimator is built from the loss's critic and keys, and later
    ``loss.set_keys(...)`` calls reach it. (In TorchRL 0.14, ``loss.value_estimator =
    estimator`` does *not* install an estimator: ``nn.Module.__setattr__`` registers it as a
    child module without calling the property setter.) Calling it again replaces the estimator.

    A stock TorchRL loss is refused: build its masked class instead (``MaskedClipPPOLoss``,
    ``MaskedKLPENPPOLoss``, ``MaskedPPOLoss``, same arguments); the loss's forward must select
    the trainable steps, which a stock loss does not.

    Args:
        loss (MaskedPPOLossMixin): a masked PPO loss.

    Keyword Args:
        gamma (float): discount factor, in ``[0, 1]``.
        lmbda (float): GAE trace decay, in ``[0, 1]``.
        masked_value_targets (bool, optional): sets the loss's ``masked_value_targets`` (train
            the critic on every step carrying a value target, masked steps included). Defaults
            to ``None``: the loss's setting.
        **gae_kwargs: other :class:`~masked_rl.MaskedGAE` arguments (``average_gae``,
            ``differentiable``, ``device``, ``value_network`` to override the critic,
            ``cp_group``, ``cp_layout``, ``dp_group``: ``normalize_advantage`` then uses the
            statistics of every rank of those groups...).

    Returns:
        The installed :class:`~masked_rl.MaskedGAE`.

    Raises:
        TypeError: ``loss`` is not a masked PPO loss (the message names the class to use), or
            ``loss_mask_key`` is passed (rename the trainable-step key with ``set_keys``).

    Examples:
        >>> import torch
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.modules import ProbabilisticActor, ValueOperator
        >>> from masked_rl import MaskedClipPPOLoss, attach_masked_gae
        >>> actor = ProbabilisticActor(
        ...     TensorDictModule(torch.nn.Linear(3, 4), ["observation"], ["logits"]),
        ...     in_keys=["logits"], distribution_class=torch.distributions.Categorical,
        ...     return_log_prob=True)
        >>> critic = ValueOperator(torch.nn.Linear(3, 1), in_keys=["observation"])
        >>> loss = MaskedClipPPOLoss(actor, critic)
        >>> gae = attach_masked_gae(loss, gamma=0.99, lmbda=0.95, average_gae=True)
        >>> loss.value_estimator is gae
        True
    """
    if not isinstance(loss, MaskedPPOLossMixin):
        masked = next((cls for stock, cls in _MASKED_CLASSES if isinstance(loss, stock)), None)
        if masked is None:
            raise TypeError(
                "attach_masked_gae expects a masked PPO loss (MaskedClipPPOLoss, "
                f"MaskedKLPENPPOLoss, MaskedPPOLoss), got {type(loss).__name__}")
        raise TypeError(
            f"attach_masked_gae no longer turns a {type(loss).__name__} into a masked loss: build "
            f"masked_rl.{masked.__name__} with the same arguments instead (a stock loss averages "
            "over every step)")
    if "loss_mask_key" in gae_kwargs:
        raise TypeError(_RENAMED_KEY)
    if masked_value_targets is not None:
        loss.masked_value_targets = bool(masked_value_targets)
    loss.make_value_estimator(ValueEstimators.GAE, gamma=gamma, lmbda=lmbda, **gae_kwargs)
    return loss.value_estimator


@dataclass
class _MaskKeys:
    """The keys every masked loss adds to its TorchRL loss's ``_AcceptedKeys``.

    Attributes:
        loss_mask (NestedKey): root key of the per-step flag, ``1`` where the step is the
            policy's own. Defaults to ``"loss_mask"``.
        value_target_mask (NestedKey): root key of the flag of steps carrying a value target,
            read with ``masked_value_targets``. Defaults to ``"value_target_mask"``.
    """

    loss_mask: NestedKey = "loss_mask"
    value_target_mask: NestedKey = "value_target_mask"


class MaskedClipPPOLoss(MaskedPPOLossMixin, ClipPPOLoss):
    """:class:`~torchrl.objectives.ClipPPOLoss` over the trainable steps of a token stream.

    The same arguments, outputs and options as ``ClipPPOLoss``, with these differences:

    - the default value estimator is :class:`~masked_rl.MaskedGAE` (TorchRL's defaults
      ``gamma=0.99, lmbda=0.95``); ``make_value_estimator(ValueEstimators.GAE, gamma=...,
      lmbda=...)`` builds a ``MaskedGAE`` too. Any other estimator (e.g. TorchRL's plain
      ``GAE`` instance, for a baseline) can still be installed with ``make_value_estimator``.
    - ``forward`` runs the estimator on the full ``[*B, T]`` input when the advantage is
      missing, then computes the loss on the steps with ``loss_mask == 1`` only: the losses
      are means over trainable steps, ``normalize_advantage`` standardises with their
      statistics, and ``clip_fraction``, ``kl_approx``, ``ESS``, ``entropy``, ``max_ratio``,
      ``mean_ratio`` and ``explained_variance`` describe them. A masked step gets zero
      gradient from every term. See :mod:`masked_rl.loss`.
    - the tensor key ``loss_mask`` (default ``"loss_mask"``; renamed with
      ``set_keys(loss_mask=...)``, forwarded to the estimator): shape ``[*B]`` or ``[*B, 1]``,
      bool or ``0`` / ``1``; and ``value_target_mask`` (read with ``masked_value_targets``).
      TorchRL's :attr:`~torchrl.objectives.LossModule.loss_mask_key` keeps its meaning (the
      validity entries; ``"auto"`` by default).

    Keyword Args:
        masked_value_targets, cp_group, cp_layout, cp_chunk_lengths, dp_group, reduction: see
            :class:`MaskedPPOLossMixin`. Every other argument is ``ClipPPOLoss``'s.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.modules import ProbabilisticActor, ValueOperator
        >>> from masked_rl import MaskedClipPPOLoss
        >>> actor = ProbabilisticActor(
        ...     TensorDictModule(torch.nn.Linear(3, 4), ["observation"], ["logits"]),
        ...     in_keys=["logits"], distribution_class=torch.distributions.Categorical,
        ...     return_log_prob=True)
        >>> critic = ValueOperator(torch.nn.Linear(3, 1), in_keys=["observation"])
        >>> loss = MaskedClipPPOLoss(actor, critic, normalize_advantage=True)
        >>> B, T = 2, 5
        >>> done = torch.zeros(B, T, 1, dtype=torch.bool); done[:, -1] = True
        >>> td = TensorDict({
        ...     "observation": torch.randn(B, T, 3),
        ...     "loss_mask": torch.tensor([[0, 1, 1, 0, 0], [0, 1, 0, 1, 0]], dtype=torch.int8),
        ...     "action": torch.randint(4, (B, T)),
        ...     "action_log_prob": torch.full((B, T), -1.4),
        ...     "next": {"observation": torch.randn(B, T, 3), "reward": done.float(),
        ...              "done": done, "terminated": done},
        ... }, batch_size=[B, T])
        >>> out = loss(td)                    # MaskedGAE runs on [2, 5], the loss on 4 steps
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_critic', 'loss_entropy', 'loss_objective']
    """

    @dataclass
    class _AcceptedKeys(_MaskKeys, ClipPPOLoss._AcceptedKeys):
        """``ClipPPOLoss`` keys plus ``loss_mask`` and ``value_target_mask`` (:class:`_MaskKeys`)."""

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys


class MaskedKLPENPPOLoss(MaskedPPOLossMixin, KLPENPPOLoss):
    """:class:`~torchrl.objectives.KLPENPPOLoss` over the trainable steps of a token stream.

    As :class:`MaskedClipPPOLoss`, for TorchRL's KL-penalised PPO loss (the KL term is a mean over
    trainable steps too). Keyword args: those of :class:`MaskedPPOLossMixin` and ``KLPENPPOLoss``.

    Examples:
        >>> import torch
        >>> from torchrl.modules import ProbabilisticActor, ValueOperator
        >>> from tensordict.nn import TensorDictModule
        >>> from masked_rl import MaskedKLPENPPOLoss
        >>> actor = ProbabilisticActor(
        ...     TensorDictModule(torch.nn.Linear(3, 4), ["observation"], ["logits"]),
        ...     in_keys=["logits"], distribution_class=torch.distributions.Categorical,
        ...     return_log_prob=True)
        >>> loss = MaskedKLPENPPOLoss(actor, ValueOperator(torch.nn.Linear(3, 1), in_keys=["observation"]))
        >>> loss.set_keys(loss_mask="trainable")  # the trainable-step flag's key
        >>> loss.tensor_keys.loss_mask, loss.value_estimator.tensor_keys.loss_mask
        ('trainable', 'trainable')
    """

    @dataclass
    class _AcceptedKeys(_MaskKeys, KLPENPPOLoss._AcceptedKeys):
        """``KLPENPPOLoss`` keys plus ``loss_mask`` and ``value_target_mask``."""

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys


class MaskedPPOLoss(MaskedPPOLossMixin, PPOLoss):
    """:class:`~torchrl.objectives.PPOLoss` (the unclipped objective) over the trainable steps.

    As :class:`MaskedClipPPOLoss`. Keyword args: those of :class:`MaskedPPOLossMixin` and
    ``PPOLoss``.

    Examples:
        >>> import torch
        >>> from torchrl.modules import ProbabilisticActor, ValueOperator
        >>> from tensordict.nn import TensorDictModule
        >>> from masked_rl import MaskedPPOLoss
        >>> actor = ProbabilisticActor(
        ...     TensorDictModule(torch.nn.Linear(3, 4), ["observation"], ["logits"]),
        ...     in_keys=["logits"], distribution_class=torch.distributions.Categorical,
        ...     return_log_prob=True)
        >>> loss = MaskedPPOLoss(actor, ValueOperator(torch.nn.Linear(3, 1), in_keys=["observation"]))
        >>> loss.set_keys(loss_mask="trainable")  # the trainable-step flag's key
        >>> loss.tensor_keys.loss_mask, loss.value_estimator.tensor_keys.loss_mask
        ('trainable', 'trainable')
    """

    @dataclass
    class _AcceptedKeys(_MaskKeys, PPOLoss._AcceptedKeys):
        """``PPOLoss`` keys plus ``loss_mask`` and ``value_target_mask``."""

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys


# The masked class of each stock loss, most derived first (for attach_masked_gae's error).
_MASKED_CLASSES = ((ClipPPOLoss, MaskedClipPPOLoss), (KLPENPPOLoss, MaskedKLPENPPOLoss),
                   (PPOLoss, MaskedPPOLoss))
