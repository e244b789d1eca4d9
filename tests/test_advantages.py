"""MaskedGAE: keys, value networks, TorchRL GAE parity, standardisation, rollouts and errors."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from masked_gae_reference import make_rollout, serial_masked_gae_batch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.envs import GymWrapper
from torchrl.objectives.value import GAE

from masked_rl import MaskedGAE, masked_generalized_advantage_estimate


def rollout_td(batch=3, horizon=30, *, seed=0, mask_dtype=torch.int8, consistent=True, **kwargs):
    value, next_value, reward, done, terminated, mask = make_rollout(
        batch, horizon, seed=seed, dtype=torch.float32, consistent=consistent, **kwargs
    )
    return TensorDict(
        {
            "loss_mask": mask.to(mask_dtype).unsqueeze(-1),
            "state_value": value,
            "next": {
                "reward": reward,
                "done": done,
                "terminated": terminated,
                "truncated": done & ~terminated,
                "state_value": next_value,
            },
        },
        batch_size=[batch, horizon],
    )


def functional_on(td, gamma, lmbda, mask_key="loss_mask"):
    return masked_generalized_advantage_estimate(
        gamma,
        lmbda,
        td["state_value"],
        td["next", "state_value"],
        td["next", "reward"],
        td["next", "done"],
        td["next", "terminated"],
        td[mask_key],
    )


def test_forward_writes_functional_result_and_zero_at_masked_steps():
    td = rollout_td(seed=1)
    # Dyadic gamma / lmbda: the estimator stores them as float32 buffers, like TorchRL's GAE.
    expected_adv, expected_target = functional_on(td, 0.9375, 0.875)
    out = MaskedGAE(gamma=0.9375, lmbda=0.875, value_network=None)(td)
    assert out is td
    assert torch.equal(td["advantage"], expected_adv)
    assert torch.equal(td["value_target"], expected_target)
    masked = td["loss_mask"] == 0
    assert td["advantage"][masked].abs().max() == 0
    assert td["value_target"][masked].abs().max() == 0


def test_matches_serial_reference_on_tensordict():
    td = rollout_td(batch=4, horizon=50, seed=2).double()
    MaskedGAE(gamma=0.9, lmbda=0.8, value_network=None)(td)
    ref_adv, ref_target = serial_masked_gae_batch(
        0.9, 0.8, td["state_value"], td["next", "state_value"], td["next", "reward"],
        td["next", "done"], td["next", "terminated"], td["loss_mask"].squeeze(-1),
    )
    # gamma and lmbda are float32 buffers, as in TorchRL's GAE.
    torch.testing.assert_close(td["advantage"], ref_adv, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(td["value_target"], ref_target, rtol=1e-6, atol=1e-6)


def test_set_keys_renames_loss_mask_and_others():
    td = rollout_td(seed=3)
    td.rename_key_("loss_mask", "trainable")
    td.rename_key_("state_value", "v")
    td.rename_key_(("next", "state_value"), ("next", "v"))
    estimator = MaskedGAE(gamma=0.5, lmbda=0.75, value_network=None)
    estimator.set_keys(loss_mask="trainable", value="v", advantage="adv")
    assert estimator.loss_mask_key == "trainable"
    estimator(td)
    expected = masked_generalized_advantage_estimate(
        0.5, 0.75, td["v"], td["next", "v"], td["next", "reward"], td["next", "done"],
        td["next", "terminated"], td["trainable"],
    )[0]
    assert torch.equal(td["adv"], expected)


def test_in_keys_include_loss_mask_with_value_network():
    critic = TensorDictModule(torch.nn.Linear(3, 1), in_keys=["obs"], out_keys=["state_value"])
    estimator = MaskedGAE(gamma=0.9, lmbda=0.9, value_network=critic)
    assert "loss_mask" in estimator.in_keys
    estimator.set_keys(loss_mask=("agent", "mask"))
    assert ("agent", "mask") in estimator.in_keys


def value_network_td(batch=2, horizon=12, seed=4):
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(batch, horizon + 1, 3, generator=g)
    td = rollout_td(batch, horizon, seed=seed)
    del td["state_value"], td["next", "state_value"]
    td["obs"] = obs[:, :-1]
    td["next", "obs"] = obs[:, 1:]
    return td


def test_value_network_gives_same_result_as_precomputed_values():
    torch.manual_seed(0)
    critic = TensorDictModule(torch.nn.Linear(3, 1), in_keys=["obs"], out_keys=["state_value"])
    td = value_network_td()
    with torch.no_grad():
        value = critic(td.select("obs").clone())["state_value"]
        next_value = critic(td["next"].select("obs").clone())["state_value"]
    pre = td.clone()
    pre["state_value"], pre["next", "state_value"] = value, next_value
    MaskedGAE(gamma=0.95, lmbda=0.9, value_network=None)(pre)
    MaskedGAE(gamma=0.95, lmbda=0.9, value_network=critic)(td)
    torch.testing.assert_close(td["advantage"], pre["advantage"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(td["value_target"], pre["value_target"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shifted", [False, True])
def test_value_network_all_ones_mask_equals_torchrl_gae(shifted):
    torch.manual_seed(0)
    critic = TensorDictModule(torch.nn.Linear(3, 1), in_keys=["obs"], out_keys=["state_value"])
    td = value_network_td(batch=3, horizon=20)
    td["loss_mask"] = torch.ones_like(td["loss_mask"])
    ours, theirs = td.clone(), td.clone()
    MaskedGAE(gamma=0.95, lmbda=0.9, value_network=critic, shifted=shifted)(ours)
    GAE(gamma=0.95, lmbda=0.9, value_network=critic, shifted=shifted, vectorized=False)(theirs)
    for key in ("advantage", "value_target", "state_value"):
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("differentiable", [False, True])
def test_differentiable_keeps_torchrl_meaning(differentiable):
    td = rollout_td(seed=4)
    td["state_value"] = td["state_value"].clone().requires_grad_(True)
    ours, theirs = td.clone(), td.clone()
    MaskedGAE(gamma=0.95, lmbda=0.9, value_network=None, differentiable=differentiable)(ours)
    GAE(gamma=0.95, lmbda=0.9, value_network=None, differentiable=differentiable)(theirs)
    assert ours["advantage"].requires_grad == theirs["advantage"].requires_grad == differentiable
    if differentiable:
        ours["advantage"].sum().backward()
        grad = td["state_value"].grad
        # Masked steps' values get no gradient: nothing at a masked step changes the output.
        assert grad[td["loss_mask"] == 0].abs().max() == 0
        assert grad[td["loss_mask"] == 1].abs().max() > 0


def test_value_estimate_returns_masked_value_target_without_writing():
    td = rollout_td(seed=5)
    estimator = MaskedGAE(gamma=0.9375, lmbda=0.875, value_network=None, average_gae=True)
    target = estimator.value_estimate(td)
    assert "advantage" not in td.keys() and "value_target" not in td.keys()
    assert torch.equal(target, functional_on(td, 0.9375, 0.875)[1])


# --- parity with TorchRL's GAE on an all-ones mask ----------------------------------------------


@pytest.mark.parametrize("average_gae", [False, True])
@pytest.mark.parametrize("p_done", [0.0, 0.1])
def test_all_ones_mask_equals_torchrl_gae(average_gae, p_done):
    td = rollout_td(batch=3, horizon=40, seed=6, p_done=p_done, consistent=False)
    td["loss_mask"] = torch.ones_like(td["loss_mask"])
    ours, theirs = td.clone(), td.clone()
    kwargs = dict(gamma=0.99, lmbda=0.95, value_network=None, average_gae=average_gae)
    MaskedGAE(**kwargs)(ours)
    GAE(vectorized=False, **kwargs)(theirs)
    torch.testing.assert_close(ours["advantage"], theirs["advantage"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours["value_target"], theirs["value_target"], rtol=1e-5, atol=1e-5)


def test_all_ones_mask_equals_torchrl_gae_with_auto_reset_env():
    td = rollout_td(batch=2, horizon=30, seed=7, p_done=0.1, consistent=False)
    td["loss_mask"] = torch.ones_like(td["loss_mask"])
    ours, theirs = td.clone(), td.clone()
    kwargs = dict(gamma=0.99, lmbda=0.95, value_network=None, auto_reset_env=True)
    MaskedGAE(**kwargs)(ours)
    GAE(vectorized=False, **kwargs)(theirs)
    torch.testing.assert_close(ours["advantage"], theirs["advantage"], rtol=1e-5, atol=1e-5)


def test_all_ones_mask_equals_torchrl_gae_group_standardisation():
    td = rollout_td(batch=4, horizon=20, seed=8, consistent=False)
    td["loss_mask"] = torch.ones_like(td["loss_mask"])
    td["task"] = torch.tensor([0, 1, 0, 1]).unsqueeze(-1).expand(4, 20)
    ours, theirs = td.clone(), td.clone()
    kwargs = dict(gamma=0.99, lmbda=0.95, value_network=None, average_gae=True, group_key="task")
    MaskedGAE(**kwargs)(ours)
    GAE(vectorized=False, **kwargs)(theirs)
    torch.testing.assert_close(ours["advantage"], theirs["advantage"], rtol=1e-5, atol=1e-5)


def test_average_gae_statistics_over_trainable_steps_only():
    td = rollout_td(batch=4, horizon=60, seed=9)
    MaskedGAE(gamma=0.9375, lmbda=0.875, value_network=None, average_gae=True)(td)
    mask = td["loss_mask"].bool()
    assert td["advantage"][~mask].abs().max() == 0
    trainable = td["advantage"][mask].double()
    assert abs(trainable.mean().item()) < 1e-6
    assert abs(trainable.std().item() - 1) < 1e-5
    # The value target is not standardised.
    assert torch.equal(td["value_target"], functional_on(td, 0.9375, 0.875)[1])


# --- layouts ------------------------------------------------------------------------------------


def test_time_dim_zero_and_single_batch_dim():
    td = rollout_td(batch=3, horizon=25, seed=10)
    expected = MaskedGAE(gamma=0.9, lmbda=0.9, value_network=None)(td.clone())["advantage"]
    time_first = td.transpose(0, 1).contiguous()
    MaskedGAE(gamma=0.9, lmbda=0.9, value_network=None, time_dim=0)(time_first)
    assert torch.equal(time_first["advantage"].transpose(0, 1), expected)
    single = td[1].clone()
    MaskedGAE(gamma=0.9, lmbda=0.9, value_network=None)(single)
    assert torch.equal(single["advantage"], expected[1])


def test_extra_batch_dims():
    td = rollout_td(batch=6, horizon=20, seed=11)
    expected = MaskedGAE(gamma=0.9, lmbda=0.9, value_network=None)(td.clone())["advantage"]
    shaped = td.reshape(2, 3, 20)
    MaskedGAE(gamma=0.9, lmbda=0.9, value_network=None)(shaped)
    assert torch.equal(shaped["advantage"].reshape(6, 20, 1), expected)


def test_runs_on_device(device):
    td = rollout_td(seed=12).to(device)
    estimator = MaskedGAE(gamma=0.99, lmbda=0.95, value_network=None, device=device)
    estimator(td)
    assert td["advantage"].device.type == device.type
    torch.testing.assert_close(td["advantage"].cpu(), functional_on(td.cpu(), 0.99, 0.95)[0])


# --- errors -------------------------------------------------------------------------------------


def test_missing_loss_mask_names_the_key():
    td = rollout_td()
    del td["loss_mask"]
    with pytest.raises(KeyError, match="loss_mask"):
        MaskedGAE(gamma=0.9, lmbda=0.9, value_network=None)(td)
    estimator = MaskedGAE(gamma=0.9, lmbda=0.9, value_network=None)
    estimator.set_keys(loss_mask="trainable")
    with pytest.raises(KeyError, match="trainable"):
        estimator(rollout_td())


@pytest.mark.parametrize("missing", ["state_value", ("next", "state_value"), ("next", "reward"), ("next", "done")])
def test_missing_inputs_name_the_key(missing):
    td = rollout_td()
    del td[missing]
    with pytest.raises(KeyError, match=str(missing[-1] if isinstance(missing, tuple) else missing)):
        MaskedGAE(gamma=0.9, lmbda=0.9, value_network=None)(td)


def test_mask_one_step_short_raises():
    td = rollout_td(batch=3, horizon=30)
    td = td.exclude("loss_mask")
    short = torch.ones(3, 29, 1, dtype=torch.int8)
    td_dict = td.to_dict()
    td_dict["loss_mask_short"] = short
    # A tensordict cannot hold a [3, 29] entry in a [3, 30] batch, so build it non-batched in time.
    flat = TensorDict(td_dict | {"loss_mask": short}, batch_size=[3])
    with pytest.raises(ValueError, match=r"loss_mask must have shape \[3, 30\] or \[3, 30, 1\].*got \[3, 29, 1\]"):
        MaskedGAE(gamma=0.9, lmbda=0.9, value_network=None, time_dim=1)(flat)


def test_non_binary_mask_raises():
    td = rollout_td()
    td["loss_mask"] = td["loss_mask"] * 3
    with pytest.raises(ValueError, match=r"loss_mask must be bool or hold only 0 and 1, got torch.int8 values \[3\]"):
        MaskedGAE(gamma=0.9, lmbda=0.9, value_network=None)(td)


def test_steps_to_next_obs_is_rejected():
    td = rollout_td()
    td["steps_to_next_obs"] = torch.ones(3, 30, 1)
    with pytest.raises(ValueError, match="steps_to_next_obs"):
        MaskedGAE(gamma=0.9, lmbda=0.9, value_network=None)(td)


# --- a rollout from a TorchRL GymEnv ------------------------------------------------------------


class PromptThenAct(gym.Env):
    """Three prompt tokens (masked), three actions, a two-token masked reply with the reward."""

    metadata = {"render_modes": []}

    def __init__(self):
        self.observation_space = gym.spaces.Dict(
            {
                "tokens": gym.spaces.Box(0, 9, shape=(4,), dtype=np.int64),
                "loss_mask": gym.spaces.Box(0, 1, shape=(1,), dtype=np.int8),
            }
        )
        self.action_space = gym.spaces.Discrete(10)
        self._mask = [0, 0, 0, 1, 1, 1, 0, 0]

    def _obs(self):
        return {
            "tokens": np.full(4, self.t % 10, dtype=np.int64),
            "loss_mask": np.array([self._mask[self.t]], dtype=np.int8),
        }

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.score = 0, 0
        return self._obs(), {}

    def step(self, action):
        if self._mask[self.t]:
            self.score += int(action == 3)
        self.t += 1
        terminated = self.t == len(self._mask)
        reward = float(self.score) if terminated else 0.0
        if terminated:
            self.t = 0  # the observation after the end is never used
        return self._obs(), reward, terminated, False, {}


def test_gym_env_rollout_goes_through_masked_gae_unchanged():
    env = GymWrapper(PromptThenAct())
    env.set_seed(0)
    rollout = env.rollout(16, break_when_any_done=False)
    assert rollout["loss_mask"].dtype == torch.int8
    assert rollout["loss_mask"].squeeze(-1).tolist() == [0, 0, 0, 1, 1, 1, 0, 0] * 2
    g = torch.Generator().manual_seed(0)
    values = torch.randn(17, 1, generator=g)
    rollout["state_value"] = values[:-1]
    rollout["next", "state_value"] = values[1:]  # a critic evaluated on the next observations
    MaskedGAE(gamma=0.99, lmbda=0.95, value_network=None)(rollout)
    mask = rollout["loss_mask"].bool()
    assert rollout["advantage"][~mask].abs().max() == 0
    # The terminal reward on the masked last step is credited to the last action (t = 5, 13).
    ref_adv, _ = serial_masked_gae_batch(
        0.99, 0.95, *(rollout[k].unsqueeze(0).double() for k in
                      ["state_value", ("next", "state_value"), ("next", "reward")]),
        rollout["next", "done"].unsqueeze(0), rollout["next", "terminated"].unsqueeze(0),
        mask.squeeze(-1).unsqueeze(0),
    )
    torch.testing.assert_close(rollout["advantage"].double(), ref_adv[0], rtol=1e-5, atol=1e-5)
    v = rollout["state_value"]
    for last_action in (5, 13):
        expected = rollout["next", "reward"][last_action + 2] - v[last_action]
        torch.testing.assert_close(rollout["advantage"][last_action], expected)


@pytest.mark.parametrize("kwargs, match", [
    (dict(gamma=-1.0, lmbda=0.95), r"gamma must be in \[0, 1\], got -1.0"),
    (dict(gamma=0.99, lmbda=float("nan")), r"lmbda must be in \[0, 1\], got nan"),
    (dict(gamma=torch.tensor([0.9, 0.8]), lmbda=0.95), "gamma must be a float or a one-element tensor"),
])
def test_bad_gamma_or_lmbda_is_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MaskedGAE(value_network=None, **kwargs)


class CountingCritic(torch.nn.Module):
    """A linear critic that records how many observations each call evaluates."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)
        self.calls = []

    def forward(self, obs):
        self.calls.append(obs.shape[:-1].numel())
        return self.linear(obs)


