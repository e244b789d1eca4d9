"""``masked-rl llm-eval``: a checkpoint's greedy success, its transcripts, one-line errors."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from masked_rl_examples.llm_ppo.config import LLMConfig, parse_llm_eval_command
from masked_rl_examples.llm_ppo.llm_ppo import run_llm_eval_command, train

TINY = dict(tokens=150, episodes_per_batch=8, eval_episodes=8, eval_every=100, epochs=1,
            minibatch_size=4, hidden_size=16, num_heads=2, progress_bar=False)


def _masked_rl(*args):
    return subprocess.run([sys.executable, "-m", "masked_rl_examples.cli", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    output = tmp_path_factory.mktemp("llm_eval")
    # A seed and step size whose last evaluation differs from the untrained policy's.
    summary = train(LLMConfig(**TINY, output=str(output), seed=0, lr=0.03))
    return output / "masked-seed0", summary


def test_eval_reproduces_the_last_evaluation_and_renders_transcripts(run):
    run_dir, summary = run
    result = _masked_rl("llm-eval", str(run_dir), "--render", "2")
    assert result.returncode == 0, result.stderr
    head, *episodes = result.stdout.split("\n\n")
    success = float(re.search(r"greedy success ([\d.]+)% over 8 episodes", head).group(1))
    assert success == pytest.approx(100 * summary["final_success_rate"], abs=0.05)
    assert f"checkpoint at {summary['tokens']} sampled tokens" in head
    turns = [float(row.split(",")[1]) for row in
             (run_dir / "scalars" / "eval" / "num_turns.csv").read_text().split()]
    assert turns[0] != turns[-1]  # the trained weights, not the initial ones, make the match
    assert float(re.search(r"([\d.]+) turns", head).group(1)) == pytest.approx(turns[-1], abs=5e-3)
    assert len(episodes) == 2
    for text in episodes:
        lines = text.strip().splitlines()
        assert re.match(r"episode \d: table (k\d=v\d ?){4}; asked k\d k\d$", lines[0])
        assert lines[1].strip().startswith("user: ")
        rewards = [float(r) for r in re.findall(r"\[reward ([+-][\d.]+)\]", text)]
        assert 1 <= len(rewards) <= LLMConfig().max_turns
        assert float(re.search(r"return ([-\d.]+),", lines[-1]).group(1)) == pytest.approx(
            sum(rewards), abs=0.011)
        assert all(line.split(":")[0].strip() in ("user", "assistant", "tool")
                   for line in lines[1:-1])


def test_eval_seed_and_episodes_change_the_episodes(run, capsys):
    run_dir, _ = run
    outputs = []
    for seed in ("5", "6"):
        command = parse_llm_eval_command([str(run_dir), "--episodes", "3", "--seed", seed,
                                          "--render", "3"])
        assert run_llm_eval_command(command) == 0
        outputs.append(capsys.readouterr().out)
    assert "over 3 episodes (seed 5)" in outputs[0] and "(seed 6)" in outputs[1]
    tables = [re.findall(r"table ([^;]+);", out) for out in outputs]
    assert len(tables[0]) == 3 and tables[0] != tables[1]


@pytest.mark.parametrize("args, message", [
    (["{missing}"], "is neither a run folder with a checkpoint.pt nor a checkpoint file"),
    (["{config}"], "is not an llm-train checkpoint"),
    (["{run}", "--episodes", "0"], "--episodes must be >= 1, got 0"),
    (["{run}", "--render", "9"], "--render must be in [0, --episodes=8], got 9"),
    (["{run}", "--seed", "-1"], "--seed must be in [0, 4294967295], got -1"),
    (["{run}", "--device", "tpu"], "device"),
])
def test_eval_errors_are_one_line(run, capsys, args, message):
    run_dir, _ = run
    paths = {"missing": run_dir / "nothing", "config": run_dir / "config.json", "run": run_dir}
    with pytest.raises(SystemExit) as exit_info:
        parse_llm_eval_command([a.format(**paths) for a in args], prog="masked-rl llm-eval")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert err.startswith("masked-rl llm-eval: error: ")
