"""``masked-rl bench``: time masked GAE against the alternatives a user has today.

Run ``masked-rl bench`` (or ``python -m masked_rl_benchmarks.bench``); ``--help`` lists the options.

Workload (:func:`make_workload`): agentic rollouts, one episode per row. Each row is a
masked prompt (32 to 128 steps), then alternating trainable agent blocks (16 to 128) and
masked observation blocks (32 to 512), cut at ``T``; the episode terminates on the row's
last step with a reward there (often on a masked observation step, so it must be folded).

Implementations, timed in one process, interleaved (one sample of each per round, in a
fresh seeded order every round), median of the rounds by the wall clock (``--clock cpu``:
by this process's CPU time, which a busy machine skews far less); a sample of a fast
implementation repeats its call back to back until it spans ``--min-time-ms``:

``ours``
    :func:`masked_rl.masked_generalized_advantage_estimate` on ``[N, T, 1]`` tensors.
``ours_module``
    :class:`masked_rl.MaskedGAE` on a ``TensorDict``: the overhead of the module.
``per_sample``
    :func:`per_sample_packed_scan_gae`: a Python loop compresses every episode to its
    trainable steps, the episodes are padded into one batch and solved with a chunked
    matrix scan, then scattered back (how the original fix works).
``per_step``
    :func:`per_step_loop_gae`: a reverse Python loop over time, vectorized over rows,
    carrying the advantage, the next value and the pending masked reward across masked
    steps (how other trainers do it).
``reference``
    :func:`reference_algorithm_gae`: the algorithm the reference system ships (a Python
    loop over rows packs each row's trainable steps; a chunk-128 matrix scan with a
    Python loop carrying between chunks). It assumes one episode per row, as the workload has.
``floor``
    :func:`memory_floor`: not an estimator; one pass that reads every input once and writes
    two outputs (two ``torch.where``). The ``x floor`` column divides every time by it.
``ours_all_ones`` / ``torchrl_all_ones``
    ours with an all-ones mask against TorchRL's
    ``vec_generalized_advantage_estimate`` (which has no mask) on the same data: the
    speed a TorchRL user has today.

Before timing, every shape checks that the implementations agree (:func:`check_agreement`):
``per_sample``, ``per_step``, ``reference`` and ``ours_module`` must equal ``ours`` to float
tolerance,
``torchrl_all_ones`` must equal ``ours_all_ones`` within the error bound of TorchRL's
``1e-7`` filter truncation.

On CUDA the host synchronisations of one call of each implementation are counted
(:func:`cuda_host_syncs`, the operations ``torch.cuda.set_sync_debug_mode`` reports) and shown
in a column of their own.

Peak memory is the peak of live bytes allocated during one call beyond what existed
before it (the outputs included, the inputs not). CUDA: ``torch.cuda.max_memory_allocated``
after ``reset_peak_memory_stats``. CPU: the allocation and free events of
``torch.profiler`` (``profile_memory=True``) replayed in order (:func:`cpu_peak_bytes`).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import platform
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tensordict import TensorDict
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from torchrl.objectives.value.functional import vec_generalized_advantage_estimate
from tqdm import tqdm

from masked_rl.advantages import MaskedGAE
from masked_rl.functional import masked_generalized_advantage_estimate
from masked_rl_benchmarks.options import (
    BENCH_SHAPES,
    CUDA_EXTRA_SHAPES,
    IMPLEMENTATIONS,
    parse_bench_args,
)

__all__ = [
    "Workload",
    "make_workload",
    "per_sample_packed_scan_gae",
    "per_step_loop_gae",
    "reference_algorithm_gae",
    "memory_floor",
    "check_agreement",
    "cpu_peak_bytes",
    "cuda_host_syncs",
    "main",
    "run",
]

REFERENCE_CHUNK = 128  # the reference system's chunk
# The CPU memory pass records every allocation with torch.profiler; for a Python loop over
# time steps that is millions of events (gigabytes at 4x131072), so longer rows skip it.
PYTHON_LOOP_OVER_TIME = ("per_step",)
CPU_MEMORY_MAX_LOOP_STEPS = 16384
TORCHRL_FILTER_THRESHOLD = 1e-7  # TorchRL's _fast_vec_gae drops filter terms below this



# -- workload -----------------------------------------------------------------


@dataclass
class Workload:
    """One batch of rollouts in TorchRL layout: ``[N, T, 1]`` tensors, a ``[N, T]`` bool mask."""

    state_value: Tensor
    next_state_value: Tensor
    reward: Tensor
    done: Tensor
    terminated: Tensor
    loss_mask: Tensor

    def inputs(self) -> tuple[Tensor, ...]:
        """The positional tensor arguments of the estimators, mask last."""
        return (self.state_value, self.next_state_value, self.reward, self.done,
                self.terminated, self.loss_mask)


def make_workload(
    batch: int,
    steps: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    prompt: tuple[int, int] = (32, 128),
    agent: tuple[int, int] = (16, 128),
    observation: tuple[int, int] = (32, 512),
) -> Workload:
    """Agentic rollouts, one terminated episode per row, generated without Python loops.

    Row layout: a masked prompt of ``prompt`` steps, then alternating trainable agent blocks
    (``agent``) and masked observation blocks (``observation``), lengths uniform in the
    inclusive ranges, cut at ``steps``. ``V`` is standard normal with ``V'[t] = V[t + 1]``;
    the only reward is a standard-normal terminal reward on the row's last step.
    """
    gen = torch.Generator().manual_seed(seed)
    # Enough blocks to cover `steps` even if every block has its minimum length.
    pairs = steps // (agent[0] + observation[0]) + 1
    low = torch.tensor([prompt[0]] + [agent[0], observation[0]] * pairs)
    high = torch.tensor([prompt[1]] + [agent[1], observation[1]] * pairs)
    # float64 uniforms: float32 ones times 481 can round up to 481 itself.
    uniform = torch.rand(batch, low.numel(), generator=gen, dtype=torch.float64)
    lengths = low + (uniform * (high - low + 1)).long()
    block_end = lengths.cumsum(1)
    time_index = torch.arange(steps).expand(batch, steps).contiguous()
    block = torch.searchsorted(block_end, time_index, right=True)
    loss_mask = block % 2 == 1  # block 0 is the prompt, odd blocks are the agent's

    values = torch.randn(batch, steps + 1, 1, generator=gen, dtype=torch.float64)
    reward = torch.zeros(batch, steps, 1, dtype=torch.float64)
    reward[:, -1] = torch.randn(batch, 1, generator=gen, dtype=torch.float64)
    done = torch.zeros(batch, steps, 1, dtype=torch.bool)
    done[:, -1] = True

    def put(x: Tensor) -> Tensor:
        return x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype).contiguous()

    return Workload(
        state_value=put(values[:, :-1]),
        next_state_value=put(values[:, 1:]),
        reward=put(reward),
        done=put(done),
        terminated=put(done.clone()),
        loss_mask=put(loss_mask),
    )


# -- the alternatives -----------------------------------------------------------


def _as_rows(*tensors: Tensor) -> list[Tensor]:
    """``[N, T, 1]`` (or ``[N, T]``) -> ``[N, T]`` views."""
    return [x.reshape(x.shape[0], x.shape[1]) for x in tensors]


def _episode_ends(done: Tensor) -> Tensor:
    end = done.clone()
    end[:, -1] = True  # a row's last step ends its episode
    return end


def _chunked_reverse_discounted_sum(x: Tensor, c: float, chunk: int) -> Tensor:
    """``A_j = x_j + c * A_{j+1}`` along the last dim of a zero-padded ``[S, K]`` batch.

    Each chunk of ``chunk`` steps is one matmul with the ``[C, C]`` matrix ``c**(j - i)``
    (``j >= i``); the carries into the chunks solve the same recurrence one level up,
    over chunk starts with factor ``c**C``, as a second matmul. Exact up to float
    rounding (powers that underflow are zero, and so are their true contributions).
    """
    sequences, length = x.shape
    n_chunks = max(1, -(-length // chunk))
    x = torch.nn.functional.pad(x, (0, n_chunks * chunk - length)).view(sequences, n_chunks, chunk)

    def discount_matrix(size: int, factor: float) -> Tensor:
        # [j, i] = factor ** (j - i) for j >= i (row j contributes to output i), in float64
        # so that powers are exact before the cast.
        idx = torch.arange(size, device=x.device, dtype=torch.float64)
        gap = idx[:, None] - idx[None, :]
        power = torch.where(gap >= 0, torch.tensor(factor, dtype=torch.float64, device=x.device)
                            .pow(gap.clamp(min=0)), 0.0)
        return power.to(x.dtype)

    within = x @ discount_matrix(chunk, c)  # [S, nC, C]: sums inside each chunk
    starts = within[:, :, 0] @ discount_matrix(n_chunks, c**chunk)  # A at every chunk start
    carry = torch.nn.functional.pad(starts[:, 1:], (0, 1))  # A at the next chunk's start
    decay = c ** torch.arange(chunk, 0, -1, device=x.device, dtype=torch.float64)  # c**(C - i)
    out = within + carry[:, :, None] * decay.to(x.dtype)
    return out.view(sequences, -1)[:, :length]


def per_sample_packed_scan_gae(
    gamma: float,
    lmbda: float,
    state_value: Tensor,
    next_state_value: Tensor,
    reward: Tensor,
    done: Tensor,
    terminated: Tensor,
    loss_mask: Tensor,
    *,
    chunk: int = 64,
) -> tuple[Tensor, Tensor]:
    """Masked GAE the per-sample way: compress each episode in a Python loop, pad, scan, scatter.

    Same semantics as :func:`masked_rl.masked_generalized_advantage_estimate` (``docs/semantics.md``)
    on ``[N, T, 1]`` inputs; the next value between trainable steps is ``V[t_{j+1}]``.
    One host synchronisation for all episode ends, then one per episode (its ``nonzero``).
    """
    value, next_value, rew, term = _as_rows(state_value, next_state_value, reward, terminated)
    mask = loss_mask.reshape(value.shape)
    rows, steps = value.shape
    c = gamma * lmbda
    bootstrap = torch.where(term, 0.0, next_value)

    positions, deltas, values = [], [], []
    start = [0] * rows
    for row, end in _episode_ends(done.reshape(value.shape)).nonzero().tolist():
        first, start[row] = start[row], end + 1
        pos = mask[row, first:end + 1].nonzero().squeeze(-1)
        if pos.numel() == 0:
            continue  # no action: rewards dropped, outputs stay 0
        # Owner of each step: its index among the trainable steps at or before it, so a
        # masked reward goes to the action before it. Slot 0 collects the dropped rewards
        # of steps before the first action.
        owner = torch.cumsum(mask[row, first:end + 1], 0)
        folded = torch.zeros(pos.numel() + 1, dtype=value.dtype, device=value.device)
        folded.index_add_(0, owner, rew[row, first:end + 1])
        value_c = value[row, first:end + 1][pos]
        next_value_c = torch.cat((value_c[1:], bootstrap[row, end:end + 1]))
        deltas.append(folded[1:] + gamma * next_value_c - value_c)
        values.append(value_c)
        positions.append(pos + (row * steps + first))

    advantage = torch.zeros(rows * steps, dtype=value.dtype, device=value.device)
    target = torch.zeros_like(advantage)
    if positions:
        packed = pad_sequence(deltas, batch_first=True)
        lengths = torch.tensor([d.numel() for d in deltas], device=value.device)
        valid = torch.arange(packed.shape[1], device=value.device) < lengths[:, None]
        advantage_c = _chunked_reverse_discounted_sum(packed, c, chunk)[valid]
        index = torch.cat(positions)
        advantage[index] = advantage_c
        target[index] = advantage_c + torch.cat(values)
    return advantage.view_as(state_value), target.view_as(state_value)


def per_step_loop_gae(
    gamma: float,
    lmbda: float,
    state_value: Tensor,
    next_state_value: Tensor,
    reward: Tensor,
    done: Tensor,
    terminated: Tensor,
    loss_mask: Tensor,
) -> tuple[Tensor, Tensor]:
    """Masked GAE the per-step way: a reverse Python loop over ``t``, vectorized over rows.

    Per row it carries the last advantage, the value to bootstrap from and the reward
    pending on masked steps since the next action; a masked step only adds its reward to
    the pending sum, so the carry crosses a gap with one ``gamma * lmbda`` factor. Same
    semantics as :func:`masked_rl.masked_generalized_advantage_estimate` on ``[N, T, 1]``
    inputs. No host synchronisation; ``T`` iterations of a few small kernels.
    """
    value, next_value, rew, term = _as_rows(state_value, next_state_value, reward, terminated)
    mask = loss_mask.reshape(value.shape)
    end = _episode_ends(done.reshape(value.shape))
    bootstrap = torch.where(term, 0.0, next_value)
    c = gamma * lmbda
    zero = torch.zeros((), dtype=value.dtype, device=value.device)
    last_advantage = torch.zeros(value.shape[0], dtype=value.dtype, device=value.device)
    next_v = torch.zeros_like(last_advantage)
    pending = torch.zeros_like(last_advantage)
    columns = zip(value.unbind(1), bootstrap.unbind(1), rew.unbind(1), mask.unbind(1),
                  end.unbind(1))
    advantages = []
    for v, boot, r, m, e in reversed(list(columns)):
        # Episode end at t: reset the carries; t's bootstrap is V'[t] or 0 if terminated.
        last_advantage = torch.where(e, zero, last_advantage)
        next_v = torch.where(e, boot, next_v)
        total = r + torch.where(e, zero, pending)
        a = (total + gamma * next_v - v).add_(last_advantage, alpha=c)
        last_advantage = torch.where(m, a, last_advantage)
        next_v = torch.where(m, v, next_v)
        pending = torch.where(m, zero, total)
        advantages.append(torch.where(m, a, zero))
    advantage = torch.stack(advantages[::-1], 1)
    target = torch.where(mask, advantage + value, zero)
    return advantage.view_as(state_value), target.view_as(state_value)


def reference_algorithm_gae(
    gamma: float,
    lmbda: float,
    state_value: Tensor,
    next_state_value: Tensor,
    reward: Tensor,
    done: Tensor,
    terminated: Tensor,
    loss_mask: Tensor,
    *,
    chunk: int = REFERENCE_CHUNK,
) -> tuple[Tensor, Tensor]:
    """The reference system's own algorithm (the miles masked-GAE PR this project implements).

    Rows must hold one episode each (``done`` only at a row's last step), which is that
    system's setting. Per row, in a Python loop over rows: the trainable positions by
    ``nonzero``; values and rewards gathered there, with the row's terminal reward (the
    rewards of the masked tail after its last trainable step, folded here as that system's
    caller does) added to the last trainable step. The rows are packed into a right-padded
    ``[N, K]`` batch of deltas (next value ``V[t_{j+1}]``, and after the last trainable step
    ``0`` if terminated, else ``V'`` of the row's last step). The chunked scan: deltas
    reshaped to ``[N, K / chunk, chunk]``, every chunk solved by one matrix product with the
    fixed ``chunk x chunk`` upper-triangular matrix of powers of ``gamma * lmbda``, then the
    carry passed from the last chunk to the first by a Python loop over chunks; results
    scattered back. On one-episode rows whose masked rewards all lie in the tail this is
    the masked GAE of docs/semantics.md; :func:`check_agreement` checks it against ours before timing.
    One host synchronisation per row (its ``nonzero``) and one per chunk step.
    """
    value, next_value, rew, term = _as_rows(state_value, next_state_value, reward, terminated)
    mask = loss_mask.reshape(value.shape)
    rows, steps = value.shape
    c = gamma * lmbda
    positions, deltas, values = [], [], []
    for row in range(rows):
        pos = mask[row].nonzero().squeeze(-1)
        if pos.numel() == 0:
            continue
        value_c = value[row, pos]
        reward_c = rew[row, pos]
        reward_c[-1] += rew[row, pos[-1] + 1 :].sum()  # the masked tail's (terminal) reward
        bootstrap = torch.where(term[row, -1], 0.0, next_value[row, -1]).reshape(1)
        deltas.append(reward_c + gamma * torch.cat((value_c[1:], bootstrap)) - value_c)
        values.append(value_c)
        positions.append(pos + row * steps)
    advantage = torch.zeros(rows * steps, dtype=value.dtype, device=value.device)
    target = torch.zeros_like(advantage)
    if positions:
        packed = pad_sequence(deltas, batch_first=True)  # [N, K], zero-padded on the right
        width = packed.shape[1]
        n_chunks = -(-width // chunk)
        x = torch.nn.functional.pad(packed, (0, n_chunks * chunk - width)).view(-1, n_chunks, chunk)
        # [j, i] = c**(j - i) for j >= i: row j of a chunk contributes to output i.
        idx = torch.arange(chunk, device=x.device, dtype=torch.float64)
        gap = idx[:, None] - idx[None, :]
        powers = torch.where(gap >= 0, c ** gap.clamp(min=0), 0.0).to(x.dtype)
        solved = x @ powers
        decay = (c ** torch.arange(chunk, 0, -1, device=x.device, dtype=torch.float64)).to(x.dtype)
        for n in range(n_chunks - 2, -1, -1):  # carry A at the next chunk's start backwards
            solved[:, n] += decay * solved[:, n + 1, :1]
        lengths = torch.tensor([d.numel() for d in deltas], device=x.device)
        valid = torch.arange(width, device=x.device) < lengths[:, None]
        advantage_c = solved.view(len(deltas), -1)[:, :width][valid]
        index = torch.cat(positions)
        advantage[index] = advantage_c
        target[index] = advantage_c + torch.cat(values)
    return advantage.view_as(state_value), target.view_as(state_value)


def memory_floor(
    gamma: float,
    lmbda: float,
    state_value: Tensor,
    next_state_value: Tensor,
    reward: Tensor,
    done: Tensor,
    terminated: Tensor,
    loss_mask: Tensor,
) -> tuple[Tensor, Tensor]:
    """Not an estimator: the memory traffic every one pays, as a unit of time.

    One pass over the stream that reads each input the estimator reads once and writes two
    outputs of its shape, in two ``torch.where`` kernels: ``where(loss_mask, reward, V)``
    and ``where(done, V', terminated)``. The numbers mean nothing (``gamma`` and ``lmbda`` are
    ignored); only the time does: every other row of the table can be read as a multiple of it.
    """
    mask = loss_mask.reshape(reward.shape)
    return (torch.where(mask, reward, state_value),
            torch.where(done, next_state_value, terminated.to(next_state_value.dtype)))


# -- agreement and measurement ------------------------------------------------


def _max_abs(x: Tensor) -> float:
    return float(x.abs().max()) if x.numel() else 0.0


def check_agreement(
    outputs: dict[str, tuple[Tensor, Tensor]], workload: Workload, gamma: float, lmbda: float
) -> dict[str, float]:
    """Raise ``AssertionError`` unless the implementations agree; return the max abs errors.

    With ``c = gamma * lmbda`` an advantage sums deltas with weights adding up to
    ``S = 1 / (1 - c)`` (``T`` if ``c == 1``), so sums in different orders differ by about
    ``eps * S`` relative: ``per_sample``, ``per_step`` and ``reference`` must be within
    ``16 * eps * S`` of ``ours``. ``ours_module`` also: ``MaskedGAE`` stores ``gamma`` and
    ``lmbda`` as float32 buffers, which moves ``c`` by up to ``2**-24`` relative and ``A`` by up to
    ``2**-24 * S**2`` relative. ``torchrl_all_ones`` against ``ours_all_ones``: TorchRL drops
    the filter terms below ``1e-7``, so it misses up to ``c**K * S * max|delta|`` (``K`` the
    filter length), plus rounding. Masked steps must hold exactly ``0``. ``floor`` computes
    nothing to compare; its outputs must only have the estimator's shape.
    """
    eps = torch.finfo(workload.state_value.dtype).eps
    errors = {}

    def compare(key: str, reference: str, atol: float, rtol: float) -> None:
        for name, got, want in zip(("advantage", "value_target"), outputs[key], outputs[reference]):
            error = _max_abs(got.double() - want.double())
            bound = atol + rtol * _max_abs(want.double())
            errors[f"{key}.{name}"] = error
            if not error <= bound:  # also catches NaN
                raise AssertionError(
                    f"{key} {name} differs from {reference} by {error:.3g} > {bound:.3g}"
                )

    steps = workload.state_value.shape[1]
    c = gamma * lmbda
    weight_sum = max(1.0, steps if c >= 1 else 1.0 / (1.0 - c))
    tolerance = 16 * eps * weight_sum
    for key in ("per_sample", "per_step", "reference"):
        if key in outputs:
            compare(key, "ours", atol=tolerance, rtol=tolerance)
    if "ours_module" in outputs:
        module_tolerance = tolerance + 2.0**-24 * weight_sum**2
        compare("ours_module", "ours", atol=module_tolerance, rtol=module_tolerance)
    if "torchrl_all_ones" in outputs:
        v, nv, r, d, k, _ = workload.inputs()
        delta = r + gamma * torch.where(k, 0.0, nv) - v
        truncation = 0.0
        if 0 < c < 1:
            length = int(math.log(TORCHRL_FILTER_THRESHOLD) / math.log(c))
            truncation = c**length * weight_sum
        atol = (truncation + tolerance) * _max_abs(delta.double())
        compare("torchrl_all_ones", "ours_all_ones", atol=atol, rtol=tolerance)
    if "floor" in outputs and any(x.shape != workload.state_value.shape for x in outputs["floor"]):
        raise AssertionError("floor outputs do not have the shape of state_value")
    masked = ~workload.loss_mask.unsqueeze(-1)
    for key, (advantage, target) in outputs.items():
        if key not in ("ours_all_ones", "torchrl_all_ones", "floor") and (
            bool(advantage[masked].any()) or bool(target[masked].any())
        ):
            raise AssertionError(f"{key} is not exactly 0 at masked steps")
    return errors


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """Silence file descriptor 2: Kineto logs every profiler start and stop there."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of live CPU bytes allocated while ``fn()`` runs, beyond what was live before.

    The profiler records every allocation and free of the CPU allocator (with
    ``profile_memory=True``) with its size; replaying them in time order gives the live
    bytes at each moment. What ``fn`` returns is alive at the end and counts; what existed
    before does not (a free of such memory lowers the running sum below zero).
    """
    from torch.profiler import ProfilerActivity, profile

    with _stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
        del result
    events = [
        e for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def cuda_peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak of live CUDA bytes allocated while ``fn()`` runs, beyond what was live before."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = fn()
    torch.cuda.synchronize(device)
    del result
    return torch.cuda.max_memory_allocated(device) - before


def cuda_host_syncs(fn: Callable[[], object], device: torch.device) -> int | None:
    """How many times ``fn()`` makes the host wait for the GPU (``None`` off CUDA): the
    synchronising operations ``torch.cuda.set_sync_debug_mode`` reports during one call."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum("synchronizing" in str(w.message) for w in caught)


