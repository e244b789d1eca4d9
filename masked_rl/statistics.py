"""Mean and std over trainable steps only: the standardisation of rule 6 (``docs/semantics.md``).

:func:`masked_standardize` (``MaskedGAE(average_gae=True)``, and the masked losses'
``normalize_advantage`` with a process group) and :func:`masked_moments`, its statistics over
the ranks of a process group. float16 and bfloat16 advantages are reduced in float32 (a sum of
squares of 10,000 half-precision values overflows), the moments across ranks in float64.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from masked_rl._checks import _LOW_PRECISION, check_loss_mask

# all_gather_single is all_gather_into_tensor's name from torch 2.13 on (the old name warns).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["masked_moments", "masked_standardize"]


def masked_moments(values: Tensor, mask: Tensor, group=None) -> tuple[Tensor, Tensor]:
    """Mean and unbiased std (float64 scalars) of ``values[mask]`` over every rank of ``group``.

    Each rank reduces its own entries to a count, a mean and a sum of squared deviations
    (two passes, float64); one ``all_gather`` of those 3 numbers per rank and Chan et al.'s
    pairwise merge give the statistics of the union, without the cancellation of a plain sum of
    squares. A rank with no entry contributes nothing. ``group`` may be a sequence of groups
    forming a grid (e.g. ``(cp_group, dp_group)``): they are merged one after the other (one
    ``all_gather`` each), giving the statistics over every rank of the grid. Used by
    :func:`~masked_rl.masked_standardize` with a ``group``.

    Examples:
        >>> import torch, torch.distributed as dist
        >>> from masked_rl.statistics import masked_moments
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> values = torch.tensor([1.0, 9.0, 3.0])
        >>> mean, std = masked_moments(values, torch.tensor([True, False, True]), dist.group.WORLD)
        >>> round(mean.item(), 4), round(std.item(), 4)
        (2.0, 1.4142)
        >>> dist.destroy_process_group()
    """
    groups = list(group) if isinstance(group, (list, tuple)) else [group]
    values = values.detach().to(torch.float64)
    count = mask.sum().to(torch.float64)
    mean = torch.where(mask, values, 0.0).sum() / count.clamp_min(1)
    squares = torch.where(mask, values - mean, 0.0).pow(2).sum()
    for each in groups:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("statistics over a process group need an initialised "
                               "torch.distributed process group (torch.distributed.init_process_group)")
        if dist.get_rank(each) < 0:
            raise RuntimeError("this process is not a member of the process group passed as group")
        ranks = dist.get_world_size(each)
        gathered = values.new_empty(3 * ranks)
        _all_gather_single(gathered, torch.stack((count, mean, squares)), group=each)
        counts, means, spreads = gathered.view(ranks, 3).unbind(-1)
        count = counts.sum()
        mean = (counts * means).sum() / count.clamp_min(1)
        squares = spreads.sum() + (counts * (means - mean).pow(2)).sum()
    return mean, (squares / (count - 1).clamp_min(1)).sqrt()


def masked_standardize(
    advantage: Tensor, loss_mask: Tensor, *, eps: float = 1e-4, group=None
) -> Tensor:
    """Standardise ``advantage`` with mean and std over trainable steps only.

    Args:
        advantage (Tensor): ``[*B, T, F]`` (floating).
        loss_mask (Tensor): ``[*B, T]``, ``[*B, T, 1]`` or ``advantage``'s shape; bool or
            numbers holding only ``0`` and ``1`` (as the estimator accepts it).

    Keyword Args:
        eps (float): lower bound of the std. Defaults to ``1e-4`` (as TorchRL's GAE).
        group (ProcessGroup or sequence of them, optional): a data-parallel group
            (``torch.distributed.group.WORLD`` for all ranks): the statistics are those of the
            trainable steps of every rank of the group, as if their batches were one. Each rank
            computes its count, mean and sum of squared deviations in float64 and one
            ``all_gather`` (3 numbers per rank) merges them (Chan et al.'s pairwise update: no
            cancellation, unlike a sum of squares). Under context parallelism pass
            ``(cp_group, dp_group)``: one ``all_gather`` per group, statistics over the grid
            (:func:`masked_moments`). ``None`` (default): this batch
            alone, no communication.

    Returns:
        ``advantage``'s shape and dtype (float16 and bfloat16 are computed in float32):
        ``(advantage - mean) / max(std, eps)`` at trainable steps, exactly ``0`` at masked steps
        (NaN or inf stored there included). The std is the unbiased std over trainable steps,
        clamped at ``eps``, so an all-ones mask gives ``(adv - adv.mean()) / adv.std()``.

    Raises:
        ValueError: ``loss_mask`` of another shape or holding values other than 0 and 1.

    Examples:
        >>> import torch
        >>> from masked_rl import masked_standardize
        >>> adv = torch.tensor([[[1.0], [9.0], [3.0]]])      # [B, T, 1]
        >>> masked_standardize(adv, torch.tensor([[1, 0, 1]], dtype=torch.int8)).squeeze(-1)
        tensor([[-0.7071,  0.0000,  0.7071]])
    """
    if not isinstance(advantage, Tensor) or not advantage.dtype.is_floating_point:
        found = advantage.dtype if isinstance(advantage, Tensor) else type(advantage).__name__
        raise TypeError(f"advantage must be a floating torch.Tensor, got {found}")
    shape = tuple(advantage.shape)
    accepted = (shape[:-1], shape[:-1] + (1,), shape)
    if not isinstance(loss_mask, Tensor) or tuple(loss_mask.shape) not in accepted:
        found = list(loss_mask.shape) if isinstance(loss_mask, Tensor) else type(loss_mask).__name__
        raise ValueError(
            f"loss_mask must have shape {list(accepted[0])}, {list(accepted[1])} or "
            f"{list(accepted[2])} to match advantage {list(shape)}, got {found}"
        )
    if loss_mask.shape == advantage.shape:  # one flag per entry
        mask = check_loss_mask(loss_mask, advantage.unsqueeze(-1)).squeeze(-1)
    else:
        mask = check_loss_mask(loss_mask, advantage).expand_as(advantage)
    out_dtype = advantage.dtype
    if out_dtype in _LOW_PRECISION:
        advantage = advantage.float()
    if group is not None:
        if torch.is_grad_enabled() and advantage.requires_grad:
            raise RuntimeError(
                "masked_standardize with a group does not differentiate through the statistics "
                "of other ranks: pass a detached advantage (or call it under torch.no_grad())"
            )
        loc, scale = masked_moments(advantage, mask, group)
        centred = torch.where(mask, advantage - loc.to(advantage.dtype), 0.0)
        return (centred / scale.clamp_min(eps).to(advantage.dtype)).to(out_dtype)
    weight = mask.to(advantage.dtype)
    count = weight.sum().clamp_min(1)
    masked_adv = torch.where(mask, advantage, 0.0)
    loc = masked_adv.sum() / count
    centred = torch.where(mask, advantage - loc, 0.0)
    scale = (centred.pow(2).sum() / (count - 1).clamp_min(1)).sqrt().clamp_min(eps)
    return (centred / scale).to(out_dtype)
