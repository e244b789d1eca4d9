"""masked_rl.llm.TokenPPOLoss on a real TorchRL LLM batch: its terms against plain per-token
formulas and TorchRL's own GRPOLoss, and the masked tokens' gradient (none) against the stock
path's (some)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torchrl.objectives.llm import GRPOLoss

from masked_rl.llm import TokenCritic, TokenPPOLoss, TokenValueHead
from masked_rl_envs.chat_tool_use import ChatToolUseConfig, make_chat_tool_use_env
from masked_rl_envs.llm_factories import make_model, make_tokenizer
from masked_rl_examples.llm_ppo.rollout import make_wrappers, rollout, score

EPS = 0.2


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def batch(tok):
    """8 sampled episodes of the chat task, scored by TorchRL's scoring pass (left-padded), a
    random dense advantage and value target on the assistant tokens, and a policy moved away
    from the one that scored them (so ratios differ from 1 and some are clipped)."""
    behaviour = make_model(tok, hidden_size=32, num_layers=2, num_heads=2, seed=0).eval()
    env = make_chat_tool_use_env(8, ChatToolUseConfig(response_len=3, max_turns=3), tokenizer=tok,
                                 seed=0)
    wrappers = make_wrappers(behaviour, tok, max_new_tokens=4)
    torch.manual_seed(0)
    data = score(wrappers.score, rollout(env, wrappers.sample, tok.pad_token_id).history)
    mask = data["masks", "all_assistant_mask"]
    generator = torch.Generator().manual_seed(1)
    shape = (*mask.shape, 1)
    data["loss_mask"] = mask
    data["advantage"] = torch.randn(shape, generator=generator) * mask.unsqueeze(-1)
    data["value_target"] = torch.randn(shape, generator=generator) * mask.unsqueeze(-1)
    policy = copy.deepcopy(behaviour)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=generator))
    return behaviour, policy, data


def _trainable(data):
    return [(b, t) for b, t in data["loss_mask"].nonzero().tolist()]


def _plain_objective(policy, data, reduction="token_mean"):
    """-min(r A, clip(r) A) per trainable token, each row's transcript scored alone, unpadded."""
    per_row: dict[int, list[float]] = {}
    attention = data["masks", "all_attention_mask"]
    for b, t in _trainable(data):
        real = attention[b].nonzero().flatten()
        first = int(real[0])
        ids = data["tokens", "full"][b, first:].unsqueeze(0)
        with torch.no_grad():
            logits = policy(ids).logits[0]
        new = logits[t - first - 1].log_softmax(-1)[ids[0, t - first]].item()
        ratio = math.exp(new - data["log_probs", "full"][b, t].item())
        a = data["advantage"][b, t, 0].item()
        per_row.setdefault(b, []).append(-min(ratio * a, min(max(ratio, 1 - EPS), 1 + EPS) * a))
    if reduction == "token_mean":
        values = [v for row in per_row.values() for v in row]
        return sum(values) / len(values)
    return sum(sum(row) / len(row) for row in per_row.values()) / len(per_row)


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
def test_policy_term_matches_a_plain_per_token_formula(batch, reduction):
    _, policy, data = batch
    out = TokenPPOLoss(policy, clip_epsilon=EPS, reduction=reduction)(data)
    assert out["clip_fraction"] > 0  # the check covers clipped tokens too
    assert out["loss_objective"].item() == pytest.approx(_plain_objective(policy, data, reduction),
                                                         abs=1e-5)
    assert int(out["num_trainable_tokens"]) == len(_trainable(data))


def test_policy_term_equals_torchrls_grpo_loss_on_the_same_dense_advantage(tok, batch):
    """TorchRL's GRPOLoss (``masking_strategy="rlhf"``: the assistant tokens) re-templates the
    history and re-scores it; on a dense, left-padded advantage it is the same objective."""
    _, policy, data = batch
    ours = TokenPPOLoss(policy, clip_epsilon=EPS)(data)
    theirs = GRPOLoss(make_wrappers(policy, tok, max_new_tokens=1).score, clip_epsilon=EPS,
                      masking_strategy="rlhf", entropy_bonus=False)(data.clone())
    assert ours["loss_objective"].item() == pytest.approx(theirs.loss_objective.item(), abs=1e-5)


