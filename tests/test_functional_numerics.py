"""masked_rl.functional under overflow and non-finite values, gradients in gamma and lmbda, and
the vectorized path's helpers (runs, run sums, bootstrap, the scan) against plain references.

Every containment test runs on both code paths: without autograd (the CPU's compiled pass) and
with autograd (the vectorized path: ``torch.where``, ``index_add_``, the doubling scan).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from masked_gae_reference import make_rollout

from masked_rl import masked_generalized_advantage_estimate as mgae
from masked_rl._checks import _any
from masked_rl._vectorized import (
    _bootstrap,
    _doubling_scan,
    _reverse_linear_scan,
    _run_sums,
    _runs,
    _scan_levels,
)


def bits(x):
    """A float tensor's bits as integers, so that NaN payloads and -0.0 compare exactly."""
    return x.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[x.element_size()])


def episode_ids(done):
    """``[B, T, 1]`` done -> ``[B, T]`` episode numbers, unique across rows (a row end ends one)."""
    rows, horizon = done.shape[:2]
    ends = done.squeeze(-1).clone()
    ends[:, -1] = True
    starts = torch.cat((torch.ones(rows, 1, dtype=torch.bool), ends[:, :-1]), 1)
    return torch.cumsum(starts.reshape(-1), 0).view(rows, horizon)


# --- issue 10 item 1: overflow stays in its own episode -----------------------------------------


@pytest.mark.parametrize("requires_grad", [False, True])
def test_overflow_in_one_row_leaves_the_other_row_exact(requires_grad):
    # float32, gamma = lmbda = 1: row 1's sums overflow to inf; row 0 must not see a NaN.
    reward = torch.ones(2, 8, 1)
    reward[1] = 2e38
    value = torch.zeros(2, 8, 1, requires_grad=requires_grad)
    done = torch.zeros(2, 8, 1, dtype=torch.bool)
    done[:, -1] = True
    mask = torch.ones(2, 8, dtype=torch.bool)
    adv, target = mgae(1.0, 1.0, value, value.detach(), reward, done, done, mask)
    assert adv[0].flatten().tolist() == [8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]
    assert target[0].flatten().tolist() == [8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]
    assert torch.isinf(adv[1, :-1]).all() and adv[1, -1].item() == pytest.approx(2e38)


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("overflowing_episode", [0, 1])
def test_overflow_in_one_episode_leaves_its_neighbours_bit_identical(
    requires_grad, overflowing_episode
):
    # Three episodes in a row with masked gaps; one overflows inside the scan from finite data.
    value, next_value, reward, done, terminated, mask = make_rollout(2, 30, p_done=0.0, seed=5,
                                                                      dtype=torch.float32)
    done[:, 9] = terminated[:, 9] = done[:, 19] = True
    mask[:] = True
    mask[:, 3:6] = mask[:, 12:14] = False
    value.requires_grad_(requires_grad)  # both runs on one path: the paths round differently
    clean = [x.detach() for x in mgae(0.99, 1.0, value, next_value, reward, done, terminated, mask)]
    lo, hi = (0, 10) if overflowing_episode == 0 else (10, 20)
    # Finite deltas (no reward on masked steps to fold): the sums overflow in the scan itself.
    reward[0, lo:hi] = torch.where(mask[0, lo:hi, None], 1e38, 0.0)
    got = mgae(0.99, 1.0, value, next_value, reward, done, terminated, mask)
    outside = torch.ones(2, 30, 1, dtype=torch.bool)
    outside[0, lo:hi] = False
    for want, have in zip(clean, got):
        have = have.detach()
        assert torch.equal(bits(have[outside]), bits(want[outside]))
        assert torch.isinf(have[0, lo:hi][mask[0, lo:hi]]).any()


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("poison", [math.inf, math.nan])
@pytest.mark.parametrize("gamma, lmbda", [(0.9, 0.0), (0.0, 0.9)])
def test_without_a_carry_a_nonfinite_reward_stays_at_its_action(requires_grad, poison, gamma,
                                                                 lmbda):
    # gamma * lmbda == 0: an advantage is its own one-step delta, and nothing multiplies the
    # next one (0 * inf is NaN). The actions before the poisoned one stay as they were.
    value, next_value, reward, done, terminated, mask = make_rollout(1, 12, p_done=0.0, seed=8)
    mask[:] = True
    value.requires_grad_(requires_grad)
    clean = mgae(gamma, lmbda, value, next_value, reward, done, terminated, mask)[0].detach()
    reward[0, 7] = poison
    adv = mgae(gamma, lmbda, value, next_value, reward, done, terminated, mask)[0].detach()
    assert not torch.isfinite(adv[0, 7]).any()
    others = torch.ones(12, dtype=torch.bool)
    others[7] = False
    assert torch.equal(bits(adv[0, others]), bits(clean[0, others]))


