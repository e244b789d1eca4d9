"""Checks that run inside a spawned gloo world (4 CPU processes), for tests/test_distributed.py.

Spawning is slow, so one world runs every case: the test module spawns it once and asserts on
what each rank recorded. Process groups of 2 ([1, 3]), 3 ([0, 2, 3]) and 4 (the world, passed as
``None``) cover world sizes 2, 3 and 4 and group ranks that differ from global ranks. Every case
is generated from a seed, identically on every rank, and compared on every rank with the
single-process function on the full rows.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from masked_gae_reference import make_rollout
from masked_rl_benchmarks.cp import count_collectives

from masked_rl import masked_generalized_advantage_estimate, masked_standardize
from masked_rl.distributed import (
    cp_all_gather,
    cp_chunk_lengths,
    cp_masked_generalized_advantage_estimate,
    cp_shard,
)

WORLD = 4
GROUP_RANKS = {2: [1, 3], 3: [0, 2, 3], 4: list(range(WORLD))}
LAYOUTS = ("contiguous", "zigzag")
DISCOUNTS = ((0.9, 0.8), (0.0, 0.0), (1.0, 1.0), (0.5, 0.0), (0.99, 0.95), (0.0, 1.0))
ATOL = 1e-10
TIMEOUT_S = 60  # a collective that waits longer raises (a hang fails the test instead)


class Recorder:
    """Cases run and failures, per check key (``"check/world/layout"``)."""

    def __init__(self):
        self.cases = defaultdict(int)
        self.failures = defaultdict(list)
        self.info = {}

    def case(self, key: str, name: str, fn):
        self.cases[key] += 1
        try:
            fn()
        except Exception:  # noqa: BLE001 - recorded and asserted on by the test
            self.failures[key].append(f"{name}: {traceback.format_exc(limit=3)}")
            # Also now: a later abort in gloo would lose the recorded failures.
            print(key, name, traceback.format_exc(), file=sys.stderr)


def _assert_equal(got, expected, *, atol=ATOL, name=""):
    assert got.shape == expected.shape, f"{name} shape {list(got.shape)} != {list(expected.shape)}"
    assert got.dtype == expected.dtype, f"{name} dtype {got.dtype} != {expected.dtype}"
    if got.dtype == torch.bool:
        assert torch.equal(got, expected), f"{name} differs at {(got != expected).nonzero()[:5].tolist()}"
        return
    same_nonfinite = torch.equal(torch.isnan(got), torch.isnan(expected)) and torch.equal(
        torch.isinf(got), torch.isinf(expected)
    )
    assert same_nonfinite, f"{name}: NaN/inf pattern differs"
    finite = torch.isfinite(expected)
    err = (got[finite].double() - expected[finite].double()).abs().max().item() if finite.any() else 0.0
    assert err <= atol, f"{name}: max abs error {err:.3e} > {atol:.0e}"


def run_cp(data, *, gamma, lmbda, n, rank, group, layout, lengths=None, masked_value_targets=False,
           time_dim=-2, next_from_row=False):
    """CP outputs on the rank's slice, and the rank's slice of the single-process outputs."""
    value, next_value, reward, done, terminated, mask = data
    mask_dim = time_dim if time_dim >= 0 else time_dim + 1  # the mask has no feature dim
    full = masked_generalized_advantage_estimate(
        gamma, lmbda, *data, time_dim=time_dim, masked_value_targets=masked_value_targets
    )
    if lengths is None:
        lengths = cp_chunk_lengths(value.shape[time_dim], n, layout)
    shard = lambda x, dim=time_dim: cp_shard(x, rank, n, layout=layout, time_dim=dim, chunk_lengths=lengths)
    local = [shard(x) for x in (value, next_value, reward, done, terminated)] + [shard(mask, mask_dim)]
    if next_from_row:  # the caller's V' is then the row's V shifted (checked by the caller)
        local[1] = None
    got = cp_masked_generalized_advantage_estimate(
        gamma, lmbda, *local, time_dim=time_dim, masked_value_targets=masked_value_targets,
        group=group, layout=layout, chunk_lengths=lengths,
    )
    return got, tuple(shard(f) for f in full)


def check_outputs(got, expected, *, atol=ATOL):
    assert len(got) == len(expected)
    for name, g, f in zip(("advantage", "value_target", "value_target_mask"), got, expected):
        _assert_equal(g, f, atol=atol, name=name)


def compare(data, *, atol=ATOL, **kwargs):
    """:func:`run_cp`, then every output checked. Raising only after the collective keeps the
    ranks in step when a check fails on some of them."""
    got, expected = run_cp(data, **kwargs)
    check_outputs(got, expected, atol=atol)
    return got


def random_lengths(horizon, chunks, generator):
    """Uneven chunk lengths with empty chunks likely: ``chunks - 1`` sorted cut points."""
    cuts = sorted(torch.randint(0, horizon + 1, (chunks - 1,), generator=generator).tolist())
    bounds = [0, *cuts, horizon]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def rows_from_masks(masks, *, dones=(), truncated=(), seed=0, reward=None):
    """``[B, T, 1]`` float64 rows for given 0/1 masks, with episode ends at ``dones`` (b, t)
    (terminated) and ``truncated`` (b, t); random values, rewards everywhere unless given."""
    mask = torch.tensor(masks, dtype=torch.bool)
    batch, horizon = mask.shape
    value, next_value, rew, _, _, _ = make_rollout(batch, horizon, seed=seed)
    done = torch.zeros(batch, horizon, 1, dtype=torch.bool)
    terminated = torch.zeros_like(done)
    for b, t in dones:
        done[b, t] = terminated[b, t] = True
    for b, t in truncated:
        done[b, t] = True
    if reward is not None:
        rew = torch.tensor(reward, dtype=torch.float64).view(batch, horizon, 1)
    return value, next_value, rew, done, terminated, mask


# --- checks: each runs the cases of one world size and layout ------------------------------------


def check_random_rows(rec, key, n, rank, group, layout):
    """Random multi-episode rows, default and random (empty-prone) chunk lengths."""
    chunks = n if layout == "contiguous" else 2 * n
    for seed in range(24):
        g = torch.Generator().manual_seed(1000 * n + seed)
        horizon = int(torch.randint(1, 48, (1,), generator=g))
        p_mask = (0.05, 0.3, 0.6, 0.95)[seed % 4]
        p_done = (0.0, 0.05, 0.2, 0.5)[(seed // 4) % 4]
        data = make_rollout(3, horizon, p_mask=p_mask, p_done=p_done, seed=seed,
                            consistent=bool(seed % 2))
        gamma, lmbda = DISCOUNTS[seed % len(DISCOUNTS)]
        lengths = random_lengths(horizon, chunks, g) if seed % 3 == 0 else None
        for mvt in (False, True):
            rec.case(key, f"seed={seed} T={horizon} lengths={lengths} mvt={mvt}", lambda: compare(
                data, gamma=gamma, lmbda=lmbda, n=n, rank=rank, group=group, layout=layout,
                lengths=lengths, masked_value_targets=mvt))


def check_structured_rows(rec, key, n, rank, group, layout):
    """Fully masked slices and rows, ends at slice borders, reward tails over several ranks."""
    chunks = n if layout == "contiguous" else 2 * n
    horizon = 4 * chunks + 3  # uneven: some chunks one step longer
    lengths = cp_chunk_lengths(horizon, n, layout)
    starts = [sum(lengths[:k]) for k in range(chunks)]
    ends = [s + length - 1 for s, length in zip(starts, lengths)]
    rows = {
        # One action at the start, every other step masked with a reward: the tail (and its
        # rewards) crosses every rank; truncated at the row end, terminated mid-row, and a row
        # that has no action at all.
        "tail_truncated": ([[1] + [0] * (horizon - 1)], [], []),
        "tail_terminated_mid": ([[1] + [0] * (horizon - 1)], [(0, horizon - 2)], []),
        "fully_masked_row": ([[0] * horizon], [], []),
        # Episode ends exactly on the last step of each chunk, and on the first step of each.
        "ends_at_chunk_ends": ([[int(t % 3 == 1) for t in range(horizon)]], [(0, e) for e in ends[:-1]], []),
        "ends_at_chunk_starts": ([[int(t % 2 == 0) for t in range(horizon)]], [(0, s) for s in starts[1:]], []),
        "truncated_at_chunk_ends": ([[0, 1] * (horizon // 2) + [0] * (horizon % 2)], [], [(0, e) for e in ends]),
        # Actions only on the first and last step of each chunk (adjacent across borders).
        "actions_at_borders": ([[int(t in starts or t in ends) for t in range(horizon)]], [], []),
        # Only the last step of the row is an action; only the first.
        "last_step_only": ([[0] * (horizon - 1) + [1]], [], []),
    }
    # Row q: the whole slice of rank q masked, every other step trainable.
    positions = torch.arange(horizon).view(1, horizon, 1)
    held = [set(cp_shard(positions, q, n, layout=layout).view(-1).tolist()) for q in range(n)]
    rows["rank_slice_masked"] = ([[int(t not in held[q]) for t in range(horizon)] for q in range(n)], [], [])
    for seed_offset, (name, (masks, dones, truncated)) in enumerate(sorted(rows.items())):
        data = rows_from_masks(masks, dones=dones, truncated=truncated, seed=seed_offset)
        for gamma, lmbda in ((0.9, 0.8), (0.0, 0.0), (1.0, 1.0)):
            for mvt in (False, True):
                rec.case(key, f"{name} gamma={gamma} mvt={mvt}", lambda: compare(
                    data, gamma=gamma, lmbda=lmbda, n=n, rank=rank, group=group, layout=layout,
                    masked_value_targets=mvt))
    # Masked slices and empty chunks in every position (one row per chunk fully masked).
    batch = chunks
    masks = [[int(not (starts[c] <= t <= ends[c])) for t in range(horizon)] for c in range(batch)]
    data = rows_from_masks(masks, dones=[(b, 5) for b in range(batch)], seed=7)
    for mvt in (False, True):
        rec.case(key, f"one_chunk_masked_per_row mvt={mvt}", lambda: compare(
            data, gamma=0.9, lmbda=0.8, n=n, rank=rank, group=group, layout=layout,
            masked_value_targets=mvt))
    # More ranks than steps: most chunks empty.
    for horizon in (1, 2, 3):
        data = make_rollout(2, horizon, p_mask=0.5, p_done=0.3, seed=horizon)
        for mvt in (False, True):
            rec.case(key, f"T={horizon} mvt={mvt}", lambda: compare(
                data, gamma=0.9, lmbda=0.8, n=n, rank=rank, group=group, layout=layout,
                masked_value_targets=mvt))


def check_shapes_and_dtypes(rec, key, n, rank, group, layout):
    """``[T, B, F]`` with ``time_dim=0`` and ``F = 2``; float32 and bfloat16."""
    value, next_value, reward, done, terminated, mask = make_rollout(6, 21, p_done=0.1, seed=5)
    as_tbf = lambda x: x.view(3, 2, 21).permute(2, 0, 1)  # [T, B=3, F=2]
    data = [as_tbf(x) for x in (value, next_value, reward, done, terminated)]
    data.append(mask.view(3, 2, 21).permute(2, 0, 1)[..., :1])  # [T, B, 1]
    for mvt in (False, True):
        rec.case(key, f"time_dim=0 mvt={mvt}", lambda: compare(
            data, gamma=0.9, lmbda=0.8, n=n, rank=rank, group=group, layout=layout, time_dim=0,
            masked_value_targets=mvt))
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 0.07)):
        data = make_rollout(3, 30, p_done=0.1, seed=6, dtype=dtype)
        rec.case(key, f"{dtype}", lambda: compare(
            data, gamma=0.9, lmbda=0.8, n=n, rank=rank, group=group, layout=layout, atol=atol))


def check_issue_two_rank_case(rec, key, n, rank, group, layout):
    """Issue 8's reference case: mask [1, 1, 0, 0, 1, 0], terminal reward on the last action."""
    data = rows_from_masks([[1, 1, 0, 0, 1, 0]], dones=[(0, 5)], reward=[[0, 0, 0, 0, 1.0, 0]])
    data = (torch.zeros_like(data[0]), torch.zeros_like(data[1]), *data[2:])
    expected = {(0.0, 0.0): [0, 0, 0, 0, 1.0, 0], (0.9, 0.8): [0.72 ** 2, 0.72, 0, 0, 1.0, 0]}
    for (gamma, lmbda), advantage in expected.items():
        def case():
            got = compare(data, gamma=gamma, lmbda=lmbda, n=n, rank=rank, group=group, layout=layout)
            want = cp_shard(torch.tensor(advantage, dtype=torch.float64).view(1, 6, 1), rank, n, layout=layout)
            _assert_equal(got[0], want, atol=1e-12, name="advantage")
        rec.case(key, f"gamma={gamma} lmbda={lmbda}", case)


