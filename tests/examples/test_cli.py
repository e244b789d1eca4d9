"""The ``masked-rl`` entry point's process-wide settings."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = ("import logging, masked_rl_examples.cli, torchrl; "
          "print(logging.getLevelName(logging.getLogger('torchrl').level))")


@pytest.mark.parametrize("preset, level", [(None, "WARNING"), ("INFO", "INFO")])
def test_torchrl_info_lines_are_off_unless_asked_for(preset, level):
    env = {k: v for k, v in os.environ.items() if k != "RL_LOGGING_LEVEL"}
    if preset is not None:
        env["RL_LOGGING_LEVEL"] = preset
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out.split()[-1] == level
