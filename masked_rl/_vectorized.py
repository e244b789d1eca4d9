"""The vectorized path of masked GAE: any device, and autograd.

The batch is flattened to one stream of length ``L = N * T`` (every row end is an episode end,
so rows cannot leak into each other). The stream is cut at *markers*, the trainable steps and
every episode's first step, and compressed to them with one ``nonzero``. Each marker's run (it
and the masked steps up to the next marker) has its rewards summed into the marker, so a masked
reward reaches the action before it and a reward before an episode's first action lands on a
masked marker, whose delta is zeroed. The linear recurrence ``A_j = delta_j + gamma * lmbda *
A_{j+1}`` (cut at episode ends) is solved by a reverse doubling scan in at most
``ceil(log2(T))`` vectorized passes, and the results are scattered back. Memory is linear in
``L``; nothing of size ``T x T`` is built and no Python loop runs over rows, episodes or time
steps. What must not let a NaN or inf through (the carry across an episode end, masked markers,
terminated bootstraps) is a selection, never a product with a 0/1 mask. The path synchronises
with the host once: the input checks' verdicts and the number of markers are read together
(:class:`masked_rl._checks._Checks`), then ``nonzero_static`` compresses without waiting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from masked_rl._checks import _Checks, _read_discounts

def _scan_levels(gamma_lmbda: float, horizon: int, dtype: torch.dtype) -> list[float]:
    """Coefficients ``c**k`` (``k = 1, 2, 4, ...``) of the doubling scan.

    A level is needed while ``k < horizon`` (no episode is longer than ``T`` steps)
    and while ``c**k`` is representable in ``dtype``: once it underflows to exactly
    zero, every further term is zero too, so stopping there drops nothing (unlike a
    truncation threshold such as TorchRL's ``1e-7``).
    """
    coefficients = []
    ck, k = gamma_lmbda, 1
    tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    while k < horizon and ck >= tiny:
        coefficients.append(ck)
        ck, k = ck * ck, 2 * k
    return coefficients


def _reverse_linear_scan(
    delta: Tensor, gate: Tensor, coefficients: Sequence[float | Tensor]
) -> Tensor:
    """Solve ``x_j = delta_j + c * x_{j+1}`` where ``gate_j`` (``x_j = delta_j`` elsewhere).

    ``delta`` is 1-D, ``gate`` (bool, same length) is true where step ``j + 1`` continues
    ``j``'s episode (so it is false at the last step), ``coefficients`` are ``c, c**2, c**4,
    ...`` (:func:`_scan_levels`; tensors where ``c`` needs a gradient). ``delta`` and ``gate``
    are not modified.

    Hillis-Steele doubling: after the level with stride ``k``, ``x_j`` sums ``c**(i - j) *
    delta_i`` over the window ``[j, j + 2k)`` cut at the episode's end, and ``gate_j`` says
    whether that window lies in one episode: ``x_j += c**k * (x_{j+k} if gate_j else 0)``,
    then ``gate_j &= gate_{j+k}``. One level per coefficient: ``O(M log M)`` work, ``O(M)``
    memory.

    A window crossing an episode end must contribute exactly nothing, also when the other
    episode holds NaN or inf or overflows in the scan: ``0 * inf`` is NaN, so the carry is
    selected, never multiplied by a 0/1 gate: a bitwise ``and`` of its bits with an all-ones /
    all-zeros integer mask (three kernels a level, in padded ping-pong buffers: no tail copies,
    no allocation in the loop), or ``torch.where`` under autograd.
    """
    length = delta.shape[0]
    levels = [(1 << level, ck) for level, ck in enumerate(coefficients) if (1 << level) < length]
    if not levels:
        return delta
    if _needs_autograd(delta, *(ck for _, ck in levels)):
        x = delta
        for k, ck in levels:
            carry = torch.where(gate[:-k], x[k:], 0.0)
            # add(alpha=) rounds as the kernels below do; a tensor c keeps its gradient.
            if isinstance(ck, Tensor):
                step = x[:-k] + ck * carry
            else:
                step = torch.add(x[:-k], carry, alpha=ck)
            x = torch.cat((step, x[-k:]))
            gate = torch.cat((gate[:-k] & gate[k:], gate.new_zeros(k)))
        return x
    return _doubling_scan(delta, gate, levels)


def _doubling_scan(delta: Tensor, gate: Tensor, levels: list[tuple[int, float]]) -> Tensor:
    """The levels of :func:`_reverse_linear_scan` without autograd, the gate an integer mask
    (all bits set where true) that selects the carry's bits."""
    n, pad = delta.shape[0], levels[-1][0]
    bits = _BITS[delta.dtype]
    # Two rows that swap roles every level; the pad (k_max zeros, gate false) lets every level
    # read x[j + k] for all j.
    x_buf = delta.new_empty(2, n + pad)
    g_buf = torch.empty(2, n + pad, dtype=bits, device=delta.device)
    x_buf[:, n:] = 0
    g_buf[:, n:] = 0
    x_rows, g_rows = x_buf.unbind(0), g_buf.unbind(0)
    x_bits = [row.view(bits) for row in x_rows]
    x_head, g_head = [row[:n] for row in x_rows], [row[:n] for row in g_rows]
    x_head[0].copy_(delta)
    torch.neg(gate.to(bits), out=g_head[0])  # true -> all bits set
    carry = delta.new_empty(n)
    carry_bits = carry.view(bits)
    for level, (k, ck) in enumerate(levels):
        src, dst = level % 2, 1 - level % 2
        torch.bitwise_and(x_bits[src][k : k + n], g_head[src], out=carry_bits)
        torch.add(x_head[src], carry, alpha=ck, out=x_head[dst])
        if level < len(levels) - 1:
            torch.bitwise_and(g_head[src], g_rows[src][k : k + n], out=g_head[dst])
    return x_head[len(levels) % 2]


# The integer dtype of each float dtype's bits, for selections by bitwise ``and``.
_BITS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def _needs_autograd(*tensors: object) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, Tensor) and t.requires_grad for t in tensors
    )