def check_non_finite_isolation(rec, key, n, rank, group, layout):
    """NaN / inf at masked steps of one rank (V, V' except at truncated ends, dropped rewards)."""
    value, next_value, reward, done, terminated, mask = make_rollout(4, 37, p_mask=0.4, p_done=0.08, seed=11)
    for poisoned_rank in range(n):
        for poison in (math.nan, math.inf, -math.inf):
            for mvt in (False, True):
                owner = cp_shard(torch.arange(37).view(1, 37, 1), poisoned_rank, n, layout=layout).view(-1)
                on_rank = torch.zeros(37, dtype=torch.bool)
                on_rank[owner] = True
                at = (~mask).unsqueeze(-1) & on_rank.view(1, 37, 1)
                bootstrap = done & ~terminated
                bootstrap[:, -1] = ~terminated[:, -1]
                bad = [torch.where(at, poison, value), torch.where(at & ~bootstrap, poison, next_value)]
                # Rewards before an episode's first action are dropped (advantages only: the
                # masked-step value targets of their own run do read them).
                first_action_before = _dropped_reward_steps(done, mask)
                bad_reward = reward if mvt else torch.where(at & first_action_before, poison, reward)

                def case():
                    common = dict(gamma=0.9, lmbda=0.8, n=n, rank=rank, group=group, layout=layout,
                                  masked_value_targets=mvt)
                    clean, _ = run_cp((value, next_value, reward, done, terminated, mask), **common)
                    dirty, expected = run_cp((*bad, bad_reward, done, terminated, mask), **common)
                    check_outputs(dirty, expected)
                    for c, d in zip(clean, dirty):
                        assert torch.equal(c, d), "outputs changed by NaN/inf at masked steps"
                    assert all(torch.isfinite(d).all() for d in dirty[:2])
                rec.case(key, f"rank={poisoned_rank} poison={poison} mvt={mvt}", case)


