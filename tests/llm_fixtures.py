"""Pytest fixtures for the language-model tests: the in-memory tokenizer and a tiny model.

Import the fixtures into a test module (``from llm_fixtures import llm_tokenizer, llm_model``);
``tests/`` is on pytest's ``pythonpath``.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def llm_tokenizer():
    """:func:`masked_rl_envs.llm_factories.make_tokenizer` with its defaults (32 tokens)."""
    from masked_rl_envs.llm_factories import make_tokenizer

    return make_tokenizer()


@pytest.fixture()
def llm_model(llm_tokenizer):
    """A fresh 2-layer, 32-wide ``LlamaForCausalLM`` (seed 0), in eval mode: one per test, so
    a test may train it."""
    from masked_rl_envs.llm_factories import make_model

    return make_model(llm_tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=0).eval()