def _run_sums(values: Tensor, marker: Tensor, count: int) -> Tensor:
    """Sum of ``values`` over each of the ``count`` runs that ``marker`` (bool) starts: a
    ``cumsum`` numbers the runs and ``index_add_`` adds each step into its run, so a NaN or inf
    stays inside its own run."""
    return values.new_zeros(count + 1).index_add_(0, _run_index(marker), values)[1:]


def _run_index(marker: Tensor) -> Tensor:
    """The 1-based index of each step's run (``marker`` starts runs); int32 where it fits."""
    dtype = torch.int32 if marker.numel() < 2**31 else torch.int64
    return torch.cumsum(marker, 0, dtype=dtype)


def _flat_nonzero(flags: Tensor) -> Tensor:
    """Indices (int64) of the true entries of a 1-D bool tensor; one host synchronisation."""
    if flags.device.type == "cpu":  # NumPy's single-threaded nonzero is 5-7x faster than torch's
        return torch.from_numpy(np.flatnonzero(flags.numpy()))
    return flags.nonzero().squeeze(-1)


class _Runs(NamedTuple):
    """The runs a marker stream starts: run ``j`` spans steps ``pos[j]`` to ``nxt[j] = pos[j +
    1] - 1`` (the stream's last step for the last run)."""

    pos: Tensor  # [M] run starts (int64)
    nxt: Tensor  # [M] each run's last step


def _runs(marker: Tensor, count: int | None = None) -> _Runs:
    """The runs a 1-D bool ``marker`` starts (``marker[0]`` must be true): ``nonzero``, one
    host synchronisation, or none with ``count``, the number of markers, already known
    (``nonzero_static``)."""
    pos = None
    if count is not None:
        try:
            pos = torch.nonzero_static(marker, size=count).squeeze(-1)
        except (NotImplementedError, RuntimeError):  # a torch without it on this device
            pos = None
    if pos is None:
        pos = marker.nonzero().squeeze(-1)
    nxt = torch.empty_like(pos)
    torch.sub(pos[1:], 1, out=nxt[:-1])
    nxt[-1] = marker.numel() - 1
    return _Runs(pos, nxt)