@st.composite
def poisoned_rollouts(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    rows, horizon = draw(st.integers(1, 3)), draw(st.integers(1, 30))
    data = list(make_rollout(rows, horizon, p_mask=draw(st.sampled_from([0.3, 0.7, 1.0])),
                             p_done=draw(st.sampled_from([0.0, 0.2, 0.5])),
                             seed=draw(st.integers(0, 2**31 - 1)), dtype=dtype))
    gamma = draw(st.sampled_from([0.0, 0.5, 0.99, 1.0]))
    lmbda = draw(st.sampled_from([0.0, 0.95, 1.0]))
    finfo = torch.finfo(dtype)
    poison = st.sampled_from([math.nan, math.inf, -math.inf, finfo.max, -finfo.max, finfo.max / 3])
    # (tensor index in data: 0 V, 1 V', 2 reward; row; step; value), at least one.
    hits = draw(st.lists(st.tuples(st.integers(0, 2), st.integers(0, rows - 1),
                                   st.integers(0, horizon - 1), poison), min_size=1, max_size=6))
    # Poison the hits, or flood the episode's actions with large finite rewards, or both.
    mode = draw(st.sampled_from(["poison", "flood", "both"]))
    return gamma, lmbda, data, hits, mode


@settings(max_examples=120, deadline=None)
@given(poisoned_rollouts(), st.booleans())
def test_any_value_in_one_episode_leaves_every_other_episode_bit_identical(case, requires_grad):
    gamma, lmbda, data, hits, mode = case
    data[0] = data[0].requires_grad_(requires_grad)  # both runs on one path
    clean = [x.detach() for x in mgae(gamma, lmbda, *data)]
    ids = episode_ids(data[3])
    victim = ids[hits[0][1], hits[0][2]]
    dirty = [x.detach().clone() for x in data]
    if mode != "poison":  # finite deltas whose sums overflow inside the scan
        in_victim = (ids == victim).unsqueeze(-1)
        large = torch.full_like(dirty[2], torch.finfo(dirty[2].dtype).max / 4)
        flooded = torch.where(data[5].unsqueeze(-1), large, torch.zeros_like(large))
        dirty[2] = torch.where(in_victim, flooded, dirty[2])
    for which, row, step, poison in hits if mode != "flood" else []:
        if ids[row, step] == victim:  # every hit lands in the one victim episode
            dirty[which][row, step] = poison
    dirty[0].requires_grad_(requires_grad)
    got = mgae(gamma, lmbda, *dirty)
    others = (ids != victim).unsqueeze(-1)
    for want, have in zip(clean, got):
        assert torch.equal(bits(have.detach()[others]), bits(want[others]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_stream_keeps_nan_inf_and_overflow_in_their_episodes(dtype):
    # Long rows, many episodes, on the CPU's compiled pass.
    data = list(make_rollout(4, 8192, p_mask=0.6, p_done=0.01, seed=11, dtype=dtype))
    clean = mgae(0.99, 0.97, *data)
    ids = episode_ids(data[3])
    dirty = [x.clone() for x in data]
    victims = ids[:, [100, 5000]].flatten().unique()  # two episodes in every row
    in_victims = torch.isin(ids, victims).unsqueeze(-1)
    large = torch.full_like(dirty[2], torch.finfo(dtype).max / 8)
    dirty[2] = torch.where(in_victims & data[5].unsqueeze(-1), large, dirty[2])
    dirty[0][0, 100] = math.nan
    dirty[1][1, 5000] = math.inf
    got = mgae(0.99, 0.97, *dirty)
    for want, have in zip(clean, got):
        assert torch.equal(bits(have[~in_victims]), bits(want[~in_victims]))
        assert not torch.isfinite(have[in_victims]).all()


# --- issue 10 item 3: gradients with respect to tensor gamma and lmbda --------------------------


@pytest.mark.parametrize("wrt", ["gamma", "lmbda"])
@pytest.mark.parametrize("masked_value_targets", [False, True])
def test_gradient_wrt_gamma_and_lmbda_matches_finite_differences(wrt, masked_value_targets):
    data = make_rollout(2, 15, p_done=0.2, seed=3)
    weights = torch.randn(2, 15, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    point = {"gamma": 0.9, "lmbda": 0.8}

    def objective(gamma, lmbda):
        out = mgae(gamma, lmbda, *data, masked_value_targets=masked_value_targets)
        return (out[0] * weights).sum() + (out[1] * weights).sum()

    tensors = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True)
               for k, v in point.items()}
    objective(**tensors).backward()
    eps = 1e-6
    with torch.no_grad():
        up = objective(**{**point, wrt: point[wrt] + eps})
        down = objective(**{**point, wrt: point[wrt] - eps})
    numeric = float(up - down) / (2 * eps)
    assert tensors[wrt].grad.item() == pytest.approx(numeric, rel=1e-6, abs=1e-8)
    assert numeric != 0.0


def test_tensor_gamma_with_gradient_gives_the_float_values():
    data = make_rollout(3, 40, seed=8)
    want = mgae(0.99, 0.95, *data)
    gamma = torch.tensor(0.99, dtype=torch.float64, requires_grad=True)
    lmbda = torch.tensor([0.95], dtype=torch.float64, requires_grad=True)
    got = mgae(gamma, lmbda, *data)
    for w, g in zip(want, got):
        torch.testing.assert_close(g.detach(), w, rtol=0, atol=1e-12)


# --- the hot path's helpers ----------------------------------------------------------------------


def runs_of(marker):
    """Plain Python: the [start, end] step range of every run (a marker starts a run)."""
    starts = [i for i, flag in enumerate(marker.tolist()) if flag]
    return list(zip(starts, [s - 1 for s in starts[1:]] + [marker.numel() - 1]))


@pytest.mark.parametrize("seed", range(6))
def test_run_sums_sum_every_run_and_keep_nan_inside_it(seed):
    gen = torch.Generator().manual_seed(seed)
    length = 300
    if seed < 3:  # scattered markers
        marker = torch.rand(length, generator=gen) < [0.05, 0.5, 0.95][seed]
    else:  # agent turns: long blocks of markers, and a few lone markers
        turn = torch.randint(1, 40, (length,), generator=gen).cumsum(0)
        block = torch.searchsorted(turn, torch.arange(length), right=True)
        marker = block % 2 == 0
        marker[torch.rand(length, generator=gen) < 0.02] = True
    marker[0] = True
    marker[-1] = bool(seed % 2)  # a last run of one step, or longer
    values = torch.randn(length, generator=gen, dtype=torch.float64)
    values[7] = math.nan
    runs = _runs(marker)
    want_runs = runs_of(marker)
    assert list(zip(runs.pos.tolist(), runs.nxt.tolist())) == want_runs
    static = _runs(marker, count=len(want_runs))  # nonzero_static, no synchronisation
    assert torch.equal(static.pos, runs.pos) and torch.equal(static.nxt, runs.nxt)
    want = [sum(values[a : b + 1].tolist()) for a, b in want_runs]
    got = _run_sums(values, marker, len(want_runs))
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64),
                               rtol=1e-12, atol=1e-12, equal_nan=True)
    assert got.isnan().sum() == 1


