"""masked-rl bench-cp: a smoke run on 2 gloo ranks, and the rebuild comparator's numbers."""

from __future__ import annotations

import json

from masked_rl_benchmarks.cp import IMPLEMENTATIONS, main


def test_bench_cp_smoke(tmp_path, capsys):
    code = main(["--cp", "2", "--shapes", "2x301", "--repeats", "1", "--warmup", "0",
                 "--layout", "contiguous", "--dtype", "float64", "--out", str(tmp_path)])
    assert code == 0
    rows = json.loads((tmp_path / "cp.json").read_text())["rows"]
    by_name = {r["implementation"]: r for r in rows}
    assert set(by_name) == set(IMPLEMENTATIONS)
    # One all_gather of 20 + 640 float64 numbers (header and inline summaries); the rebuild
    # sends every row of V, V', r.
    assert (by_name["masked_rl_cp"]["collectives"], by_name["masked_rl_cp"]["bytes_per_rank"]) == (1, 660 * 8)
    assert (by_name["rebuild_per_sample"]["collectives"], by_name["rebuild_per_sample"]["bytes_per_rank"]) == (6, 3 * 2 * 301 * 8)
    assert (by_name["rebuild_one_call"]["collectives"], by_name["rebuild_one_call"]["bytes_per_rank"]) == (1, 3 * 2 * 301 * 8)
    assert "| 2 | 2x301 | masked_rl_cp | 1 | 5,280 |" in capsys.readouterr().out


def test_bench_cp_with_a_rank_holding_no_step(tmp_path):
    """Issue 29 item 9: 2 ranks over rows of one step (rank 1 holds none) ran into max() of nothing."""
    assert main(["--cp", "2", "--shapes", "2x1", "--repeats", "1", "--warmup", "0",
                 "--out", str(tmp_path)]) == 0