def _load_average() -> float | None:
    """The 1-minute load average (``None`` where the OS has none): busy CPUs skew timings."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _implementations(
    workload: Workload, gamma: float, lmbda: float, chunk: int, keys: Sequence[str]
) -> dict[str, Callable[[], tuple[Tensor, Tensor]]]:
    inputs = workload.inputs()
    ones = torch.ones_like(workload.loss_mask)
    module = MaskedGAE(gamma=gamma, lmbda=lmbda, value_network=None).to(workload.reward.device)
    rows, steps = workload.loss_mask.shape
    tensordict = TensorDict(
        {
            "state_value": workload.state_value,
            "loss_mask": workload.loss_mask,
            "next": {
                "state_value": workload.next_state_value,
                "reward": workload.reward,
                "done": workload.done,
                "terminated": workload.terminated,
            },
        },
        batch_size=[rows, steps],
        device=workload.reward.device,
    )

    def run_module() -> tuple[Tensor, Tensor]:
        out = module(tensordict)
        return out["advantage"], out["value_target"]

    candidates = {
        "ours": lambda: masked_generalized_advantage_estimate(gamma, lmbda, *inputs),
        "ours_module": run_module,
        "per_sample": lambda: per_sample_packed_scan_gae(gamma, lmbda, *inputs, chunk=chunk),
        "per_step": lambda: per_step_loop_gae(gamma, lmbda, *inputs),
        "reference": lambda: reference_algorithm_gae(gamma, lmbda, *inputs),
        "floor": lambda: memory_floor(gamma, lmbda, *inputs),
        "ours_all_ones": lambda: masked_generalized_advantage_estimate(
            gamma, lmbda, *inputs[:-1], ones),
        "torchrl_all_ones": lambda: vec_generalized_advantage_estimate(
            gamma, lmbda, *inputs[:-1]),
    }
    return {key: candidates[key] for key in keys}


# -- targets --------------------------------------------------------------------


def evaluate_targets(results: list[dict]) -> list[dict]:
    """The issue's CPU targets, on the shapes of this run (a target without its shape is skipped)."""
    by = {(r["batch"], r["steps"], r["implementation"]): r for r in results}
    shapes = sorted({(r["batch"], r["steps"]) for r in results}, key=lambda s: (s[0] * s[1], s[0]))
    targets = []

    def ratio(shape: tuple[int, int], key: str) -> float | None:
        row = by.get((*shape, key))
        return None if row is None else row["ratio"]

    def add(name: str, measured: list[tuple[str, float]], passed: bool) -> None:
        if measured:
            targets.append({"target": name, "passed": passed,
                            "measured": {shape: value for shape, value in measured}})

    def label(shape: tuple[int, int]) -> str:
        return f"{shape[0]}x{shape[1]}"

    measured = [(label(s), ratio(s, "per_sample")) for s in shapes if ratio(s, "per_sample")]
    add("never slower than per_sample (per_sample / ours >= 1)", measured,
        all(v >= 1.0 for _, v in measured))
    measured = [(label(s), ratio(s, "per_sample")) for s in shapes
                if s[0] >= 512 and s[0] * s[1] >= 512 * 1024 and ratio(s, "per_sample")]
    add(">= 3x faster than per_sample at 512x1024 and larger batches", measured,
        all(v >= 3.0 for _, v in measured))
    measured = [(label(s), ratio(s, "reference")) for s in shapes if ratio(s, "reference")]
    add(">= 2x faster than the reference algorithm (reference / ours >= 2)", measured,
        all(v >= 2.0 for _, v in measured))
    measured = [(label(s), by[(*s, "ours")]["floor_ratio"]) for s in shapes
                if s[0] * s[1] >= 2**18 and (*s, "ours") in by and by[(*s, "ours")]["floor_ratio"]]
    add("<= 3x the memory floor at >= 256k steps (ours / floor)", measured,
        all(v <= 3.0 for _, v in measured))
    measured = [(label(s), ratio(s, "per_step")) for s in shapes if s == (64, 4096)
                and ratio(s, "per_step")]
    add(">= 30x faster than per_step at 64x4096", measured, all(v >= 30.0 for _, v in measured))
    measured = [(label(s), ratio(s, "torchrl_all_ones")) for s in shapes if s == (64, 4096)
                and ratio(s, "torchrl_all_ones")]
    add("all-ones mask faster than TorchRL vec GAE at 64x4096", measured,
        all(v > 1.0 for _, v in measured))
    measured = [(label(s), ratio(s, "ours_module") - 1.0) for s in shapes if ratio(s, "ours_module")]
    add("MaskedGAE overhead over the function < 10% (module / function - 1)", measured,
        all(v < 0.10 for _, v in measured))
    per_step_bytes = [(label(s), by[(*s, "ours")]["peak_bytes"] / (s[0] * s[1])) for s in shapes
                      if (*s, "ours") in by and by[(*s, "ours")]["peak_bytes"] is not None]
    if per_step_bytes:
        values = [v for _, v in per_step_bytes]
        add("memory linear in steps (ours: peak bytes per step, max / min < 1.5)", per_step_bytes,
            max(values) / min(values) < 1.5)
    return targets


