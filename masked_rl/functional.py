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

Implementation: the batch is flattened to one stream of length ``L = N * T``
(every row end is an episode end, so rows cannot leak into each other). The stream
is cut at *markers*, the trainable steps and every episode's first step, and
compressed to them with a single ``nonzero`` (the only host synchronisation). One
``cumsum`` numbers each step's run and one ``index_add_`` folds every run's rewards
into its marker, so a masked reward reaches the action before it and a reward
before an episode's first action lands on a masked marker, whose delta is zeroed.
The linear recurrence ``A_j = delta_j + gamma * lmbda * A_{j+1}`` (cut at episode
ends) is solved by a reverse doubling scan in at most ``ceil(log2(T))`` vectorized
passes. Memory is linear in ``L``; nothing of size ``T x T`` is built and no Python
loop runs over rows, episodes or time steps.

Reference: Schulman et al., "High-Dimensional Continuous Control Using
Generalized Advantage Estimation", ICLR 2016, https://arxiv.org/abs/1506.02438.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "masked_generalized_advantage_estimate",
    "masked_standardize",
    "check_loss_mask",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def check_loss_mask(loss_mask: Tensor, reference: Tensor, *, key: object = "loss_mask") -> Tensor:
    """Validate a loss mask against a ``[*B, T, F]`` tensor and return it as bool, broadcastable to it.

    Accepted: shape ``reference.shape[:-1]`` (``[*B, T]``) or ``reference.shape[:-1] + (1,)``
    (``[*B, T, 1]``), dtype bool or any integer / floating dtype holding only ``0`` and ``1``.

    Raises:
        ValueError: naming ``key``, with the expected and the received shape or values.
    """
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
        # One host synchronisation: a mask holding 0.5 or 2 is a bug upstream, never silently cast.
        bad = (loss_mask != 0) & (loss_mask != 1)
        if bool(bad.any()):
            found = torch.unique(loss_mask[bad])[:5].tolist()
            raise ValueError(
                f"{key} must be bool or hold only 0 and 1, got {loss_mask.dtype} values {found}"
            )
        loss_mask = loss_mask != 0
    if loss_mask.ndim == reference.ndim - 1:
        loss_mask = loss_mask.unsqueeze(-1)
    return loss_mask


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
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{name} must be a float or a one-element tensor (one {name} for the whole batch), "
                f"got a tensor of shape {list(value.shape)}"
            )
        number = float(value.detach().reshape(()))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        raise TypeError(f"{name} must be a float or a one-element tensor, got {type(value).__name__}")
    if not 0.0 <= number <= 1.0:  # also rejects NaN
        raise ValueError(f"{name} must be in [0, 1], got {number}")
    return number


def _check_episode_flags(done: Tensor, terminated: Tensor) -> tuple[Tensor, Tensor]:
    """``done`` and ``terminated`` as bool, or a ``ValueError``.

    Flags that are not bool must hold only 0 and 1 (0.5 or NaN is a bug upstream, not "true"),
    and ``terminated`` must imply ``done``, as in TorchRL: a terminated step that does not end its
    episode has no meaning here (TorchRL's GAE would zero its bootstrap yet carry the advantage
    across it). All checks share one host synchronisation.
    """
    flags = []
    problems = []
    for name, flag in (("done", done), ("terminated", terminated)):
        if flag.dtype == torch.bool:
            flags.append(flag)
            problems.append(flag.new_zeros((), dtype=torch.bool))
        else:
            problems.append(((flag != 0) & (flag != 1)).any())
            flags.append(flag != 0)
    done_b, terminated_b = flags
    orphan = terminated_b & ~done_b
    problems.append(orphan.any())
    bad_done, bad_terminated, has_orphan = torch.stack(problems).tolist()
    for name, flag, bad in (("done", done, bad_done), ("terminated", terminated, bad_terminated)):
        if bad:
            found = torch.unique(flag[(flag != 0) & (flag != 1)])[:5].tolist()
            raise ValueError(f"{name} must be bool or hold only 0 and 1, got {flag.dtype} values {found}")
    if has_orphan:
        first = [int(i) for i in orphan.nonzero()[0].tolist()]
        raise ValueError(
            f"terminated must imply done: terminated is True where done is False at "
            f"{int(orphan.sum())} step(s), the first at index {first} of shape {list(done.shape)}"
        )
    return done_b, terminated_b


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


