"""CompleteEpisodes: every episode estimated once, whole, as if the rows had never been cut."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from masked_rl import masked_generalized_advantage_estimate as mgae
from masked_rl.episodes import CompleteEpisodes


def stream(rows, length, *, p_done, seed):
    """A long uncut ``[B, L]`` stream with a global step id, to be cut into collector batches."""
    g = torch.Generator().manual_seed(seed)
    done = torch.rand(rows, length, 1, generator=g) < p_done
    return TensorDict(
        {
            "step_id": torch.arange(rows * length).view(rows, length),
            "loss_mask": (torch.rand(rows, length, 1, generator=g) < 0.4).to(torch.int8),
            "state_value": torch.randn(rows, length, 1, generator=g, dtype=torch.float64),
            "next": {
                "done": done,
                "terminated": done & (torch.rand(rows, length, 1, generator=g) < 0.5),
                "reward": torch.randn(rows, length, 1, generator=g, dtype=torch.float64),
                "state_value": torch.randn(rows, length, 1, generator=g, dtype=torch.float64),
            },
        },
        batch_size=[rows, length],
    )


def advantage(td):
    return mgae(0.9, 0.8, td["state_value"], td["next", "state_value"], td["next", "reward"],
                td["next", "done"], td["next", "terminated"], td["loss_mask"])[0]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 12), st.integers(1, 6), st.sampled_from([0.02, 0.1, 0.4]),
       st.integers(0, 2**31 - 1))
def test_every_finished_episode_once_whole_and_exact(rows, horizon, batches, p_done, seed):
    full = stream(rows, horizon * batches, p_done=p_done, seed=seed)
    # Advantages of the uncut stream, for the steps of episodes that have ended by its last step.
    reference = advantage(full).squeeze(-1)
    done = full["next", "done"].squeeze(-1)
    steps = torch.arange(full.batch_size[1])
    finished = steps <= torch.where(done, steps, -1).amax(-1, keepdim=True)
    complete = CompleteEpisodes()
    seen = []
    for k in range(batches):
        out = complete(full[:, k * horizon : (k + 1) * horizon])
        valid = out["collector", "mask"]
        seen.append(out["step_id"][valid])
        # Each row is a run of whole episodes: estimating here gives the uncut stream's numbers.
        trainable = out["loss_mask"].squeeze(-1).bool()
        assert not (trainable & ~valid).any()
        expected = reference.flatten()[out["step_id"][trainable]]
        torch.testing.assert_close(advantage(out).squeeze(-1)[trainable], expected, rtol=0, atol=1e-12)
        # Padding is made of one-step, reward-free, terminated episodes.
        pad = out["next", "done"].squeeze(-1) & ~valid & (out["next", "reward"].squeeze(-1) == 0)
        assert out["next", "terminated"].squeeze(-1)[pad].all()
    seen = torch.cat(seen).sort().values
    assert torch.equal(seen, full["step_id"][finished].sort().values)  # each finished step once
    assert complete.held_steps == int((~finished).sum())


def test_state_dict_resumes_and_reset_forgets(tmp_path):
    full = stream(3, 40, p_done=0.05, seed=1)
    a, b = CompleteEpisodes(), CompleteEpisodes()
    a(full[:, :20])
    state = a.state_dict()
    path = tmp_path / "held.pt"
    torch.save(state, path)
    b.load_state_dict(torch.load(path, weights_only=True))  # plain containers only
    assert (a(full[:, 20:]) == b(full[:, 20:])).all()
    a.reset()
    assert a.held_steps == 0 and a(full[:, 20:]).batch_size == (3, 20)


def test_leading_dims_are_rows():
    """[workers, envs, T] batches (a multi-process collector's) are rows of their environments."""
    full = stream(6, 40, p_done=0.06, seed=3)
    flat, shaped = CompleteEpisodes(), CompleteEpisodes()
    for k in range(4):
        part = full[:, 10 * k : 10 * (k + 1)]
        expected = flat(part)
        got = shaped(part.reshape(2, 3, 10))
        assert got.batch_size[:2] == (2, 3)
        assert (got.reshape(6, -1) == expected).all()


def test_errors_name_what_is_wrong():
    complete = CompleteEpisodes()
    with pytest.raises(ValueError, match=r"shape \[\*B, T\].*got batch_size \[5\]"):
        complete(stream(1, 5, p_done=0.0, seed=0)[0])
    complete(stream(2, 5, p_done=0.0, seed=0))
    with pytest.raises(ValueError, match="the batch has 3 rows but the held-back steps came from 2"):
        complete(stream(3, 5, p_done=0.0, seed=0))


def test_with_a_torchrl_collector():
    """Real collector batches (episodes of 44+ steps in rows of 30): rows continue across calls."""
    from torchrl.collectors import Collector
    from torchrl.envs.utils import RandomPolicy

    from masked_rl_envs import make_torchrl_env

    env = make_torchrl_env("MaskedRL/ToolUse-v0", num_envs=3, seed=0)
    collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=3 * 30, total_frames=3 * 30 * 4)
    complete = CompleteEpisodes()
    lengths = []
    for batch in collector:
        out = complete(batch)
        lengths.append(out.batch_size[1])
        valid = out["collector", "mask"]
        continues = (out["next", "tokens"][:, :-1] == out["tokens"][:, 1:]).all(-1)
        ends = out["next", "done"].squeeze(-1)[:, :-1]
        both_valid = valid[:, :-1] & valid[:, 1:]
        assert (continues | ends)[both_valid].all()
    collector.shutdown()
    assert max(lengths) > 30  # held-back steps were carried


def test_empty_batches_pass_through_and_keep_what_is_held():
    """T = 0 and B = 0 (e.g. a collector's empty last batch) neither raise nor lose the held steps."""
    complete = CompleteEpisodes()
    empty = stream(3, 0, p_done=0.5, seed=0)
    out = complete(empty)
    assert out.batch_size == torch.Size([3, 0]) and complete.held_steps == 0
    no_rows = complete.__class__()(stream(0, 5, p_done=0.5, seed=0))
    assert no_rows.batch_size == torch.Size([0, 5])

    first = stream(3, 6, p_done=0.3, seed=1)
    first["next", "done"][:, -1] = False  # every row ends on an unfinished episode
    complete(first)
    held = complete.held_steps
    assert held > 0
    out = complete(empty)  # nothing new: the held steps come back, still held
    assert complete.held_steps == held and not out["collector", "mask"].any()
    ids = out["step_id"][complete._held_valid]
    assert set(ids.tolist()) <= set(first["step_id"].flatten().tolist())
