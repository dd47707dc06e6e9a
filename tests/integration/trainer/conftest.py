"""Fixtures of the trainer service integration tests (real Redis comes from tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The `tiny` preset (about 1M parameters) made by `gyre model init`, shared by the session."""
    from gyre.model_init import init_model

    return init_model(tmp_path_factory.mktemp("model") / "tiny", preset="tiny", seed=0)


@pytest.fixture
def isolated_torch_state():
    """For trainers run inside the test process: one thread, and deterministic mode switched back off."""
    import torch

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)
