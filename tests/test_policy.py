"""SkipMaskedSteps: the network sees trainable rows only, their outputs are the policy's, and the
placeholders of masked rows never reach the loss."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.collectors import Collector
from torchrl.data import OneHot
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import ActorValueOperator, ProbabilisticActor, ValueOperator

from masked_rl import MaskedClipPPOLoss
from masked_rl.loss import select_trainable_steps
from masked_rl.policy import SkipMaskedSteps
from masked_rl_envs import make_torchrl_env

OBS, ACTIONS = 6, 5


class RowCounter(torch.nn.Module):
    """A linear layer that records how many rows each call sees."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.linear = torch.nn.Linear(n_in, n_out)
        self.calls: list[int] = []

    def forward(self, x):
        self.calls.append(x.shape[:-1].numel())
        return self.linear(x)


def make_actor(spec=None):
    torch.manual_seed(0)
    net = RowCounter(OBS, ACTIONS)
    actor = ProbabilisticActor(
        TensorDictModule(net, ["observation"], ["logits"]),
        in_keys=["logits"],
        spec=spec,
        distribution_class=torch.distributions.Categorical,
        return_log_prob=True,
    )
    return actor, net


def make_input(batch_size, p_trainable=0.3, seed=1):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(*batch_size, 1, generator=g) < p_trainable).to(torch.int8)
    return TensorDict(
        observation=torch.randn(*batch_size, OBS, generator=g), loss_mask=mask, batch_size=batch_size
    )


@pytest.mark.parametrize("batch_size", [(), (7,), (3, 4)])
def test_network_sees_only_trainable_rows_and_their_outputs_are_the_policys(batch_size):
    actor, net = make_actor()
    policy = SkipMaskedSteps(actor)
    policy(make_input(batch_size, p_trainable=1.0))  # learns the output shapes
    for seed in range(6):  # batch [] draws a trainable and a masked row among these seeds
        td = make_input(batch_size, seed=seed)
        mask = td["loss_mask"].squeeze(-1).bool()
        net.calls.clear()
        with set_exploration_type(ExplorationType.DETERMINISTIC):
            out = policy(td.clone())
            calls = list(net.calls)
            reference = actor(td.clone())
        assert sum(calls) == int(mask.sum()) and len(calls) <= 1
        assert out.batch_size == td.batch_size
        torch.testing.assert_close(out["logits"][mask], reference["logits"][mask])
        torch.testing.assert_close(out["action_log_prob"][mask], reference["action_log_prob"][mask])
        assert torch.equal(out["action"][mask], reference["action"][mask])
        # Masked rows: zeros of the policy's shapes and dtypes.
        for key in ("logits", "action", "action_log_prob"):
            assert out[key].dtype == reference[key].dtype and out[key].shape == reference[key].shape
            assert (out[key][~mask] == 0).all()


def test_random_mode_samples_from_the_policys_distribution():
    actor, _ = make_actor()
    policy = SkipMaskedSteps(actor)
    td = make_input((400,), p_trainable=0.5)
    mask = td["loss_mask"].squeeze(-1).bool()
    with set_exploration_type(ExplorationType.RANDOM):
        out = policy(td.clone())
        deterministic = actor(td.clone()).get("logits").argmax(-1)
    logits = out["logits"][mask]
    log_prob = torch.log_softmax(logits, -1).gather(-1, out["action"][mask].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out["action_log_prob"][mask], log_prob)
    assert (out["action"][mask] != deterministic[mask]).any()  # sampled, not the mode
    assert (out["action"][~mask] == 0).all()


def test_all_rows_trainable_is_the_unwrapped_call_under_the_same_rng_state():
    actor, net = make_actor()
    policy = SkipMaskedSteps(actor)
    td = make_input((3, 50), p_trainable=1.0)
    with set_exploration_type(ExplorationType.RANDOM):
        torch.manual_seed(5)
        out = policy(td.clone())
        torch.manual_seed(5)
        reference = actor(td.clone())
    assert (out == reference).all()
    assert net.calls[-1] == 150