# -- command line ---------------------------------------------------------------


def _format_table(results: list[dict], header: list[str]) -> str:
    clock = results[0]["clock"] if results else "wall"
    columns = ("shape", "implementation", f"{clock} ms", "x ours", "x floor", "peak MiB")
    with_syncs = any(r.get("host_syncs") is not None for r in results)  # CUDA
    if with_syncs:
        columns += ("host syncs",)
    lines = []
    previous = None
    for r in results:
        shape = f"{r['batch']}x{r['steps']}"
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        floor = "-" if r["floor_ratio"] is None else f"{r['floor_ratio']:.2f}"
        line = (shape if shape != previous else "", IMPLEMENTATIONS[r["implementation"]][0],
                f"{r['median_ms']:.2f}", ratio, floor, peak)
        if with_syncs:
            line += (str(r.get("host_syncs", "-")),)
        lines.append(line)
        previous = shape
    widths = [max(len(columns[i]), *(len(line[i]) for line in lines)) for i in range(len(columns))]
    aligns = ("<", "<", ">", ">", ">", ">", ">")

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(f"{c:{a}{w}}" for c, a, w in zip(cells, aligns, widths))

    rule = "-" * len(fmt(columns))
    body = []
    for line in lines:
        if line[0] and body:
            body.append(rule)
        body.append(fmt(line))
    return "\n".join([*header, rule, fmt(columns), rule, *body, rule])


