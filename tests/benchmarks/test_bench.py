"""The benchmark's comparators against a plain serial reference, and a smoke test of the command."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys

import pytest
import torch
from masked_gae_reference import serial_masked_gae_batch
from torchrl.objectives.value.functional import generalized_advantage_estimate

from masked_rl_benchmarks.bench import (
    check_agreement,
    cpu_peak_bytes,
    make_workload,
    memory_floor,
    per_sample_packed_scan_gae,
    per_step_loop_gae,
    reference_algorithm_gae,
)
from masked_rl.functional import masked_generalized_advantage_estimate

COMPARATORS = {
    "ours": masked_generalized_advantage_estimate,  # the estimator the benchmark times
    "per_sample": per_sample_packed_scan_gae,
    "per_sample_chunk_3": lambda *args: per_sample_packed_scan_gae(*args, chunk=3),
    "per_step": per_step_loop_gae,
}


def reference_masked_gae(gamma, lmbda, value, next_value, reward, done, terminated, mask):
    """The project's serial reference (docs/semantics.md) on ``[N, T]`` inputs, as ``[N, T]`` float64."""
    advantage, target = serial_masked_gae_batch(gamma, lmbda, *as_inputs(value, next_value, reward,
                                                                          done, terminated, mask))
    return advantage.squeeze(-1), target.squeeze(-1)


def random_batch(seed, rows=6, steps=40, all_masked_row=True):
    """Multi-episode rows (terminated and truncated ends), rewards everywhere, V' consistent."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, steps + 1, generator=gen, dtype=torch.float64)
    value = values[:, :-1].clone()
    done = torch.rand(rows, steps, generator=gen) < 0.1
    done[1, -1] = False  # a row cut mid-episode: bootstraps from V'
    terminated = done & (torch.rand(rows, steps, generator=gen) < 0.5)
    # A TorchRL rollout: V'[t] = V[t + 1] inside an episode, a fresh value at an episode end.
    next_value = torch.where(done, torch.randn(rows, steps, generator=gen, dtype=torch.float64),
                             values[:, 1:])
    reward = torch.randn(rows, steps, generator=gen, dtype=torch.float64)
    mask = torch.rand(rows, steps, generator=gen) < 0.4
    if all_masked_row:
        mask[2] = False
    mask[3, :5] = True  # a trainable run right at the row start
    return value, next_value, reward, done, terminated, mask


def as_inputs(value, next_value, reward, done, terminated, mask, dtype=torch.float64):
    """[N, T] -> the [N, T, 1] TorchRL layout of the estimators."""
    def col(x):
        return x.unsqueeze(-1).to(dtype if x.is_floating_point() else x.dtype)
    return (col(value), col(next_value), col(reward), col(done), col(terminated), mask)


@pytest.mark.parametrize("name", COMPARATORS)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma, lmbda", [(0.99, 0.95), (1.0, 1.0), (0.9, 0.0), (0.0, 0.5)])
def test_comparators_match_serial_reference(name, seed, gamma, lmbda):
    batch = random_batch(seed)
    want_adv, want_target = reference_masked_gae(gamma, lmbda, *batch)
    adv, target = COMPARATORS[name](gamma, lmbda, *as_inputs(*batch))
    assert adv.shape == target.shape == (6, 40, 1)
    torch.testing.assert_close(adv.squeeze(-1), want_adv, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(target.squeeze(-1), want_target, rtol=1e-10, atol=1e-10)
    mask = batch[-1]
    assert (adv.squeeze(-1)[~mask] == 0).all() and (target.squeeze(-1)[~mask] == 0).all()
    assert (adv.squeeze(-1)[2] == 0).all()  # the all-masked row


def test_reference_is_torchrl_gae_with_an_all_ones_mask():
    value, next_value, reward, done, terminated, _ = random_batch(11)
    ones = torch.ones_like(done)
    # TorchRL casts gamma and lmbda to float32: pick values that float32 holds exactly.
    want_adv, want_target = reference_masked_gae(0.75, 0.5, value, next_value, reward, done,
                                                 terminated, ones)
    inputs = as_inputs(value, next_value, reward, done, terminated, ones)[:-1]
    adv, target = generalized_advantage_estimate(0.75, 0.5, *inputs)
    torch.testing.assert_close(adv.squeeze(-1), want_adv, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(target.squeeze(-1), want_target, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", COMPARATORS)
def test_comparators_worked_cases(name):
    """Worked cases 1 and 2 of docs/semantics.md: one gamma*lmbda across a gap, a masked terminal reward folds."""
    estimator = COMPARATORS[name]
    zeros = torch.zeros(1, 6, 1, dtype=torch.float64)
    done = torch.zeros(1, 6, 1, dtype=torch.bool)
    done[0, -1] = True
    reward = zeros.clone()
    reward[0, -1] = 2.0
    mask = torch.tensor([[1, 0, 0, 0, 0, 1]], dtype=torch.bool)
    adv, _ = estimator(0.9, 0.5, zeros, zeros, reward, done, done, mask)
    torch.testing.assert_close(adv.flatten(), torch.tensor([0.9, 0, 0, 0, 0, 2.0], dtype=torch.float64))

    mask = torch.tensor([[1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    reward = zeros.clone()
    reward[0, -1] = 10.0
    adv, _ = estimator(0.0, 0.0, zeros, zeros, reward, done, done, mask)
    torch.testing.assert_close(adv.flatten(), torch.tensor([0, 0, 10.0, 0, 0, 0], dtype=torch.float64))


def test_comparators_ignore_masked_values():
    """NaN stored in V and V' at masked steps (not episode ends) changes nothing."""
    value, next_value, reward, done, terminated, mask = random_batch(7, all_masked_row=False)
    poisoned = ~mask & ~done
    poisoned[:, -1] = False
    inputs = as_inputs(value, next_value, reward, done, terminated, mask)
    dirty = as_inputs(value.masked_fill(~mask, math.nan), next_value.masked_fill(poisoned, math.nan),
                      reward, done, terminated, mask)
    for estimator in COMPARATORS.values():
        for clean, got in zip(estimator(0.99, 0.95, *inputs), estimator(0.99, 0.95, *dirty)):
            assert torch.equal(clean, got)


