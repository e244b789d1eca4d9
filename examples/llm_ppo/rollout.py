"""Rollout, scoring and greedy evaluation of a causal LM on the chat tool-use task.

The pieces of the ``masked-rl llm-train`` recipe that every estimator shares:

- :func:`make_wrappers`: TorchRL ``TransformersWrapper`` s around one model: a sampling one, a
  greedy one (evaluation) and a scoring one (``generate=False``: log-probs of a whole transcript
  and its assistant mask in one forward pass);
- :func:`rollout`: one batch of episodes on the ``ChatEnv``, turn by turn, each row's transcript
  kept as it stood when its episode ended, with the reward of each of its assistant turns;
- :func:`score`: the scoring pass over the final transcripts, the source of the old log-probs
  (never the generation-time ones: TorchRL's generate path zeroes the first response token's);
- :func:`evaluate`: greedy success over seeded episodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack
from torchrl.data.llm import History
from torchrl.modules.llm import TransformersWrapper
from torchrl.modules.llm.policies import ChatHistory

from masked_rl_envs.chat_tool_use import ChatToolUseConfig, make_chat_tool_use_env
from masked_rl_envs.llm_factories import CHAT_TEMPLATE_NAME, suppressed_token_ids


@dataclass
class Wrappers:
    sample: TransformersWrapper
    greedy: TransformersWrapper
    score: TransformersWrapper


def make_wrappers(model, tokenizer, *, max_new_tokens: int, temperature: float = 1.0,
                  device=None) -> Wrappers:
    """The sampling, greedy and scoring ``TransformersWrapper`` s of ``model`` (history mode).

    Generation may only emit task words and ``<|im_end|>`` (``bad_words_ids``:
    :func:`~masked_rl_envs.llm_factories.suppressed_token_ids`), so every sampled token survives
    TorchRL's decode -> ``History`` -> re-template round trip and the scoring pass sees it.
    """
    bad = [[i] for i in suppressed_token_ids(tokenizer)]
    common = dict(tokenizer=tokenizer, input_mode="history", pad_output=True,
                  chat_template_name=CHAT_TEMPLATE_NAME, device=device)
    sample = TransformersWrapper(
        model, generate=True, return_log_probs=False, **common,
        generate_kwargs={"max_new_tokens": max_new_tokens, "do_sample": True,
                         "temperature": temperature, "top_k": len(tokenizer),
                         "bad_words_ids": bad},
    )
    greedy = TransformersWrapper(
        model, generate=True, return_log_probs=False, **common,
        generate_kwargs={"max_new_tokens": max_new_tokens, "do_sample": False,
                         "bad_words_ids": bad},
    )
    score = TransformersWrapper(model, generate=False, return_log_probs=True, **common)
    return Wrappers(sample, greedy, score)


@dataclass
class Rollout:
    """One batch of finished episodes.

    Attributes:
        history: ``History`` ``[B, -1]`` (lazily stacked rows): each row's transcript when its
            episode ended, without TorchRL's ``"<none>"`` placeholder messages.
        turn_rewards: ``[B, max_turns]`` float: the reward after each assistant turn, 0 after
            the episode's last turn.
        num_turns: ``[B]`` int64: assistant turns of each episode.
        terminated: ``[B]`` bool: the episode answered (else the turn budget truncated it).
        success: ``[B]`` bool: every value of the answer right.
        num_tool_calls: ``[B]`` int64.
        sampled_tokens: tokens generated for these episodes (the end-of-turn tokens included;
            the budget unit of the comparison).
    """

    history: History
    turn_rewards: torch.Tensor
    num_turns: torch.Tensor
    terminated: torch.Tensor
    success: torch.Tensor
    num_tool_calls: torch.Tensor
    sampled_tokens: int

    @property
    def returns(self) -> torch.Tensor:
        """``[B]`` undiscounted episode returns."""
        return self.turn_rewards.sum(-1)


def _without_placeholders(history: History) -> History:
    """One row's messages without TorchRL's ``"<none>"`` batch-padding placeholders."""
    keep = [i for i, role in enumerate(history.role) if role != "<none>"]
    return history if len(keep) == history.batch_size[0] else history[keep]


def rollout(env, policy: TransformersWrapper, pad_token_id: int) -> Rollout:
    """Play one batch of episodes of ``env`` (:func:`make_chat_tool_use_env`) with ``policy``.

    All rows step together until every episode is done (at most ``max_turns`` turns); a row
    whose episode has ended keeps the transcript it had then, and what is generated for it
    later is neither kept nor counted.
    """
    config: ChatToolUseConfig = env.transform.config
    batch = env.batch_size[0]
    turn_rewards = torch.zeros(batch, config.max_turns)
    num_turns = torch.zeros(batch, dtype=torch.int64)
    done = torch.zeros(batch, dtype=torch.bool)
    final: list[History | None] = [None] * batch
    sampled = 0
    td = env.reset()
    with torch.no_grad():
        for turn in range(config.max_turns):
            td = policy(td)
            response = td["tokens", "response"]
            sampled += int(((response != pad_token_id).sum(-1) * ~done).sum())
            td = env.step(td)
            nxt = td["next"]
            active = ~done
            turn_rewards[active, turn] = nxt["reward"].reshape(-1)[active]
            num_turns[active] += 1
            now_done = nxt["done"].reshape(-1) & active
            for i in now_done.nonzero().flatten().tolist():
                final[i] = _without_placeholders(nxt["history"].prompt[i])
            done |= now_done
            if bool(done.all()):
                break
            td = nxt.exclude("reward", "done", "terminated", "truncated")
    return Rollout(
        history=lazy_stack(final),
        turn_rewards=turn_rewards,
        num_turns=num_turns,
        terminated=nxt["terminated"].reshape(-1).clone(),
        success=nxt["success"].reshape(-1).clone(),
        num_tool_calls=nxt["num_tool_calls"].reshape(-1).clone(),
        sampled_tokens=sampled,
    )


def sequence_data(history: History) -> TensorDict:
    """The ``[B]`` sequence-level input of the scoring wrapper and the losses."""
    batch = history.batch_size[:1]
    return TensorDict({"history": ChatHistory(full=history, batch_size=batch)}, batch_size=batch)


SCORED_KEYS = (("tokens", "full"), ("log_probs", "full"), ("masks", "all_assistant_mask"),
               ("masks", "all_attention_mask"))


def score(wrapper: TransformersWrapper, history: History) -> TensorDict:
    """The scoring pass: ``[B]`` data with ``("history", "full")`` and dense, left-padded
    ``[B, T]`` ``("tokens", "full")``, ``("log_probs", "full")`` (``log_prob[t]`` of token
    ``t`` from the logits at ``t - 1``), ``("masks", "all_assistant_mask")`` and
    ``("masks", "all_attention_mask")``, no gradient.

    The rows of ``history`` have different lengths, so the wrapper answers with a lazy stack of
    rows; the tensors are padded here into one dense TensorDict that the losses can slice.
    """
    with torch.no_grad():
        scored = wrapper(sequence_data(history))
    data = sequence_data(history)
    for key in SCORED_KEYS:
        data.set(key, scored.get(key, as_padded_tensor=True, padding_side="left",
                                 padding_value=0))
    return data


def trim_left_padding(data: TensorDictBase) -> TensorDictBase:
    """``data`` (a minibatch of the scoring pass' output) with the left-padding columns that no
    row of it uses removed from every ``[b, T, ...]`` tensor, in place.

    The losses re-score their input and pad it to its own longest row, so a minibatch must hold
    exactly that many columns to stay aligned with its stored log-probs and advantages.
    """
    attention = data["masks", "all_attention_mask"]
    width = attention.shape[1]
    keep = int(attention.sum(-1).max())
    if keep == width:
        return data
    for key in data.keys(include_nested=True, leaves_only=True):
        if isinstance(key, tuple) and key[0] in ("history", "text"):
            continue  # transcripts, not [b, T] tensors (and reading them stacks strings)
        value = data.get(key)
        if torch.is_tensor(value) and value.ndim >= 2 and value.shape[1] == width:
            data.set(key, value[:, width - keep:])
    return data


def evaluate(policy: TransformersWrapper, config: ChatToolUseConfig, *, episodes: int,
             seed: int, pad_token_id: int, tokenizer=None) -> dict[str, float]:
    """Greedy success rate (and mean return, turns, tool calls) over ``episodes`` seeded
    episodes of the task; the same episodes for every call with the same ``seed``."""
    env = make_chat_tool_use_env(episodes, config, tokenizer=tokenizer, seed=seed)
    return episode_statistics(rollout(env, policy, pad_token_id))


def episode_statistics(result: Rollout) -> dict[str, float]:
    """Success rate, mean return, turns and tool calls of a batch of episodes."""
    return {
        "success_rate": result.success.float().mean().item(),
        "episode_return": result.returns.mean().item(),
        "num_turns": result.num_turns.float().mean().item(),
        "num_tool_calls": result.num_tool_calls.float().mean().item(),
    }


def render_episode(result: Rollout, index: int) -> str:
    """Episode ``index`` of ``result`` as text: one ``role: content`` line per message, the
    reward after each assistant turn, and the outcome."""
    history = result.history[index]
    lines, turn = [], 0
    for role, content in zip(history.role, history.content):
        lines.append(f"{role:>9}: {content}")
        if role == "assistant":
            lines[-1] += f"    [reward {result.turn_rewards[index, turn].item():+.2f}]"
            turn += 1
    outcome = "answered" if bool(result.terminated[index]) else "truncated (no answer)"
    lines.append(f"return {result.returns[index].item():.2f}, {outcome}, "
                 f"{'success' if bool(result.success[index]) else 'not all values right'}")
    return "\n".join(lines)
