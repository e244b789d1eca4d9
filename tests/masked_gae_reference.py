"""The plain serial reference for docs/semantics.md, and random rollout data for the tests.

Importable from any test module (``pythonpath = ["tests"]`` in pyproject.toml).
"""

from __future__ import annotations

import torch


def serial_masked_gae(gamma, lmbda, value, next_value, reward, done, terminated, mask):
    """The rules of docs/semantics.md, read literally, for one row of plain Python floats.

    Time only, no feature dim.

    Deliberately naive: one episode at a time, one trainable step at a time. Rule 2 as
    docs/semantics.md states it: ``V[t_{j+1}]`` across a masked gap, ``V'[t_j]`` when the next
    trainable step is adjacent, the end's bootstrap after the last one (the two readings of an
    adjacent pair differ only on data where ``V'[t] != V[t + 1]``, which the tests draw too).
    Returns ``(advantage, value_target)`` as lists.
    """
    horizon = len(value)
    advantage = [0.0] * horizon
    target = [0.0] * horizon
    start = 0
    while start < horizon:
        end = start
        while not done[end] and end < horizon - 1:
            end += 1
        steps = [t for t in range(start, end + 1) if mask[t]]
        carry = 0.0
        for j in reversed(range(len(steps))):
            t = steps[j]
            last = j == len(steps) - 1
            stop = end + 1 if last else steps[j + 1]
            effective_reward = reward[t] + sum(reward[u] for u in range(t + 1, stop))
            if last:
                bootstrap = 0.0 if terminated[end] else next_value[end]
            elif steps[j + 1] == t + 1:  # rule 2: adjacent actions read V'[t_j]
                bootstrap = next_value[t]
            else:
                bootstrap = value[steps[j + 1]]
            delta = effective_reward + gamma * bootstrap - value[t]
            carry = delta + gamma * lmbda * carry
            advantage[t] = carry
            target[t] = carry + value[t]
        start = end + 1
    return advantage, target


def serial_masked_value_targets(gamma, lmbda, value, next_value, reward, done, terminated, mask):
    """The extension "value targets at masked steps" (docs/semantics.md), read literally, for one row.

    Returns ``(value_target, has_target)`` as lists: ``G`` at trainable steps (from
    :func:`serial_masked_gae`), the extension's target at the masked steps of an episode with a
    trainable step, ``0`` / ``False`` elsewhere.
    """
    _, target = serial_masked_gae(gamma, lmbda, value, next_value, reward, done, terminated, mask)
    horizon = len(value)
    has_target = [bool(m) for m in mask]
    start = 0
    while start < horizon:
        end = start
        while not done[end] and end < horizon - 1:
            end += 1
        steps = [t for t in range(start, end + 1) if mask[t]]
        for u in range(start, end + 1):
            if mask[u] or not steps:
                continue
            later = [t for t in steps if t > u]
            if later:
                stop, follow = later[0], target[later[0]]
            else:
                stop, follow = end + 1, 0.0 if terminated[end] else next_value[end]
            rewards = sum(reward[w] for w in range(u, stop))
            target[u] = follow + (rewards / gamma if gamma > 0 else 0.0)
            has_target[u] = True
        start = end + 1
    return target, has_target


def serial_masked_gae_batch(gamma, lmbda, value, next_value, reward, done, terminated, mask):
    """:func:`serial_masked_gae` over ``[B, T, 1]`` tensors (mask ``[B, T]``), float64 out."""
    rows = []
    for b in range(value.shape[0]):
        args = [x[b].reshape(-1).tolist() for x in (value, next_value, reward, done, terminated, mask)]
        rows.append(serial_masked_gae(gamma, lmbda, *args))
    advantage = torch.tensor([r[0] for r in rows], dtype=torch.float64).unsqueeze(-1)
    target = torch.tensor([r[1] for r in rows], dtype=torch.float64).unsqueeze(-1)
    return advantage, target


def serial_masked_value_targets_batch(gamma, lmbda, value, next_value, reward, done, terminated, mask):
    """:func:`serial_masked_value_targets` over ``[B, T, 1]`` tensors: float64 targets, bool flags."""
    rows = []
    for b in range(value.shape[0]):
        args = [x[b].reshape(-1).tolist() for x in (value, next_value, reward, done, terminated, mask)]
        rows.append(serial_masked_value_targets(gamma, lmbda, *args))
    target = torch.tensor([r[0] for r in rows], dtype=torch.float64).unsqueeze(-1)
    has_target = torch.tensor([r[1] for r in rows], dtype=torch.bool).unsqueeze(-1)
    return target, has_target


def make_rollout(batch, horizon, *, p_mask=0.5, p_done=0.1, p_term=0.5, seed=0, dtype=torch.float64,
                 consistent=True):
    """Random ``[B, T, 1]`` data. With ``consistent``, ``V'[t] == V[t+1]`` inside episodes, as in
    a TorchRL rollout (``V'`` is fresh at episode ends). Mask is ``[B, T]`` bool."""
    g = torch.Generator().manual_seed(seed)
    value = torch.randn(batch, horizon, 1, generator=g, dtype=dtype)
    reward = torch.randn(batch, horizon, 1, generator=g, dtype=dtype)
    done = torch.rand(batch, horizon, 1, generator=g) < p_done
    terminated = done & (torch.rand(batch, horizon, 1, generator=g) < p_term)
    mask = torch.rand(batch, horizon, generator=g) < p_mask
    fresh = torch.randn(batch, horizon, 1, generator=g, dtype=dtype)
    if consistent:
        shifted = torch.cat((value[:, 1:], fresh[:, -1:]), dim=1)
        next_value = torch.where(done, fresh, shifted)
        next_value[:, -1:] = fresh[:, -1:]
    else:
        next_value = fresh
    return value, next_value, reward, done, terminated, mask

