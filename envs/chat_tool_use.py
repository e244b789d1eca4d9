"""The key-value lookup task of :class:`~masked_rl_envs.ToolUseEnv` as a chat, on TorchRL's ``ChatEnv``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from tensordict import TensorDictBase, lazy_stack
from torchrl.data import Composite, Unbounded
from torchrl.envs import TransformedEnv
from torchrl.envs.llm import ChatEnv
from torchrl.envs.llm.transforms.tools import ToolTransformBase

from masked_rl_envs.llm_factories import CHAT_TEMPLATE_NAME, task_words, words

__all__ = ["ChatToolUseConfig", "ChatToolUseTransform", "make_chat_tool_use_env"]


@dataclass(frozen=True)
class ChatToolUseConfig:
    """The rules of one chat tool-use task (see :func:`make_chat_tool_use_env`).

    >>> ChatToolUseConfig().oracle_turns
    3
    """

    n_keys: int = 4
    n_values: int = 4
    n_queries: int = 2
    n_filler: int = 1
    response_len: int = 8
    max_turns: int = 5
    max_calls: int | None = None
    lookup_reward: float = 0.1
    call_cost: float = 0.0
    partial_credit: bool = True

    def __post_init__(self):
        for name, low in (("n_keys", 1), ("n_values", 1), ("n_queries", 1), ("n_filler", 1),
                          ("response_len", 2), ("max_turns", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.n_queries > self.n_keys:
            raise ValueError(
                f"n_queries must be <= n_keys={self.n_keys} (distinct keys are asked), "
                f"got {self.n_queries}"
            )
        if self.max_calls is not None and (
            isinstance(self.max_calls, bool) or not isinstance(self.max_calls, int)
            or self.max_calls < 0
        ):
            raise ValueError(f"max_calls must be None or an integer >= 0, got {self.max_calls!r}")
        for name in ("lookup_reward", "call_cost"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
                math.isfinite(value) and value >= 0
            ):
                raise ValueError(f"{name} must be a finite float >= 0, got {value!r}")

    @property
    def quota(self) -> int:
        """Lookups served before calls become errors (``max_calls``, default ``2 * n_queries``)."""
        return 2 * self.n_queries if self.max_calls is None else self.max_calls

    @property
    def oracle_turns(self) -> int:
        """Assistant turns of a perfect episode: one lookup per queried key, then the answer."""
        return self.n_queries + 1

    @property
    def oracle_return(self) -> float:
        return 1.0 + self.n_queries * (self.lookup_reward - self.call_cost)


class ChatToolUseTransform(ToolTransformBase):
    """The task's rules as a TorchRL tool transform on a history-mode ``ChatEnv``.

    At reset it draws, per episode, a hidden table (``n_keys`` keys to values) and ``n_queries``
    distinct queried keys from its own seeded generator, and writes the user prompt into the
    ``"query"`` entry ``ChatEnv`` reads. After each assistant turn it parses the turn's words,
    answers a lookup with a ``tool`` message (the base class appends it to the history), and
    writes ``("next", "reward")``, ``done``/``terminated``/``truncated`` and the episode's
    ``"success"`` and ``"num_tool_calls"``, all ``[B, 1]``.

    Args:
        config: the :class:`ChatToolUseConfig`.
        seed: seed of the episode generator.
        group_size: consecutive rows that share one task (table and queried keys), as a
            group-relative advantage (GRPO) needs; the batch size must be a multiple of it.
    """

    def __init__(self, config: ChatToolUseConfig, seed: int = 0, group_size: int = 1):
        super().__init__()
        self.config = config
        self.group_size = group_size
        self._rng = np.random.default_rng(seed)
        self._tables = None

    # -- episode state -------------------------------------------------------------------
    def _new_episodes(self, batch: int):
        cfg = self.config
        tasks = batch // self.group_size
        tables = self._rng.integers(0, cfg.n_values, size=(tasks, cfg.n_keys))
        queries = np.stack(
            [self._rng.permutation(cfg.n_keys)[: cfg.n_queries] for _ in range(tasks)]
        )
        self._tables = np.repeat(tables, self.group_size, axis=0)
        self._queries = np.repeat(queries, self.group_size, axis=0)
        self._turns = np.zeros(batch, np.int64)
        self._calls = np.zeros(batch, np.int64)  # tool messages, results and errors
        self._lookups = np.zeros(batch, np.int64)  # lookups served, against the quota
        self._next_query = np.zeros(batch, np.int64)  # the in-order lookup bonus' progress
        self._done = np.zeros(batch, bool)
        self._success = np.zeros(batch, bool)

    def generator_state(self) -> dict:
        """The episode generator's state (a checkpoint resumes the same task stream)."""
        return self._rng.bit_generator.state

    def set_generator_state(self, state: dict) -> None:
        self._rng.bit_generator.state = state

    @property
    def tables(self) -> np.ndarray:
        """``[B, n_keys]`` values of the current episodes' hidden tables."""
        return self._tables

    @property
    def queries(self) -> np.ndarray:
        """``[B, n_queries]`` queried keys of the current episodes, in answer order."""
        return self._queries

    def _reset_env_preprocess(self, tensordict: TensorDictBase | None) -> TensorDictBase:
        batch_size = self.parent.batch_size
        if tensordict is None:
            from tensordict import TensorDict

            tensordict = TensorDict(batch_size=batch_size)
        self._new_episodes(int(batch_size.numel()))
        prompts = [words(f"k{k}" for k in q) for q in self._queries]
        tensordict.set(ChatEnv.data_key, prompts)
        return tensordict

    def _reset(self, tensordict, tensordict_reset):
        return self._write(tensordict_reset, np.zeros(len(self._done)),
                           np.zeros(len(self._done), bool), np.zeros(len(self._done), bool))

    # -- one assistant turn --------------------------------------------------------------
    def _filler(self, n: int) -> list[str]:
        return [f"w{i}" for i in self._rng.integers(0, self.config.n_filler, size=n)]

    def _process_batch_item(self, content: str, index: int) -> list[str] | None:
        cfg = self.config
        if self._done[index]:  # finished episodes get no tool message
            return None
        self._turns[index] += 1
        turn = content.split()
        keys = {f"k{k}": k for k in range(cfg.n_keys)}
        reward = 0.0
        terminated = False
        reply = None
        if turn[:1] == ["answer"]:
            given = turn[1 : 1 + cfg.n_queries]
            truth = [f"v{self._tables[index, k]}" for k in self._queries[index]]
            right = sum(g == t for g, t in zip(given, truth))
            self._success[index] = right == cfg.n_queries
            reward = right / cfg.n_queries if cfg.partial_credit else float(self._success[index])
            terminated = True
        elif self._turns[index] < cfg.max_turns:
            if len(turn) >= 2 and turn[0] == "lookup" and turn[1] in keys and (
                self._lookups[index] < cfg.quota
            ):
                key = keys[turn[1]]
                self._lookups[index] += 1
                reply = [turn[1], f"v{self._tables[index, key]}"]
                if (self._next_query[index] < cfg.n_queries
                        and key == self._queries[index, self._next_query[index]]):
                    reward += cfg.lookup_reward
                    self._next_query[index] += 1
            else:
                reply = ["error"]
            self._calls[index] += 1
            reward -= cfg.call_cost
            reply = reply + self._filler(cfg.response_len - len(reply))
        # else: the budget's last turn, not an answer: truncated, and the tool is not called
        truncated = not terminated and reply is None
        self._step_out[index] = (reward, terminated, truncated)
        self._done[index] = terminated or truncated
        return None if reply is None else [words(reply)]

    def _step(self, tensordict, next_tensordict):
        if self._tables is None:
            raise RuntimeError("ChatToolUseTransform: call env.reset() before env.step()")
        batch = len(self._done)
        self._step_out = {i: (0.0, False, False) for i in range(batch)}
        was_done = self._done.copy()
        next_tensordict = self._process_tensordict(next_tensordict)
        reward = np.array([self._step_out[i][0] for i in range(batch)])
        terminated = np.array([self._step_out[i][1] for i in range(batch)]) | was_done
        truncated = np.array([self._step_out[i][2] for i in range(batch)])
        return self._write(next_tensordict, reward, terminated, truncated)

    def _write(self, td, reward, terminated, truncated):
        shape = (*td.batch_size, 1)
        as_tensor = lambda x, dtype: torch.as_tensor(np.asarray(x)).to(dtype).reshape(shape)
        td.set("reward", as_tensor(reward, torch.float32))
        td.set("terminated", as_tensor(terminated, torch.bool))
        td.set("truncated", as_tensor(truncated, torch.bool))
        td.set("done", as_tensor(terminated | truncated, torch.bool))
        td.set("success", as_tensor(self._success, torch.bool))
        td.set("num_tool_calls", as_tensor(self._calls, torch.int64))
        return td

    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        shape = (*observation_spec.shape, 1)
        observation_spec["success"] = Unbounded(shape, dtype=torch.bool)
        observation_spec["num_tool_calls"] = Unbounded(shape, dtype=torch.int64)
        return observation_spec

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        reward_spec["reward"] = Unbounded((*reward_spec.shape, 1))
        return reward_spec


