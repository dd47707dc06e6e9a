"""Fixtures of the trainer service integration tests (real Redis and the tiny model come from tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture
def isolated_torch_state():
    """For trainers run inside the test process: one thread, and deterministic mode switched back off."""
    import torch

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)
