"""The masked PPO losses (MaskedClipPPOLoss, MaskedKLPENPPOLoss, MaskedPPOLoss) and
attach_masked_gae: PPO terms over trainable steps only.

docs/semantics.md, "The loss side".
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.modules import ProbabilisticActor, ValueOperator
from torchrl.objectives import ClipPPOLoss, KLPENPPOLoss, PPOLoss
from torchrl.objectives.utils import ValueEstimators
from torchrl.objectives.value import GAE

from masked_rl import (
    MaskedClipPPOLoss,
    MaskedGAE,
    MaskedKLPENPPOLoss,
    MaskedPPOLoss,
    attach_masked_gae,
    masked_standardize,
)
from masked_rl.loss import select_trainable_steps, training_step_masks

OBS_DIM, N_ACTIONS = 3, 4
GAMMA, LMBDA = 0.9, 0.8


def actor_critic(seed=0, value_key="state_value"):
    torch.manual_seed(seed)
    actor = ProbabilisticActor(
        TensorDictModule(nn.Linear(OBS_DIM, N_ACTIONS), ["observation"], ["logits"]),
        in_keys=["logits"],
        distribution_class=torch.distributions.Categorical,
        return_log_prob=True,
    )
    critic = ValueOperator(
        nn.Sequential(nn.Linear(OBS_DIM, 8), nn.Tanh(), nn.Linear(8, 1)),
        in_keys=["observation"],
        out_keys=[value_key],
    )
    return actor, critic


def rollout(actor, *, batch=3, horizon=12, seed=0):
    """A ``[B, T]`` batch shaped like a tool-use rollout.

    Every row ends an episode (a terminal reward on its last, masked step), row 0 has a second
    episode boundary in the middle, the behaviour log-probs are the actor's plus noise (so ratios
    differ from 1 and some are clipped), and roughly a third of the steps are trainable.
    """
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(batch, horizon + 1, OBS_DIM, generator=g)
    mask = torch.rand(batch, horizon, generator=g) < 0.35
    mask[:, 1] = True
    mask[:, -1] = False
    done = torch.zeros(batch, horizon, 1, dtype=torch.bool)
    done[:, -1] = True
    done[0, horizon // 2] = True
    reward = torch.zeros(batch, horizon, 1)
    reward[:, -1, 0] = torch.randint(0, 2, (batch,), generator=g).float()
    reward[1, 3, 0] = -0.5
    td = TensorDict(
        {
            "observation": obs[:, :-1],
            "loss_mask": mask.to(torch.int8).unsqueeze(-1),
            "action": torch.randint(0, N_ACTIONS, (batch, horizon), generator=g),
            "next": {
                "observation": obs[:, 1:],
                "reward": reward,
                "done": done,
                "terminated": done.clone(),
            },
        },
        batch_size=[batch, horizon],
    )
    with torch.no_grad():
        logits = actor.module[0](td.select("observation"))["logits"]
    log_prob = torch.distributions.Categorical(logits=logits).log_prob(td["action"])
    td["logits"] = logits
    td["action_log_prob"] = log_prob + 0.3 * torch.randn(log_prob.shape, generator=g)
    return td


def perturb_masked_steps(td, *, seed=1):
    """Overwrite what a masked step stores (but its reward and episode flags) with garbage."""
    g = torch.Generator().manual_seed(seed)
    out = td.clone()
    masked = out["loss_mask"].squeeze(-1) == 0
    n = int(masked.sum())
    out["observation"][masked] = 100 * torch.randn(n, OBS_DIM, generator=g)
    out["next", "observation"][masked] = 100 * torch.randn(n, OBS_DIM, generator=g)
    out["action"][masked] = 10**6  # not even a valid action
    out["action_log_prob"][masked] = float("nan")
    out["logits"][masked] = float("nan")
    for key in ("state_value", "advantage", "value_target"):
        if key in out.keys():
            out[key][masked] = float("nan")
    return out


def masked_clip(actor, critic, **kwargs):
    loss = MaskedClipPPOLoss(actor, critic, **kwargs)
    loss.make_value_estimator(gamma=GAMMA, lmbda=LMBDA)
    return loss


def attached(loss_cls):
    def make(actor, critic, **kwargs):
        loss = loss_cls(actor, critic, **kwargs)
        attach_masked_gae(loss, gamma=GAMMA, lmbda=LMBDA)
        return loss

    return make


MASKED = {ClipPPOLoss: MaskedClipPPOLoss, KLPENPPOLoss: MaskedKLPENPPOLoss, PPOLoss: MaskedPPOLoss}
ROUTES = {
    "MaskedClipPPOLoss": masked_clip,
    "attach-MaskedClipPPOLoss": attached(MaskedClipPPOLoss),
    "attach-MaskedKLPENPPOLoss": attached(MaskedKLPENPPOLoss),
    "attach-MaskedPPOLoss": attached(MaskedPPOLoss),
}
routes = pytest.mark.parametrize("make_loss", ROUTES.values(), ids=ROUTES.keys())
LOSS_TERMS = ("loss_objective", "loss_entropy", "loss_critic")


def outputs_and_grads(loss, td):
    loss.reset()  # KLPENPPOLoss adapts beta at every call
    out = loss(td)
    total = sum(out[k] for k in out.keys() if k.startswith("loss_"))
    params = [p for p in loss.parameters() if p.requires_grad]
    return out.detach(), torch.autograd.grad(total, params)


def with_masked_gae_advantage(td, critic):
    """``td`` with the advantage and value target written by MaskedGAE (a precomputing recipe)."""
    td = td.clone()
    with torch.no_grad():
        MaskedGAE(gamma=GAMMA, lmbda=LMBDA, value_network=critic)(td)
        critic(td)  # "state_value", read by clip_value
    return td


# --- the supported installation route ------------------------------------------------------


@pytest.mark.parametrize("loss_cls", [MaskedClipPPOLoss, MaskedKLPENPPOLoss, MaskedPPOLoss])
def test_attach_installs_masked_gae_with_the_losss_critic_and_keys(loss_cls):
    actor, critic = actor_critic(value_key="v")
    loss = loss_cls(actor, critic)
    loss.set_keys(value="v", advantage="adv", loss_mask="trainable")
    gae = attach_masked_gae(loss, gamma=0.5, lmbda=0.25)
    assert isinstance(gae, MaskedGAE)
    assert loss.value_estimator is gae
    assert gae.value_network is loss.critic_network
    assert (float(gae.gamma), float(gae.lmbda)) == (0.5, 0.25)
    assert gae.tensor_keys.value == "v" and gae.tensor_keys.advantage == "adv"
    assert gae.tensor_keys.loss_mask == "trainable"
    loss.set_keys(value_target="vt")  # later renames still reach the estimator
    assert gae.tensor_keys.value_target == "vt" and gae.tensor_keys.loss_mask == "trainable"


def test_assigning_value_estimator_does_not_install_it_in_torchrl():
    """Why attach_masked_gae uses make_value_estimator (see its docstring): plain assignment
    registers a child module and the loss keeps building its default GAE."""
    actor, critic = actor_critic()
    loss = MaskedClipPPOLoss(actor, critic)
    gae = MaskedGAE(gamma=GAMMA, lmbda=LMBDA, value_network=critic)
    loss.value_estimator = gae
    assert loss.value_estimator is not gae


def test_attach_twice_replaces_the_estimator_and_later_keys_reach_it():
    actor, critic = actor_critic()
    loss = MaskedClipPPOLoss(actor, critic)
    hooks = len(loss._forward_pre_hooks)
    attach_masked_gae(loss, gamma=GAMMA, lmbda=LMBDA)
    second = attach_masked_gae(loss, gamma=GAMMA, lmbda=LMBDA)
    loss.set_keys(loss_mask="m")
    assert loss.value_estimator is second and second.tensor_keys.loss_mask == "m"
    assert type(loss) is MaskedClipPPOLoss and len(loss._forward_pre_hooks) == hooks
    assert "m" in loss.in_keys and "loss_mask" not in loss.in_keys
    td = rollout(actor)
    td.rename_key_("loss_mask", "m")
    loss(td)  # reads the new key


@pytest.mark.parametrize("stock, masked", list(MASKED.items()))
def test_attach_refuses_a_stock_loss_and_names_its_masked_class(stock, masked):
    actor, critic = actor_critic()
    loss = stock(actor, critic)
    with pytest.raises(TypeError, match=f"masked_rl.{masked.__name__} with the same arguments"):
        attach_masked_gae(loss, gamma=GAMMA, lmbda=LMBDA)
    assert type(loss) is stock  # no class surgery
    assert isinstance(masked(actor, critic), stock)


@pytest.mark.parametrize("loss_cls", [MaskedClipPPOLoss, MaskedKLPENPPOLoss, MaskedPPOLoss])
def test_loss_mask_key_keeps_torchrls_meaning(loss_cls):
    """``loss.loss_mask_key`` is TorchRL's validity setting; ``tensor_keys.loss_mask`` names the
    trainable-step flag. A validity key given there removes its invalid steps too."""
    actor, critic = actor_critic()
    loss = loss_cls(actor, critic)
    assert loss.loss_mask_key == "auto" and loss.tensor_keys.loss_mask == "loss_mask"
    td = rollout(actor)
    valid = torch.ones(td.batch_size, dtype=torch.bool)
    valid[0] = False
    td["my_valid"] = valid
    loss.make_value_estimator(gamma=GAMMA, lmbda=LMBDA)
    loss.loss_mask_key = "my_valid"
    got = outputs_and_grads(loss, td)[0]
    loss.loss_mask_key = "auto"  # "my_valid" is not one of TorchRL's auto entries: all rows train
    auto = outputs_and_grads(loss, td)[0]
    td["loss_mask"][0] = 0
    expected = outputs_and_grads(loss, td)[0]
    for key in LOSS_TERMS:
        torch.testing.assert_close(got[key], expected[key], msg=key)
    assert not torch.equal(auto["loss_objective"], expected["loss_objective"])
    with pytest.raises(ValueError, match="loss_mask_key must be"):
        loss.loss_mask_key = 3


def test_loss_mask_key_as_a_constructor_or_attach_argument_is_a_clear_error():
    """It used to name the trainable-step key; TorchRL's losses would swallow it unread."""
    actor, critic = actor_critic()
    with pytest.raises(TypeError, match=r"set_keys\(loss_mask=...\)"):
        MaskedClipPPOLoss(actor, critic, loss_mask_key="m")
    with pytest.raises(TypeError, match=r"set_keys\(loss_mask=...\)"):
        attach_masked_gae(MaskedClipPPOLoss(actor, critic), gamma=GAMMA, lmbda=LMBDA, loss_mask_key="m")


