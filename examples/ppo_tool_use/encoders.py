"""Token-window encoders that can find a token anywhere in a long window.

:class:`AttentionWindowEncoder` has the interface of ``TokenWindowEncoder`` in ``utils.py``
(``tokens [*B, W] integers -> [*B, hidden]``, same constructor arguments first): pass either as
the recipe's encoder. This module imports only torch: copy it with the recipe.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class AttentionWindowEncoder(nn.Module):
    """Features of the observation window: a few rounds of attention from learned queries.

    The MLP encoder gives every window position its own weights, so it can read a token at a
    fixed offset from the window's end but not "the value that follows key ``k``" wherever it
    sits. Here every position ``p`` of the window is one vector

        ``x_p = E[token_p] + F[token_{p-1}] + P[p]``

    (``embed_dim`` wide: the token, the token before it, and a learned embedding of the position,
    counted from the window's end since windows are right-aligned), and ``rounds`` rounds of
    attention read it. In round ``r``, ``heads`` queries ``q = Q_r + L_r(c_r)`` (learned vectors
    plus a linear function of a context: the last position's ``x``, and then also the previous
    rounds' outputs) each take the softmax-weighted mean ``s = sum_p a_p x_p`` with
    ``a = softmax_p(q . x_p / sqrt(embed_dim))``. The previous-token term makes "the token after
    marker ``X``" one query; a later round can look up what an earlier one found (the key asked,
    then the value after that key). A tanh MLP (``layers`` layers of ``hidden``) maps the last
    position's ``x`` and every round's outputs to the features.

    Keys and values are ``x`` itself (key and value projections would fold into the query and
    the MLP), so ``q . x_p`` splits into per-vocabulary tables gathered by token, and ``s`` into
    per-token sums of the weights (a scatter over the window) times the embedding tables: no
    ``[*B, W, embed_dim]`` tensor is built. Per window and round: ``O(W * heads * embed_dim)``
    multiply-adds and ``O(W * heads)`` memory. Large batches (the critic over a whole collected
    batch) are processed ``chunk_size`` windows at a time to bound memory.

    Args:
        vocab_size (int): token ids are in ``[0, vocab_size)``.
        window (int): observation length ``W``.
        embed_dim (int): width ``d`` of the token, previous-token and position embeddings.
        hidden (int): hidden units per layer of the output MLP (the feature size).
        layers (int): tanh layers of the output MLP (``>= 1``).

    Keyword Args:
        heads (int): queries per round. Defaults to ``4``.
        rounds (int): attention rounds. Defaults to ``2``.
        chunk_size (int): windows per chunk. Defaults to ``4096``.

    Shapes: ``tokens`` ``[*B, W]`` (any integer dtype) -> ``[*B, hidden]``.

    Examples:
        >>> import torch
        >>> from masked_rl_examples.ppo_tool_use.encoders import AttentionWindowEncoder
        >>> encoder = AttentionWindowEncoder(vocab_size=17, window=64, embed_dim=16, hidden=64, layers=1)
        >>> encoder(torch.randint(17, (8, 5, 64))).shape
        torch.Size([8, 5, 64])
    """

    def __init__(
        self,
        vocab_size: int,
        window: int,
        embed_dim: int,
        hidden: int,
        layers: int,
        *,
        heads: int = 4,
        rounds: int = 2,
        chunk_size: int = 4096,
    ):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("window", window), ("embed_dim", embed_dim),
                            ("hidden", hidden), ("layers", layers), ("heads", heads),
                            ("rounds", rounds), ("chunk_size", chunk_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.window, self.heads, self.embed_dim, self.chunk_size = window, heads, embed_dim, chunk_size
        self.token = nn.Embedding(vocab_size, embed_dim)
        self.previous = nn.Embedding(vocab_size, embed_dim)
        self.position = nn.Parameter(torch.randn(window, embed_dim) / math.sqrt(embed_dim))
        # Small initial queries: attention starts close to uniform over the window.
        self.queries = nn.Parameter(torch.randn(rounds, heads, embed_dim) * 0.1)
        self.contexts = nn.ModuleList(
            nn.Linear(embed_dim * (1 + r * heads), heads * embed_dim) for r in range(rounds)
        )
        for context in self.contexts:
            nn.init.normal_(context.weight, std=0.1 / math.sqrt(context.in_features))
            nn.init.zeros_(context.bias)
        sizes = [embed_dim * (1 + rounds * heads)] + [hidden] * layers
        body = []
        for n_in, n_out in zip(sizes[:-1], sizes[1:]):
            linear = nn.Linear(n_in, n_out)
            nn.init.orthogonal_(linear.weight, gain=2**0.5)
            nn.init.zeros_(linear.bias)
            body += [linear, nn.Tanh()]
        self.mlp = nn.Sequential(*body)

    def forward(self, tokens: Tensor) -> Tensor:
        if tokens.ndim < 1 or tokens.shape[-1] != self.window:
            raise ValueError(
                f"tokens must have shape [*B, {self.window}] (the window), got {list(tokens.shape)}"
            )
        batch_shape = tokens.shape[:-1]
        flat = tokens.reshape(-1, self.window).long()
        if flat.shape[0] <= self.chunk_size:
            features = self._encode(flat)
        else:
            features = torch.cat([self._encode(chunk) for chunk in flat.split(self.chunk_size)])
        return features.reshape(*batch_shape, features.shape[-1])

    def _encode(self, tokens: Tensor) -> Tensor:
        n, width = tokens.shape
        vocab = self.token.num_embeddings
        previous = torch.cat((tokens.new_zeros(n, 1), tokens[:, :-1]), dim=1)  # <pad> before the window
        last = self.token(tokens[:, -1]) + self.previous(previous[:, -1]) + self.position[-1]
        # One id per (token, previous token) pair: one gather and one scatter per round, over
        # [n, heads, W] with the window innermost (contiguous softmax, gather and scatter).
        pair = (tokens * vocab + previous).unsqueeze(1).expand(n, self.heads, width)
        summaries = [last]
        for queries, context in zip(self.queries, self.contexts):
            q = queries + context(torch.cat(summaries, -1)).view(n, self.heads, self.embed_dim)
            q = q / math.sqrt(self.embed_dim)
            # scores[b, h, p] = q[b, h] . x[b, p], term by term of x = E[token] + F[previous] + P.
            pair_scores = (q @ self.token.weight.T).unsqueeze(-1) + (q @ self.previous.weight.T).unsqueeze(-2)
            scores = (q @ self.position.T).add_(pair_scores.view(n, self.heads, vocab * vocab).gather(2, pair))
            weights = scores.softmax(dim=-1)
            # s[b, h] = sum_p a[b, h, p] x[b, p]: the weights summed per pair id, times the tables.
            per_pair = weights.new_zeros(n, self.heads, vocab * vocab).scatter_add_(2, pair, weights)
            per_pair = per_pair.view(n, self.heads, vocab, vocab)
            summary = (weights @ self.position
                       + per_pair.sum(-1) @ self.token.weight
                       + per_pair.sum(-2) @ self.previous.weight)
            summaries.append(summary.reshape(n, self.heads * self.embed_dim))
        return self.mlp(torch.cat(summaries, -1))