def _bootstrap(next_value: Tensor, value_c: Tensor, runs: _Runs, last: Tensor, term: Tensor
               ) -> Tensor:
    """Each marker's bootstrap: ``V'[nxt]`` where its run is single or its episode's last
    (``0`` there if ``term[nxt]``), else ``V`` at the next marker (``value_c[j + 1]``).

    ``runs`` are the markers' :func:`_runs`, ``last`` is ``end[nxt]`` (bool, per marker).
    Selections, never products, so a NaN or inf stored where it is not read cannot leak.
    """
    at_end = next_value.index_select(0, runs.nxt)
    following = torch.cat((value_c[1:], value_c[:1]))  # V at the next marker (wraps)
    bootstrap = torch.where(last | (runs.nxt == runs.pos), at_end, following)
    return bootstrap.masked_fill(term.index_select(0, runs.nxt), 0.0)


class _Index(NamedTuple):
    """The marker structure of the flattened batch (see
    :func:`masked_generalized_advantage_estimate`), per step ``[L]`` or per marker ``[M]``."""

    marker: Tensor  # [L] bool: the markers (trainable steps, episode starts); they start runs
    runs: _Runs
    train: Tensor  # [M] bool: the marker is a trainable step (else an episode's masked start)
    last: Tensor  # [M] bool: the marker's run ends its episode
    gate: Tensor  # [M] bool: the carry flows from marker j + 1 into j (train and not last)
    discounts: tuple[float, float]  # gamma and lmbda, read with the number of markers


def _stream_index(m: Tensor, done: Tensor, horizon: int, checks: _Checks,
                  gamma: float | Tensor, lmbda: float | Tensor) -> _Index:
    """:class:`_Index` with torch's kernels, on any device: one host synchronisation reads the
    number of markers, the pending checks' verdicts and ``gamma``, ``lmbda`` if they are
    tensors; the markers are then found without another (``nonzero_static``)."""
    end = done.clone(memory_format=torch.contiguous_format)
    end.view(-1, horizon)[:, -1] = True  # a row's last step ends its episode
    marker = torch.empty_like(end)
    torch.logical_or(m[1:], end[:-1], out=marker[1:])
    marker[0] = True
    gamma_f, lmbda_f, count = _read_discounts(checks, gamma, lmbda, marker.sum())
    runs = _runs(marker, count=int(count))
    train = m.index_select(0, runs.pos)
    last = end.index_select(0, runs.nxt)
    return _Index(marker, runs, train, last, train > last, (gamma_f, lmbda_f))


def _masked_step_targets(
    target_c: Tensor,
    masked_c: Tensor,
    last_c: Tensor,
    pos: Tensor,
    nxt: Tensor,
    run: Tensor,
    marker: Tensor,
    trainable: Tensor,
    reward: Tensor,
    terminated: Tensor,
    next_value: Tensor,
    gamma: float | Tensor | None,
    horizon: int,
) -> tuple[Tensor, Tensor]:
    """Value targets at every step of the stream, and where they exist (the opt-in extension).

    ``*_c`` are per marker (compressed), the rest per step; ``run`` numbers each step's run
    (1-based) and ``marker`` starts runs. A masked step ``u`` in marker ``j``'s run continues to
    the run's end ``nxt[j]``, then reaches either the next marker (an action of the same episode,
    target ``G``) or the episode's end (bootstrap ``0`` or ``V'``). Its target is that value plus
    the rewards from ``u`` to the run's end, divided by ``gamma`` (omitted when ``gamma`` is
    ``None``, i.e. ``0``). A run whose marker is masked and which reaches the episode's end is an
    episode without trainable step: no target there.
    """
    end_value = next_value.index_select(0, nxt).masked_fill_(terminated.index_select(0, nxt), 0.0)
    follow_c = torch.where(last_c, end_value, target_c.roll(-1))
    has_target_c = masked_c.logical_not() | last_c.logical_not()
    owner = run.long() - 1
    follow = follow_c.index_select(0, owner)
    has_target = has_target_c.index_select(0, owner)
    target = target_c.new_zeros(trainable.numel()).scatter_(0, pos, target_c)
    if gamma is not None:
        # Rewards from each step to its run's end: a reverse scan with coefficient 1 whose
        # windows stop at run ends (it keeps a NaN or inf reward inside its own run).
        same_run = torch.cat((marker[1:].logical_not(), marker.new_zeros(1)))
        to_run_end = _reverse_linear_scan(reward.clone(), same_run,
                                          _scan_levels(1.0, horizon, reward.dtype))
        follow = follow + to_run_end / gamma
    at_masked = has_target & trainable.logical_not()
    return torch.where(at_masked, follow, target), has_target




