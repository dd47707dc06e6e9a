"""Fixtures of the orchestrator's integration tests: `gyre inference` replicas of the tiny model.

Two inference replicas are shared by the session (`replicas`); each test gets them back on the base
model (ReloadWeights) so versions never leak between tests. A test that kills a replica starts its own.
"""

from __future__ import annotations

import pytest
from support.inference import InferenceServer


@pytest.fixture(scope="session")
def start_replica(start_inference):
    """start_replica(*args, model=None): `start_inference` (tests/conftest.py), replicas living until the session
    ends (or until the test kills them)."""
    return start_inference


@pytest.fixture(scope="session")
def shared_replicas(start_replica) -> list[InferenceServer]:
    return [start_replica(), start_replica()]


@pytest.fixture
def replicas(shared_replicas) -> list[InferenceServer]:
    """The two shared replicas, serving the base model (version 0) when the test starts."""
    for r in shared_replicas:
        r.reload_base()
    return shared_replicas