def _dropped_reward_steps(done, mask):
    """Masked steps before their episode's first action ([B, T, 1] bool)."""
    batch, horizon = mask.shape
    out = torch.zeros(batch, horizon, 1, dtype=torch.bool)
    for b in range(batch):
        seen = False
        for t in range(horizon):
            if mask[b, t]:
                seen = True
            out[b, t, 0] = not seen
            if done[b, t, 0]:
                seen = False
    return out


def check_communication(rec, key, n, rank, group, layout):
    """One collective per call up to 64 rows x chunks, two beyond; bytes that do not grow with T."""
    measured = {}
    chunks = 1 if layout == "contiguous" else 2
    for batch in (4, 70):
        for horizon in (64, 1024, 16384):
            for mvt in (False, True):
                data = make_rollout(batch, horizon, p_mask=0.3, p_done=0.01, seed=horizon)
                with count_collectives() as calls:
                    run_cp(data, gamma=0.9, lmbda=0.8, n=n, rank=rank, group=group, layout=layout,
                           masked_value_targets=mvt)
                measured[(batch, horizon, mvt)] = list(calls)

    def case():
        for (batch, horizon, mvt), made in measured.items():
            # The header and summaries of up to 64 rows x chunks in one all_gather (20 + 640
            # float64 numbers); beyond, then 10 float64 numbers per row and chunk.
            expected = [("all_gather_single", ONE_CALL_BYTES)]
            if batch * chunks > 64:
                expected.append(("all_gather_single", 10 * batch * chunks * 8))
            assert made == expected, f"B={batch} T={horizon} mvt={mvt}: calls {made}, expected {expected}"
        rec.info[key] = measured[(4, 64, False)]
    rec.case(key, "collectives", case)


