"""The opt-in extension "value targets at masked steps" (``masked_value_targets=True``)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from masked_gae_reference import make_rollout, serial_masked_value_targets_batch

from masked_rl import masked_generalized_advantage_estimate as mgae


def row(mask, reward, *, done_at=(), terminated=True, value=None, next_value=None):
    """One ``[1, T, 1]`` float64 row ending at its last step (and at ``done_at``)."""
    horizon = len(mask)
    as_row = lambda x: torch.tensor(x, dtype=torch.float64).view(1, horizon, 1)
    zeros = [0.0] * horizon
    done = torch.zeros(1, horizon, 1, dtype=torch.bool)
    done[0, -1] = True
    for t in done_at:
        done[0, t] = True
    return (
        as_row(zeros if value is None else value),
        as_row(zeros if next_value is None else next_value),
        as_row(reward),
        done,
        done & terminated,
        torch.tensor([mask], dtype=torch.bool),
    )


def test_spec_worked_case():
    # gamma 0.9, lmbda 1, V = 0: trainable steps 0 and 4, reward 1 at step 2 and 10 at step 6.
    data = row([1, 0, 0, 0, 1, 0, 0], [0, 0, 1.0, 0, 0, 0, 10.0])
    adv, target, has_target = mgae(0.9, 1.0, *data, masked_value_targets=True)
    expected = [10.0, 10.0 + 1.0 / 0.9, 10.0 + 1.0 / 0.9, 10.0, 10.0, 10.0 / 0.9, 10.0 / 0.9]
    torch.testing.assert_close(target.view(-1), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    assert has_target.all()
    # Advantages are those of the main definition.
    torch.testing.assert_close(adv, mgae(0.9, 1.0, *data)[0], rtol=0, atol=0)
    # Cutting the row after step 1 and bootstrapping from the target of step 2 gives A[0] as uncut.
    value, next_value, reward, done, terminated, mask = data
    cut_next = next_value[:, :2].clone()
    cut_next[0, 1] = target[0, 2]
    cut = mgae(0.9, 1.0, value[:, :2], cut_next, reward[:, :2], torch.zeros_like(done[:, :2]),
               torch.zeros_like(done[:, :2]), mask[:, :2])[0]
    assert math.isclose(cut[0, 0, 0].item(), 10.0, rel_tol=0, abs_tol=1e-12)


def test_tail_targets_terminated_and_truncated():
    # Trainable step 1, a masked tail with rewards 1 and 2; truncated: bootstrap V'[e] = 5.
    for terminated, bootstrap in ((True, 0.0), (False, 5.0)):
        data = row([0, 1, 0, 0], [0, 0, 1.0, 2.0], terminated=terminated, next_value=[0, 0, 0, 5.0])
        _, target, has_target = mgae(0.5, 0.5, *data, masked_value_targets=True)
        expected_tail = [(1.0 + 2.0) / 0.5 + bootstrap, 2.0 / 0.5 + bootstrap]
        assert target.view(-1)[2:].tolist() == pytest.approx(expected_tail, abs=1e-12)
        # The prompt step before the first action: G(t_1) plus its own (dropped) reward, none here.
        assert target[0, 0, 0].item() == pytest.approx(target[0, 1, 0].item(), abs=1e-12)
        assert has_target.all()


def test_gamma_zero_omits_reward_terms():
    data = row([0, 1, 0, 1, 0], [3.0, 1.0, 2.0, 4.0, 5.0], terminated=False, next_value=[0, 0, 0, 0, 7.0])
    _, target, _ = mgae(0.0, 0.0, *data, masked_value_targets=True)
    # G at trainable steps: 1 + 2 = 3 and 4 + 5 = 9; masked steps: the next G, the tail V'[e] = 7.
    assert target.view(-1).tolist() == [3.0, 3.0, 9.0, 9.0, 7.0]


def test_episode_without_trainable_step_carries_no_target():
    data = row([0, 0, 0, 1, 0], [9.0, 9.0, 9.0, 1.0, 0.0], done_at=(2,))
    adv, target, has_target = mgae(0.9, 0.9, *data, masked_value_targets=True)
    assert has_target.view(-1).tolist() == [False, False, False, True, True]
    assert target.view(-1)[:3].tolist() == [0.0, 0.0, 0.0]
    assert adv.view(-1)[:3].tolist() == [0.0, 0.0, 0.0]


@st.composite
def rollouts(draw):
    batch = draw(st.integers(1, 3))
    horizon = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    p_mask = draw(st.sampled_from([0.0, 0.1, 0.3, 0.7, 1.0]))
    p_done = draw(st.sampled_from([0.0, 0.1, 0.3]))
    gamma = draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))
    lmbda = draw(st.sampled_from([0.0, 0.9, 1.0]))
    consistent = draw(st.booleans())  # V' != V[t + 1] too (rule 2 at adjacent actions)
    return gamma, lmbda, make_rollout(batch, horizon, p_mask=p_mask, p_done=p_done, seed=seed,
                                      consistent=consistent)


@settings(max_examples=120, deadline=None)
@given(rollouts())
def test_matches_serial_reference(case):
    gamma, lmbda, data = case
    ref_target, ref_has = serial_masked_value_targets_batch(gamma, lmbda, *data)
    for implementation in ("reference", "auto"):
        adv, target, has_target = mgae(gamma, lmbda, *data, masked_value_targets=True,
                                       implementation=implementation)
        torch.testing.assert_close(target, ref_target, rtol=0, atol=1e-10)
        assert torch.equal(has_target, ref_has)
    plain_adv, plain_target = mgae(gamma, lmbda, *data)
    assert torch.equal(adv, plain_adv)
    mask = data[-1].unsqueeze(-1)
    assert torch.equal(target[mask], plain_target[mask])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([0.5, 0.9, 0.99, 1.0]), st.sampled_from([0.1, 0.3, 0.6]),
       st.booleans())
def test_cutting_a_row_anywhere_keeps_trainable_advantages(seed, gamma, p_mask, learned_everywhere):
    """With lmbda = 1 and the critic equal to its targets, a cut changes no trainable advantage.

    Cutting the row after step ``c`` turns ``c`` into a row end that bootstraps from
    ``V*[c + 1]``, the critic's value of the observation after the cut; the first part's and
    the second part's trainable advantages must equal the uncut row's. The targets do not
    depend on ``V`` here (lmbda = 1, terminated episodes), so ``V*`` is a fixed point.
    ``learned_everywhere``: ``V*`` equals the targets at every step and any cut is allowed.
    Otherwise ``V*`` keeps arbitrary values at trainable steps (the uncut advantages are then
    not zero) and the cuts are those inside masked blocks, which the extension is for.
    """
    value, next_value, reward, done, _, mask = make_rollout(1, 30, p_mask=p_mask, p_done=0.08, seed=seed)
    done[0, -1] = True
    terminated = done.clone()
    _, target, has_target = mgae(gamma, 1.0, value, next_value, reward, done, terminated, mask,
                                 masked_value_targets=True)
    learned = has_target if learned_everywhere else has_target & ~mask.unsqueeze(-1)
    critic = torch.where(learned, target, value)
    next_critic = torch.cat((critic[:, 1:], torch.zeros_like(critic[:, :1])), 1)
    uncut = mgae(gamma, 1.0, critic, next_critic, reward, done, terminated, mask)[0]
    for c in range(29):
        if done[0, c] or not (learned_everywhere or not mask[0, c + 1]):
            continue
        first = [x[:, : c + 1] for x in (critic, next_critic, reward, done, terminated, mask)]
        second = [x[:, c + 1 :] for x in (critic, next_critic, reward, done, terminated, mask)]
        a_first = mgae(gamma, 1.0, *first)[0]
        a_second = mgae(gamma, 1.0, *second)[0]
        torch.testing.assert_close(torch.cat((a_first, a_second), 1), uncut, rtol=0, atol=1e-9)


def test_a_cut_without_masked_targets_changes_advantages():
    """The control: bootstrapping a cut inside a masked block from an untrained value is wrong."""
    data = row([1, 0, 0, 0, 1, 0, 0], [0, 0, 1.0, 0, 0, 0, 10.0])
    value, next_value, reward, done, terminated, mask = data
    uncut = mgae(0.9, 1.0, *data)[0]
    cut = mgae(0.9, 1.0, value[:, :2], next_value[:, :2], reward[:, :2], torch.zeros_like(done[:, :2]),
               torch.zeros_like(done[:, :2]), mask[:, :2])[0]
    assert uncut[0, 0, 0].item() == pytest.approx(10.0) and cut[0, 0, 0].item() == 0.0


@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_nonfinite_reward_stays_in_its_episode(poison):
    value, next_value, reward, done, terminated, mask = make_rollout(2, 24, p_done=0.0, p_mask=0.3, seed=3)
    done[:, 11] = terminated[:, 11] = True
    mask[0, 2] = mask[0, 14] = True
    clean = mgae(0.9, 0.9, value, next_value, reward, done, terminated, mask, masked_value_targets=True)
    reward[0, 16] = poison  # second episode of row 0
    dirty = mgae(0.9, 0.9, value, next_value, reward, done, terminated, mask, masked_value_targets=True)
    keep = torch.ones(2, 24, 1, dtype=torch.bool)
    keep[0, 12:] = False
    for a, b in zip(clean, dirty):
        assert torch.equal(a[keep], b[keep])


def test_values_at_masked_steps_do_not_matter():
    value, next_value, reward, done, terminated, mask = make_rollout(3, 30, p_mask=0.4, seed=8)
    clean = mgae(0.9, 0.8, value, next_value, reward, done, terminated, mask, masked_value_targets=True)
    poisoned = torch.where(mask.unsqueeze(-1), value, torch.full_like(value, math.nan))
    dirty = mgae(0.9, 0.8, poisoned, next_value, reward, done, terminated, mask, masked_value_targets=True)
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)


def test_shapes_dtypes_time_dim_and_gradients():
    value, next_value, reward, done, terminated, mask = make_rollout(2, 15, seed=5)
    adv, target, has_target = mgae(0.9, 0.9, value, next_value, reward, done, terminated, mask,
                                   masked_value_targets=True)
    assert has_target.dtype == torch.bool and has_target.shape == value.shape
    moved = [x.movedim(1, 0) for x in (value, next_value, reward, done, terminated, mask)]
    adv_t, target_t, has_t = mgae(0.9, 0.9, *moved, time_dim=0, masked_value_targets=True)
    assert torch.equal(target_t.movedim(0, 1), target) and torch.equal(has_t.movedim(0, 1), has_target)
    low = mgae(0.9, 0.9, *(x.half() if x.is_floating_point() else x for x in (value, next_value, reward, done,
                                                                               terminated, mask)),
               masked_value_targets=True)
    assert low[1].dtype == torch.float16
    empty = mgae(0.9, 0.9, *(x[:, :0] for x in (value, next_value, reward, done, terminated, mask)),
                 masked_value_targets=True)
    assert [x.shape for x in empty] == [(2, 0, 1)] * 3
    reward = reward.clone().requires_grad_(True)
    _, target, _ = mgae(0.9, 0.9, value, next_value, reward, done, terminated, mask, masked_value_targets=True)
    target.sum().backward()
    assert torch.isfinite(reward.grad).all()