def test_value_term_is_a_mean_over_trainable_tokens_only(tok, batch):
    _, policy, data = batch
    trunk = make_model(tok, hidden_size=32, num_layers=2, num_heads=2, seed=3).model.eval()
    with torch.random.fork_rng():
        torch.manual_seed(4)
        critic = TokenCritic(trunk, TokenValueHead(32, zero_init=False))
    out = TokenPPOLoss(policy, critic, critic_coeff=0.5)(data)
    with torch.no_grad():
        value, _ = critic(data["tokens", "full"], data["masks", "all_attention_mask"])
    errors = [(value[b, t, 0] - data["value_target"][b, t, 0]).item() ** 2
              for b, t in _trainable(data)]
    assert out["loss_critic"].item() == pytest.approx(0.5 * sum(errors) / len(errors), rel=1e-5)


def _squared_value_errors(critic, data, keep):
    """``(V - value_target)^2`` at each real token but a row's first, where ``keep(b, t)``; each
    row's values from a forward over its real tokens alone (no padding)."""
    attention = data["masks", "all_attention_mask"]
    errors = []
    for b in range(attention.shape[0]):
        real = attention[b].nonzero().flatten().tolist()
        ids = data["tokens", "full"][b, real].unsqueeze(0)
        with torch.no_grad():
            value, _ = critic(ids, torch.ones_like(ids, dtype=torch.bool))
        errors += [(value[0, i, 0] - data["value_target"][b, t, 0]).item() ** 2
                   for i, t in enumerate(real) if i > 0 and keep(b, t)]
    return errors


@pytest.mark.parametrize("shared", [False, True])
def test_value_term_over_every_token_is_a_mean_over_every_transition(tok, batch, shared):
    """``critic_tokens="every"`` (plain token GAE's critic): every real token with a real token
    before it, however the row is padded, and the policy term is unchanged."""
    _, policy, data = batch
    if shared:
        critic = TokenCritic(policy)
        with torch.no_grad():
            critic.head.linear.weight.normal_(generator=torch.Generator().manual_seed(5))
    else:
        trunk = make_model(tok, hidden_size=32, num_layers=2, num_heads=2, seed=3).model.eval()
        with torch.random.fork_rng():
            torch.manual_seed(4)
            critic = TokenCritic(trunk, TokenValueHead(32, zero_init=False))
    target = data.clone()
    target["value_target"] = torch.randn(target["value_target"].shape,
                                         generator=torch.Generator().manual_seed(6))
    every = TokenPPOLoss(policy, critic, critic_coeff=0.5, critic_tokens="every")(target)
    trainable = TokenPPOLoss(policy, critic, critic_coeff=0.5)(target)
    errors = _squared_value_errors(critic, target, lambda b, t: True)
    assert len(errors) > 2 * int(trainable["num_trainable_tokens"])
    assert every["loss_critic"].item() == pytest.approx(0.5 * sum(errors) / len(errors), rel=1e-5)
    assert every["loss_critic"].item() != pytest.approx(trainable["loss_critic"].item(), rel=1e-3)
    assert torch.equal(every["loss_objective"], trainable["loss_objective"])


def test_value_term_over_the_estimators_targets(tok, batch):
    """``critic_tokens="targets"`` (a dense critic beside masked advantages): the mean over the
    tokens of ``value_target_mask`` that have a real token before them; nothing stored off that
    mask changes it, and the policy term is the same."""
    _, policy, data = batch
    critic = TokenCritic(policy)
    with torch.no_grad():
        critic.head.linear.weight.normal_(generator=torch.Generator().manual_seed(5))
    generator = torch.Generator().manual_seed(7)
    target = data.clone()
    target["value_target"] = torch.randn(target["value_target"].shape, generator=generator)
    has_target = torch.rand(target["value_target"].shape, generator=generator) < 0.6
    has_target[:, :2] = True  # padding or a row's first token: no state, never taken
    target["value_target_mask"] = has_target
    loss = TokenPPOLoss(policy, critic, critic_coeff=0.5, critic_tokens="targets")
    assert "value_target_mask" in loss.in_keys
    out = loss(target)
    errors = _squared_value_errors(critic, target, lambda b, t: bool(has_target[b, t, 0]))
    assert out["loss_critic"].item() == pytest.approx(0.5 * sum(errors) / len(errors), rel=1e-5)
    every = TokenPPOLoss(policy, critic, critic_coeff=0.5, critic_tokens="every")(target)
    assert out["loss_critic"].item() != pytest.approx(every["loss_critic"].item(), rel=1e-3)
    assert torch.equal(out["loss_objective"], every["loss_objective"])
    poisoned = target.clone()
    poisoned["value_target"] = torch.where(has_target, poisoned["value_target"], torch.nan)
    assert torch.equal(loss(poisoned)["loss_critic"], out["loss_critic"])
    with pytest.raises(KeyError, match=r"TokenPPOLoss needs .*value_target_mask"):
        loss(target.exclude("value_target_mask"))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(critic_tokens="all"), ValueError,
     r"critic_tokens must be one of \('trainable', 'targets', 'every'\), got 'all'"),
    (dict(reduction="prompt_mean"), ValueError,
     r"reduction must be one of \('token_mean', 'sequence_mean'\), got 'prompt_mean'"),
    (dict(loss_critic_type="huber"), ValueError,
     r"loss_critic_type must be 'l1', 'l2' or 'smooth_l1', got 'huber'"),
    (dict(clip_epsilon=1.5), ValueError, r"clip_epsilon must be eps in \[0, 1\) .* got 1.5"),
    (dict(clip_value=0.0), ValueError, r"clip_value must be None or > 0, got 0.0"),
    (dict(critic_network=torch.nn.Linear(2, 1)), TypeError,
     r"critic_network must be a TokenCritic, got Linear"),
])
def test_bad_arguments_name_the_argument_and_the_value(batch, kwargs, error, message):
    _, policy, _ = batch
    with pytest.raises(error, match=message):
        TokenPPOLoss(policy, **kwargs)