ONE_CALL_BYTES = (20 + 640) * 8


def check_errors(rec, key, n, rank, group, layout):
    """Ranks disagreeing on chunk lengths and a differentiable input raise on every rank."""
    data = make_rollout(2, 12, seed=3)

    def disagree():
        # Without chunk_lengths each rank assumes the even split of its own length; rank 0 holds
        # more steps than the others, so every rank sees the disagreement in the gathered lengths.
        local_len = (4 if rank == 0 else 3) * (1 if layout == "contiguous" else 2)
        local = [x[:, :local_len] for x in data[:5]] + [data[5][:, :local_len]]
        try:
            cp_masked_generalized_advantage_estimate(0.9, 0.8, *local, group=group, layout=layout)
        except ValueError as error:
            assert "disagree on the chunk lengths" in str(error), str(error)
        else:
            raise AssertionError("no error for ranks disagreeing on chunk lengths")
    rec.case(key, "disagreeing chunk lengths", disagree)

    def differentiable():
        local = [cp_shard(x, rank, n, layout=layout) for x in data[:5]]
        local.append(cp_shard(data[5], rank, n, layout=layout, time_dim=-1))
        local[0] = local[0].clone().requires_grad_()
        try:
            cp_masked_generalized_advantage_estimate(0.9, 0.8, *local, group=group, layout=layout)
        except RuntimeError as error:
            assert "not differentiable" in str(error)
        else:
            raise AssertionError("no error for an input requiring grad")
    rec.case(key, "requires_grad", differentiable)


def check_all_gather_round_trip(rec, key, n, rank, group, layout):
    """cp_shard then cp_all_gather gives the full rows back, even and uneven."""
    for horizon in (8 * n, 8 * n + 3, 1):
        full = torch.randn(2, horizon, 3, generator=torch.Generator().manual_seed(horizon))
        def case():
            local = cp_shard(full, rank, n, layout=layout)
            lengths = cp_chunk_lengths(horizon, n, layout)
            inferred = cp_all_gather(local, group, layout=layout)
            stated = cp_all_gather(local, group, layout=layout, chunk_lengths=lengths)
            assert torch.equal(inferred, full) and torch.equal(stated, full)
        rec.case(key, f"T={horizon}", case)


def check_data_parallel_standardize(rec, key, n, rank, group, layout):
    """masked_standardize over a DP group equals it on the concatenated batches."""
    if layout != "contiguous":
        return  # independent of the CP layout: run once per group
    g = torch.Generator().manual_seed(n)
    advantages = [torch.randn(3, 10, 1, generator=g, dtype=torch.float64) * 0.01 + 1e6 for _ in range(n)]
    masks = [torch.rand(3, 10, generator=g) < 0.5 for _ in range(n)]
    masks[-1].zero_()  # a rank with no trainable step
    advantages[0][~masks[0]] = math.nan  # NaN at masked steps stays out of the statistics
    me = rank

    def case():
        # group=None means "no communication" here: the world is passed explicitly.
        dp_group = dist.group.WORLD if group is None else group
        got = masked_standardize(advantages[me], masks[me].to(torch.int8), group=dp_group)
        expected = masked_standardize(torch.cat(advantages), torch.cat(masks))
        _assert_equal(got, expected[3 * me: 3 * me + 3], atol=1e-6, name="standardized")
        assert (got[~masks[me]] == 0).all()
    rec.case(key, "dp", case)


def rollout_td(batch, horizon, *, seed, obs_dim=3):
    """A ``[B, T]`` TensorDict rollout with observations (for a critic) and precomputed values."""
    from tensordict import TensorDict

    value, next_value, reward, done, terminated, mask = make_rollout(batch, horizon, seed=seed)
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(batch, horizon + 1, obs_dim, generator=g, dtype=torch.float64)
    return TensorDict({
        "observation": obs[:, :-1], "loss_mask": mask.to(torch.int8), "state_value": value,
        "action": torch.randint(4, (batch, horizon), generator=g),
        "action_log_prob": torch.randn(batch, horizon, generator=g, dtype=torch.float64) - 1.4,
        "next": {"observation": obs[:, 1:], "reward": reward, "done": done,
                 "terminated": terminated, "state_value": next_value},
    }, batch_size=[batch, horizon])


def actor_critic(seed=0):
    from tensordict.nn import TensorDictModule
    from torchrl.modules import ProbabilisticActor, ValueOperator

    torch.manual_seed(seed)
    actor = ProbabilisticActor(
        TensorDictModule(torch.nn.Linear(3, 4).double(), ["observation"], ["logits"]),
        in_keys=["logits"], distribution_class=torch.distributions.Categorical, return_log_prob=True)
    critic = ValueOperator(torch.nn.Linear(3, 1).double(), in_keys=["observation"])
    return actor, critic


