"""``ToolUseBatchedEnv``: N :class:`~masked_rl_envs.tool_use.ToolUseEnv` episodes stepped at once
with tensor operations, as a TorchRL ``EnvBase``.

``make_torchrl_env(env_id, num_envs=N)`` steps N gymnasium environments one after the other in
Python and converts every step through TorchRL's ``GymWrapper``; for these microsecond
environments that plumbing is most of a collector's time once the policy skips masked steps.
This module keeps the state of all N episodes in tensors of shape ``[N, ...]`` and advances them
together: a step is a fixed sequence of tensor operations, whatever the environments are doing,
with no Python loop over environments. The rules are :class:`ToolUseEnv`'s, token for token
(``tests/envs/test_tool_use_batched.py`` replays every episode through ``ToolUseEnv``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Bounded, Categorical, Composite, OneHot, Unbounded
from torchrl.envs import EnvBase

from masked_rl_envs.tool_use import (
    _ANSWERING,
    _CALL_ARGUMENT,
    _CLOSING,
    _TURN,
    ANSWER,
    BOS,
    CALL,
    END,
    EOS,
    ERROR,
    PAD,
    RESULT,
    ToolUseEnv,
)

__all__ = ["ToolUseBatchedEnv"]


@dataclass
class _EpisodeState:
    """Every environment's episode, one row per environment (shape ``[num_envs, ...]``).

    A step replaces these tensors instead of writing into them (except ``head``, which no
    observation holds): the tensors of an observation already handed out never change.
    """

    tokens: torch.Tensor  # [N, W] the observation window
    num_steps: torch.Tensor
    phase: torch.Tensor  # _TURN, _CALL_ARGUMENT, _ANSWERING or _CLOSING
    # The block the environment is writing: its first head_len tokens come from head, the others
    # are filler words then END (a response block) or <eos> (the closing block). The agent
    # writes the next token once block_pos reaches block_len.
    head: torch.Tensor  # [N, max(prompt_len, 3)]
    head_len: torch.Tensor
    block_len: torch.Tensor
    block_pos: torch.Tensor
    first_reward: torch.Tensor  # float64, on the block's first token
    last_reward: torch.Tensor  # float64, on its last token
    table: torch.Tensor  # [N, n_keys] value index of each key
    queries: torch.Tensor  # [N, n_queries] key indices, in answer order
    answer: torch.Tensor  # [N, n_queries] the answer's tokens so far
    answer_len: torch.Tensor
    num_lookups: torch.Tensor
    num_in_order: torch.Tensor  # queried keys looked up in the order asked, for lookup_reward
    num_tool_calls: torch.Tensor
    num_agent_tokens: torch.Tensor
    is_success: torch.Tensor
    episode_over: torch.Tensor  # ended and not reset since


_INFO_DTYPES = {"is_success": torch.bool, "num_tool_calls": torch.int64, "num_agent_tokens": torch.int64}


class ToolUseBatchedEnv(EnvBase):
    """``num_envs`` :class:`~masked_rl_envs.tool_use.ToolUseEnv` environments as one TorchRL
    environment with batch size ``[num_envs]``, stepped together with tensor operations.

    The rules (grammar, blocks, rewards, quota, truncation) are those of :class:`ToolUseEnv`,
    built from the same constructor arguments, and so are the keys, dtypes and shapes of
    :func:`~masked_rl_envs.make_torchrl_env` with ``num_envs > 1``. Per environment, with ``W``
    the window and ``V`` the vocabulary size:

    - ``"tokens"`` ``[W]`` (int64, or ``tokens_dtype``): the last ``W`` tokens of the transcript,
      oldest first, left-padded with ``<pad>`` (0); the last entry is the token of the previous step.
    - ``"loss_mask"`` int8 ``[1]``: 1 when the NEXT token (the one the next step writes) is the
      agent's. In a rollout the root ``"loss_mask"`` at step ``t`` says whether ``"action"`` at
      ``t`` counts; on the other steps the action is ignored and may be any value.
    - ``"action"``: the token id, int64 ``[]`` (one-hot int64 ``[V]`` with
      ``categorical_action_encoding=False``).
    - ``("next", "reward")`` float32 ``[1]``; ``"done"``, ``"terminated"``, ``"truncated"`` bool
      ``[1]``: terminated on the last token of the closing block (which carries the terminal
      reward), truncated after ``max_steps`` steps without termination.
    - ``"is_success"`` bool ``[]``, ``"num_tool_calls"`` and ``"num_agent_tokens"`` int64 ``[]``:
      the info of :class:`ToolUseEnv`, so ``("next", "is_success")`` on a done step says whether
      that episode was solved.

    Episodes end independently. Reset follows TorchRL's partial-reset protocol (a ``"_reset"``
    mask of shape ``[num_envs, 1]``): ``env.rollout(..., break_when_any_done=False)``,
    ``step_and_maybe_reset`` and TorchRL's collectors restart each finished environment on the
    next step, and ``("next", ...)`` of a done step keeps the finished episode's last observation
    and info. Stepping an environment whose episode has ended without resetting it raises.

    Randomness (each episode's table and queried keys, each filler word) comes from one
    ``torch.Generator`` on ``device``, seeded by ``set_seed`` (a collector's ``set_seed`` calls
    it); unseeded, it starts from a nondeterministic seed. The draws are not numpy's, so a seed
    gives other episodes than the same seed in :class:`ToolUseEnv`.

    Every step is the same sequence of tensor operations on ``[num_envs]`` state tensors, plus
    a shift of the ``[num_envs, W]`` window, and one host synchronisation (the check that the
    actions of agent steps are tokens and that no finished episode is stepped); a reset draws a
    task for every environment and keeps those of the environments reset, without
    synchronisation. With 128 environments a TorchRL collector running the recipe's policy
    gathers 1.9-3.8x the frames per second of the gymnasium stack
    (``python -m masked_rl_benchmarks.collector``).

    Args:
        num_envs (int): environments in the batch (``>= 1``).

    Keyword Args:
        device (torch.device or str): where the state and every output live. Defaults to ``"cpu"``.
        categorical_action_encoding (bool): actions as token ids (default) or as one-hot vectors.
        tokens_dtype (torch.dtype): integer dtype of ``"tokens"``. Defaults to ``torch.int64``,
            as in :func:`~masked_rl_envs.make_torchrl_env`. ``torch.int32`` halves what a
            collector copies per step, which is most of its time with long windows (measured:
            1.3-1.5x the frames per second on ``ToolUseLong64-v0`` and ``ToolUseLong256-v0``);
            ``nn.Embedding`` takes it, ``gather`` and ``scatter`` indices must be cast to int64.
        **env_kwargs: the constructor arguments of :class:`ToolUseEnv` (``n_keys``,
            ``response_len``, ``max_steps``, ...), validated by it; ``render_mode`` must be ``None``.

    Attributes:
        grammar (ToolUseGrammar): token ids and block lengths, as ``ToolUseEnv.grammar``.
        window (int), max_steps (int), max_calls (int): as in :class:`ToolUseEnv`.

    Example:
        >>> import masked_rl_envs
        >>> from masked_rl_envs import OraclePolicy, ToolUseBatchedEnv
        >>> env = ToolUseBatchedEnv.from_id("MaskedRL/ToolUse-v0", num_envs=4)
        >>> _ = env.set_seed(0)
        >>> policy = OraclePolicy.from_env(env).as_module()
        >>> rollout = env.rollout(88, policy, break_when_any_done=False)  # two 44-step episodes
        >>> rollout.batch_size, rollout["tokens"].shape
        (torch.Size([4, 88]), torch.Size([4, 88, 64]))
        >>> env.grammar.decode(rollout["next", "tokens"][0, 4, -5:])  # the prompt, a call, RESULT
        '<bos> k1 k0 k1 RESULT'
        >>> rollout["loss_mask"][0, :8].squeeze(-1).tolist()
        [0, 0, 0, 1, 0, 0, 0, 0]
        >>> done = rollout["next", "done"].squeeze(-1)
        >>> done.sum(-1).tolist(), rollout["next", "is_success"][done].all().item()
        ([2, 2, 2, 2], True)
        >>> round(rollout["next", "reward"].sum().item(), 4)  # 8 x (1.0 + two lookup bonuses of 0.1)
        9.6
    """

    def __init__(
        self,
        num_envs: int,
        *,
        device="cpu",
        categorical_action_encoding: bool = True,
        tokens_dtype: torch.dtype = torch.int64,
        **env_kwargs,
    ):
        if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
            raise ValueError(f"num_envs must be an integer >= 1, got {num_envs!r}")
        if env_kwargs.get("render_mode") is not None:
            raise ValueError(
                f"render_mode must be None for ToolUseBatchedEnv (decode tokens with "
                f"env.grammar.decode instead), got {env_kwargs['render_mode']!r}"
            )
        if not isinstance(tokens_dtype, torch.dtype) or tokens_dtype.is_floating_point or tokens_dtype in (
            torch.bool, torch.complex64, torch.complex128
        ):
            raise ValueError(f"tokens_dtype must be an integer torch.dtype, got {tokens_dtype!r}")
        # ToolUseEnv validates the arguments and derives the grammar and the quota: one place
        # for the configuration of both environments.
        config = ToolUseEnv(**env_kwargs)
        super().__init__(device=device, batch_size=torch.Size([num_envs]))
        self.grammar = config.grammar
        self.window = config.window
        self.max_steps = config.max_steps
        self.max_calls = config.max_calls
        self.partial_credit = config.partial_credit
        self.categorical_action_encoding = bool(categorical_action_encoding)
        g = self.grammar
        if torch.iinfo(tokens_dtype).max < g.vocab_size - 1:
            raise ValueError(
                f"tokens_dtype must hold token ids up to {g.vocab_size - 1}, got {tokens_dtype}"
            )
        self.tokens_dtype = tokens_dtype
        # The shaping rewards of a response block, in Python floats as ToolUseEnv computes them
        # (float64, then float32 like TorchRL's reading of a gymnasium reward).
        self._response_reward_in_order = config.lookup_reward - config.call_cost + 0.0
        self._response_reward = 0.0 - config.call_cost + 0.0
        self._head_size = max(g.prompt_len, 3)  # the prompt, or RESULT/ERROR and two echoed tokens
        self._generator = torch.Generator(device=self.device)
        self._generator.seed()
        self._make_specs()
        self._allocate_state()

    @classmethod
    def from_id(cls, env_id: str = "MaskedRL/ToolUse-v0", num_envs: int = 1, **kwargs) -> "ToolUseBatchedEnv":
        """Build for a registered ``ToolUseEnv`` id: its registered arguments, updated by ``kwargs``
        (``device``, ``tokens_dtype``, ``categorical_action_encoding`` or constructor overrides).

        Example:
            >>> import torch
            >>> from masked_rl_envs import ToolUseBatchedEnv
            >>> env = ToolUseBatchedEnv.from_id("MaskedRL/ToolUseLong256-v0", num_envs=8,
            ...                                 tokens_dtype=torch.int32)
            >>> env.reset()["tokens"].shape, env.grammar.response_len, env.max_steps
            (torch.Size([8, 1040]), 256, 1040)
        """
        import gymnasium

        import masked_rl_envs  # noqa: F401  (registers the ids)

        spec = gymnasium.spec(env_id.split(":")[-1])
        if spec.entry_point not in ("masked_rl_envs.tool_use:ToolUseEnv", ToolUseEnv):
            raise ValueError(
                f"env_id must name a ToolUseEnv (entry point masked_rl_envs.tool_use:ToolUseEnv), "
                f"got {env_id!r} with entry point {spec.entry_point!r}"
            )
        return cls(num_envs, **{**spec.kwargs, **kwargs})

    # -- specs and state ------------------------------------------------------------------------

    def _make_specs(self) -> None:
        n, g = self.batch_size, self.grammar
        self.observation_spec = Composite(
            tokens=Bounded(0, g.vocab_size - 1, (*n, self.window), dtype=self.tokens_dtype, device=self.device),
            loss_mask=Bounded(0, 1, (*n, 1), dtype=torch.int8, device=self.device),
            **{key: Unbounded(n, dtype=dtype, device=self.device) for key, dtype in _INFO_DTYPES.items()},
            shape=n,
            device=self.device,
        )
        if self.categorical_action_encoding:
            action = Categorical(g.vocab_size, n, dtype=torch.int64, device=self.device)
        else:
            action = OneHot(g.vocab_size, (*n, g.vocab_size), dtype=torch.int64, device=self.device)
        self.action_spec = action
        self.reward_spec = Unbounded((*n, 1), dtype=torch.float32, device=self.device)
        self.done_spec = Composite(
            {key: Categorical(2, (*n, 1), dtype=torch.bool, device=self.device)
             for key in ("done", "terminated", "truncated")},
            shape=n,
            device=self.device,
        )

    def _allocate_state(self) -> None:
        """Zeroed state tensors; every episode is over until the first reset."""
        g, (n,), dev = self.grammar, self.batch_size, self.device

        def zeros(*shape, dtype=torch.int64):
            return torch.zeros((n, *shape), dtype=dtype, device=dev)

        self._state = _EpisodeState(
            tokens=zeros(self.window, dtype=self.tokens_dtype),
            num_steps=zeros(),
            phase=zeros(),
            head=zeros(self._head_size),
            head_len=zeros(),
            block_len=zeros(),
            block_pos=zeros(),
            first_reward=zeros(dtype=torch.float64),
            last_reward=zeros(dtype=torch.float64),
            table=zeros(g.n_keys),
            queries=zeros(g.n_queries),
            answer=zeros(g.n_queries),
            answer_len=zeros(),
            num_lookups=zeros(),
            num_in_order=zeros(),
            num_tool_calls=zeros(),
            num_agent_tokens=zeros(),
            is_success=zeros(dtype=torch.bool),
            episode_over=torch.ones(n, dtype=torch.bool, device=dev),
        )
        self._arange_queries = torch.arange(g.n_queries, device=dev)

    def _set_seed(self, seed: int | None) -> None:
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(int(seed))
        # Draw every environment's episode from the new seed, as gymnasium's reset(seed=...) does
        # (and TorchRL's GymWrapper with it): a collector built before set_seed() then plays
        # seeded episodes from its first step. Its first observation does not change (an empty
        # window before the prompt), so a collector's stored observation stays right.
        self._reset(None)

    def episode_state(self) -> dict:
        """Every environment's episode and the random generator, as tensors (a checkpoint of the
        environments mid-episode; :meth:`set_episode_state` restores it)."""
        state = {name: value.clone() for name, value in vars(self._state).items()}
        return {"episodes": state, "generator": self._generator.get_state()}

    def set_episode_state(self, state: dict) -> None:
        """Restore what :meth:`episode_state` returned, on an environment of the same arguments."""
        episodes = state["episodes"]
        if set(episodes) != set(vars(self._state)):
            raise ValueError(f"state must hold the fields {sorted(vars(self._state))}, got {sorted(episodes)}")
        for name, value in episodes.items():
            current = getattr(self._state, name)
            if value.shape != current.shape:
                raise ValueError(f"state[{name!r}] must have shape {list(current.shape)} (this "
                                 f"environment's), got {list(value.shape)}")
            setattr(self._state, name, value.to(current.device).clone())
        self._generator.set_state(state["generator"])

    # -- hidden state, for tests and debugging (the agent never sees it) -------------------------

    @property
    def table(self) -> torch.Tensor:
        """Value index of each key in each environment's current table, shape ``[num_envs, n_keys]``."""
        return self._state.table.clone()

    @property
    def queries(self) -> torch.Tensor:
        """Key indices asked in each environment's current episode, in answer order,
        shape ``[num_envs, n_queries]``."""
        return self._state.queries.clone()

    # -- reset and step -------------------------------------------------------------------------

    def _output(self, done, terminated, truncated, reward=None) -> TensorDict:
        """The observation, info and done flags (``[N]`` bools) of the current state, and ``reward``."""
        s = self._state
        agent_next = ~done & (s.block_pos >= s.block_len)
        out = {
            "tokens": s.tokens,
            "loss_mask": agent_next.to(torch.int8).unsqueeze(-1),
            "is_success": s.is_success,
            "num_tool_calls": s.num_tool_calls,
            "num_agent_tokens": s.num_agent_tokens,
            "done": done.unsqueeze(-1),
            "terminated": terminated.unsqueeze(-1),
            "truncated": truncated.unsqueeze(-1),
        }
        if reward is not None:
            out["reward"] = reward.to(torch.float32).unsqueeze(-1)
        return TensorDict(out, batch_size=self.batch_size, device=self.device)

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDictBase:
        g, (n,), dev, s = self.grammar, self.batch_size, self.device, self._state
        reset = None if tensordict is None else tensordict.get("_reset", None)
        if reset is None:
            reset = torch.ones(n, dtype=torch.bool, device=dev)
        else:
            reset = reset.reshape(n).to(dev, torch.bool)
        # Every environment draws a task and the ones not reset discard theirs: fixed shapes, no
        # host synchronisation.
        table = torch.randint(g.n_values, (n, g.n_keys), generator=self._generator, device=dev)
        # The first n_queries of a uniform random permutation: distinct keys in uniform order.
        order = torch.rand((n, g.n_keys), generator=self._generator, device=dev, dtype=torch.float64)
        queries = order.argsort(-1)[:, : g.n_queries]
        prompt = torch.cat(
            [torch.full((n, 1), BOS, device=dev), g.key(0) + queries,
             torch.zeros((n, self._head_size - g.prompt_len), dtype=torch.int64, device=dev)],
            -1,
        )
        rows = reset.unsqueeze(-1)
        s.table = torch.where(rows, table, s.table)
        s.queries = torch.where(rows, queries, s.queries)
        s.head = torch.where(rows, prompt, s.head)
        s.tokens = torch.where(rows, PAD, s.tokens)
        s.head_len = torch.where(reset, g.prompt_len, s.head_len)
        s.block_len = torch.where(reset, g.prompt_len, s.block_len)
        s.phase = torch.where(reset, _TURN, s.phase)
        s.is_success = s.is_success & ~reset
        s.episode_over = s.episode_over & ~reset
        for name in ("num_steps", "block_pos", "answer_len", "num_lookups", "num_in_order",
                     "num_tool_calls", "num_agent_tokens", "first_reward", "last_reward"):
            setattr(s, name, torch.where(reset, 0, getattr(s, name)))

        false = torch.zeros(n, dtype=torch.bool, device=dev)
        return self._output(false, false.clone(), false.clone())

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        g, (n,), dev, s = self.grammar, self.batch_size, self.device, self._state
        action = tensordict.get("action")
        if action.is_floating_point() or action.is_complex() or action.dtype == torch.bool:
            # 10.9 would become token 10: integer token ids (or one-hot integer vectors) only.
            raise ValueError(f"action must be an integer tensor of token ids, got dtype {action.dtype}")
        if not self.categorical_action_encoding:
            action = action.argmax(-1)
        token = action.reshape(n).to(dev, torch.int64)
        # Partial steps (TorchRL's "_step" mask, e.g. rollout(break_when_all_done=True)): the
        # other environments do not move.
        active = tensordict.get("_step", None)
        active = None if active is None else active.reshape(n).to(dev, torch.bool)

        pos, block_len, phase = s.block_pos, s.block_len, s.phase
        writing = pos < block_len  # the environment writes this step's token
        agent = ~writing
        if active is not None:
            writing, agent = writing & active, agent & active
        stepped = agent | writing
        bad_action = agent & ((token < 0) | (token >= g.vocab_size))
        if (bad_action | (stepped & s.episode_over)).any():  # the step's one host synchronisation
            self._raise_bad_step(token, bad_action, stepped)

        # -- the environment's token: the head, then filler words and END, or <eos> throughout
        closing = phase == _CLOSING
        last = pos == block_len - 1
        head_token = s.head.gather(1, pos.clamp(max=self._head_size - 1).unsqueeze(-1)).squeeze(-1)
        if g.n_filler > 1:
            filler = g.filler(0) + torch.randint(g.n_filler, (n,), generator=self._generator, device=dev)
        else:
            filler = torch.full((n,), g.filler(0), device=dev)
        tail = torch.where(closing, EOS, torch.where(last, END, filler))
        env_token = torch.where(pos < s.head_len, head_token, tail)
        env_reward = torch.where(pos == 0, s.first_reward, 0.0) + torch.where(last, s.last_reward, 0.0)
        terminated = writing & closing & last

        # -- the agent's token, as in ToolUseEnv._agent_token
        key_index = token - g.key(0)
        is_key = (key_index >= 0) & (key_index < g.n_keys)
        key_index = key_index.clamp(0, g.n_keys - 1)
        turn = agent & (phase == _TURN)
        call_argument = agent & (phase == _CALL_ARGUMENT)
        answering = agent & (phase == _ANSWERING)
        opens_answer = turn & (token == ANSWER)
        if g.call_prefix:
            opens_call = turn & (token == CALL)
            calls = call_argument & is_key
        else:
            opens_call = torch.zeros_like(turn)
            calls = turn & is_key
        malformed = (turn & ~opens_call & ~opens_answer & ~calls) | (call_argument & ~is_key)
        lookup = calls & (s.num_lookups < self.max_calls)
        responds = malformed | calls  # a response block follows: a result or an error
        next_query = s.queries.gather(1, s.num_in_order.clamp(max=g.n_queries - 1).unsqueeze(-1)).squeeze(-1)
        in_order = lookup & (s.num_in_order < g.n_queries) & (next_query == key_index)
        value_token = g.value(0) + s.table.gather(1, key_index.unsqueeze(-1)).squeeze(-1)
        # [RESULT key value], [ERROR token] (a turn) or [ERROR CALL token] (after CALL)
        head = torch.stack(
            [
                torch.where(lookup, RESULT, ERROR),
                torch.where(lookup | turn, token, CALL),
                torch.where(lookup, value_token, token),
            ],
            -1,
        )
        head_len = torch.where(turn & ~lookup, 2, 3)

        answer_slot = answering.unsqueeze(-1) & (self._arange_queries == s.answer_len.unsqueeze(-1))
        s.answer = torch.where(answer_slot, token.unsqueeze(-1), s.answer)
        s.answer_len = s.answer_len + answering
        answers = answering & (s.answer_len == g.n_queries)  # the answer is complete
        num_correct = (s.answer == g.value(0) + s.table.gather(1, s.queries)).sum(-1)
        solved = answers & (num_correct == g.n_queries)
        if self.partial_credit:
            terminal_reward = num_correct.to(torch.float64) / g.n_queries
        else:
            terminal_reward = solved.to(torch.float64)

        # -- the state after this step
        s.num_lookups = s.num_lookups + lookup
        s.num_in_order = s.num_in_order + in_order
        s.num_tool_calls = s.num_tool_calls + responds
        s.num_agent_tokens = s.num_agent_tokens + agent
        s.is_success = s.is_success | solved
        phase = torch.where(opens_call, _CALL_ARGUMENT, phase)
        phase = torch.where(opens_answer, _ANSWERING, phase)
        phase = torch.where(call_argument, _TURN, phase)
        s.phase = torch.where(answers, _CLOSING, phase)
        s.head[:, :3] = torch.where(responds.unsqueeze(-1), head, s.head[:, :3])
        s.head_len = torch.where(responds, head_len, torch.where(answers, 0, s.head_len))
        s.block_len = torch.where(responds, g.response_len, torch.where(answers, g.closing_len, block_len))
        s.block_pos = torch.where(responds | answers, 0, pos + writing)
        response_reward = torch.where(in_order, self._response_reward_in_order, self._response_reward)
        s.first_reward = torch.where(responds, response_reward, torch.where(answers, 0.0, s.first_reward))
        s.last_reward = torch.where(responds, 0.0, torch.where(answers, terminal_reward, s.last_reward))

        written = torch.where(writing, env_token, token).to(self.tokens_dtype)
        shifted = torch.cat([s.tokens[:, 1:], written.unsqueeze(-1)], -1)
        s.tokens = shifted if active is None else torch.where(active.unsqueeze(-1), shifted, s.tokens)
        s.num_steps = s.num_steps + stepped
        truncated = stepped & ~terminated & (s.num_steps >= self.max_steps)
        done = terminated | truncated
        s.episode_over = s.episode_over | done

        return self._output(done, terminated, truncated, reward=torch.where(writing, env_reward, 0.0))

    def _raise_bad_step(self, token, bad_action, stepped) -> None:
        over = (stepped & self._state.episode_over).nonzero().squeeze(-1).tolist()
        if over:
            raise RuntimeError(
                f"step() called on environments {over} whose episode ended; reset them first "
                f"(env.reset with a '_reset' mask, or step_and_maybe_reset)"
            )
        rows = bad_action.nonzero().squeeze(-1).tolist()
        raise ValueError(
            f"action must be a token id in [0, {self.grammar.vocab_size}) on agent steps "
            f"(loss_mask == 1), got {token[rows].tolist()} in environments {rows}"
        )