def test_select_trainable_steps_honours_torchrl_validity():
    td = TensorDict({"loss_mask": torch.tensor([[1, 1, 0], [1, 0, 1]]), "x": torch.arange(6).view(2, 3),
                     "collector": {"mask": torch.tensor([[True, False, True], [True, True, True]])}},
                    batch_size=[2, 3])
    assert select_trainable_steps(td)["x"].tolist() == [0, 3, 5]
    td["value_target_mask"] = torch.tensor([[1, 1, 1], [0, 0, 1]], dtype=torch.bool)
    trainable, has_target = training_step_masks(td, value_target_mask_key="value_target_mask")
    assert trainable.tolist() == [[True, False, False], [True, False, True]]
    assert has_target.tolist() == [[True, False, True], [False, False, True]]
    td["loss_mask"] = torch.tensor([[1, 2, 0], [1, 0, 1]])
    with pytest.raises(ValueError, match="loss_mask"):
        select_trainable_steps(td)


def test_torchrl_validity_mask_still_excludes_steps():
    actor, critic = actor_critic()
    loss = masked_clip(actor, critic)
    td = rollout(actor)
    valid = torch.ones(td.batch_size, dtype=torch.bool)
    valid[0] = False  # row 0 is padding
    td["collector", "mask"] = valid
    expected_input = with_masked_gae_advantage(td.exclude("collector"), critic)
    out = loss(td)
    expected = ClipPPOLoss(actor, critic)(select_trainable_steps(expected_input[1:]))
    for key in expected.keys():
        torch.testing.assert_close(out[key], expected[key], msg=key)