def test_nothing_stored_at_masked_tokens_changes_the_loss(batch):
    _, policy, data = batch
    loss = TokenPPOLoss(policy, clip_epsilon=EPS)
    poisoned = data.clone()
    off = ~poisoned["loss_mask"]
    for key in ("advantage", "value_target"):
        poisoned[key] = torch.where(off.unsqueeze(-1), torch.nan, poisoned[key])
    poisoned["log_probs", "full"] = torch.where(off, torch.nan, poisoned["log_probs", "full"])
    assert torch.equal(loss(poisoned)["loss_objective"], loss(data)["loss_objective"])


def _logit_gradient(model, run):
    """The gradient of ``run()`` with respect to the model's output logits, ``[B, T, V]``."""
    captured = {}

    def keep(_module, _inputs, output):
        output.retain_grad()
        captured["logits"] = output

    handle = model.lm_head.register_forward_hook(keep)
    try:
        model.zero_grad(set_to_none=True)
        run().backward()
    finally:
        handle.remove()
    return captured["logits"].grad


def test_masked_tokens_get_no_gradient_and_the_stock_path_gives_them_some(tok, batch):
    """Logits at position ``p`` emit token ``p + 1``: with TokenPPOLoss their gradient is nonzero
    only where token ``p + 1`` is trainable. TorchRL's stock path without the adapter (its
    ``masking_strategy="generic"``: the attention mask, with the every-token advantage a
    plain GAE gives) puts gradient on the tool and prompt tokens too."""
    _, policy, data = batch
    model = copy.deepcopy(policy)
    ours = TokenPPOLoss(model, clip_epsilon=EPS, entropy_coeff=0.01)
    grad = _logit_gradient(model, lambda: sum(v for k, v in ours(data).items()
                                              if k.startswith("loss_")))
    emits = torch.zeros_like(data["loss_mask"])
    emits[:, :-1] = data["loss_mask"][:, 1:]  # position p emits token p + 1
    per_position = grad.abs().sum(-1)
    assert torch.all(per_position[~emits] == 0)
    assert torch.all(per_position[emits] > 0)

    attention = data["masks", "all_attention_mask"]
    stock = data.clone()
    stock["advantage"] = attention.unsqueeze(-1).float()  # plain GAE: an advantage at every token
    grpo = GRPOLoss(make_wrappers(model, tok, max_new_tokens=1).score, clip_epsilon=EPS,
                    entropy_bonus=False, masking_strategy="generic")  # every real token
    grad = _logit_gradient(model, lambda: grpo(stock).loss_objective)
    assistant = data["masks", "all_assistant_mask"]
    not_agent = attention & ~assistant
    not_agent[:, 0] = False
    emits_not_agent = torch.zeros_like(not_agent)
    emits_not_agent[:, :-1] = not_agent[:, 1:]
    # The wrapper's logits are over the re-templated (here identical) tokens, left-padded.
    assert grad.shape[:2] == attention.shape
    # (a token whose ratio is clipped gets none there either: most are not)
    assert (grad.abs().sum(-1)[emits_not_agent] > 0).float().mean() > 0.5
