"""The baseline estimators of the reference experiment against plain serial implementations of their rules."""

from __future__ import annotations

import pytest
import torch
from masked_gae_reference import make_rollout, serial_masked_value_targets_batch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.modules import ProbabilisticActor, ValueOperator
from torchrl.objectives.value import GAE

from masked_rl import MaskedClipPPOLoss
from masked_rl_examples.ppo_tool_use.baselines import PlainGAE, TerminalOnlyGAE, ZeroedGAE


# --- plain serial references: one row of Python floats, read literally off the docstrings ---------


def serial_zeroed_gae(gamma, lmbda, value, next_value, reward, done, terminated, mask, next_mask):
    """Plain GAE, one step at a time, on values and rewards multiplied by the masks, after each
    episode's reward on a masked last step is moved to the episode's last trainable step."""
    horizon = len(value)
    reward = list(reward)
    start = 0
    for end in range(horizon):
        if done[end]:
            actions = [t for t in range(start, end + 1) if mask[t]]
            if actions and not mask[end]:
                reward[actions[-1]] += reward[end]
                reward[end] = 0.0
            start = end + 1
    advantage, target = [0.0] * horizon, [0.0] * horizon
    carry = 0.0
    for t in reversed(range(horizon)):
        v, nv, r = value[t] * mask[t], next_value[t] * next_mask[t], reward[t] * mask[t]
        if t == horizon - 1 or done[t]:
            carry = 0.0  # nothing flows back across an episode end or the row's end
        delta = r + gamma * nv * (1 - terminated[t]) - v
        carry = delta + gamma * lmbda * carry
        advantage[t], target[t] = carry, carry + v
    return advantage, target


def serial_terminal_only_gae(gamma, lmbda, value, next_value, reward, done, terminated, mask):
    """One episode at a time: GAE over its trainable steps, rewards of trainable steps only plus the
    terminal reward on the last one, zero bootstrap at an episode end, V' at a cut row's end."""
    horizon = len(value)
    advantage, target = [0.0] * horizon, [0.0] * horizon
    start = 0
    while start < horizon:
        end = start
        while not done[end] and end < horizon - 1:
            end += 1
        steps = [t for t in range(start, end + 1) if mask[t]]
        carry = 0.0
        for j in reversed(range(len(steps))):
            t = steps[j]
            r = reward[t]
            if j == len(steps) - 1:
                if done[end] and t != end:
                    r += reward[end]  # the terminal reward, moved
                bootstrap = 0.0 if done[end] else next_value[end]
            else:
                bootstrap = value[steps[j + 1]]
            carry = r + gamma * bootstrap - value[t] + gamma * lmbda * carry
            advantage[t], target[t] = carry, carry + value[t]
        start = end + 1
    return advantage, target


def f64(x):
    """TorchRL keeps gamma and lmbda as tensors: a float64 one keeps float64 exactness."""
    return torch.tensor(x, dtype=torch.float64)


def serial_batch(reference, *tensors, **kwargs):
    rows = [reference(*kwargs.values(), *[x[b].reshape(-1).tolist() for x in tensors])
            for b in range(tensors[0].shape[0])]
    return tuple(torch.tensor([row[i] for row in rows], dtype=torch.float64).unsqueeze(-1)
                 for i in range(2))


