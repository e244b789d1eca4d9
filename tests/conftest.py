"""Shared fixtures."""

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    """Every test taking ``device`` runs on the CPU, and on CUDA where a GPU is present."""
    return torch.device(request.param)