def test_masked_clip_default_estimator_is_masked_gae_with_torchrl_defaults():
    actor, critic = actor_critic()
    loss = MaskedClipPPOLoss(actor, critic)
    gae = loss.value_estimator
    assert isinstance(gae, MaskedGAE) and gae.value_network is loss.critic_network
    torch.testing.assert_close((gae.gamma, gae.lmbda), (torch.tensor(0.99), torch.tensor(0.95)))
    for value_type in (ValueEstimators.GAE, "gae"):
        loss.make_value_estimator(value_type, gamma=0.5, lmbda=0.25)
        assert isinstance(loss.value_estimator, MaskedGAE)
        assert (float(loss.value_estimator.gamma), float(loss.value_estimator.lmbda)) == (0.5, 0.25)
    loss.make_value_estimator(ValueEstimators.TD0, gamma=0.5)  # others: TorchRL's own
    assert type(loss.value_estimator).__name__ == "TD0Estimator"


def test_masked_clip_set_keys_renames_loss_mask_everywhere():
    actor, critic = actor_critic()
    loss = masked_clip(actor, critic)
    loss.set_keys(loss_mask="trainable")
    assert loss.value_estimator.tensor_keys.loss_mask == "trainable"
    assert "trainable" in loss.in_keys
    td = rollout(actor)
    td.rename_key_("loss_mask", "trainable")
    loss(td)