def rollout(seed, batch=6, horizon=40):
    """Random rows: several episodes, terminations, truncations (done, not terminated), rows cut
    mid-episode, V' == V[t + 1] inside episodes, and the next observation's mask."""
    value, next_value, reward, done, terminated, mask = make_rollout(
        batch, horizon, p_mask=0.4, p_done=0.1, p_term=0.5, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    next_mask = torch.cat((mask[:, 1:], torch.rand(batch, 1, generator=g) < 0.4), dim=1)
    next_mask = torch.where(done.squeeze(-1), torch.rand(batch, horizon, generator=g) < 0.4, next_mask)
    assert (done & ~terminated).any() and (~done[:, -1]).any()  # truncations and cut rows
    return value, next_value, reward, done, terminated, mask, next_mask


def as_tensordict(value, next_value, reward, done, terminated, mask, next_mask):
    return TensorDict({
        "loss_mask": mask.to(torch.int8),
        "state_value": value,
        "next": {"loss_mask": next_mask, "reward": reward, "done": done, "terminated": terminated,
                 "state_value": next_value},
    }, batch_size=mask.shape)


# --- the rules --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma, lmbda", [(0.9, 0.8), (1.0, 1.0), (0.0, 0.5)])
def test_zeroed_matches_its_serial_rule(seed, gamma, lmbda):
    data = rollout(seed)
    td = as_tensordict(*data)
    before = td.clone()
    ZeroedGAE(gamma=f64(gamma), lmbda=f64(lmbda), value_network=None)(td)
    advantage, target = serial_batch(serial_zeroed_gae, *data, gamma=gamma, lmbda=lmbda)
    torch.testing.assert_close(td["advantage"], advantage, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(td["value_target"], target, rtol=1e-10, atol=1e-10)
    # The caller's inputs are read, never rewritten.
    assert (td.select(*before.keys(True, True)) == before).all()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma, lmbda", [(0.9, 0.8), (1.0, 1.0), (0.0, 0.5)])
def test_terminal_only_matches_its_serial_rule(seed, gamma, lmbda):
    value, next_value, reward, done, terminated, mask, next_mask = data = rollout(seed)
    td = as_tensordict(*data)
    before = td.clone()
    TerminalOnlyGAE(gamma=f64(gamma), lmbda=f64(lmbda), value_network=None)(td)
    advantage, target = serial_batch(serial_terminal_only_gae, value, next_value, reward, done,
                                     terminated, mask, gamma=gamma, lmbda=lmbda)
    torch.testing.assert_close(td["advantage"], advantage, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(td["value_target"], target, rtol=1e-10, atol=1e-10)
    assert (td["advantage"][~mask] == 0).all() and (td["value_target"][~mask] == 0).all()
    assert (td.select(*before.keys(True, True)) == before).all()


def test_terminal_only_with_masked_value_targets():
    value, next_value, reward, done, terminated, mask, next_mask = data = rollout(5)
    td = as_tensordict(*data)
    TerminalOnlyGAE(gamma=f64(0.9), lmbda=f64(0.8), value_network=None, masked_value_targets=True)(td)
    # The extension's targets for terminal-only's rewards (masked ones dropped but at episode
    # ends) and terminations (every episode end).
    kept = torch.where(mask.unsqueeze(-1) | done, reward, 0.0)
    target, has_target = serial_masked_value_targets_batch(0.9, 0.8, value, next_value, kept, done, done, mask)
    torch.testing.assert_close(td["value_target"], target, rtol=1e-10, atol=1e-10)
    assert torch.equal(td["value_target_mask"], has_target)
    assert (has_target & ~mask.unsqueeze(-1)).any()
    advantage, _ = serial_batch(serial_terminal_only_gae, value, next_value, reward, done, terminated,
                                mask, gamma=0.9, lmbda=0.8)
    torch.testing.assert_close(td["advantage"], advantage, rtol=1e-10, atol=1e-10)


def test_with_an_all_ones_mask_both_are_torchrl_gae():
    value, next_value, reward, done, terminated, mask, next_mask = rollout(7)
    ones = torch.ones_like(mask)
    td = as_tensordict(value, next_value, reward, done, terminated, ones, ones)
    plain = GAE(gamma=0.95, lmbda=0.9, value_network=None)
    zeroed = ZeroedGAE(gamma=0.95, lmbda=0.9, value_network=None)(td.clone())
    torch.testing.assert_close(zeroed["advantage"], plain(td.clone())["advantage"])
    # terminal-only bootstraps no truncation: TorchRL's GAE with terminated = done.
    terminal_only = TerminalOnlyGAE(gamma=0.95, lmbda=0.9, value_network=None)(td.clone())
    td["next", "terminated"] = done
    torch.testing.assert_close(terminal_only["advantage"], plain(td)["advantage"])


def test_both_move_the_terminal_reward_and_drop_other_masked_rewards():
    # One episode: trainable steps 0 and 2, a shaping reward on masked step 1, the terminal
    # reward on masked step 4, values 0.
    mask = torch.tensor([[1, 0, 1, 0, 0]])
    reward = torch.tensor([[0.0, 0.5, 0.0, 0.0, 1.0]]).unsqueeze(-1)
    done = torch.tensor([[0, 0, 0, 0, 1]], dtype=torch.bool).unsqueeze(-1)
    zeros = torch.zeros(1, 5, 1)
    td = as_tensordict(zeros, zeros, reward, done, done, mask, torch.tensor([[0, 1, 0, 0, 0]]))
    # zeroed: every step a transition, so the moved reward also reaches the masked step 1.
    zeroed = ZeroedGAE(gamma=1.0, lmbda=1.0, value_network=None)(td.clone())["advantage"]
    assert zeroed.squeeze(-1).tolist() == [[1.0, 1.0, 1.0, 0.0, 0.0]]
    advantage = TerminalOnlyGAE(gamma=1.0, lmbda=1.0, value_network=None)(td.clone())["advantage"]
    assert advantage.squeeze(-1).tolist() == [[1.0, 0.0, 1.0, 0.0, 0.0]]


# --- TorchRL integration ----------------------------------------------------------------------


def with_observations(td, seed=0):
    g = torch.Generator().manual_seed(seed)
    td = td.exclude("state_value", ("next", "state_value"))
    td["observation"] = torch.randn(*td.batch_size, 3, generator=g, dtype=torch.float64)
    td["next", "observation"] = torch.randn(*td.batch_size, 3, generator=g, dtype=torch.float64)
    return td


@pytest.mark.parametrize("estimator_cls", [ZeroedGAE, TerminalOnlyGAE])
def test_value_network_path_equals_precomputed_values(estimator_cls):
    torch.manual_seed(0)
    critic = ValueOperator(torch.nn.Linear(3, 1).double(), in_keys=["observation"])
    td = with_observations(as_tensordict(*rollout(1)))
    with torch.no_grad():
        precomputed = td.clone()
        precomputed["state_value"] = critic(td.clone())["state_value"]
        precomputed["next", "state_value"] = critic(td["next"].clone())["state_value"]
        expected = estimator_cls(gamma=0.9, lmbda=0.8, value_network=None)(precomputed)
        out = estimator_cls(gamma=0.9, lmbda=0.8, value_network=critic)(td.clone())
        target = estimator_cls(gamma=0.9, lmbda=0.8, value_network=critic).value_estimate(td.clone())
    torch.testing.assert_close(out["advantage"], expected["advantage"])
    torch.testing.assert_close(out["value_target"], expected["value_target"])
    torch.testing.assert_close(target, expected["value_target"])


@pytest.mark.parametrize("estimator_cls", [ZeroedGAE, TerminalOnlyGAE])
def test_installable_in_the_masked_ppo_loss(estimator_cls):
    torch.manual_seed(0)
    actor = ProbabilisticActor(
        TensorDictModule(torch.nn.Linear(3, 4).double(), ["observation"], ["logits"]),
        in_keys=["logits"], distribution_class=torch.distributions.Categorical, return_log_prob=True)
    critic = ValueOperator(torch.nn.Linear(3, 1).double(), in_keys=["observation"])
    loss = MaskedClipPPOLoss(actor, critic, normalize_advantage=True)
    estimator = estimator_cls(gamma=0.9, lmbda=0.8, value_network=critic)
    loss.make_value_estimator(estimator)
    assert loss.value_estimator is estimator
    td = with_observations(as_tensordict(*rollout(2)))
    td["action"] = torch.randint(4, td.batch_size)
    td["action_log_prob"] = torch.full(td.batch_size, -1.4, dtype=torch.float64)
    out = loss(td)
    assert torch.isfinite(out["loss_objective"]) and torch.isfinite(out["loss_critic"])


def collected_batches(complete: bool, batches: int = 3):
    """Batches of ``ToolUse-v0`` from a TorchRL collector and an untrained policy: truncations (a
    30-step budget, not terminated), rows cut mid-episode, masked tool outputs; with
    ``complete``, :class:`masked_rl.CompleteEpisodes`' ``[B, P + T]`` output."""
    from torchrl.collectors import Collector

    from masked_rl import CompleteEpisodes
    from masked_rl_examples.ppo_tool_use.utils import make_actor_critic, make_env

    torch.manual_seed(0)
    env = make_env("MaskedRL/ToolUse-v0", 6, max_steps=30)
    actor, critic = make_actor_critic(env, 4, 16, 1)
    collector = Collector(env, actor, frames_per_batch=6 * 50, total_frames=6 * 50 * batches,
                          auto_register_policy_transforms=False)
    episodes = CompleteEpisodes()
    out = [episodes(batch) if complete else batch for batch in collector]
    collector.shutdown()
    return critic, out


def counting(critic):
    """``critic`` and the list of how many steps each of its calls evaluates."""
    calls = []
    critic.register_forward_hook(lambda module, args, output: calls.append(args[0].batch_size.numel()))
    return calls


@pytest.mark.parametrize("complete", [True, False])
def test_plain_equals_torchrl_gae_on_collected_batches_with_one_critic_pass(complete):
    """PlainGAE is TorchRL's GAE on every step that counts (the valid ones), with the critic run
    once per valid step plus once per bootstrap that no later step's observation gives."""
    critic, batches = collected_batches(complete)
    calls = counting(critic)
    for td in batches:
        done, terminated = (td["next", key].squeeze(-1) for key in ("done", "terminated"))
        assert (done & ~terminated).any()  # truncations: V' read at the next observation
        valid = td.get(("collector", "mask"), torch.ones_like(done))
        with torch.no_grad():
            expected = GAE(gamma=0.95, lmbda=0.9, value_network=critic)(td.clone())
            calls.clear()
            out = PlainGAE(gamma=0.95, lmbda=0.9, value_network=critic)(td.clone())
        for key in ("advantage", "value_target", "state_value"):
            torch.testing.assert_close(out[key][valid], expected[key][valid])
        cut = torch.zeros_like(done)
        cut[..., -1] = ~done[..., -1]  # a row's last step, unfinished: V' from the network
        assert sum(calls) == int(valid.sum() + (valid & ((done & ~terminated) | cut)).sum())
        if complete:
            assert (~valid).any() and sum(calls) < 0.6 * 2 * td.numel()  # GAE: 2 x numel


def test_plain_on_a_multi_worker_batch_and_on_one_without_a_valid_step():
    """A ``[workers, envs, T]`` batch equals GAE on its valid steps; a batch with no valid step
    (no episode ended yet) evaluates nothing and gives finite outputs."""
    critic, batches = collected_batches(complete=True, batches=1)
    td = torch.stack([batches[0][:3], batches[0][3:]])  # [2, 3, P + T], as two workers
    valid = td["collector", "mask"]
    with torch.no_grad():
        expected = GAE(gamma=0.95, lmbda=0.9, value_network=critic)(td.clone())
        out = PlainGAE(gamma=0.95, lmbda=0.9, value_network=critic)(td.clone())
        torch.testing.assert_close(out["advantage"][valid], expected["advantage"][valid])
        td["collector", "mask"] = torch.zeros_like(valid)
        calls = counting(critic)
        out = PlainGAE(gamma=0.95, lmbda=0.9, value_network=critic)(td)
    assert sum(calls) == 0 and torch.isfinite(out["advantage"]).all()


def test_zeroed_runs_the_critic_only_where_its_values_are_not_zeroed():
    critic, batches = collected_batches(complete=True)
    calls = counting(critic)
    for td in batches:
        valid = td["collector", "mask"]
        mask = td["loss_mask"].squeeze(-1).bool()
        with torch.no_grad():
            everywhere = td.clone()
            everywhere["state_value"] = critic(td.clone())["state_value"]
            everywhere["next", "state_value"] = critic(td["next"].clone())["state_value"]
            expected = ZeroedGAE(gamma=0.95, lmbda=0.9, value_network=None)(everywhere)
            calls.clear()
            out = ZeroedGAE(gamma=0.95, lmbda=0.9, value_network=critic)(td.clone())
        for key in ("advantage", "value_target"):
            torch.testing.assert_close(out[key][valid], expected[key][valid])
        assert int(mask.sum()) > 0 and sum(calls) <= int((valid & mask).sum()) + td.shape[0] * 4


def test_renamed_mask_key_and_missing_keys():
    data = rollout(3)
    td = as_tensordict(*data)
    td.rename_key_("loss_mask", "assistant_mask")
    td.rename_key_(("next", "loss_mask"), ("next", "assistant_mask"))
    zeroed = ZeroedGAE(gamma=0.9, lmbda=0.8, value_network=None)
    with pytest.raises(KeyError) as error:
        zeroed(td.clone())
    assert error.value.args[0].startswith("ZeroedGAE needs the key 'loss_mask' in the input")
    zeroed.set_keys(loss_mask="assistant_mask")
    advantage, _ = serial_batch(serial_zeroed_gae, *data, gamma=0.9, lmbda=0.8)
    torch.testing.assert_close(zeroed(td.clone())["advantage"], advantage, rtol=1e-5, atol=1e-5)
    terminal_only = TerminalOnlyGAE(gamma=0.9, lmbda=0.8, value_network=None)
    terminal_only.set_keys(loss_mask="assistant_mask")
    assert "advantage" in terminal_only(td.clone()).keys()
    del td["next", "assistant_mask"]
    with pytest.raises(KeyError) as error:
        zeroed(td)
    assert error.value.args[0].startswith("ZeroedGAE needs the key ('next', 'assistant_mask')")


def test_docstring_examples_run():
    import doctest

    import masked_rl_examples.ppo_tool_use.baselines as baselines

    failed, attempted = doctest.testmod(baselines)
    assert failed == 0 and attempted > 0