def critic_rollout(seed, p_mask=0.3, p_done=0.1, batch=4, horizon=40):
    g = torch.Generator().manual_seed(seed)
    value, next_value, reward, done, terminated, mask = make_rollout(
        batch, horizon, p_mask=p_mask, p_done=p_done, seed=seed, dtype=torch.float32)
    obs = torch.randn(batch, horizon + 1, 3, generator=g)
    # Cut rows, truncations (done, not terminated) and terminations all occur.
    return TensorDict({"obs": obs[:, :-1], "loss_mask": mask.to(torch.int8),
                       "next": {"obs": obs[:, 1:], "reward": reward, "done": done,
                                "terminated": terminated}}, batch_size=[batch, horizon])


def expected_reads(td):
    trainable = td["loss_mask"].bool()
    end = td["next", "done"].squeeze(-1).clone()
    end[:, -1] = True
    return trainable, trainable | (end & ~td["next", "terminated"].squeeze(-1))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("p_mask", [0.05, 0.3, 1.0])
def test_value_steps_read_equals_every_step_and_runs_the_critic_only_where_read(seed, p_mask):
    torch.manual_seed(seed)
    net = CountingCritic()
    critic = TensorDictModule(net, in_keys=["obs"], out_keys=["state_value"])
    td = critic_rollout(seed, p_mask=p_mask)
    every, read = td.clone(), td.clone()
    MaskedGAE(gamma=0.95, lmbda=0.9, value_network=critic, value_steps="all")(every)
    assert sum(net.calls) >= td.numel()  # every step (TorchRL vmaps V and V' into one call)
    net.calls.clear()
    MaskedGAE(gamma=0.95, lmbda=0.9, value_network=critic)(read)  # "read" is the default
    value_read, next_read = expected_reads(td)
    assert net.calls == [int(value_read.sum()), int(next_read.sum())]
    # Equal up to the matrix product's summation order on a smaller batch.
    for key in ("advantage", "value_target"):
        torch.testing.assert_close(read[key], every[key], rtol=1e-6, atol=1e-6, msg=key)
    # The stored values: the critic's where read, NaN elsewhere (never read by the rule).
    for key, where in (("state_value", value_read), (("next", "state_value"), next_read)):
        torch.testing.assert_close(read[key][where], every[key][where], rtol=1e-6, atol=1e-6)
        assert read[key][~where].isnan().all()


