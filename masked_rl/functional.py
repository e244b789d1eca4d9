"""Masked Generalized Advantage Estimation as pure tensor functions.

The semantics (``docs/semantics.md``, with worked cases) in short: GAE runs on the
compressed subsequence of *trainable* steps (``loss_mask == 1``) of every episode.

* A reward emitted on a masked step is credited, undiscounted, to the last
  trainable step before it in the same episode (that action caused it). Rewards
  on masked steps before an episode's first trainable step are dropped.
* Between consecutive trainable steps ``t_j < t_{j+1}`` of an episode the
  bootstrap value is ``V[t_{j+1}]`` and the advantage carry is multiplied by one
  ``gamma * lmbda`` factor, however many masked steps lie between them. When the
  two steps are adjacent, ``V'[t_j]`` is read instead (in a TorchRL rollout the
  two are equal; reading ``V'`` makes an all-ones mask reproduce TorchRL's
  ``GAE`` exactly, on any data).
* After an episode's last trainable step, the bootstrap is taken at the episode's
  last step ``e``: ``0`` if ``terminated[e]``, else ``V'[e]`` (truncation, or a row
  cut before the episode ended).
* Masked steps get exactly ``0`` advantage and value target. Nothing stored at a
  masked step other than its reward (and ``V'[e]`` of a truncated episode end,
  which *is* the bootstrap) can change any output, NaN and inf included.

Implementation. On the CPU (without autograd) a compiled kernel (numba,
:mod:`masked_rl._cpu_kernel`) walks each row once from its end to its start, carrying the
episode's end bootstrap, the rewards of the masked steps since the next action and that action's
value and advantage: the recursion of ``docs/semantics.md`` written out, one read of the inputs
and one write of the outputs, the rows spread over torch's threads.

Every other device, and autograd, take the vectorized path: the batch is flattened to one stream
of length ``L = N * T`` (every row end is an episode end, so rows cannot leak into each other).
The stream is cut at *markers*, the trainable steps and every episode's first step, and
compressed to them with one ``nonzero``. Each marker's run (it and the masked steps up to the
next marker) has its rewards summed into the marker, so a masked reward reaches the action
before it and a reward before an episode's first action lands on a masked marker, whose delta
is zeroed. The linear recurrence ``A_j = delta_j + gamma * lmbda * A_{j+1}`` (cut at episode
ends) is solved by a reverse doubling scan in at most ``ceil(log2(T))`` vectorized passes, and
the results are scattered back. Memory is linear in ``L``; nothing of size ``T x T`` is built and
no Python loop runs over rows, episodes or time steps. What must not let a NaN or inf through
(the carry across an episode end, masked markers, terminated bootstraps) is a selection, never
a product with a 0/1 mask. The function synchronises with the host once: the input checks'
verdicts and the number of markers are read together, then ``nonzero_static`` compresses
without waiting.

Reference: Schulman et al., "High-Dimensional Continuous Control Using
Generalized Advantage Estimation", ICLR 2016, https://arxiv.org/abs/1506.02438.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "masked_generalized_advantage_estimate",
    "masked_standardize",
    "check_loss_mask",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)

# CPU tensors take the compiled kernel and NumPy's checks; tests set this to False to run the
# path of every other device (torch kernels, one host synchronisation) on the CPU.
_HOST_KERNELS = True


def _on_host(tensor: Tensor) -> bool:
    """Whether ``tensor`` takes the CPU's kernels (the compiled pass, NumPy's flag checks)."""
    return _HOST_KERNELS and tensor.device.type == "cpu"


class _Checks:
    """Input checks whose verdicts are device tensors, read in one host synchronisation.

    :meth:`fail_if` registers a 0-d bool tensor (true: the input is bad) and the function that
    raises its error; :meth:`read` turns 0-d tensors into Python numbers together with the
    pending verdicts, one ``tolist`` for all, then raises the first failed check. With
    ``at_once`` (CPU inputs: there is nothing to wait for) every check is read as it comes.
    """

    def __init__(self, at_once: bool, device: torch.device | None = None):
        self.at_once, self.device = at_once, device  # device: where the data (and verdicts) are
        self._pending: list[tuple[Tensor, Callable[[], None]]] = []

    def fail_if(self, bad: Tensor, fail: Callable[[], None]) -> None:
        if self.at_once:
            if bool(bad):
                fail()
        else:
            self._pending.append((bad, fail))

    def read(self, *numbers: Tensor) -> list[float]:
        verdicts = [bad for bad, _ in self._pending]
        if not verdicts and not numbers:
            return []
        if self.at_once:  # nothing pending; a CPU number reads faster alone than stacked
            return [float(x) for x in numbers]
        # A number the CPU holds beside data on a device (say a gamma tensor) is read as it is;
        # the others are stacked with the verdicts.
        apart = [x.device.type == "cpu" and x.device != self.device for x in numbers]
        parts = [torch.stack(verdicts).to(torch.float64)] if verdicts else []
        parts += [x.detach().reshape(1).to(torch.float64) for x, a in zip(numbers, apart) if not a]
        values = torch.cat(parts).tolist() if parts else []
        for (_, fail), bad in zip(self._pending, values):
            if bad:
                fail()
        self._pending.clear()
        read = iter(values[len(verdicts):])
        return [float(x) if a else next(read) for x, a in zip(numbers, apart)]


def _any(flags: Tensor) -> Tensor:
    """``flags.any()`` of a bool tensor, as a 0-d bool tensor (no host synchronisation).

    ``Tensor.any`` reduces a CPU bool tensor about 30 times slower than ``amax`` reduces the
    same bytes viewed as uint8 (torch 2.13), and the estimator checks flags at every step.
    """
    if flags.numel() == 0:
        return flags.new_zeros((), dtype=torch.bool)
    return flags.view(torch.uint8).amax().bool()


def check_loss_mask(loss_mask: Tensor, reference: Tensor, *, key: object = "loss_mask") -> Tensor:
    """Validate a loss mask against a ``[*B, T, F]`` tensor and return it as bool, broadcastable to it.

    Accepted: shape ``reference.shape[:-1]`` (``[*B, T]``) or ``reference.shape[:-1] + (1,)``
    (``[*B, T, 1]``), dtype bool or any integer / floating dtype holding only ``0`` and ``1``.

    Raises:
        ValueError: naming ``key``, with the expected and the received shape or values.
    """
    return _check_loss_mask(loss_mask, reference, key, _Checks(at_once=True))


def _check_loss_mask(loss_mask: Tensor, reference: Tensor, key: object, checks: _Checks) -> Tensor:
    if not isinstance(loss_mask, Tensor):
        raise TypeError(f"{key} must be a torch.Tensor, got {type(loss_mask).__name__}")
    ref_shape = tuple(reference.shape)
    expected = (ref_shape[:-1], ref_shape[:-1] + (1,))
    if tuple(loss_mask.shape) not in expected:
        raise ValueError(
            f"{key} must have shape {list(expected[0])} or {list(expected[1])} "
            f"matching reward {list(ref_shape)}, got {list(loss_mask.shape)}"
        )
    if loss_mask.dtype != torch.bool:
        if loss_mask.is_complex():
            raise ValueError(f"{key} must be bool or hold only 0 and 1, got dtype {loss_mask.dtype}")
        # A mask holding 0.5 or 2 is a bug upstream, never silently cast.
        loss_mask = _binary_as_bool(key, loss_mask, checks)
    if loss_mask.ndim == reference.ndim - 1:
        loss_mask = loss_mask.unsqueeze(-1)
    return loss_mask


def _binary_as_bool(name: object, flags: Tensor, checks: _Checks) -> Tensor:
    """``flags != 0``, with a check in ``checks`` that they hold only 0 and 1 (its error names
    ``name`` and up to five of the other values)."""
    bad = (flags != 0) & (flags != 1)

    def fail() -> None:
        found = torch.unique(flags[bad])[:5].tolist()
        raise ValueError(
            f"{name} must be bool or hold only 0 and 1, got {flags.dtype} values {found}")

    checks.fail_if(_any(bad), fail)
    return flags != 0


def _check_same_shape(reference_name: str, reference: Tensor, **tensors: Tensor) -> None:
    for name, tensor in tensors.items():
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.shape != reference.shape:
            raise ValueError(
                f"{name} must have the shape of {reference_name} {list(reference.shape)}, "
                f"got {list(tensor.shape)}"
            )


def _check_discount(name: str, value: float | Tensor) -> float:
    """``value`` as a Python float in ``[0, 1]``, or a ``ValueError`` naming ``name``.

    A tensor must hold one number (the masked recursion uses one ``gamma`` and one ``lmbda`` for
    the whole batch); reading it is a host synchronisation for a CUDA tensor.
    """
    number = _discount_number(name, value)
    return _check_discount_range(name, float(number) if isinstance(number, Tensor) else number)


def _discount_number(name: str, value: float | Tensor) -> float | Tensor:
    """``value`` as a Python float, or as a 0-d tensor still to be read; checks its type."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{name} must be a float or a one-element tensor (one {name} for the whole batch), "
                f"got a tensor of shape {list(value.shape)}"
            )
        return value.detach().reshape(())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{name} must be a float or a one-element tensor, got {type(value).__name__}")