def check_modules(rec, key, n, rank, group, layout):
    """MaskedGAE(cp_group=...) and MaskedClipPPOLoss(cp_group=...) on a rank's slice."""

    from masked_rl import MaskedClipPPOLoss, MaskedGAE, attach_masked_gae

    group = dist.group.WORLD if group is None else group  # None means "no CP" for the modules
    horizon = 5 * n + 2
    lengths = cp_chunk_lengths(horizon, n, layout)
    shard = lambda td: cp_shard(td, rank, n, layout=layout, time_dim=1, chunk_lengths=lengths)
    full = rollout_td(3, horizon, seed=n)
    keys = ("advantage", "value_target", "value_target_mask")
    for average_gae in (False, True):
        for mvt in (False, True):
            for with_critic in (False, True):
                critic = actor_critic()[1] if with_critic else None
                options = dict(gamma=0.9, lmbda=0.8, value_network=critic, average_gae=average_gae,
                               masked_value_targets=mvt)
                expected = shard(MaskedGAE(**options)(full.clone()))
                got = MaskedGAE(**options, cp_group=group, cp_layout=layout,
                                cp_chunk_lengths=lengths)(shard(full.clone()))

                def case():
                    for name in keys[: 3 if mvt else 2]:
                        _assert_equal(got[name], expected[name], name=name)
                rec.case(key, f"MaskedGAE average_gae={average_gae} mvt={mvt} critic={with_critic}", case)

    # The loss: the estimator under CP, then normalize_advantage over the CP group's trainable
    # steps, against the same loss given advantages standardised over the full rows.
    actor, critic = actor_critic()
    reference = MaskedGAE(gamma=0.9, lmbda=0.8, value_network=critic)(full.clone())
    mask = reference["loss_mask"].bool()
    trainable = reference["advantage"][mask]
    reference["advantage"] = (reference["advantage"] - trainable.mean()) / trainable.std().clamp_min(
        torch.finfo(torch.float).resolution)
    expected = MaskedClipPPOLoss(actor, critic, normalize_advantage=False)(shard(reference))
    loss = MaskedClipPPOLoss(actor, critic, normalize_advantage=True, cp_group=group, cp_layout=layout,
                             cp_chunk_lengths=lengths)
    loss.make_value_estimator("gae", gamma=0.9, lmbda=0.8)
    got = loss(shard(full.clone()))
    attached = MaskedClipPPOLoss(actor, critic, normalize_advantage=True)
    attach_masked_gae(attached, gamma=0.9, lmbda=0.8, cp_group=group, cp_layout=layout,
                      cp_chunk_lengths=lengths)
    got_attached = attached(shard(full.clone()))

    def loss_case():
        for out in (got, got_attached):
            for name in ("loss_objective", "loss_critic", "loss_entropy"):
                _assert_equal(out[name].detach(), expected[name].detach(), atol=1e-12, name=name)
    rec.case(key, "MaskedClipPPOLoss and attach_masked_gae, normalize_advantage", loss_case)

    # masked_value_targets under CP: the critic term over every step with a target of the slice.
    reference = MaskedGAE(gamma=0.9, lmbda=0.8, value_network=critic, masked_value_targets=True)(full.clone())
    expected_mvt = MaskedClipPPOLoss(actor, critic, normalize_advantage=False,
                                     masked_value_targets=True)(shard(reference))
    loss_mvt = MaskedClipPPOLoss(actor, critic, normalize_advantage=False, masked_value_targets=True,
                                 cp_group=group, cp_layout=layout, cp_chunk_lengths=lengths)
    loss_mvt.make_value_estimator("gae", gamma=0.9, lmbda=0.8)
    got_mvt = loss_mvt(shard(full.clone()))

    def loss_mvt_case():
        for name in ("loss_objective", "loss_critic", "loss_entropy"):
            _assert_equal(got_mvt[name].detach(), expected_mvt[name].detach(), atol=1e-12, name=name)
    rec.case(key, "MaskedClipPPOLoss(masked_value_targets=True)", loss_mvt_case)


def check_grid(rec, rank, cp_groups, dp_groups):
    """A 2 x 2 CP x DP grid: average_gae statistics over all four ranks' steps."""
    from masked_rl import MaskedGAE

    cp_rank, dp_rank = rank % 2, rank // 2  # cp groups {0, 1}, {2, 3}; dp groups {0, 2}, {1, 3}
    cp_group, dp_group = cp_groups[dp_rank], dp_groups[cp_rank]
    batches = [rollout_td(2, 13, seed=100 + d) for d in range(2)]
    for layout in LAYOUTS:
        for mvt in (False, True):
            options = dict(gamma=0.9, lmbda=0.8, value_network=None, masked_value_targets=mvt)
            got = MaskedGAE(**options, average_gae=True, cp_group=cp_group, dp_group=dp_group,
                            cp_layout=layout, cp_chunk_lengths=cp_chunk_lengths(13, 2, layout))(
                cp_shard(batches[dp_rank].clone(), cp_rank, 2, layout=layout, time_dim=1))
            both = torch.cat([MaskedGAE(**options)(b.clone()) for b in batches])
            both["advantage"] = masked_standardize(both["advantage"], both["loss_mask"])
            expected = cp_shard(both[2 * dp_rank: 2 * dp_rank + 2], cp_rank, 2, layout=layout, time_dim=1)

            def case():
                _assert_equal(got["advantage"], expected["advantage"], atol=1e-12, name="advantage")
                _assert_equal(got["value_target"], expected["value_target"], name="value_target")
            rec.case(f"grid/4/{layout}", f"mvt={mvt}", case)

    # DP x CP loss reduction: a DDP step over the 4 ranks with the token mean counted over the
    # grid has the gradient of the token mean over every rank's tokens.
    from torch.nn.parallel import DistributedDataParallel

    from masked_rl.reduction import masked_mean

    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(2 + q, 5, 3, generator=g, dtype=torch.float64) for q in range(4)]
    masks = [torch.rand(2 + q, 5, generator=g) < 0.15 * (q + 1) for q in range(4)]
    torch.manual_seed(0)
    single = torch.nn.Linear(3, 1).double()
    model = DistributedDataParallel(torch.nn.Linear(3, 1).double())
    model.module.load_state_dict(single.state_dict())
    masked_mean(model(inputs[rank]).squeeze(-1).pow(2), masks[rank], group=(cp_group, dp_group)).backward()
    masked_mean(single(torch.cat(inputs)).squeeze(-1).pow(2), torch.cat(masks)).backward()

    def grid_loss_case():
        for got, want in zip(model.module.parameters(), single.parameters()):
            _assert_equal(got.grad, want.grad, atol=1e-12, name="grad")
    rec.case("grid/4/zigzag", "DDP token_mean over (cp_group, dp_group)", grid_loss_case)

    # Data parallelism alone: whole rows on every rank, statistics over the DP group's ranks.
    got = MaskedGAE(gamma=0.9, lmbda=0.8, value_network=None, average_gae=True,
                    dp_group=dp_group)(batches[dp_rank].clone())
    both = torch.cat([MaskedGAE(gamma=0.9, lmbda=0.8, value_network=None)(b.clone()) for b in batches])
    both["advantage"] = masked_standardize(both["advantage"], both["loss_mask"])

    def dp_case():
        _assert_equal(got["advantage"], both[2 * dp_rank: 2 * dp_rank + 2]["advantage"], atol=1e-12,
                      name="advantage")
    rec.case("grid/4/contiguous", "dp_group only", dp_case)


