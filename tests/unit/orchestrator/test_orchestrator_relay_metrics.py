"""The relay's `gyre_orchestrator_latest_weights_step` series exists from the start (the base model, 0)."""

from __future__ import annotations

from gyre.transport import FolderStore
from gyre_orchestrator.metrics import OrchestratorMetrics
from gyre_orchestrator.relay import WeightRelay
from gyre_orchestrator.replicas import ReplicaSet, static_endpoints
from gyre_orchestrator.scheduler import VersionWatch


def test_the_latest_weights_series_exists_before_the_first_publish(tmp_path):
    # it appeared only once a version was learned: a short run scraped before its first publish showed no series,
    # and the GyreReplicaBehindAsyncBound alert (which reads it) saw no run at all
    metrics = OrchestratorMetrics("exp")
    replicas = ReplicaSet(static_endpoints(["http://127.0.0.1:9"], None, 9))
    WeightRelay(replicas, FolderStore(tmp_path), VersionWatch(0), metrics=metrics)
    value = metrics.registry.get_sample_value("gyre_orchestrator_latest_weights_step", {"run_id": "exp"})
    assert value == 0.0
