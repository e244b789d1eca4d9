"""PPO losses of TorchRL that train on the policy's own steps only.

A token stream mixes the policy's steps (``loss_mask == 1``) with steps it never chose
(prompt, tool output; ``loss_mask == 0``). Masked GAE gives the masked steps exactly
zero advantage, but that is not enough: a stock TorchRL PPO loss would still average its
policy, entropy and critic terms over *every* step, pull the critic towards ``0`` at masked
steps, standardise advantages with statistics diluted by the masked zeros, and report
``clip_fraction`` or ``kl_approx`` over actions the environment ignored. Here one forward
(:meth:`MaskedPPOLossMixin.forward`) serves both entry points, :class:`MaskedClipPPOLoss` and
:func:`attach_masked_gae`:

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
The loss mask key is the loss's :attr:`loss_mask_key` (``tensor_keys.loss_mask``, one setting
under two names). TorchRL's validity entries, ``("collector", "mask")`` and ``"shifted_valid"``,
still count where present: a step trains only if it is trainable *and* valid.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import dispatch
from tensordict.utils import NestedKey
from torchrl.objectives import ClipPPOLoss, PPOLoss
from torchrl.objectives.utils import ValueEstimators, default_value_kwargs
from torchrl.objectives.value import ValueEstimatorBase

from masked_rl.advantages import MaskedGAE
from masked_rl.functional import check_loss_mask, masked_standardize
from masked_rl.reduction import REDUCTIONS, masked_mean

__all__ = [
    "MaskedClipPPOLoss",
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The bool ``[*B]`` masks of the steps that train: ``(policy steps, critic steps or None)``.

    The one place the masked losses and :func:`select_trainable_steps` decide which steps
    train. A step trains the policy if ``tensordict[loss_mask_key]`` is ``1`` and it is valid
    (TorchRL's ``("collector", "mask")`` and ``"shifted_valid"``, where present); with
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
    for key in _VALIDITY_KEYS:
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
    """The forward shared by every masked PPO loss; see :mod:`masked_rl.loss`.

    Mixed in before a TorchRL PPO loss class (``class MaskedClipPPOLoss(MaskedPPOLossMixin,
    ClipPPOLoss)``); :func:`attach_masked_gae` builds such a class for any PPO loss.
    """

    masked_value_targets: bool = False
    # Defaults of the MaskedGAE this loss builds (MaskedClipPPOLoss takes them as arguments).
    cp_group = None
    cp_layout: str = "contiguous"
    cp_chunk_lengths = None
    dp_group = None

    @property
    def loss_mask_key(self) -> NestedKey:
        """The per-step flag selecting the trainable steps: ``tensor_keys.loss_mask``."""
        return self.tensor_keys.loss_mask

    @loss_mask_key.setter
    def loss_mask_key(self, value: NestedKey) -> None:
        if value is None or value == "auto":
            raise ValueError(
                f"a masked PPO loss needs a loss mask key (TorchRL's validity entries "
                f"{_VALIDITY_KEYS} are always honoured), got {value!r}"
            )
        self.set_keys(loss_mask=value)

    def _loss_mask_keys(self) -> tuple[NestedKey, ...]:
        # TorchRL's reduction masks: none, every step handed to the stock loss is trainable and
        # valid (the validity entries are folded into the selection below).
        return ()

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
        holding a ``cp_group`` or ``dp_group``, over the steps of every rank of those groups."""
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
            tensordict, keys.loss_mask, keys.value_target_mask if self.masked_value_targets else None)
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


def _masked_keys_class(keys_cls: type) -> type:
    """``keys_cls`` (a loss's ``_AcceptedKeys`` dataclass) plus ``loss_mask`` and ``value_target_mask``."""
    return dataclasses.make_dataclass(
        keys_cls.__name__,
        [("loss_mask", NestedKey, dataclasses.field(default="loss_mask")),
         ("value_target_mask", NestedKey, dataclasses.field(default="value_target_mask"))],
        bases=(keys_cls,),
    )


_MASKED_CLASSES: dict[type, type] = {}


