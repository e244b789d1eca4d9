"""A word-level tokenizer and a tiny causal LM for the chat tool-use task, built in memory.

Nothing is downloaded: the tokenizer is assembled with the ``tokenizers`` library and wrapped as a
``transformers.PreTrainedTokenizerFast``; the model is a randomly initialised
``LlamaForCausalLM`` sized by a ``LlamaConfig``. Both are what TorchRL's LLM stack expects
(``ChatEnv``, ``History.apply_chat_template``, ``TransformersWrapper``).

Vocabulary (word level, so one task word is one token, which is what makes the task learnable by
RL from scratch in minutes; a character-level vocabulary multiplies every decision by the word
length):

- special: ``<pad>`` (id 0, the padding token, distinct from end-of-sequence), ``<unk>``,
  ``<|im_start|>``, ``<|im_end|>`` (the end-of-turn token, also the tokenizer's ``eos_token``,
  so generation stops at the end of an assistant turn);
- template words: the roles ``system``, ``user``, ``assistant``, ``tool`` and ``"\\n"``;
- task words: ``lookup``, ``answer``, ``error``, the keys ``k0 ...``, the values ``v0 ...`` and
  the filler words ``w0 ...``, stored SentencePiece-style with a leading ``"▁"`` (the ``tokenizers``
  ``Metaspace`` pre-tokenizer and decoder).

A message content is its words joined by single spaces (``"lookup k2"``; :func:`words`). The
decoder writes a space before each task word and TorchRL strips message contents when it parses
decoded text back into a ``History``, so generated content tokens survive TorchRL's
decode -> parse -> re-template -> re-encode round trip, and the scoring pass sees the tokens that
were sampled, provided generation only emits task words and ``<|im_end|>``.
:func:`make_model` builds that rule into the model (its output head gives every
:func:`suppressed_token_ids` id a logit of ``-1e4``), so generation samples from the same
distribution that the scoring pass and the losses compute. A model from elsewhere needs both
halves: ``bad_words_ids`` in generation (``TransformersWrapper(generate_kwargs=
{"bad_words_ids": [[i] for i in suppressed_token_ids(tokenizer)]})``; the wrapper drops
``suppress_tokens``) *and* the same restriction in the log-probs the losses train, or PPO's ratio
and entropy are taken over a distribution that is never sampled (see :class:`RestrictedHead`).

The chat template is TorchRL's ``chatml_format`` (imported, not copied), which wraps assistant
content in ``{% generation %}`` blocks so ``return_assistant_tokens_mask=True`` works.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = [
    "make_tokenizer", "make_model", "words", "task_words", "suppressed_token_ids",
    "RestrictedHead", "CHAT_TEMPLATE_NAME",
]

CHAT_TEMPLATE_NAME = "chatml_format"
_SPECIAL = ("<pad>", "<unk>", "<|im_start|>", "<|im_end|>")
_TEMPLATE_WORDS = ("system", "user", "assistant", "tool", "\n")
_COMMAND_WORDS = ("lookup", "answer", "error")


def _require_int(name: str, value, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ValueError(f"{name} must be an integer in [{minimum}, {maximum}], got {value!r}")
    return value


def task_words(n_keys: int = 8, n_values: int = 8, n_filler: int = 4) -> list[str]:
    """The task words of :func:`make_tokenizer`'s vocabulary, without their trailing space.

    >>> task_words(2, 2, 1)
    ['lookup', 'answer', 'error', 'k0', 'k1', 'v0', 'v1', 'w0']
    """
    n_keys = _require_int("n_keys", n_keys, 1, 64)
    n_values = _require_int("n_values", n_values, 1, 64)
    n_filler = _require_int("n_filler", n_filler, 1, 64)
    return (
        list(_COMMAND_WORDS)
        + [f"k{i}" for i in range(n_keys)]
        + [f"v{i}" for i in range(n_values)]
        + [f"w{i}" for i in range(n_filler)]
    )


def words(tokens: Iterable[str]) -> str:
    """A message content in the tokenizer's convention: words joined by single spaces.

    >>> words(["lookup", "k2"])
    'lookup k2'
    """
    return " ".join(tokens)


def suppressed_token_ids(tokenizer) -> list[int]:
    """Ids an assistant turn should never sample: everything but task words and ``<|im_end|>``.

    Pad, unknown, ``<|im_start|>``, the roles and ``"\\n"`` inside generated content would not
    survive TorchRL's decode -> parse -> re-encode round trip (or would read as padding).

    >>> suppressed_token_ids(make_tokenizer())
    [0, 1, 2, 4, 5, 6, 7, 8]
    """
    keep = {tokenizer.eos_token_id} | {
        i for t, i in tokenizer.get_vocab().items() if t.startswith("\u2581")
    }
    return sorted(i for i in range(len(tokenizer)) if i not in keep)


def make_tokenizer(n_keys: int = 8, n_values: int = 8, n_filler: int = 4):
    """A word-level ``PreTrainedTokenizerFast`` for the chat tool-use task, built in memory.

    Args:
        n_keys, n_values, n_filler: how many keys ``k0 ...``, values ``v0 ...`` and filler
            words ``w0 ...`` the vocabulary holds (each in ``[1, 64]``). An environment may use
            fewer; it may not use more.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` with ``pad_token="<pad>"`` (id 0),
        ``eos_token="<|im_end|>"``, ``padding_side="left"``, and TorchRL's ``chatml_format``
        chat template (with ``{% generation %}`` blocks). ``len(tokenizer)`` is
        ``12 + n_keys + n_values + n_filler`` (32 with the defaults).

    Example:
        >>> tok = make_tokenizer()
        >>> len(tok), tok.pad_token_id, tok.eos_token
        (32, 0, '<|im_end|>')
        >>> chat = [{"role": "user", "content": "k2 k0"}, {"role": "assistant", "content": "lookup k2"}]
        >>> out = tok.apply_chat_template(
        ...     chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        >>> tok.convert_ids_to_tokens(out["input_ids"])[-5:], out["assistant_masks"][-5:]
        (['\\n', '▁lookup', '▁k2', '<|im_end|>', '\\n'], [0, 1, 1, 0, 0])
        >>> from torchrl.data.llm import History
        >>> list(History.from_text(tok.decode(out["input_ids"]), chat_template_name="chatml_format").content)
        ['k2 k0', 'lookup k2']
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from torchrl.data.llm.history import _CHAT_TEMPLATES
    from transformers import PreTrainedTokenizerFast

    task = [f"\u2581{w}" for w in task_words(n_keys, n_values, n_filler)]
    vocab = {t: i for i, t in enumerate((*_SPECIAL, *_TEMPLATE_WORDS, *task))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    metaspace = {"replacement": "\u2581", "prepend_scheme": "always", "split": True}
    backend.pre_tokenizer = pre_tokenizers.Metaspace(**metaspace)
    backend.decoder = decoders.Metaspace(**metaspace)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL])
    # Roles and "\n" are added tokens: the template glues them to their neighbours.
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in _TEMPLATE_WORDS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        padding_side="left",
        # TorchRL picks a chat template from name_or_path; this name matches no model family.
        name_or_path="masked-rl-chat-words",
    )
    tokenizer.chat_template = _CHAT_TEMPLATES[CHAT_TEMPLATE_NAME]
    return tokenizer


SUPPRESSED_LOGIT = -1e4
"""The logit :class:`RestrictedHead` gives a suppressed id: ``exp`` of it is 0 in float32 and
bfloat16, and it stays finite, so ``p * log p`` (an entropy) is 0 there rather than NaN."""


class RestrictedHead(nn.Linear):
    """A bias-free output projection whose logits at ``suppressed`` ids are ``SUPPRESSED_LOGIT``.

    Generation with ``bad_words_ids`` samples from the softmax over the allowed ids only. A
    scoring pass over the plain head computes log-probs over the whole vocabulary instead, so a
    PPO ratio, a KL and an entropy bonus are taken over a distribution that was never sampled:
    nothing ever pushes the never-sampled ids down, and an entropy bonus over the whole vocabulary
    pushes them up. (Measured before this head existed: after 240k tokens of ``llm-train`` the
    policy put more than 99.9999 % of its probability on the 8 suppressed ids at every
    assistant token; the entropy it reported, 2.07 against ``ln 8 = 2.08``, was theirs.) With
    this head every forward computes the distribution generation draws from. The mask is a
    non-persistent buffer: state dicts are those of ``nn.Linear`` (``weight`` only), and the
    weight may stay tied to the input embeddings.

    Example:
        >>> head = RestrictedHead(4, 3, suppressed=[1])
        >>> logits = head(torch.ones(2, 4))
        >>> logits.softmax(-1)[:, 1].tolist()
        [0.0, 0.0]
    """

    def __init__(self, in_features: int, out_features: int, suppressed: Iterable[int]):
        super().__init__(in_features, out_features, bias=False)
        bias = torch.zeros(out_features)
        ids = torch.as_tensor(list(suppressed), dtype=torch.long)
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < out_features):
            raise ValueError(f"suppressed ids must be in [0, {out_features}), got {ids.tolist()}")
        bias[ids] = SUPPRESSED_LOGIT
        self.register_buffer("logit_bias", bias, persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden) + self.logit_bias.to(hidden.dtype)


def make_model(
    tokenizer,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    seed: int = 0,
    restrict_vocabulary: bool = True,
):
    """A randomly initialised ``LlamaForCausalLM`` whose vocabulary is ``tokenizer``'s.

    Args:
        tokenizer: the tokenizer (``len(tokenizer)`` sets the vocabulary size; its pad and eos
            ids go into the config and the generation config).
        hidden_size, num_layers, num_heads: width, depth and attention heads (``hidden_size``
            divisible by ``num_heads``).
        intermediate_size: MLP width (default ``4 * hidden_size``).
        max_position_embeddings: longest transcript the rotary embedding is configured for.
        seed: the initialisation seed (``torch.manual_seed`` inside a forked RNG state, so the
            caller's global RNG is untouched).
        restrict_vocabulary: the output head is a :class:`RestrictedHead` over
            :func:`suppressed_token_ids` (default), so the model's distribution is the one
            generation samples; ``False`` keeps Llama's plain head.

    Returns:
        ``LlamaForCausalLM`` in train mode, float32, on the CPU, with tied input and output
        embeddings (about 133k parameters with the defaults and the default tokenizer).

    Example:
        >>> import torch
        >>> tok = make_tokenizer()
        >>> model = make_model(tok, seed=0)
        >>> logits = model(torch.tensor([[2, 5, 8]])).logits
        >>> logits.shape
        torch.Size([1, 3, 32])
        >>> float(logits.softmax(-1)[..., suppressed_token_ids(tok)].sum())
        0.0
        >>> same = make_model(tok, seed=0)
        >>> all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters()))
        True
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    for name, value, low in (("hidden_size", hidden_size, 4), ("num_layers", num_layers, 1),
                             ("num_heads", num_heads, 1),
                             ("max_position_embeddings", max_position_embeddings, 8)):
        _require_int(name, value, low, 1 << 20)
    if hidden_size % num_heads:
        raise ValueError(
            f"hidden_size must be divisible by num_heads, got hidden_size={hidden_size}, "
            f"num_heads={num_heads}"
        )
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ValueError(
            "tokenizer must have a pad token distinct from its eos token, got "
            f"pad_token_id={tokenizer.pad_token_id}, eos_token_id={tokenizer.eos_token_id}"
        )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    if restrict_vocabulary:
        head = RestrictedHead(hidden_size, len(tokenizer), suppressed_token_ids(tokenizer))
        head.weight = model.get_input_embeddings().weight  # still tied
        model.lm_head = head
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model.train()
