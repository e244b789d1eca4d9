"""The ``masked-rl`` command line: ``train``, ``compare``, ``eval``, ``bench`` and the ``llm-*``
commands.

Each command parses and checks its options with a torch-free module first and imports the
code that runs it (torch, TorchRL, the environments) only then: ``--help`` and option errors
come back at once, and ``masked-rl bench`` does not pay for the recipe or vice versa.
"""

from __future__ import annotations

import argparse
import os
import sys

# TorchRL logs INFO lines (to stdout, through the progress bars) unless told otherwise; it reads
# this when it is first imported, which the commands do after this module. RL_LOGGING_LEVEL=INFO
# in the environment brings them back.
os.environ.setdefault("RL_LOGGING_LEVEL", "WARNING")


def _train(argv: list[str]) -> int:
    from masked_rl_examples.ppo_tool_use.config import parse_train_command

    command = parse_train_command(argv, prog="masked-rl train")
    from masked_rl_examples.ppo_tool_use.ppo_tool_use import run_train_command

    return run_train_command(command)


def _compare(argv: list[str]) -> int:
    from masked_rl_examples.ppo_tool_use.config import parse_compare_command

    command = parse_compare_command(argv, prog="masked-rl compare")
    from masked_rl_examples.ppo_tool_use.compare import run_compare_command

    return run_compare_command(command)


def _eval(argv: list[str]) -> int:
    from masked_rl_examples.ppo_tool_use.config import parse_eval_command

    command = parse_eval_command(argv, prog="masked-rl eval")
    from masked_rl_examples.ppo_tool_use.ppo_tool_use import run_eval_command

    return run_eval_command(command)


def _bench(argv: list[str]) -> int:
    from masked_rl_benchmarks.options import parse_bench_args

    args = parse_bench_args(argv)
    from masked_rl_benchmarks.bench import run

    return run(args)


def _bench_cp(argv: list[str]) -> int:
    from masked_rl_benchmarks.options import parse_cp_args

    args = parse_cp_args(argv)
    from masked_rl_benchmarks.cp import run

    return run(args)


def _llm_train(argv: list[str]) -> int:
    from masked_rl_examples.llm_ppo.config import parse_llm_train_command

    command = parse_llm_train_command(argv, prog="masked-rl llm-train")
    from masked_rl_examples.llm_ppo.llm_ppo import run_llm_train_command

    return run_llm_train_command(command)


def _llm_compare(argv: list[str]) -> int:
    from masked_rl_examples.llm_ppo.config import parse_llm_compare_command

    command = parse_llm_compare_command(argv, prog="masked-rl llm-compare")
    from masked_rl_examples.llm_ppo.compare import run_llm_compare_command

    return run_llm_compare_command(command)


def _llm_eval(argv: list[str]) -> int:
    from masked_rl_examples.llm_ppo.config import parse_llm_eval_command

    command = parse_llm_eval_command(argv, prog="masked-rl llm-eval")
    from masked_rl_examples.llm_ppo.llm_ppo import run_llm_eval_command

    return run_llm_eval_command(command)


def _llm_bench(argv: list[str]) -> int:
    from masked_rl_benchmarks.llm import parse_llm_bench_args

    args = parse_llm_bench_args(argv, prog="masked-rl llm-bench")
    from masked_rl_benchmarks.llm import run

    return run(args)


_COMMANDS = {
    "train": (_train, "train PPO on a toy tool-use environment (masked or plain GAE); "
                      "--resume RUN_DIR continues an interrupted run"),
    "compare": (_compare, "masked vs plain GAE over several seeds: table, CSV and PNG "
                          "(re-run to resume)"),
    "eval": (_eval, "greedy success of a trained checkpoint over seeded episodes"),
    "bench": (_bench, "time masked GAE against the alternatives: table, CSV and JSON"),
    "bench-cp": (_bench_cp, "context-parallel masked GAE vs rebuilding full rows, on N gloo ranks"),
    "llm-train": (_llm_train, "token-level PPO with masked GAE (or GRPO, plain token GAE) for a "
                              "tiny causal LM on the chat tool-use task (TorchRL LLM stack)"),
    "llm-compare": (_llm_compare, "masked PPO vs GRPO vs plain token GAE over seeds: table, CSV "
                                  "and PNG (re-run to resume)"),
    "llm-eval": (_llm_eval, "greedy success of an llm-train checkpoint, and its transcripts"),
    "llm-bench": (_llm_bench, "tokens per second of a PPO iteration against a GRPO iteration, "
                              "and the estimator's share"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="masked-rl",
        description="Masked GAE for multi-turn, tool-using agents in TorchRL.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(_COMMANDS) + "}")
    for name, (_, help_text) in _COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in _COMMANDS:
        parser.parse_args(argv[:1] or ["--help"])  # --help, or a one-line error
        return 2
    run, _ = _COMMANDS[argv[0]]
    return int(run(argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
