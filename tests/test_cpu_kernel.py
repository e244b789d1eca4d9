"""The CPU kernel (masked_rl._cpu_kernel): rows spread over threads give the one-thread bits,
and the guards that keep numba's threading layers out of trouble (concurrent callers, fork)."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import torch
from masked_gae_reference import make_rollout, serial_masked_gae_batch

from masked_rl import _cpu_kernel, functional
from masked_rl import masked_generalized_advantage_estimate as mgae

# Rows x steps at or above the size where the parallel kernel runs.
ROWS, STEPS = 6, _cpu_kernel._PARALLEL_MIN_STEPS // 2


@contextmanager
def _torch_threads(threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _run(data, threads, **kwargs):
    with _torch_threads(threads):
        return mgae(0.99, 0.95, *data, **kwargs)


def _calls(monkeypatch):
    """Counts of the kernels' launches, by name."""
    # Compile both first: numba binds the serial kernel into the parallel one when it compiles.
    _run(make_rollout(ROWS, STEPS, seed=0), 2)
    counts = {"serial": 0, "parallel": 0}
    serial, parallel = _cpu_kernel.masked_gae_rows, _cpu_kernel._masked_gae_chunks

    def count(name, kernel):
        def wrapper(bounds, *args):
            counts[name] += 1
            counts[f"{name} chunks"] = bounds.size - 1
            return kernel(bounds, *args)
        return wrapper

    monkeypatch.setattr(_cpu_kernel, "masked_gae_rows", count("serial", serial))
    monkeypatch.setattr(_cpu_kernel, "_masked_gae_chunks", count("parallel", parallel))
    return counts


@pytest.mark.parametrize("masked_value_targets", [False, True])
@pytest.mark.parametrize("rows", [2, ROWS])
def test_rows_on_two_threads_give_the_bits_of_one(monkeypatch, masked_value_targets, rows):
    data = make_rollout(rows, STEPS, p_mask=0.4, p_done=0.002, seed=rows)
    counts = _calls(monkeypatch)
    one = _run(data, 1, masked_value_targets=masked_value_targets)
    assert (counts["serial"], counts["parallel"]) == (1, 0)
    two = _run(data, 2, masked_value_targets=masked_value_targets)
    # Two threads really ran (conftest gives numba two even on a one-core machine).
    assert (counts["serial"], counts["parallel"], counts["parallel chunks"]) == (1, 1, 2)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    ref_adv, ref_target = serial_masked_gae_batch(0.99, 0.95, *data)
    torch.testing.assert_close(two[0], ref_adv, rtol=0, atol=1e-10)


def test_small_batches_stay_on_one_thread(monkeypatch):
    counts = _calls(monkeypatch)
    _run(make_rollout(4, 100, seed=1), 2)
    _run(make_rollout(1, _cpu_kernel._PARALLEL_MIN_STEPS, seed=1), 2)  # one row: one thread
    assert (counts["serial"], counts["parallel"]) == (2, 0)


def test_a_second_caller_runs_on_its_own_thread_meanwhile(monkeypatch):
    # While one thread holds the parallel kernel, another call does not wait for it (nor launch
    # parallel work at once, which numba's workqueue layer would abort on).
    data = make_rollout(ROWS, STEPS, seed=2)
    want = _run(data, 1)
    counts = _calls(monkeypatch)
    assert _cpu_kernel._LAUNCH.acquire(blocking=False)
    try:
        got = _run(data, 2)
    finally:
        _cpu_kernel._LAUNCH.release()
    assert (counts["serial"], counts["parallel"]) == (1, 0)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_forked_process_runs_on_one_thread(monkeypatch):
    # The guard: a forked process (GNU OpenMP's pool would hang there) uses the one-thread kernel.
    counts = _calls(monkeypatch)
    monkeypatch.setattr(functional, "_FORKED_CHILD", True)  # as the at-fork hook sets it
    data = make_rollout(ROWS, STEPS, seed=3)
    got = _run(data, 2)
    assert (counts["serial"], counts["parallel"]) == (1, 0)
    assert all(torch.equal(a, b) for a, b in zip(got, _run(data, 1)))


