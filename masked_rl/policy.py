"""``SkipMaskedSteps``: a TorchRL policy that runs its network only on the policy's own steps.

In a token stream most steps are written by the environment (``loss_mask == 0``: prompt, tool
output, closing text); their action is ignored and never trained on. A TorchRL collector still
calls the policy on every environment of every step. Wrapped in :class:`SkipMaskedSteps`, the
policy's network sees only the rows whose ``loss_mask`` is 1, and the other rows get fixed
placeholders, so the collected batch keeps every key the policy writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import InteractionType, TensorDictModuleBase, set_interaction_type
from tensordict.utils import NestedKey
from torch import Tensor

from masked_rl.functional import check_loss_mask

__all__ = ["SkipMaskedSteps"]


class _Placeholder(NamedTuple):
    """What a masked row holds under one output key: one row's value and its trailing shape."""

    value: Tensor
    shape: torch.Size


class SkipMaskedSteps(TensorDictModuleBase):
    """Run a TorchRL policy only on the rows whose ``loss_mask`` is 1; fill the others with placeholders.

    Give this wrapper to a collector (``Collector(env, SkipMaskedSteps(actor), ...)``) and the
    wrapped ``actor`` to the loss. On each call with an input of batch size ``[*B]`` (``[]``,
    ``[N]``, ``[W, N]``, ...), ``tensordict[loss_mask_key]`` (shape ``[*B]`` or ``[*B, 1]``, bool
    or ``0`` / ``1`` numbers) selects the rows:

    - rows with ``loss_mask == 1`` are gathered into a flat ``[n]`` tensordict of the policy's
      ``in_keys`` and the policy runs on those ``n`` rows only. Each of the policy's ``out_keys``
      is scattered back: on these rows the wrapper writes what the policy computed for them.
    - rows with ``loss_mask == 0`` get, under every output key, a placeholder of the shape and
      dtype the policy writes: zeros (a ``Categorical`` action ``0``, a log-prob ``0``, logits,
      features and values ``0``), or the value given in ``placeholders``. If the policy has a
      spec for a key (``policy.spec[key]``, e.g. its action spec) and zeros are not in it (a
      ``OneHot`` action), the placeholder must be given.
    - every row trainable: the policy runs on the input as it is (no gather, no scatter), so the
      result is exactly the unwrapped policy's. No row trainable: the network is not called
      (except once, on one row, if no call has shown the output shapes yet).

    What is identical to the unwrapped policy, on trainable rows: its network outputs (up to the
    floating-point differences a matrix multiply may show for a different number of rows), the
    deterministic actions (``ExplorationType.DETERMINISTIC`` / ``MODE`` / ``MEAN``, read by the
    wrapped policy as usual), and in ``RANDOM`` mode the distribution the action is sampled from
    and the log-prob of the sampled action. The random draws themselves differ from those of an
    unwrapped call under the same RNG state whenever some rows are masked: fewer rows consume
    random numbers. Placeholders never consume random numbers.

    The policy must be feed-forward (a recurrent state would have to advance on masked steps
    too) and write all its outputs under ``out_keys``. The placeholders of masked steps must
    never be trained on: reduce the loss over trainable steps, as
    :class:`masked_rl.MaskedClipPPOLoss` and :func:`masked_rl.attach_masked_gae` do. (A
    placeholder ``"state_value"``, written when the policy is a whole ``ActorValueOperator``, is
    not read by TorchRL's value estimators either: they call their critic, unless told to skip
    existing keys.)

    Args:
        policy (TensorDictModuleBase): the policy, e.g. a ``ProbabilisticActor`` or the policy
            operator of an ``ActorValueOperator``; it keeps its parameters (the wrapper shares
            them, so ``collector.update_policy_weights_()`` works as usual).

    Keyword Args:
        loss_mask_key (NestedKey): the per-row flag, ``1`` where the step is the policy's own.
            Defaults to ``"loss_mask"``.
        placeholders (Mapping[NestedKey, Tensor | float], optional): the value of masked rows
            for some output keys, as one row's value (e.g. ``{"action": one_hot_of_token_0}``);
            the others get zeros.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.modules import ProbabilisticActor
        >>> from masked_rl.policy import SkipMaskedSteps
        >>> actor = ProbabilisticActor(
        ...     TensorDictModule(torch.nn.Linear(3, 4), ["observation"], ["logits"]),
        ...     in_keys=["logits"], distribution_class=torch.distributions.Categorical,
        ...     return_log_prob=True)
        >>> policy = SkipMaskedSteps(actor)
        >>> td = TensorDict(observation=torch.randn(5, 3),
        ...                 loss_mask=torch.tensor([[0], [1], [0], [0], [1]], dtype=torch.int8),
        ...                 batch_size=[5])
        >>> td = policy(td)                      # the network runs on rows 1 and 4 only
        >>> td["action"].shape, td["action_log_prob"][[0, 2, 3]].tolist()
        (torch.Size([5]), [0.0, 0.0, 0.0])
    """

    def __init__(
        self,
        policy: TensorDictModuleBase,
        *,
        loss_mask_key: NestedKey = "loss_mask",
        placeholders: Mapping[NestedKey, Tensor | float] | None = None,
    ):
        if not isinstance(policy, TensorDictModuleBase):
            raise TypeError(
                "policy must be a TensorDictModuleBase (TensorDictModule, ProbabilisticActor, "
                f"TensorDictSequential...) with in_keys and out_keys, got {type(policy).__name__}"
            )
        super().__init__()
        self.policy = policy
        self.loss_mask_key = loss_mask_key
        self.in_keys = list(dict.fromkeys([*policy.in_keys, loss_mask_key]))
        self.out_keys = list(policy.out_keys)
        placeholders = dict(placeholders or {})
        unknown = [key for key in placeholders if key not in self.out_keys]
        if unknown:
            raise KeyError(
                f"placeholders must name output keys of the policy {self.out_keys}, got {unknown}"
            )
        self._given = {key: torch.as_tensor(value) for key, value in placeholders.items()}
        self._placeholders: dict[NestedKey, _Placeholder] | None = None

    @property
    def spec(self):
        """The wrapped policy's output spec (read by collectors), or ``None``."""
        return getattr(self.policy, "spec", None)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Writes the policy's ``out_keys`` into ``tensordict`` (batch size ``[*B]``) and returns it."""
        mask = tensordict.get(self.loss_mask_key, None)
        if mask is None:
            raise KeyError(
                f"SkipMaskedSteps needs the loss mask {self.loss_mask_key!r} in its input "
                f"(1 where the step is the policy's own), found keys "
                f"{sorted(map(str, tensordict.keys(True, True)))}"
            )
        # A shape-only reference: check_loss_mask accepts [*B] and [*B, 1] against [*B, 1].
        reference = torch.empty((*tensordict.batch_size, 1), device="meta")
        rows = check_loss_mask(mask, reference, key=self.loss_mask_key).reshape(-1)
        # Host synchronisations: this nonzero, and the 0/1 check of a non-bool mask.
        index = rows.nonzero().squeeze(-1)
        if index.numel() == rows.numel():
            out = self.policy(tensordict)
            if self._placeholders is None:
                self._learn_placeholders(out, tensordict.batch_dims)
            return out

        if self._placeholders is None:
            # The shapes and dtypes of the outputs are only known from a call: make one, once,
            # on the first row (trainable or not), deterministic so that it draws no random number.
            probe = index[:1] if index.numel() else index.new_zeros(1)
            with set_interaction_type(InteractionType.DETERMINISTIC):
                self._learn_placeholders(self.policy(self._gather(tensordict, probe)), 1)
        computed = self.policy(self._gather(tensordict, index)) if index.numel() else None
        for key, placeholder in self._placeholders.items():
            full = placeholder.value.expand(rows.numel(), *placeholder.shape).clone()
            if computed is not None:
                full.index_copy_(0, index, computed.get(key))
            tensordict.set(key, full.reshape((*tensordict.batch_size, *placeholder.shape)))
        return tensordict

    def _gather(self, tensordict: TensorDictBase, index: Tensor) -> TensorDictBase:
        """The policy's inputs at the flat row ``index``, as a ``[len(index)]`` tensordict.

        Entry by entry: indexing a reshaped TensorDict costs about 20 times more (tensordict 0.14).
        """
        rows = tensordict.batch_size.numel()
        out = TensorDict(batch_size=index.shape, device=tensordict.device)
        for key in self.policy.in_keys:
            value = tensordict.get(key)
            out.set(key, value.reshape(rows, *value.shape[tensordict.batch_dims :])[index])
        return out

    def _learn_placeholders(self, out: TensorDictBase, batch_dims: int) -> None:
        placeholders = {}
        spec = self.spec
        for key in self.out_keys:
            value = out.get(key, None)
            if value is None:
                raise KeyError(
                    f"the policy did not write its out_key {key!r}; it wrote "
                    f"{sorted(map(str, out.keys(True, True)))}"
                )
            shape = value.shape[batch_dims:]
            if key in self._given:
                row = self._given[key].to(device=value.device, dtype=value.dtype)
                if row.shape != shape:
                    raise ValueError(
                        f"placeholders[{key!r}] must have one row's shape {list(shape)} "
                        f"(the policy writes {list(value.shape)}), got {list(row.shape)}"
                    )
            else:
                row = torch.zeros(shape, dtype=value.dtype, device=value.device)
                key_spec = spec.get(key, None) if spec is not None and key in spec.keys(True) else None
                if key_spec is not None and not bool(key_spec.is_in(key_spec.zero())):
                    raise ValueError(
                        f"zeros are not a valid {key!r} for the policy's spec "
                        f"{type(key_spec).__name__}: pass placeholders={{{key!r}: ...}} with a "
                        "valid value for one row"
                    )
            placeholders[key] = _Placeholder(row, shape)
        self._placeholders = placeholders
