"""Deprecated: the ``masked-rl`` command line moved to ``masked_rl_examples.cli``.

The ``masked-rl`` command is unchanged; ``python -m masked_rl.cli`` and ``masked_rl.cli.main``
keep working with a ``DeprecationWarning`` and will be removed in a later release.
"""

import warnings

warnings.warn("masked_rl.cli moved to masked_rl_examples.cli (command: masked-rl)",
              DeprecationWarning, stacklevel=2)

from masked_rl_examples.cli import main  # noqa: E402,F401

if __name__ == "__main__":
    raise SystemExit(main())
