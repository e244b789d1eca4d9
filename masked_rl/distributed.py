"""Masked GAE under context parallelism, on ``torch.distributed``.

Under context parallelism (Megatron CP, ring attention) each rank of a CP group holds a slice
of every row. :func:`cp_masked_generalized_advantage_estimate` returns, on every rank, that
rank's slice of what :func:`~masked_rl.masked_generalized_advantage_estimate` returns on the
gathered rows, with one ``all_gather`` of a few numbers per row and chunk (never the rows; a
second one beyond 64 rows x chunks), and raises the same error on every rank where the ranks'
calls disagree.

A row is cut into ``P`` chunks in row order (``P = cp`` for ``layout="contiguous"``, ``2 * cp``
for ``"zigzag"``); rank ``r`` holds chunk ``r``, or chunks ``r`` and ``2 * cp - 1 - r``.
Algorithm, per rank:

1. Run the single-process function on the local slice, every chunk closed at its last step
   with a zero bootstrap (a *zero boundary*). Everything left of a chunk's last open episode
   piece is then exact; what comes from the right is missing.
2. Summarise each chunk per row in ten numbers: the rewards before its first *event* (its first
   trainable step or episode end: they belong to a trainable step to its left), the event's
   kind and value (``V`` of that step, or the bootstrap of that end), the advantage of its first
   trainable step under the zero boundary (``a``) and how it depends on the right (the reverse
   scan ``x_j = delta_j + c * x_{j+1}`` is linear, so ``A = a + b * Z`` with ``b = c**(n - 1)``),
   and flags for adjacency and for "this episode has a trainable step so far".
3. ``all_gather`` the summaries with a fixed-size header of what the ranks must agree on
   (beyond 64 rows x chunks the header first, then the summaries), check the headers, then
   fold the summaries from the last chunk to the first (and the flags from the first to the
   last): every chunk learns what follows its last
   open step, the reward owed from the right ``R``, the next event's value and advantage, so
   ``Z = R + gamma * NV + gamma * lmbda * A_next``, the term missing from its last ``delta``.
4. Add ``c**m * Z`` to the ``m``-th trainable step from the end of each chunk's open last
   segment (and, with ``masked_value_targets``, fix the masked steps whose target needs the
   right or left side).

Only trainable ``V``, the bootstrap ``V'`` of episode ends and rewards cross ranks, each chosen
with ``where``: NaN or inf stored at a masked step never reaches another rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from masked_rl._checks import _LOW_PRECISION, _check_gae_inputs
from masked_rl._vectorized import _flat_nonzero
from masked_rl.functional import masked_generalized_advantage_estimate
from masked_rl.statistics import _all_gather_single, masked_moments

__all__ = [
    "masked_moments",
    "cp_all_gather",
    "cp_chunk_lengths",
    "cp_masked_generalized_advantage_estimate",
    "cp_response_chunk_lengths",
    "cp_shard",
    "cp_unshard",
]

LAYOUTS = ("contiguous", "zigzag")

# Fields of a chunk's summary, one number each per row.
_KIND, _HEAD, _VALUE, _AT_START, _A, _B, _TAIL_TRAIN, _TAIL_NEXT, _HAS_DONE, _LAST_TRAIN = range(10)
_FIELDS = 10
_NONE, _TRAIN, _END = 0, 1, 2  # a chunk's first event: nothing, a trainable step, an episode end

def _check_layout(layout: str, cp: int) -> int:
    """The number of chunks per row, or a ``ValueError``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp (the context-parallel size) must be a positive int, got {cp!r}")
    return cp if layout == "contiguous" else 2 * cp


def _rank_chunks(rank: int, cp: int, layout: str) -> tuple[int, ...]:
    """Indices (in row order) of the chunks rank ``rank`` holds, in the order it holds them."""
    return (rank,) if layout == "contiguous" else (rank, 2 * cp - 1 - rank)


def cp_chunk_lengths(horizon: int, cp: int, layout: str = "contiguous") -> list[int]:
    """The default cut of a row of ``horizon`` steps into context-parallel chunks, in row order.

    ``cp`` chunks for ``layout="contiguous"``, ``2 * cp`` for ``"zigzag"``, as even as possible:
    the first ``horizon % P`` chunks are one step longer (``horizon < P`` leaves empty chunks).
    When ``P`` divides ``horizon`` this is the usual even split, which the estimator assumes
    when it is given no ``chunk_lengths``; otherwise pass this list (or any other) to it, and to
    :func:`cp_shard` / :func:`cp_unshard`.

    Examples:
        >>> from masked_rl.distributed import cp_chunk_lengths
        >>> cp_chunk_lengths(10, 2, "zigzag")   # rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
        [3, 3, 2, 2]
    """
    chunks = _check_layout(layout, cp)
    if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 0:
        raise ValueError(f"horizon must be a non-negative int, got {horizon!r}")
    base, extra = divmod(horizon, chunks)
    return [base + (k < extra) for k in range(chunks)]