def test_no_trainable_row_calls_the_network_once_to_learn_shapes_then_never():
    actor, net = make_actor()
    policy = SkipMaskedSteps(actor)
    td = make_input((4,), p_trainable=0.0)
    rng = torch.get_rng_state()
    with set_exploration_type(ExplorationType.RANDOM):
        for _ in range(3):
            out = policy(td.clone())
    assert net.calls == [1]  # one probe row, the first time only
    assert torch.equal(torch.get_rng_state(), rng)  # the probe is deterministic: no draws
    assert (out["action"] == 0).all() and (out["action_log_prob"] == 0).all()
    assert out["logits"].shape == (4, ACTIONS)


def test_given_placeholders_and_invalid_zeros():
    actor, _ = make_actor()
    policy = SkipMaskedSteps(actor, placeholders={"action": 2, "action_log_prob": float("nan")})
    out = policy(make_input((6,), p_trainable=0.0))
    assert (out["action"] == 2).all() and out["action_log_prob"].isnan().all()
    assert (out["logits"] == 0).all()

    one_hot_actor = ProbabilisticActor(
        TensorDictModule(torch.nn.Linear(OBS, ACTIONS), ["observation"], ["logits"]),
        in_keys=["logits"],
        spec=OneHot(ACTIONS),
        distribution_class=torch.distributions.OneHotCategorical,
        return_log_prob=True,
    )
    with pytest.raises(ValueError, match=r"zeros are not a valid 'action'.*OneHot.*placeholders="):
        SkipMaskedSteps(one_hot_actor)(make_input((6,)))
    first = torch.nn.functional.one_hot(torch.tensor(0), ACTIONS)
    out = SkipMaskedSteps(one_hot_actor, placeholders={"action": first})(make_input((6,)))
    assert (out["action"].sum(-1) == 1).all()


def test_bad_input_raises_clear_errors():
    actor, _ = make_actor()
    with pytest.raises(TypeError, match="policy must be a TensorDictModuleBase"):
        SkipMaskedSteps(torch.nn.Linear(2, 2))
    with pytest.raises(KeyError, match=r"placeholders must name output keys.*\['value'\]"):
        SkipMaskedSteps(actor, placeholders={"value": 0.0})
    with pytest.raises(ValueError, match=r"placeholders\['action'\] must have one row's shape \[\]"):
        SkipMaskedSteps(actor, placeholders={"action": torch.zeros(2)})(make_input((3,)))
    td = make_input((3,))
    with pytest.raises(KeyError, match="needs the loss mask 'assistant_mask'"):
        SkipMaskedSteps(actor, loss_mask_key="assistant_mask")(td)
    td["loss_mask"] = torch.full((3, 1), 2, dtype=torch.int8)
    with pytest.raises(ValueError, match="loss_mask must be bool or hold only 0 and 1"):
        SkipMaskedSteps(actor)(td)


def test_loss_mask_key_is_configurable_and_may_be_bool_without_feature_dim():
    actor, net = make_actor()
    policy = SkipMaskedSteps(actor, loss_mask_key=("agent", "mask"))
    td = make_input((8,))
    td["agent", "mask"] = td.pop("loss_mask").squeeze(-1).bool()
    policy(td)
    assert net.calls[-1] == int(td["agent", "mask"].sum())
    assert policy.in_keys == ["observation", ("agent", "mask")]


# --- with the real environment, a collector and the loss ---------------------------------------


