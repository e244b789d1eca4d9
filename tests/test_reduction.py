"""masked_rl.reduction.masked_mean on one process (the DDP gradient over a gloo group is
checked by distributed_worker.check_data_parallel_loss, run from tests/test_distributed.py)."""

from __future__ import annotations

import math

import pytest
import torch
from distributed_worker import actor_critic, rollout_td

from masked_rl import MaskedClipPPOLoss, MaskedGAE
from masked_rl.reduction import masked_mean


def _plain_token_mean(values, mask):
    picked = [v for v, m in zip(values.reshape(-1).tolist(), mask.reshape(-1).tolist()) if m]
    return sum(picked) / len(picked) if picked else 0.0


def _plain_sequence_mean(values, mask):
    means = []
    for row, flags in zip(values.reshape(-1, values.shape[-1]).tolist(), mask.reshape(-1, mask.shape[-1]).tolist()):
        picked = [v for v, m in zip(row, flags) if m]
        if picked:
            means.append(sum(picked) / len(picked))
    return sum(means) / len(means) if means else 0.0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("reduction, plain", [("token_mean", _plain_token_mean),
                                              ("sequence_mean", _plain_sequence_mean)])
def test_matches_a_plain_loop(seed, reduction, plain):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(2, 3, 7, generator=g, dtype=torch.float64)  # [*B, T], *B = (2, 3)
    mask = torch.rand(2, 3, 7, generator=g) < (0.1, 0.3, 0.6, 0.9, 0.0, 1.0)[seed]
    values = torch.where(mask, values, math.nan)  # masked entries never reach the result
    got = masked_mean(values, mask, reduction=reduction)
    assert got.shape == () and got.dtype == torch.float64
    assert got.item() == pytest.approx(plain(values, mask), abs=1e-12)


def test_sequence_mean_weighs_sequences_not_tokens():
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert masked_mean(values, mask, reduction="sequence_mean").item() == 3.0  # (1 + 5) / 2
    assert masked_mean(values, mask).item() == pytest.approx(9 / 5)


@pytest.mark.parametrize("values_shape, mask_shape", [((3, 5), (3, 5)), ((3, 5, 1), (3, 5)),
                                                      ((3, 5), (3, 5, 1)), ((3, 5, 1), (3, 5, 1))])
def test_accepts_a_trailing_dim_of_one_and_numeric_masks(values_shape, mask_shape):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, generator=g)
    flags = torch.rand(3, 5, generator=g) < 0.5
    expected = masked_mean(base, flags)
    assert torch.equal(masked_mean(base.view(values_shape), flags.view(mask_shape).to(torch.int8)), expected)


def test_gradient_reaches_trainable_tokens_only_and_empty_masks_give_zero():
    values = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    masked_mean(values, torch.tensor([[1, 0, 1]])).backward()
    assert values.grad.tolist() == [[0.5, 0.0, 0.5]]
    empty = masked_mean(values, torch.zeros(1, 3, dtype=torch.bool), reduction="sequence_mean")
    assert empty.item() == 0.0 and empty.requires_grad


@pytest.mark.parametrize(
    "values, mask, kwargs, error, message",
    [
        (torch.zeros(2, 3), torch.ones(2, 4), {}, ValueError,
         r"mask must have the shape of values .* got values \[2, 3\] and mask \[2, 4\]"),
        (torch.zeros(2, 3), torch.full((2, 3), 2), {}, ValueError, r"mask must be bool or hold only 0 and 1"),
        (torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 3), {}, TypeError,
         r"values must be a floating torch.Tensor, got torch.int64"),
        (torch.zeros(2, 3), [[1, 1, 1]], {}, TypeError, r"mask must be a torch.Tensor, got list"),
        (torch.zeros(2, 3), torch.ones(2, 3), dict(reduction="prompt_mean"), ValueError,
         r"reduction must be one of \('token_mean', 'sequence_mean'\), got 'prompt_mean'"),
    ],
)
def test_rejects_bad_arguments(values, mask, kwargs, error, message):
    with pytest.raises(error, match=message):
        masked_mean(values, mask, **kwargs)


def test_group_without_process_group_says_so():
    with pytest.raises(RuntimeError, match="initialised torch.distributed process group"):
        masked_mean(torch.zeros(2, 3), torch.ones(2, 3), group=object())


# --- MaskedClipPPOLoss(reduction="token_mean" | "sequence_mean") on one process ---------------


def _loss_and_batch(reduction, seed=0):
    td = MaskedGAE(gamma=0.9, lmbda=0.8, value_network=None)(rollout_td(4, 9, seed=seed))
    return MaskedClipPPOLoss(*actor_critic(), reduction=reduction), td


def test_loss_token_mean_is_the_mean_over_trainable_steps():
    mean_loss, td = _loss_and_batch("mean")
    token_loss, _ = _loss_and_batch("token_mean")
    expected, got = mean_loss(td.clone()), token_loss(td.clone())
    for name in ("loss_objective", "loss_critic", "loss_entropy"):
        torch.testing.assert_close(got[name], expected[name], atol=1e-12, rtol=0)


def test_loss_sequence_mean_averages_each_rows_steps_first():
    per_step_loss, td = _loss_and_batch("none")
    sequence_loss, _ = _loss_and_batch("sequence_mean")
    per_step, got = per_step_loss(td.clone()), sequence_loss(td.clone())
    rows = torch.arange(td.numel()).view(td.batch_size)[td["loss_mask"].bool()] // td.shape[1]
    for name in ("loss_objective", "loss_critic", "loss_entropy"):
        means = [per_step[name][rows == r].mean() for r in rows.unique()]
        torch.testing.assert_close(got[name], torch.stack(means).mean(), atol=1e-12, rtol=0)


def test_loss_sequence_mean_needs_rows():
    loss, td = _loss_and_batch("sequence_mean")
    with pytest.raises(ValueError, match=r"reduction='sequence_mean' needs whole \[\*B, T\] rows"):
        loss(td.reshape(-1))
