"""masked_rl.functional under overflow and non-finite values, gradients in gamma and lmbda, and
the hot path's helpers (bitwise selection, run sums, the scan) against plain references.

Every containment test runs on both code paths: without autograd (bitwise selections, NumPy
run sums on the CPU) and with autograd (``torch.where``, ``index_add_``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from masked_gae_reference import make_rollout

from masked_rl import masked_generalized_advantage_estimate as mgae
from masked_rl.functional import (
    _BITWISE_MIN,
    _any,
    _bootstrap,
    _doubling_scan,
    _reverse_linear_scan,
    _run_ends,
    _run_sums,
    _runs,
    _scan_levels,
    _where,
    _zero_where,
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
    clean = mgae(0.99, 1.0, value, next_value, reward, done, terminated, mask)
    lo, hi = (0, 10) if overflowing_episode == 0 else (10, 20)
    # Finite deltas (no reward on masked steps to fold): the sums overflow in the scan itself.
    reward[0, lo:hi] = torch.where(mask[0, lo:hi, None], 1e38, 0.0)
    value.requires_grad_(requires_grad)
    got = mgae(0.99, 1.0, value, next_value, reward, done, terminated, mask)
    outside = torch.ones(2, 30, 1, dtype=torch.bool)
    outside[0, lo:hi] = False
    for want, have in zip(clean, got):
        have = have.detach()
        assert torch.equal(bits(have[outside]), bits(want[outside]))
        assert torch.isinf(have[0, lo:hi][mask[0, lo:hi]]).any()


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
    clean = mgae(gamma, lmbda, *data)
    ids = episode_ids(data[3])
    victim = ids[hits[0][1], hits[0][2]]
    dirty = [x.clone() for x in data]
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
    # Streams long enough for the bitwise selections (small ones use torch.where).
    data = list(make_rollout(4, 8192, p_mask=0.6, p_done=0.01, seed=11, dtype=dtype))
    clean = mgae(0.99, 0.97, *data)
    ids = episode_ids(data[3])
    assert (ids.unsqueeze(-1) >= 0).sum() > _BITWISE_MIN
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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
# torch.where below the threshold, the bitwise kernels above it
@pytest.mark.parametrize("size", [200, _BITWISE_MIN])
def test_bitwise_where_is_torch_where_bit_for_bit(dtype, size):
    gen = torch.Generator().manual_seed(0)
    specials = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0], dtype=dtype)
    a = torch.cat((torch.randn(size, generator=gen).to(dtype), specials))
    b = torch.cat((specials, torch.randn(size, generator=gen).to(dtype)))
    cond = torch.rand(a.numel(), generator=gen) < 0.5
    assert torch.equal(bits(_where(cond, a, b)), bits(torch.where(cond, a, b)))
    assert torch.equal(bits(_where(cond, a, 0.0)), bits(torch.where(cond, a, 0.0)))
    assert torch.equal(bits(_zero_where(cond, a)), bits(torch.where(cond, 0.0, a)))
    with pytest.raises(ValueError, match="other"):
        _where(cond, a, -0.0)


def runs_of(marker):
    """Plain Python: the [start, end] step range of every run (a marker starts a run)."""
    starts = [i for i, flag in enumerate(marker.tolist()) if flag]
    return list(zip(starts, [s - 1 for s in starts[1:]] + [marker.numel() - 1]))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("requires_grad", [False, True])  # NumPy reduceat / index_add_
def test_run_sums_sum_every_run_and_keep_nan_inside_it(seed, requires_grad):
    gen = torch.Generator().manual_seed(seed)
    length = 300
    if seed < 3:  # scattered markers: short blocks, one nonzero over the markers
        marker = torch.rand(length, generator=gen) < [0.05, 0.5, 0.95][seed]
    else:  # agent turns: long blocks of markers, the runs are built block by block
        turn = torch.randint(1, 40, (length,), generator=gen).cumsum(0)
        block = torch.searchsorted(turn, torch.arange(length), right=True)
        marker = block % 2 == 0
        marker[torch.rand(length, generator=gen) < 0.02] = True  # a few lone markers too
    marker[0] = True
    marker[-1] = bool(seed % 2)  # a last run of one step, or longer
    values = torch.randn(length, generator=gen, dtype=torch.float64)
    values[7] = math.nan
    runs = _runs(marker)
    want_runs = runs_of(marker)
    assert list(zip(runs.pos.tolist(), _run_ends(runs).tolist())) == want_runs
    assert runs.longer.tolist() == [j for j, (a, b) in enumerate(want_runs) if b > a]
    assert runs.longer_end.tolist() == [b for a, b in want_runs if b > a]
    some = np.array([0, len(want_runs) // 2, len(want_runs) - 1])
    assert _run_ends(runs, some).tolist() == [want_runs[j][1] for j in some]
    torch_runs = _runs(marker, numpy=False)  # other devices
    assert torch_runs.longer is None
    assert torch.equal(torch_runs.pos, runs.pos) and torch.equal(torch_runs.nxt, _run_ends(runs))
    assert torch_runs.single.tolist() == [a == b for a, b in want_runs]
    assert torch.equal(_runs(marker, numpy=False, count=len(want_runs)).nxt, torch_runs.nxt)
    want = [sum(values[a : b + 1].tolist()) for a, b in want_runs]
    got = _run_sums(values.clone().requires_grad_(requires_grad), marker, runs)
    torch.testing.assert_close(got.detach(), torch.tensor(want, dtype=torch.float64),
                               rtol=1e-12, atol=1e-12, equal_nan=True)
    assert got.isnan().sum() == 1
    by_torch = _run_sums(values, marker, torch_runs)  # index_add_
    torch.testing.assert_close(by_torch, got.detach(), rtol=1e-12, atol=1e-12, equal_nan=True)


def test_runs_take_both_numpy_paths():
    # Blocks of 2 markers on average take the one-nonzero path, blocks of 50 the block path;
    # both must agree with torch's nonzero.
    for size in (2, 50):
        marker = (torch.arange(10_000) // size) % 2 == 0
        mine, torchs = _runs(marker), _runs(marker, numpy=False)
        assert torch.equal(mine.pos, torchs.pos) and torch.equal(_run_ends(mine), torchs.nxt)


@pytest.mark.parametrize("seed", range(4))
def test_bootstrap_reads_the_rule_and_only_it(seed):
    # The CPU fast path (gather, then sparse overwrites) against a plain loop over markers and
    # against the selecting path (taken under autograd), bit for bit, with NaN and inf in V' at
    # steps the rule reads and at steps it must not read.
    gen = torch.Generator().manual_seed(seed)
    length = 400
    end = torch.rand(length, generator=gen) < 0.05
    end[-1] = True
    term = end & (torch.rand(length, generator=gen) < 0.5)
    marker = torch.rand(length, generator=gen) < [0.2, 0.6, 0.9, 1.0][seed]
    marker[0] = True
    marker[1:] |= end[:-1]
    runs = _runs(marker)
    pos, nxt = runs.pos, _run_ends(runs)
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
    by_torch = _bootstrap(next_value, value_c, _runs(marker, numpy=False), last, term)
    assert torch.equal(bits(got), bits(want))
    assert torch.equal(bits(selected.detach()), bits(want))
    assert torch.equal(bits(by_torch), bits(want))
    assert bool(term.any())  # the terminated fix-up is exercised, and the other one
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
def test_fused_and_selecting_scans_agree_bit_for_bit_on_finite_data(dtype):
    # The CPU keeps the fused scan only when it is exact; the fallback must then give the same
    # bits, or a NaN in one episode would move the rounding of every other one.
    gen = torch.Generator().manual_seed(1)
    delta = torch.randn(5000, generator=gen, dtype=torch.float64).to(dtype) * 1e3
    gate = torch.rand(5000, generator=gen) < 0.99
    gate[-1] = False
    levels = [(1 << i, c) for i, c in enumerate(_scan_levels(0.97, 5000, dtype))]
    fused = _doubling_scan(delta, gate, levels, fused=True)
    selected = _doubling_scan(delta, gate, levels, fused=False)
    assert torch.equal(bits(fused), bits(selected))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("tile_bytes", [64, 4096, 16384])
def test_tiled_scan_gives_the_bits_of_the_whole_stream(monkeypatch, fused, tile_bytes):
    # Tiles with a halo (the CPU's cache blocking) against one piece, bit for bit, with episode
    # ends near the tile edges and a last tile shorter than the others. float32 and c = 0.5:
    # 8 levels (c**256 underflows), a halo of 255 steps, tiles of 256 to 1024 steps a thread.
    gen = torch.Generator().manual_seed(tile_bytes)
    length = 5001
    delta = torch.randn(length, generator=gen)
    delta[1234] = 3e38  # the fused pass overflows in one episode: the selecting one is tiled too
    gate = torch.rand(length, generator=gen) < 0.995
    gate[-1] = False
    levels = [(1 << i, c) for i, c in enumerate(_scan_levels(0.5, length, torch.float32))]
    assert levels[-1][0] == 128
    whole = _doubling_scan(delta, gate, levels, fused=fused)
    monkeypatch.setattr("masked_rl.functional._TILE_BYTES", tile_bytes)
    tile = max(256, tile_bytes // (4 * delta.element_size()) * torch.get_num_threads())
    assert tile + 255 < length  # several tiles
    tiled = _doubling_scan(delta, gate, levels, fused=fused)
    assert torch.equal(bits(tiled), bits(whole))
    want = serial_scan(delta.double(), gate, 0.5)
    finite = torch.isfinite(tiled)
    torch.testing.assert_close(tiled[finite].double(), want[finite], rtol=1e-6, atol=1e-6)
    if not fused:  # the selecting scan is exact everywhere: inf where the serial one is inf
        assert torch.equal(finite, torch.isfinite(want.float()) & torch.isfinite(want))