def test_value_steps_read_with_the_loss_parameters_equals_every_step():
    from torchrl.modules import ProbabilisticActor, ValueOperator

    from masked_rl import MaskedClipPPOLoss

    torch.manual_seed(0)
    actor = ProbabilisticActor(TensorDictModule(torch.nn.Linear(3, 4), ["obs"], ["logits"]),
                               in_keys=["logits"], distribution_class=torch.distributions.Categorical,
                               return_log_prob=True)
    critic = ValueOperator(torch.nn.Linear(3, 1), in_keys=["obs"])
    td = critic_rollout(3)
    td["action"] = torch.randint(4, td.shape)
    td["action_log_prob"] = torch.randn(td.shape) - 1.4
    out = {}
    for steps in ("read", "all"):
        loss = MaskedClipPPOLoss(actor, critic)
        loss.make_value_estimator("gae", gamma=0.9, lmbda=0.8, value_steps=steps)
        out[steps] = loss(td.clone())  # the estimator runs inside, with the loss's detached params
    for name in ("loss_objective", "loss_critic", "loss_entropy"):
        torch.testing.assert_close(out["read"][name], out["all"][name], rtol=1e-6, atol=1e-6)
        assert out["read"][name].isfinite().all()


@pytest.mark.parametrize("options", [dict(masked_value_targets=True), dict(shifted=True)])
def test_value_steps_read_runs_every_step_where_the_loss_or_torchrl_needs_them(options):
    net = CountingCritic()
    critic = TensorDictModule(net, in_keys=["obs"], out_keys=["state_value"])
    td = critic_rollout(1)
    MaskedGAE(gamma=0.95, lmbda=0.9, value_network=critic, **options)(td)
    assert sum(net.calls) >= td.numel()  # every step seen
    assert not td["state_value"].isnan().any()