def _reverse_linear_scan(delta: Tensor, gate: Tensor, coefficients: list[float]) -> Tensor:
    """Solve ``x_j = delta_j + c * x_{j+1}`` where ``gate_j`` (``x_j = delta_j`` elsewhere).

    ``gate`` (bool) is true where step ``j + 1`` continues ``j``'s episode; ``coefficients``
    are ``c, c**2, c**4, ...``. After the level with stride ``k``, ``x_j`` sums the window
    ``[j, j + 2k)`` and ``gate_j`` says whether that window lies in one episode
    (Hillis-Steele doubling: ``O(M log M)`` work, ``O(M)`` memory). Without autograd,
    ``delta`` and ``gate`` are overwritten (they serve as buffers).

    A window crossing an episode end must contribute exactly nothing, also when the other
    episode holds NaN or inf (``0 * inf`` is NaN): the carry is selected with ``where``.
    On the CPU, when every ``delta`` is finite, a fused multiply by the 0/1 gate is used
    instead: it gives the same bits at about half the cost.
    """
    x = delta
    length = x.shape[0]
    levels = [(1 << level, ck) for level, ck in enumerate(coefficients) if (1 << level) < length]
    if not levels:
        return x
    if torch.is_grad_enabled() and delta.requires_grad:
        for k, ck in levels:
            carry = torch.where(gate[:-k], x[k:], 0.0)
            x = torch.cat((torch.add(x[:-k], carry, alpha=ck), x[-k:]))
            gate = torch.cat((gate[:-k] & gate[k:], gate.new_zeros(k)))
        return x
    fused = delta.device.type == "cpu" and bool(torch.isfinite(delta).all())
    # Ping-pong buffers: no allocation inside the loop.
    x_next, gate_next = torch.empty_like(x), torch.empty_like(gate)
    if fused:
        gate, gate_next = gate.to(x.dtype), gate_next.to(x.dtype)
    else:
        carry, zero = torch.empty_like(x), x.new_zeros(())
    for level, (k, ck) in enumerate(levels):
        if fused:
            torch.addcmul(x[:-k], gate[:-k], x[k:], value=ck, out=x_next[:-k])
        else:
            torch.where(gate[:-k], x[k:], zero, out=carry[:-k])
            torch.add(x[:-k], carry[:-k], alpha=ck, out=x_next[:-k])
        x_next[-k:] = x[-k:]
        x, x_next = x_next, x
        if level < len(levels) - 1:
            torch.mul(gate[:-k], gate[k:], out=gate_next[:-k])
            gate_next[-k:] = 0
            gate, gate_next = gate_next, gate
    return x