def _check_discount_range(name: str, number: float) -> float:
    if not 0.0 <= number <= 1.0:  # also rejects NaN
        raise ValueError(f"{name} must be in [0, 1], got {number}")
    return number


def _check_episode_flags(done: Tensor, terminated: Tensor, checks: _Checks | None = None
                         ) -> tuple[Tensor, Tensor]:
    """``done`` and ``terminated`` as bool, or a ``ValueError``.

    Flags that are not bool must hold only 0 and 1 (0.5 or NaN is a bug upstream, not "true"),
    and ``terminated`` must imply ``done``, as in TorchRL: a terminated step that does not end its
    episode has no meaning here (TorchRL's GAE would zero its bootstrap yet carry the advantage
    across it). The verdicts go to ``checks`` (default: one host synchronisation for all).
    """
    if done.dtype == terminated.dtype == torch.bool and _on_host(done):
        # The common case, with NumPy's bool kernels (about 4x faster than torch's here).
        if np.greater(terminated.numpy(), done.numpy()).any():
            _raise_orphan(terminated > done, done)
        return done, terminated
    own = checks is None
    checks = _Checks(at_once=False) if own else checks
    done_b, terminated_b = (
        flag if flag.dtype == torch.bool else _binary_as_bool(name, flag, checks)
        for name, flag in (("done", done), ("terminated", terminated)))
    orphan = terminated_b > done_b  # terminated and not done
    checks.fail_if(_any(orphan), lambda: _raise_orphan(orphan, done_b))
    if own:
        checks.read()
    return done_b, terminated_b