def test_masked_clip_accepts_a_plain_gae_baseline():
    """The comparison's baseline: plain TorchRL GAE, losses still over trainable steps only."""
    actor, critic = actor_critic()
    loss = MaskedClipPPOLoss(actor, critic)
    plain = GAE(gamma=GAMMA, lmbda=LMBDA, value_network=critic)
    loss.make_value_estimator(plain)
    td = rollout(actor)
    out = loss(td)
    expected = plain(td.clone())
    stock = ClipPPOLoss(actor, critic)
    stock.make_value_estimator(plain)
    reference = stock(select_trainable_steps(expected))
    for key in reference.keys():
        torch.testing.assert_close(out[key], reference[key])


# --- estimator called only when needed -----------------------------------------------------


@routes
def test_estimator_called_when_advantage_missing_and_skipped_when_present(make_loss):
    actor, critic = actor_critic()
    loss = make_loss(actor, critic)
    calls = []
    loss.value_estimator.register_forward_hook(lambda *args: calls.append(1))
    td = rollout(actor)
    loss(td)
    assert len(calls) == 1
    assert "advantage" not in td.keys()  # the caller's data is not written to
    loss(with_masked_gae_advantage(td, critic))
    assert len(calls) == 1


# --- masked steps: no effect, no gradient --------------------------------------------------


@routes
@pytest.mark.parametrize("precomputed", [False, True], ids=["estimator", "precomputed"])
@pytest.mark.parametrize("normalize_advantage", [False, True])
def test_nothing_stored_at_masked_steps_changes_loss_or_gradients(
    make_loss, precomputed, normalize_advantage
):
    actor, critic = actor_critic()
    loss = make_loss(actor, critic, normalize_advantage=normalize_advantage, clip_value=0.5)
    td = rollout(actor)
    if precomputed:
        td = with_masked_gae_advantage(td, critic)
    out, grads = outputs_and_grads(loss, td)
    out_p, grads_p = outputs_and_grads(loss, perturb_masked_steps(td))
    assert set(out.keys()) == set(out_p.keys())
    for key in out.keys():
        torch.testing.assert_close(out_p[key], out[key], msg=f"{key} changed")
        assert torch.isfinite(out[key]).all(), key
    for g, g_p in zip(grads, grads_p):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g_p, g)


def observation_gradients(loss, td, term):
    obs = td["observation"].clone().requires_grad_()
    td = td.clone()
    td["observation"] = obs
    loss.reset()
    (grad,) = torch.autograd.grad(loss(td)[term], obs, allow_unused=True)
    return torch.zeros_like(obs) if grad is None else grad


@routes
@pytest.mark.parametrize("term", LOSS_TERMS)
def test_masked_step_gets_zero_gradient_from_every_term(make_loss, term):
    actor, critic = actor_critic()
    loss = make_loss(actor, critic)
    td = rollout(actor)
    grad = observation_gradients(loss, td, term).abs().sum(-1)
    masked = td["loss_mask"].squeeze(-1) == 0
    assert grad[masked].max() == 0
    assert grad[~masked].max() > 0


@pytest.mark.parametrize("term", LOSS_TERMS)
def test_stock_loss_fails_the_zero_gradient_check(term):
    """The check above can fail: TorchRL's own loss trains every step."""
    actor, critic = actor_critic()
    loss = ClipPPOLoss(actor, critic)
    loss.make_value_estimator(gamma=GAMMA, lmbda=LMBDA)
    td = rollout(actor)
    grad = observation_gradients(loss, td, term).abs().sum(-1)
    assert grad[td["loss_mask"].squeeze(-1) == 0].max() > 0


# --- statistics over trainable steps -------------------------------------------------------