@pytest.mark.parametrize("seed", range(4))
def test_bootstrap_reads_the_rule_and_only_it(seed):
    # Against a plain loop over markers, bit for bit, with and without autograd, with NaN and
    # inf in V' at steps the rule reads and at steps it must not read.
    gen = torch.Generator().manual_seed(seed)
    length = 400
    end = torch.rand(length, generator=gen) < 0.05
    end[-1] = True
    term = end & (torch.rand(length, generator=gen) < 0.5)
    marker = torch.rand(length, generator=gen) < [0.2, 0.6, 0.9, 1.0][seed]
    marker[0] = True
    marker[1:] |= end[:-1]
    runs = _runs(marker)
    pos, nxt = runs.pos, runs.nxt
    single = nxt == pos
    last = end.index_select(0, nxt)
    value_c = torch.randn(pos.numel(), generator=gen, dtype=torch.float64)
    next_value = torch.randn(length, generator=gen, dtype=torch.float64)
    next_value[1::3] = math.nan
    next_value[2::7] = math.inf
    want = []
    for j, (p, e) in enumerate(zip(pos.tolist(), nxt.tolist())):
        if term[e]:
            want.append(0.0)
        elif end[e] or p == e:
            want.append(next_value[e].item())
        else:
            want.append(value_c[j + 1].item())
    want = torch.tensor(want, dtype=torch.float64)
    got = _bootstrap(next_value, value_c, runs, last, term)
    selected = _bootstrap(next_value, value_c.clone().requires_grad_(), runs, last, term)
    assert torch.equal(bits(got), bits(want))
    assert torch.equal(bits(selected.detach()), bits(want))
    assert bool(term.any())  # terminated ends are exercised, and runs longer than one step
    assert bool(single.all()) == (seed == 3)  # except on an all-marker stream