def cp_response_chunk_lengths(
    prompt_length: int,
    response_length: int,
    cp: int,
    layout: str = "zigzag",
    *,
    sequence_length: int | None = None,
) -> list[int]:
    """A response's steps per chunk when CP shards the whole prompt + response sequence.

    Megatron-style context parallelism shards token *positions*: the sequence of
    ``sequence_length`` positions (prompt, response, any padding after it) is cut into
    ``P = 2 * cp`` (``"zigzag"``) or ``cp`` (``"contiguous"``) chunks of
    ``ceil(sequence_length / P)`` positions (the last ones shorter or empty), and rank ``r``
    holds chunks ``r`` and ``2 * cp - 1 - r`` (or chunk ``r``), in that order. Step ``t`` of the
    response emits response token ``t``, at position ``prompt_length + t``; its log-prob and its
    value come from the logits at the position before (SPEC, language-model transcripts:
    ``V[t] = critic(tokens)[t - 1]``), so the rank holding position ``prompt_length + t - 1``
    computes step ``t``: the response's ``response_length`` steps sit at positions
    ``prompt_length - 1 ... prompt_length + response_length - 2``. This returns how many of
    them fall in each chunk, in row order: pass it as ``chunk_lengths`` to
    :func:`cp_masked_generalized_advantage_estimate` (with each rank's response steps, in the
    order it holds its positions) and to :func:`cp_shard` / :func:`cp_unshard` of response rows.

    One list serves every row of a call, so rows sharing it must share ``prompt_length`` (left-pad
    prompts to a common length, or call once per group of equal prompt lengths).

    Args:
        prompt_length (int): tokens before the response (``>= 1``: the first response token is
            scored by the logits at the prompt's last position).
        response_length (int): response tokens (steps), ``>= 0``.
        cp (int): the CP group's size.
        layout (str): ``"zigzag"`` (default) or ``"contiguous"``.

    Keyword Args:
        sequence_length (int, optional): positions sharded, padding included; defaults to
            ``prompt_length + response_length``.

    Examples:
        >>> from masked_rl.distributed import cp_response_chunk_lengths
        >>> # 5 prompt + 6 response tokens, 2 ranks zigzag: 4 chunks of 3 positions, the
        >>> # response's steps at positions 4 ... 9
        >>> cp_response_chunk_lengths(5, 6, 2)
        [0, 2, 3, 1]
    """
    chunks = _check_layout(layout, cp)
    for name, number, low in (("prompt_length", prompt_length, 1),
                              ("response_length", response_length, 0)):
        if isinstance(number, bool) or not isinstance(number, int) or number < low:
            raise ValueError(f"{name} must be an int >= {low}, got {number!r}")
    total = prompt_length + response_length
    if sequence_length is None:
        sequence_length = total
    if isinstance(sequence_length, bool) or not isinstance(sequence_length, int) or sequence_length < total:
        raise ValueError(
            f"sequence_length must be an int >= prompt_length + response_length = {total}, "
            f"got {sequence_length!r}"
        )
    size = -(-sequence_length // chunks)
    first, stop = prompt_length - 1, prompt_length - 1 + response_length
    return [max(0, min(stop, (k + 1) * size) - max(first, k * size)) for k in range(chunks)]


def _check_chunk_lengths(chunk_lengths: Sequence[int], cp: int, layout: str) -> list[int]:
    chunks = _check_layout(layout, cp)
    lengths = list(chunk_lengths)
    if len(lengths) != chunks or any(
        isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in lengths
    ):
        raise ValueError(
            f"chunk_lengths must hold {chunks} non-negative ints (one per chunk in row order, "
            f"layout={layout!r}, cp={cp}), got {lengths}"
        )
    return lengths


def _time_index(x, time_dim: int, start: int, stop: int):
    """``x[..., start:stop, ...]`` along ``time_dim`` (a Tensor or a TensorDict)."""
    dim = time_dim % x.ndim
    return x[(slice(None),) * dim + (slice(start, stop),)]


def cp_shard(
    x,
    rank: int,
    cp: int,
    *,
    layout: str = "contiguous",
    time_dim: int = -2,
    chunk_lengths: Sequence[int] | None = None,
):
    """The slice of full rows that context-parallel rank ``rank`` holds.

    Args:
        x (Tensor or TensorDict): full rows, time at ``time_dim`` (a TensorDict's ``time_dim``
            counts its batch dims: ``-1`` or ``1`` for a ``[B, T]`` rollout).
        rank (int): the rank's index in the CP group, ``0 <= rank < cp``.
        cp (int): the CP group's size.

    Keyword Args:
        layout (str): ``"contiguous"`` (rank ``r`` holds chunk ``r`` of ``cp``) or ``"zigzag"``
            (rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` of ``2 * cp``, concatenated in
            that order: Megatron's load-balanced layout for causal attention).
        time_dim (int): the time dim of ``x``. Defaults to ``-2`` (``[*B, T, F]`` tensors).
        chunk_lengths (list of int, optional): chunk lengths in row order; defaults to
            :func:`cp_chunk_lengths` of ``x``'s horizon.

    Returns:
        ``x`` restricted to the rank's steps, in the order the rank holds them.

    Examples:
        >>> import torch
        >>> from masked_rl.distributed import cp_shard
        >>> row = torch.arange(8).view(1, 8, 1)
        >>> cp_shard(row, 0, 2, layout="zigzag").view(-1).tolist()
        [0, 1, 6, 7]
    """
    horizon = x.shape[time_dim]
    if chunk_lengths is None:
        chunk_lengths = cp_chunk_lengths(horizon, cp, layout)
    lengths = _check_chunk_lengths(chunk_lengths, cp, layout)
    if sum(lengths) != horizon:
        raise ValueError(
            f"chunk_lengths {lengths} must sum to the horizon {horizon} (dim {time_dim} of x)"
        )
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < cp:
        raise ValueError(f"rank must be an int in [0, {cp}), got {rank!r}")
    starts = [sum(lengths[:k]) for k in range(len(lengths))]
    pieces = [_time_index(x, time_dim, starts[k], starts[k] + lengths[k])
              for k in _rank_chunks(rank, cp, layout)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=time_dim)


def cp_unshard(
    slices: Sequence,
    *,
    layout: str = "contiguous",
    time_dim: int = -2,
    chunk_lengths: Sequence[int] | None = None,
):
    """Full rows from every rank's slice (the inverse of :func:`cp_shard`; no communication).

    Args:
        slices (list of Tensor or TensorDict): the slice of every rank, in rank order.

    Keyword Args:
        layout, time_dim: as in :func:`cp_shard`.
        chunk_lengths (list of int, optional): chunk lengths in row order. Defaults to each
            slice's length (``"contiguous"``) or :func:`cp_chunk_lengths` of the total
            (``"zigzag"``, whose slices do not say where their two chunks meet).

    Examples:
        >>> import torch
        >>> from masked_rl.distributed import cp_shard, cp_unshard
        >>> rows = torch.randn(3, 11, 1)
        >>> parts = [cp_shard(rows, r, 2, layout="zigzag") for r in range(2)]
        >>> torch.equal(cp_unshard(parts, layout="zigzag"), rows)
        True
    """
    cp = len(slices)
    _check_layout(layout, cp)
    local = [s.shape[time_dim] for s in slices]
    if chunk_lengths is None:
        chunk_lengths = local if layout == "contiguous" else cp_chunk_lengths(sum(local), cp, layout)
    lengths = _check_chunk_lengths(chunk_lengths, cp, layout)
    pieces: list = [None] * len(lengths)
    for rank, part in enumerate(slices):
        offset = 0
        held = _rank_chunks(rank, cp, layout)
        if local[rank] != sum(lengths[k] for k in held):
            raise ValueError(
                f"slices[{rank}] has {local[rank]} steps, but chunk_lengths {lengths} give rank "
                f"{rank} chunks {list(held)} of {sum(lengths[k] for k in held)} steps"
            )
        for k in held:
            pieces[k] = _time_index(part, time_dim, offset, offset + lengths[k])
            offset += lengths[k]
    return torch.cat(pieces, dim=time_dim)


def _group_rank(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "context parallelism needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group)"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise RuntimeError("this process is not a member of the process group passed as group")
    return rank, dist.get_world_size(group)


def cp_all_gather(
    local: Tensor,
    group=None,
    *,
    layout: str = "contiguous",
    time_dim: int = -2,
    chunk_lengths: Sequence[int] | None = None,
) -> Tensor:
    """Full rows on every rank from each rank's slice (one or two ``all_gather`` calls).

    For inspection, tests and examples: it moves whole rows (``O(T)`` per rank), which
    :func:`cp_masked_generalized_advantage_estimate` never does. Every rank passes its slice of the
    same ``[*B, T, *F]`` rows; ``group`` defaults to the world. Without ``chunk_lengths`` the
    slice lengths are gathered first (a second, tiny collective) and the chunks are those of
    :func:`cp_chunk_lengths`, as :func:`cp_shard` cuts them by default.

    Examples:
        >>> import torch, torch.distributed as dist
        >>> from masked_rl.distributed import cp_all_gather, cp_shard
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> rows = torch.randn(2, 5, 1)                      # under torchrun: every rank's rows
        >>> local = cp_shard(rows, dist.get_rank(), dist.get_world_size(), layout="zigzag")
        >>> torch.equal(cp_all_gather(local, layout="zigzag"), rows)
        True
        >>> dist.destroy_process_group()
    """
    rank, cp = _group_rank(group)
    _check_layout(layout, cp)
    if chunk_lengths is None:
        sizes = torch.zeros(cp, dtype=torch.int64, device=local.device)
        _all_gather_single(sizes, torch.tensor([local.shape[time_dim]], device=local.device), group=group)
        chunk_lengths = cp_chunk_lengths(int(sizes.sum()), cp, layout)
    lengths = _check_chunk_lengths(chunk_lengths, cp, layout)
    held = [sum(lengths[k] for k in _rank_chunks(q, cp, layout)) for q in range(cp)]
    if local.shape[time_dim] != held[rank]:
        raise ValueError(
            f"rank {rank} holds {local.shape[time_dim]} steps, chunk_lengths {lengths} give it {held[rank]}"
        )
    # all_gather needs one size on every rank: pad each slice to the longest.
    moved = local.movedim(time_dim, 0)
    padded = moved.new_zeros((max(held), *moved.shape[1:]))
    padded[: held[rank]] = moved
    out = padded.new_empty((cp * padded.shape[0], *padded.shape[1:]))
    _all_gather_single(out, padded.contiguous(), group=group)
    out = out.view(cp, *padded.shape)
    slices = [out[q, : held[q]].movedim(0, time_dim) for q in range(cp)]
    return cp_unshard(slices, layout=layout, time_dim=time_dim, chunk_lengths=lengths)


def _holder(chunk: int, cp: int, layout: str) -> int:
    """The rank holding chunk ``chunk`` (``-1`` for no chunk)."""
    if chunk < 0:
        return -1
    return chunk if layout == "contiguous" or chunk < cp else 2 * cp - 1 - chunk


def _local_offset(chunk: int, held: Sequence[int], lengths: Sequence[int]) -> int:
    """Where held chunk ``chunk`` starts in its rank's slice."""
    return sum(lengths[j] for j in held[: list(held).index(chunk)])


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SHAPE_SLOTS = 6  # non-time dims sent one by one; the product of any further ones in the last
_HEADER = 20  # float64 numbers per rank
# Summaries of up to 64 rows x chunks (10 numbers each) travel with the header: one collective.
_INLINE = 64 * _FIELDS
# Header slots read by name (the agreed ones are listed in _AGREED below).
_STATUS, _TRUNCATED, _HELD, _PAYLOAD_SIZE = 0, 15, slice(16, 18), 18


class _Header(tuple):
    """What every rank of a CP call must agree on, as ``_HEADER`` float64 numbers."""

    def __new__(cls, shape, time_dim, dtype, layout, gamma, lmbda, masked_value_targets,
                next_from_row, truncated_inside, held_lengths):
        other = [n for i, n in enumerate(shape) if i != time_dim]
        dims = other[: _SHAPE_SLOTS - 1] + ([math.prod(other[_SHAPE_SLOTS - 1:])]
                                            if len(other) >= _SHAPE_SLOTS else [])
        dims += [-1] * (_SHAPE_SLOTS - len(dims))
        code = _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)
        held = list(held_lengths) + [-1] * (2 - len(held_lengths))
        numbers = [0, len(shape), time_dim, *dims, code, LAYOUTS.index(layout), gamma, lmbda,
                   masked_value_targets, next_from_row, truncated_inside, *held]
        return super().__new__(cls, [float(x) for x in numbers] + [0.0] * (_HEADER - len(numbers)))


# (name, slice of the header, how to show one rank's numbers) for the agreement check.
_DIMS = slice(3, 3 + _SHAPE_SLOTS)
_AGREED = (
    ("the number of dims of state_value", slice(1, 2), lambda x: int(x[0])),
    ("time_dim (non-negative)", slice(2, 3), lambda x: int(x[0])),
    ("the shape of state_value without its time dim ([*B, F] rows: B = 0 too)", _DIMS,
     lambda x: [int(n) for n in x if n >= 0]),
    ("the dtype of state_value", slice(9, 10),
     lambda x: str(_DTYPES[int(x[0])]) if x[0] < len(_DTYPES) else "not floating point 16/32/64"),
    ("layout", slice(10, 11), lambda x: LAYOUTS[int(x[0])]),
    ("gamma", slice(11, 12), lambda x: x[0]),
    ("lmbda", slice(12, 13), lambda x: x[0]),
    ("masked_value_targets", slice(13, 14), lambda x: bool(x[0])),
    ("next_state_value is None", slice(14, 15), lambda x: bool(x[0])),
)


def _exchange(header, payload: Tensor | None, cp: int, group, error: Exception | None, device,
              *, expected_lengths: Sequence[int] | None = None, rank: int = 0) -> Tensor | None:
    """The call's collective(s): every rank's header (``None``: this rank rejected its inputs)
    and summaries. Raises the same ``ValueError`` on every rank where the headers disagree (the
    rejecting rank re-raises its own error, in the caller); returns the ``[cp, numel]``
    summaries, in ``payload``'s dtype, or ``None`` without a payload.

    A payload of up to ``_INLINE`` numbers travels with the header, in one all_gather whose
    size is the same on every rank whatever they pass; a larger one follows in a second
    all_gather, once the headers say that every rank sends as many numbers.
    """
    numbers = [1.0] + [0.0] * (_HEADER - 1) if header is None else list(header)
    inline = payload is not None and payload.numel() <= _INLINE
    numbers[_PAYLOAD_SIZE] = 0.0 if payload is None else float(payload.numel())
    if dist.get_backend(group) == "nccl" and (device is None or device.type != "cuda"):
        device = torch.device("cuda", torch.cuda.current_device())  # NCCL sends CUDA tensors only
    sent = torch.zeros(_HEADER + _INLINE, dtype=torch.float64, device=device)
    sent[:_HEADER] = torch.tensor(numbers, dtype=torch.float64)
    if inline:
        sent[_HEADER:_HEADER + payload.numel()] = payload  # float32 -> float64 is exact
    gathered = sent.new_empty(cp * sent.numel())
    _all_gather_single(gathered, sent, group=group)
    gathered = gathered.view(cp, sent.numel())
    headers = gathered[:, :_HEADER].tolist()
    rejected = [q for q in range(cp) if headers[q][_STATUS] != 0]
    if error is not None:
        return None
    if rejected:
        raise ValueError(
            f"rank(s) {rejected} of the CP group rejected their inputs (their own error says "
            f"why); every rank raises, so that none waits in a collective"
        )
    for name, where, show in _AGREED:
        values = [show(h[where]) for h in headers]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {q} {v!r}" for q, v in enumerate(values))
            raise ValueError(
                f"the ranks of the CP group disagree on {name}: {per_rank}; every rank must pass "
                f"its slice of the same rows with the same options"
            )
    seen = [[int(n) for n in h[_HELD] if n >= 0] for h in headers]
    layout = LAYOUTS[int(headers[0][10])]
    expected = [[expected_lengths[j] for j in _rank_chunks(q, cp, layout)] for q in range(cp)]
    if seen != expected:
        raise ValueError(
            f"the ranks disagree on the chunk lengths: rank {rank} expects per-rank chunk lengths "
            f"{expected}, the ranks hold {seen}; pass the same chunk_lengths on every rank"
        )
    truncated = [q for q in range(cp) if headers[q][_TRUNCATED]]
    if truncated:
        raise ValueError(
            f"next_state_value=None reads V'[t] = V[t + 1], the next episode's value at an "
            f"episode end inside the row, but rank(s) {truncated} hold truncated ends (done and "
            f"not terminated) before the row's last step: pass next_state_value"
        )
    if payload is None:
        return None
    if inline:
        return gathered[:, _HEADER:_HEADER + payload.numel()].to(payload.dtype)
    out = payload.new_empty(cp * payload.numel())
    _all_gather_single(out, payload, group=group)
    return out.view(cp, payload.numel())


def _reverse_cumsum(x: Tensor) -> Tensor:
    return x.flip(-1).cumsum(-1).flip(-1)


def cp_masked_generalized_advantage_estimate(
    gamma: float | Tensor,
    lmbda: float | Tensor,
    state_value: Tensor,
    next_state_value: Tensor | None,
    reward: Tensor,
    done: Tensor,
    terminated: Tensor,
    loss_mask: Tensor,
    *,
    time_dim: int = -2,
    masked_value_targets: bool = False,
    group=None,
    layout: str = "contiguous",
    chunk_lengths: Sequence[int] | None = None,
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """:func:`~masked_rl.masked_generalized_advantage_estimate` on rows split over a CP group.

    Every rank of ``group`` calls it with its slice of the same rows (:func:`cp_shard` cuts
    them) and gets its slice of what the single-process function returns on the full rows:
    every rule of ``docs/semantics.md`` holds across ranks (masked rewards credited to a trainable step
    any number of ranks to the left, carries and bootstraps from the right, episode ends at or
    next to a slice border, slices and rows without trainable steps, NaN or inf at a masked step
    staying on its rank).

    Args:
        gamma, lmbda, state_value, next_state_value, reward, done, terminated, loss_mask: as in
            :func:`~masked_rl.masked_generalized_advantage_estimate`, each the rank's slice
            ``[*B, T_local, F]`` (``loss_mask``: ``[*B, T_local]`` or ``[*B, T_local, 1]``).
            ``*B``, ``F``, dtypes, ``gamma`` and ``lmbda`` must be the same on every rank.
            ``next_state_value=None`` (a token critic, whose ``V'[t]`` is the next token's
            ``V``; see SPEC's language-model transcripts) means ``V'[t] = V[t + 1]`` in the
            row, across slice borders: a border's ``V`` comes from the rank holding the next
            chunk, inside the same collective, at no extra bytes. After the row's last step it
            is 0: a row truncated at its last token (whose bootstrap, the critic's output at
            that token, is not in ``state_value``) needs ``next_state_value``; so does a
            truncated episode end (``done`` and not ``terminated``) before the row's last
            step, where ``V[t + 1]`` would be the next episode's value (every rank raises).
            Terminated ends do not read ``V'``.

    Keyword Args:
        time_dim (int): as in the single-process function. Defaults to ``-2``.
        masked_value_targets (bool): as in the single-process function (a third output).
        group (ProcessGroup, optional): the CP group; ``None`` is the default (world) group.
            Its rank ``r`` holds chunk(s) ``r`` of ``layout``.
        layout (str): ``"contiguous"`` (rank ``r`` holds chunk ``r`` of ``cp``) or ``"zigzag"``
            (chunks ``r`` and ``2 * cp - 1 - r`` of ``2 * cp``, concatenated in that order).
        chunk_lengths (list of int, optional): the length of every chunk in row order (``cp`` or
            ``2 * cp`` ints, the same list on every rank; empty chunks allowed). ``None`` means
            the even split: every rank holds ``T_local`` steps, halved for ``"zigzag"`` (which
            then needs an even ``T_local``). For uneven rows pass
            ``cp_chunk_lengths(T, cp, layout)``, the cut :func:`cp_shard` makes by default.

    Returns:
        ``(advantage, value_target)`` (plus ``value_target_mask`` with ``masked_value_targets``),
        the rank's slice, shapes and dtypes as in the single-process function.

    Communication: one ``all_gather`` per call of ``20 + 640`` float64 numbers per rank
    (5,280 bytes), whatever ``*B`` and ``T``, when ``10 * N * n_chunks <= 640`` (``N =
    prod(*B) * F`` rows, ``n_chunks`` 1 for contiguous, 2 for zigzag: up to 32 rows zigzag, 64
    contiguous); beyond, the 20-number header and then, in a second ``all_gather``, the
    ``10 * N * n_chunks`` summary numbers in the compute dtype (float32 for float16, bfloat16
    and float32 inputs, else float64). The header holds what the ranks must agree on (the shape
    without the time dim, ``time_dim``, dtype, ``layout``, ``gamma``, ``lmbda``,
    ``masked_value_targets``, ``next_state_value is None``, each rank's chunk lengths, whether
    it rejected its inputs). Its size never depends on them, so ranks that disagree (``B = 0``
    on one rank included) all raise the same ``ValueError`` naming what differs and the value
    of every rank, instead of aborting in the backend or waiting for each other; a rank whose
    inputs fail a check raises its own error, its peers one saying which rank did. Host
    synchronisations: those of the single-process function on the local slice, plus one to
    read the headers. Not differentiable (the collective has no backward): call it without
    gradients or with detached inputs. The same code runs on gloo (CPU tensors) and NCCL (CUDA
    tensors, each rank on its device).

    Examples:
        One process here; ``torchrun --nproc-per-node 2 examples/context_parallel.py`` runs two.

        >>> import torch, torch.distributed as dist
        >>> from masked_rl import masked_generalized_advantage_estimate
        >>> from masked_rl.distributed import cp_masked_generalized_advantage_estimate, cp_shard
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> rank, cp = dist.get_rank(), dist.get_world_size()
        >>> mask = torch.tensor([[1, 1, 0, 0, 1, 0]])             # [B, T], the full rows
        >>> reward = torch.zeros(1, 6, 1); reward[0, 4] = 1.0      # [B, T, 1]
        >>> value = torch.zeros(1, 6, 1)
        >>> done = torch.zeros(1, 6, 1, dtype=torch.bool); done[0, -1] = True
        >>> full = (value, value, reward, done, done, mask)
        >>> local = [cp_shard(x, rank, cp, layout="zigzag", time_dim=1) for x in full]
        >>> adv, target = cp_masked_generalized_advantage_estimate(
        ...     0.9, 0.8, *local, layout="zigzag")                # this rank's slice
        >>> adv.squeeze(-1)
        tensor([[0.5184, 0.7200, 0.0000, 0.0000, 1.0000, 0.0000]])
        >>> torch.equal(adv, masked_generalized_advantage_estimate(0.9, 0.8, *full)[0])
        True
        >>> dist.destroy_process_group()
    """
    rank, cp = _group_rank(group)  # before the collective: without a group there is none
    next_from_row = next_state_value is None
    # Every rank joins the header all_gather, also with inputs it rejects (it raises after it):
    # raising before would leave its peers waiting in the collective.
    try:
        if next_from_row and isinstance(state_value, Tensor):
            next_state_value = state_value  # for the shape checks only
        time_dim, mask, gamma_f, lmbda_f, done, terminated = _check_gae_inputs(
            gamma, lmbda, state_value, next_state_value, reward, done, terminated, loss_mask,
            time_dim)
        if torch.is_grad_enabled() and any(
            isinstance(x, Tensor) and x.requires_grad
            for x in (gamma, lmbda, state_value, next_state_value, reward)
        ):
            raise RuntimeError(
                "cp_masked_generalized_advantage_estimate is not differentiable (its all_gather "
                "has no backward): call it under torch.no_grad() or pass detached tensors"
            )
        chunks = _check_layout(layout, cp)
        local_horizon = state_value.shape[time_dim]
        if chunk_lengths is None:
            if layout == "zigzag" and local_horizon % 2:
                raise ValueError(
                    f"layout='zigzag' without chunk_lengths needs an even local length (two equal "
                    f"chunks), got {local_horizon}: pass chunk_lengths=cp_chunk_lengths(T, cp, "
                    f"'zigzag')"
                )
            chunk_lengths = [local_horizon // (chunks // cp)] * chunks
        lengths = _check_chunk_lengths(chunk_lengths, cp, layout)
        held = _rank_chunks(rank, cp, layout)
        if sum(lengths[k] for k in held) != local_horizon:
            raise ValueError(
                f"rank {rank} holds {local_horizon} steps (dim {time_dim} of state_value), but "
                f"chunk_lengths {lengths} give it chunks {list(held)} of "
                f"{sum(lengths[k] for k in held)} steps"
            )
        last_chunk = max((k for k, n in enumerate(lengths) if n > 0), default=-1)
        truncated_inside = False
        if next_from_row:
            # V'[t] = V[t + 1] is the next episode's value at an episode end inside the row.
            truncated = done & ~terminated
            if rank == _holder(last_chunk, cp, layout):
                row_end = _local_offset(last_chunk, held, lengths) + lengths[last_chunk] - 1
                truncated = truncated.clone()
                _time_index(truncated, time_dim, row_end, row_end + 1).fill_(False)
            truncated_inside = bool(truncated.any())
        header = _Header(state_value.shape, time_dim, state_value.dtype, layout, gamma_f, lmbda_f,
                         masked_value_targets, next_from_row, truncated_inside,
                         [lengths[k] for k in held])

        rows = state_value.movedim(time_dim, -1).shape[:-1].numel()
        local = None if rows == 0 else _LocalPass(
            gamma, lmbda, gamma_f * lmbda_f, state_value, None if next_from_row else next_state_value,
            reward, mask, done, terminated, time_dim=time_dim, lengths=lengths, held=held,
            last_chunk=last_chunk, masked_value_targets=masked_value_targets)
    except Exception as error:  # noqa: BLE001 - re-raised once the peers know
        _exchange(None, None, cp, group, error,
                  state_value.device if isinstance(state_value, Tensor) else None)
        raise
    gathered = _exchange(header, None if local is None else local.payload, cp, group, None,
                         state_value.device, expected_lengths=lengths, rank=rank)
    if local is None:  # B = 0 on every rank (checked): only the header was exchanged
        return masked_generalized_advantage_estimate(
            gamma, lmbda, state_value,
            torch.zeros_like(state_value) if next_from_row else next_state_value,
            reward, done, terminated, mask, time_dim=time_dim,
            masked_value_targets=masked_value_targets,
        )
    summaries = gathered.new_zeros((chunks, rows, _FIELDS))
    by_rank = gathered.view(cp, len(held), rows, _FIELDS)
    for q in range(cp):
        for i, chunk in enumerate(_rank_chunks(q, cp, layout)):
            summaries[chunk] = by_rank[q, i]
    right, has_left = _fold(summaries, lengths, gamma_f, gamma_f * lmbda_f, next_from_row)
    return local.finish(right, has_left, gamma_f)


class _LocalPass:
    """Steps 1 and 2 on the rank's slice (its zero-boundary outputs and the summaries of its
    chunks, ``payload``), then step 4 (:meth:`finish`) once the fold has run."""

    def __init__(self, gamma, lmbda, gamma_lmbda: float, state_value: Tensor,
                 next_state_value: Tensor | None, reward: Tensor, mask: Tensor, done: Tensor,
                 terminated: Tensor, *, time_dim: int, lengths: list[int], held: Sequence[int],
                 last_chunk: int, masked_value_targets: bool):
        self.out_dtype = out_dtype = state_value.dtype
        dtype = torch.float32 if out_dtype in _LOW_PRECISION else out_dtype
        self.moved_shape = state_value.movedim(time_dim, -1).shape
        self.time_dim, self.gamma_lmbda, self.held, self.lengths = time_dim, gamma_lmbda, held, lengths
        rows, horizon = self.moved_shape[:-1].numel(), state_value.shape[time_dim]

        def as_rows(x: Tensor, to: torch.dtype) -> Tensor:
            # [*B, T, F] -> [N, T]: one row per stream, as the single-process function sees them.
            return x.movedim(time_dim, -1).reshape(rows, horizon).to(to)

        value, rew = as_rows(state_value, dtype), as_rows(reward, dtype)
        m, d, k = (as_rows(x, torch.bool) for x in (mask, done, terminated))
        self.offsets = offsets = [_local_offset(chunk, held, lengths) for chunk in held]
        if next_state_value is None:
            # V'[t] = V[t + 1] inside each chunk; at a chunk's last step V' is read only before
            # an adjacent action (its V then comes in that chunk's summary) or at the row end (0).
            next_value = torch.zeros_like(value)
            for chunk, start in zip(held, offsets):
                if lengths[chunk] > 1:
                    stop = start + lengths[chunk]
                    next_value[:, start:stop - 1] = value[:, start + 1:stop]
        else:
            next_value = as_rows(next_state_value, dtype)

        # 1. The local slice, every chunk closed at its last step with a zero bootstrap (the
        #    true bootstrap, rewards and carry from the right are added in step 4).
        local_done, local_term = d.clone(), k.clone()
        for chunk, start in zip(held, offsets):
            if lengths[chunk] > 0:
                end = start + lengths[chunk] - 1
                local_done[:, end] = True
                if chunk != last_chunk:
                    local_term[:, end] = k[:, end] | ~d[:, end]
        local = masked_generalized_advantage_estimate(
            gamma, lmbda, value.unsqueeze(-1), next_value.unsqueeze(-1), rew.unsqueeze(-1),
            local_done.unsqueeze(-1), local_term.unsqueeze(-1), m,
            masked_value_targets=masked_value_targets,
        )
        # Contiguous [N, T_local] (already so: no copy), for flat index_add_ in step 4.
        self.advantage = local[0].squeeze(-1).contiguous()
        self.target = local[1].squeeze(-1).contiguous()
        self.has_target = local[2].squeeze(-1) if masked_value_targets else None

        # 2. Summaries (3., their all_gather, is the caller's).
        self.views = []
        for chunk, start in zip(held, offsets):
            span = slice(start, start + lengths[chunk])
            chunk_done = d[:, span]
            if chunk == last_chunk:  # the row's last step ends its episode
                chunk_done = chunk_done.clone()
                chunk_done[:, -1] = True
            self.views.append(_Chunk(
                m[:, span], chunk_done, k[:, span], value[:, span], next_value[:, span],
                rew[:, span], open_end=chunk != last_chunk,
            ))
        self.payload = torch.stack([
            view.summary(self.advantage[:, offset:offset + view.length], gamma_lmbda)
            for view, offset in zip(self.views, offsets)
        ]).reshape(-1)

    def finish(self, right: Tensor, has_left: Tensor, gamma: float):
        """4. Boundary corrections of the local chunks; the outputs in the caller's layout."""
        for chunk, view, start in zip(self.held, self.views, self.offsets):
            if self.lengths[chunk] > 0:
                view.correct(right[chunk], has_left[chunk], gamma, self.gamma_lmbda,
                             self.advantage, self.target, self.has_target, start)

        def unrows(x: Tensor) -> Tensor:
            return x.reshape(self.moved_shape).movedim(-1, self.time_dim)

        result = (unrows(self.advantage).to(self.out_dtype), unrows(self.target).to(self.out_dtype))
        if self.has_target is not None:
            return (*result, unrows(self.has_target))
        return result


class _Chunk:
    """One local chunk, ``[N, L]`` views, with the sorted flat indices (``row * L + t``) of its
    actions and episode ends: per-row firsts, lasts and counts come from ``searchsorted`` on
    them instead of passes over every step."""

    def __init__(self, m, d, k, value, next_value, reward, *, open_end: bool):
        self.m, self.d, self.k = m, d, k
        self.value, self.next_value, self.reward = value, next_value, reward
        self.open_end = open_end  # False for the row's last chunk, which ends every row
        self.rows, self.length = rows, length = m.shape
        self.row_start = torch.arange(rows, device=m.device) * length

        def firsts_and_lasts(flags: Tensor):
            flat = _flat_nonzero(flags.reshape(-1))
            lo = torch.searchsorted(flat, self.row_start)
            hi = torch.searchsorted(flat, self.row_start + length)
            # Sentinels on both sides, so that empty rows index safely (and are masked below).
            padded = torch.cat((flat.new_full((1,), -1), flat, flat.new_full((1,), rows * length)))
            count = hi - lo
            first = torch.where(count > 0, padded[lo + 1] - self.row_start, length)
            last = torch.where(count > 0, padded[hi] - self.row_start, -1)
            return flat, lo, hi, first, last

        self.actions, _, self.actions_end, self.first_action, self.last_action = firsts_and_lasts(m)
        self.action_count = self.actions_end - _
        _, _, _, self.first_end, self.last_end = firsts_and_lasts(d)

    def summary(self, advantage: Tensor, gamma_lmbda: float) -> Tensor:
        """The ``[N, 10]`` summary of the chunk (fields ``_KIND`` ... ``_LAST_TRAIN``), from its
        zero-boundary advantage."""
        out = self.value.new_zeros((self.rows, _FIELDS))
        length = self.length
        if length == 0:
            return out  # transparent: kind _NONE, nothing owed
        # The first event: an action (also when it ends its episode), or an episode end.
        trainable = self.first_action <= self.first_end
        trainable &= self.first_action < length
        ended = ~trainable & (self.first_end < length)
        event = torch.where(trainable, self.first_action, self.first_end).clamp_max(length - 1)
        at = lambda x: x.gather(-1, event.unsqueeze(-1)).squeeze(-1)
        # Rewards before the first event, the end step's own reward included (its run ends there).
        stop = torch.where(trainable, self.first_action, torch.where(ended, self.first_end + 1, length))
        steps = torch.arange(length, device=stop.device)
        head = torch.where(steps < stop.unsqueeze(-1), self.reward, 0.0).sum(-1)
        end_value = torch.where(at(self.k), 0.0, at(self.next_value))
        has_done = self.last_end >= 0
        b = torch.pow(gamma_lmbda, (self.action_count - 1).clamp_min(0).to(out.dtype))
        tail_train = (self.last_action == length - 1) & (self.last_end < length - 1)
        out[:, _KIND] = torch.where(trainable, _TRAIN, torch.where(ended, _END, _NONE))
        out[:, _HEAD] = head
        out[:, _VALUE] = torch.where(trainable, at(self.value), torch.where(ended, end_value, 0.0))
        out[:, _AT_START] = trainable & (self.first_action == 0)
        out[:, _A] = torch.where(trainable, at(advantage), 0.0)
        out[:, _B] = torch.where(trainable & ~has_done & self.open_end, b, 0.0)
        out[:, _TAIL_TRAIN] = tail_train
        out[:, _TAIL_NEXT] = torch.where(tail_train, self.next_value[:, -1], 0.0)
        out[:, _HAS_DONE] = has_done
        out[:, _LAST_TRAIN] = self.last_action > self.last_end
        return out

    def correct(self, right: Tensor, has_left: Tensor, gamma: float, gamma_lmbda: float,
                advantage: Tensor, target: Tensor, has_target: Tensor | None, offset: int) -> None:
        """Step 4 in place on the rank's ``[N, T_local]`` outputs (this chunk starts at column
        ``offset``): the carry from the right, and masked targets across ranks."""
        owed, kind, value, _, next_adv, z = right.unbind(-1)
        span = slice(offset, offset + self.length)
        if self.open_end:
            # The actions of each row's last segment (after its last end; none if the chunk's
            # last step is an end), the m-th from the end receiving c**m * Z.
            row = torch.div(self.actions, self.length, rounding_mode="floor")
            col = self.actions - self.row_start[row]
            later = self.actions_end[row] - 1 - torch.arange(self.actions.numel(), device=row.device)
            coef = torch.where(col > self.last_end[row], torch.pow(gamma_lmbda, later.to(z.dtype)), 0.0)
            # Exactly nothing past an underflow (0 * inf is NaN).
            correction = torch.where(coef != 0, coef * z[row], 0.0)
            flat = row * advantage.shape[-1] + offset + col
            advantage.view(-1).index_add_(0, flat, correction)
            if has_target is None:
                target.view(-1).index_add_(0, flat, correction)
            else:
                self._correct_masked_targets(owed, kind, value, next_adv, z, has_left, gamma,
                                             gamma_lmbda, target[:, span], has_target[:, span])
        if has_target is not None:
            self._head_targets(has_left, gamma, target[:, span], has_target[:, span])

    def _correct_masked_targets(self, owed, kind, value, next_adv, z, has_left, gamma, gamma_lmbda,
                                target, has_target) -> None:
        """Targets of the last segment, masked steps included (``masked_value_targets``)."""
        # Actions at or after each step, in its row (the next one's coefficient is the step's):
        # an integer count, so one cumsum over all rows is exact.
        count = torch.int32 if self.rows * self.length < 2**31 else torch.int64
        m = self.m.to(count)
        before = torch.cumsum(m.reshape(-1), 0, dtype=count).view(self.rows, self.length)
        remaining = (self.actions_end.to(count).unsqueeze(-1) - before).add_(m)
        steps = torch.arange(self.length, device=z.device)
        in_last_segment = steps > self.last_end.unsqueeze(-1)
        coef = torch.where(
            in_last_segment & (remaining > 0),
            torch.pow(gamma_lmbda, (remaining - 1).clamp_min(0).to(z.dtype)), 0.0,
        )
        target.add_(torch.where(has_target & (coef != 0), coef * z.unsqueeze(-1), 0.0))
        # Masked steps after the segment's last action here: the rest of the run up to the next
        # event to the right, then G there (or that end's bootstrap).
        tail = in_last_segment & (remaining == 0)
        follow = torch.where(kind == _TRAIN, value + next_adv, value).unsqueeze(-1)
        if gamma > 0:
            to_end = _reverse_cumsum(torch.where(tail, self.reward, 0.0))
            tail_target = follow + (to_end + owed.unsqueeze(-1)) / gamma
        else:
            tail_target = follow.expand_as(target)
        exists = (self.last_action > self.last_end) | (kind == _TRAIN) | (has_left & (self.last_end < 0))
        exists = exists.unsqueeze(-1) & tail
        target.copy_(torch.where(tail, torch.where(exists, tail_target, 0.0), target))
        has_target.copy_(torch.where(tail, exists, has_target))

    def _head_targets(self, has_left, gamma, target, has_target) -> None:
        """An episode that started left of the chunk and ends in it before any action here: its
        steps up to that end have a target if the episode had an action on the left."""
        head = (self.first_end < self.first_action) & has_left
        steps = torch.arange(self.length, device=target.device)
        region = head.unsqueeze(-1) & (steps <= self.first_end.unsqueeze(-1))
        first_end = self.first_end.clamp_max(self.length - 1).unsqueeze(-1)
        terminated = self.k.gather(-1, first_end)
        bootstrap = torch.where(terminated, 0.0, self.next_value.gather(-1, first_end))
        if gamma > 0:
            head_target = bootstrap + _reverse_cumsum(torch.where(region, self.reward, 0.0)) / gamma
        else:
            head_target = bootstrap.expand_as(target)
        target.copy_(torch.where(region, head_target, target))
        has_target.copy_(has_target | region)


def _fold(summaries: Tensor, lengths: list[int], gamma: float, gamma_lmbda: float,
          next_from_row: bool = False):
    """What lies right of every chunk, and whether its first step's episode has an action so far.

    Returns ``right`` (``[P, N, 6]``: owed rewards ``R``, next event kind, its value, whether it
    is the first step after the chunk, its advantage, and ``Z`` of the chunk itself) and
    ``has_left`` (``[P, N]`` bool).
    """
    chunks, rows, _ = summaries.shape
    zero = summaries.new_zeros(rows)
    owed, kind, value, adjacent, next_adv = zero, zero + _END, zero, zero.bool(), zero
    right = summaries.new_zeros((chunks, rows, 6))
    for chunk in reversed(range(chunks)):
        s = summaries[chunk]
        next_is_train = kind == _TRAIN
        # The bootstrap of the chunk's last trainable step: V'[t] before an adjacent action (as
        # in the single-process function), else V of the next action, else the end's bootstrap.
        # With next_from_row, V'[t] before an adjacent action is that action's V: ``value``.
        use_own = next_is_train & adjacent & (s[:, _TAIL_TRAIN] != 0) & (not next_from_row)
        bootstrap = torch.where(use_own, s[:, _TAIL_NEXT], value)
        carry = torch.where(next_is_train, next_adv, 0.0)
        z = owed + gamma * bootstrap
        if gamma_lmbda > 0:
            z = z + gamma_lmbda * carry
        right[chunk] = torch.stack((owed, kind, value, adjacent.to(zero.dtype), next_adv, z), -1)
        if lengths[chunk] == 0:
            continue
        first_adv = s[:, _A] + torch.where(s[:, _B] != 0, s[:, _B] * z, 0.0)
        transparent = s[:, _KIND] == _NONE
        owed = torch.where(transparent, s[:, _HEAD] + owed, s[:, _HEAD])
        value = torch.where(transparent, value, s[:, _VALUE])
        adjacent = torch.where(transparent, False, s[:, _AT_START] != 0)
        next_adv = torch.where(transparent, next_adv, torch.where(s[:, _KIND] == _TRAIN, first_adv, 0.0))
        kind = torch.where(transparent, kind, s[:, _KIND])
    has_left = torch.zeros((chunks, rows), dtype=torch.bool, device=summaries.device)
    so_far = has_left[0]
    for chunk in range(chunks):
        has_left[chunk] = so_far
        s = summaries[chunk]
        so_far = (s[:, _LAST_TRAIN] != 0) | (so_far & (s[:, _HAS_DONE] == 0))
    return right, has_left