@routes
def test_normalize_advantage_uses_trainable_steps_only(make_loss):
    actor, critic = actor_critic()
    td = with_masked_gae_advantage(rollout(actor), critic)
    mask = td["loss_mask"].bool()
    td["advantage"] = torch.where(mask, td["advantage"] + 3.0, 1e3)  # masked steps far off
    normalized = td.clone()
    normalized["advantage"] = masked_standardize(td["advantage"], mask)
    out = make_loss(actor, critic, normalize_advantage=True)(td)
    expected = make_loss(actor, critic, normalize_advantage=False)(normalized)
    torch.testing.assert_close(out["loss_objective"], expected["loss_objective"])


@pytest.mark.parametrize("precomputed", [False, True], ids=["estimator", "precomputed"])
def test_masked_clip_equals_torchrl_clip_loss_on_the_trainable_steps(precomputed):
    """Every output, the losses and the logged statistics (clip_fraction, kl_approx, ESS,
    entropy, ratios, explained_variance), is ClipPPOLoss's on the trainable steps alone."""
    actor, critic = actor_critic()
    kwargs = dict(normalize_advantage=True, clip_value=0.5)
    td = rollout(actor)
    expected_input = with_masked_gae_advantage(td, critic)
    if precomputed:
        td = expected_input
    out = masked_clip(actor, critic, **kwargs)(td)
    expected = ClipPPOLoss(actor, critic, **kwargs)(select_trainable_steps(expected_input))
    assert set(out.keys()) == set(expected.keys())
    assert {"clip_fraction", "kl_approx", "ESS", "entropy", "max_ratio", "mean_ratio"} <= set(out.keys())
    assert out["clip_fraction"] > 0
    for key in expected.keys():
        torch.testing.assert_close(out[key], expected[key], msg=key)


def test_reduction_none_gives_one_entry_per_trainable_step():
    actor, critic = actor_critic()
    loss = masked_clip(actor, critic, reduction="none")
    td = rollout(actor)
    out = loss(td)
    n = int(td["loss_mask"].sum())
    assert out["loss_objective"].shape == (n,)
    assert out["loss_critic"].shape == (n,)


# --- errors ---------------------------------------------------------------------------------


@routes
def test_missing_loss_mask_names_the_key(make_loss):
    actor, critic = actor_critic()
    td = rollout(actor).exclude("loss_mask")
    with pytest.raises(KeyError, match="loss_mask"):
        make_loss(actor, critic)(td)


@routes
def test_non_binary_loss_mask_raises(make_loss):
    actor, critic = actor_critic()
    td = rollout(actor)
    td["loss_mask"][0, 0] = 2
    with pytest.raises(ValueError, match=r"only 0 and 1.*\[2\]"):
        make_loss(actor, critic)(td)


@routes
def test_batch_without_trainable_step_raises(make_loss):
    actor, critic = actor_critic()
    td = rollout(actor)
    td["loss_mask"].zero_()
    with pytest.raises(ValueError, match="no trainable step"):
        make_loss(actor, critic)(td)


def test_attach_rejects_non_ppo_losses():
    with pytest.raises(TypeError, match="masked PPO loss"):
        attach_masked_gae(nn.Linear(1, 1), gamma=GAMMA, lmbda=LMBDA)


def test_runs_on_device(device):
    actor, critic = actor_critic()
    td = rollout(actor)  # on the CPU, before Module.to moves the actor in place
    loss = masked_clip(actor.to(device), critic.to(device))
    out = loss(td.to(device))
    assert out["loss_objective"].device.type == device.type


# --- masked_value_targets: the critic learns every step carrying a target --------------------


def test_masked_gae_writes_masked_targets_and_their_mask():
    actor, critic = actor_critic()
    td = rollout(actor)
    gae = MaskedGAE(gamma=GAMMA, lmbda=LMBDA, value_network=critic, masked_value_targets=True)
    gae.set_keys(value_target_mask="has_target")
    assert "has_target" in gae.out_keys
    out = gae(td.clone())
    with torch.no_grad():
        values = critic(td.clone())["state_value"]
        next_values = critic(td["next"].clone())["state_value"]
    from masked_rl import masked_generalized_advantage_estimate

    expected = masked_generalized_advantage_estimate(
        GAMMA, LMBDA, values, next_values, td["next", "reward"], td["next", "done"],
        td["next", "terminated"], td["loss_mask"], masked_value_targets=True)
    torch.testing.assert_close(out["advantage"], expected[0])
    torch.testing.assert_close(out["value_target"], expected[1])
    assert torch.equal(out["has_target"], expected[2])
    assert (out["has_target"] & (td["loss_mask"] == 0)).any()


