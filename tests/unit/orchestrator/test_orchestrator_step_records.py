"""A step's reward statistics (`StepRecords`): over which samples each figure is taken.

docs/orchestrator.md: `reward_mean` / `reward_std` of the step line and the `gyre_orchestrator_reward_*` gauges are
over every sample generated for the step, its dropped zero-signal groups included (filtering must not inflate the
learning curve); `reward_mean_trained` is over the batch; stale samples (an old policy's) are in neither.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from gyre.config import load_config
from gyre.config.orchestrator import OrchestratorConfig
from gyre_orchestrator.metrics import OrchestratorMetrics
from gyre_orchestrator.packing import TrainSample
from gyre_orchestrator.progress import ProgressStore
from gyre_orchestrator.records import StepRecords
from gyre_orchestrator.scheduler import Group, StepState


def scored(reward: float, tokens: int = 4):
    rollout = SimpleNamespace(num_completion_tokens=tokens, stop_reason="stop")
    return SimpleNamespace(reward=reward, rollout=rollout, score=SimpleNamespace(per_function={"r": reward}))


def trained(sample) -> TrainSample:
    meta = {"reward": sample.reward, "lag": 0, "min_version": 0, "max_version": 0, "env": "reverse_text",
            "rewards": {"r": sample.reward}}  # fmt: skip
    return TrainSample(np.arange(6), np.array([0, 0, 1, 1, 1, 1], bool), np.zeros(6), 0.0, meta)


def test_the_reward_figures_are_over_every_generated_sample_and_the_trained_mean_over_the_batch(tmp_path):
    kept = Group(step=1, task=SimpleNamespace(id="a"), samples=[scored(1.0), scored(0.0)], dispatched_version=0)
    dropped = Group(step=1, task=SimpleNamespace(id="b"), samples=[scored(0.0), scored(0.0)], dispatched_version=0)
    stale = scored(1.0)  # generated from a version below the floor: dropped, generated again
    st = StepState(step=1, floor=0, kept=[kept], dropped_zero_signal=1, dropped_stale=1,
                   all_rewards=[*kept.rewards, *dropped.rewards], finished=[kept, dropped],
                   wasted=[*dropped.samples, stale], first_dispatch=0.0, closed_at=1.0)  # fmt: skip
    cfg = load_config(OrchestratorConfig, [], output_dir=str(tmp_path))
    metrics = OrchestratorMetrics("t")
    records = StepRecords(cfg, metrics=metrics, wandb=SimpleNamespace(log=lambda *a, **k: None),
                          progress=ProgressStore(tmp_path / "progress"), signals={}, teacher=None)  # fmt: skip
    samples = [trained(s) for s in kept.samples]
    record = records.record(st, samples, SimpleNamespace(num_rows=1, efficiency=1.0), 0, 0.0, 0, {})

    generated = [1.0, 0.0, 0.0, 0.0]  # the kept group and the dropped one; not the stale sample
    assert record["reward_mean"] == pytest.approx(0.25) and record["reward_std"] == pytest.approx(np.std(generated))
    assert record["reward_mean_trained"] == pytest.approx(0.5)
    entry = record["envs"]["reverse_text"]
    assert (entry["reward_mean"], entry["reward_std"]) == (record["reward_mean"], record["reward_std"])
    assert (entry["generated_groups"], entry["dropped_zero_signal"], entry["num_groups"]) == (2, 1, 1)
    assert record["generated_tokens"] == 5 * 4 and record["wasted_tokens"] == 3 * 4

    records.account(st, record, [0, 0], ({}, 0))
    labels = {"run_id": "t", "env": "reverse_text"}
    assert metrics.registry.get_sample_value("gyre_orchestrator_reward_mean", labels) == pytest.approx(0.25)
    assert metrics.registry.get_sample_value("gyre_orchestrator_reward_std", labels) == pytest.approx(np.std(generated))
    # what the gauges' help says (Prometheus' # HELP, Grafana's tooltip): not "the last batch", whose mean is 0.5
    helps = {m.name: m.documentation for m in metrics.registry.collect()}
    for name in ("gyre_orchestrator_reward_mean", "gyre_orchestrator_reward_std"):
        assert "generated" in helps[name] and "zero-signal groups included" in helps[name], helps[name]