def row_next_values(value, time_dim=-2):
    """``V'[t] = V[t + 1]`` inside the row and 0 after its last step: what
    ``next_state_value=None`` means."""
    moved = value.movedim(time_dim, 0)
    return torch.cat((moved[1:], torch.zeros_like(moved[:1]))).movedim(0, time_dim)


def check_next_from_row(rec, key, n, rank, group, layout):
    """``next_state_value=None`` (a token critic): the single-process function with
    ``V'[t] = V[t + 1]``, across borders, ragged and empty chunks, every rule."""
    chunks = n if layout == "contiguous" else 2 * n
    for seed in range(16):
        g = torch.Generator().manual_seed(7000 + 100 * n + seed)
        horizon = int(torch.randint(1, 40, (1,), generator=g))
        value, _, reward, done, terminated, mask = make_rollout(
            3, horizon, p_mask=(0.3, 0.6, 0.95, 0.1)[seed % 4], p_done=(0.0, 0.1, 0.3)[seed % 3],
            p_term=1.0, seed=seed)
        if seed % 2:  # the row end truncated or not done: V' there is 0
            done[:, -1], terminated[:, -1] = seed % 4 == 1, False
        gamma, lmbda = DISCOUNTS[seed % len(DISCOUNTS)]
        lengths = random_lengths(horizon, chunks, g) if seed % 3 else None
        full = (value, row_next_values(value), reward, done, terminated, mask)
        for mvt in (False, True):
            def case():
                got, expected = run_cp(full, gamma=gamma, lmbda=lmbda, n=n, rank=rank, group=group,
                                       layout=layout, lengths=lengths, masked_value_targets=mvt,
                                       next_from_row=True)
                check_outputs(got, expected)
            rec.case(key, f"seed={seed} T={horizon} lengths={lengths} mvt={mvt}", case)
    # Actions on both sides of every border (V' crosses it), and right-padded transcripts.
    horizon = 3 * chunks + 2
    lengths = cp_chunk_lengths(horizon, n, layout)
    data = rows_from_masks([[1] * horizon, [0, 0] + [1] * (horizon - 4) + [0, 0]],
                           dones=[(1, horizon - 3)], seed=3)
    full = (data[0], row_next_values(data[0]), *data[2:])
    with torch.no_grad():
        got, expected = run_cp(full, gamma=0.9, lmbda=0.8, n=n, rank=rank, group=group,
                               layout=layout, lengths=lengths, next_from_row=True)
    rec.case(key, "actions across every border", lambda: check_outputs(got, expected))

    def communication():
        with count_collectives() as calls:
            run_cp(full, gamma=0.9, lmbda=0.8, n=n, rank=rank, group=group, layout=layout,
                   lengths=lengths, next_from_row=True)
        assert calls == [("all_gather_single", ONE_CALL_BYTES)], calls
    rec.case(key, "collectives", communication)


