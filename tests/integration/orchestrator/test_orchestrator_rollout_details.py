"""A sample's `details` (why it scored what it did) through the real orchestrator: rollout dump and samples.md.

Before, the dumps carried only the per-function rewards: the code environment's reason for a 0 (no code block, a
SyntaxError, the first failing test) stayed in `rollout.state["code"]`, lost after the run.
"""

from __future__ import annotations

import json

import pytest
from gyre.rollouts import DETAILS_MAX_CHARS, read_dump, samples_page
from orchestrator_testlib import first_batch, orchestrator_config

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]


async def test_the_code_environment_s_reason_for_a_zero_is_in_the_dump_and_samples_md(
    tmp_path, redis_url, unique_run_id, replicas, tiny_model
):
    # the random tiny model writes no ```python block: every reply scores 0, and the dump says why
    env = {"name": "code", "args": {"num_tests": 2, "num_eval": 2}}
    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, replicas, env=env, max_steps=1,
                              rollouts={"interval": 1}, advantage={"drop_zero_signal": False})  # fmt: skip
    await first_batch(cfg, tiny_model)
    records = read_dump(cfg.output_dir, 1)
    assert len(records) == 8
    for r in records:
        assert r["reward"] == 0.0
        assert r["details"] == {"passed": 0, "total": 2, "error": "no ```python code block in the reply",
                                "failures": []}  # fmt: skip
    page = samples_page(cfg.output_dir)
    assert any(line.startswith("| task |") and "| reward | details | advantage |" in line for line in page.splitlines())
    assert page.count("error: no ```python code block in the reply") == 8


def traceback_reward(state) -> float:
    """A user environment's reward that explains itself with a huge traceback and a value JSON cannot hold."""
    state["details"] = {"error": "Traceback (most recent call last):\n" + "  File 'x.py', line 1\n" * 20_000,
                        "failures": [f"test {i}: wrong" for i in range(1000)], "seen": {1, 2}}  # fmt: skip
    return 0.0


async def test_a_huge_explanation_is_capped_in_the_dump(tmp_path, redis_url, unique_run_id, replicas, tiny_model):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"w{i}", "answer": f"{i}w"}) + "\n" for i in range(8)))
    env = {"name": "dataset", "args": {"path": str(data), "reward": f"{__name__}:traceback_reward", "num_eval": 2}}
    cfg = orchestrator_config(tmp_path, redis_url, unique_run_id, replicas, env=env, max_steps=1,
                              rollouts={"interval": 1}, advantage={"drop_zero_signal": False})  # fmt: skip
    await first_batch(cfg, tiny_model)
    lines = (cfg.output_dir / "rollouts" / "step_1.jsonl").read_text().splitlines()
    assert len(lines) == 8
    for line in lines:
        details = json.loads(line)["details"]
        assert len(json.dumps(details, ensure_ascii=False)) <= DETAILS_MAX_CHARS
        assert details["error"].startswith("Traceback (most recent call last):")
        assert details["failures"][:2] == ["test 0: wrong", "test 1: wrong"] and details["failures"][-1] == "… 990 more"
        assert details["seen"] == "{1, 2}"  # a set, as its str
        assert len(line) < 3 * DETAILS_MAX_CHARS  # the prompt, completion and the rest are small here