def make_actor_value_operator(env):
    """A shared token-window encoder, a policy head and a value head, as in the recipe."""
    torch.manual_seed(0)
    vocab = env.action_spec.space.n
    window = env.observation_spec["tokens"].shape[-1]
    encoder = torch.nn.Sequential(torch.nn.Embedding(vocab, 4), torch.nn.Flatten(-2),
                                  torch.nn.Linear(4 * window, 16), torch.nn.Tanh())
    return ActorValueOperator(
        TensorDictModule(encoder, ["tokens"], ["features"]),
        ProbabilisticActor(
            TensorDictModule(torch.nn.Linear(16, vocab), ["features"], ["logits"]),
            in_keys=["logits"], spec=env.full_action_spec["action"],
            distribution_class=torch.distributions.Categorical, return_log_prob=True,
        ),
        ValueOperator(torch.nn.Linear(16, 1), in_keys=["features"]),
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_collector_rollout_on_the_tool_use_env(workers):
    env = make_torchrl_env("MaskedRL/ToolUse-v0", num_envs=4, workers=workers, serial=True, seed=0)
    operator = make_actor_value_operator(env)
    actor = operator.get_policy_operator()
    rows = []
    actor.module[0].module.register_forward_hook(
        lambda m, args, out: rows.append(out.shape[:-1].numel()))
    collector = Collector(env, SkipMaskedSteps(actor), frames_per_batch=4 * workers * 50,
                          total_frames=-1, auto_register_policy_transforms=False)
    collector.set_seed(0)
    rows.clear()  # the collector's own call at construction
    batch = next(iter(collector))
    collector.shutdown()
    assert batch.batch_size == ((4, 50) if workers == 1 else (2, 4, 50))
    mask = batch["loss_mask"].squeeze(-1).bool()
    assert 0 < mask.sum() < mask.numel() / 4
    assert sum(rows) == int(mask.sum())
    for key in ("action", "action_log_prob", "logits", "features"):
        assert (batch[key][~mask] == 0).all(), key
    assert (batch["action_log_prob"][mask] < 0).all()
    # Trainable actions were written into the transcript by the environment.
    assert torch.equal(batch["next", "tokens"][..., -1][mask], batch["action"][mask])


def test_whole_actor_value_operator_gets_a_state_value_placeholder():
    env = make_torchrl_env("MaskedRL/ToolUse-v0", num_envs=4, seed=0)
    operator = make_actor_value_operator(env)
    policy = SkipMaskedSteps(operator)
    assert policy.out_keys == ["features", "logits", "action", "action_log_prob", "state_value"]
    td = env.rollout(4, policy)[..., -1]  # after the 3-token prompt: the first agent step
    assert (td["loss_mask"] == 1).all()
    td["loss_mask"][1:] = 0
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        out = policy(td.clone())
        reference = operator(td.clone())
    for key in policy.out_keys:
        torch.testing.assert_close(out[key][:1], reference[key][:1])
        assert (out[key][1:] == 0).all() and out[key].shape == reference[key].shape


def test_placeholders_never_reach_the_loss():
    env = make_torchrl_env("MaskedRL/ToolUse-v0", num_envs=4, seed=0)
    operator = make_actor_value_operator(env)
    actor, critic = operator.get_policy_operator(), operator.get_value_operator()
    collector = Collector(env, SkipMaskedSteps(actor), frames_per_batch=4 * 60, total_frames=-1,
                          auto_register_policy_transforms=False)
    batch = next(iter(collector))
    collector.shutdown()
    mask = batch["loss_mask"].squeeze(-1).bool()
    loss = MaskedClipPPOLoss(actor, critic, normalize_advantage=True)

    def loss_and_grads(data):
        loss.zero_grad()
        out = loss(data.clone())
        total = out["loss_objective"] + out["loss_entropy"] + out["loss_critic"]
        total.backward()
        return total.detach(), [p.grad.clone() for p in loss.parameters() if p.grad is not None]

    total, grads = loss_and_grads(batch)
    changed = batch.clone()
    g = torch.Generator().manual_seed(3)
    for key in ("action", "action_log_prob", "logits", "features"):
        noise = torch.randint(0, 17, changed[key].shape, generator=g).to(changed[key].dtype)
        trainable = mask.view(*mask.shape, *[1] * (noise.ndim - mask.ndim))
        changed[key] = torch.where(trainable, changed[key], noise)
    assert not (changed == batch).all()
    total_changed, grads_changed = loss_and_grads(changed)
    assert len(grads) > 0 and torch.equal(total, total_changed)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_changed))
    assert (select_trainable_steps(changed)["loss_mask"] == 1).all()
