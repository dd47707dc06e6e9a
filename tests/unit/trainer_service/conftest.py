"""Fixtures of the trainer service unit tests: a single-process context (the tiny model: tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def ctx():
    from gyre_trainer.dist import DistContext

    return DistContext(device=torch.device("cpu"))


@pytest.fixture(autouse=True)
def _few_threads():
    # the machine is shared: heavy tests must not grab every core
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