def test_value_steps_is_checked():
    with pytest.raises(ValueError, match=r"value_steps must be one of \('read', 'all'\), got 'some'"):
        MaskedGAE(gamma=0.9, lmbda=0.9, value_network=None, value_steps="some")


# --- TorchRL options that keep their meaning (#29) -----------------------------------------


def stored_values_td(all_ones, seed=5):
    """A value-network rollout that already holds values the critic would not give."""
    td = value_network_td(batch=3, horizon=16, seed=seed)
    g = torch.Generator().manual_seed(seed)
    td["state_value"] = torch.randn(3, 16, 1, generator=g)
    td["next", "state_value"] = torch.randn(3, 16, 1, generator=g)
    if all_ones:
        td["loss_mask"] = torch.ones_like(td["loss_mask"])
    return td


@pytest.mark.parametrize("value_steps", ["read", "all"])
def test_skip_existing_reads_stored_values_as_torchrl_gae(value_steps):
    torch.manual_seed(0)
    critic = TensorDictModule(torch.nn.Linear(3, 1), in_keys=["obs"], out_keys=["state_value"])
    td = stored_values_td(all_ones=True)
    ours, theirs = td.clone(), td.clone()
    MaskedGAE(gamma=0.95, lmbda=0.9, value_network=critic, skip_existing=True,
              value_steps=value_steps)(ours)
    GAE(gamma=0.95, lmbda=0.9, value_network=critic, skip_existing=True)(theirs)
    for key in ("advantage", "value_target"):
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6)
    for key in ("state_value", ("next", "state_value")):  # neither recomputed nor overwritten
        assert torch.equal(ours[key], td[key]) and torch.equal(theirs[key], td[key])