def masked_targets_loss(make_loss, actor, critic, **kwargs):
    if make_loss is masked_clip:
        loss = MaskedClipPPOLoss(actor, critic, masked_value_targets=True, **kwargs)
        loss.make_value_estimator(gamma=GAMMA, lmbda=LMBDA)
        return loss
    loss = make_loss(actor, critic, **kwargs)
    attach_masked_gae(loss, gamma=GAMMA, lmbda=LMBDA, masked_value_targets=True)
    return loss


@routes
def test_masked_value_targets_train_the_critic_on_every_target_step(make_loss):
    actor, critic = actor_critic()
    loss = masked_targets_loss(make_loss, actor, critic, loss_critic_type="l2")
    assert loss.value_estimator.masked_value_targets
    td = rollout(actor)
    out = loss(td)
    estimated = td.clone()
    loss.value_estimator(estimated)
    has_target = estimated["value_target_mask"].squeeze(-1)
    steps = estimated[has_target]
    with torch.no_grad():
        predicted = critic(steps.clone())["state_value"]
    expected = loss.critic_coeff * (steps["value_target"] - predicted).pow(2).mean()
    torch.testing.assert_close(out["loss_critic"], expected)
    # The policy terms are those of the plain masked loss.
    plain = make_loss(actor, critic, loss_critic_type="l2")
    reference = plain(td)
    torch.testing.assert_close(out["loss_objective"], reference["loss_objective"])
    # Gradients: the critic reaches masked steps with a target, the policy never does.
    masked = td["loss_mask"].squeeze(-1) == 0
    critic_grad = observation_gradients(loss, td, "loss_critic").abs().sum(-1)
    assert critic_grad[masked & has_target].min() > 0
    assert (~has_target).any() and critic_grad[~has_target].max() == 0
    for term in ("loss_objective", "loss_entropy"):
        assert observation_gradients(loss, td, term).abs().sum(-1)[masked].max() == 0


def test_masked_value_targets_minibatch_without_trainable_step():
    actor, critic = actor_critic()
    loss = masked_targets_loss(masked_clip, actor, critic)
    td = rollout(actor)
    loss.value_estimator(td)
    steps = td.reshape(-1)
    masked_only = steps[(steps["loss_mask"].squeeze(-1) == 0) & steps["value_target_mask"].squeeze(-1)]
    out = loss(masked_only)
    assert out["loss_objective"] == 0 and out["loss_entropy"] == 0
    assert out["loss_critic"] > 0 and out["loss_critic"].requires_grad


def test_masked_value_targets_precomputed_batch_needs_the_target_mask():
    actor, critic = actor_critic()
    loss = masked_targets_loss(masked_clip, actor, critic)
    td = with_masked_gae_advantage(rollout(actor), critic)
    with pytest.raises(KeyError, match="value_target_mask"):
        loss(td)


def test_plain_gae_baseline_critic_on_every_step():
    """The recipe's fair `plain` baseline: TorchRL's GAE, the critic trained on every step."""
    actor, critic = actor_critic()
    loss = MaskedClipPPOLoss(actor, critic, masked_value_targets=True, loss_critic_type="l2")
    loss.make_value_estimator(GAE(gamma=GAMMA, lmbda=LMBDA, value_network=critic))
    td = rollout(actor)
    td["value_target_mask"] = torch.ones(td.batch_size, dtype=torch.bool)
    out = loss(td)
    everything = td.clone()
    GAE(gamma=GAMMA, lmbda=LMBDA, value_network=critic)(everything)
    with torch.no_grad():
        predicted = critic(everything.clone())["state_value"]
    expected = loss.critic_coeff * (everything["value_target"] - predicted).pow(2).mean()
    torch.testing.assert_close(out["loss_critic"], expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [10_000, 30_000])
def test_normalize_advantage_on_half_precision_uses_float32(dtype, n):
    # #29: masked_standardize overflowed in float16; normalize_advantage's statistics (TorchRL's
    # reductions, or masked_moments' float64 with a group) must not either.
    actor, critic = actor_critic()
    loss = MaskedClipPPOLoss(actor, critic, normalize_advantage=True)
    advantage = (4 * torch.randn(n, 1, generator=torch.Generator().manual_seed(n)) + 3).to(dtype)
    td = TensorDict({"advantage": advantage}, batch_size=[n])
    got = loss._standardize_advantage(advantage, td)
    expected = loss._standardize_advantage(advantage.double(), td)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=1e-2)
