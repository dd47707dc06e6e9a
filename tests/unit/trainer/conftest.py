"""Fixtures of the trainer-core tests: one tiny model made by `gyre model init`, loaded fresh per test."""

from __future__ import annotations

import pytest
import torch
from gyre.config.shared import ModelConfig
from gyre.model_init import init_model
from gyre_trainer.model import load_model


@pytest.fixture(scope="session", autouse=True)
def _few_threads():
    # Shared 2-core machines: with other test processes busy, a second OpenMP thread mostly spins
    # (a 78x128x1024 matmul measured 70 ms on 2 threads vs 3 ms on 1 under load).
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("trainer-core") / "model", preset="tiny", seed=0)


@pytest.fixture
def tiny_model(tiny_model_dir):
    """The tiny Llama in float32 on CPU, training mode."""
    return load_model(ModelConfig(name=str(tiny_model_dir)), "cpu")


@pytest.fixture
def tiny_model64(tiny_model_dir):
    """The tiny Llama in float64: gradient comparisons at 1e-6 relative tolerance need it."""
    return load_model(ModelConfig(name=str(tiny_model_dir)), "cpu", torch.float64)
