"""Fixtures of the trainer service unit tests: one tiny model folder per session, a single-process context."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from gyre.model_init import init_model

    return init_model(tmp_path_factory.mktemp("model") / "tiny", preset="tiny", seed=0)


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
