"""Smoke runs of the collection-speed and encoder-cost scripts, at tiny sizes."""

import pytest

from masked_rl_benchmarks import collector, encoders


def test_collector_speed_table_and_split(capsys):
    assert collector.main(["--envs", "MaskedRL/ToolUse-v0", "--num-envs", "4",
                           "--frames-per-batch", "64", "--batches", "1", "--split"]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if line.startswith("ToolUse-v0 "))
    trainable, plain, skip, ratio = row.split()[1:]
    assert trainable.endswith("%") and plain.endswith("/s") and skip.endswith("/s")
    assert float(ratio) > 0
    split = [line for line in lines if line.startswith("ToolUse-v0 ") and "Skip" in line]
    assert len(split) == 1
    batch, policy, torchrl_env, gym_vector, tool_use, rest = map(float, split[0].split()[2:])
    # The parts nest: ToolUseEnv inside the gymnasium vector env inside TorchRL's step.
    assert 0 < tool_use <= gym_vector <= torchrl_env <= batch and policy > 0


def test_collector_speed_rejects_bad_sizes():
    with pytest.raises(SystemExit):
        collector.main(["--num-envs", "3", "--frames-per-batch", "64"])


def test_encoder_cost_table(capsys):
    assert encoders.main(["--windows", "16", "--rounds", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("   16")]
    assert [row[1] for row in rows] == ["mlp", "attention"]
    assert all(float(value) > 0 for row in rows for value in row[2:])
