"""The CPU kernel of masked GAE: one compiled reverse pass over each row (numba).

:func:`masked_gae_rows` is the serial recursion of ``docs/semantics.md`` written out once, step
by step from a row's end to its start, compiled by numba to machine code (no Python runs per
step). A row is read once and each output written once, so on the CPU it runs at about the
speed of one pass over the data, several times faster than the vectorized path of
:mod:`masked_rl.functional` (which the other devices and autograd use). :func:`masked_gae`
spreads the rows over torch's number of threads (``torch.set_num_threads``).

Compiled on first use for each dtype (a few seconds) and cached on disk: in a ``__pycache__``
folder, numba's user-wide cache when the package's folder is read-only, ``NUMBA_CACHE_DIR`` if
set; with no writable folder at all, compiled anew in every process (:func:`_compiled`).
"""

from __future__ import annotations

import threading
import warnings

import numba
import numpy as np
import torch

# Below this many steps a call runs on one thread (starting the others costs more).
_PARALLEL_MIN_STEPS = 1 << 15

# numba's threading layers differ in what they survive: its "workqueue" layer aborts the
# process when two threads launch parallel work at once, so one thread at a time runs the
# parallel kernel (the others run their rows on their own thread meanwhile). A forked child
# must not launch one at all (OpenMP's threads do not survive a fork: it would hang); the
# caller says so with ``parallel=False``.
_LAUNCH = threading.Lock()


def _compiled(**options):
    """``numba.njit`` with machine code cached on disk, or, where numba finds no writable folder
    for it (it raises then), compiled anew in every process, with a warning."""
    def decorate(function):
        try:
            return numba.njit(cache=True, nogil=True, **options)(function)
        except RuntimeError as error:
            warnings.warn(f"masked_rl: the CPU kernel is compiled in every process ({error}); "
                          "set NUMBA_CACHE_DIR to a writable folder to cache it", stacklevel=2)
            return numba.njit(nogil=True, **options)(function)
    return decorate


def masked_gae(value: np.ndarray, next_value: np.ndarray, reward: np.ndarray, done: np.ndarray,
               terminated: np.ndarray, trainable: np.ndarray, horizon: int, gamma: float,
               gamma_lmbda: float, masked_targets: bool, advantage: np.ndarray,
               target: np.ndarray, has_target: np.ndarray, *, parallel: bool = True) -> None:
    """:func:`masked_gae_rows` over every row, on up to ``torch.get_num_threads()`` threads
    (the outputs are the same bits whatever the number: each row is one thread's); on one
    thread with ``parallel=False`` (a forked child: :mod:`masked_rl.functional`)."""
    rows = value.size // horizon
    scalar = value.dtype.type
    args = (value, next_value, reward, done, terminated, trainable, horizon, scalar(gamma),
            scalar(gamma_lmbda), masked_targets, advantage, target, has_target)
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS, rows)
    if parallel and threads > 1 and value.size >= _PARALLEL_MIN_STEPS:
        if _LAUNCH.acquire(blocking=False):
            try:  # one chunk of rows a thread (numba's other threads, if any, stay idle)
                _masked_gae_chunks(np.arange(threads + 1) * rows // threads, *args)
                return
            finally:
                _LAUNCH.release()
    masked_gae_rows(np.array([0, rows], dtype=np.int64), *args)


@_compiled(parallel=True)
def _masked_gae_chunks(bounds, value, next_value, reward, done, terminated, trainable, horizon,
                       gamma, gamma_lmbda, masked_targets, advantage, target, has_target):
    """:func:`masked_gae_rows` on the rows ``bounds[i]`` to ``bounds[i + 1] - 1``, one chunk a
    thread."""
    for chunk in numba.prange(bounds.size - 1):
        masked_gae_rows(bounds[chunk : chunk + 2], value, next_value, reward, done, terminated,
                        trainable, horizon, gamma, gamma_lmbda, masked_targets, advantage,
                        target, has_target)


@_compiled(boundscheck=False)
def masked_gae_rows(rows, value, next_value, reward, done, terminated, trainable, horizon, gamma,
                    gamma_lmbda, masked_targets, advantage, target, has_target):
    """Masked GAE of the rows ``rows[0]`` to ``rows[1] - 1`` of ``horizon`` steps each, stored one
    after the other (C order).

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
    for row in range(rows[0], rows[1]):
        first, last = row * horizon, row * horizon + horizon - 1
        end_value = zero
        pending = zero
        next_step = -1  # the next action of the episode (-1: none after this step)
        next_action_value = zero
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
                    bootstrap = next_value[t] if next_step == t + 1 else next_action_value
                    delta = folded + gamma * bootstrap - value[t]
                    # No carry at all when gamma * lmbda is 0: 0 * inf would be NaN.
                    adv = delta + gamma_lmbda * next_advantage if gamma_lmbda > zero else delta
                advantage[t] = adv
                target[t] = adv + value[t]
                pending = zero
                next_step = t
                next_action_value = value[t]
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

