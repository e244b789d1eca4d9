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
