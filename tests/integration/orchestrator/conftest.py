"""Fixtures of the orchestrator's integration tests: `gyre inference` replicas of the tiny model.

Two inference replicas are shared by the session (`replicas`); each test gets them back on the base
model (ReloadWeights) so versions never leak between tests. A test that kills a replica starts its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.inference import InferenceServer


@pytest.fixture(scope="session")
def start_replica(tiny_model, tmp_path_factory):
    """Factory for replicas that live until the end of the session (or until the test kills them)."""
    started: list[InferenceServer] = []
    log_dir = tmp_path_factory.mktemp("orchestrator-inference-logs")

    def start(*args: str, model: Path | None = None) -> InferenceServer:
        replica = InferenceServer(model or tiny_model, *args, log_dir=log_dir)
        started.append(replica)
        return replica

    yield start
    for replica in started:
        replica.stop()


@pytest.fixture(scope="session")
def shared_replicas(start_replica) -> list[InferenceServer]:
    return [start_replica(), start_replica()]


@pytest.fixture
def replicas(shared_replicas) -> list[InferenceServer]:
    """The two shared replicas, serving the base model (version 0) when the test starts."""
    for r in shared_replicas:
        r.reload_base()
    return shared_replicas