def make_chat_tool_use_env(
    batch_size: int,
    config: ChatToolUseConfig | None = None,
    *,
    tokenizer=None,
    seed: int = 0,
    group_size: int = 1,
) -> TransformedEnv:
    """
    Answer questions about a hidden key-value table that only a lookup tool can read, as a chat.

    ## Description
    The rules of :class:`~masked_rl_envs.ToolUseEnv` in chat form, on TorchRL's ``ChatEnv``
    (history mode) with :class:`ChatToolUseTransform`, a ``ToolTransformBase``. Each episode draws
    a hidden table mapping each of ``n_keys`` keys ``k0 ...`` to one of ``n_values`` values
    ``v0 ...`` and ``n_queries`` distinct queried keys. The user message lists the queried keys;
    the only way to read the table is the lookup tool. An oracle transcript of the two-lookup task
    (TorchRL's ``chatml_format`` template; message contents are words joined by spaces):

        <|im_start|>user\\nk3 k0<|im_end|>\\n
        <|im_start|>assistant\\nlookup k3<|im_end|>\\n
        <|im_start|>tool\\nk3 v2 w0 w0 w0 w0 w0 w0<|im_end|>\\n
        <|im_start|>assistant\\nlookup k0<|im_end|>\\n
        <|im_start|>tool\\nk0 v1 w0 w0 w0 w0 w0 w0<|im_end|>\\n
        <|im_start|>assistant\\nanswer v2 v1<|im_end|>\\n

    Only assistant content is the agent's (TorchRL's assistant mask); the prompt, the tool
    messages and the template tokens are written by the environment, so the value a lookup
    returns reaches the agent only through tokens it did not write.

    ## Action Space
    One assistant message per step (``("history", "full")`` from a ``TransformersWrapper`` in
    history mode). Its content is split on whitespace:

        lookup <key> ...          -> tool message "<key> <value> w ... w", next turn
        answer <v_1> ... <v_n> ... -> end of episode (words after the n-th value are ignored)
        anything else             -> tool message "error w ... w", next turn

    Words after ``lookup <key>`` are ignored, so a turn that runs on past its action (TorchRL's
    assistant mask never trains ``<|im_end|>``: the stop decision is untrained unless the
    trainer makes it an action) is still read. A lookup beyond the quota (``max_calls``) is an
    error.

    ## Observation Space
    ``("history", "prompt")``: the transcript so far (``ChatEnv``), plus ``"success"`` (bool) and
    ``"num_tool_calls"`` (int64), ``[B, 1]``.

    ## Starting State
    The user message ``"<q_1> ... <q_n>"``. Tables, queried keys and filler words are drawn
    from the transform's generator (``seed``; ``env.transform.generator_state()``).

    ## Rewards
    ``("next", "reward")`` ``[B, 1]`` after each assistant turn:
    - the answer turn: the fraction of correct values (``partial_credit``, default), else 1.0 if
      all are right and 0.0 otherwise;
    - a lookup turn: ``lookup_reward`` for looking up the next queried key in the order asked
      (each at most once), minus ``call_cost`` for every tool message (results and errors).
    The oracle's return is ``1 + n_queries * (lookup_reward - call_cost)`` (1.2 by default).

    ## Episode End
    - Termination: the answer turn (``terminated = done = True``).
    - Truncation: ``max_turns`` assistant turns without an answer (``truncated = done = True``);
      the budget's last turn, if it is not an answer, is not served (no tool message, no
      shaping reward, no call cost): the transcript ends on the agent's turn.
    Rows that are already done stay done, get reward 0 and no tool message on later steps (a
    batch steps together); a trainer keeps each row's history at the step its episode ended.

    ## Arguments
    - ``batch_size``: episodes stepped together.
    - ``config``: :class:`ChatToolUseConfig` (defaults: 4 keys, 4 values, 2 queries, 1 filler word,
      8-word tool messages, 5 turns, quota ``2 * n_queries``, ``lookup_reward=0.1``,
      ``call_cost=0``, ``partial_credit=True``).
    - ``tokenizer``: optional; checked to hold every word the task writes or reads (the
      vocabulary of :func:`~masked_rl_envs.llm_factories.make_tokenizer`).
    - ``seed``: the episode generator's seed.
    - ``group_size``: consecutive rows sharing one task (GRPO's groups); divides ``batch_size``.

    Example:
        >>> from tensordict import TensorDict
        >>> from torchrl.data.llm import History
        >>> env = make_chat_tool_use_env(2, seed=0)
        >>> td = env.reset()
        >>> list(td["history"].prompt[0].content)
        ['k1 k2']
        >>> def reply(td, texts):
        ...     turns = lazy_stack([History(role="assistant", content=t).unsqueeze(0) for t in texts])
        ...     td["history"].full = td["history"].prompt.extend(turns, inplace=False, dim=-1)
        ...     return env.step(td)
        >>> td = reply(td, [words(["lookup", "k1"]), words(["hello"])])
        >>> td["next", "history"].prompt[0, -1].content, td["next", "reward"].squeeze(-1).tolist()
        ('k1 v2 w0 w0 w0 w0 w0 w0', [0.1..., 0.0])
        >>> td["next", "history"].prompt[1, -1].content
        'error w0 w0 w0 w0 w0 w0 w0'
    """
    config = ChatToolUseConfig() if config is None else config
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or (
        batch_size % group_size
    ):
        raise ValueError(
            f"group_size must be a positive divisor of batch_size={batch_size}, got {group_size!r}"
        )
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        missing = [w for w in task_words(config.n_keys, config.n_values, config.n_filler)
                   if f"\u2581{w}" not in vocab]
        if missing:
            raise ValueError(
                f"tokenizer lacks the task words {missing[:5]}; build it "
                f"with make_tokenizer(n_keys>={config.n_keys}, n_values>={config.n_values}, "
                f"n_filler>={config.n_filler})"
            )
    base = ChatEnv(
        batch_size=(batch_size,),
        input_mode="history",
        tokenizer=tokenizer,
        template_kwargs={"chat_template_name": CHAT_TEMPLATE_NAME},
    )
    return TransformedEnv(base, ChatToolUseTransform(config, seed=seed, group_size=group_size))
