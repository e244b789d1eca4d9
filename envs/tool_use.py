"""Key-value lookup through a tool, one token per step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

import gymnasium as gym
from gymnasium import spaces

# Special tokens come first so that their ids do not depend on the configuration.
PAD = 0
BOS = 1
CALL = 2
ANSWER = 3
RESULT = 4
ERROR = 5
END = 6
EOS = 7
NUM_SPECIAL_TOKENS = 8

_SPECIAL_NAMES = {
    PAD: "<pad>",
    BOS: "<bos>",
    CALL: "CALL",
    ANSWER: "ANSWER",
    RESULT: "RESULT",
    ERROR: "ERROR",
    END: "END",
    EOS: "<eos>",
}

# Agent-side phases of the grammar.
_TURN = 0  # the agent starts a turn: a call or ANSWER
_CALL_ARGUMENT = 1  # (call_prefix only) the agent just wrote CALL: a key must follow
_ANSWERING = 2  # the agent is writing its answer, one value per query
_CLOSING = 3  # the answer is complete; the closing block is being written


@dataclass(frozen=True)
class ToolUseGrammar:
    """Token ids and fixed block lengths of a :class:`ToolUseEnv` configuration.

    Everything a policy needs to read a transcript: which id is which token, how many keys the
    prompt asks for, and how long each environment-written block is. The token ids are laid out
    as ``[8 special tokens | n_filler filler words | n_keys keys | n_values values]``.
    """

    n_keys: int
    n_values: int
    n_queries: int
    n_filler: int
    response_len: int
    closing_len: int
    call_prefix: bool

    PAD = PAD
    BOS = BOS
    CALL = CALL
    ANSWER = ANSWER
    RESULT = RESULT
    ERROR = ERROR
    END = END
    EOS = EOS

    @property
    def vocab_size(self) -> int:
        return NUM_SPECIAL_TOKENS + self.n_filler + self.n_keys + self.n_values

    @property
    def prompt_len(self) -> int:
        """Length of the prompt block: ``BOS`` then the queried keys."""
        return 1 + self.n_queries

    def filler(self, index: int) -> int:
        return NUM_SPECIAL_TOKENS + index

    def key(self, index: int) -> int:
        return NUM_SPECIAL_TOKENS + self.n_filler + index

    def value(self, index: int) -> int:
        return NUM_SPECIAL_TOKENS + self.n_filler + self.n_keys + index

    def is_key(self, token: int) -> bool:
        return self.key(0) <= token < self.key(self.n_keys)

    def is_value(self, token: int) -> bool:
        return self.value(0) <= token < self.value(self.n_values)

    def token_name(self, token: int) -> str:
        token = int(token)
        if token in _SPECIAL_NAMES:
            return _SPECIAL_NAMES[token]
        if token < self.key(0):
            return f"w{token - self.filler(0)}"
        if token < self.value(0):
            return f"k{token - self.key(0)}"
        if token < self.vocab_size:
            return f"v{token - self.value(0)}"
        raise ValueError(f"token must be in [0, {self.vocab_size}), got {token}")

    def decode(self, tokens) -> str:
        """Token ids to a space-separated string, e.g. ``"<bos> k2 k0 CALL k2"``."""
        return " ".join(self.token_name(t) for t in np.asarray(tokens).reshape(-1))


def _require_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return int(value)


def _require_reward(name: str, value: Any) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a finite float >= 0, got {value!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite float >= 0, got {value}")
    return value


class ToolUseEnv(gym.Env):
    """
    Answer questions about a hidden key-value table that only a lookup tool can read, one token
    per step.

    ## Description
    Each episode draws a hidden table that maps each of `n_keys` keys to one of `n_values` values
    (uniformly, with repetition) and a question: `n_queries` distinct keys. The agent must answer
    the values of the queried keys, in the order asked. The table is never shown; the only way to
    read it is a tool call, which the environment answers with a fixed-length response block
    that echoes the key and its value. With the defaults the agent needs two calls (multi-turn),
    and each value reaches the agent only through tokens it did not write.

    This is a token-level environment for masked advantage estimation: every step is one token
    of the transcript. Some tokens are the agent's to choose (`loss_mask == 1`); the others
    (prompt, tool responses, closing text) are written by the environment (`loss_mask == 0`),
    and on those steps the action is ignored. The terminal reward arrives on a masked step, so
    credit for the answer has to cross masked steps to reach the tokens that caused it.

    Transcript of one `MaskedRL/ToolUse-v0` episode played by the oracle (`[...]` marks
    environment tokens, `w0` is filler text, `kI` a key, `vJ` a value; 44 steps, 5 of them the
    agent's):

        [<bos> k3 k0] k3 [RESULT k3 v2 w0 ... w0 END] k0 [RESULT k0 v1 w0 ... w0 END]
        ANSWER v2 v1 [<eos> <eos> <eos> <eos>]

    Agent grammar, one token per agent step (`call_prefix=False`, the default):

        turn := <key>                        -> response block (result or error), next turn
              | ANSWER <value>{n_queries}    -> closing block, end of episode
              | <any other token>            -> error block, next turn

    With `call_prefix=True` (`MaskedRL/ToolUseHard-v0`) a call takes two tokens, `CALL <key>`;
    a key without `CALL` is then a malformed turn, and so is `CALL` followed by a non-key.
    Answer tokens are taken as they come: a non-value token is a wrong value.

    Environment blocks, all of fixed length, so every position sits at a fixed offset:
    - prompt (`1 + n_queries` tokens): `<bos> q_1 ... q_n`, the queried keys in answer order.
    - result (`response_len` tokens): `RESULT <key> <value> w ... w END`.
    - error (`response_len` tokens): `ERROR <the agent's tokens of that turn> w ... w END`, for
      a malformed turn (`ERROR x ...`, or `ERROR CALL x ...` for a call on a non-key `x`) and
      for a valid call beyond the quota of `max_calls` lookups (`ERROR <key> ...` or
      `ERROR CALL <key> ...`).
    - closing (`closing_len` tokens): `<eos> ... <eos>`.
    Filler words `w` are drawn uniformly from the `n_filler` filler tokens. Unnecessary but
    valid calls (a key that was not asked, or a repeated key) are answered like any other
    lookup, as a real tool would; they cost steps, quota and `call_cost`, and earn no
    `lookup_reward`.

    ## Action Space
    `Discrete(V)` with `V = 8 + n_filler + n_keys + n_values` (17 for v0, 32 for the hard id):
    the next token. Token ids: `0 <pad>, 1 <bos>, 2 CALL, 3 ANSWER, 4 RESULT, 5 ERROR, 6 END,
    7 <eos>`, then the filler words, the keys and the values (see :class:`ToolUseGrammar`). On
    agent steps the action must be one integer (a Python or NumPy integer, or a one-element
    integer array) in `[0, V)`: a float, a bool or a string raises `ValueError`. On masked
    steps (`loss_mask == 0`) the action is ignored and may be anything.

    ## Observation Space
    `Dict` with
    - `"tokens"`: `Box(0, V - 1, (window,), int64)`, the last `window` tokens of the transcript,
      oldest first, left-padded with `<pad>` (0). The last entry is the token written by the
      previous step.
    - `"loss_mask"`: `Box(0, 1, (1,), int8)`, 1 when the NEXT token (the one the next `step`
      writes) is the agent's to choose, 0 when the environment writes it. So the `loss_mask`
      of the observation at step `t` says whether action `t` counts.

    ## Starting State
    An empty transcript (all `<pad>`) with `loss_mask == 0`: the first `1 + n_queries` steps
    write the prompt. The table, the queried keys and the filler words are drawn from
    `self.np_random`.

    ## Rewards
    - Terminal: on the last step of the closing block (a masked step). With `partial_credit`
      (default) the fraction of correct values, else 1.0 if all are correct and 0.0 otherwise.
    - Shaping, on the first step of a response block, i.e. the masked step right after the
      action that completed the turn: `lookup_reward` for looking up the next queried key in
      the order asked (`q_1` first, then `q_2`, ...: each at most once), minus `call_cost` for
      every response block (results and errors alike).
    - 0.0 on every other step.
    The oracle's return is `1 + n_queries * (lookup_reward - call_cost)`: 1.2 on v0, 0.97 on
    the hard id. Success (`info["is_success"]`) means every value right.

    ## Episode End
    - Termination: the last token of the closing block has been written (`terminated=True` on
      that masked step, which carries the terminal reward).
    - Truncation: `max_steps` steps (agent and environment tokens together) have been taken
      without termination (`truncated=True`), possibly in the middle of a block.

    ## Information
    `reset` and `step` return the same keys:
    - `"is_success"` (`np.bool_`): the answer has been written and all of it is correct.
    - `"num_tool_calls"` (`np.int64`): response blocks served so far (results and errors).
    - `"num_agent_tokens"` (`np.int64`): agent steps taken so far.

    ## Arguments
    ```python
    import gymnasium as gym
    import masked_rl_envs  # registers the ids
    env = gym.make("MaskedRL/ToolUse-v0")      # the defaults below
    env = gym.make("MaskedRL/ToolUseHard-v0")  # masked_rl_envs.HARD_KWARGS
    # v0 with a 64-token closing block, 64- or 256-token tool outputs (masked_rl_envs.CLOSING64_KWARGS,
    # LONG64_KWARGS: no lookup bonus, LONG256_KWARGS; window = max_steps in all three)
    env = gym.make("MaskedRL/ToolUseClosing64-v0")
    env = gym.make("MaskedRL/ToolUseLong64-v0")
    env = gym.make("MaskedRL/ToolUseLong256-v0")
    ```
    - `n_keys=4`, `n_values=4`: table size and value alphabet.
    - `n_queries=2`: keys asked per episode, hence lookups needed (`1 <= n_queries <= n_keys`).
    - `response_len=16`: tokens per tool response block (>= 4).
    - `closing_len=4`: tokens in the closing block (>= 1).
    - `n_filler=1`: number of distinct filler words (1: constant filler).
    - `window=64`: observation window length.
    - `max_steps=80`: step budget of an episode. The oracle takes `(1 + n_queries) +
      n_queries * (c + response_len) + (1 + n_queries) + closing_len` steps, `c` the call's
      token count (44 on v0, room for about two wasted turns).
    - `max_calls=None`: lookup quota (`None`: `2 * n_queries`).
    - `call_cost=0.0`: shaping cost per response block.
    - `lookup_reward=0.1`: shaping bonus for looking up the queried keys in the order asked.
    - `partial_credit=True`: terminal reward as the fraction of correct values.
    - `call_prefix=False`: calls are `CALL <key>` instead of `<key>`.
    - `render_mode=None`: `"ansi"` returns the transcript with environment spans in `[...]`.

    The v0 defaults (one-token calls, an in-order lookup bonus, partial credit) are what makes
    v0 learnable by a small PPO policy in minutes: without them PPO settles on answering at
    once and guessing. In-order lookups put each needed value at one fixed offset from the
    answer step. The hard id turns all three off.

    ## Version History
    - v0: Initial version.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(
        self,
        n_keys: int = 4,
        n_values: int = 4,
        n_queries: int = 2,
        response_len: int = 16,
        closing_len: int = 4,
        n_filler: int = 1,
        window: int = 64,
        max_steps: int = 80,
        max_calls: int | None = None,
        call_cost: float = 0.0,
        lookup_reward: float = 0.1,
        partial_credit: bool = True,
        call_prefix: bool = False,
        render_mode: str | None = None,
    ):
        n_keys = _require_int("n_keys", n_keys, 1)
        n_values = _require_int("n_values", n_values, 1)
        n_queries = _require_int("n_queries", n_queries, 1)
        if n_queries > n_keys:
            raise ValueError(
                f"n_queries must be <= n_keys ({n_keys}) since queried keys are distinct, "
                f"got {n_queries}"
            )
        # ERROR + two echoed tokens + END must fit in a response block.
        response_len = _require_int("response_len", response_len, 4)
        closing_len = _require_int("closing_len", closing_len, 1)
        n_filler = _require_int("n_filler", n_filler, 1)
        self.window = _require_int("window", window, 1)
        self.max_steps = _require_int("max_steps", max_steps, 1)
        self.max_calls = (
            2 * n_queries if max_calls is None else _require_int("max_calls", max_calls, 0)
        )
        self.call_cost = _require_reward("call_cost", call_cost)
        self.lookup_reward = _require_reward("lookup_reward", lookup_reward)
        if not isinstance(partial_credit, (bool, np.bool_)):
            raise ValueError(f"partial_credit must be a bool, got {partial_credit!r}")
        self.partial_credit = bool(partial_credit)
        if not isinstance(call_prefix, (bool, np.bool_)):
            raise ValueError(f"call_prefix must be a bool, got {call_prefix!r}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(
                f"render_mode must be None or one of {self.metadata['render_modes']}, "
                f"got {render_mode!r}"
            )
        self.render_mode = render_mode

        self.grammar = ToolUseGrammar(
            n_keys=n_keys,
            n_values=n_values,
            n_queries=n_queries,
            n_filler=n_filler,
            response_len=response_len,
            closing_len=closing_len,
            call_prefix=bool(call_prefix),
        )
        vocab_size = self.grammar.vocab_size
        self.action_space = spaces.Discrete(vocab_size)
        self.observation_space = spaces.Dict(
            {
                "tokens": spaces.Box(0, vocab_size - 1, (self.window,), dtype=np.int64),
                "loss_mask": spaces.Box(0, 1, (1,), dtype=np.int8),
            }
        )

        self._transcript = np.zeros(self.max_steps, dtype=np.int64)
        self._written_by_env = np.zeros(self.max_steps, dtype=bool)
        self._num_steps = 0
        self._episode_over = True
        self._table: np.ndarray | None = None  # drawn by reset()

    # -- episode state -------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        g = self.grammar
        rng = self.np_random
        self._table = rng.integers(0, g.n_values, size=g.n_keys)
        self._queries = [int(q) for q in rng.choice(g.n_keys, size=g.n_queries, replace=False)]
        self._num_steps = 0
        self._num_agent_tokens = 0
        self._num_tool_calls = 0
        self._num_lookups = 0
        self._phase = _TURN
        self._answer: list[int] = []
        self._num_in_order = 0  # queried keys looked up in the order asked, for lookup_reward
        self._is_success = False
        self._episode_over = False
        self._set_block([BOS, *(g.key(q) for q in self._queries)])
        return self._observation(), self._info()

    def step(self, action):
        self._require_reset("step()")
        if self._episode_over:
            raise RuntimeError("step() called after the episode ended; call reset() first")
        terminated = False
        if self._block_pos < len(self._block):
            token = self._block[self._block_pos]
            reward = self._block_rewards[self._block_pos]
            self._block_pos += 1
            terminated = self._phase == _CLOSING and self._block_pos == len(self._block)
            written_by_env = True
        else:
            token = self._validate_action(action)
            reward = 0.0
            self._num_agent_tokens += 1
            self._agent_token(token)
            written_by_env = False
        self._transcript[self._num_steps] = token
        self._written_by_env[self._num_steps] = written_by_env
        self._num_steps += 1
        truncated = not terminated and self._num_steps >= self.max_steps
        self._episode_over = terminated or truncated
        return self._observation(), float(reward), terminated, truncated, self._info()

    def _require_reset(self, what: str) -> None:
        if self._table is None:
            raise RuntimeError(f"{what} called before reset(); call reset() first")

    def _validate_action(self, action) -> int:
        """The token of an agent step: one integer (Python, NumPy or a one-element integer
        array). A float, a bool or a string is an error, not a token: ``int(10.9)`` would
        silently write token 10."""
        value = None if isinstance(action, (str, bytes)) else np.asarray(action)
        if value is None or value.dtype.kind not in "iu" or value.size != 1:
            raise ValueError(
                f"action must be one integer in [0, {self.action_space.n}), got {action!r}"
            )
        token = int(value.reshape(()))
        if not 0 <= token < self.action_space.n:
            raise ValueError(f"action must be in [0, {self.action_space.n}), got {token}")
        return token

    def _agent_token(self, token: int) -> None:
        g = self.grammar
        if self._phase == _TURN:
            if token == CALL and g.call_prefix:
                self._phase = _CALL_ARGUMENT
            elif token == ANSWER:
                self._phase = _ANSWERING
            elif g.is_key(token) and not g.call_prefix:
                self._call(token, echo=[token])
            else:
                self._respond([ERROR, token])
        elif self._phase == _CALL_ARGUMENT:
            self._phase = _TURN
            if g.is_key(token):
                self._call(token, echo=[CALL, token])
            else:
                self._respond([ERROR, CALL, token])
        else:  # _ANSWERING: the only other phase with agent steps
            self._answer.append(token)
            if len(self._answer) == g.n_queries:
                expected = [g.value(int(self._table[q])) for q in self._queries]
                num_correct = sum(a == e for a, e in zip(self._answer, expected))
                self._is_success = num_correct == g.n_queries
                if self.partial_credit:
                    terminal_reward = num_correct / g.n_queries
                else:
                    terminal_reward = float(self._is_success)
                self._phase = _CLOSING
                self._set_block([EOS] * g.closing_len, last_reward=terminal_reward)

    def _call(self, key: int, echo: list[int]) -> None:
        """Look ``key`` up, or answer an error echoing the call if the quota is spent."""
        if self._num_lookups >= self.max_calls:
            self._respond([ERROR, *echo])
            return
        self._num_lookups += 1
        key_index = key - self.grammar.key(0)
        bonus = 0.0
        if self._queries[self._num_in_order:][:1] == [key_index]:
            bonus = self.lookup_reward
            self._num_in_order += 1
        self._respond([RESULT, key, self.grammar.value(int(self._table[key_index]))], bonus)

    def _respond(self, head: list[int], bonus: float = 0.0) -> None:
        """Queue a tool response block: ``head``, filler words, ``END``."""
        g = self.grammar
        self._num_tool_calls += 1
        num_filler = g.response_len - len(head) - 1
        fill = g.filler(0) + self.np_random.integers(0, g.n_filler, size=num_filler)
        shaping = bonus - self.call_cost + 0.0  # + 0.0 turns -0.0 into 0.0
        self._set_block([*head, *fill.tolist(), END], first_reward=shaping)

    def _set_block(self, tokens, *, first_reward=0.0, last_reward=0.0) -> None:
        self._block = [int(t) for t in tokens]
        self._block_rewards = [0.0] * len(self._block)
        self._block_rewards[0] += first_reward
        self._block_rewards[-1] += last_reward
        self._block_pos = 0

    def _observation(self) -> dict[str, np.ndarray]:
        tokens = np.full(self.window, PAD, dtype=np.int64)
        n = min(self._num_steps, self.window)
        if n:
            tokens[-n:] = self._transcript[self._num_steps - n : self._num_steps]
        agent_next = not self._episode_over and self._block_pos >= len(self._block)
        return {"tokens": tokens, "loss_mask": np.array([agent_next], dtype=np.int8)}

    def _info(self) -> dict[str, Any]:
        # NumPy scalars: TorchRL's info reader needs a dtype on every value.
        return {
            "is_success": np.bool_(self._is_success),
            "num_tool_calls": np.int64(self._num_tool_calls),
            "num_agent_tokens": np.int64(self._num_agent_tokens),
        }

    # -- hidden state, for tests and debugging (the agent never sees it) -------------------------

    @property
    def table(self) -> np.ndarray:
        """Value index of each key in this episode's hidden table, shape ``[n_keys]``."""
        self._require_reset("table")
        return self._table.copy()

    @property
    def queries(self) -> list[int]:
        """Key indices asked in this episode, in answer order."""
        self._require_reset("queries")
        return list(self._queries)

    # -- rendering -----------------------------------------------------------------------------

    def render(self):
        if self.render_mode is None:
            gym.logger.warn(
                "You are calling render method without specifying any render mode. "
                'You can specify the render_mode at initialization, e.g. render_mode="ansi"'
            )
            return None
        return self.transcript()

    def transcript(self) -> str:
        """The transcript so far, environment-written spans in brackets: ``[<bos> k2] CALL k2 [...``."""
        parts = []
        previous = False
        for i in range(self._num_steps):
            by_env = bool(self._written_by_env[i])
            name = self.grammar.token_name(self._transcript[i])
            if by_env and not previous:
                name = "[" + name
            if previous and not by_env:
                parts[-1] += "]"
            parts.append(name)
            previous = by_env
        if previous:
            parts[-1] += "]"
        return " ".join(parts)