def serial_scan(delta, gate, c):
    x = delta.tolist()
    for j in range(len(x) - 2, -1, -1):
        if gate[j]:
            x[j] += c * x[j + 1]
    return torch.tensor(x, dtype=delta.dtype)


@pytest.mark.parametrize("length", [1, 2, 7, 64, 1000])
@pytest.mark.parametrize("c", [0.0, 0.5, 0.95, 1.0])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_reverse_linear_scan_matches_the_serial_recurrence(length, c, requires_grad):
    gen = torch.Generator().manual_seed(length)
    delta = torch.randn(length, generator=gen, dtype=torch.float64)
    gate = torch.rand(length, generator=gen) < 0.9
    gate[-1] = False
    delta_in, gate_in = delta.clone().requires_grad_(requires_grad), gate.clone()
    got = _reverse_linear_scan(delta_in, gate_in, _scan_levels(c, length, torch.float64))
    torch.testing.assert_close(got.detach(), serial_scan(delta, gate, c), rtol=1e-12, atol=1e-12)
    assert torch.equal(delta_in.detach(), delta) and torch.equal(gate_in, gate)  # inputs untouched


def test_any_of_bool_flags():
    flags = torch.zeros(3, 1000, dtype=torch.bool)
    assert not _any(flags) and not _any(flags[:, :0]) and _any(flags).shape == ()
    flags[2, 999] = True
    assert _any(flags) and _any(flags.t()) and _any(flags[2:, None].expand(2, 4, 1000))
    assert not _any(flags[:2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_doubling_scan_keeps_inf_and_nan_in_their_episodes(dtype):
    # The selecting scan (no autograd): inf and NaN exactly where the serial scan has them (the
    # steps of their episode up to them), and the serial scan's values elsewhere. c = 0.5:
    # 8 levels in float32, windows of 256 steps, longer than any episode here.
    gen = torch.Generator().manual_seed(3)
    length = 5001
    delta = torch.randn(length, generator=gen, dtype=dtype)
    delta[1234], delta[3050] = math.inf, math.nan
    gate = torch.rand(length, generator=gen) < 0.98
    gate[199::200] = False  # episodes of at most 200 steps
    gate[-1] = False
    levels = [(1 << i, c) for i, c in enumerate(_scan_levels(0.5, length, dtype))]
    got = _doubling_scan(delta, gate, levels)
    want = serial_scan(delta, gate, 0.5)
    assert int(torch.isinf(want).sum()) > 1 and int(torch.isnan(want).sum()) > 1
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = torch.isfinite(got)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5)
