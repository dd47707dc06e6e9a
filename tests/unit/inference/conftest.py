"""Fixtures of the inference unit tests (the tiny model itself comes from tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model_text(tiny_model):
    from gyre_inference.text import ModelText

    return ModelText(tiny_model)