def _flat_nonzero(flags: Tensor) -> Tensor:
    """Indices (int64) of the true entries of a 1-D bool tensor; one host synchronisation."""
    if flags.device.type == "cpu":
        # NumPy's single-threaded nonzero is 5-7x faster than torch's on CPU (torch 2.x), and
        # on a machine with busy cores it does not wait for a second thread either.
        return torch.from_numpy(np.flatnonzero(flags.numpy()))
    return flags.nonzero().squeeze(-1)


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
    ``loss_mask`` must share ``state_value``'s shape. Host synchronisations: one ``nonzero``,
    one for the checks of ``done`` and ``terminated``, one more for a non-bool ``loss_mask``
    (the check that it holds only 0 and 1), and reading ``gamma`` and ``lmbda`` if they are
    CUDA tensors.

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
    mask = check_loss_mask(loss_mask, reward).expand(state_value.shape)
    gamma_f, lmbda_f = _check_discount("gamma", gamma), _check_discount("lmbda", lmbda)
    done, terminated = _check_episode_flags(done, terminated)

    out_dtype = state_value.dtype
    if not out_dtype.is_floating_point:
        raise ValueError(f"state_value must be a floating tensor, got {out_dtype}")
    dtype = torch.float32 if out_dtype in _LOW_PRECISION else out_dtype
    horizon = state_value.shape[time_dim]
    if state_value.numel() == 0:
        empty = torch.zeros_like(state_value)
        if masked_value_targets:
            return empty, empty.clone(), torch.zeros_like(empty, dtype=torch.bool)
        return empty, empty.clone()

    def stream(x: Tensor) -> Tensor:
        # [*B, T, F] -> [N * T] with time fastest, so each row is a contiguous run.
        return x.movedim(time_dim, -1).reshape(-1)

    value = stream(state_value).to(dtype)
    next_value = stream(next_state_value).to(dtype)
    rew = stream(reward).to(dtype)
    m = stream(mask)
    term = stream(terminated).to(torch.bool)
    end = stream(done).to(torch.bool, copy=True)
    end.view(-1, horizon)[:, -1] = True  # a row's last step ends its episode
    length = end.numel()
    gamma_t = gamma.to(device=value.device, dtype=dtype) if isinstance(gamma, Tensor) else gamma
    gamma_lmbda = gamma_f * lmbda_f

    # Markers: every trainable step and every episode's first step. The markers cut the stream
    # into runs; a run's rewards are folded into its marker: a trainable marker is the run's
    # action, a masked one (an episode start before its first action) drops them.
    marker = torch.empty_like(end)
    torch.logical_or(m[1:], end[:-1], out=marker[1:])
    marker[0] = True
    pos = _flat_nonzero(marker)  # the only host synchronisation
    run = torch.cumsum(marker, 0, dtype=torch.int32 if length < 2**31 else torch.int64)
    folded = value.new_zeros(pos.numel() + 1).index_add_(0, run, rew)[1:]  # run is 1-based

    # In the compressed stream the marker after j is the next action of j's episode, or the
    # next episode's start; either way step nxt[j] (the one before it) ends j's run.
    nxt = torch.cat((pos[1:], pos.new_full((1,), length))).sub_(1)
    train = m.index_select(0, pos)
    value_c = value.index_select(0, pos)
    last = end.index_select(0, nxt)  # j is its episode's last marker
    # Bootstrap: V'[e] at the episode's end e (0 if terminated); before an adjacent action
    # V'[t_j] (equal to V[t_j + 1] in a rollout, and what TorchRL reads); else V[t_{j+1}].
    delta = torch.where(
        last | (nxt == pos), next_value.index_select(0, nxt), value_c.roll(-1)
    ).masked_fill_(last & term.index_select(0, nxt), 0.0)
    # masked_fill, not a product: NaN or inf stored at a masked marker must not leak.
    masked = train.logical_not_()
    delta = delta.mul_(gamma_t).add_(folded).sub_(value_c).masked_fill_(masked, 0.0)
    # The carry flows from j + 1 into an action j of the same episode; a masked marker gets 0.
    gate = (last | masked).logical_not_()
    del folded

    advantage_c = _reverse_linear_scan(delta, gate, _scan_levels(gamma_lmbda, horizon, dtype))
    target_c = torch.add(advantage_c, value_c).masked_fill_(masked, 0.0)

    moved_shape = state_value.movedim(time_dim, -1).shape

    def unstream(x: Tensor) -> Tensor:
        full = x if x.numel() == length else x.new_zeros(length).scatter_(0, pos, x)
        return full.view(moved_shape).movedim(-1, time_dim).to(out_dtype)

    if not masked_value_targets:
        return unstream(advantage_c), unstream(target_c)
    target, has_target = _masked_step_targets(
        target_c, masked, last, pos, nxt, run, marker, m, rew, term, next_value,
        gamma_t if gamma_f > 0 else None, horizon,
    )
    has_target = has_target.view(moved_shape).movedim(-1, time_dim)
    return unstream(advantage_c), unstream(target), has_target


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
        to_run_end = _reverse_linear_scan(reward.clone(), same_run, _scan_levels(1.0, horizon, reward.dtype))
        follow = follow + to_run_end / gamma
    at_masked = has_target & trainable.logical_not()
    return torch.where(at_masked, follow, target), has_target


def masked_standardize(
    advantage: Tensor, loss_mask: Tensor, *, eps: float = 1e-4
) -> Tensor:
    """Standardise ``advantage`` with mean and std over trainable steps only.

    Args:
        advantage (Tensor): ``[*B, T, F]``.
        loss_mask (Tensor): bool, broadcastable to ``advantage`` (e.g. ``[*B, T, 1]``).

    Returns:
        ``(advantage - mean) / max(std, eps)`` at trainable steps, exactly ``0`` at masked steps.
        The std is the unbiased std over trainable steps, clamped at ``eps`` (``1e-4``, as in
        TorchRL), so an all-ones mask gives exactly ``(adv - adv.mean()) / adv.std()``.

    Examples:
        >>> import torch
        >>> adv = torch.tensor([[1.0, 9.0, 3.0]]).unsqueeze(-1)          # [B, T, 1]
        >>> mask = torch.tensor([[True, False, True]]).unsqueeze(-1)
        >>> masked_standardize(adv, mask).squeeze(-1)
        tensor([[-0.7071,  0.0000,  0.7071]])
    """
    mask = loss_mask.expand_as(advantage)
    weight = mask.to(advantage.dtype)
    count = weight.sum().clamp_min(1)
    masked_adv = torch.where(mask, advantage, 0.0)
    loc = masked_adv.sum() / count
    centred = torch.where(mask, advantage - loc, 0.0)
    scale = (centred.pow(2).sum() / (count - 1).clamp_min(1)).sqrt().clamp_min(eps)
    return centred / scale
