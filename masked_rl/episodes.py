"""``CompleteEpisodes``: hand the estimator whole episodes, however the collector cuts its rows.

A TorchRL collector returns ``[B, T]`` batches: row ``b`` holds the next ``T`` steps of
environment ``b``, cut wherever the batch ends. An episode running across the cut is split, and
its first part bootstraps from the critic's value of the observation after the cut. In token
streams that observation is almost always inside a tool output or closing block (masked steps,
which a critic trained on trainable steps never sees; see ``docs/semantics.md``, "Cuts inside
masked blocks"), and the reward behind the cut never reaches the actions before it.
:class:`CompleteEpisodes` removes the cuts: each row's unfinished episode is held back and
prepended to the same row of the next batch, so every episode is estimated once, whole.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey

from masked_rl.functional import check_loss_mask

__all__ = ["CompleteEpisodes"]

VALID_KEY = ("collector", "mask")


class CompleteEpisodes:
    """Turn a collector's ``[B, T]`` batches into batches of complete episodes.

    Call it on every batch, in order (``for batch in collector: batch = complete(batch)``). For
    each row (one environment; ``[*B, T]`` batches such as a multi-process collector's
    ``[workers, envs, T]`` have one per leading index), the steps after the row's last episode
    end are held back and prepended to that row in the next call; the output has shape
    ``[*B, P + T]``, ``P`` the longest held-back part, rows left-padded. In the output:

    - the steps of episodes that ended in this batch (held-back steps of earlier batches
      included) are valid: ``("collector", "mask")`` is true there, and they are exactly the
      steps of every episode that ended, each episode whole;
    - the held-back steps (the unfinished episode at each row's end) and the padding are not:
      ``("collector", "mask")`` is false and ``loss_mask`` is ``0`` there, so a masked estimator
      gives them nothing and :func:`~masked_rl.select_trainable_steps` skips them; padding steps
      also get ``done = terminated = True`` and reward ``0``, each a one-step episode of its own.

    Estimate advantages on the output (``MaskedGAE`` on ``[B, P + T]``): no episode is cut, so no
    bootstrap is read inside a masked block (truncations still bootstrap, as configured). The
    masked losses (:class:`~masked_rl.MaskedClipPPOLoss`) honour ``("collector", "mask")``. The
    held-back steps were collected by the previous policy: PPO's importance ratio uses the stored
    log-probabilities, so they are one update stale, like any off-by-one-iteration data.

    Args (keyword only):
        loss_mask_key (NestedKey): the per-step flag, ``1`` where the step is the policy's own.
            Defaults to ``"loss_mask"``.
        done_key, terminated_key, reward_key (NestedKey): TorchRL's ``("next", "done")``,
            ``("next", "terminated")`` and ``("next", "reward")``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> def batch(done_at):
        ...     done = torch.zeros(1, 4, 1, dtype=torch.bool); done[0, done_at] = True
        ...     return TensorDict({"loss_mask": torch.ones(1, 4, 1, dtype=torch.int8),
        ...                        "next": {"done": done, "terminated": done,
        ...                                 "reward": torch.zeros(1, 4, 1)}}, batch_size=[1, 4])
        >>> complete = CompleteEpisodes()
        >>> first = complete(batch([1]))          # steps 2, 3 continue in the next batch
        >>> first["collector", "mask"].tolist()
        [[True, True, False, False]]
        >>> second = complete(batch([0]))         # ... and end at its step 0
        >>> second.batch_size, second["collector", "mask"].tolist()
        (torch.Size([1, 6]), [[True, True, True, False, False, False]])
    """

    def __init__(
        self,
        *,
        loss_mask_key: NestedKey = "loss_mask",
        done_key: NestedKey = ("next", "done"),
        terminated_key: NestedKey = ("next", "terminated"),
        reward_key: NestedKey = ("next", "reward"),
    ):
        self.loss_mask_key = loss_mask_key
        self.done_key = done_key
        self.terminated_key = terminated_key
        self.reward_key = reward_key
        self._held: TensorDictBase | None = None  # [B, P]: each row's unfinished episode, right-aligned
        self._held_valid: torch.Tensor | None = None  # [B, P]: false on the left padding

    @property
    def held_steps(self) -> int:
        """Steps held back for the next call, over all rows."""
        return 0 if self._held_valid is None else int(self._held_valid.sum())

    def reset(self) -> None:
        """Forget the held-back steps (e.g. after the environments were reset)."""
        self._held = self._held_valid = None

    def state_dict(self) -> dict:
        """The held-back steps as nested dicts of tensors, for a checkpoint that
        ``torch.load(..., weights_only=True)`` can read (``load_state_dict`` restores them)."""
        if self._held is None:
            return {"held": None, "held_valid": None}
        return {"held": self._held.to_dict(), "held_valid": self._held_valid}

    def load_state_dict(self, state: dict) -> None:
        held, held_valid = state["held"], state["held_valid"]
        if held is None:
            self.reset()
            return
        self._held = TensorDict(held, batch_size=held_valid.shape, device=held_valid.device)
        self._held_valid = held_valid

    def __call__(self, batch: TensorDictBase) -> TensorDictBase:
        """The batch with the previous call's held-back steps prepended, and its own held back."""
        if batch.batch_dims < 2:
            raise ValueError(
                f"CompleteEpisodes expects a collector batch of shape [*B, T] (one row per "
                f"environment, e.g. [workers, envs, T]), got batch_size {list(batch.batch_size)}"
            )
        if batch.batch_dims > 2:  # e.g. [workers, envs, T]: one row per environment
            rows_shape = batch.batch_size[:-1]
            out = self(batch.reshape(-1, batch.batch_size[-1]))
            return out.reshape(*rows_shape, out.batch_size[-1])
        rows, _ = batch.batch_size
        valid = torch.ones(batch.batch_size, dtype=torch.bool, device=batch.device)
        if self._held is None:
            full = batch
        else:
            if self._held.batch_size[0] != rows:
                raise ValueError(
                    f"the batch has {rows} rows but the held-back steps came from "
                    f"{self._held.batch_size[0]}: the rows must be the same environments in every "
                    f"call (call reset() after changing them)"
                )
            full = torch.cat([self._held, batch.exclude(VALID_KEY)], dim=1)
            valid = torch.cat([self._held_valid, valid], dim=1)
        length = full.batch_size[1]
        steps = torch.arange(length, device=valid.device)
        done = _flag(full, self.done_key) & valid
        # -1 where a row has no episode end (also for T = 0, where amax has nothing to reduce)
        ends = torch.where(done, steps, -1)
        no_end = torch.full((rows, 1), -1, dtype=ends.dtype, device=ends.device)
        last_end = torch.cat([no_end, ends], dim=1).amax(-1, keepdim=True)
        held = (steps > last_end) & valid  # the unfinished episode at the end of each row
        keep = int(held.sum(-1).amax()) if rows else 0
        if keep:
            # Cloned: a collector may reuse the memory of its batches.
            self._held = full[:, length - keep :].exclude(VALID_KEY).clone()
            self._held_valid = held[:, length - keep :].clone()
        else:
            self._held = self._held_valid = None

        train = valid & ~held
        out = full.clone(False)
        loss_mask = full.get(self.loss_mask_key)
        reference = torch.empty((*full.batch_size, 1), device="meta")
        trainable = check_loss_mask(loss_mask, reference, key=self.loss_mask_key).squeeze(-1) & train
        out.set(self.loss_mask_key, trainable.reshape(loss_mask.shape).to(loss_mask.dtype))
        padding = ~valid
        if padding.any():
            for key in (self.done_key, self.terminated_key):
                flag = out.get(key)
                out.set(key, flag | padding.reshape(*padding.shape, *[1] * (flag.ndim - 2)))
            reward = out.get(self.reward_key)
            out.set(self.reward_key, reward.masked_fill(padding.reshape(*padding.shape, *[1] * (reward.ndim - 2)), 0))
        out.set(VALID_KEY, train)
        return out


def _flag(tensordict: TensorDictBase, key: NestedKey) -> torch.Tensor:
    """A ``[B, T]`` bool view of a ``[B, T]`` or ``[B, T, 1]`` flag."""
    flag = tensordict.get(key)
    if flag.ndim == 3:
        flag = flag.squeeze(-1)
    return flag.bool()