def _child(queue, data):
    # No torch kernel here: torch's own OpenMP pool is not usable in a forked child either.
    torch.set_num_threads(2)
    queue.put([float(x.numpy().sum()) for x in mgae(0.99, 0.95, *data)])


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork here")
def test_fork_after_the_parallel_kernel_ran_is_safe(monkeypatch):
    # Without the guard numba terminates the child ("fork() called from a process already using
    # GNU OpenMP") or, with another OpenMP, it hangs.
    data = make_rollout(ROWS, STEPS, seed=4)
    counts = _calls(monkeypatch)
    want = [float(x.numpy().sum()) for x in _run(data, 2)]
    assert counts["parallel"] == 1  # the parent ran the parallel kernel before the fork
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(queue, data))
    child.start()
    child.join(timeout=60)
    hung = child.is_alive()
    if hung:
        child.kill()
    assert not hung, "the forked child hung in the CPU kernel"
    assert child.exitcode == 0 and queue.get(timeout=5) == want


_CHILDREN = """
import multiprocessing, sys
import numpy as np
import torch
from masked_gae_reference import make_rollout
from masked_rl import masked_generalized_advantage_estimate as mgae

def advantage(data):
    # No torch kernel in the child but the estimator's own: after the parent's torch ran on
    # two threads, torch's OpenMP pool is not usable in a forked child either.
    return mgae(0.99, 0.95, *data)[0].numpy()

if __name__ == "__main__":
    torch.set_num_threads(2)
    data = make_rollout(16, 4096, seed=5)  # torch's threads ran; the estimator did not, yet
    with multiprocessing.get_context(sys.argv[1]).Pool(1) as pool:
        child = pool.apply_async(advantage, (data,)).get(timeout=60)
    assert np.array_equal(child, advantage(data))
    print("same")
"""


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_child_started_before_any_call_computes(tmp_path, start_method):
    # #29: a child forked before the parent's first call hung in the parallel kernel.
    if start_method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"no {start_method} here")
    script = tmp_path / "children.py"
    script.write_text(_CHILDREN)
    tests = str(Path(__file__).parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = tests + ":" + env.get("PYTHONPATH", "")
    try:
        done = subprocess.run([sys.executable, str(script), start_method], capture_output=True,
                              text=True, timeout=240, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a {start_method}ed child hung in the estimator")
    assert done.returncode == 0 and done.stdout.strip() == "same", done.stderr[-2000:]


# Small batches run the one-thread kernel in each caller; large ones contend for the parallel one.
@pytest.mark.parametrize("rows, steps", [(4, 3000), (ROWS, STEPS)])
def test_concurrent_callers_get_their_own_results(rows, steps):
    # The compiled pass releases the GIL and keeps no state between calls.
    batches = [make_rollout(rows, steps, p_done=0.01, seed=seed) for seed in range(6)]
    want = [_run(data, 1) for data in batches]
    with _torch_threads(2), ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda data: mgae(0.99, 0.95, *data), batches))
    for a, b in zip(got, want):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_without_a_writable_cache_folder_the_kernel_compiles_and_warns():
    # numba raises when no locator finds a writable folder for its cache; simulated here by
    # giving it no locator at all, in a fresh process.
    script = """
import warnings, torch
from numba.core import caching
impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # the name varies by version
impl._locator_classes = []
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from masked_rl import masked_generalized_advantage_estimate as mgae
    value = torch.arange(6.0).view(1, 6, 1)
    done = torch.zeros(1, 6, 1, dtype=torch.bool)
    done[0, -1] = True
    adv, _ = mgae(1.0, 1.0, value, value, value, done, done, torch.ones(1, 6, dtype=torch.bool))
assert any("NUMBA_CACHE_DIR" in str(w.message) for w in caught), [str(w.message) for w in caught]
print(adv.flatten().tolist())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    # V = V' = r = t, gamma = lmbda = 1, terminated at 5: delta_t = t (0 at 5), A_t = sum of them
    assert done.stdout.split("\n")[-2] == str([10.0, 10.0, 9.0, 7.0, 4.0, 0.0])
