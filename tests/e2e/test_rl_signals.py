"""`gyre rl` with other models beside the policy: a teacher and a judge served by `[[servers]]`, end to end.

The teacher and the judge serve the tiny base model the run creates (its own folder, so the server starts with
the run): at step 1 the trainer's weights are still the base model's, so the reverse KL to the teacher is 0 up
to numerics; the judge (weight 0) is logged in every sample's rewards without changing the reward.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gyre.events import read_events

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_rl_starts_a_teacher_and_a_judge_beside_the_policy(tmp_path):
    out = tmp_path / "run"
    model = tmp_path / "base"
    subprocess.run([sys.executable, "-m", "gyre.cli", "model", "init", "--output-dir", str(model), "--preset", "tiny"],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    judge = {"name": "judge", "url": "server:base", "weight": 0.0, "score": "json", "structured": True,
             "max_tokens": 12, "prompt": "Grade: {response}"}  # fmt: skip
    cmd = [sys.executable, "-m", "gyre.cli", "rl", "@", str(ROOT / "configs/ci.toml"), "--output-dir", str(out),
           "--max-steps", "2", "--model.name", str(model), "--model.init-preset", "null",
           "--servers", json.dumps([{"name": "base", "model": str(model)}]),
           "--orchestrator.teacher", json.dumps({"url": "server:base"}),
           "--orchestrator.judges", json.dumps([judge]),
           "--trainer.loss.distill", "1.0", "--trainer.loss.reward-weight", "0.5"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-4000:]

    trainer = read_events(out / "events" / "trainer_steps.jsonl")
    assert [e["step"] for e in trainer] == [1, 2]
    assert abs(trainer[0]["teacher_kl"]) < 1e-3  # the student's weights are the teacher's at step 1
    steps = read_events(out / "events" / "orchestrator_steps.jsonl")
    assert steps[0]["signals"]["teacher"]["ok"] >= 1 and steps[0]["scoring_failures"] == 0
    assert "judge" in steps[0]["rewards_mean"]
    records = [json.loads(line) for line in (out / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert all(r["reward"] == r["rewards"]["lcs_reward"] for r in records)  # weight 0: logged, not rewarded
    assert (out / "logs" / "server-base.log").exists() and (out / "configs" / "server-base.toml").exists()
