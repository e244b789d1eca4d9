"""masked_rl.distributed: context-parallel masked GAE and data-parallel standardisation.

One gloo world of 4 CPU processes is spawned for the whole module (spawning is the slow part);
it runs every case of ``distributed_worker.CHECKS`` with process groups of 2, 3 and 4 ranks and
both layouts, comparing every rank with the single-process function on the full rows. The tests
below assert on what each rank recorded. The shard helpers are also tested without processes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from distributed_worker import CHECKS, GROUP_RANKS, LAYOUTS, ONE_CALL_BYTES, WORLD, run_world, spawn_world

from masked_rl import masked_standardize
from masked_rl.distributed import (
    cp_chunk_lengths,
    cp_masked_generalized_advantage_estimate,
    cp_response_chunk_lengths,
    cp_shard,
    cp_unshard,
)

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with the gloo backend",
)


@pytest.fixture(scope="module")
def world_results():
    # fork (where available) starts the 4 processes without re-importing torch and torchrl in
    # each: about 3x faster than spawn on a 2-core machine. The parent never initialises a
    # process group, and each child uses one intra-op thread (as DataLoader workers do).
    with tempfile.TemporaryDirectory() as tmp:
        spawn_world(run_world, WORLD, tmp)
        return [torch.load(Path(tmp) / f"rank{rank}.pt") for rank in range(WORLD)]


KEYS = [f"{check}/{n}/{layout}" for check in CHECKS for n in GROUP_RANKS for layout in LAYOUTS
        if not (check.startswith("data_parallel") and layout == "zigzag")]
KEYS += [f"grid/4/{layout}" for layout in LAYOUTS]  # CP x DP: 2 x 2


@pytest.mark.parametrize("key", KEYS)
def test_every_rank_matches_the_single_process_function(world_results, key):
    n = int(key.split("/")[1])
    members = GROUP_RANKS[n]
    for rank in members:
        recorded = world_results[rank]
        assert recorded["cases"].get(key, 0) > 0, f"rank {rank} ran no case of {key}"
        failures = recorded["failures"].get(key, [])
        assert not failures, f"rank {rank}: {len(failures)} of {recorded['cases'][key]} cases failed:\n" + "\n".join(failures[:3])
    # Every member of the group ran the same cases.
    assert len({world_results[r]["cases"][key] for r in members}) == 1


def test_communication_is_one_small_all_gather(world_results):
    """Recorded by the 'communication' check (which also checks B = 70: two collectives)."""
    for n in GROUP_RANKS:
        for layout in LAYOUTS:
            sent = world_results[GROUP_RANKS[n][0]]["info"][f"communication/{n}/{layout}"]
            assert sent == [("all_gather_single", ONE_CALL_BYTES)]


DISAGREEMENTS = {
    "batch": "the shape of state_value without its time dim",
    "batch_zero_on_one_rank": "the shape of state_value without its time dim",
    "batch_large": "rank 0 [69, 1], rank 1 [70, 1]",
    "features": "the shape of state_value without its time dim",
    "dtype": "the dtype of state_value: rank 0 'torch.float32', rank 1 'torch.float64'",
    "layout": "layout",
    "gamma": "gamma: rank 0 0.5, rank 1 0.9",
    "lmbda": "lmbda: rank 0 0.5, rank 1 0.8",
    "masked_value_targets": "masked_value_targets: rank 0 True, rank 1 False",
    "next_state_value_none": "next_state_value is None: rank 0 True, rank 1 False",
    "time_dim": "time_dim (non-negative): rank 0 0, rank 1 1",
    "chunk_lengths": "the chunk lengths",
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", sorted(GROUP_RANKS))
@pytest.mark.parametrize("what", sorted(DISAGREEMENTS))
def test_disagreeing_ranks_raise_the_same_error(world_results, what, n, layout):
    """Issue 29 item 7: every rank raises (none aborts in gloo, none waits), naming what differs."""
    messages = [world_results[r]["info"].get(f"disagreement/{n}/{layout}/{what}") for r in GROUP_RANKS[n]]
    assert all(messages), messages
    assert DISAGREEMENTS[what] in messages[0], messages[0]
    if what != "chunk_lengths":  # each rank says what its own chunk_lengths give
        assert len(set(messages)) == 1, messages
    if what == "batch_zero_on_one_rank":
        assert "rank 0 [0, 1], rank 1 [3, 1]" in messages[0]


# --- shard helpers, no processes ---------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp, horizon", [(1, 5), (2, 8), (2, 11), (3, 7), (4, 3), (4, 0)])
def test_shard_unshard_round_trip(layout, cp, horizon):
    rows = torch.arange(2 * horizon * 3).view(2, horizon, 3)
    parts = [cp_shard(rows, r, cp, layout=layout) for r in range(cp)]
    assert sum(p.shape[1] for p in parts) == horizon
    assert torch.equal(cp_unshard(parts, layout=layout), rows)
    lengths = cp_chunk_lengths(horizon, cp, layout)
    assert sum(lengths) == horizon and max(lengths) - min(lengths) <= 1


def test_zigzag_holds_chunks_r_and_2cp_minus_1_minus_r():
    row = torch.arange(16).view(1, 16, 1)
    assert [cp_shard(row, r, 4, layout="zigzag").view(-1).tolist() for r in range(4)] == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]
    ]
    assert cp_chunk_lengths(10, 2, "zigzag") == [3, 3, 2, 2]


def test_shard_tensordict_and_explicit_uneven_lengths():
    from tensordict import TensorDict

    td = TensorDict({"a": torch.arange(12).view(2, 6), "b": torch.randn(2, 6, 1)}, batch_size=[2, 6])
    lengths = [0, 4, 1, 1]  # zigzag, cp 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    parts = [cp_shard(td, r, 2, layout="zigzag", time_dim=1, chunk_lengths=lengths) for r in range(2)]
    assert parts[0]["a"].tolist() == [[5], [11]]
    assert parts[1]["a"].tolist() == [[0, 1, 2, 3, 4], [6, 7, 8, 9, 10]]
    back = cp_unshard(parts, layout="zigzag", time_dim=1, chunk_lengths=lengths)
    assert (back == td).all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(layout="ring"), r"layout must be one of \('contiguous', 'zigzag'\), got 'ring'"),
        (dict(chunk_lengths=[4, 4]), r"chunk_lengths \[4, 4\] must sum to the horizon 6"),
        (dict(chunk_lengths=[6]), r"chunk_lengths must hold 2 non-negative ints .* got \[6\]"),
        (dict(chunk_lengths=[7, -1]), r"chunk_lengths must hold 2 non-negative ints"),
    ],
)
def test_shard_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        cp_shard(torch.zeros(1, 6, 1), 0, 2, **kwargs)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\), got 2"):
        cp_shard(torch.zeros(1, 6, 1), 2, 2)


def _megatron_positions(sequence_length, rank, cp, layout):
    """The token positions a rank holds under Megatron-style CP: chunks of ceil(S / P)."""
    chunks = 2 * cp if layout == "zigzag" else cp
    size = -(-sequence_length // chunks)
    held = (rank, 2 * cp - 1 - rank) if layout == "zigzag" else (rank,)
    return [p for k in held for p in range(k * size, min((k + 1) * size, sequence_length))]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_response_chunk_lengths_match_slicing_full_sequences(layout, cp):
    """Issue 27 item 2: the rank's response steps are those whose scoring position (one before
    the token) it holds, in the order it holds them: cp_shard of the response row with these
    lengths gives exactly them."""
    for prompt in (1, 2, 5, 13):
        for response in (0, 1, 4, 17, 40):
            for padding in (0, 1, 7):
                total = prompt + response + padding
                lengths = cp_response_chunk_lengths(prompt, response, cp, layout, sequence_length=total)
                assert sum(lengths) == response
                steps = torch.arange(response).view(1, response, 1)
                for rank in range(cp):
                    expected = [p - (prompt - 1) for p in _megatron_positions(total, rank, cp, layout)
                                if prompt - 1 <= p < prompt - 1 + response]
                    got = cp_shard(steps, rank, cp, layout=layout, chunk_lengths=lengths)
                    assert got.view(-1).tolist() == expected, (prompt, response, padding, rank)


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((0, 3, 2), {}, r"prompt_length must be an int >= 1, got 0"),
        ((2, -1, 2), {}, r"response_length must be an int >= 0, got -1"),
        ((2, 3, 2), dict(sequence_length=4), r"sequence_length must be an int >= .* = 5, got 4"),
        ((2, 3, 2, "ring"), {}, r"layout must be one of"),
    ],
)
def test_response_chunk_lengths_reject_bad_arguments(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cp_response_chunk_lengths(*args, **kwargs)


def test_estimator_without_process_group_says_so():
    data = [torch.zeros(1, 4, 1)] * 3 + [torch.zeros(1, 4, 1, dtype=torch.bool)] * 2 + [torch.ones(1, 4)]
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed process group"):
        cp_masked_generalized_advantage_estimate(0.9, 0.9, *data)


# --- masked_standardize (issue 10, item 5), single process ---------------------------------------


@pytest.mark.parametrize("mask_shape", ["[B, T]", "[B, T, 1]", "int8", "float"])
def test_masked_standardize_accepts_the_estimators_masks(mask_shape):
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(3, 7, 1, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 7, generator=g) < 0.5
    expected = masked_standardize(adv, mask.unsqueeze(-1))
    given = {"[B, T]": mask, "[B, T, 1]": mask.unsqueeze(-1), "int8": mask.to(torch.int8),
             "float": mask.float()}[mask_shape]
    assert torch.equal(masked_standardize(adv, given), expected)
    trainable = expected[mask.unsqueeze(-1)]
    torch.testing.assert_close(trainable.mean().item(), 0.0, atol=1e-12, rtol=0)
    torch.testing.assert_close(trainable.std().item(), 1.0, atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    "mask, message",
    [
        (torch.ones(3, 6), r"loss_mask must have shape \[3, 7\], \[3, 7, 1\] or \[3, 7, 1\] .* got \[3, 6\]"),
        (torch.full((3, 7), 2, dtype=torch.int8), r"loss_mask must be bool or hold only 0 and 1, got torch.int8 values \[2\]"),
        ([[1] * 7] * 3, r"loss_mask must have shape .* got list"),
    ],
)
def test_masked_standardize_rejects_bad_masks(mask, message):
    with pytest.raises(ValueError, match=message):
        masked_standardize(torch.zeros(3, 7, 1), mask)