def test_skip_existing_on_a_partial_mask_uses_the_stored_values_and_keeps_them():
    torch.manual_seed(0)
    critic = TensorDictModule(torch.nn.Linear(3, 1), in_keys=["obs"], out_keys=["state_value"])
    td = stored_values_td(all_ones=False)
    assert 0 < td["loss_mask"].float().mean() < 1
    out = MaskedGAE(gamma=0.95, lmbda=0.9, value_network=critic, skip_existing=True)(td.clone())
    expected = functional_on(td, 0.95, 0.9)
    torch.testing.assert_close(out["advantage"], expected[0])
    torch.testing.assert_close(out["value_target"], expected[1])
    for key in ("state_value", ("next", "state_value")):
        assert torch.equal(out[key], td[key])  # no NaN written at masked steps
    # Without skip_existing the critic runs where the rule reads (another answer).
    fresh = MaskedGAE(gamma=0.95, lmbda=0.9, value_network=critic)(td.clone())
    assert not torch.allclose(fresh["advantage"], out["advantage"])


@pytest.mark.parametrize("value_steps", ["read", "all"])
@pytest.mark.parametrize("with_network", [False, True])
def test_empty_time_gives_empty_outputs(value_steps, with_network):
    torch.manual_seed(0)
    td = value_network_td(batch=2, horizon=0) if with_network else rollout_td(2, 0)
    critic = TensorDictModule(torch.nn.Linear(3, 1), in_keys=["obs"], out_keys=["state_value"])
    out = MaskedGAE(gamma=0.9, lmbda=0.8, value_network=critic if with_network else None,
                    value_steps=value_steps)(td)
    assert out["advantage"].shape == out["value_target"].shape == (2, 0, 1)


def test_vectorized_is_refused():
    with pytest.raises(TypeError, match="no vectorized argument"):
        MaskedGAE(gamma=0.9, lmbda=0.8, value_network=None, vectorized=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_average_gae_on_half_precision_is_standardised_in_float32(dtype):
    td = rollout_td(8, 10_000, seed=3, p_mask=0.9, p_done=0.001)
    td["next", "reward"] = 20 * td["next", "reward"]  # advantages whose squares sum past 65504
    half = td.apply(lambda x: x.to(dtype) if x.is_floating_point() else x)
    out = MaskedGAE(gamma=0.99, lmbda=0.95, value_network=None, average_gae=True)(half)
    full = MaskedGAE(gamma=0.99, lmbda=0.95, value_network=None, average_gae=True)(
        half.apply(lambda x: x.double() if x.is_floating_point() else x))
    assert out["advantage"].dtype == dtype and torch.isfinite(out["advantage"]).all()
    torch.testing.assert_close(out["advantage"].double(), full["advantage"], rtol=0.02, atol=0.02)
