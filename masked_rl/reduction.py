"""Masked loss reductions that stay exact under data parallelism.

A loss averaged over each rank's own trainable tokens, then averaged over ranks by DDP's
gradient all-reduce, is a mean of per-rank means: a rank with 10 trainable tokens weighs as much
as one with 10,000, and the update depends on how the batch was split. :func:`masked_mean` over
a ``group`` divides each rank's *sum* by the *group's* count instead, times the group size, so
that DDP's averaging of gradients gives the gradient of the mean over every rank's tokens (or
sequences) as if the batches were one.

Plain tensors in, a scalar out: the classic PPO loss and token-level LLM losses call it alike.
"""

from __future__ import annotations

import torch
from torch import Tensor

from masked_rl.functional import check_loss_mask

__all__ = ["REDUCTIONS", "masked_mean"]

REDUCTIONS = ("token_mean", "sequence_mean")


def _as_tokens(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``values`` and ``mask`` as ``[*B, T]``, the mask bool (a trailing dim of 1 on either
    side is dropped)."""
    if not isinstance(values, Tensor) or not values.dtype.is_floating_point:
        found = values.dtype if isinstance(values, Tensor) else type(values).__name__
        raise TypeError(f"values must be a floating torch.Tensor, got {found}")
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    v, m = values, mask
    if v.ndim == m.ndim + 1 and v.shape[-1] == 1:
        v = v.squeeze(-1)
    elif m.ndim == v.ndim + 1 and m.shape[-1] == 1:
        m = m.squeeze(-1)
    if v.ndim < 1 or v.shape != m.shape:
        raise ValueError(
            f"mask must have the shape of values ([*B, T], either may add a trailing dim of 1), "
            f"got values {list(values.shape)} and mask {list(mask.shape)}"
        )
    return v, check_loss_mask(m, v.unsqueeze(-1), key="mask").squeeze(-1)


def masked_mean(values: Tensor, mask: Tensor, *, reduction: str = "token_mean", group=None) -> Tensor:
    """The mean of ``values`` at ``mask``, over this rank or every rank of a data-parallel group.

    Args:
        values (Tensor): per-token terms ``[*B, T]`` (or ``[*B, T, 1]``), floating; may require
            grad. Entries where ``mask`` is false never reach the result (NaN there included).
        mask (Tensor): ``[*B, T]`` or ``[*B, T, 1]``, bool or 0/1 numbers: the trainable tokens.

    Keyword Args:
        reduction (str): ``"token_mean"`` (default): the sum over trainable tokens divided by
            their number. ``"sequence_mean"``: each sequence (a row of ``[*B]``) averaged over
            its trainable tokens, then the mean over the sequences that have any (a sequence
            without trainable tokens counts for nothing), as TorchRL's ``"prompt_mean"``.
        group (ProcessGroup or sequence of them, optional): the ranks whose gradients DDP
            averages: a data-parallel group (``torch.distributed.group.WORLD`` for all ranks),
            or under DP x CP with ``"token_mean"`` the group of all those ranks or the pair
            ``(cp_group, dp_group)`` (a grid: counted over both). The denominator is then the
            count over every rank (tokens, or sequences with a trainable token) and the result
            is multiplied by the number of ranks ``W``: summed over ranks it is ``W`` times the
            global mean, so the gradients DDP averages (divides by ``W``) are those of the
            global mean. The value on one rank is that rank's share times ``W``, not the global
            mean: for logging, all-reduce it and divide by ``W``. ``"sequence_mean"`` needs
            whole sequences on each rank (no CP). ``None`` (default): this rank alone, no
            communication.

    Returns:
        A 0-d tensor of ``values``' dtype; ``0`` (still connected to ``values``' graph) where the
        denominator is 0.

    Communication: with a ``group``, one ``all_reduce`` of one float64 number per call and
    group (the count); counts are integers, so it is exact and the same on every rank.

    Examples:
        >>> import torch
        >>> from masked_rl.reduction import masked_mean
        >>> terms = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
        >>> mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
        >>> masked_mean(terms, mask)                            # (1 + 2 + 3 + 4) / 4
        tensor(2.5000)
        >>> masked_mean(terms, mask, reduction="sequence_mean")  # (2 + 4) / 2
        tensor(3.)
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    v, m = _as_tokens(values, mask)
    terms = torch.where(m, v, 0.0)
    if reduction == "token_mean":
        total, count = terms.sum(), m.sum()
    else:
        flat_terms, flat_mask = terms.reshape(-1, v.shape[-1]), m.reshape(-1, m.shape[-1])
        tokens = flat_mask.sum(-1)
        total = (flat_terms.sum(-1) / tokens.clamp_min(1).to(v.dtype)).sum()
        count = (tokens > 0).sum()
    count = count.to(torch.float64)
    world = 1
    if group is not None:
        import torch.distributed as dist  # only when asked

        from masked_rl.distributed import _group_rank

        for each in (group if isinstance(group, (list, tuple)) else [group]):
            world *= _group_rank(each)[1]
            if dist.get_backend(each) == "nccl" and count.device.type != "cuda":
                count = count.cuda()
            dist.all_reduce(count, group=each)
    mean = total / count.clamp_min(1).to(device=total.device, dtype=v.dtype)
    return mean * world if world != 1 else mean
