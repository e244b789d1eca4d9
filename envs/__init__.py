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

Also: :class:`OraclePolicy` (a scripted policy that solves every episode from its
observations) and :func:`make_torchrl_env` (the ids as a TorchRL environment).
"""

import gymnasium

from masked_rl_envs.oracle import OraclePolicy, oracle_action
from masked_rl_envs.tool_use import ToolUseEnv, ToolUseGrammar
from masked_rl_envs.torchrl_env import make_torchrl_env

__all__ = [
    "HARD_KWARGS",
    "OraclePolicy",
    "ToolUseEnv",
    "ToolUseGrammar",
    "make_torchrl_env",
    "oracle_action",
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

_ENTRY_POINT = "masked_rl_envs.tool_use:ToolUseEnv"
for _env_id, _kwargs in (("MaskedRL/ToolUse-v0", {}), ("MaskedRL/ToolUseHard-v0", HARD_KWARGS)):
    if _env_id not in gymnasium.registry:  # importing twice (e.g. importlib reload) is harmless
        gymnasium.register(id=_env_id, entry_point=_ENTRY_POINT, kwargs=_kwargs)
