"""Input checks of the masked estimator, and the one host synchronisation that reads them.

Every check raises an exception naming the argument, the expected and the received value. On
the CPU a check's verdict is read as it comes; on other devices the verdicts are device tensors
collected in a :class:`_Checks` and read once, together with the numbers the estimator needs
from the device (``gamma``, ``lmbda`` as tensors, the number of markers).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

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


