"""A scripted policy that solves :class:`~masked_rl_envs.tool_use.ToolUseEnv` from its observations."""

from __future__ import annotations

import numpy as np

from masked_rl_envs.tool_use import (
    _ANSWERING,
    _CALL_ARGUMENT,
    _CLOSING,
    _TURN,
    ANSWER,
    BOS,
    CALL,
    PAD,
    RESULT,
    ToolUseEnv,
    ToolUseGrammar,
)


def oracle_action(observation, grammar: ToolUseGrammar) -> int:
    """The oracle's next token for one observation ``{"tokens": [W], "loss_mask": [1]}``.

    Reads only the observation window and the grammar (token ids, block lengths): it replays the
    transcript from the prompt, collects the ``RESULT`` blocks, then calls the first queried key
    whose value it has not seen, or answers once it has seen them all. On a masked step it
    returns ``PAD`` (the environment ignores it). Raises ``ValueError`` if the window no longer
    reaches back to the prompt (``window`` shorter than the transcript).
    """
    if not int(np.asarray(observation["loss_mask"]).reshape(-1)[0]):
        return PAD
    tokens = np.asarray(observation["tokens"]).reshape(-1)
    written = np.flatnonzero(tokens != PAD)
    if len(written) == 0 or tokens[written[0]] != BOS:
        raise ValueError(
            "the observation window must reach back to the prompt (<bos> after the padding), "
            f"got {grammar.decode(tokens)}"
        )
    transcript = tokens[written[0] :].tolist()
    queries = transcript[1 : grammar.prompt_len]
    seen: dict[int, int] = {}
    answer: list[int] = []
    phase = _TURN
    pos = grammar.prompt_len
    while pos < len(transcript):
        token = transcript[pos]
        if phase == _TURN:
            if token == CALL and grammar.call_prefix:
                phase, pos = _CALL_ARGUMENT, pos + 1
            elif token == ANSWER:
                phase, pos = _ANSWERING, pos + 1
            else:  # a one-token call, or a malformed turn: either way a response block
                pos = _read_response(transcript, pos + 1, grammar, seen)
        elif phase == _CALL_ARGUMENT:
            phase, pos = _TURN, _read_response(transcript, pos + 1, grammar, seen)
        elif phase == _ANSWERING:
            answer.append(token)
            pos += 1
            if len(answer) == grammar.n_queries:
                phase = _CLOSING
        else:
            break
    missing = [q for q in queries if q not in seen]
    if phase == _TURN:
        if not missing:
            return ANSWER
        return CALL if grammar.call_prefix else missing[0]
    if phase == _CALL_ARGUMENT:
        return missing[0] if missing else queries[0]
    if phase == _ANSWERING:
        return seen.get(queries[len(answer)], grammar.value(0))
    return PAD


def _read_response(transcript: list[int], start: int, grammar: ToolUseGrammar, seen: dict) -> int:
    """Record the key and value of a ``RESULT`` block at ``start``; return the position after it."""
    response = transcript[start : start + grammar.response_len]
    if len(response) >= 3 and response[0] == RESULT:
        seen[response[1]] = response[2]
    return start + grammar.response_len


class OraclePolicy:
    """Scripted policy over (batches of) observations; see :func:`oracle_action`.

    Example:
        >>> import gymnasium as gym
        >>> import masked_rl_envs
        >>> env = gym.make("MaskedRL/ToolUse-v0")
        >>> policy = masked_rl_envs.OraclePolicy.from_env(env)
        >>> obs, info = env.reset(seed=0)
        >>> done = False
        >>> while not done:
        ...     obs, reward, terminated, truncated, info = env.step(policy(obs))
        ...     done = terminated or truncated
        >>> reward, bool(info["is_success"])
        (1.0, True)
    """

    def __init__(self, grammar: ToolUseGrammar):
        self.grammar = grammar

    @classmethod
    def from_env(cls, env) -> "OraclePolicy":
        """Build from a (possibly wrapped or vectorised) ``ToolUseEnv``."""
        grammar = getattr(env, "grammar", None)
        if grammar is None and hasattr(env, "get_attr"):  # gymnasium vector env
            grammar = env.get_attr("grammar")[0]
        if grammar is None:
            grammar = env.unwrapped.grammar
        return cls(grammar)

    @classmethod
    def from_id(cls, env_id: str = "MaskedRL/ToolUse-v0", **env_kwargs) -> "OraclePolicy":
        """Build for a registered id and constructor overrides, e.g. for a TorchRL env."""
        import gymnasium

        spec = gymnasium.spec(env_id)
        return cls(ToolUseEnv(**{**spec.kwargs, **env_kwargs}).grammar)

    def __call__(self, observation):
        """One action for one observation, or an int64 array of actions for a batch.

        ``observation["tokens"]`` has shape ``[*B, W]`` and ``observation["loss_mask"]``
        ``[*B, 1]`` (or ``[*B]``); numpy arrays and CPU tensors both work.
        """
        tokens = np.asarray(observation["tokens"])
        if tokens.ndim == 1:
            return oracle_action(observation, self.grammar)
        batch_shape = tokens.shape[:-1]
        tokens = tokens.reshape(-1, tokens.shape[-1])
        loss_mask = np.asarray(observation["loss_mask"]).reshape(len(tokens), -1)
        actions = [
            oracle_action({"tokens": t, "loss_mask": m}, self.grammar)
            for t, m in zip(tokens, loss_mask)
        ]
        return np.asarray(actions, dtype=np.int64).reshape(batch_shape)

    def as_module(self):
        """The oracle as a TorchRL policy: a ``TensorDictModule`` reading ``"tokens"`` and
        ``"loss_mask"`` and writing the categorical ``"action"`` ``[*B]`` (int64), for
        ``env.rollout(n, policy)`` on ``make_torchrl_env``'s default
        ``categorical_action_encoding=True``."""
        import torch
        from tensordict.nn import TensorDictModule

        def act(tokens, loss_mask):
            actions = self({"tokens": tokens.cpu(), "loss_mask": loss_mask.cpu()})
            return torch.as_tensor(actions, dtype=torch.int64, device=tokens.device)

        return TensorDictModule(act, in_keys=["tokens", "loss_mask"], out_keys=["action"])
