"""The environments through TorchRL: keys, dtypes, shapes, alignment of loss_mask and rewards."""

import pytest
import torch

from masked_rl_envs import OraclePolicy, make_torchrl_env

V0_EPISODE = 44  # oracle steps per v0 episode
ORACLE = OraclePolicy.from_id("MaskedRL/ToolUse-v0").as_module()


def oracle_rollout(env, steps=2 * V0_EPISODE + 10):
    return env.rollout(steps, ORACLE, break_when_any_done=False)


def check_rollout(td, batch_shape, steps):
    """Keys, dtypes, shapes, and the masking rules on an oracle rollout ``[*batch_shape, T]``."""
    shape = (*batch_shape, steps)
    expected = {
        "tokens": (torch.int64, (*shape, 64)),
        "loss_mask": (torch.int8, (*shape, 1)),
        "action": (torch.int64, shape),
        "done": (torch.bool, (*shape, 1)),
        "terminated": (torch.bool, (*shape, 1)),
        "truncated": (torch.bool, (*shape, 1)),
        "is_success": (torch.bool, shape),
        ("next", "tokens"): (torch.int64, (*shape, 64)),
        ("next", "loss_mask"): (torch.int8, (*shape, 1)),
        ("next", "reward"): (torch.float32, (*shape, 1)),
        ("next", "done"): (torch.bool, (*shape, 1)),
        ("next", "terminated"): (torch.bool, (*shape, 1)),
        ("next", "is_success"): (torch.bool, shape),
    }
    for key, (dtype, key_shape) in expected.items():
        assert td[key].dtype == dtype, key
        assert td[key].shape == key_shape, key

    mask = td["loss_mask"].squeeze(-1).bool()
    written = td["next", "tokens"][..., -1]
    # loss_mask at t is the observation's: it says whether action t is the token written at t.
    assert torch.equal(written[mask], td["action"][mask])
    # On masked steps the oracle passes <pad> (0), which the environment never writes.
    assert (written[~mask] != td["action"][~mask]).all()
    # One token per step: the window shifts by one, on done steps too (the final observation
    # is kept in "next"; the root of the following step is the reset one).
    assert torch.equal(td["next", "tokens"][..., :-1], td["tokens"][..., 1:])
    not_done = ~td["next", "done"].squeeze(-1)[..., :-1]
    assert torch.equal(td["loss_mask"][..., 1:, :][not_done], td["next", "loss_mask"][..., :-1, :][not_done])

    reward = td["next", "reward"].squeeze(-1)
    terminated = td["next", "terminated"].squeeze(-1)
    assert terminated.sum() >= 2 * max(1, int(torch.Size(batch_shape).numel()))
    assert (reward[terminated] == 1.0).all() and (~mask[terminated]).all()
    assert td["next", "is_success"][terminated].all()
    # Every reward, terminal or shaping, sits on a masked step.
    assert (reward[mask] == 0).all()
    assert torch.allclose(reward[~mask & ~terminated & (reward != 0)], torch.tensor(0.1))
    assert not td["next", "truncated"].any()


def test_gym_env_rollout():
    env = make_torchrl_env(seed=0)
    assert type(env).__name__ == "GymEnv" and env.batch_size == torch.Size([])
    td = oracle_rollout(env)
    check_rollout(td, (), 98)
    mask = td["loss_mask"].squeeze(-1).tolist()
    assert mask[:V0_EPISODE] == [0] * 3 + ([1] + [0] * 16) * 2 + [1] * 3 + [0] * 4
    assert td["next", "terminated"].squeeze(-1).nonzero().squeeze(-1).tolist() == [43, 87]


@pytest.mark.parametrize("num_envs", [1, 3])
def test_rollouts_are_seeded(num_envs):
    def tokens(seed):
        return oracle_rollout(make_torchrl_env(num_envs=num_envs, seed=seed))["next", "tokens"]

    assert torch.equal(tokens(3), tokens(3))
    assert not torch.equal(tokens(3), tokens(4))


@pytest.mark.parametrize("num_envs", [1, 2])
def test_truncation_keeps_the_final_observation(num_envs):
    env = make_torchrl_env(num_envs=num_envs, max_steps=10, seed=0)
    td = oracle_rollout(env, steps=25)
    truncated = td["next", "truncated"].squeeze(-1)
    assert truncated.sum() == 2 * num_envs and not td["next", "terminated"].any()
    assert (td["next", "tokens"][truncated][:, -10:] != 0).all()  # ten tokens written
    assert (td["tokens"][..., 10, :] == 0).all()  # the next episode starts empty


@pytest.mark.parametrize("vectorization", ["sync", "async"])
def test_vectorised_gym_env_rollout(vectorization):
    env = make_torchrl_env(num_envs=3, vectorization=vectorization, seed=0)
    try:
        assert env.batch_size == torch.Size([3])
        check_rollout(oracle_rollout(env), (3,), 98)
    finally:
        env.close()


@pytest.mark.parametrize("serial", [True, False])
def test_batched_env_rollout(serial):
    env = make_torchrl_env(workers=2, serial=serial, seed=0)
    try:
        assert type(env).__name__ == ("SerialEnv" if serial else "ParallelEnv")
        assert env.batch_size == torch.Size([2])
        check_rollout(oracle_rollout(env), (2,), 98)
    finally:
        env.close()


