"""Every ``>>>`` example in the library's docstrings runs and prints what it shows."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import masked_rl
import masked_rl_envs
import masked_rl_examples.ppo_tool_use

DEPRECATED_ALIASES = ("masked_rl.bench", "masked_rl.cli")  # tested in test_deprecated_aliases_still_work
MODULES = sorted(
    name
    for package in (masked_rl, masked_rl_envs, masked_rl_examples.ppo_tool_use)
    for name in [package.__name__]
    + [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]
    if name not in DEPRECATED_ALIASES
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


def test_deprecated_aliases_still_work():
    """The modules that left the library keep their old import paths, with a warning."""
    import sys

    for name in DEPRECATED_ALIASES:
        sys.modules.pop(name, None)
        with pytest.warns(DeprecationWarning, match="moved to"):
            module = importlib.import_module(name)
        assert callable(module.main)
    from masked_rl_benchmarks.bench import make_workload

    assert sys.modules["masked_rl.bench"].make_workload is make_workload
