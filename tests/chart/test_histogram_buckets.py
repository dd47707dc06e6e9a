"""The duration histograms' buckets cover what a large model really takes, finely enough to read quantiles.

A duration past the last finite bucket lands in +Inf: `histogram_quantile` then answers the last finite bound
(or +Inf), so the dashboards' p99 of a 70B checkpoint said "120 s" while saves took half an hour. Each
duration histogram of the services, as their metrics classes create it, must reach the slowest real case
(docs/metrics.md, "Histogram buckets") with neighbouring bounds at most 3x apart above one second.
"""

from __future__ import annotations

import pytest
from chart_testlib import ROOT

PARAMS_70B = 70e9
VOLUME_BYTES_PER_S = 250e6  # a shared ReadWriteMany volume (NFS, EFS, Filestore) under one writer
# bf16 weights, gathered and written once per published version (and read back by every replica)
PUBLISH_S = PARAMS_70B * 2 / VOLUME_BYTES_PER_S
# bf16 weights + fp32 master weights + Adam's two fp32 moments: 14 bytes a parameter
CHECKPOINT_S = PARAMS_70B * 14 / VOLUME_BYTES_PER_S
SLOWEST = {
    "gyre_trainer_checkpoint_seconds": CHECKPOINT_S,  # ~65 min
    "gyre_trainer_weight_publish_seconds": 2 * PUBLISH_S,  # gather + write, ~19 min
    "gyre_inference_weight_update_seconds": 2 * PUBLISH_S,  # read + verify + swap
    "gyre_orchestrator_weight_relay_duration_seconds": 2 * PUBLISH_S,  # every replica's load
    "gyre_trainer_step_duration_seconds": 30 * 60,  # a 70B step on a long-context batch
    "gyre_orchestrator_rollout_latency_seconds": 30 * 60,  # a multi-turn rollout with tools
}


@pytest.fixture(scope="module")
def histograms() -> dict[str, tuple[float, ...]]:
    """{name: finite upper bounds} of every duration histogram the services' metrics classes create."""
    from gyre import metrics
    from gyre_inference.metrics import InferenceMetrics
    from gyre_inference.torch_backend import TorchBackend
    from gyre_orchestrator.metrics import OrchestratorMetrics
    from gyre_trainer.metrics import TrainerMetrics

    backend = TorchBackend(ROOT / "no-model-needed", device="cpu", dtype="float32")  # loads nothing
    registries = [
        TrainerMetrics("buckets").registry,
        OrchestratorMetrics("buckets").registry,
        InferenceMetrics("buckets", backend).registry,
    ]
    found = {}
    for registry in registries:
        for name, (kind, labels, metric) in metrics._made.get(registry, {}).items():
            if kind == "histogram" and name.endswith("_seconds"):
                bounds = metric.labels(*["x"] * len(labels))._upper_bounds
                found[name] = tuple(b for b in bounds if b != float("inf"))
    return found


def test_every_duration_histogram_is_sized(histograms):
    # a new duration histogram needs its slowest case stated here (or an explicit reason it has none)
    sized = set(SLOWEST) | {"gyre_inference_time_to_first_token_seconds", "gyre_inference_request_latency_seconds"}
    assert set(histograms) == sized


@pytest.mark.parametrize("name", sorted(SLOWEST))
def test_the_slowest_real_case_lands_in_a_finite_bucket(histograms, name):
    assert histograms[name][-1] >= SLOWEST[name], (
        f"{name}: last bucket {histograms[name][-1]} s < {SLOWEST[name]:.0f} s"
    )


@pytest.mark.parametrize("name", sorted(SLOWEST))
def test_bounds_are_close_enough_for_quantiles(histograms, name):
    bounds = histograms[name]
    assert list(bounds) == sorted(set(bounds))
    wide = [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if a >= 1 and b / a > 3]
    assert not wide, f"{name}: neighbouring bounds more than 3x apart: {wide}"
