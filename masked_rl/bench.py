"""Deprecated: the benchmark moved out of the library to ``masked_rl_benchmarks.bench``.

``masked-rl bench`` is unchanged; ``python -m masked_rl.bench`` and ``import masked_rl.bench``
keep working with a ``DeprecationWarning`` and will be removed in a later release.
"""

import warnings

warnings.warn("masked_rl.bench moved to masked_rl_benchmarks.bench (command: masked-rl bench)",
              DeprecationWarning, stacklevel=2)

from masked_rl_benchmarks.bench import *  # noqa: E402,F401,F403
from masked_rl_benchmarks.bench import main  # noqa: E402,F401

if __name__ == "__main__":
    raise SystemExit(main())