def check_disagreement(rec, key, n, rank, group, layout):
    """Ranks that disagree raise the same ValueError, each after joining the collectives (no
    abort in gloo, no hang): the message, per rank, is recorded and compared by the test."""
    full = make_rollout(3, 8 * n, p_term=1.0, seed=5)
    big = make_rollout(70, 8 * n, p_term=1.0, seed=5)
    lengths = cp_chunk_lengths(8 * n, n, layout)

    def local(data=full):
        shard = lambda x, dim=-2: cp_shard(x, rank, n, layout=layout, time_dim=dim, chunk_lengths=lengths)
        return [shard(x) for x in data[:5]] + [shard(data[5], -1)]

    odd = rank == 0  # the rank that differs
    variants = {
        "batch": lambda: dict(data=[x[:2] for x in local()] if odd else local()),
        "batch_zero_on_one_rank": lambda: dict(data=[x[:0] for x in local()] if odd else local()),
        # Beyond the inline capacity (70 rows x chunks > 64): the second collective is not made.
        "batch_large": lambda: dict(data=[x[:69] if odd else x for x in local(big)]),
        "features": lambda: dict(data=[x.expand(*x.shape[:2], 2) if i < 5 else x
                                       for i, x in enumerate(local())] if odd else local()),
        "dtype": lambda: dict(data=[x.float() if i < 3 else x for i, x in enumerate(local())] if odd else local()),
        "layout": lambda: dict(layout=("zigzag" if layout == "contiguous" else "contiguous") if odd else layout,
                               chunk_lengths=None),  # the even split of 8 steps: valid in both
        "gamma": lambda: dict(gamma=0.5 if odd else 0.9),
        "lmbda": lambda: dict(lmbda=0.5 if odd else 0.8),
        "masked_value_targets": lambda: dict(masked_value_targets=odd),
        "next_state_value_none": lambda: dict(next_none=odd),
        "time_dim": lambda: dict(data=[x.transpose(0, 1) if i < 5 else x.transpose(0, 1).unsqueeze(-1)
                                       for i, x in enumerate(local())] if odd else local(),
                                 time_dim=0 if odd else -2),
        "chunk_lengths": lambda: dict(chunk_lengths=None if odd else lengths),
    }
    for name, variant in variants.items():
        options = dict(data=local(), gamma=0.9, lmbda=0.8, layout=layout, masked_value_targets=False,
                       next_none=False, time_dim=-2, chunk_lengths=lengths)
        options.update(variant())
        data = list(options["data"])
        if options["next_none"]:
            data[1] = None
        if name == "chunk_lengths" and odd:
            # The even split of a different local length: rank 0 holds one step fewer.
            data = [x[:, 1:] for x in data]
            options["chunk_lengths"] = cp_chunk_lengths(data[0].shape[1] * n, n, layout)

        def case(options=options, data=data, name=name):
            try:
                cp_masked_generalized_advantage_estimate(
                    options["gamma"], options["lmbda"], *data, group=group, layout=options["layout"],
                    time_dim=options["time_dim"], chunk_lengths=options["chunk_lengths"],
                    masked_value_targets=options["masked_value_targets"])
            except ValueError as error:
                rec.info[f"{key}/{name}"] = str(error)
            else:
                raise AssertionError(f"{name}: no error")
        rec.case(key, name, case)

    # A rank that rejects its own input (a mask of the wrong shape): it raises its own error,
    # the others say which rank rejected.
    def rejected():
        data = local()
        if odd:
            data[5] = data[5][:, :-1]
        try:
            cp_masked_generalized_advantage_estimate(0.9, 0.8, *data, group=group, layout=layout,
                                                     chunk_lengths=lengths)
        except ValueError as error:
            expected = "loss_mask must have shape" if odd else "rank(s) [0] of the CP group rejected"
            assert expected in str(error), str(error)
        else:
            raise AssertionError("no error")
    rec.case(key, "rejected input on one rank", rejected)

    # next_state_value=None and a truncated end inside the row, on one rank's slice only.
    def truncated():
        data = local()
        data[1] = None
        if odd:
            data[3] = data[3].clone()
            data[3][:, 0] = True  # done, not terminated
        try:
            cp_masked_generalized_advantage_estimate(0.9, 0.8, *data, group=group, layout=layout,
                                                     chunk_lengths=lengths)
        except ValueError as error:
            assert "rank(s) [0] hold truncated ends" in str(error), str(error)
        else:
            raise AssertionError("no error")
    rec.case(key, "truncated end with next_state_value=None", truncated)


def check_data_parallel_loss(rec, key, n, rank, group, layout):
    """Issue 27 item 3: a DDP step with masked_mean(group=...) has the gradient of the
    single-process loss on the concatenated batch, whatever the split (unequal batch sizes and
    trainable counts per rank, one rank with none)."""
    from torch.nn.parallel import DistributedDataParallel

    from masked_rl.reduction import masked_mean

    if layout != "contiguous":
        return  # no CP layout involved: run once per group
    dp_group = dist.group.WORLD if group is None else group
    g = torch.Generator().manual_seed(50 + n)
    batches = [2 + q for q in range(n)]
    inputs = [torch.randn(b, 6, 3, generator=g, dtype=torch.float64) for b in batches]
    targets = [torch.randn(b, 6, generator=g, dtype=torch.float64) for b in batches]
    masks = [torch.rand(b, 6, generator=g) < (0.2 + 0.6 * q / n) for q, b in enumerate(batches)]
    masks[-1][:] = False  # no trainable token on the last rank
    masks[0][0] = False  # and a sequence without any on the first

    def per_token(model, x, y):
        return (model(x).squeeze(-1) - y).pow(2)

    for reduction in ("token_mean", "sequence_mean"):
        torch.manual_seed(0)
        single = torch.nn.Linear(3, 1).double()
        ddp_model = DistributedDataParallel(torch.nn.Linear(3, 1).double(), process_group=dp_group)
        ddp_model.module.load_state_dict(single.state_dict())
        loss = masked_mean(per_token(ddp_model, inputs[rank], targets[rank]), masks[rank],
                           reduction=reduction, group=dp_group)
        loss.backward()
        reference = masked_mean(per_token(single, torch.cat(inputs), torch.cat(targets)),
                                torch.cat(masks), reduction=reduction)
        reference.backward()
        # What the per-rank means that DDP averages would give instead (not the reference).
        naive = torch.nn.Linear(3, 1).double()
        naive.load_state_dict(single.state_dict())
        sum(masked_mean(per_token(naive, x, y), m, reduction=reduction)
            for x, y, m in zip(inputs, targets, masks)).div(n).backward()

        def case(ddp_model=ddp_model, single=single, naive=naive):
            for (name, got), want, off in zip(ddp_model.module.named_parameters(), single.parameters(),
                                              naive.parameters()):
                _assert_equal(got.grad, want.grad, atol=1e-12, name=name)
                assert (off.grad - want.grad).abs().max() > 1e-6, "the test cannot tell the splits apart"
        rec.case(key, reduction, case)


