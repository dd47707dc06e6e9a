"""`gyre rl` with `[[runs]]` end to end: two runs on one trainer and one inference server.

configs/multirun/two_runs.toml cut down (no SFT, 3 and 2 steps): every run trains exactly its own steps
into its own folder, publishes its adapter alone, and its orchestrator brought the replica's adapter
of that run (and only that run) to the final version; a re-run of a finished experiment does nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gyre.events import read_events
from gyre.weights import WeightStore

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/multirun/two_runs.toml"
RUNS = [{"name": "alpha"}, {"name": "beta", "max_steps": 2, "trainer": {"lora": {"rank": 8, "alpha": 16}}}]
pytestmark = pytest.mark.slow


def gyre_rl(out: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gyre.cli", "rl", "@", str(CONFIG), "--output-dir", str(out), "--sft.enabled",
           "false", "--max-steps", "3", "--runs", json.dumps(RUNS), "--orchestrator.eval.interval", "null"]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)


def test_two_runs_share_one_trainer_and_one_replica(tmp_path):
    out = tmp_path / "multi"
    res = gyre_rl(out)
    assert res.returncode == 0, res.stderr[-4000:]
    for name, steps in (("alpha", 3), ("beta", 2)):
        run = out / "runs" / name
        assert [r["step"] for r in read_events(run / "events" / "trainer_steps.jsonl")] == list(range(1, steps + 1))
        assert [r["step"] for r in read_events(run / "events" / "orchestrator_steps.jsonl")] == list(
            range(1, steps + 1)
        )
        store = WeightStore(run / "weights")
        assert store.latest() == steps
        assert sorted(p.name for p in store.path(steps).iterdir() if p.suffix != ".json") == [
            "adapter_model.safetensors"
        ]
        relayed = read_events(run / "events" / "weight_relay.jsonl")
        assert relayed and all(r["ok"] for r in relayed) and max(r["step"] for r in relayed) == steps
    assert not (out / "weights").exists()  # nothing is published outside the runs' folders
    again = gyre_rl(out)
    assert again.returncode == 0 and "already finished" in again.stdout
