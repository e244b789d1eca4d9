"""Token-level PPO with a critic on TorchRL's LLM stack: transcripts as masked token streams.

TorchRL's LLM stack (``ChatEnv``, ``History``, ``TransformersWrapper``, ``GRPOLoss``) works on
sequence-level data: a TensorDict of batch ``[B]`` whose per-token entries are ``[B, T]``
tensors, left-padded by its wrappers (``("tokens", "full")``, ``("log_probs", "full")``,
``("masks", "all_assistant_mask")``, ``("masks", "all_attention_mask")``). It has no critic and
no per-token advantage. This module adds them, following SPEC.md, "Language-model transcripts":

- a transcript ``tokens[0..L-1]`` is one episode and its steps are its tokens: step ``t`` is
  "emit token ``t``" from the state ``tokens[:t]``, so ``log_prob[t]`` and the value ``V[t]``
  are read at position ``t - 1`` and ``V'[t] = V[t + 1]`` is read at position ``t``;
- the loss mask is the assistant mask (prompt, tool messages, chat-template tokens and padding
  are masked), optionally with each assistant turn's end-of-turn token as an action;
- a reward given after an assistant turn sits on that turn's closing end-of-turn token, a
  final reward on the transcript's last token, where ``done = 1`` and ``terminated`` says
  whether ``V'`` is bootstrapped (truncated) or not;
- padding, left or right, is masked, carries nothing and changes no output.

The pieces:

- :func:`transcript_steps`: sequence-level ``[B]`` data to the ``[B, T]`` step TensorDict
  :class:`~masked_rl.MaskedGAE` reads (plain tensors only: a ``[B, T]`` TensorDict cannot hold
  a ``ChatHistory``, so the sequence-level and the step-level data stay apart);
- :class:`TokenCritic` / :class:`TokenValueHead`: ``V`` and ``V'`` for every token in one
  causal forward, on a separate model or on the policy's own trunk;
- :func:`kl_penalty_reward`: KL-to-reference shaping as a per-token reward at trainable tokens;
- :func:`compute_token_advantages`: critic + adapter + ``MaskedGAE`` in one call, writing
  ``"advantage"`` and ``"value_target"`` back into the ``[B]`` data, ``[B, T, 1]`` and aligned
  with ``("tokens", "full")``;
- :class:`TokenPPOLoss`: the clipped policy term and the value loss per trainable token;
- :func:`token_log_probs`: the scoring pass the loss itself uses (TorchRL's
  ``("log_probs", "full")`` layout);
- :func:`check_chat_tokenizer`: the tokenizer requirements, as one clear error.

``import masked_rl`` does not import this module, and this module imports ``transformers``
nowhere: it only calls the models it is given.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey
from torch import Tensor, nn
from torchrl.objectives import LossModule
from torchrl.objectives.utils import distance_loss

from masked_rl.advantages import MaskedGAE
from masked_rl.functional import masked_standardize

__all__ = [
    "TokenCritic",
    "TokenPPOLoss",
    "TokenValueHead",
    "check_chat_tokenizer",
    "compute_token_advantages",
    "kl_penalty_reward",
    "token_log_probs",
    "transcript_steps",
]

MODES = ("history", "tokens")
REDUCTIONS = ("token_mean", "sequence_mean")
CRITIC_TOKENS = ("trainable", "targets", "every")
_GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")


# -- tokenizer -------------------------------------------------------------------------------

def check_chat_tokenizer(tokenizer, chat_template: str | None = None) -> None:
    """Raise a clear error if ``tokenizer`` cannot make the data this module reads.

    Two requirements, both of TorchRL's scoring pass:

    - a pad token distinct from the end-of-sequence token: TorchRL's wrappers pad with
      ``pad_token_id`` and stop generation at ``eos_token_id``; when they are the same id, padding
      and the end of a turn cannot be told apart;
    - a chat template with ``{% generation %}`` blocks: ``return_assistant_tokens_mask=True``
      (``("masks", "all_assistant_mask")``) comes from them; without them the mask is all zeros.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        chat_template (str, optional): the template to check instead of
            ``tokenizer.chat_template`` (e.g. TorchRL's named template the wrapper uses).

    Raises:
        ValueError: naming what is missing and what was found.

    Examples:
        >>> class Tok:  # the attributes this check reads
        ...     pad_token_id, eos_token_id = 0, 0
        ...     chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        >>> check_chat_tokenizer(Tok())
        Traceback (most recent call last):
        ...
        ValueError: tokenizer must have a pad token distinct from its eos token ...
        >>> Tok.pad_token_id = 1
        >>> check_chat_tokenizer(Tok())
        Traceback (most recent call last):
        ...
        ValueError: the chat template has no {% generation %} blocks...
    """
    pad, eos = getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)
    if pad is None or pad == eos:
        raise ValueError(
            "tokenizer must have a pad token distinct from its eos token (TorchRL pads with "
            f"pad_token_id and stops at eos_token_id), got pad_token_id={pad}, eos_token_id={eos}"
        )
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: every one must have the blocks
        template = " ".join(template.values())
    if not template or not _GENERATION_BLOCK.search(template):
        raise ValueError(
            "the chat template has no {% generation %} blocks, so return_assistant_tokens_mask "
            "(('masks', 'all_assistant_mask')) would mark no token; use a template that wraps "
            "assistant content in {% generation %}...{% endgeneration %} (TorchRL's "
            f"'chatml_format' does), got {'no template' if not template else repr(template[:80])}"
        )


# -- reading TorchRL's sequence-level data -----------------------------------------------------

def _per_token(data: TensorDictBase, key: NestedKey, hint: str = "") -> tuple[Tensor, bool]:
    """``data[key]`` as ``[B, T]`` (a trailing 1 dropped) and whether it was stored ragged."""
    if not isinstance(data, TensorDictBase) or data.batch_dims != 1:
        found = list(data.batch_size) if isinstance(data, TensorDictBase) else type(data).__name__
        raise ValueError(f"data must be a sequence-level TensorDict of batch [B], got {found}")
    value = data.get(key, None, as_list=True)
    if value is None:
        raise KeyError(
            f"data has no entry {key!r}{hint}; found {sorted(map(str, data.keys(True, True)))}"
        )
    if isinstance(value, Tensor):
        if value.dim() == 3 and value.shape[-1] == 1:
            value = value.squeeze(-1)
        if value.dim() != 2:
            raise ValueError(f"{key!r} must be [B, T] or [B, T, 1], got {list(value.shape)}")
        return value, False
    rows = [v.squeeze(-1) if v.dim() == 2 and v.shape[-1] == 1 else v for v in value]
    if any(r.dim() != 1 for r in rows):
        raise ValueError(f"{key!r} rows must be [L] or [L, 1], got {[list(r.shape) for r in rows]}")
    return rows, True


def _read_token_entries(data: TensorDictBase, keys: dict[str, NestedKey],
                        hints: dict[str, str]) -> dict[str, Tensor]:
    """Per-token entries as ``[B, T]`` tensors of one shape, all padded or all ragged.

    Ragged entries (TorchRL's ``pad_output=False``) are padded on the left, TorchRL's side.
    """
    read = {name: _per_token(data, key, hints.get(name, "")) for name, key in keys.items()}
    kinds = {name: ragged for name, (_, ragged) in read.items()}
    if len(set(kinds.values())) > 1:
        raise ValueError(
            "per-token entries must be all padded [B, T] tensors or all ragged (one [L_i] tensor "
            f"per row); got ragged={ {keys[n]: r for n, r in kinds.items()} }: a padded entry "
            "next to a ragged one cannot be aligned"
        )
    out = {}
    for name, (value, ragged) in read.items():
        if ragged:
            lengths = {n: [len(r) for r in v] for n, (v, _) in read.items()}
            if len({tuple(v) for v in lengths.values()}) > 1:
                raise ValueError(f"ragged per-token entries have different row lengths: {lengths}")
            value = torch.nn.utils.rnn.pad_sequence(value, batch_first=True, padding_side="left")
        out[name] = value
    shapes = {keys[n]: list(v.shape) for n, v in out.items()}
    if len({tuple(s) for s in shapes.values()}) > 1:
        raise ValueError(f"per-token entries must all have the same shape [B, T], got {shapes}")
    if out and next(iter(out.values())).shape[0] != data.batch_size[0]:
        raise ValueError(f"per-token entries must have B={data.batch_size[0]} rows, got {shapes}")
    return out


def _as_flags(name: object, value: Tensor) -> Tensor:
    if value.dtype != torch.bool:
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise ValueError(f"{name!r} must hold only 0 and 1, found non-finite values")
        if ((value != 0) & (value != 1)).any():
            raise ValueError(f"{name!r} must be bool or hold only 0 and 1, got values "
                             f"{value.unique()[:8].tolist()}")
        value = value != 0
    return value


def _real_token_bounds(attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(first, last)`` real position of every row; each row's real tokens must be contiguous."""
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    length = attention_mask.sum(-1)
    if (length == 0).any():
        raise ValueError(
            f"every transcript needs at least one token; rows {(length == 0).nonzero().flatten().tolist()} "
            "of the attention mask are empty"
        )
    first = torch.where(attention_mask, positions, attention_mask.shape[-1]).amin(-1)
    last = first + length - 1
    contiguous = attention_mask == ((positions >= first[:, None]) & (positions <= last[:, None]))
    if not contiguous.all():
        rows = (~contiguous.all(-1)).nonzero().flatten().tolist()
        raise ValueError(
            "each row's real tokens must be one contiguous block (left or right padding), but the "
            f"attention mask of rows {rows} has holes"
        )
    return first, last


def _per_row(name: str, value, batch: int, *, dtype: torch.dtype, device) -> Tensor:
    """A per-sequence input (python scalar, ``[B]`` or ``[B, 1]``) as a ``[B]`` tensor."""
    tensor = torch.as_tensor(value, device=device)
    if tensor.dim() == 0:
        tensor = tensor.expand(batch)
    elif tensor.dim() == 2 and tensor.shape[-1] == 1:
        tensor = tensor.squeeze(-1)
    if tuple(tensor.shape) != (batch,):
        raise ValueError(f"{name} must be a scalar, [B] or [B, 1] with B={batch}, got {list(tensor.shape)}")
    if dtype == torch.bool:
        return _as_flags(name, tensor)
    if not torch.isfinite(tensor.to(torch.float64)).all():
        raise ValueError(f"{name} must be finite, got {tensor.tolist()}")
    return tensor.to(dtype)


def _read_optional(data: TensorDictBase, value, name: str):
    """A tensor given directly, or read from ``data`` when a key is given."""
    if value is None or isinstance(value, (Tensor, bool, int, float)):
        return value
    found = data.get(value, None)
    if found is None:
        raise KeyError(f"{name}={value!r} is not an entry of data; found "
                       f"{sorted(map(str, data.keys(True, True)))}")
    return found


def _history_turn_ends(data: TensorDictBase, history_key: NestedKey, tokens: Tensor,
                       attention_mask: Tensor, eot: int) -> Tensor:
    """``[B, T]`` flags on the closing end-of-turn token of every assistant message.

    The ``k``-th end-of-turn token of a row closes the ``k``-th message of its history (chat
    templates close every message with it, and generated content cannot contain it: generation
    stops there), so an assistant message whose content is empty is still found.
    """
    history = data.get(history_key, None)
    if history is None:
        raise KeyError(
            f"history mode needs the transcripts' History at {history_key!r} (ChatHistory.full "
            "from a TransformersWrapper scoring pass); pass mode='tokens' with a mask key "
            f"otherwise; found {sorted(map(str, data.keys(True, True)))}"
        )
    closing = (tokens == eot) & attention_mask
    counts = closing.sum(-1).tolist()
    flags = torch.zeros_like(closing)
    for row in range(tokens.shape[0]):
        # "<none>" pads a batch of histories (TorchRL's placeholder; the template drops it)
        roles = [role for role in history[row].role if role != "<none>"]
        if counts[row] != len(roles):
            raise ValueError(
                f"row {row}: its history has {len(roles)} messages but its tokens hold "
                f"{counts[row]} end-of-turn tokens (id {eot}); the chat template must close every "
                "message with end_of_turn_token_id and add no message of its own (e.g. a default "
                "system prompt), and tokens must come from a scoring pass over this history"
            )
        positions = closing[row].nonzero().flatten()
        assistant = [k for k, role in enumerate(roles) if role == "assistant"]
        flags[row, positions[assistant]] = True
    return flags


def _mask_run_turn_ends(mask: Tensor, tokens: Tensor, attention_mask: Tensor,
                        eot: int | None) -> Tensor:
    """Tokens mode: each run of trainable tokens is a turn, closed by the first end-of-turn token
    at or after the run's end (the run's last token when there is none, or no ``eot`` is given)."""
    horizon = mask.shape[-1]
    after = torch.zeros_like(mask)
    after[:, :-1] = mask[:, 1:]
    run_end = mask & ~after
    if eot is None:
        return run_end
    positions = torch.arange(horizon, device=mask.device).expand_as(mask)
    closing = torch.where((tokens == eot) & attention_mask, positions, horizon)
    next_closing = closing.flip(-1).cummin(-1).values.flip(-1)  # first closing position >= t
    rows, cols = run_end.nonzero(as_tuple=True)
    target = next_closing[rows, cols]
    target = torch.where(target < horizon, target, cols)
    flags = torch.zeros_like(mask)
    flags[rows, target] = True
    return flags


def transcript_steps(
    data: TensorDictBase,
    *,
    terminated,
    turn_reward: Tensor | NestedKey | None = None,
    final_reward: Tensor | NestedKey | None = None,
    mode: str = "history",
    end_of_turn_token_id: int | None = None,
    end_of_turn_action: bool = False,
    tokens_key: NestedKey = ("tokens", "full"),
    mask_key: NestedKey = ("masks", "all_assistant_mask"),
    attention_mask_key: NestedKey = ("masks", "all_attention_mask"),
    history_key: NestedKey = ("history", "full"),
    turn_end_key: NestedKey | None = None,
) -> TensorDict:
    """The ``[B, T]`` step layout of :class:`~masked_rl.MaskedGAE` from TorchRL's LLM data.

    Each transcript (a row of ``("tokens", "full")``) is one episode whose steps are its tokens
    (SPEC.md, "Language-model transcripts"). The step at token ``t`` is "emit token ``t``".

    - ``loss_mask[t]``: ``mask_key`` (the assistant mask: message content only, so
      ``<|im_end|>`` is never trainable), plus each assistant turn's closing end-of-turn token
      with ``end_of_turn_action=True`` (then the stop decision trains too, and a turn that emits
      only ``<|im_end|>`` has an action).
    - ``("next", "reward")[t]``: ``turn_reward[b, k]`` on the closing token of row ``b``'s
      ``k``-th assistant turn (its end-of-turn token in history mode); ``final_reward[b]`` on the
      row's last real token. Masked rewards are credited by ``MaskedGAE`` to the last trainable
      token before them: the turn's last content token (or the end-of-turn token when it is an
      action); a turn with no trainable token passes its reward to the previous turn's action.
    - ``("next", "done")`` at every row's last real token; ``("next", "terminated")`` there too
      where ``terminated[b]`` (else the transcript was truncated and bootstraps from ``V'``
      there); ``("next", "truncated")`` is ``done & ~terminated``.
    - padding (either side) is masked, carries no reward and no flag.

    How turns are found:

    - ``mode="history"``: from ``history_key`` (``ChatHistory.full`` of a scoring pass). The
      ``k``-th end-of-turn token of a row (``end_of_turn_token_id``, the tokenizer's
      ``eos_token_id`` for chatml) closes the ``k``-th message; those of ``"assistant"`` messages
      are the turns, empty ones included. A count that does not match the history is an error.
    - ``mode="tokens"``: from ``turn_end_key`` if given (``[B, T]`` flags on each assistant turn's
      closing token, exact); else each run of ``mask_key`` tokens is a turn, closed by the first
      end-of-turn token at or after it (or its last token if there is none or no
      ``end_of_turn_token_id``). A turn with no trainable token is invisible to the runs: pass
      ``turn_end_key`` when such turns carry rewards.

    Args:
        data (TensorDictBase): sequence-level TorchRL LLM data of batch ``[B]`` (e.g. the output of
            ``TransformersWrapper(generate=False, input_mode="history", pad_output=True)``), with
            ``[B, T]`` per-token entries padded on either side, or ragged (one ``[L_i]`` tensor per
            row, padded here on the left); not a mix.

    Keyword Args:
        terminated (bool or Tensor): per transcript, ``[B]`` / ``[B, 1]`` or one bool: the episode
            ended by termination (no bootstrap). Required: a truncated transcript bootstraps.
        turn_reward (Tensor or NestedKey, optional): ``[B, N]`` reward after each assistant turn,
            in order (TorchRL's ``("next", "reward")`` of each ``ChatEnv`` step), ``N`` at least a
            row's number of assistant turns; entries past a row's last turn must be ``0``.
        final_reward (Tensor or NestedKey, optional): ``[B]`` / ``[B, 1]`` reward on the last token.
        mode (str): ``"history"`` (default) or ``"tokens"``.
        end_of_turn_token_id (int, optional): the token closing each message (required in history
            mode and with ``end_of_turn_action``).
        end_of_turn_action (bool): make each assistant turn's closing end-of-turn token trainable.
            Defaults to ``False`` (TorchRL's assistant mask).
        tokens_key, mask_key, attention_mask_key, history_key: TorchRL's keys (defaults:
            ``("tokens", "full")``, ``("masks", "all_assistant_mask")``,
            ``("masks", "all_attention_mask")``, ``("history", "full")``).
        turn_end_key (NestedKey, optional): tokens mode only: the turn closing flags.

    Returns:
        TensorDict of batch ``[B, T]`` with ``"tokens"`` (``[B, T]``), ``"attention_mask"``,
        ``"loss_mask"``, ``"turn_end"`` (bool ``[B, T]``), ``("next", "reward")`` (float32
        ``[B, T, 1]``), ``("next", "done")``, ``("next", "terminated")``, ``("next", "truncated")``
        (bool ``[B, T, 1]``). Plain tensors only, aligned with ``data[tokens_key]``.

    Raises:
        KeyError: a missing entry (e.g. no assistant mask: the generate path writes none; run a
            ``generate=False`` scoring pass).
        ValueError: shapes that do not match, ragged next to padded entries, a trainable token
            outside the attention mask or at a row's first token (no state to act from: TorchRL
            scores it 0), end-of-turn counts that do not match the history, rewards for turns a
            row does not have.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> EOT = 3  # one row: prompt "5 <eot>", a 2-token assistant turn "7 8 <eot>", left-padded
        >>> data = TensorDict({
        ...     "tokens": {"full": torch.tensor([[0, 5, EOT, 7, 8, EOT]])},
        ...     "masks": {"all_assistant_mask": torch.tensor([[0, 0, 0, 1, 1, 0]], dtype=torch.bool),
        ...               "all_attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1]], dtype=torch.bool)},
        ... }, batch_size=[1])
        >>> steps = transcript_steps(data, mode="tokens", end_of_turn_token_id=EOT,
        ...                          turn_reward=torch.tensor([[1.0]]), terminated=True)
        >>> steps.batch_size
        torch.Size([1, 6])
        >>> steps["next", "reward"].squeeze(-1), steps["next", "done"].squeeze(-1)
        (tensor([[0., 0., 0., 0., 0., 1.]]), tensor([[False, False, False, False, False,  True]]))
        >>> transcript_steps(data, mode="tokens", end_of_turn_token_id=EOT, end_of_turn_action=True,
        ...                  terminated=True)["loss_mask"]
        tensor([[False, False, False,  True,  True,  True]])
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(end_of_turn_action, bool):
        raise TypeError(f"end_of_turn_action must be a bool, got {end_of_turn_action!r}")
    if end_of_turn_token_id is not None and (
        isinstance(end_of_turn_token_id, bool) or not isinstance(end_of_turn_token_id, int)
    ):
        raise TypeError(f"end_of_turn_token_id must be an int, got {end_of_turn_token_id!r}")
    if end_of_turn_token_id is None and (mode == "history" or end_of_turn_action):
        why = "history mode" if mode == "history" else "end_of_turn_action=True"
        raise ValueError(f"{why} needs end_of_turn_token_id (e.g. tokenizer.eos_token_id for chatml)")
    if turn_end_key is not None and mode != "tokens":
        raise ValueError("turn_end_key is read in mode='tokens' only (history mode finds the turns)")
    keys = {"tokens": tokens_key, "mask": mask_key, "attention": attention_mask_key}
    hints = {"mask": (" (TorchRL's generate path writes no assistant mask: score the transcripts "
                      "with TransformersWrapper(generate=False, input_mode='history'), or pass "
                      "mode='tokens' with your own mask_key)")}
    if turn_end_key is not None:
        keys["turn_end"] = turn_end_key
    entries = _read_token_entries(data, keys, hints)
    tokens = entries["tokens"]
    attention = _as_flags(attention_mask_key, entries["attention"])
    mask = _as_flags(mask_key, entries["mask"])
    batch, horizon = tokens.shape
    device = tokens.device
    first, last = _real_token_bounds(attention)
    if (mask & ~attention).any():
        raise ValueError(f"{mask_key!r} marks tokens outside the attention mask (padding)")

    if mode == "history":
        turn_end = _history_turn_ends(data, history_key, tokens, attention, end_of_turn_token_id)
    elif turn_end_key is not None:
        turn_end = _as_flags(turn_end_key, entries["turn_end"])
        if (turn_end & ~attention).any():
            raise ValueError(f"{turn_end_key!r} marks tokens outside the attention mask (padding)")
    else:
        turn_end = _mask_run_turn_ends(mask, tokens, attention, end_of_turn_token_id)

    loss_mask = mask.clone()
    if end_of_turn_action:
        loss_mask |= turn_end & (tokens == end_of_turn_token_id)
    rows = torch.arange(batch, device=device)
    if loss_mask[rows, first].any():
        bad = loss_mask[rows, first].nonzero().flatten().tolist()
        raise ValueError(
            f"rows {bad}: the first token of a transcript is marked trainable, but it has no state "
            "to act from (TorchRL scores it 0); the prompt must come first"
        )

    reward = torch.zeros(batch, horizon, dtype=torch.float32, device=device)
    turn_reward = _read_optional(data, turn_reward, "turn_reward")
    if turn_reward is not None:
        turn_reward = torch.as_tensor(turn_reward, device=device)
        if turn_reward.dim() == 3 and turn_reward.shape[-1] == 1:
            turn_reward = turn_reward.squeeze(-1)
        if turn_reward.dim() != 2 or turn_reward.shape[0] != batch:
            raise ValueError(f"turn_reward must be [B, N] with B={batch}, got {list(turn_reward.shape)}")
        if not torch.isfinite(turn_reward.to(torch.float64)).all():
            raise ValueError("turn_reward must be finite")
        n_turns = turn_end.sum(-1)
        width = turn_reward.shape[1]
        if (n_turns > width).any():
            raise ValueError(
                f"turn_reward has N={width} columns but rows have up to {int(n_turns.max())} "
                f"assistant turns (per row: {n_turns.tolist()})"
            )
        beyond = torch.arange(width, device=device) >= n_turns[:, None]
        if (turn_reward.ne(0) & beyond).any():
            row = int((turn_reward.ne(0) & beyond).any(-1).nonzero()[0])
            raise ValueError(
                f"turn_reward[{row}] rewards turn(s) past the row's {int(n_turns[row])} assistant "
                f"turn(s): {turn_reward[row].tolist()}"
            )
        rank = (turn_end.long().cumsum(-1) - 1).clamp(0, max(width - 1, 0))
        if width:
            reward += torch.where(turn_end, turn_reward.to(torch.float32).gather(1, rank), 0.0)
    final_reward = _read_optional(data, final_reward, "final_reward")
    if final_reward is not None:
        reward[rows, last] += _per_row("final_reward", final_reward, batch, dtype=torch.float32,
                                       device=device)
    term = _per_row("terminated", _read_optional(data, terminated, "terminated"), batch,
                    dtype=torch.bool, device=device)
    done = torch.zeros(batch, horizon, dtype=torch.bool, device=device)
    done[rows, last] = True
    terminated_flags = done & term[:, None]
    return TensorDict(
        {
            "tokens": tokens,
            "attention_mask": attention,
            "loss_mask": loss_mask,
            "turn_end": turn_end,
            "next": {
                "reward": reward.unsqueeze(-1),
                "done": done.unsqueeze(-1),
                "terminated": terminated_flags.unsqueeze(-1),
                "truncated": (done & ~terminated_flags).unsqueeze(-1),
            },
        },
        batch_size=[batch, horizon],
        device=device,
    )


# -- model forwards ----------------------------------------------------------------------------

def _causal_model(network: nn.Module) -> nn.Module:
    """The ``transformers`` model of a TorchRL LLM wrapper, or the model itself."""
    model = getattr(network, "model", None)
    return model if isinstance(model, nn.Module) and hasattr(network, "tokenizer") else network


def _causal_forward(model: nn.Module, tokens: Tensor, attention_mask: Tensor, *,
                    hidden_states: bool):
    """One forward of a ``transformers`` causal model, independent of the padding side.

    Position ids count real tokens (``cumsum(attention_mask) - 1``), so a transcript gets the same
    positions padded left or right, for absolute position embeddings too (RoPE models such as
    Llama give the same attention scores either way, up to rounding).
    """
    attention_mask = attention_mask.long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    return model(input_ids=tokens, attention_mask=attention_mask, position_ids=position_ids,
                 output_hidden_states=hidden_states, use_cache=False)


def _last_hidden(output) -> Tensor:
    hidden = getattr(output, "last_hidden_state", None)
    return hidden if hidden is not None else output.hidden_states[-1]


def _log_probs_of(logits: Tensor, targets: Tensor) -> Tensor:
    """``log softmax(logits)[target]`` per row: the one formula of the scoring pass and the loss."""
    return logits.float().log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _previous_is_real(attention_mask: Tensor) -> Tensor:
    """``[B, T]``: position ``t - 1`` is a real token of the row (so step ``t`` has a state)."""
    previous = torch.zeros_like(attention_mask)
    previous[:, 1:] = attention_mask[:, :-1]
    return previous & attention_mask


@torch.no_grad()
def token_log_probs(model: nn.Module, tokens: Tensor, attention_mask: Tensor) -> Tensor:
    """``log pi(tokens[t] | tokens[:t])`` for every token, in TorchRL's ``("log_probs", "full")`` layout.

    Read from the logits at position ``t - 1``; ``0`` at each row's first real token (it has no
    state: TorchRL writes ``0`` there too) and at padding. :class:`TokenPPOLoss` computes its
    current log-probs with the same forward and formula, so scoring with this function gives a
    ratio of exactly ``1`` before the first update; TorchRL's ``TransformersWrapper`` scoring pass
    agrees with it to rounding (it uses no position ids).

    Args:
        model: a ``transformers`` causal LM, or a TorchRL ``TransformersWrapper`` (its ``.model``).
        tokens (Tensor): ``[B, T]`` token ids, padded on either side.
        attention_mask (Tensor): ``[B, T]``, ``1`` at real tokens.

    Returns:
        float32 ``[B, T]``, no grad.

    Examples:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> _ = torch.manual_seed(0)
        >>> lm = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)).eval()
        >>> tokens = torch.tensor([[5, 6, 7, 0], [0, 5, 6, 7]])   # right- and left-padded
        >>> attention = tokens != 0
        >>> lp = token_log_probs(lm, tokens, attention)
        >>> lp[0, 0].item(), lp[0, 3].item()
        (0.0, 0.0)
        >>> torch.allclose(lp[0, :3], lp[1, 1:], atol=1e-5)
        True
    """
    model = _causal_model(model)
    if tokens.shape != attention_mask.shape or tokens.dim() != 2:
        raise ValueError(f"tokens and attention_mask must both be [B, T], got "
                         f"{list(tokens.shape)} and {list(attention_mask.shape)}")
    attention_mask = attention_mask.bool()
    logits = _causal_forward(model, tokens, attention_mask, hidden_states=False).logits
    out = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    out[:, 1:] = _log_probs_of(logits[:, :-1], tokens[:, 1:])
    return torch.where(_previous_is_real(attention_mask), out, 0.0)


class TokenValueHead(nn.Module):
    """A scalar value head on a causal model's hidden states, read with the off-by-one of SPEC.md.

    The hidden state at position ``p`` has read ``tokens[:p + 1]``, so it is the state of the step
    that emits token ``p + 1``:

    - ``V[t] = head(h[t - 1])``, the value of the state token ``t`` is chosen from (a value read
      at ``t`` would already have seen the token it judges);
    - ``V'[t] = head(h[t]) = V[t + 1]``, in the row, for one forward.

    At each row's first real token ``V = 0`` (no state: it is never trainable) and at padding
    ``V = V' = 0``; neither is read by :class:`~masked_rl.MaskedGAE` there.

    Args:
        hidden_size (int): width of the hidden states.
        zero_init (bool): start at ``V = 0`` everywhere (the first advantages are then the
            returns). Defaults to ``True``.

    Shapes: ``hidden`` ``[B, T, H]``, ``attention_mask`` ``[B, T]`` -> ``(V, V')``, ``[B, T, 1]`` each.

    Examples:
        >>> import torch
        >>> head = TokenValueHead(4, zero_init=False)
        >>> hidden = torch.randn(1, 3, 4)
        >>> value, next_value = head(hidden, torch.ones(1, 3, dtype=torch.bool))
        >>> value.shape, bool(value[0, 0] == 0), torch.equal(value[0, 1:], next_value[0, :-1])
        (torch.Size([1, 3, 1]), True, True)
    """

    def __init__(self, hidden_size: int, *, zero_init: bool = True):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        if zero_init:
            nn.init.zeros_(self.linear.weight)
            nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
        if hidden.dim() != 3 or hidden.shape[:2] != attention_mask.shape:
            raise ValueError(f"hidden must be [B, T, H] matching attention_mask [B, T], got "
                             f"{list(hidden.shape)} and {list(attention_mask.shape)}")
        attention_mask = attention_mask.bool()
        position_value = self.linear(hidden.to(self.linear.weight.dtype))  # value of tokens[:p + 1]
        value = torch.zeros_like(position_value)
        value[:, 1:] = position_value[:, :-1]
        value = torch.where(_previous_is_real(attention_mask).unsqueeze(-1), value, 0.0)
        next_value = torch.where(attention_mask.unsqueeze(-1), position_value, 0.0)
        return value, next_value


class TokenCritic(nn.Module):
    """``V`` and ``V'`` for every token of a batch of transcripts, in one causal forward.

    ``model`` is a ``transformers`` model (a causal LM, or its base model) and ``head`` a
    :class:`TokenValueHead` on its last hidden state. Two set-ups:

    - a separate critic: ``TokenCritic(small_causal_model)``; its own forward and its own
      parameters (in the loss: one more forward and backward of that model);
    - a head on the policy's trunk: ``TokenCritic(policy_model)``; :class:`TokenPPOLoss` sees that
      ``critic.model`` is the policy's model and reads logits and hidden states from one forward
      (the value loss then also trains the trunk unless ``detach_trunk=True``). The advantage
      pass (:func:`compute_token_advantages`) still runs one no-grad forward of the policy.

    Args:
        model (nn.Module): the trunk (``config.hidden_size`` gives the head's width), or a TorchRL
            ``TransformersWrapper`` (its ``.model``).
        head (TokenValueHead, optional): defaults to a zero-initialised head.

    Keyword Args:
        detach_trunk (bool): the head reads detached hidden states, so the value loss trains the
            head only. Defaults to ``False``.

    Shapes: ``forward(tokens [B, T], attention_mask [B, T]) -> (V, V')``, float ``[B, T, 1]``,
    aligned with ``tokens`` (see :class:`TokenValueHead` for what each position holds).

    Examples:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaModel
        >>> _ = torch.manual_seed(0)
        >>> trunk = LlamaModel(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
        >>> critic = TokenCritic(trunk, TokenValueHead(16, zero_init=False))
        >>> tokens = torch.tensor([[0, 0, 5, 6, 7]])
        >>> value, next_value = critic(tokens, tokens != 0)
        >>> value.shape, torch.equal(value[0, 3:], next_value[0, 2:4])
        (torch.Size([1, 5, 1]), True)
    """

    def __init__(self, model: nn.Module, head: TokenValueHead | None = None, *,
                 detach_trunk: bool = False):
        super().__init__()
        self.model = _causal_model(model)
        if head is None:
            hidden_size = getattr(getattr(self.model, "config", None), "hidden_size", None)
            if hidden_size is None:
                raise ValueError("model has no config.hidden_size: pass head=TokenValueHead(width)")
            head = TokenValueHead(hidden_size)
        self.head = head
        self.detach_trunk = detach_trunk

    def values_from_hidden(self, hidden: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
        """``(V, V')`` from the trunk's last hidden states ``[B, T, H]``."""
        return self.head(hidden.detach() if self.detach_trunk else hidden, attention_mask)

    def forward(self, tokens: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
        if tokens.dim() != 2 or tokens.shape != attention_mask.shape:
            raise ValueError(f"tokens and attention_mask must both be [B, T], got "
                             f"{list(tokens.shape)} and {list(attention_mask.shape)}")
        output = _causal_forward(self.model, tokens, attention_mask, hidden_states=True)
        return self.values_from_hidden(_last_hidden(output), attention_mask)


# -- shaping and the one-call estimate --------------------------------------------------------

def kl_penalty_reward(log_prob: Tensor, ref_log_prob: Tensor, loss_mask: Tensor,
                      kl_coef: float) -> Tensor:
    """KL-to-reference shaping as a per-token reward: ``-kl_coef * (log_prob - ref_log_prob)``.

    Only at trainable tokens: masked tokens are not actions and carry no KL reward (whatever the
    log-probs stored there, NaN included, give ``0``).

    Args:
        log_prob (Tensor): ``[B, T]`` or ``[B, T, 1]``, the sampling policy's scored log-probs.
        ref_log_prob (Tensor): the reference policy's, same shape and alignment.
        loss_mask (Tensor): ``[B, T]`` or ``[B, T, 1]``, bool or 0/1.
        kl_coef (float): ``>= 0``.

    Returns:
        ``[B, T, 1]`` reward (the dtype of ``log_prob``), ``0`` at masked tokens.

    Examples:
        >>> import torch
        >>> lp, ref = torch.tensor([[-1.0, -2.0, float("nan")]]), torch.tensor([[-1.5, -1.0, 0.0]])
        >>> kl_penalty_reward(lp, ref, torch.tensor([[1, 1, 0]]), kl_coef=0.1).squeeze(-1)
        tensor([[-0.0500,  0.1000,  0.0000]])
    """
    if isinstance(kl_coef, bool) or not isinstance(kl_coef, (int, float)) or not kl_coef >= 0:
        raise ValueError(f"kl_coef must be a float >= 0, got {kl_coef!r}")
    shapes = [tuple(x.shape[:2]) if x.dim() == 3 else tuple(x.shape) for x in (log_prob, ref_log_prob, loss_mask)]
    if len(set(shapes)) > 1 or len(shapes[0]) != 2:
        raise ValueError(f"log_prob, ref_log_prob and loss_mask must be [B, T] (or [B, T, 1]) of one "
                         f"shape, got {[list(s) for s in shapes]}")
    log_prob, ref_log_prob, loss_mask = (x.reshape(shapes[0]) for x in (log_prob, ref_log_prob, loss_mask))
    mask = _as_flags("loss_mask", loss_mask)
    return torch.where(mask, -kl_coef * (log_prob - ref_log_prob), 0.0).unsqueeze(-1)


def compute_token_advantages(
    data: TensorDictBase,
    critic: TokenCritic,
    estimator: MaskedGAE,
    *,
    terminated,
    turn_reward=None,
    final_reward=None,
    kl_coef: float = 0.0,
    ref_log_prob_key: NestedKey = ("next", "ref_log_probs", "full"),
    sample_log_prob_key: NestedKey = ("log_probs", "full"),
    **steps_kwargs,
) -> TensorDictBase:
    """Critic, :func:`transcript_steps` and ``MaskedGAE`` on a scored batch, written back into it.

    1. :func:`transcript_steps` builds the ``[B, T]`` steps (``steps_kwargs``: ``mode``,
       ``end_of_turn_token_id``, ``end_of_turn_action``, the keys);
    2. with ``kl_coef > 0``, :func:`kl_penalty_reward` of ``data[sample_log_prob_key]`` against
       ``data[ref_log_prob_key]`` is added to the reward at trainable tokens;
    3. ``critic`` runs once, without grad, over the tokens: ``"state_value"`` and
       ``("next", "state_value")``;
    4. ``estimator`` (a :class:`~masked_rl.MaskedGAE` with ``value_network=None``) writes the
       advantages.

    Written into ``data`` (``[B]``), aligned with the tokens as the steps are: ``"loss_mask"``
    (bool ``[B, T]``), ``"state_value"``, ``"advantage"``, ``"value_target"`` (float
    ``[B, T, 1]``, ``0`` at masked tokens for the last two), the shaped ``"token_reward"``
    (``[B, T, 1]``) and, with ``masked_value_targets``, ``"value_target_mask"``. That is what
    :class:`TokenPPOLoss` reads (and ``GRPOLoss(masking_strategy="rlhf")`` too: a dense,
    left-padded ``[B, T, 1]`` advantage).

    Returns:
        ``data``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from transformers import LlamaConfig, LlamaModel
        >>> from masked_rl import MaskedGAE
        >>> _ = torch.manual_seed(0)
        >>> trunk = LlamaModel(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
        >>> data = TensorDict({
        ...     "tokens": {"full": torch.tensor([[0, 5, 3, 7, 8, 3]])},
        ...     "masks": {"all_assistant_mask": torch.tensor([[0, 0, 0, 1, 1, 0]], dtype=torch.bool),
        ...               "all_attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1]], dtype=torch.bool)},
        ... }, batch_size=[1])
        >>> data = compute_token_advantages(
        ...     data, TokenCritic(trunk), MaskedGAE(gamma=1.0, lmbda=0.5, value_network=None),
        ...     terminated=True, final_reward=torch.tensor([1.0]), mode="tokens")
        >>> data["advantage"].squeeze(-1)   # zero-initialised head: V = 0
        tensor([[0.0000, 0.0000, 0.0000, 0.5000, 1.0000, 0.0000]])
    """
    if not isinstance(estimator, MaskedGAE):
        raise TypeError(f"estimator must be a masked_rl.MaskedGAE, got {type(estimator).__name__}")
    if estimator.value_network is not None:
        raise ValueError("estimator must be built with value_network=None: the critic's values are "
                         "computed here, from the tokens")
    steps = transcript_steps(data, terminated=terminated, turn_reward=turn_reward,
                             final_reward=final_reward, **steps_kwargs)
    if kl_coef:
        log_probs = _read_token_entries(
            data, {"lp": sample_log_prob_key, "ref": ref_log_prob_key},
            {"ref": " (the reference model's scored log-probs, for kl_coef > 0)"})
        if log_probs["lp"].shape != steps.batch_size:
            raise ValueError(f"{sample_log_prob_key!r} is {list(log_probs['lp'].shape)} but the tokens "
                             f"are {list(steps.batch_size)}")
        steps["next", "reward"] = steps["next", "reward"] + kl_penalty_reward(
            log_probs["lp"], log_probs["ref"], steps["loss_mask"], kl_coef).to(torch.float32)
    with torch.no_grad():
        value, next_value = critic(steps["tokens"], steps["attention_mask"])
    steps["state_value"] = value.detach()
    steps["next", "state_value"] = next_value.detach()
    keys = estimator.tensor_keys
    if keys.loss_mask != "loss_mask" or keys.value != "state_value" or keys.reward != "reward":
        steps.rename_key_("loss_mask", keys.loss_mask)
    estimator(steps)
    data.set("loss_mask", steps.get(keys.loss_mask))
    data.set("state_value", steps["state_value"])
    data.set("advantage", steps.get(keys.advantage))
    data.set("value_target", steps.get(keys.value_target))
    data.set("token_reward", steps["next", "reward"])
    if estimator.masked_value_targets:
        data.set("value_target_mask", steps.get(keys.value_target_mask))
    return data


# -- the loss ----------------------------------------------------------------------------------

def _token_weights(rows: Tensor, batch: int, reduction: str, group, dtype) -> Tensor:
    """``[N]`` weights whose dot product with per-token terms is the loss reduction.

    ``"token_mean"``: ``1 / count`` over every trainable token. ``"sequence_mean"``:
    ``1 / (tokens in the row * rows with a trainable token)``. With a data-parallel ``group``
    the counts are the group's (one ``all_reduce`` of one float64 number per group and call)
    and the weights are multiplied by the group's size, so that DDP's mean of the ranks'
    gradients is the gradient of the global mean (as :func:`masked_rl.reduction.masked_mean`).
    No trainable token: an empty weight vector, and the loss is ``0`` with a graph.
    """
    per_row = torch.zeros(batch, dtype=torch.float64, device=rows.device).index_add(
        0, rows, torch.ones(rows.shape, dtype=torch.float64, device=rows.device))
    count = per_row.sum() if reduction == "token_mean" else (per_row > 0).sum().to(torch.float64)
    world = 1
    if group is not None:
        import torch.distributed as dist  # only when asked

        from masked_rl.distributed import _group_rank

        count = count.reshape(1)
        for each in (group if isinstance(group, (list, tuple)) else [group]):
            world *= _group_rank(each)[1]
            dist.all_reduce(count, group=each)
        count = count.reshape(())
    weight = world / count.clamp_min(1)
    if reduction == "sequence_mean":
        weight = weight / per_row[rows]
    return (weight * torch.ones_like(rows, dtype=torch.float64)).to(dtype)


class TokenPPOLoss(LossModule):
    """Token-level PPO on TorchRL's LLM data: a clipped policy term and a value loss per trainable token.

    Per trainable token ``t`` (``loss_mask``): ``ratio = exp(log_prob[t] - old_log_prob[t])``,
    policy term ``-min(ratio * A[t], clip(ratio, 1 - eps_low, 1 + eps_high) * A[t])``, value term
    ``critic_coeff * distance(V[t], value_target[t])`` (``loss_critic_type``; with ``clip_value``,
    the larger of it and the clipped value's), entropy term ``-entropy_coeff * H(pi(.|tokens[:t]))``.
    Each is reduced over trainable tokens only (``reduction``). A masked token is not gathered at
    all: it gets exactly zero gradient from every term, and nothing stored there (advantage,
    old log-prob, value target, NaN included) changes the loss. (``critic_tokens`` is the one
    exception: ``"targets"`` takes the value term wherever the estimator wrote a target, masked
    tokens included (``MaskedGAE(masked_value_targets=True)``), and ``"every"`` at every real
    token, for a plain token-level GAE baseline.)

    Shape contract (input: the sequence-level ``[B]`` TensorDict of TorchRL's LLM stack):

    - ``("tokens", "full")`` ``[B, T]``, ``("masks", "all_attention_mask")`` ``[B, T]``, each row's
      real tokens one block, padded on either side;
    - ``"loss_mask"`` ``[B, T]`` (or ``[B, T, 1]``), bool or 0/1 (:func:`compute_token_advantages`
      writes it);
    - ``("log_probs", "full")`` ``[B, T]``: old log-probs from a scoring pass aligned with the
      tokens (``log_prob[t]`` from position ``t - 1``), never generation-time ones (TorchRL's
      generate path zeroes the first response token's); :func:`token_log_probs` is this loss's
      own formula;
    - the policy is the softmax of the model's logits over its whole vocabulary, in this loss, in
      the scoring pass and in the entropy: it must be the distribution generation sampled from.
      A logits processor at generation (``bad_words_ids``, top-k, top-p, a temperature other
      than 1) that the model's own forward does not apply makes the ratio, the KL and the
      entropy those of a policy that was never sampled (build the restriction into the model's
      head, as ``masked_rl_envs.llm_factories.RestrictedHead`` does);
    - ``"advantage"``, ``"value_target"`` and, with ``clip_value``, ``"state_value"``:
      ``[B, T, 1]`` dense, aligned with the tokens; with ``critic_tokens="targets"``,
      ``"value_target_mask"`` (bool ``[B, T, 1]``, as ``MaskedGAE(masked_value_targets=True)``
      writes it).

    Where it differs from TorchRL's ``GRPOLoss`` (its model): it reads the stored tokens (no
    re-templating of the history, so history and tokens mode are one path) and runs the model
    itself, once (policy and a trunk-sharing critic from one forward); the advantage is per token
    and must be dense and aligned (GRPOLoss reads ``"advantage"`` right-padded when ragged, while
    its log-probs are left-padded); there is a critic; ``"sequence_mean"`` (GRPOLoss's
    ``"prompt_mean"``) leaves out rows with no trainable token instead of counting them as ``0``;
    no KL term (shape the reward with :func:`kl_penalty_reward` instead); padding never changes
    the loss (position ids count real tokens).

    Args:
        actor_network: the policy, a ``transformers`` causal LM or a TorchRL ``TransformersWrapper``
            (its ``.model``). Keep it in eval mode, as for GRPOLoss (no dropout between scoring
            and loss).
        critic_network (TokenCritic, optional): the critic; ``None`` trains no value function
            (``loss_critic`` is then absent).

    Keyword Args:
        clip_epsilon (float or (float, float)): symmetric ``eps`` or ``(eps_low, eps_high)``.
            Defaults to ``0.2``.
        critic_coeff (float): Defaults to ``1.0``.
        loss_critic_type (str): ``"l2"``, ``"l1"`` or ``"smooth_l1"`` (TorchRL's
            ``distance_loss``). Defaults to ``"l2"``.
        clip_value (float, optional): clip ``V`` to ``state_value +- clip_value``. Defaults to ``None``.
        entropy_coeff (float): Defaults to ``0.0`` (entropy still reported).
        normalize_advantage (bool): standardise advantages over the batch's trainable tokens
            (:func:`~masked_rl.masked_standardize`). Defaults to ``False``.
        critic_tokens (str): where the value loss is taken: ``"trainable"`` (default), the
            ``loss_mask`` tokens, as for masked GAE's targets; ``"targets"``: the tokens of
            ``value_target_mask`` (masked GAE's targets at masked tokens too: prompt, tool and
            template tokens, SPEC's opt-in extension), a dense critic beside masked advantages;
            or ``"every"``: every real token (every transition of a plain token-level GAE, whose
            targets exist there). The last two leave out a row's first real token (no position
            before it to read ``V`` from) and reduce over their own tokens, from the same forward.
        reduction (str): ``"token_mean"`` (default): the mean over every trainable token of the
            batch; or ``"sequence_mean"``: each row's mean, then the mean over the rows that have
            a trainable token.
        dp_group (ProcessGroup or sequence of them, optional): the data-parallel ranks whose
            gradients DDP averages (``torch.distributed.group.WORLD`` for all; under DP x CP
            with ``"token_mean"``, the pair ``(cp_group, dp_group)``). The reduction's
            denominator is then counted over every rank and the terms are scaled by the number
            of ranks, so the averaged gradient is that of one process holding every rank's
            batch, however the batch was split (:func:`masked_rl.reduction.masked_mean`); with
            ``normalize_advantage`` the statistics are the group's too. Each rank's reported
            terms are then its share times the number of ranks (all-reduce and divide to log
            the global value). Communication: one ``all_reduce`` of one float64 number per
            group and call (plus the standardisation's ``all_gather`` of 3 numbers per rank).
            Defaults to ``None``: this rank alone.

    Keys (``set_keys``): ``action`` (``("tokens", "full")``), ``attention_mask``
    (``("masks", "all_attention_mask")``), ``loss_mask`` (``"loss_mask"``), ``sample_log_prob``
    (``("log_probs", "full")``), ``advantage``, ``value_target``, ``value`` (``"state_value"``),
    ``value_target_mask``.

    Returns (``forward``): a TensorDict with ``"loss_objective"``, ``"loss_critic"`` (with a critic),
    ``"loss_entropy"`` (the terms to sum; scalars) and, detached, ``"entropy"``,
    ``"clip_fraction"``, ``"kl_approx"`` (``mean(old - new)``), ``"num_trainable_tokens"``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> _ = torch.manual_seed(0)
        >>> lm = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)).eval()
        >>> tokens = torch.tensor([[0, 5, 3, 7, 8, 3]]); attention = tokens != 0
        >>> data = TensorDict({
        ...     "tokens": {"full": tokens}, "masks": {"all_attention_mask": attention},
        ...     "log_probs": {"full": token_log_probs(lm, tokens, attention)},
        ...     "loss_mask": torch.tensor([[0, 0, 0, 1, 1, 0]], dtype=torch.bool),
        ...     "advantage": torch.ones(1, 6, 1), "value_target": torch.ones(1, 6, 1),
        ... }, batch_size=[1])
        >>> loss = TokenPPOLoss(lm, TokenCritic(lm))      # value head on the policy's trunk
        >>> out = loss(data)
        >>> round(out["loss_objective"].item(), 4), out["loss_critic"].item()  # ratio 1; V = 0
        (-1.0, 1.0)
        >>> (out["loss_objective"] + out["loss_critic"] + out["loss_entropy"]).backward()
    """

    @dataclass
    class _AcceptedKeys:
        """Keys of the sequence-level input (see the class docstring)."""

        action: NestedKey = ("tokens", "full")
        attention_mask: NestedKey = ("masks", "all_attention_mask")
        loss_mask: NestedKey = "loss_mask"
        sample_log_prob: NestedKey = ("log_probs", "full")
        advantage: NestedKey = "advantage"
        value_target: NestedKey = "value_target"
        value: NestedKey = "state_value"
        value_target_mask: NestedKey = "value_target_mask"

    default_keys = _AcceptedKeys

    def __init__(
        self,
        actor_network: nn.Module,
        critic_network: TokenCritic | None = None,
        *,
        clip_epsilon: float | Sequence[float] = 0.2,
        critic_coeff: float = 1.0,
        loss_critic_type: str = "l2",
        clip_value: float | None = None,
        entropy_coeff: float = 0.0,
        normalize_advantage: bool = False,
        critic_tokens: str = "trainable",
        reduction: str = "token_mean",
        dp_group=None,
    ):
        super().__init__()
        if critic_network is not None and not isinstance(critic_network, TokenCritic):
            raise TypeError(f"critic_network must be a TokenCritic, got {type(critic_network).__name__}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if reduction == "sequence_mean" and isinstance(dp_group, (list, tuple)):
            raise ValueError("reduction='sequence_mean' needs whole sequences on each rank: pass "
                             "one data-parallel dp_group, not a (cp_group, dp_group) grid")
        if critic_tokens not in CRITIC_TOKENS:
            raise ValueError(f"critic_tokens must be one of {CRITIC_TOKENS}, got {critic_tokens!r}")
        if loss_critic_type not in ("l1", "l2", "smooth_l1"):
            raise ValueError(f"loss_critic_type must be 'l1', 'l2' or 'smooth_l1', got {loss_critic_type!r}")
        low, high = (clip_epsilon, clip_epsilon) if isinstance(clip_epsilon, (int, float)) else tuple(clip_epsilon)
        if not (0 <= low < 1 and high >= 0):
            raise ValueError(f"clip_epsilon must be eps in [0, 1) or (eps_low in [0, 1), eps_high >= 0), "
                             f"got {clip_epsilon!r}")
        if clip_value is not None and not clip_value > 0:
            raise ValueError(f"clip_value must be None or > 0, got {clip_value!r}")
        self.actor_network = actor_network
        self.critic_network = critic_network
        self.clip_bounds = (float(torch.tensor(-low).log1p()), float(torch.tensor(high).log1p()))
        self.critic_coeff = critic_coeff
        self.loss_critic_type = loss_critic_type
        self.clip_value = clip_value
        self.entropy_coeff = entropy_coeff
        self.normalize_advantage = normalize_advantage
        self.critic_tokens = critic_tokens
        self.reduction = reduction
        self.dp_group = dp_group

    @property
    def shares_trunk(self) -> bool:
        """Whether the critic's trunk is the policy's model (one forward for both)."""
        return self.critic_network is not None and (
            self.critic_network.model is _causal_model(self.actor_network))

    def _per_step_keys(self) -> dict:
        """The dense ``[B, T, 1]`` entries this configuration reads, by name."""
        keys = self.tensor_keys
        wanted = {"advantage": keys.advantage}
        if self.critic_network is not None:
            wanted["value_target"] = keys.value_target
            if self.clip_value is not None:
                wanted["value"] = keys.value
            if self.critic_tokens == "targets":
                wanted["value_target_mask"] = keys.value_target_mask
        return wanted

    @property
    def in_keys(self):
        keys = self.tensor_keys
        return [keys.action, keys.attention_mask, keys.loss_mask, keys.sample_log_prob,
                *self._per_step_keys().values()]

    @property
    def out_keys(self):
        out = ["loss_objective", "loss_entropy", "entropy", "clip_fraction", "kl_approx",
               "num_trainable_tokens"]
        return out + (["loss_critic"] if self.critic_network is not None else [])

    def _forward_value_estimator_keys(self, **kwargs) -> None:
        pass  # the advantage is computed outside the loss (compute_token_advantages)

    def _read(self, data: TensorDictBase):
        keys = self.tensor_keys
        names = {"tokens": keys.action, "attention": keys.attention_mask, "mask": keys.loss_mask,
                 "old": keys.sample_log_prob}
        entries = _read_token_entries(data, names, {
            "mask": " (compute_token_advantages writes it)",
            "old": " (old log-probs from a scoring pass: token_log_probs or a generate=False wrapper)"})
        if entries["old"].requires_grad:
            raise RuntimeError(f"{keys.sample_log_prob!r} requires grad: store detached old log-probs")
        per_step = {}
        shape = tuple(entries["tokens"].shape)
        for name, key in self._per_step_keys().items():
            value = data.get(key, None)
            if value is None:
                raise KeyError(f"TokenPPOLoss needs {key!r} ([B, T, 1], dense, aligned with the "
                               f"tokens); found {sorted(map(str, data.keys(True, True)))}")
            if not isinstance(value, Tensor) or tuple(value.shape) not in (shape, shape + (1,)):
                found = list(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(f"{key!r} must be [B, T, 1] = {list(shape) + [1]} (dense, aligned with "
                                 f"{keys.action!r}), got {found}")
            per_step[name] = value.reshape(shape)
        attention = _as_flags(keys.attention_mask, entries["attention"])
        mask = _as_flags(keys.loss_mask, entries["mask"])
        if (mask & ~_previous_is_real(attention)).any():
            raise ValueError(f"{keys.loss_mask!r} marks padding or a row's first token (no state to "
                             "act from) as trainable")
        return entries["tokens"], attention, mask, entries["old"], per_step

    def forward(self, tensordict: TensorDictBase) -> TensorDict:
        tokens, attention, mask, old_log_prob, per_step = self._read(tensordict)
        policy = _causal_model(self.actor_network)
        output = _causal_forward(policy, tokens, attention, hidden_states=self.shares_trunk)
        rows, cols = mask.nonzero(as_tuple=True)  # the trainable tokens, [N]
        logits = output.logits[rows, cols - 1]  # position t - 1 emits token t
        log_prob = _log_probs_of(logits, tokens[rows, cols])
        advantage = per_step["advantage"]
        if self.normalize_advantage:
            advantage = masked_standardize(advantage.unsqueeze(-1), mask,
                                           group=self.dp_group).squeeze(-1)
        advantage = advantage[rows, cols].detach().to(log_prob.dtype)
        log_weight = log_prob - old_log_prob[rows, cols].to(log_prob.dtype)
        clipped = log_weight.clamp(*self.clip_bounds)
        gain = torch.minimum(log_weight.exp() * advantage, clipped.exp() * advantage)
        entropy = -(logits.float().softmax(-1) * logits.float().log_softmax(-1)).sum(-1)
        weight = _token_weights(rows, tokens.shape[0], self.reduction, self.dp_group, log_prob.dtype)
        reduce = lambda x: (x * weight).sum()  # noqa: E731
        out = {
            "loss_objective": reduce(-gain),
            "loss_entropy": -self.entropy_coeff * reduce(entropy),
            "entropy": reduce(entropy).detach(),
            "clip_fraction": reduce((clipped != log_weight).to(log_prob.dtype)).detach(),
            "kl_approx": reduce(-log_weight).detach(),
            "num_trainable_tokens": torch.tensor(rows.numel()),
        }
        if self.critic_network is not None:
            if self.shares_trunk:
                value, _ = self.critic_network.values_from_hidden(_last_hidden(output), attention)
            else:
                value, _ = self.critic_network(tokens, attention)
            value_rows, value_cols, value_weight = rows, cols, weight
            if self.critic_tokens != "trainable":
                where = _previous_is_real(attention)
                if self.critic_tokens == "targets":
                    where = where & _as_flags(self.tensor_keys.value_target_mask,
                                              per_step["value_target_mask"])
                value_rows, value_cols = where.nonzero(as_tuple=True)
                value_weight = _token_weights(value_rows, tokens.shape[0], self.reduction,
                                              self.dp_group, log_prob.dtype)
            value = value.squeeze(-1)[value_rows, value_cols]
            target = per_step["value_target"][value_rows, value_cols].detach().to(value.dtype)
            loss_critic = distance_loss(value, target, self.loss_critic_type)
            if self.clip_value is not None:
                old = per_step["value"][value_rows, value_cols].detach().to(value.dtype)
                clipped_value = old + (value - old).clamp(-self.clip_value, self.clip_value)
                loss_critic = torch.maximum(
                    loss_critic, distance_loss(clipped_value, target, self.loss_critic_type))
            out["loss_critic"] = self.critic_coeff * (loss_critic * value_weight).sum()
        return TensorDict(out, batch_size=[])
