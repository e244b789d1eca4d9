"""Toy token-level tool-use environments for masked advantage estimation.

Importing this package registers the environment ids with gymnasium (1.x has no entry-point
plugins), so ``gymnasium.make("masked_rl_envs:MaskedRL/ToolUse-v0")`` works from a fresh
interpreter:

- ``MaskedRL/ToolUse-v0``: :class:`ToolUseEnv` defaults: 4 keys and values, 2 one-token
  lookups, 16-token responses, window 64, budget 80 steps, lookup bonus and partial credit
  (oracle: 44 steps, 5 of them the agent's). Small and learnable by a small PPO policy.
- ``MaskedRL/ToolUseHard-v0``: :data:`HARD_KWARGS`: 8 keys and values, 3 two-token
  ``CALL <key>`` lookups, 48-token noisy responses, window 256, budget 256 steps, 0.01 cost per
  tool call, all-or-nothing reward (oracle: 166 steps, 10 of them the agent's).
- ``MaskedRL/ToolUseClosing64-v0``: :data:`CLOSING64_KWARGS`: v0 with a 64-token closing block,
  so the terminal reward arrives 64 masked steps after the answer; a 74-token window (the whole
  transcript up to the answer, two wasted turns included), budget 138 steps (oracle: 104 steps,
  5 of them the agent's, plus two wasted turns). ``masked-rl train --closing-len 64`` on v0
  builds the same environment.
- ``MaskedRL/ToolUseLong64-v0``: :data:`LONG64_KWARGS`: v0 with 64-token tool outputs and *no*
  lookup bonus; window = budget = 272 steps (oracle: 140 steps, 5 of them the agent's; the
  budget and the window hold the oracle plus two wasted 65-step turns).
- ``MaskedRL/ToolUseLong256-v0``: :data:`LONG256_KWARGS`: v0 (lookup bonus included) with
  256-token tool outputs; window = budget = 1040 steps (oracle: 524 steps, 5 of them the
  agent's, plus room for two wasted 257-step turns).

In these three ids the window is the whole step budget, so nothing of an episode scrolls out of
view: the answer stays visible to the critic until the terminal reward, and the prompt to the
policy after wasted turns.

Also: :class:`OraclePolicy` (a scripted policy that solves every episode from its
observations), :func:`make_torchrl_env` (the ids as a TorchRL environment) and
:class:`ToolUseBatchedEnv` (N episodes stepped at once with tensor operations, a TorchRL
``EnvBase``; ``make_torchrl_env(..., backend="batched")``).
"""

import gymnasium

from masked_rl_envs.oracle import OraclePolicy, oracle_action
from masked_rl_envs.tool_use import ToolUseEnv, ToolUseGrammar
from masked_rl_envs.torchrl_env import make_torchrl_env

__all__ = [
    "CLOSING64_KWARGS",
    "HARD_KWARGS",
    "LONG256_KWARGS",
    "LONG64_KWARGS",
    "OraclePolicy",
    "ToolUseBatchedEnv",
    "ToolUseEnv",
    "ToolUseGrammar",
    "make_torchrl_env",
    "oracle_action",
    "time_limit_kwargs",
]

HARD_KWARGS = dict(
    n_keys=8,
    n_values=8,
    n_queries=3,
    response_len=48,
    closing_len=8,
    n_filler=8,
    window=256,
    max_steps=256,
    call_cost=0.01,
    lookup_reward=0.0,
    partial_credit=False,
    call_prefix=True,
)
"""Constructor arguments of ``MaskedRL/ToolUseHard-v0`` (oracle: 166 steps, 10 agent tokens)."""

CLOSING64_KWARGS = dict(closing_len=64, window=74, max_steps=138)
"""Constructor arguments of ``MaskedRL/ToolUseClosing64-v0`` (oracle: 104 steps, 5 agent tokens)."""

LONG64_KWARGS = dict(response_len=64, lookup_reward=0.0, window=272, max_steps=272)
"""Constructor arguments of ``MaskedRL/ToolUseLong64-v0`` (oracle: 140 steps, 5 agent tokens)."""

LONG256_KWARGS = dict(response_len=256, window=1040, max_steps=1040)
"""Constructor arguments of ``MaskedRL/ToolUseLong256-v0`` (oracle: 524 steps, 5 agent tokens)."""



def __getattr__(name):
    # Lazy: importing this package (as gymnasium does in every vector-env worker) should not
    # pay for importing TorchRL.
    if name == "ToolUseBatchedEnv":
        from masked_rl_envs.tool_use_batched import ToolUseBatchedEnv

        return ToolUseBatchedEnv
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_ENTRY_POINT = "masked_rl_envs.tool_use:ToolUseEnv"
_IDS = (
    ("MaskedRL/ToolUse-v0", {}),
    ("MaskedRL/ToolUseHard-v0", HARD_KWARGS),
    ("MaskedRL/ToolUseClosing64-v0", CLOSING64_KWARGS),
    ("MaskedRL/ToolUseLong64-v0", LONG64_KWARGS),
    ("MaskedRL/ToolUseLong256-v0", LONG256_KWARGS),
)
_DEFAULT_MAX_STEPS = 80  # ToolUseEnv's default max_steps (tests/envs/test_env_ids.py checks it)
for _env_id, _kwargs in _IDS:
    if _env_id not in gymnasium.registry:  # importing twice (e.g. importlib reload) is harmless
        # Gymnasium's TimeLimit at the env's own step budget: `spec.max_episode_steps` tells
        # users the limit, and both truncate at the same step (ToolUseEnv sizes its transcript
        # by max_steps, so it keeps its own truncation; the TimeLimit never cuts earlier).
        gymnasium.register(id=_env_id, entry_point=_ENTRY_POINT, kwargs=_kwargs,
                           max_episode_steps=_kwargs.get("max_steps", _DEFAULT_MAX_STEPS))


def time_limit_kwargs(env_kwargs: dict) -> dict:
    """``env_kwargs`` plus the ``max_episode_steps`` that ``gymnasium.make`` needs when they
    override ``max_steps``: the registered TimeLimit would otherwise cut episodes at the id's
    budget, not the new one.

    Example:
        >>> import gymnasium, masked_rl_envs
        >>> env = gymnasium.make("MaskedRL/ToolUse-v0", **time_limit_kwargs({"max_steps": 120}))
        >>> env.spec.max_episode_steps, env.unwrapped.max_steps
        (120, 120)
    """
    if "max_steps" not in env_kwargs:
        return dict(env_kwargs)
    return {**env_kwargs, "max_episode_steps": env_kwargs["max_steps"]}
