"""The CPU kernel of masked GAE: one compiled reverse pass over each row (numba).

:func:`masked_gae_rows` is the serial recursion of ``docs/semantics.md`` written out once, step
by step from a row's end to its start, compiled by numba to machine code (no Python runs per
step). A row is read once and each output written once, so on the CPU it runs at about the
speed of one pass over the data, several times faster than the vectorized path of
:mod:`masked_rl.functional` (which the other devices and autograd use). It runs on one thread and
holds no lock: no threading layer, safe to call from several threads and after a ``fork``.

Compiled on first use for each dtype (about a second); ``cache=True`` keeps the machine code in a
``__pycache__`` folder (numba's user-wide cache when the package's folder is read-only).
"""

from __future__ import annotations

import numba


@numba.njit(cache=True, nogil=True, boundscheck=False)
def masked_gae_rows(value, next_value, reward, done, terminated, trainable, horizon, gamma,
                    gamma_lmbda, masked_targets, advantage, target, has_target):
    """Masked GAE of rows of ``horizon`` steps, stored one after the other (C order).

    ``value`` ... ``reward``: 1-D float arrays of one dtype; ``done``, ``terminated``,
    ``trainable``: 1-D bool arrays of the same length, ``terminated`` implying ``done``;
    ``gamma`` and ``gamma_lmbda``: scalars of that dtype. Writes ``advantage`` and ``target``
    (same dtype); with ``masked_targets``, also the value targets of masked steps and
    ``has_target`` (bool), else ``target`` is ``0`` at masked steps and ``has_target`` unused.

    Going backwards through a row, the state is the episode's end bootstrap ``V'[e]`` (or ``0``
    if it terminated), the sum of the rewards of the masked steps since the next action
    (``pending``), and the next action's step, value and advantage. An action folds ``pending``
    into its reward, bootstraps from ``V'`` at its own step when the next action is adjacent,
    from the next action's ``V`` across a masked block, or from the end's; its advantage adds
    ``gamma * lmbda`` times the next action's. Only these values are read: a NaN or inf
    stored anywhere else (masked steps' values, a terminated end's ``V'``) cannot reach an output.
    """
    zero = value.dtype.type(0)
    for row in range(value.size // horizon):
        first, last = row * horizon, row * horizon + horizon - 1
        end_value = zero
        pending = zero
        next_step = -1  # the next action of the episode (-1: none after this step)
        next_value_at = zero
        next_advantage = zero
        next_target = zero
        episode_end = last
        for t in range(last, first - 1, -1):
            if t == last or done[t]:  # the last step of an episode
                episode_end = t
                end_value = zero if terminated[t] else next_value[t]
                pending = zero
                next_step = -1
            if trainable[t]:
                folded = reward[t] + pending
                if next_step < 0:
                    delta = folded + gamma * end_value - value[t]
                    adv = delta
                else:
                    bootstrap = next_value[t] if next_step == t + 1 else next_value_at
                    delta = folded + gamma * bootstrap - value[t]
                    adv = delta + gamma_lmbda * next_advantage
                advantage[t] = adv
                target[t] = adv + value[t]
                pending = zero
                next_step = t
                next_value_at = value[t]
                next_advantage = adv
                next_target = target[t]
                if masked_targets:
                    has_target[t] = True
            else:
                pending += reward[t]
                advantage[t] = zero
                if masked_targets:
                    # G at the next action, or the end's bootstrap, plus the rewards up to it
                    # (from this step on), discounted back by one gamma.
                    follow = end_value if next_step < 0 else next_target
                    target[t] = follow + pending / gamma if gamma > zero else follow
                    has_target[t] = True
                else:
                    target[t] = zero
            if masked_targets and next_step < 0 and (t == first or done[t - 1]):
                # The first step of an episode without any action: no target anywhere in it.
                for u in range(t, episode_end + 1):
                    target[u] = zero
                    has_target[u] = False

