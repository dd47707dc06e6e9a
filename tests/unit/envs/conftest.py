"""Fixtures of the environment tests; the fake model client lives in envs_doubles.py."""

import pytest
from gyre.envs import SamplingParams


@pytest.fixture
def sampling() -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=64, seed=7)