def one_episode_batch(seed, rows=5, steps=50):
    """The reference system's setting: one episode per row (done only at the row's last step),
    rewards on trainable steps and in the masked tail after the last one; a fully masked row, a
    truncated row (bootstraps from V'), a row ending on a trainable step."""
    value, next_value, reward, done, terminated, mask = random_batch(seed, rows, steps)
    done[:] = False
    done[:, -1] = True
    terminated[:] = done
    terminated[1, -1] = False
    mask[2] = False
    mask[3, -1] = True
    last = torch.where(mask, torch.arange(steps), -1).amax(1, keepdim=True)
    # No reward on a masked step before the last trainable step (the reference drops those).
    reward = torch.where(mask | (torch.arange(steps) > last), reward, 0.0)
    # One episode a row: V'[t] = V[t + 1] everywhere inside it, as in a rollout (the reference
    # system reads V[t + 1] at adjacent actions, the rule V'[t]: the same numbers here).
    next_value = torch.cat((value[:, 1:], next_value[:, -1:]), 1)
    return value, next_value, reward, done, terminated, mask


@pytest.mark.parametrize("chunk", [128, 4, 1])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("gamma, lmbda", [(0.99, 0.95), (1.0, 1.0), (0.9, 0.0), (0.0, 0.5)])
def test_reference_algorithm_matches_serial_reference_on_one_episode_rows(
    chunk, seed, gamma, lmbda
):
    batch = one_episode_batch(seed)
    want_adv, want_target = reference_masked_gae(gamma, lmbda, *batch)
    adv, target = reference_algorithm_gae(gamma, lmbda, *as_inputs(*batch), chunk=chunk)
    torch.testing.assert_close(adv.squeeze(-1), want_adv, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(target.squeeze(-1), want_target, rtol=1e-10, atol=1e-10)
    assert (adv.squeeze(-1)[2] == 0).all()  # the fully masked row


def test_memory_floor_reads_every_input_and_writes_two_outputs():
    workload = make_workload(3, 300, dtype=torch.float64, seed=2)
    advantage, target = memory_floor(0.9, 0.9, *workload.inputs())
    mask = workload.loss_mask.unsqueeze(-1)
    assert advantage.shape == target.shape == workload.state_value.shape
    assert torch.equal(advantage, torch.where(mask, workload.reward, workload.state_value))
    assert torch.equal(target, torch.where(workload.done, workload.next_state_value,
                                           workload.terminated.double()))
    outputs = {"ours": masked_generalized_advantage_estimate(0.9, 0.9, *workload.inputs()),
               "floor": (advantage, target)}
    check_agreement(outputs, workload, 0.9, 0.9)  # the floor is not compared
    outputs["floor"] = (advantage[:, :-1], target)
    with pytest.raises(AssertionError, match="floor"):
        check_agreement(outputs, workload, 0.9, 0.9)


def test_workload_layout():
    workload = make_workload(16, 2000, seed=3)
    mask = workload.loss_mask
    assert mask.shape == (16, 2000) and mask.dtype == torch.bool
    assert workload.state_value.shape == (16, 2000, 1)
    torch.testing.assert_close(workload.next_state_value[:, :-1], workload.state_value[:, 1:])
    assert workload.done[:, -1].all() and workload.done[:, :-1].sum() == 0
    assert torch.equal(workload.done, workload.terminated)
    assert (workload.reward[:, :-1] == 0).all()
    for row in mask.int().tolist():
        # Run lengths of the row: masked prompt, then agent / observation blocks.
        runs, value = [], None
        for flag in row:
            if flag == value:
                runs[-1] += 1
            else:
                runs.append(1)
                value = flag
        assert row[0] == 0 and 32 <= runs[0] <= 128
        inner = runs[1:-1]  # the last block is cut at T
        assert all(16 <= n <= 128 for n in inner[0::2])
        assert all(32 <= n <= 512 for n in inner[1::2])
    assert torch.equal(make_workload(16, 2000, seed=3).loss_mask, mask)


def test_check_agreement_accepts_the_workload_and_catches_a_bug():
    workload = make_workload(4, 700, dtype=torch.float32, seed=1)
    inputs = workload.inputs()
    outputs = {
        "ours": masked_generalized_advantage_estimate(1.0, 0.95, *inputs),
        "per_sample": per_sample_packed_scan_gae(1.0, 0.95, *inputs),
        "per_step": per_step_loop_gae(1.0, 0.95, *inputs),
        "reference": reference_algorithm_gae(1.0, 0.95, *inputs),
    }
    errors = check_agreement(outputs, workload, 1.0, 0.95)
    assert max(errors.values()) < 1e-4
    # Plain GAE decays a masked terminal reward over the gap: must be rejected.
    wrong = per_step_loop_gae(1.0, 0.95, *inputs[:-1], torch.ones_like(workload.loss_mask))
    mask = workload.loss_mask.unsqueeze(-1)
    outputs["per_step"] = tuple(torch.where(mask, x, 0.0) for x in wrong)
    with pytest.raises(AssertionError, match="per_step"):
        check_agreement(outputs, workload, 1.0, 0.95)


def test_cpu_peak_bytes_sees_a_known_peak():
    size = 4_000_000  # bytes per tensor

    def allocate():
        a = torch.ones(size // 4)
        b = torch.ones(size // 4)
        del a
        c = torch.ones(size // 4)
        return b, c

    peak = cpu_peak_bytes(allocate)
    assert 2 * size <= peak < 2 * size + 100_000


def test_bench_command_writes_table_csv_and_json(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "masked_rl_examples.cli", "bench", "--shapes", "3x300", "2x64",
         "--repeats", "2", "--min-time-ms", "5", "--dtype", "float64", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "wall ms" in proc.stdout and "3x300" in proc.stdout
    assert "TorchRL vec GAE" in proc.stdout and "peak MiB" in proc.stdout
    assert "USDT" not in proc.stderr  # the profiler's log lines are silenced
    with open(out / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 8
    assert {r["implementation"] for r in rows} == {
        "ours", "ours_module", "per_sample", "per_step", "reference", "floor", "ours_all_ones",
        "torchrl_all_ones"}
    assert all(float(r["floor_ratio"]) > 0 for r in rows)
    assert "x floor" in proc.stdout and "reference algorithm" in proc.stdout
    report = json.loads((out / "bench.json").read_text())
    assert report["config"]["shapes"] == [[3, 300], [2, 64]]
    assert all(r["median_ms"] > 0 and r["peak_bytes"] >= 0 for r in report["results"])
    assert set(report["agreement_max_abs_error"]) == {"3x300", "2x64"}
    assert "host syncs" not in proc.stdout  # counted on CUDA only
    assert all(r["host_syncs"] is None for r in report["results"])


def test_host_syncs_column_on_cuda_results():
    from masked_rl_benchmarks.bench import _format_table, cuda_host_syncs

    assert cuda_host_syncs(lambda: None, torch.device("cpu")) is None
    row = {"batch": 2, "steps": 8, "implementation": "ours", "median_ms": 1.0, "ratio": 1.0,
           "floor_ratio": 3.0, "peak_bytes": None, "clock": "wall", "host_syncs": 1}
    table = _format_table([row, {**row, "implementation": "reference", "host_syncs": 17}], [])
    assert "host syncs" in table.splitlines()[1]
    assert table.splitlines()[3].rstrip().endswith("1") and "17" in table.splitlines()[4]


def test_bench_command_cpu_clock(tmp_path):
    out = tmp_path / "results"
    command = [sys.executable, "-m", "masked_rl_examples.cli", "bench", "--shapes", "2x200",
               "--repeats", "2", "--min-time-ms", "1", "--no-memory", "--clock", "cpu",
               "--implementations", "ours", "floor", "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "cpu ms" in proc.stdout and "clock=cpu" in proc.stdout
    report = json.loads((out / "bench.json").read_text())
    assert {r["clock"] for r in report["results"]} == {"cpu"}
    assert all(r["median_ms"] > 0 and r["wall_median_ms"] > 0 for r in report["results"])
    proc = subprocess.run(command + ["--device", "cuda"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "--clock cpu" in proc.stderr


def test_memory_pass_skips_python_time_loops_on_long_rows(tmp_path, monkeypatch):
    from masked_rl_benchmarks import bench

    monkeypatch.setattr(bench, "CPU_MEMORY_MAX_LOOP_STEPS", 100)
    out = tmp_path / "results"
    argv = ["--shapes", "2x150", "2x80", "--repeats", "1", "--warmup", "0", "--min-time-ms", "1",
            "--implementations", "ours", "per_step", "--out", str(out)]
    assert bench.main(argv) == 0
    peaks = {(r["steps"], r["implementation"]): r["peak_bytes"]
             for r in json.loads((out / "bench.json").read_text())["results"]}
    assert peaks[150, "per_step"] is None and peaks[80, "per_step"] > 0
    assert peaks[150, "ours"] > 0