def _masked_class(loss_cls: type) -> type:
    """The masked subclass of a TorchRL PPO loss class (built once per class)."""
    if issubclass(loss_cls, MaskedPPOLossMixin):
        return loss_cls
    if loss_cls not in _MASKED_CLASSES:
        keys = _masked_keys_class(loss_cls._AcceptedKeys)
        _MASKED_CLASSES[loss_cls] = type(
            f"Masked{loss_cls.__name__}",
            (MaskedPPOLossMixin, loss_cls),
            {"_AcceptedKeys": keys, "default_keys": keys, "__module__": __name__,
             "__doc__": f"{loss_cls.__name__} over trainable steps (see :mod:`masked_rl.loss`)."},
        )
    return _MASKED_CLASSES[loss_cls]


def attach_masked_gae(
    loss: PPOLoss,
    *,
    gamma: float,
    lmbda: float,
    loss_mask_key: NestedKey = "loss_mask",
    masked_value_targets: bool = False,
    **gae_kwargs,
) -> MaskedGAE:
    """Make a TorchRL PPO loss train on trainable steps only, with :class:`~masked_rl.MaskedGAE`.

    Works in place with :class:`~torchrl.objectives.ClipPPOLoss` (it becomes a
    :class:`MaskedClipPPOLoss`), :class:`~torchrl.objectives.KLPENPPOLoss` and
    :class:`~torchrl.objectives.PPOLoss` (they become their masked subclass, built on
    :class:`MaskedPPOLossMixin`): the one forward of :mod:`masked_rl.loss` then runs, and a
    ``MaskedGAE`` built from the loss's critic and keys is installed with
    :meth:`~torchrl.objectives.LossModule.make_value_estimator`. (In TorchRL 0.14,
    ``loss.value_estimator = estimator`` does *not* install an estimator: ``nn.Module.__setattr__``
    registers it as a child module without calling the property setter.) Later
    ``loss.set_keys(...)`` calls reach the estimator as usual. Calling it again replaces the
    estimator and the keys.

    Args:
        loss (PPOLoss): the loss to modify.

    Keyword Args:
        gamma (float): discount factor, in ``[0, 1]``.
        lmbda (float): GAE trace decay, in ``[0, 1]``.
        loss_mask_key (NestedKey): root key of the per-step flag (``1``: the policy's own step),
            shape ``[*B]`` or ``[*B, 1]``, bool or 0/1. Defaults to ``"loss_mask"``.
        masked_value_targets (bool): train the critic on every step carrying a value target
            (masked steps included), see :mod:`masked_rl.loss`. Defaults to ``False``.
        **gae_kwargs: other :class:`~masked_rl.MaskedGAE` arguments (``average_gae``,
            ``differentiable``, ``device``, ``value_network`` to override the critic,
            ``cp_group``, ``cp_layout``, ``dp_group``: ``normalize_advantage`` then uses the
            statistics of every rank of those groups...).

    Returns:
        The installed :class:`~masked_rl.MaskedGAE`.

    Examples:
        >>> import torch
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.modules import ProbabilisticActor, ValueOperator
        >>> from torchrl.objectives import ClipPPOLoss
        >>> from masked_rl import MaskedClipPPOLoss, attach_masked_gae
        >>> actor = ProbabilisticActor(
        ...     TensorDictModule(torch.nn.Linear(3, 4), ["observation"], ["logits"]),
        ...     in_keys=["logits"], distribution_class=torch.distributions.Categorical,
        ...     return_log_prob=True)
        >>> critic = ValueOperator(torch.nn.Linear(3, 1), in_keys=["observation"])
        >>> loss = ClipPPOLoss(actor, critic)
        >>> gae = attach_masked_gae(loss, gamma=0.99, lmbda=0.95)
        >>> loss.value_estimator is gae, isinstance(loss, MaskedClipPPOLoss)
        (True, True)
    """
    if not isinstance(loss, PPOLoss):
        raise TypeError(
            f"attach_masked_gae expects a TorchRL PPO loss (ClipPPOLoss, KLPENPPOLoss, PPOLoss), "
            f"got {type(loss).__name__}"
        )
    if not isinstance(loss, MaskedPPOLossMixin):
        old_keys = dataclasses.asdict(loss.tensor_keys)
        loss.__class__ = _masked_class(type(loss))
        loss._tensor_keys = loss._AcceptedKeys(**old_keys)
    loss.masked_value_targets = bool(masked_value_targets)
    loss.set_keys(loss_mask=loss_mask_key)
    loss.make_value_estimator(ValueEstimators.GAE, gamma=gamma, lmbda=lmbda, **gae_kwargs)
    return loss.value_estimator


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
    - the tensor key ``loss_mask`` (default ``"loss_mask"``; also :attr:`loss_mask_key`; renamed
      with ``set_keys``, forwarded to the estimator): shape ``[*B]`` or ``[*B, 1]``, bool or
      ``0`` / ``1``; and ``value_target_mask`` (read with ``masked_value_targets``).

    Keyword Args:
        loss_mask_key (NestedKey): the loss mask key, as ``set_keys(loss_mask=...)``
            (``None`` and TorchRL's ``"auto"`` are refused: the validity entries always count).
            Defaults to ``"loss_mask"``.
        masked_value_targets (bool): the default ``MaskedGAE`` also writes value targets at
            masked steps, and the critic term is a mean over every step carrying one
            (``value_target_mask``) instead of the trainable steps. Defaults to ``False``.
        cp_group, cp_layout, cp_chunk_lengths, dp_group: passed to the default ``MaskedGAE``
            (context parallelism: the input is this rank's slice of every row); with a group,
            ``normalize_advantage`` standardises over the trainable steps of every rank of
            ``cp_group`` and ``dp_group``. Default: none, whole rows on every rank.
        reduction (str): ``ClipPPOLoss``'s (``"mean"``, the default, ``"sum"``, ``"none"``:
            over this rank's trainable steps), or, for data parallelism,
            ``"token_mean"`` / ``"sequence_mean"``: each ``loss_*`` term is
            :func:`masked_rl.reduction.masked_mean` of its per-step values over the ranks of
            ``dp_group`` (and ``cp_group``; ``"sequence_mean"`` needs whole rows), so that a
            DDP step averaging gradients over those ranks has the gradient of the mean over
            every rank's trainable steps (or sequences), whatever the split. One
            ``all_reduce`` of one number per term and group. Without a group: this rank's
            token (or sequence) mean. A rank's ``loss_*`` value is then its share times the
            number of ranks (see ``masked_mean``).
        Every other argument is ``ClipPPOLoss``'s.

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
    class _AcceptedKeys(ClipPPOLoss._AcceptedKeys):
        """``ClipPPOLoss`` keys plus ``loss_mask`` and ``value_target_mask``.

        Attributes:
            loss_mask (NestedKey): root key of the per-step flag, ``1`` where the step is the
                policy's own. Defaults to ``"loss_mask"``.
            value_target_mask (NestedKey): root key of the flag of steps carrying a value target,
                read with ``masked_value_targets``. Defaults to ``"value_target_mask"``.
        """

        loss_mask: NestedKey = "loss_mask"
        value_target_mask: NestedKey = "value_target_mask"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys

    def __init__(self, *args, loss_mask_key: NestedKey = "loss_mask", masked_value_targets: bool = False,
                 cp_group=None, cp_layout: str = "contiguous", cp_chunk_lengths=None, dp_group=None,
                 **kwargs):
        # Read by the default estimator, built on first use.
        self.masked_value_targets = bool(masked_value_targets)
        self.cp_group, self.cp_layout, self.cp_chunk_lengths = cp_group, cp_layout, cp_chunk_lengths
        self.dp_group = dp_group
        super().__init__(*args, **kwargs)
        self.loss_mask_key = loss_mask_key  # TorchRL's PPO losses would swallow it unread


_MASKED_CLASSES[ClipPPOLoss] = MaskedClipPPOLoss