@pytest.mark.parametrize("num_envs, workers", [(1, 1), (3, 1), (2, 2)])
def test_batched_backend_rollout(num_envs, workers):
    env = make_torchrl_env(num_envs=num_envs, workers=workers, serial=True, backend="batched", seed=0)
    try:
        assert env.batch_size == ((workers,) if workers > 1 else ()) + (num_envs,)
        check_rollout(oracle_rollout(env), tuple(env.batch_size), 98)
    finally:
        env.close()


def test_plain_torchrl_wrappers():
    """Without the helper: GymWrapper over gymnasium.make, and GymEnv(num_envs=...)."""
    import gymnasium as gym
    from torchrl.envs import GymEnv, GymWrapper

    env = GymWrapper(gym.make("MaskedRL/ToolUse-v0"), categorical_action_encoding=True)
    env.set_seed(0)
    td = env.rollout(V0_EPISODE, ORACLE)
    assert td["loss_mask"].dtype == torch.int8 and td["loss_mask"].sum() == 5
    assert td["next", "terminated"][-1] and td["next", "reward"][-1].item() == 1.0

    # GymEnv(num_envs=N) runs an AsyncVectorEnv. TorchRL 0.14.1 zeroes its final Dict
    # observations and loses the done step's info (make_torchrl_env does not); the rest holds.
    env = GymEnv("masked_rl_envs:MaskedRL/ToolUse-v0", num_envs=2, categorical_action_encoding=True)
    try:
        env.set_seed(0)
        td = oracle_rollout(env)
        assert td.batch_size == (2, 98) and td["tokens"].shape == (2, 98, 64)
        mask = td["loss_mask"].squeeze(-1).bool()
        assert torch.equal(td["next", "tokens"][..., -1][mask], td["action"][mask])
        terminated = td["next", "terminated"].squeeze(-1)
        assert terminated.sum() == 4 and (~mask[terminated]).all()
        assert (td["next", "reward"].squeeze(-1)[terminated] == 1.0).all()
    finally:
        env.close()


def test_one_hot_actions_and_env_kwargs():
    env = make_torchrl_env(categorical_action_encoding=False, response_len=24, seed=0)
    td = env.rollout(10)
    assert td["action"].shape == (10, 17) and td["action"].dtype == torch.int64
    assert (td["action"].sum(-1) == 1).all()
    assert env.observation_spec["tokens"].shape == (64,)
    assert env.reward_spec.shape == (1,)


def test_hard_id():
    env = make_torchrl_env("MaskedRL/ToolUseHard-v0", seed=0)
    policy = OraclePolicy.from_id("MaskedRL/ToolUseHard-v0").as_module()
    td = env.rollout(166, policy)
    assert td["tokens"].shape == (166, 256) and td["loss_mask"].sum() == 10
    assert td["next", "terminated"][-1] and td["next", "reward"][-1].item() == 1.0
    assert td["next", "reward"].sum().item() == pytest.approx(0.97)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_envs=0), "num_envs must be an integer >= 1, got 0"),
        (dict(workers=1.5), "workers must be an integer >= 1, got 1.5"),
        (dict(vectorization="threads"), r"vectorization must be one of \('sync', 'async'\)"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_torchrl_env(**kwargs)


def test_docstring_examples_run():
    import doctest

    import masked_rl_envs.oracle
    import masked_rl_envs.torchrl_env

    for module in (masked_rl_envs.oracle, masked_rl_envs.torchrl_env):
        failed, attempted = doctest.testmod(module)
        assert failed == 0 and attempted > 0, module.__name__


def test_masked_gae_on_a_rollout():
    from masked_rl import MaskedGAE
    from tensordict.nn import TensorDictModule

    generator = torch.Generator().manual_seed(0)
    oracle = OraclePolicy.from_id("MaskedRL/ToolUse-v0")

    def oracle_and_random(tokens, loss_mask):  # env 0 plays the oracle, env 1 at random
        first = oracle({"tokens": tokens[:1], "loss_mask": loss_mask[:1]})
        return torch.cat([torch.as_tensor(first), torch.randint(17, (1,), generator=generator)])

    policy = TensorDictModule(oracle_and_random, ["tokens", "loss_mask"], ["action"])
    env = make_torchrl_env(num_envs=2, seed=0)
    td = env.rollout(300, policy, break_when_any_done=False)
    values = torch.randn(2, 301, 1, generator=generator)
    td["state_value"] = values[:, :-1]
    td["next", "state_value"] = values[:, 1:]

    td = MaskedGAE(gamma=0.99, lmbda=0.95, value_network=None)(td)

    mask = td["loss_mask"].squeeze(-1).bool()
    for key in ("advantage", "value_target"):
        assert td[key].shape == (2, 300, 1)
        assert (td[key].squeeze(-1)[~mask] == 0).all()
    # With random values no trainable advantage is 0 (value targets can be: a wrong answer
    # on an episode's last trainable step has target 0 + 0).
    assert (td["advantage"].squeeze(-1)[mask] != 0).all()
    assert td["next", "terminated"][0].sum() >= 6 and td["next", "truncated"][1].any()
    assert 0 < mask.sum() < mask.numel() / 4
