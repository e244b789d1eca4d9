"""Every ``>>>`` example in the library's docstrings runs and prints what it shows."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import masked_rl
import masked_rl_envs
import masked_rl_examples.llm_ppo
import masked_rl_examples.ppo_tool_use

MODULES = sorted(
    name
    for package in (masked_rl, masked_rl_envs, masked_rl_examples.ppo_tool_use,
                    masked_rl_examples.llm_ppo)
    for name in [package.__name__]
    + [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]
)


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples_run(module_name):
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, module_name, globs=dict(vars(module))):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {module_name}"


def test_the_public_api_has_examples():
    """The public entry points each show a runnable example."""
    for name in masked_rl.__all__:
        assert ">>>" in (getattr(masked_rl, name).__doc__ or ""), name
