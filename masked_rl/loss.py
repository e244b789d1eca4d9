"""PPO losses of TorchRL that train on the policy's own steps only.

A token stream mixes the policy's steps (``loss_mask == 1``) with steps it never chose
(prompt, tool output; ``loss_mask == 0``). Masked GAE gives the masked steps exactly
zero advantage and value target, but that is not enough: a stock TorchRL PPO loss would
still average its policy, entropy and critic terms over *every* step, pull the critic
towards ``0`` at masked steps, standardise advantages with statistics diluted by the
masked zeros, and report ``clip_fraction`` or ``kl_approx`` over actions the environment
ignored. Here the loss sees only the trainable steps:

1. if the input has no advantage yet, the value estimator runs on the full ``[*B, T]``
   batch (it needs the time structure, and the masked steps' rewards);
2. the trainable steps are selected, ``tensordict[loss_mask]``, a flat ``[N]`` batch;
3. the unchanged TorchRL loss runs on those ``N`` steps.

So every loss term is a mean over trainable steps, ``normalize_advantage`` and every
logged statistic use trainable steps only, a masked step gets exactly zero gradient from
every term (whatever it stores: NaN log-probs, out-of-range actions), and the networks
are evaluated on ``N`` steps instead of ``B * T``: in tool-use transcripts most steps are
masked. With ``reduction="none"`` the per-step outputs have shape ``[N]``.

TorchRL's own validity masks (``LossModule.loss_mask_key``, ``"auto"`` by default:
``("collector", "mask")`` and ``"shifted_valid"``) keep working on top, on the selected
steps. They are not a substitute: ``_reduce_loss`` needs a bool mask (environments
deliver ``int8``), and neither advantage standardisation nor the logged statistics read
them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDictBase, is_tensor_collection
from tensordict.nn import dispatch
from tensordict.utils import NestedKey
from torchrl.objectives import ClipPPOLoss, PPOLoss
from torchrl.objectives.utils import ValueEstimators, _coerce_value_type, default_value_kwargs
from torchrl.objectives.value import ValueEstimatorBase

from masked_rl.advantages import MaskedGAE
from masked_rl.functional import check_loss_mask

__all__ = ["MaskedClipPPOLoss", "attach_masked_gae", "select_trainable_steps"]


def select_trainable_steps(
    tensordict: TensorDictBase, loss_mask_key: NestedKey = "loss_mask"
) -> TensorDictBase:
    """The steps of ``tensordict`` with ``loss_mask == 1``, as a flat ``[N]`` tensordict.

    ``tensordict[loss_mask_key]`` must have shape ``[*B]`` or ``[*B, 1]`` (``*B`` the batch
    size) and hold bool or ``0`` / ``1`` numbers. Every entry is indexed, nested ones included.
    """
    loss_mask = tensordict.get(loss_mask_key, None)
    if loss_mask is None:
        raise KeyError(
            f"expected the loss mask {loss_mask_key!r} in the input tensordict (1 where the step "
            f"is the policy's own), found keys {sorted(map(str, tensordict.keys(True, True)))}"
        )
    # A shape-only reference: check_loss_mask accepts [*B] and [*B, 1] against [*B, 1].
    reference = torch.empty((*tensordict.batch_size, 1), device="meta")
    mask = check_loss_mask(loss_mask, reference, key=loss_mask_key).squeeze(-1)
    return tensordict[mask]


def _trainable_steps_for_loss(
    loss: PPOLoss, tensordict: TensorDictBase, loss_mask_key: NestedKey
) -> TensorDictBase:
    """Steps 1 and 2 of the module docstring: estimate the advantage if missing, then select."""
    estimated = tensordict.get(loss.tensor_keys.advantage, None) is None
    if estimated:
        if loss.critic_network is None:
            raise RuntimeError(
                "the input has no advantage and the loss has no critic to estimate it: "
                f"write {loss.tensor_keys.advantage!r} first, or give the loss a critic"
            )
        tensordict = tensordict.clone(False)  # as TorchRL: never write into the caller's data
        # The same call as TorchRL's PPO forward, so the estimator sees the same parameters.
        loss.value_estimator(
            tensordict,
            params=loss._cached_critic_network_params_detached,
            target_params=loss.target_critic_network_params,
        )
    trainable = select_trainable_steps(tensordict, loss_mask_key)
    if trainable.batch_size.numel() == 0:
        raise ValueError(
            f"the batch has no trainable step ({loss_mask_key!r} is 0 everywhere): "
            "there is nothing for the PPO loss to train on"
        )
    if estimated and loss.advantage_norm is not None and loss.training:
        # TorchRL updates the return statistics only when its forward runs the estimator; the
        # forward that follows sees the advantage present, so the update is made here.
        loss.advantage_norm.update(trainable.get(loss.tensor_keys.value_target))
    return trainable


class _TrainableStepsHook:
    """Forward pre-hook that hands a PPO loss the trainable steps of its input only."""

    def __init__(self, loss_mask_key: NestedKey):
        self.loss_mask_key = loss_mask_key

    def __call__(self, loss: PPOLoss, args: tuple, kwargs: dict):
        if len(args) != 1 or kwargs or not is_tensor_collection(args[0]):
            raise TypeError(
                f"a {type(loss).__name__} with masked GAE attached must be called with one "
                f"tensordict, got {len(args)} positional and keyword arguments {sorted(kwargs)}"
            )
        return (_trainable_steps_for_loss(loss, args[0], self.loss_mask_key),), {}


def attach_masked_gae(
    loss: PPOLoss,
    *,
    gamma: float,
    lmbda: float,
    loss_mask_key: NestedKey = "loss_mask",
    **gae_kwargs,
) -> MaskedGAE:
    """Install :class:`~masked_rl.MaskedGAE` in a TorchRL PPO loss and train on trainable steps only.

    Works with :class:`~torchrl.objectives.ClipPPOLoss`, :class:`~torchrl.objectives.KLPENPPOLoss`
    and :class:`~torchrl.objectives.PPOLoss`, in place:

    - the estimator is built from the loss's critic (``value_network``) and tensor keys, and
      installed with :meth:`~torchrl.objectives.LossModule.make_value_estimator`. (In TorchRL
      0.14.1, ``loss.value_estimator = estimator`` does *not* install it: ``nn.Module.__setattr__``
      registers the module as a child named ``value_estimator`` without calling the property
      setter, and the loss goes on building its default ``GAE``.) Later ``loss.set_keys(...)``
      calls are forwarded to it as usual.
    - a forward pre-hook makes the loss run on the trainable steps of its input only: it runs
      the estimator on the full ``[*B, T]`` batch when the advantage is missing (and skips it
      when the advantage is present), then selects the steps with ``loss_mask == 1``. Every
      term (policy, entropy, critic), ``normalize_advantage`` and every logged statistic is
      computed over trainable steps; a masked step gets zero gradient from every term. See
      :mod:`masked_rl.loss`.

    Calling it again replaces the estimator and the mask key. The loss must then be called with
    one tensordict holding ``loss_mask_key`` (shape ``[*B]`` or ``[*B, 1]``, bool or 0/1).

    Args:
        loss (PPOLoss): the loss to modify.

    Keyword Args:
        gamma (float): discount factor.
        lmbda (float): GAE trace decay.
        loss_mask_key (NestedKey): root key of the per-step flag (``1``: the policy's own step).
            Defaults to ``"loss_mask"``.
        **gae_kwargs: other :class:`~masked_rl.MaskedGAE` arguments (``average_gae``,
            ``differentiable``, ``device``, ``value_network`` to override the critic...).

    Returns:
        The installed :class:`~masked_rl.MaskedGAE`.

    Examples:
        >>> import torch
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.modules import ProbabilisticActor, ValueOperator
        >>> from torchrl.objectives import ClipPPOLoss
        >>> from masked_rl import attach_masked_gae
        >>> actor = ProbabilisticActor(
        ...     TensorDictModule(torch.nn.Linear(3, 4), ["observation"], ["logits"]),
        ...     in_keys=["logits"], distribution_class=torch.distributions.Categorical,
        ...     return_log_prob=True)
        >>> critic = ValueOperator(torch.nn.Linear(3, 1), in_keys=["observation"])
        >>> loss = ClipPPOLoss(actor, critic)
        >>> gae = attach_masked_gae(loss, gamma=0.99, lmbda=0.95)
        >>> loss.value_estimator is gae
        True
    """
    if not isinstance(loss, PPOLoss):
        raise TypeError(
            f"attach_masked_gae expects a TorchRL PPO loss (ClipPPOLoss, KLPENPPOLoss, PPOLoss), "
            f"got {type(loss).__name__}"
        )
    keys = loss.tensor_keys
    estimator = MaskedGAE.for_loss(loss, gamma=gamma, lmbda=lmbda, **gae_kwargs)
    estimator.set_keys(
        advantage=keys.advantage,
        value_target=keys.value_target,
        value=keys.value,
        reward=keys.reward,
        done=keys.done,
        terminated=keys.terminated,
        loss_mask=loss_mask_key,
    )
    loss.make_value_estimator(estimator)
    if isinstance(loss, MaskedClipPPOLoss):
        # Already restricted to trainable steps by its forward; keep its key in sync.
        loss.tensor_keys.loss_mask = loss_mask_key
        return estimator
    handle = getattr(loss, "_masked_rl_hook", None)
    if handle is not None:
        handle.remove()
    loss._masked_rl_hook = loss.register_forward_pre_hook(
        _TrainableStepsHook(loss_mask_key), with_kwargs=True
    )
    return estimator


class MaskedClipPPOLoss(ClipPPOLoss):
    """:class:`~torchrl.objectives.ClipPPOLoss` over the trainable steps of a token stream.

    The same arguments, outputs and options as ``ClipPPOLoss``, with three differences:

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
    - the tensor key ``loss_mask`` (default ``"loss_mask"``, renamed with ``set_keys``, forwarded
      to the estimator): shape ``[*B]`` or ``[*B, 1]``, bool or ``0`` / ``1``.

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
        """``ClipPPOLoss`` keys plus ``loss_mask``.

        Attributes:
            loss_mask (NestedKey): root key of the per-step flag, ``1`` where the step is the
                policy's own. Defaults to ``"loss_mask"``.
        """

        loss_mask: NestedKey = "loss_mask"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys

    def make_value_estimator(self, value_type: ValueEstimators | str | None = None, **hyperparams):
        """As in TorchRL, except that ``None`` and ``ValueEstimators.GAE`` (or ``"gae"``) build a
        ``MaskedGAE``."""
        is_estimator = isinstance(value_type, ValueEstimatorBase) or (
            isinstance(value_type, type) and issubclass(value_type, ValueEstimatorBase)
        )
        if value_type is None or (
            not is_estimator and _coerce_value_type(value_type) == ValueEstimators.GAE
        ):
            hyperparams = {**default_value_kwargs(ValueEstimators.GAE), **hyperparams}
            attach_masked_gae(self, loss_mask_key=self.tensor_keys.loss_mask, **hyperparams)
            return self
        return super().make_value_estimator(value_type, **hyperparams)

    def _forward_value_estimator_keys(self, **kwargs) -> None:
        super()._forward_value_estimator_keys(**kwargs)
        estimator = self._value_estimator
        if isinstance(estimator, MaskedGAE):
            estimator.set_keys(loss_mask=self.tensor_keys.loss_mask)

    def _set_in_keys(self):
        super()._set_in_keys()
        if self.tensor_keys.loss_mask not in self._in_keys:
            self._in_keys.append(self.tensor_keys.loss_mask)

    @dispatch
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """The ``ClipPPOLoss`` outputs, computed over the trainable steps of ``tensordict``.

        Args:
            tensordict (TensorDictBase): a ``[*B, T]`` rollout (the estimator runs if the advantage
                is missing), or any batch of steps that already holds the advantage and the value
                target (e.g. a replay-buffer minibatch).
        """
        trainable = _trainable_steps_for_loss(self, tensordict, self.tensor_keys.loss_mask)
        return super().forward(trainable)
