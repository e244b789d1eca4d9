"""masked_rl.functional against docs/semantics.md, the serial reference and TorchRL's GAE."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from masked_gae_reference import make_rollout, serial_masked_gae_batch
from torchrl.objectives.value.functional import generalized_advantage_estimate

from masked_rl import masked_generalized_advantage_estimate as mgae
from masked_rl import masked_standardize


def episode(mask, *, reward=None, value=None, next_value=None, terminated=True, dtype=torch.float64):
    """One ``[1, T, 1]`` row ending (done) at its last step."""
    horizon = len(mask)
    zeros = torch.zeros(1, horizon, 1, dtype=dtype)
    as_row = lambda x: zeros.clone() if x is None else torch.tensor(x, dtype=dtype).view(1, horizon, 1)
    done = torch.zeros(1, horizon, 1, dtype=torch.bool)
    done[0, -1] = True
    return dict(
        state_value=as_row(value),
        next_state_value=as_row(next_value),
        reward=as_row(reward),
        done=done,
        terminated=done & terminated,
        loss_mask=torch.tensor([mask]),
    )


def run(gamma, lmbda, data, **kwargs):
    return mgae(gamma, lmbda, **data, **kwargs)


# --- the worked cases of docs/semantics.md --------------------------------------------------


@pytest.mark.parametrize("gap", [0, 1, 4, 50, 1000])
def test_spec_case1_one_gamma_lambda_per_gap(gap):
    mask = [1] + [0] * gap + [1]
    reward = [0.0] * (gap + 1) + [2.0]
    adv, target = run(0.9, 0.5, episode(mask, reward=reward))
    expected = torch.zeros(gap + 2, dtype=torch.float64)
    expected[0], expected[-1] = 0.9 * 0.5 * 2.0, 2.0
    torch.testing.assert_close(adv.view(-1), expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(target.view(-1), expected, rtol=0, atol=1e-15)


def test_spec_case2_terminal_reward_on_masked_step_lands_on_last_action():
    adv, target = run(0.0, 0.0, episode([1, 1, 1, 0, 0], reward=[0, 0, 0, 0, 10.0]))
    assert adv.view(-1).tolist() == [0.0, 0.0, 10.0, 0.0, 0.0]
    assert target.view(-1).tolist() == [0.0, 0.0, 10.0, 0.0, 0.0]


def test_spec_case3_monte_carlo_with_unit_gamma_lambda():
    g = torch.Generator().manual_seed(3)
    reward = torch.randn(12, generator=g, dtype=torch.float64)
    value = torch.randn(12, generator=g, dtype=torch.float64)
    next_value = torch.cat((value[1:], torch.tensor([123.0], dtype=torch.float64)))
    data = episode([1] * 12, reward=reward.tolist(), value=value.tolist(), next_value=next_value.tolist())
    adv, target = run(1.0, 1.0, data)
    expected = reward.flip(0).cumsum(0).flip(0) - value
    torch.testing.assert_close(adv.view(-1), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(target.view(-1), expected + value, rtol=0, atol=1e-12)


@pytest.mark.parametrize("last_trainable", [True, False])
def test_spec_case4_truncation_bootstraps_from_next_value_at_episode_end(last_trainable):
    mask = [1, 0, 1, 1 if last_trainable else 0]
    next_value = [0.0, 0.0, 0.0, 5.0]
    truncated = episode(mask, next_value=next_value, terminated=False)
    terminated = episode(mask, next_value=next_value, terminated=True)
    gamma, lmbda = 0.5, 0.5
    adv_trunc, _ = run(gamma, lmbda, truncated)
    adv_term, _ = run(gamma, lmbda, terminated)
    last = 3 if last_trainable else 2
    assert adv_term.abs().max() == 0
    assert adv_trunc[0, last, 0] == gamma * 5.0
    later_actions = 2 if last_trainable else 1
    assert adv_trunc[0, 0, 0] == (gamma * lmbda) ** later_actions * gamma * 5.0
    # A row cut before the episode ended (done == 0 at the last step) also bootstraps.
    cut = dict(truncated, done=torch.zeros_like(truncated["done"]), terminated=torch.zeros_like(truncated["done"]))
    torch.testing.assert_close(run(gamma, lmbda, cut)[0], adv_trunc, rtol=0, atol=0)


def test_spec_case5_fully_masked_row_is_zero_and_leaves_other_rows_bit_identical():
    value, next_value, reward, done, terminated, mask = make_rollout(6, 40, seed=5, dtype=torch.float32)
    mask[2] = False
    adv, target = mgae(0.99, 0.95, value, next_value, reward, done, terminated, mask)
    assert adv[2].abs().max() == 0 and target[2].abs().max() == 0
    for row in (0, 1, 3, 4, 5):
        alone = [x[row : row + 1] for x in (value, next_value, reward, done, terminated, mask)]
        adv_alone, target_alone = mgae(0.99, 0.95, *alone)
        assert torch.equal(adv[row : row + 1], adv_alone)
        assert torch.equal(target[row : row + 1], target_alone)


# --- the other rules of docs/semantics.md ---------------------------------------------------


def test_prompt_rewards_before_first_trainable_step_are_dropped():
    adv, _ = run(0.9, 0.9, episode([0, 0, 1, 0], reward=[7.0, 7.0, 1.0, 2.0]))
    assert adv.view(-1).tolist() == [0.0, 0.0, 3.0, 0.0]


def test_segment_without_trainable_step_is_zero_and_drops_its_rewards():
    # Two episodes in one row: the first has no trainable step and a big reward.
    data = episode([0, 0, 0, 1, 1], reward=[100.0, 100.0, 100.0, 1.0, 1.0])
    data["done"][0, 2] = True
    data["terminated"][0, 2] = True
    adv, _ = run(1.0, 1.0, data)
    assert adv.view(-1).tolist() == [0.0, 0.0, 0.0, 2.0, 1.0]


def test_masked_rewards_are_summed_undiscounted_into_the_previous_action():
    adv, _ = run(0.5, 0.0, episode([1, 0, 0, 1, 0], reward=[1.0, 2.0, 3.0, 4.0, 5.0]))
    # delta_0 = 1 + 2 + 3 + gamma * V(t=3) - V(t=0); values are zero.
    assert adv.view(-1).tolist() == [6.0, 0.0, 0.0, 9.0, 0.0]


@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf, 1e30])
def test_nothing_at_masked_steps_but_rewards_changes_outputs(poison):
    value, next_value, reward, done, terminated, mask = make_rollout(4, 60, seed=11)
    adv, target = mgae(0.9, 0.8, value, next_value, reward, done, terminated, mask)
    end = done.clone()
    end[:, -1] = True
    truncated_end = (end & ~terminated).squeeze(-1)
    # Values of masked steps; next values of masked steps except a truncated episode end (the bootstrap).
    masked = ~mask
    poisoned_value = torch.where(masked.unsqueeze(-1), torch.full_like(value, poison), value)
    poisoned_next = torch.where((masked & ~truncated_end).unsqueeze(-1), torch.full_like(value, poison), next_value)
    # Next values of trainable steps that are followed by a masked step are not read either.
    nxt_masked = torch.cat((masked[:, 1:], torch.zeros_like(masked[:, :1])), 1) & ~end.squeeze(-1)
    poisoned_next = torch.where((mask & nxt_masked).unsqueeze(-1), torch.full_like(value, poison), poisoned_next)
    # Rewards on prompt steps (masked, before the first trainable step of their episode).
    adv2, target2 = mgae(0.9, 0.8, poisoned_value, poisoned_next, reward, done, terminated, mask)
    assert torch.equal(adv, adv2) and torch.equal(target, target2)


def test_prompt_reward_poison_is_dropped():
    data = episode([0, 0, 1, 1], reward=[math.nan, math.inf, 1.0, 1.0])
    adv, _ = run(1.0, 1.0, data)
    assert adv.view(-1).tolist() == [0.0, 0.0, 2.0, 1.0]


def test_terminated_end_ignores_nonfinite_next_value():
    data = episode([1, 0], next_value=[0.0, math.nan], terminated=True)
    adv, _ = run(0.9, 0.9, data)
    assert adv.view(-1).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("poison", [math.nan, math.inf])
@pytest.mark.parametrize("poisoned_episode", [0, 1])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_nonfinite_reward_stays_in_its_episode(poison, poisoned_episode, requires_grad):
    # Two episodes in a row, and a second row: a NaN or inf credited to an action of one
    # episode reaches the earlier actions of that episode and nothing else, in both directions.
    value, next_value, reward, done, terminated, mask = make_rollout(2, 12, p_done=0.0, seed=21)
    mask[:] = True
    done[:, 5] = terminated[:, 5] = True
    value.requires_grad_(requires_grad)  # both runs on one path: the paths round differently
    clean = mgae(0.9, 0.9, value, next_value, reward, done, terminated, mask)[0].detach()
    step = 3 if poisoned_episode == 0 else 9
    reward[0, step] = poison
    adv = mgae(0.9, 0.9, value, next_value, reward, done, terminated, mask)[0].detach()
    episode_start = 0 if poisoned_episode == 0 else 6
    poisoned = torch.zeros(2, 12, dtype=torch.bool)
    poisoned[0, episode_start : step + 1] = True
    assert not torch.isfinite(adv[0, episode_start : step + 1]).any()
    assert torch.equal(adv[~poisoned], clean[~poisoned])


# --- property tests against the serial reference ------------------------------------------


@st.composite
def rollouts(draw):
    batch = draw(st.integers(1, 4))
    horizon = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    p_mask = draw(st.sampled_from([0.0, 0.2, 0.5, 0.9, 1.0]))
    p_done = draw(st.sampled_from([0.0, 0.1, 0.3, 1.0]))
    gamma = draw(st.sampled_from([0.0, 0.5, 0.9, 0.99, 1.0]))
    lmbda = draw(st.sampled_from([0.0, 0.5, 0.95, 1.0]))
    # V' independent of V[t + 1] too: then reading V' or V at an adjacent pair differs (rule 2).
    consistent = draw(st.booleans())
    data = make_rollout(batch, horizon, p_mask=p_mask, p_done=p_done, seed=seed,
                        consistent=consistent)
    return gamma, lmbda, data


@settings(max_examples=150, deadline=None)
@given(rollouts())
def test_matches_serial_reference(case):
    gamma, lmbda, data = case
    ref_adv, ref_target = serial_masked_gae_batch(gamma, lmbda, *data)
    for implementation in ("auto", "reference"):
        adv, target = mgae(gamma, lmbda, *data, implementation=implementation)
        torch.testing.assert_close(adv, ref_adv, rtol=0, atol=1e-10)
        torch.testing.assert_close(target, ref_target, rtol=0, atol=1e-10)


@pytest.mark.parametrize("p_mask", [0.5, 0.8, 1.0])
def test_adjacent_actions_read_next_value_where_it_differs_from_the_next_value(p_mask):
    # The issue's case (4x40, seed 3, V' independent of V[t + 1]): the reference read V[t + 1]
    # at adjacent actions and disagreed with the library by 2.25.
    data = make_rollout(4, 40, p_mask=p_mask, seed=3, consistent=False)
    value, next_value, *_, mask = data
    adjacent = mask[:, :-1] & mask[:, 1:]
    assert adjacent.any() and not torch.equal(next_value[:, :-1], value[:, 1:])
    ref_adv, _ = serial_masked_gae_batch(0.9, 0.8, *data)
    for implementation in ("auto", "reference"):
        torch.testing.assert_close(mgae(0.9, 0.8, *data, implementation=implementation)[0],
                                   ref_adv, rtol=0, atol=1e-10)
    # V'[t] of an action followed by an adjacent one enters its delta with one gamma.
    t = int(adjacent[0].nonzero()[0])
    poked = [x.clone() for x in data]
    poked[1][0, t] += 1.0
    assert mgae(0.9, 0.8, *poked)[0][0, t] - ref_adv[0, t] == pytest.approx(0.9, abs=1e-9)


@settings(max_examples=25, deadline=None)
@given(rollouts(), st.sampled_from([(2, 3), (1,), (3, 1, 2)]))
def test_extra_batch_dims_and_time_dim_zero(case, batch_shape):
    gamma, lmbda, _ = case
    n = math.prod(batch_shape)
    data = make_rollout(n, 17, seed=n, p_done=0.2)
    flat_adv, flat_target = mgae(gamma, lmbda, *data)
    shaped = [x.reshape(*batch_shape, *x.shape[1:]) for x in data]
    adv, target = mgae(gamma, lmbda, *shaped)
    assert torch.equal(adv.reshape(flat_adv.shape), flat_adv)
    # time_dim=0: [T, *B, 1] tensors, [T, *B] mask.
    time_first = [x.movedim(len(batch_shape), 0) for x in shaped]
    adv_t, target_t = mgae(gamma, lmbda, *time_first, time_dim=0)
    assert torch.equal(adv_t.movedim(0, len(batch_shape)), adv)
    assert torch.equal(target_t.movedim(0, len(batch_shape)), target)


def test_long_rows_float64_exact():
    data = make_rollout(3, 3000, p_mask=0.3, p_done=0.002, seed=9)
    for gamma, lmbda in [(1.0, 1.0), (0.999, 0.99), (0.99, 0.95)]:
        adv, target = mgae(gamma, lmbda, *data)
        ref_adv, ref_target = serial_masked_gae_batch(gamma, lmbda, *data)
        torch.testing.assert_close(adv, ref_adv, rtol=0, atol=1e-10)


def test_strided_inputs_give_the_contiguous_result():
    # Views with gaps (every other entry of wider tensors) are copied for the CPU kernel.
    data = make_rollout(3, 50, p_done=0.1, seed=2)
    strided = [torch.stack((x, torch.full_like(x, 7)), -1)[..., 0] for x in data]
    assert not any(x.is_contiguous() for x in strided)
    want = mgae(0.99, 0.9, *data, masked_value_targets=True)
    got = mgae(0.99, 0.9, *strided, masked_value_targets=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_feature_dim_broadcasts_the_mask():
    data = make_rollout(2, 30, seed=4)
    value, next_value, reward, done, terminated, mask = data
    two = [torch.cat((x, 2 * x), -1) if x.is_floating_point() else torch.cat((x, x), -1) for x in data[:5]]
    adv, _ = mgae(0.9, 0.9, *two, mask)
    single, _ = mgae(0.9, 0.9, *data)
    torch.testing.assert_close(adv[..., :1], single)
    torch.testing.assert_close(adv[..., 1:], 2 * single)


# --- parity with TorchRL's GAE (all-ones mask) ---------------------------------------------


@pytest.mark.parametrize("p_done", [0.0, 0.05, 0.3])
def test_all_ones_mask_equals_torchrl_gae(p_done):
    # Dyadic gamma/lmbda: TorchRL stores them as float32 tensors, these are exact there.
    gamma, lmbda = 0.9375, 0.875
    value, next_value, reward, done, terminated, _ = make_rollout(
        4, 200, p_done=p_done, seed=1, consistent=False
    )
    ones = torch.ones(4, 200, dtype=torch.bool)
    adv, target = mgae(gamma, lmbda, value, next_value, reward, done, terminated, ones)
    ref_adv, ref_target = generalized_advantage_estimate(gamma, lmbda, value, next_value, reward, done, terminated)
    torch.testing.assert_close(adv, ref_adv, rtol=0, atol=1e-12)
    torch.testing.assert_close(target, ref_target, rtol=0, atol=1e-12)


# --- inputs, dtypes, errors -----------------------------------------------------------------


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int8, torch.int64, torch.float32, torch.uint8])
@pytest.mark.parametrize("trailing_one", [False, True])
def test_mask_dtypes_and_shapes(mask_dtype, trailing_one):
    data = list(make_rollout(3, 20, seed=2))
    expected = mgae(0.9, 0.9, *data)
    mask = data[-1].to(mask_dtype)
    data[-1] = mask.unsqueeze(-1) if trailing_one else mask
    adv, target = mgae(0.9, 0.9, *data)
    assert torch.equal(adv, expected[0]) and torch.equal(target, expected[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_is_computed_in_float32(dtype):
    data = list(make_rollout(2, 50, seed=8, dtype=torch.float32))
    ref = mgae(0.99, 0.95, *[x.to(dtype).float() if x.is_floating_point() else x for x in data])
    adv, target = mgae(0.99, 0.95, *[x.to(dtype) if x.is_floating_point() else x for x in data])
    assert adv.dtype == dtype and target.dtype == dtype
    torch.testing.assert_close(adv, ref[0].to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("implementation", ["auto", "reference"])
@pytest.mark.parametrize("masked_value_targets", [False, True])
def test_empty_time_returns_empty(implementation, masked_value_targets):
    data = make_rollout(3, 0, seed=0)
    out = mgae(0.99, 0.95, *data, implementation=implementation,
               masked_value_targets=masked_value_targets)
    assert [x.shape for x in out] == [(3, 0, 1)] * (3 if masked_value_targets else 2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [10_000, 30_000])
def test_low_precision_standardisation_is_computed_in_float32(dtype, n):
    # #29: the half-precision sum of squares overflowed (all zeros at 10,000, NaN at 30,000).
    g = torch.Generator().manual_seed(n)
    advantage = (4 * torch.randn(1, n, 1, generator=g) + 3).to(dtype)
    mask = torch.rand(1, n, generator=g) < 0.8
    got = masked_standardize(advantage, mask)
    expected = masked_standardize(advantage.double(), mask)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=1e-2)
    assert got[mask].double().std().item() == pytest.approx(1.0, abs=0.01)


def test_all_masked_batch_returns_zeros():
    data = list(make_rollout(3, 10, seed=0))
    data[-1] = torch.zeros(3, 10, dtype=torch.bool)
    adv, target = mgae(0.99, 0.95, *data)
    assert adv.abs().max() == 0 and target.abs().max() == 0


@pytest.mark.parametrize(
    "bad_mask, message",
    [
        (torch.ones(3, 19, dtype=torch.bool), r"loss_mask must have shape \[3, 20\] or \[3, 20, 1\] matching reward \[3, 20, 1\], got \[3, 19\]"),
        (torch.ones(3, 19, 1, dtype=torch.bool), r"got \[3, 19, 1\]"),
        (torch.ones(1, 20, dtype=torch.bool), r"got \[1, 20\]"),
        (torch.ones(20, dtype=torch.bool), r"got \[20\]"),
        (torch.ones(3, 20, 2, dtype=torch.bool), r"got \[3, 20, 2\]"),
        (torch.full((3, 20), 2, dtype=torch.int8), r"hold only 0 and 1, got torch.int8 values \[2\]"),
        (torch.full((3, 20), 0.5), r"hold only 0 and 1, got torch.float32 values \[0.5\]"),
    ],
)
def test_bad_mask_raises(bad_mask, message):
    data = list(make_rollout(3, 20, seed=0))
    data[-1] = bad_mask
    with pytest.raises(ValueError, match=message):
        mgae(0.9, 0.9, *data)


def test_mismatched_shapes_and_time_dim_raise():
    value, next_value, reward, done, terminated, mask = make_rollout(3, 20, seed=0)
    with pytest.raises(ValueError, match=r"reward must have the shape of state_value \[3, 20, 1\], got \[3, 19, 1\]"):
        mgae(0.9, 0.9, value, next_value, reward[:, 1:], done, terminated, mask)
    with pytest.raises(ValueError, match="time_dim"):
        mgae(0.9, 0.9, value, next_value, reward, done, terminated, mask, time_dim=-1)
    with pytest.raises(ValueError, match="time_dim"):
        mgae(0.9, 0.9, value, next_value, reward, done, terminated, mask, time_dim=5)


def test_gradient_matches_autograd_through_reference():
    value, next_value, reward, done, terminated, mask = make_rollout(2, 25, seed=6)
    value = value.clone().requires_grad_(True)
    adv, target = mgae(0.9, 0.8, value, next_value, reward, done, terminated, mask)
    weights = torch.randn_like(adv)
    (adv * weights).sum().backward()
    # A_j depends on V[t_j] with coefficient -1 and on V[t_{j+1}] (when read) with gamma * (1 - lmbda)...
    # so check against finite differences instead of a closed form.
    eps = 1e-6
    numeric = torch.zeros_like(value)
    with torch.no_grad():
        for idx in [(0, 3, 0), (1, 7, 0), (0, 24, 0), (1, 0, 0)]:
            bumped = value.detach().clone()
            bumped[idx] += eps
            up = (mgae(0.9, 0.8, bumped, next_value, reward, done, terminated, mask)[0] * weights).sum()
            bumped[idx] -= 2 * eps
            down = (mgae(0.9, 0.8, bumped, next_value, reward, done, terminated, mask)[0] * weights).sum()
            numeric[idx] = (up - down) / (2 * eps)
            torch.testing.assert_close(value.grad[idx], numeric[idx], rtol=1e-6, atol=1e-8)


def test_runs_on_device(device):
    data = [x.to(device) for x in make_rollout(4, 64, seed=12)]
    adv, target = mgae(0.99, 0.95, *data)
    assert adv.device.type == device.type
    ref_adv, _ = serial_masked_gae_batch(0.99, 0.95, *[x.cpu() for x in data])
    torch.testing.assert_close(adv.cpu(), ref_adv, rtol=0, atol=1e-10)


# --- standardisation ----------------------------------------------------------------------------


def test_masked_standardize_uses_trainable_steps_only():
    value, next_value, reward, done, terminated, mask = make_rollout(4, 50, seed=13)
    adv, _ = mgae(0.99, 0.95, value, next_value, reward, done, terminated, mask)
    normed = masked_standardize(adv, mask.unsqueeze(-1))
    assert normed[~mask].abs().max() == 0
    trainable = normed[mask]
    torch.testing.assert_close(trainable.mean(), torch.zeros((), dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(trainable.std(), torch.ones((), dtype=torch.float64), atol=1e-12, rtol=0)
    ones = torch.ones_like(mask).unsqueeze(-1)
    torch.testing.assert_close(masked_standardize(adv, ones), (adv - adv.mean()) / adv.std())


# --- gamma, lmbda, done and terminated are checked --------------------------------------------


@pytest.mark.parametrize(
    "gamma, lmbda, message",
    [
        (-0.1, 0.9, r"gamma must be in \[0, 1\], got -0.1"),
        (1.01, 0.9, r"gamma must be in \[0, 1\], got 1.01"),
        (0.9, math.nan, r"lmbda must be in \[0, 1\], got nan"),
        (0.9, -1.0, r"lmbda must be in \[0, 1\], got -1.0"),
        (0.9, 1.5, r"lmbda must be in \[0, 1\], got 1.5"),
        (torch.full((3,), 0.9), 0.9, r"gamma must be a float or a one-element tensor .* shape \[3\]"),
        (torch.tensor(1.5), 0.9, r"gamma must be in \[0, 1\], got 1.5"),
        ("0.9", 0.9, "gamma must be a float or a one-element tensor, got str"),
        (True, 0.9, "gamma must be a float or a one-element tensor, got bool"),
    ],
)
def test_bad_gamma_or_lmbda_raises(gamma, lmbda, message):
    data = make_rollout(3, 20, seed=0)
    with pytest.raises((ValueError, TypeError), match=message):
        mgae(gamma, lmbda, *data)


def test_one_element_tensor_gamma_equals_float():
    data = make_rollout(3, 20, seed=0)
    expected = mgae(0.75, 0.5, *data)
    got = mgae(torch.tensor([0.75], dtype=torch.float64), torch.tensor(0.5), *data)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_terminated_without_done_raises():
    value, next_value, reward, done, terminated, mask = make_rollout(2, 10, p_done=0.0, seed=0)
    terminated = terminated.clone()
    terminated[1, 4] = True
    with pytest.raises(ValueError, match=r"terminated must imply done: .* 1 step\(s\), the first at index \[1, 4, 0\]"):
        mgae(0.9, 0.9, value, next_value, reward, done, terminated, mask)


@pytest.mark.parametrize("name", ["done", "terminated"])
@pytest.mark.parametrize("bad", [0.5, math.nan, 2.0])
def test_non_binary_done_or_terminated_raises(name, bad):
    value, next_value, reward, done, terminated, mask = make_rollout(2, 10, seed=0)
    flags = {"done": done.double(), "terminated": terminated.double()}
    flags[name][0, 3] = bad
    if name == "terminated":
        flags["done"][0, 3] = 1.0
    with pytest.raises(ValueError, match=rf"{name} must be bool or hold only 0 and 1, got torch.float64 values"):
        mgae(0.9, 0.9, value, next_value, reward, flags["done"], flags["terminated"], mask)


def test_numeric_done_and_terminated_equal_bool():
    data = list(make_rollout(3, 20, seed=4))
    expected = mgae(0.9, 0.9, *data)
    data[3], data[4] = data[3].to(torch.int8), data[4].float()
    got = mgae(0.9, 0.9, *data)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_integer_values_raise():
    values = torch.zeros(1, 3, 1, dtype=torch.int64)
    done = torch.zeros(1, 3, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="state_value must be a floating tensor, got torch.int64"):
        mgae(0.9, 0.9, values, values, values, done, done, torch.ones(1, 3, dtype=torch.bool))


def test_reference_implementation_refuses_autograd_and_unknown_names():
    value, *rest = make_rollout(2, 5, seed=0)
    with pytest.raises(ValueError, match="no gradient"):
        mgae(0.9, 0.8, value.requires_grad_(), *rest, implementation="reference")
    with pytest.raises(ValueError, match="implementation must be one of"):
        mgae(0.9, 0.8, value.detach(), *rest, implementation="numba")