def main(argv: list[str] | None = None) -> int:
    """``masked-rl bench``: parse the options (:func:`~masked_rl_benchmarks.options.parse_bench_args`) and :func:`run`."""
    return run(parse_bench_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the benchmark on checked options; returns the exit code (1 if implementations disagree)."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("masked-rl bench: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_before = _load_average()
    shapes = args.shapes or list(BENCH_SHAPES) + (list(CUDA_EXTRA_SHAPES)
                                                   if device.type == "cuda" else [])
    keys = [k for k in IMPLEMENTATIONS if k in args.implementations]
    measure_memory = not args.no_memory
    rounds = args.warmup + args.repeats
    total = len(shapes) * (rounds * len(keys) + (len(keys) if measure_memory else 0))

    results, agreement = [], {}
    shuffler = random.Random(args.seed)
    with torch.no_grad(), tqdm(total=total, desc="bench", unit="call", file=sys.stderr) as bar:
        for batch, steps in shapes:
            bar.set_postfix_str(f"{batch}x{steps}")
            workload = make_workload(batch, steps, dtype=dtype, device=device, seed=args.seed)
            fns = _implementations(workload, args.gamma, args.lmbda, args.chunk, keys)
            try:
                outputs = {key: fn() for key, fn in fns.items()}
                agreement[f"{batch}x{steps}"] = check_agreement(
                    outputs, workload, args.gamma, args.lmbda)
            except AssertionError as error:
                bar.close()
                print(f"masked-rl bench: {batch}x{steps}: {error}", file=sys.stderr)
                return 1
            del outputs
            times: dict[str, list[float]] = {key: [] for key in keys}  # by --clock
            other_times: dict[str, list[float]] = {key: [] for key in keys}  # by the other clock
            calls = dict.fromkeys(keys, 1)
            for round_index in range(rounds):
                # A fresh order every round: no implementation always runs right after another
                # (the allocator and cache state one call leaves skews the next).
                order = shuffler.sample(keys, len(keys))
                for key in order:
                    _synchronize(device)
                    start, start_cpu = time.perf_counter(), time.process_time()
                    for _ in range(calls[key]):
                        fns[key]()
                    _synchronize(device)
                    per_call = (time.perf_counter() - start) / calls[key]
                    cpu_per_call = (time.process_time() - start_cpu) / calls[key]
                    if round_index >= args.warmup:
                        wall_cpu = (per_call, cpu_per_call)
                        times[key].append(wall_cpu[args.clock == "cpu"])
                        other_times[key].append(wall_cpu[args.clock == "wall"])
                    elif round_index == args.warmup - 1:
                        # Fast calls repeat back to back within a round, so that a sample
                        # spans --min-time-ms rather than one scheduler hiccup.
                        calls[key] = max(1, min(1000, round(args.min_time_ms / 1e3 / per_call)))
                    bar.update()
            syncs = {key: cuda_host_syncs(fns[key], device) for key in keys}
            peaks: dict[str, int | None] = {key: None for key in keys}
            if measure_memory:
                for key in keys:
                    if (device.type == "cpu" and key in PYTHON_LOOP_OVER_TIME
                            and steps > CPU_MEMORY_MAX_LOOP_STEPS):
                        pass  # the profiler would hold every step's events: gigabytes
                    elif device.type == "cuda":
                        peaks[key] = cuda_peak_bytes(fns[key], device)
                    else:
                        peaks[key] = cpu_peak_bytes(fns[key])
                    bar.update()
            medians = {key: statistics.median(times[key]) for key in keys}
            for key in keys:
                reference = IMPLEMENTATIONS[key][1]
                results.append({
                    "batch": batch,
                    "steps": steps,
                    "implementation": key,
                    "label": IMPLEMENTATIONS[key][0],
                    "median_ms": medians[key] * 1e3,
                    "ratio": medians[key] / medians[reference] if reference in medians else None,
                    "ratio_to": reference,
                    "floor_ratio": medians[key] / medians["floor"] if "floor" in medians else None,
                    "peak_bytes": peaks[key],
                    "host_syncs": syncs[key],
                    "repeats": args.repeats,
                    "calls_per_sample": calls[key],
                    "min_ms": min(times[key]) * 1e3,
                    "times_ms": [t * 1e3 for t in times[key]],
                    "clock": args.clock,
                    f"{'wall' if args.clock == 'cpu' else 'cpu'}_median_ms":
                        statistics.median(other_times[key]) * 1e3,
                })

    memory_note = {
        "cuda": "CUDA max_memory_allocated beyond the inputs",
        "cpu": "CPU allocator events of torch.profiler replayed, beyond the inputs",
    }[device.type]
    load_after = _load_average()
    header = [
        f"masked-rl bench: device={device} dtype={args.dtype} threads={torch.get_num_threads()} "
        f"gamma={args.gamma} lmbda={args.lmbda} clock={args.clock} "
        f"median of {args.repeats} interleaved rounds "
        f"(fast calls repeated to ~{args.min_time_ms:g} ms a sample); "
        f"1-min load average {load_before} before, {load_after} after "
        f"on {os.cpu_count()} CPUs (other processes skew CPU timings)",
        "x ours = median / median of ours on the same mask (masked rows: masked_gae function; "
        "all-ones rows: masked_gae with an all-ones mask); > 1 means ours is faster; "
        "x floor = median / median of the memory floor (one read of the inputs, one write of "
        "two outputs)",
        f"peak MiB = peak live bytes allocated during one call, outputs included ({memory_note}; "
        f"not measured for the per-step loop beyond {CPU_MEMORY_MAX_LOOP_STEPS} steps on the CPU)"
        if measure_memory else "peak MiB: not measured (--no-memory)",
    ]
    # The load before the run is other processes' (ours had not started computing yet).
    if (device.type == "cpu" and load_before is not None
            and load_before + torch.get_num_threads() > (os.cpu_count() or 1) + 0.5):
        header.append(
            f"WARNING: load average {load_before} before the run, on {os.cpu_count()} CPUs with "
            f"{torch.get_num_threads()} torch threads: other processes hold the cores, and "
            "every multi-threaded torch op waits for a descheduled thread; vectorized "
            "implementations suffer most. Rerun on an idle machine"
            + (" or with --threads 1" if torch.get_num_threads() > 1 else "")
            + (" or with --clock cpu." if args.clock == "wall" else ".")
        )
    print(_format_table(results, header))
    targets = evaluate_targets(results)
    if targets:
        print(f"\ntargets (set for CPU; measured on {device.type} in this run):")
        for t in targets:
            values = ", ".join(f"{shape} {value:.2f}" for shape, value in t["measured"].items())
            print(f"  [{'met' if t['passed'] else 'MISSED'}] {t['target']}: {values}")

    args.out.mkdir(parents=True, exist_ok=True)
    fields = ["batch", "steps", "implementation", "label", "median_ms", "clock",
              "cpu_median_ms" if args.clock == "wall" else "wall_median_ms", "ratio", "ratio_to",
              "floor_ratio",
              "peak_bytes", "host_syncs", "min_ms", "repeats", "calls_per_sample"]
    with open(args.out / "bench.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(results)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["shapes"] = [list(s) for s in shapes]
    report = {
        "config": config,
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "load_average_1min_before": load_before,
            "load_average_1min_after": load_after,
            "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                            else platform.processor() or platform.machine()),
        },
        "memory_measure": memory_note if measure_memory else None,
        "results": results,
        "agreement_max_abs_error": agreement,
        "targets": targets,
    }
    with open(args.out / "bench.json", "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nwrote {args.out / 'bench.csv'} and {args.out / 'bench.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