def check_data_parallel_ppo_loss(rec, key, n, rank, group, layout):
    """MaskedClipPPOLoss(reduction="token_mean" | "sequence_mean", dp_group=...): gradients
    averaged over the ranks as DDP does equal the single-process gradient on the concatenated
    batch (unequal batch sizes and trainable counts)."""
    from masked_rl import MaskedClipPPOLoss, MaskedGAE

    if layout != "contiguous":
        return
    dp_group = dist.group.WORLD if group is None else group
    batches = []
    for q in range(n):
        td = rollout_td(2 + q, 7, seed=200 + q)
        td["loss_mask"] = (torch.rand(2 + q, 7, generator=torch.Generator().manual_seed(q)) < 0.2 + 0.2 * q).to(torch.int8)
        batches.append(MaskedGAE(gamma=0.9, lmbda=0.8, value_network=None)(td))
    for reduction in ("token_mean", "sequence_mean"):
        for mvt in (False, True):
            actor, critic = actor_critic()
            loss = MaskedClipPPOLoss(actor, critic, reduction=reduction, dp_group=dp_group,
                                     masked_value_targets=mvt)
            reference = MaskedClipPPOLoss(*actor_critic(), reduction=reduction, masked_value_targets=mvt)
            batch = batches[rank]
            if mvt:
                batch = MaskedGAE(gamma=0.9, lmbda=0.8, value_network=None, masked_value_targets=True)(batch.clone())
            out = loss(batch)
            sum(out[k] for k in ("loss_objective", "loss_critic", "loss_entropy")).backward()
            grads = [p.grad.clone() for p in loss.parameters() if p.grad is not None]
            for grad in grads:  # what DDP does: the mean over the ranks
                dist.all_reduce(grad, group=dp_group)
                grad /= n
            full = torch.cat([b if not mvt else MaskedGAE(gamma=0.9, lmbda=0.8, value_network=None,
                                                          masked_value_targets=True)(b.clone())
                              for b in batches])
            ref_out = reference(full)
            sum(ref_out[k] for k in ("loss_objective", "loss_critic", "loss_entropy")).backward()
            expected = [p.grad for p in reference.parameters() if p.grad is not None]

            def case(grads=grads, expected=expected):
                assert len(grads) == len(expected) > 0
                for got, want in zip(grads, expected):
                    _assert_equal(got, want, atol=1e-12, name="grad")
            rec.case(key, f"{reduction} mvt={mvt}", case)


CHECKS = {
    "random_rows": check_random_rows,
    "structured_rows": check_structured_rows,
    "shapes_and_dtypes": check_shapes_and_dtypes,
    "issue_two_rank_case": check_issue_two_rank_case,
    "non_finite_isolation": check_non_finite_isolation,
    "communication": check_communication,
    "errors": check_errors,
    "all_gather_round_trip": check_all_gather_round_trip,
    "data_parallel_standardize": check_data_parallel_standardize,
    "modules": check_modules,
    "next_from_row": check_next_from_row,
    "disagreement": check_disagreement,
    "data_parallel_loss": check_data_parallel_loss,
    "data_parallel_ppo_loss": check_data_parallel_ppo_loss,
}


def spawn_world(entry, world: int, out_dir: str, *, timeout_s: float = 4 * TIMEOUT_S) -> None:
    """Run ``entry(rank, world, init_file, out_dir)`` in ``world`` processes (fork where
    available: about 3x faster than spawn on 2 cores), killing them after ``timeout_s``."""
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    context = mp.start_processes(entry, args=(world, str(Path(out_dir) / "init"), out_dir),
                                 nprocs=world, join=False, start_method=method)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"the {world} ranks did not finish within {timeout_s} s")


def run_torchrun(script: Path, *args: str, world: int = 2,
                 timeout_s: float = 300) -> subprocess.CompletedProcess:
    """``script`` under ``torch.distributed.run`` with ``world`` CPU processes, one thread each.

    After ``timeout_s`` the launcher gets SIGTERM, on which it stops its workers before exiting
    (killing the launcher alone would leave them, each in a session of its own, waiting on a
    collective), and ``subprocess.TimeoutExpired`` is raised.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(world), str(script), *args]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run_world(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Entry point of each spawned process: every check, every group this rank belongs to."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    groups = {n: (None if n == world else dist.new_group(ranks)) for n, ranks in GROUP_RANKS.items()}
    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    rec = Recorder()
    for name, check in CHECKS.items():
        started = time.perf_counter()
        for n, group in groups.items():
            if rank not in GROUP_RANKS[n]:
                continue
            for layout in LAYOUTS:
                group_rank = GROUP_RANKS[n].index(rank)
                check(rec, f"{name}/{n}/{layout}", n, group_rank, group, layout)
        rec.info[f"seconds/{name}"] = time.perf_counter() - started
    check_grid(rec, rank, cp_groups, dp_groups)
    torch.save({"cases": dict(rec.cases), "failures": dict(rec.failures), "info": rec.info},
               Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
