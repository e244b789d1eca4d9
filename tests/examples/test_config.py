"""The recipe's options: every field an option, and every bad option a one-line error (exit 2)
before anything is created."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from dataclasses import fields

import pytest
import torch

from masked_rl_examples.ppo_tool_use.config import (
    Config,
    parse_compare_command,
    parse_eval_command,
    parse_train_command,
    train_parser,
)


def test_every_config_field_is_an_option_with_help():
    help_text = train_parser("masked-rl train").format_help()
    for field in fields(Config):
        flag = "--" + field.name.replace("_", "-")
        assert flag in help_text, flag
    assert "--resume RUN_DIR" in help_text


def test_options_overlay_the_defaults(tmp_path):
    command = parse_train_command(
        ["--frames", "123", "--estimator", "plain", "--no-normalize-advantage",
         "--entropy-coeff", "0.5", "--threads", "2", "--output", str(tmp_path)])
    cfg = command.config
    assert (cfg.frames, cfg.estimator, cfg.normalize_advantage, cfg.entropy_coeff, cfg.threads) == (
        123, "plain", False, 0.5, 2)
    assert cfg.lr == Config().lr and cfg.num_envs == Config().num_envs  # defaults unchanged
    assert command.run_dir == tmp_path / "plain-seed0" and not command.resume
    assert not command.run_dir.exists()  # parsing creates nothing


@pytest.mark.parametrize(
    "kwargs, match",
    [({"estimator": "gae"}, "estimator must be one of masked, plain, zeroed, terminal-only, got 'gae'"),
     ({"num_envs": 6, "workers": 4}, "multiple of workers"),
     ({"frames_per_batch": 100}, "multiple of num_envs"), ({"epochs": 0}, "epochs must be >= 1"),
     ({"lr": -1.0}, r"lr must be a finite number > 0, got -1.0"), ({"lr": 0.0}, "lr must be"),
     ({"seed": -1}, r"seed must be in \[0, 4294967295\], got -1"),
     ({"gamma": -1.0}, r"gamma must be in \[0, 1\], got -1.0"),
     ({"lmbda": math.nan}, r"lmbda must be in \[0, 1\], got nan"),
     ({"clip_epsilon": -1.0}, "clip_epsilon must be a finite number >= 0, got -1.0"),
     ({"entropy_coeff": math.inf}, "entropy_coeff must be a finite number >= 0, got inf"),
     ({"threads": 0}, "threads must be >= 1, got 0"),
     ({"frames": 2.5}, "frames must be an integer"),
     ({"logger": "foo"}, "logger must be one of")],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Config(**kwargs)


def one_line_error(capsys, parse, argv, prog="masked-rl train") -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse(argv, prog=prog)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: error: ") and err.count("\n") == 1, err
    return err


NO_CUDA = ["--device", "cuda:99" if torch.cuda.is_available() else "cuda"]


@pytest.mark.parametrize(
    "argv, match",
    [(["--env", "Foo/Bar-v0"], "unknown environment id 'Foo/Bar-v0'"),
     (["--device", "foo"], "device: expected cpu, cuda or cuda:N, got 'foo'"),
     (NO_CUDA, "device: 'cuda.*' asked for, but"),
     (["--threads", "0"], "threads must be >= 1, got 0"),
     (["--threads", "-3"], "threads must be >= 1, got -3"),
     (["--logger", "foo"], "argument --logger: invalid choice: 'foo'"),
     (["--lr", "-1"], "lr must be a finite number > 0, got -1.0"),
     (["--seed", "-1"], "seed must be in"),
     (["--gamma", "-1"], r"gamma must be in \[0, 1\], got -1.0"),
     (["--lmbda", "nan"], r"lmbda must be in \[0, 1\], got nan"),
     (["--clip-epsilon", "-1"], "clip_epsilon must be a finite number >= 0"),
     (["--frames", "abc"], "argument --frames: invalid int value: 'abc'"),
     (["--bogus", "1"], "unrecognized arguments: --bogus 1"),
     (["--num-envs", "8", "--frames-per-batch", "24"],
      "rows of frames_per_batch / num_envs = 24 / 8 = 3 steps cannot hold a trainable step: "
      "every episode of MaskedRL/ToolUse-v0 starts with 3 environment-written steps; use "
      "frames_per_batch >= 32")],
)
def test_train_option_errors_are_one_line_and_create_nothing(capsys, tmp_path, argv, match):
    output = tmp_path / "out"
    err = one_line_error(capsys, parse_train_command, [*argv, "--output", str(output)])
    assert re.search(match, err), err
    assert not output.exists()


def test_unwritable_output_is_an_error(capsys, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    err = one_line_error(capsys, parse_train_command, ["--output", str(a_file / "runs")])
    assert f"output: '{a_file}' is a file" in err
    err = one_line_error(capsys, parse_train_command, ["--output", "/proc/runs"])
    assert "output: cannot write to '/proc'" in err


def test_resume_errors(capsys, tmp_path):
    err = one_line_error(capsys, parse_train_command, ["--resume", str(tmp_path)])
    assert f"--resume: '{tmp_path}' holds no checkpoint.pt" in err
    import dataclasses

    import torch

    saved = {"frames": 1024, "num_envs": 8, "frames_per_batch": 512}
    torch.save({"config": dataclasses.asdict(Config(**saved))}, tmp_path / "checkpoint.pt")
    (tmp_path / "config.json").write_text(json.dumps(saved))
    err = one_line_error(capsys, parse_train_command, ["--resume", str(tmp_path), "--lr", "1"])
    assert "--resume continues a run with its saved options; --lr cannot be changed" in err
    command = parse_train_command(["--resume", str(tmp_path), "--no-progress-bar",
                                   "--threads", "1"])
    assert command.resume and command.run_dir == tmp_path
    assert (command.config.frames, command.config.progress_bar, command.config.threads) == (
        1024, False, 1)


def test_compare_option_errors(capsys, tmp_path):
    prog = "masked-rl compare"
    output = ["--output", str(tmp_path / "out")]
    err = one_line_error(capsys, parse_compare_command, ["--seeds", "0", "0", *output], prog)
    assert "--seeds must be distinct (each seed is one run folder), got 0 0" in err
    err = one_line_error(capsys, parse_compare_command, ["--jobs", "0", *output], prog)
    assert "--jobs must be >= 1, got 0" in err
    err = one_line_error(capsys, parse_compare_command, ["--lr", "-1", *output], prog)
    assert "lr must be a finite number > 0" in err
    err = one_line_error(capsys, parse_compare_command, ["--seeds", "-1", *output], prog)
    assert "seed must be in" in err
    err = one_line_error(capsys, parse_compare_command, ["--estimator", "plain", *output], prog)
    assert "unrecognized arguments: --estimator plain" in err
    assert not (tmp_path / "out").exists()
    command = parse_compare_command(output)
    assert command.seeds == [0, 1, 2] and command.jobs == 2 and command.base.threads == 1


def test_eval_option_errors(capsys, tmp_path):
    prog = "masked-rl eval"
    err = one_line_error(capsys, parse_eval_command, [str(tmp_path)], prog)
    assert "is neither a run folder with a checkpoint.pt nor a checkpoint file" in err
    (tmp_path / "checkpoint.pt").write_text("not a checkpoint")
    err = one_line_error(capsys, parse_eval_command, [str(tmp_path)], prog)
    assert "is not a checkpoint of this recipe" in err


def test_option_errors_from_the_command_line(tmp_path):
    """``masked-rl train`` itself: exit status 2, one line on stderr, no run folder."""
    output = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "masked_rl_examples.cli", "train", "--lr", "-1",
         "--output", str(output)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "masked-rl train: error: lr must be a finite number > 0, got -1.0 "
        "(see masked-rl train --help)"]
    assert not output.exists()


def test_help_imports_neither_torch_nor_the_environments():
    """``masked-rl <command> --help`` answers before importing torch, TorchRL or gymnasium."""
    code = (
        "import sys\n"
        "from masked_rl_examples import cli\n"
        "for argv in ([], ['--help'], ['train', '--help'], ['compare', '--help'], ['bench', '--help'],\n"
        "             ['eval', '--help'], ['bench-cp', '--help'], ['bench', '--repeats', '0'],\n"
        "             ['bench-cp', '--cp', '0']):\n"
        "    try:\n"
        "        cli.main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in ('torch', 'torchrl', 'gymnasium', 'tensordict') "
        "if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=True)
    assert result.stdout.splitlines()[-1] == "[]"
    assert "usage: masked-rl train" in result.stdout and "--resume RUN_DIR" in result.stdout
    assert "usage: masked-rl bench " in result.stdout and "usage: masked-rl bench-cp" in result.stdout
    assert "--repeats and --chunk must be >= 1" in result.stderr
    assert "--cp, --repeats and --threads must be >= 1" in result.stderr
