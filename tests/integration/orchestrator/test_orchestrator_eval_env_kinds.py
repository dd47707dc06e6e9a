"""`gyre eval` on each kind of environment (built-in, JSONL dataset, reasoning-gym, verifiers) against real replicas."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gyre.events import read_events

ROOT = Path(__file__).resolve().parents[3]
DATASET = ROOT / "tests/unit/envs/data/reverse_words.jsonl"
VF_ENVS = ROOT / "tests/verifiers_envs"  # the tests' own verifiers environment (no hub, no network)

KINDS = {
    "reverse_text": {},
    "dataset": {"path": str(DATASET), "system_prompt": "Reverse the text.", "reward": "exact"},
    "reasoning_gym:chain_sum": {"config": {"min_terms": 2, "max_terms": 2, "max_digits": 1}, "num_eval": 4},
    "verifiers:vf_gyre_tasks": {"taskset": {"source": "calculator"}, "num_eval": 4},
}


@pytest.mark.parametrize("name", sorted(KINDS))
def test_gyre_eval_runs_on_each_kind(tmp_path, replicas, name):
    if name.startswith("reasoning_gym"):
        pytest.importorskip("reasoning_gym")
    if name.startswith("verifiers"):
        pytest.importorskip("verifiers.v1")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "gyre.cli", "eval", "--output-dir", str(out), "--env.name", name,
           "--env.args", json.dumps(KINDS[name]), "--inference.urls", json.dumps([replicas[0].url]),
           "--inference.control-urls", json.dumps([replicas[0].control]), "--eval.num-examples", "4",
           "--eval.k", "2", "--eval.temperature", "1.0", "--sampling.max-tokens", "8"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(VF_ENVS), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    printed = json.loads(res.stdout.strip().splitlines()[-1])
    assert printed["env"] == name and printed["num_examples"] == 4 and printed["k"] == 2
    assert 0.0 <= printed["avg_at_k"] <= 1.0 and 0.0 <= printed["pass_at_k"] <= 1.0
    assert read_events(out / "events/eval.jsonl")[-1]["avg_at_k"] == printed["avg_at_k"]


def test_gyre_eval_on_an_unknown_environment_lists_the_available_ones(tmp_path):
    cmd = [sys.executable, "-m", "gyre.cli", "eval", "--output-dir", str(tmp_path), "--env.name", "reverse_txt"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode != 0
    assert "unknown environment 'reverse_txt'" in res.stderr
    assert all(name in res.stderr for name in ("reverse_text", "dataset", "reasoning_gym:<name>"))


def test_gyre_eval_scores_with_the_configured_judges(tmp_path, replicas):
    # the training eval scores with [[judges]] added to the rubric; gyre eval ignored them (same config, other score)
    from support.judge_server import ScriptedServer

    with ScriptedServer() as judge:  # answers "5" unless scripted otherwise
        judges = [{"name": "style", "url": judge.url, "weight": 0.5, "prompt": "Grade: {response}"}]
        cmd = [sys.executable, "-m", "gyre.cli", "eval", "--output-dir", str(tmp_path / "run"),
               "--judges", json.dumps(judges), "--env.name", "reverse_text",
               "--inference.urls", json.dumps([replicas[0].url]),
               "--inference.control-urls", json.dumps([replicas[0].control]), "--eval.num-examples", "2",
               "--eval.k", "2", "--eval.temperature", "1.0", "--sampling.max-tokens", "4"]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    printed = json.loads(res.stdout.strip().splitlines()[-1])
    assert printed["rewards_mean"]["style"] == 0.5
    assert printed["avg_at_k"] == pytest.approx(printed["rewards_mean"]["lcs_reward"] + 0.5 * 0.5)
    asked = [body["messages"][-1]["content"] for kind, body in judge.requests if kind == "chat"]
    assert asked and all(a.startswith("Grade: ") for a in asked)
