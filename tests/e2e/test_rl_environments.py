"""`gyre rl` on environments users bring (a JSONL dataset, reasoning-gym, verifiers 0.4): real services, 2 steps each,
tiny model. The verifiers environment is the tests' own (tests/verifiers_envs/vf_gyre_tasks.py; no hub, no network).

Asserted from the artifacts: both steps trained, every sample's rollout dumped with what it trained with, the
samples page of `gyre report` drawn from those dumps, and (dataset run) W&B runs of both services, offline.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gyre.events import read_events
from gyre.rollouts import dumped_steps, read_dump

ROOT = Path(__file__).resolve().parents[2]
CI_CONFIG = ROOT / "configs/ci.toml"
DATASET = ROOT / "tests/unit/envs/data/reverse_words.jsonl"
VF_ENVS = ROOT / "tests/verifiers_envs"
pytestmark = pytest.mark.slow

KINDS = {
    "dataset": {"path": str(DATASET), "system_prompt": "Reverse the text."},
    "reasoning_gym:chain_sum": {"config": {"min_terms": 2, "max_terms": 2, "max_digits": 1}, "num_eval": 8},
    "verifiers:vf_gyre_tasks": {
        "taskset": {"source": "calculator", "fail_first": list(range(24))},  # every first episode raises
        "agent": {"harness": {"id": "vf_gyre_tasks", "turns": 2}},
        "num_eval": 4,
    },
}


@pytest.mark.timeout(900)  # three services + model init on 2 shared cores; a quiet machine needs a third of it
@pytest.mark.parametrize("name", sorted(KINDS))
def test_rl_trains_two_steps_on_each_kind(tmp_path, name):
    if name.startswith("reasoning_gym"):
        pytest.importorskip("reasoning_gym")
    if name.startswith("verifiers"):
        pytest.importorskip("verifiers.v1")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "gyre.cli", "rl", "@", str(CI_CONFIG), "--output-dir", str(out), "--max-steps", "2",
           "--orchestrator.env.name", name, "--orchestrator.env.args", json.dumps(KINDS[name]),
           "--orchestrator.rollouts.interval", "2"]  # fmt: skip
    wandb = name == "dataset" and importlib.util.find_spec("wandb") is not None
    if wandb:  # one of the runs also logs to Weights & Biases, offline
        cmd += ["--wandb.enabled", "true", "--wandb.mode", "offline"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(VF_ENVS), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=840, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stderr[-4000:]

    assert [t["step"] for t in read_events(out / "events/trainer_steps.jsonl")] == [1, 2]
    pushed = read_events(out / "events/orchestrator_steps.jsonl")
    assert [p["env"] for p in pushed] == [name, name]

    # step 1 always, then every rollouts.interval steps: one line per trained sample
    assert dumped_steps(out) == [1, 2]
    for step, p in zip((1, 2), pushed, strict=True):
        records = read_dump(out, step)
        assert len(records) == p["num_samples"]
        for r in records:
            assert r["step"] == step and r["prompt"][-1]["role"] == "user"
            assert r["completion"][0]["role"] == "assistant" and r["answer"]
            assert 0.0 <= r["reward"] <= 1.0 and r["min_version"] <= r["max_version"] <= step - 1
            assert isinstance(r["advantage"], float) and r["num_loss_tokens"] > 0
        rewards = [r["reward"] for r in records]
        assert abs(sum(rewards) / len(rewards) - p["reward_mean_trained"]) < 1e-9

    if name.startswith("verifiers"):  # episodes that raised were counted and generated again, not fatal
        assert sum(p["failed_rollouts"] for p in pushed) >= 1

    samples = (out / "samples.md").read_text()
    assert "## Step 2" in samples and "## Step 1" in samples
    assert read_dump(out, 2)[0]["task_id"] in samples

    if wandb:  # a run per service, with the step metrics and (orchestrator) the samples tables
        runs = {}
        for run_dir in (out / "wandb").glob("offline-run-*"):
            data = next(run_dir.glob("run-*.wandb")).read_bytes()
            runs["orchestrator" if b"orchestrator/reward_mean" in data else "trainer"] = (run_dir, data)
        assert set(runs) == {"orchestrator", "trainer"}
        assert b"trainer/loss" in runs["trainer"][1] or b"trainer/num_tokens" in runs["trainer"][1]
        assert len(list(runs["orchestrator"][0].glob("files/media/table/samples_*.table.json"))) == 2