def _raise_orphan(orphan: Tensor, done: Tensor) -> None:
    first = [int(i) for i in orphan.nonzero()[0].tolist()]
    raise ValueError(
        f"terminated must imply done: terminated is True where done is False at "
        f"{int(orphan.sum())} step(s), the first at index {first} of shape {list(done.shape)}"
    )


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


def _check_gae_inputs(gamma, lmbda, state_value, next_state_value, reward, done, terminated,
                     loss_mask, time_dim, checks: _Checks | None = None):
    """The argument checks of :func:`masked_generalized_advantage_estimate` (and its CP twin).

    Returns ``(time_dim, mask, gamma, lmbda, done, terminated)`` for a floating ``state_value``:
    ``time_dim`` non-negative,
    the mask as bool expanded to ``state_value``'s shape, ``gamma`` and ``lmbda`` as floats (or
    their one-element tensors' values), the flags as bool. Raises ``ValueError`` naming the
    argument, the expected and the received value. With ``checks``, the checks of values on
    the device go there and ``gamma`` and ``lmbda`` may come back as 0-d tensors still to be
    read (and range-checked) with them; without, they are read here.
    """
    _check_same_shape(
        "state_value",
        state_value,
        next_state_value=next_state_value,
        reward=reward,
        done=done,
        terminated=terminated,
    )
    if state_value.ndim < 2:
        raise ValueError(
            f"state_value must have shape [*B, T, F] with a trailing feature dim, "
            f"got {list(state_value.shape)}"
        )
    ndim = state_value.ndim
    if not -ndim <= time_dim < ndim or time_dim % ndim == ndim - 1:
        raise ValueError(
            f"time_dim must index a dim of state_value {list(state_value.shape)} other than "
            f"the trailing feature dim, got {time_dim}"
        )
    time_dim %= ndim
    own = checks is None
    checks = _Checks(at_once=False, device=state_value.device) if own else checks
    mask = _check_loss_mask(loss_mask, reward, "loss_mask", checks).expand(state_value.shape)
    gamma_n, lmbda_n = _discount_number("gamma", gamma), _discount_number("lmbda", lmbda)
    for name, number in (("gamma", gamma_n), ("lmbda", lmbda_n)):
        if not isinstance(number, Tensor):
            _check_discount_range(name, number)
    done, terminated = _check_episode_flags(done, terminated, checks)
    if not state_value.dtype.is_floating_point:
        raise ValueError(f"state_value must be a floating tensor, got {state_value.dtype}")
    if own:
        gamma_n, lmbda_n = _read_discounts(checks, gamma_n, lmbda_n)
    return time_dim, mask, gamma_n, lmbda_n, done, terminated


