"""The estimator's device path (torch kernels only, as on CUDA) run on the CPU.

``masked_rl.checks_module._HOST_KERNELS = False`` makes CPU tensors take the path every other
device takes: no NumPy, the selecting scan, ``index_add_`` run sums and one host
synchronisation. These tests check that path against the plain serial reference, against the
host path, for its errors, and that it synchronises once: every op it dispatches is one that
runs on a device without waiting for it, and the checks' verdicts, the number of markers and
tensor-valued ``gamma`` / ``lmbda`` come back in one read.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from masked_gae_reference import (
    make_rollout,
    serial_masked_gae_batch,
    serial_masked_value_targets_batch,
)
from torch.utils._python_dispatch import TorchDispatchMode

import masked_rl._checks as checks_module
from masked_rl import masked_generalized_advantage_estimate as mgae


@pytest.fixture
def device_path(monkeypatch):
    monkeypatch.setattr(checks_module, "_HOST_KERNELS", False)


# Ops that make a CUDA host wait for the device: output sizes known only from the data, or
# a value read back.
SYNCING = {"nonzero", "_local_scalar_dense", "item", "is_nonzero", "equal", "masked_select",
           "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim", "repeat_interleave",
           "bincount", "histc", "multinomial", "allclose"}


class RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def count_reads(monkeypatch):
    reads = []
    original = checks_module._Checks.read

    def read(self, *numbers):
        reads.append(len(numbers))
        return original(self, *numbers)

    monkeypatch.setattr(checks_module._Checks, "read", read)
    return reads


@pytest.mark.parametrize("masked_value_targets", [False, True])
@pytest.mark.parametrize("tensor_discounts", [False, True])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_one_host_synchronisation(device_path, monkeypatch, masked_value_targets,
                                  tensor_discounts, mask_dtype):
    value, next_value, reward, done, terminated, mask = make_rollout(4, 64, seed=3)
    gamma, lmbda = 0.99, 0.95
    if tensor_discounts:  # as MaskedGAE passes its buffers
        gamma = torch.tensor(gamma, dtype=torch.float64)
        lmbda = torch.tensor(lmbda, dtype=torch.float64)
    reads = count_reads(monkeypatch)
    with RecordOps() as ops, torch.no_grad():
        out = mgae(gamma, lmbda, value, next_value, reward, done, terminated, mask.to(mask_dtype),
                   masked_value_targets=masked_value_targets)
    assert reads == [3 if tensor_discounts else 1]  # one read: (gamma, lmbda,) the marker count
    assert not SYNCING.intersection(ops.names), SYNCING.intersection(ops.names)
    assert "nonzero_static" in ops.names
    want = serial_masked_gae_batch(0.99, 0.95, value, next_value, reward, done, terminated, mask)
    torch.testing.assert_close(out[0], want[0], rtol=1e-10, atol=1e-10)


@st.composite
def rollouts(draw):
    rows, horizon = draw(st.integers(1, 4)), draw(st.integers(1, 40))
    data = make_rollout(rows, horizon, p_mask=draw(st.sampled_from([0.0, 0.2, 0.6, 1.0])),
                        p_done=draw(st.sampled_from([0.0, 0.1, 0.4])),
                        seed=draw(st.integers(0, 2**31 - 1)))
    gamma = draw(st.sampled_from([0.0, 0.5, 0.99, 1.0]))
    lmbda = draw(st.sampled_from([0.0, 0.95, 1.0]))
    return gamma, lmbda, data


@settings(max_examples=60, deadline=None)
@given(rollouts())
def test_device_path_matches_the_serial_reference_and_the_host_path(case):
    gamma, lmbda, data = case
    host = mgae(gamma, lmbda, *data, masked_value_targets=True)
    checks_module._HOST_KERNELS = False
    try:
        device = mgae(gamma, lmbda, *data, masked_value_targets=True)
    finally:
        checks_module._HOST_KERNELS = True
    advantage, target = serial_masked_gae_batch(gamma, lmbda, *data)
    torch.testing.assert_close(device[0], advantage, rtol=1e-10, atol=1e-10)
    all_targets, has_target = serial_masked_value_targets_batch(gamma, lmbda, *data)
    torch.testing.assert_close(device[1], all_targets, rtol=1e-10, atol=1e-10)
    assert torch.equal(device[2], has_target)
    for mine, theirs in zip(device[:2], host[:2]):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_device_path_keeps_nan_in_its_episode(device_path):
    value, next_value, reward, done, terminated, mask = make_rollout(2, 30, p_done=0.0, seed=5)
    done[:, 9] = terminated[:, 9] = True
    mask[:] = True
    clean = mgae(0.99, 0.95, value, next_value, reward, done, terminated, mask)
    reward[0, 4] = math.nan
    value[1, 20] = math.inf
    got = mgae(0.99, 0.95, value, next_value, reward, done, terminated, mask)
    outside = torch.ones(2, 30, 1, dtype=torch.bool)
    outside[0, :10] = outside[1, 10:] = False
    for want, have in zip(clean, got):
        assert torch.equal(have[outside], want[outside])
        assert not torch.isfinite(have[~outside]).all()


@pytest.mark.parametrize("case, message", [
    ("done", r"done must be bool or hold only 0 and 1, got torch.float32 values \[0.5"),
    ("orphan", "terminated must imply done"),
    ("mask", r"loss_mask must be bool or hold only 0 and 1, got torch.float32 values \[2.0"),
    ("gamma", r"gamma must be in \[0, 1\], got 1.5"),
])
def test_device_path_errors(device_path, case, message):
    value, next_value, reward, done, terminated, mask = make_rollout(2, 16, seed=1)
    gamma = 0.9
    if case == "done":
        done = done.float()
        done[0, 3] = 0.5
    elif case == "orphan":
        done[:] = False
        terminated[0, 5] = True
    elif case == "mask":
        mask = mask.float()
        mask[1, 2] = 2.0
    else:
        gamma = torch.tensor(1.5)
    with pytest.raises(ValueError, match=message):
        mgae(gamma, 0.95, value, next_value, reward, done, terminated, mask)


def test_checks_read_device_and_cpu_numbers_in_order(device_path):
    # A CPU gamma tensor beside data on the device is read apart from the device's numbers
    # (stacking it there would cost a copy); the order of the numbers is kept.
    checks = checks_module._Checks(at_once=False, device=torch.device("meta"))  # data elsewhere
    checks.fail_if(torch.tensor(False), lambda: None)
    assert checks.read(torch.tensor(0.5), torch.tensor(7), torch.tensor(0.25)) == [0.5, 7.0, 0.25]
    with RecordOps() as ops:  # the CPU numbers beside the device's data: read apart
        checks_module._Checks(at_once=False, device=torch.device("meta")).read(torch.tensor(0.5))
    assert "cat" not in ops.names
    checks.fail_if(torch.tensor(True), lambda: (_ for _ in ()).throw(ValueError("bad input")))
    with pytest.raises(ValueError, match="bad input"):
        checks.read(torch.tensor(1))


def test_without_nonzero_static_on_the_device_nonzero_does(device_path, monkeypatch):
    def missing(*args, **kwargs):
        raise NotImplementedError("nonzero_static: not on this device")

    data = make_rollout(3, 40, seed=9)
    want = mgae(0.9, 0.8, *data)
    monkeypatch.setattr(torch, "nonzero_static", missing)
    with RecordOps() as ops:
        got = mgae(0.9, 0.8, *data)
    assert "nonzero" in ops.names  # the fallback, one synchronisation more
    for mine, theirs in zip(got, want):
        assert torch.equal(mine, theirs)