def masked_gae_vectorized(
    value: Tensor,
    next_value: Tensor,
    reward: Tensor,
    done: Tensor,
    terminated: Tensor,
    trainable: Tensor,
    horizon: int,
    gamma: float | Tensor,
    lmbda: float | Tensor,
    checks: _Checks,
    discounts: tuple[float | Tensor, float | Tensor],
    masked_value_targets: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Masked GAE of a stream of rows of ``horizon`` steps (1-D tensors, time fastest).

    ``gamma`` and ``lmbda`` are the caller's (a tensor keeps its gradient), ``discounts`` the
    same checked as numbers or 0-d tensors still to be read with ``checks``' verdicts: the one
    host synchronisation. Returns ``(advantage, value_target, value_target_mask or None)``
    streams, ``value``'s dtype.
    """
    length = trainable.numel()
    index = _stream_index(trainable, done, horizon, checks, *discounts)
    gamma_f, lmbda_f = index.discounts
    runs, train, last = index.runs, index.train, index.last
    pos = runs.pos
    gamma_t = gamma_f  # a tensor only where its gradient is asked for
    if _needs_autograd(gamma):
        gamma_t = gamma.reshape(()).to(value.device, value.dtype)
    coefficients = _scan_levels(gamma_f * lmbda_f, horizon, value.dtype)
    if _needs_autograd(gamma, lmbda):
        # The carry's powers of gamma * lmbda as tensors, so that their gradient flows too.
        lmbda_t = lmbda.reshape(()).to(value.device, value.dtype) if isinstance(lmbda, Tensor) else lmbda
        c = gamma_t * lmbda_t
        coefficients = [c ** (1 << level) for level in range(len(coefficients))]

    folded = _run_sums(reward, index.marker, pos.numel())
    value_c = value.index_select(0, pos)
    # Bootstrap: V'[e] at the episode's end e (0 if terminated); before an adjacent action
    # V'[t_j] (equal to V[t_j + 1] in a rollout, and what TorchRL reads); else V[t_{j+1}].
    # Selections, never products: NaN or inf stored where it is not read must not leak.
    bootstrap = _bootstrap(next_value, value_c, runs, last, terminated)
    if _needs_autograd(gamma_t):
        delta = bootstrap.mul_(gamma_t).add_(folded)
    else:
        delta = torch.add(folded, bootstrap, alpha=gamma_f)
    delta = torch.where(train, delta.sub_(value_c), 0.0)
    del folded, bootstrap

    # The carry flows from j + 1 into an action j of the same episode; a masked marker gets 0.
    advantage_c = _reverse_linear_scan(delta, index.gate, coefficients)
    target_c = torch.where(train, advantage_c + value_c, 0.0)

    def scatter(x: Tensor) -> Tensor:  # per marker -> per step, 0 elsewhere
        return x.new_zeros(length).index_copy(0, pos, x)

    if not masked_value_targets:
        return scatter(advantage_c), scatter(target_c), None
    target, has_target = _masked_step_targets(
        target_c, train.logical_not(), last, pos, runs.nxt, _run_index(index.marker),
        index.marker, trainable, reward, terminated,
        next_value, gamma_t if gamma_f > 0 else None, horizon,
    )
    return scatter(advantage_c), target, has_target
