"""Fixtures of the trainer-core tests: the session's tiny model (tests/conftest.py) loaded fresh per test."""

from __future__ import annotations

import pytest
import torch
from gyre.config.shared import ModelConfig
from gyre_trainer.model import load_model


@pytest.fixture(scope="session", autouse=True)
def _few_threads():
    # Shared 2-core machines: with other test processes busy, a second OpenMP thread mostly spins
    # (a 78x128x1024 matmul measured 70 ms on 2 threads vs 3 ms on 1 under load).
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def tiny_llama(tiny_model):
    """The tiny model (tests/conftest.py) loaded in float32 on CPU, training mode."""
    return load_model(ModelConfig(name=str(tiny_model)), "cpu")


@pytest.fixture
def tiny_llama64(tiny_model):
    """The tiny model in float64: gradient comparisons at 1e-6 relative tolerance need it."""
    return load_model(ModelConfig(name=str(tiny_model)), "cpu", torch.float64)
