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


def _judge_app(asked: list[str]):
    """An OpenAI-compatible judge that grades everything 7/10 (real HTTP, the test's own process)."""

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"].endswith("/models"):
            answer = {"object": "list", "data": [{"id": "judge", "object": "model", "created": 0, "owned_by": "t"}]}
        else:
            asked.append(json.loads(body)["messages"][-1]["content"])
            answer = {"id": "j", "object": "chat.completion", "created": 0, "model": "judge",
                      "choices": [{"index": 0, "finish_reason": "stop",
                                   "message": {"role": "assistant", "content": "Score: 7/10"}}]}  # fmt: skip
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})

    return app


def test_gyre_eval_scores_with_the_configured_judges(tmp_path, replicas):
    # the training eval scores with [[judges]] added to the rubric; gyre eval ignored them (same config, other score)
    from gyre.net import free_port
    from support.asgi import serving

    port, asked = free_port(), []
    judges = [{"name": "style", "url": f"http://127.0.0.1:{port}", "weight": 0.5, "prompt": "Grade: {response}"}]
    cmd = [sys.executable, "-m", "gyre.cli", "eval", "--output-dir", str(tmp_path / "run"),
           "--judges", json.dumps(judges), "--env.name", "reverse_text",
           "--inference.urls", json.dumps([replicas[0].url]),
           "--inference.control-urls", json.dumps([replicas[0].control]), "--eval.num-examples", "2",
           "--eval.k", "2", "--eval.temperature", "1.0", "--sampling.max-tokens", "4"]  # fmt: skip
    with serving(_judge_app(asked), port):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    printed = json.loads(res.stdout.strip().splitlines()[-1])
    assert printed["rewards_mean"]["style"] == 0.7
    assert printed["avg_at_k"] == pytest.approx(printed["rewards_mean"]["lcs_reward"] + 0.5 * 0.7)
    assert asked and all(a.startswith("Grade: ") for a in asked)
