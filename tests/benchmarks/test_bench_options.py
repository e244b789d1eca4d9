"""``masked-rl bench`` refuses bad options before it times anything."""

import pytest

from masked_rl_benchmarks import bench


@pytest.mark.parametrize("value", ["-5", "nan"])
def test_negative_min_time_is_refused(capsys, tmp_path, value):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--min-time-ms", value, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert f"--min-time-ms must be >= 0, got {float(value)}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_unwritable_out_is_refused_before_the_benchmark_runs(capsys, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(SystemExit) as exit_info:  # would take minutes if it ran first
        bench.main(["--out", str(a_file / "results")])
    assert exit_info.value.code == 2
    assert f"--out: '{a_file}' is a file" in capsys.readouterr().err


@pytest.mark.parametrize("command, argv, message", [
    ("bench", ["--gamma", "1.5"], "--gamma must be in [0, 1], got 1.5"),
    ("bench", ["--lmbda", "nan"], "--lmbda must be in [0, 1], got nan"),
    ("bench-cp", ["--gamma", "2"], "--gamma must be in [0, 1], got 2.0"),
])
def test_bad_bench_options_are_one_line_errors_before_anything_starts(capsys, tmp_path, command,
                                                                      argv, message):
    from masked_rl_examples.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([command, *argv, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err and not (tmp_path / "out").exists()
