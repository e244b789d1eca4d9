"""The ``masked-rl`` command line: ``train``, ``compare`` and ``bench``.

Each sub-command lives in its own module and is imported only when it is run, so
``masked-rl bench`` does not pay for importing Gymnasium environments and vice versa.
"""

from __future__ import annotations

import argparse
import importlib
import sys

_COMMANDS = {
    "train": ("masked_rl_examples.ppo_tool_use.commands", "train_main",
              "train PPO on a toy tool-use environment (masked or plain GAE)"),
    "compare": ("masked_rl_examples.ppo_tool_use.commands", "compare_main",
                "masked vs plain GAE over several seeds: table, CSV and PNG"),
    "bench": ("masked_rl_benchmarks.bench", "main",
              "time masked GAE against the alternatives: table, CSV and JSON"),
    "bench-cp": ("masked_rl_benchmarks.cp", "main",
                 "context-parallel masked GAE vs rebuilding full rows, on N gloo ranks"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="masked-rl",
        description="Masked GAE for multi-turn, tool-using agents in TorchRL.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{train,compare,bench}")
    for name, (_, _, help_text) in _COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        parser.parse_args(argv[:1] or ["--help"])
        return 2
    module_name, func_name, _ = _COMMANDS[argv[0]]
    command = getattr(importlib.import_module(module_name), func_name)
    return int(command(argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
