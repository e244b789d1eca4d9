"""Shared fixtures."""

import os

# numba reads this once, at import: two threads even on a one-core machine, so that the tests
# of the parallel CPU kernel run it on two threads (and child processes inherit it).
os.environ.setdefault("NUMBA_NUM_THREADS", "2")

import pytest  # noqa: E402
import torch  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    """Every test taking ``device`` runs on the CPU, and on CUDA where a GPU is present."""
    return torch.device(request.param)
