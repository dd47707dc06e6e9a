"""The tiny model for the inference unit tests (created once per session, shared with integration tests)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from gyre.model_init import init_model

    path = tmp_path_factory.getbasetemp() / "inference-tiny-model"
    if not (path / "config.json").exists():
        init_model(path, preset="tiny", seed=0)
    return path


@pytest.fixture(scope="session")
def model_text(tiny_model):
    from gyre_inference.text import ModelText

    return ModelText(tiny_model)