def _read_discounts(checks: _Checks, gamma: float | Tensor, lmbda: float | Tensor,
                    *numbers: Tensor) -> list[float]:
    """``gamma`` and ``lmbda`` as checked floats, and ``numbers``, in one read of ``checks``."""
    tensors = [x for x in (gamma, lmbda) if isinstance(x, Tensor)]
    values = checks.read(*tensors, *numbers)
    read = iter(values)
    out = [_check_discount_range(name, next(read)) if isinstance(x, Tensor) else x
           for name, x in (("gamma", gamma), ("lmbda", lmbda))]
    return out + values[len(tensors):]


def masked_generalized_advantage_estimate(
    gamma: float | Tensor,
    lmbda: float | Tensor,
    state_value: Tensor,
    next_state_value: Tensor,
    reward: Tensor,
    done: Tensor,
    terminated: Tensor,
    loss_mask: Tensor,
    *,
    time_dim: int = -2,
    masked_value_targets: bool = False,
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """GAE over the trainable steps of each episode (``loss_mask == 1``).

    Args:
        gamma (float or one-element Tensor): discount factor, in ``[0, 1]``.
        lmbda (float or one-element Tensor): GAE trace decay, in ``[0, 1]``.
        state_value (Tensor): ``V[t]``, shape ``[*B, T, F]`` (time at ``time_dim``).
        next_state_value (Tensor): ``V'[t]``, the value of the observation reached by step ``t``.
        reward (Tensor): ``r[t]`` (TorchRL's ``("next", "reward")``).
        done (Tensor): ``d[t]``, episode ends after step ``t`` (``("next", "done")``).
        terminated (Tensor): ``k[t]``, the episode terminated at ``t`` (zero bootstrap).
            Where ``done`` and not ``terminated`` the episode was truncated (bootstrap ``V'``).
        loss_mask (Tensor): ``m[t]``, one flag per step, shape ``[*B, T]`` or ``[*B, T, 1]``,
            bool or numbers holding only 0 and 1. ``1`` marks the policy's own steps.

    Keyword Args:
        time_dim (int): the time dimension of the ``[*B, T, F]`` tensors. Defaults to ``-2``.
        masked_value_targets (bool): also write value targets at masked steps, so that a critic
            trained on them makes the bootstrap ``V'[e]`` of a row cut (or an episode truncated)
            inside a masked block meaningful (``docs/semantics.md``, "Value targets at masked
            steps"). For a masked step ``u`` of an episode with at least one trainable step:
            ``G(t_next) + sum(r[u:t_next]) / gamma`` where ``t_next`` is the episode's next
            trainable step, else (after its last trainable step, up to its end ``e``)
            ``sum(r[u:e+1]) / gamma + (0 if terminated[e] else V'[e])``; with ``gamma == 0``
            the reward terms are omitted. Advantages are unchanged. Defaults to ``False``.

    Returns:
        ``(advantage, value_target)``, each of ``state_value``'s shape and dtype, exactly ``0``
        at masked steps. float16 / bfloat16 inputs are computed in float32.
        With ``masked_value_targets=True``: ``(advantage, value_target, value_target_mask)``,
        where the bool ``value_target_mask`` (``state_value``'s shape) is true at every step that
        carries a target (trainable steps, and masked steps of episodes with a trainable step);
        ``value_target`` is ``0`` elsewhere.

    Raises:
        ValueError: a shape, ``time_dim``, ``gamma`` or ``lmbda`` outside ``[0, 1]`` (or NaN),
            a ``loss_mask``, ``done`` or ``terminated`` holding values other than 0 and 1, or
            ``terminated`` set where ``done`` is not.

    Every row's last step ends an episode (a cut row bootstraps from ``V'``). All tensors but
    ``loss_mask`` must share ``state_value``'s shape. On the CPU without autograd: one compiled
    pass over each row (numba; the rows spread over ``torch.get_num_threads()`` threads, the
    same bits on any number), compiled on the first call of a fresh install. Under autograd and
    on other devices: the vectorized path, on CUDA (any device but the CPU) with one host
    synchronisation: the number of markers is read together with the checks of ``done``,
    ``terminated`` and a non-bool ``loss_mask``, and with ``gamma`` and ``lmbda`` when they are
    device tensors.

    Examples:
        >>> import torch
        >>> from masked_rl import masked_generalized_advantage_estimate
        >>> mask = torch.tensor([[1, 0, 0, 0, 0, 1]])            # [B, T]
        >>> reward = torch.zeros(1, 6, 1); reward[0, -1] = 2.0   # [B, T, 1]
        >>> value = torch.zeros(1, 6, 1)
        >>> done = torch.zeros(1, 6, 1, dtype=torch.bool); done[0, -1] = True
        >>> adv, target = masked_generalized_advantage_estimate(
        ...     0.9, 0.5, value, value, reward, done, done, mask)
        >>> adv.squeeze(-1)
        tensor([[0.9000, 0.0000, 0.0000, 0.0000, 0.0000, 2.0000]])
    """
    host = _on_host(state_value)
    checks = _Checks(at_once=host, device=state_value.device)
    time_dim, mask, gamma_n, lmbda_n, done, terminated = _check_gae_inputs(
        gamma, lmbda, state_value, next_state_value, reward, done, terminated, loss_mask, time_dim,
        checks)

    out_dtype = state_value.dtype
    dtype = torch.float32 if out_dtype in _LOW_PRECISION else out_dtype
    horizon = state_value.shape[time_dim]
    if state_value.numel() == 0:
        _read_discounts(checks, gamma_n, lmbda_n)
        empty = torch.zeros_like(state_value)
        if masked_value_targets:
            return empty, empty.clone(), torch.zeros_like(empty, dtype=torch.bool)
        return empty, empty.clone()

    # Time already varies fastest when every dim after it has size 1 (TorchRL's [*B, T, 1]):
    # then moving it last changes no element's place, and plain reshapes do.
    time_fastest = all(size == 1 for size in state_value.shape[time_dim + 1 :])

    def stream(x: Tensor, as_dtype: torch.dtype | None = None) -> Tensor:
        # [*B, T, F] -> [N * T] with time fastest, so each row is a contiguous run.
        x = x.reshape(-1) if time_fastest else x.movedim(time_dim, -1).reshape(-1)
        return x if as_dtype is None or x.dtype == as_dtype else x.to(as_dtype)

    value = stream(state_value, dtype)
    next_value = stream(next_state_value, dtype)
    rew = stream(reward, dtype)
    m, term = stream(mask), stream(terminated)
    length = m.numel()
    moved_shape = state_value.movedim(time_dim, -1).shape

    def unstream(full: Tensor) -> Tensor:  # [N * T] -> state_value's shape and dtype
        if time_fastest:
            out = full.view(state_value.shape)
        else:
            out = full.view(moved_shape).movedim(-1, time_dim)
        return out if out.dtype == out_dtype else out.to(out_dtype)

    if host and not _needs_autograd(value, next_value, rew, gamma, lmbda):
        # The CPU: one compiled pass over each row (masked_rl._cpu_kernel).
        gamma_f, lmbda_f = _read_discounts(checks, gamma_n, lmbda_n)
        from masked_rl._cpu_kernel import masked_gae  # numba, imported on first use

        advantage, target = value.new_empty(length), value.new_empty(length)
        has_target = torch.empty(length if masked_value_targets else 0, dtype=torch.bool)
        masked_gae(
            *(_as_array(x) for x in (value, next_value, rew, stream(done), term, m)), horizon,
            gamma_f, gamma_f * lmbda_f, masked_value_targets,
            advantage.numpy(), target.numpy(), has_target.numpy())
        outputs = (unstream(advantage), unstream(target))
        if masked_value_targets:
            return *outputs, has_target.view(moved_shape).movedim(-1, time_dim)
        return outputs

    # Every other device, and autograd: vectorized. Markers, runs, and which markers are
    # trainable or end their episode; the number of markers is read with the checks' verdicts
    # (and gamma, lmbda if they are device tensors): the one host synchronisation.
    index = _stream_index(m, stream(done), horizon, checks, gamma_n, lmbda_n)
    gamma_f, lmbda_f = index.discounts
    runs, train, last = index.runs, index.train, index.last
    pos = runs.pos
    gamma_t = gamma_f  # a tensor only where its gradient is asked for
    if _needs_autograd(gamma):
        gamma_t = gamma.reshape(()).to(value.device, dtype)
    coefficients = _scan_levels(gamma_f * lmbda_f, horizon, dtype)
    if _needs_autograd(gamma, lmbda):
        # The carry's powers of gamma * lmbda as tensors, so that their gradient flows too.
        lmbda_t = lmbda.reshape(()).to(value.device, dtype) if isinstance(lmbda, Tensor) else lmbda
        c = gamma_t * lmbda_t
        coefficients = [c ** (1 << level) for level in range(len(coefficients))]

    folded = _run_sums(rew, index.marker, pos.numel())
    value_c = value.index_select(0, pos)
    # Bootstrap: V'[e] at the episode's end e (0 if terminated); before an adjacent action
    # V'[t_j] (equal to V[t_j + 1] in a rollout, and what TorchRL reads); else V[t_{j+1}].
    # Selections, never products: NaN or inf stored where it is not read must not leak.
    bootstrap = _bootstrap(next_value, value_c, runs, last, term)
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
        return unstream(scatter(advantage_c)), unstream(scatter(target_c))
    target, has_target = _masked_step_targets(
        target_c, train.logical_not(), last, pos, runs.nxt, _run_index(index.marker),
        index.marker, m, rew, term,
        next_value, gamma_t if gamma_f > 0 else None, horizon,
    )
    has_target = has_target.view(moved_shape).movedim(-1, time_dim)
    return unstream(scatter(advantage_c)), unstream(target), has_target


def _as_array(x: Tensor) -> np.ndarray:
    """A CPU tensor as a contiguous NumPy array (a view where it is one already)."""
    return np.ascontiguousarray(x.numpy(force=True))


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


def masked_standardize(
    advantage: Tensor, loss_mask: Tensor, *, eps: float = 1e-4, group=None
) -> Tensor:
    """Standardise ``advantage`` with mean and std over trainable steps only.

    Args:
        advantage (Tensor): ``[*B, T, F]`` (floating).
        loss_mask (Tensor): ``[*B, T]``, ``[*B, T, 1]`` or ``advantage``'s shape; bool or
            numbers holding only ``0`` and ``1`` (as the estimator accepts it).

    Keyword Args:
        eps (float): lower bound of the std. Defaults to ``1e-4`` (as TorchRL's GAE).
        group (ProcessGroup or sequence of them, optional): a data-parallel group
            (``torch.distributed.group.WORLD`` for all ranks): the statistics are those of the
            trainable steps of every rank of the group, as if their batches were one. Each rank
            computes its count, mean and sum of squared deviations in float64 and one
            ``all_gather`` (3 numbers per rank) merges them (Chan et al.'s pairwise update: no
            cancellation, unlike a sum of squares). Under context parallelism pass
            ``(cp_group, dp_group)``: one ``all_gather`` per group, statistics over the grid
            (:func:`masked_rl.distributed.masked_moments`). ``None`` (default): this batch
            alone, no communication.

    Returns:
        ``(advantage - mean) / max(std, eps)`` at trainable steps, exactly ``0`` at masked steps
        (NaN or inf stored there included). The std is the unbiased std over trainable steps,
        clamped at ``eps``, so an all-ones mask gives ``(adv - adv.mean()) / adv.std()``.

    Raises:
        ValueError: ``loss_mask`` of another shape or holding values other than 0 and 1.

    Examples:
        >>> import torch
        >>> from masked_rl import masked_standardize
        >>> adv = torch.tensor([[[1.0], [9.0], [3.0]]])      # [B, T, 1]
        >>> masked_standardize(adv, torch.tensor([[1, 0, 1]], dtype=torch.int8)).squeeze(-1)
        tensor([[-0.7071,  0.0000,  0.7071]])
    """
    if not isinstance(advantage, Tensor) or not advantage.dtype.is_floating_point:
        found = advantage.dtype if isinstance(advantage, Tensor) else type(advantage).__name__
        raise TypeError(f"advantage must be a floating torch.Tensor, got {found}")
    shape = tuple(advantage.shape)
    accepted = (shape[:-1], shape[:-1] + (1,), shape)
    if not isinstance(loss_mask, Tensor) or tuple(loss_mask.shape) not in accepted:
        found = list(loss_mask.shape) if isinstance(loss_mask, Tensor) else type(loss_mask).__name__
        raise ValueError(
            f"loss_mask must have shape {list(accepted[0])}, {list(accepted[1])} or "
            f"{list(accepted[2])} to match advantage {list(shape)}, got {found}"
        )
    if loss_mask.shape == advantage.shape:  # one flag per entry
        mask = check_loss_mask(loss_mask, advantage.unsqueeze(-1)).squeeze(-1)
    else:
        mask = check_loss_mask(loss_mask, advantage).expand_as(advantage)
    if group is not None:
        from masked_rl.distributed import masked_moments  # torch.distributed only when asked

        if torch.is_grad_enabled() and advantage.requires_grad:
            raise RuntimeError(
                "masked_standardize with a group does not differentiate through the statistics "
                "of other ranks: pass a detached advantage (or call it under torch.no_grad())"
            )
        loc, scale = masked_moments(advantage, mask, group)
        centred = torch.where(mask, advantage - loc.to(advantage.dtype), 0.0)
        return centred / scale.clamp_min(eps).to(advantage.dtype)
    weight = mask.to(advantage.dtype)
    count = weight.sum().clamp_min(1)
    masked_adv = torch.where(mask, advantage, 0.0)
    loc = masked_adv.sum() / count
    centred = torch.where(mask, advantage - loc, 0.0)
    scale = (centred.pow(2).sum() / (count - 1).clamp_min(1)).sqrt().clamp_min(eps)
    return centred / scale
