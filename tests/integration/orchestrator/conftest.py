"""Fixtures of the orchestrator's integration tests: the tiny model and `gyre inference` replicas.

Two inference replicas are shared by the session (`replicas`); each test gets them back on the base
model (ReloadWeights) so versions never leak between tests. A test that kills a replica starts its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from orchestrator_testlib import InferenceReplica


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from gyre.model_init import init_model

    path = tmp_path_factory.getbasetemp() / "orchestrator-tiny-model"
    if not (path / "config.json").exists():
        init_model(path, preset="tiny", seed=0)
    return path


@pytest.fixture(scope="session")
def start_replica(tiny_model, tmp_path_factory):
    """Factory for replicas that live until the end of the session (or until the test kills them)."""
    started: list[InferenceReplica] = []
    log_dir = tmp_path_factory.mktemp("orchestrator-inference-logs")

    def start(*args: str, model: Path | None = None) -> InferenceReplica:
        replica = InferenceReplica(model or tiny_model, log_dir, *args)
        started.append(replica)
        return replica

    yield start
    for replica in started:
        replica.stop()


@pytest.fixture(scope="session")
def shared_replicas(start_replica) -> list[InferenceReplica]:
    return [start_replica(), start_replica()]


@pytest.fixture
def replicas(shared_replicas) -> list[InferenceReplica]:
    """The two shared replicas, serving the base model (version 0) when the test starts."""
    for r in shared_replicas:
        r.reload_base()
    return shared_replicas
