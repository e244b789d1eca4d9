"""Entry points of ``masked-rl train`` and ``masked-rl compare`` (see ``examples/cli.py``)."""

from __future__ import annotations


def train_main(argv: list[str]) -> int:
    """``masked-rl train``: one PPO run of the recipe (``ppo_tool_use.py``)."""
    from masked_rl_examples.ppo_tool_use.ppo_tool_use import main

    return main(argv, prog="masked-rl train")


def compare_main(argv: list[str]) -> int:
    """``masked-rl compare``: masked vs plain GAE over seeds (``compare.py``)."""
    from masked_rl_examples.ppo_tool_use.compare import main

    return main(argv, prog="masked-rl compare")
