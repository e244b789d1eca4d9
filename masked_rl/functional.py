"""Masked Generalized Advantage Estimation as pure tensor functions.

GAE runs on the compressed subsequence of *trainable* steps (``loss_mask == 1``) of every
episode. :func:`serial_masked_gae`, first below, is the recursion of ``docs/semantics.md``
written out for one row, rule by rule: read it against the doc. The public
:func:`masked_generalized_advantage_estimate` checks its inputs (:mod:`masked_rl._checks`),
lays the batch out as rows and hands them to one of two fast paths that compute the same
numbers:

* on the CPU without autograd, a compiled kernel (numba, :mod:`masked_rl._cpu_kernel`) that
  walks each row once from its end to its start, the rows spread over torch's threads;
* on every other device, and under autograd, the vectorized path
  (:mod:`masked_rl._vectorized`): a reverse doubling scan over the trainable steps of the whole
  batch, one host synchronisation.

``implementation="reference"`` runs :func:`serial_masked_gae` instead (slow, for readers and
tests). Standardisation over trainable steps is :func:`masked_standardize`
(:mod:`masked_rl.statistics`).

Reference: Schulman et al., "High-Dimensional Continuous Control Using
Generalized Advantage Estimation", ICLR 2016, https://arxiv.org/abs/1506.02438.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import Tensor

from masked_rl._checks import (
    _LOW_PRECISION,
    _Checks,
    _check_gae_inputs,
    _on_host,
    _read_discounts,
    check_loss_mask,
)
from masked_rl._vectorized import _needs_autograd, masked_gae_vectorized
from masked_rl.statistics import masked_standardize

__all__ = [
    "masked_generalized_advantage_estimate",
    "masked_standardize",
    "serial_masked_gae",
    "check_loss_mask",
]

IMPLEMENTATIONS = ("auto", "reference")


def serial_masked_gae(gamma: float, lmbda: float, value: list, next_value: list, reward: list,
                      done: list, terminated: list, trainable: list,
                      masked_value_targets: bool = False) -> tuple[list, list, list]:
    """The rules of ``docs/semantics.md`` for one row of ``T`` numbers (Python lists).

    Returns ``(advantage, value_target, has_target)`` lists. One episode (segment) at a time,
    one trainable step at a time, from the last to the first.

    Examples:
        >>> zeros = [0.0] * 6
        >>> serial_masked_gae(0.9, 0.5, zeros, zeros, [0, 0, 0, 0, 0, 2.0], [0, 0, 0, 0, 0, 1],
        ...                   [0, 0, 0, 0, 0, 1], [1, 0, 0, 0, 0, 1])[0]   # worked case 1
        [0.9, 0.0, 0.0, 0.0, 0.0, 2.0]
    """
    horizon = len(value)
    advantage, target, has_target = [0.0] * horizon, [0.0] * horizon, [False] * horizon
    start = 0
    while start < horizon:
        # A segment ends at a done step or at the row's last step.
        end = next(t for t in range(start, horizon) if done[t] or t == horizon - 1)
        steps = [t for t in range(start, end + 1) if trainable[t]]  # t_1 < ... < t_K
        carry = 0.0  # A_{j+1}
        for j in reversed(range(len(steps))):
            t, last = steps[j], j == len(steps) - 1
            stop = end + 1 if last else steps[j + 1]
            # Rule 1: the rewards of the masked steps up to the next action, undiscounted.
            effective_reward = reward[t] + sum(reward[u] for u in range(t + 1, stop))
            # Rule 2: bootstrap from the next action, V'[t] when it is adjacent, or the end's.
            if last:
                next_value_j = 0.0 if terminated[end] else next_value[end]
            elif stop == t + 1:
                next_value_j = next_value[t]
            else:
                next_value_j = value[stop]
            # Rule 3: one gamma * lmbda per decision (none at all when it is 0: 0 * inf is NaN).
            delta = effective_reward + gamma * next_value_j - value[t]
            carry = delta + gamma * lmbda * carry if not last and gamma * lmbda > 0 else delta
            advantage[t], target[t], has_target[t] = carry, carry + value[t], True
        # Rule 4 and 5: masked steps, and segments without an action, keep 0. The extension:
        # value targets at the masked steps of a segment with an action.
        for u in range(start, end + 1) if masked_value_targets and steps else ():
            if trainable[u]:
                continue
            later = [t for t in steps if t > u]
            if later:
                stop, follow = later[0], target[later[0]]
            else:
                stop, follow = end + 1, 0.0 if terminated[end] else next_value[end]
            rewards = sum(reward[w] for w in range(u, stop))
            target[u], has_target[u] = follow + (rewards / gamma if gamma > 0 else 0.0), True
        start = end + 1
    return advantage, target, has_target


# A child forked from a process whose threads ran OpenMP (torch does) hangs in its first
# parallel region, so forked children run the kernel on one thread (#29).
_FORKED_CHILD = False


def _mark_forked_child() -> None:
    global _FORKED_CHILD
    _FORKED_CHILD = True


os.register_at_fork(after_in_child=_mark_forked_child)


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
    implementation: str = "auto",
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
        implementation (str): ``"auto"`` (default): the compiled kernel on the CPU without
            autograd, else the vectorized path. ``"reference"``: :func:`serial_masked_gae`, the
            plain recursion at the top of this module, one Python loop per row (slow, no
            gradient); for readers and tests.

    Returns:
        ``(advantage, value_target)``, each of ``state_value``'s shape and dtype, exactly ``0``
        at masked steps. float16 / bfloat16 inputs are computed in float32.
        With ``masked_value_targets=True``: ``(advantage, value_target, value_target_mask)``,
        where the bool ``value_target_mask`` (``state_value``'s shape) is true at every step that
        carries a target (trainable steps, and masked steps of episodes with a trainable step);
        ``value_target`` is ``0`` elsewhere.

    Raises:
        ValueError: an unknown ``implementation``, a shape, ``time_dim``, ``gamma`` or ``lmbda`` outside ``[0, 1]`` (or NaN),
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
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    host = _on_host(state_value)
    checks = _Checks(at_once=host, device=state_value.device)
    time_dim, mask, gamma_n, lmbda_n, done, terminated = _check_gae_inputs(
        gamma, lmbda, state_value, next_state_value, reward, done, terminated, loss_mask, time_dim,
        checks)

    out_dtype = state_value.dtype
    dtype = torch.float32 if out_dtype in _LOW_PRECISION else out_dtype
    horizon = state_value.shape[time_dim]
    # Time already varies fastest when every dim after it has size 1 (TorchRL's [*B, T, 1]):
    # then moving it last changes no element's place, and plain reshapes do.
    time_fastest = all(size == 1 for size in state_value.shape[time_dim + 1 :])
    moved_shape = state_value.movedim(time_dim, -1).shape

    def stream(x: Tensor, as_dtype: torch.dtype | None = None) -> Tensor:
        # [*B, T, F] -> [N * T] with time fastest, so each row is a contiguous run.
        x = x.reshape(-1) if time_fastest else x.movedim(time_dim, -1).reshape(-1)
        return x if as_dtype is None or x.dtype == as_dtype else x.to(as_dtype)

    def unstream(full: Tensor) -> Tensor:  # [N * T] -> state_value's shape (and dtype)
        out = full.view(state_value.shape) if time_fastest else full.view(moved_shape).movedim(-1, time_dim)
        return out if out.dtype in (out_dtype, torch.bool) else out.to(out_dtype)

    args = (stream(state_value, dtype), stream(next_state_value, dtype), stream(reward, dtype),
            stream(done), stream(terminated), stream(mask))
    if state_value.numel() == 0:
        _read_discounts(checks, gamma_n, lmbda_n)
        empty = args[0].clone()
        outputs = (empty, empty.clone(), torch.zeros_like(empty, dtype=torch.bool))
    elif implementation == "reference":
        if _needs_autograd(*args[:3], gamma, lmbda):
            raise ValueError("implementation='reference' computes with Python numbers and gives no "
                             "gradient: use implementation='auto' under autograd")
        gamma_f, lmbda_f = _read_discounts(checks, gamma_n, lmbda_n)
        rows = zip(*(x.view(-1, horizon).tolist() for x in args))
        results = [serial_masked_gae(gamma_f, lmbda_f, *row, masked_value_targets) for row in rows]
        outputs = tuple(torch.tensor([r[i] for r in results], dtype=dtype if i < 2 else torch.bool,
                                     device=state_value.device).view(-1) for i in range(3))
    elif host and not _needs_autograd(*args[:3], gamma, lmbda):
        gamma_f, lmbda_f = _read_discounts(checks, gamma_n, lmbda_n)
        outputs = _cpu_masked_gae(*args, horizon, gamma_f, lmbda_f, masked_value_targets)
    else:
        outputs = masked_gae_vectorized(*args, horizon, gamma, lmbda, checks, (gamma_n, lmbda_n),
                                        masked_value_targets)
    if masked_value_targets:
        return tuple(unstream(x) for x in outputs)
    return unstream(outputs[0]), unstream(outputs[1])


def _cpu_masked_gae(value: Tensor, next_value: Tensor, reward: Tensor, done: Tensor,
                    terminated: Tensor, trainable: Tensor, horizon: int, gamma: float,
                    lmbda: float, masked_value_targets: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The compiled kernel on CPU streams (numba, imported on first use)."""
    from masked_rl._cpu_kernel import masked_gae

    length = value.numel()
    advantage, target = value.new_empty(length), value.new_empty(length)
    has_target = torch.empty(length if masked_value_targets else 0, dtype=torch.bool)
    masked_gae(*(np.ascontiguousarray(x.numpy(force=True))
                 for x in (value, next_value, reward, done, terminated, trainable)),
               horizon, gamma, gamma * lmbda, masked_value_targets,
               advantage.numpy(), target.numpy(), has_target.numpy(),
               parallel=not _FORKED_CHILD)
    return advantage, target, has_target
