"""Reward functions written for verifiers, run by Gyre's rubric: each argument is what verifiers passes.

The rewards are tests/verifiers_envs/vf_mixed_rewards.py (a mixed-task rubric, as a verifiers user has it), over a
`dataset` environment whose rows carry verifiers' `task` column; the model is the scripted double.
"""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

import pytest
from envs_doubles import ScriptedClient
from gyre.envs import load_environment

VF_ENVS = Path(__file__).resolve().parents[2] / "verifiers_envs"
REWARDS = ["vf_mixed_rewards:correct", "vf_mixed_rewards:task_seen"]


@pytest.fixture
def vf_rewards(monkeypatch):
    monkeypatch.syspath_prepend(str(VF_ENVS))
    import vf_mixed_rewards

    vf_mixed_rewards.SEEN.clear()
    return vf_mixed_rewards


def mixed_dataset(tmp_path, rows) -> str:
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


async def score_of(env, task, reply, sampling):
    rollout = await env.rollout(ScriptedClient([reply]), task, sampling)
    return await env.score(task, rollout)


@pytest.mark.asyncio
async def test_a_reward_branching_on_the_task_column_sees_its_name(tmp_path, vf_rewards, sampling):
    """verifiers passes the row's `task` column (a string) as `task`; Gyre passed its Task object, so
    `task == "math"` was False for every row and a math reply of "4.0" for "4" scored 0 (the text branch)."""
    rows = [{"question": "2+2?", "answer": "4", "task": "math", "split": "eval"},
            {"question": "Reverse: ab", "answer": "ba", "task": "reverse"},
            {"question": "Reverse: cd", "answer": "dc", "task": "reverse"}]  # fmt: skip
    env = load_environment("dataset", path=mixed_dataset(tmp_path, rows), prompt_key="question", reward=REWARDS)
    math_task = env.tasks("eval")[0]
    score = await score_of(env, math_task, "4.0", sampling)
    assert score.errors == {} and score.per_function["correct"] == 1.0
    seen = vf_rewards.SEEN[-1]
    assert seen["task"] == "math" and isinstance(seen["task"], str)
    # the other arguments are verifiers' too: chat messages, the answer text, the row as info, a state dict
    assert seen["prompt"] == math_task.prompt and seen["completion"] == [{"role": "assistant", "content": "4.0"}]
    assert seen["answer"] == "4" and seen["info"]["task"] == "math" and isinstance(seen["state"], dict)
    # a reverse row takes the text branch: "4.0"-style leniency is the math rows' only
    reverse = env.tasks("train", seed=0)[0]
    assert (await score_of(env, reverse, reverse.answer, sampling)).per_function["correct"] == 1.0
    assert vf_rewards.SEEN[-1]["task"] == "reverse"


@pytest.mark.asyncio
async def test_without_a_task_column_the_task_is_default_and_still_reads_as_the_task(tmp_path, vf_rewards, sampling):
    """No `task` column: verifiers' name is "default". A Gyre reward reading the Task (`task.answer`, `task.info`,
    `task.id`) keeps working on the same argument."""
    rows = [{"question": f"Reverse: {w}", "answer": w[::-1]} for w in ("ab", "cd", "ef")]
    env = load_environment("dataset", path=mixed_dataset(tmp_path, rows), prompt_key="question", reward=REWARDS,
                           num_eval=1)  # fmt: skip
    task = env.tasks("eval")[0]
    await score_of(env, task, task.answer, sampling)
    seen = vf_rewards.SEEN[-1]["task"]
    assert seen == "default"
    assert (seen.answer, seen.info, seen.id, seen.prompt, seen.key) == (task.answer, task.info, task.id, task.prompt,
                                                                        task.key)  # fmt: skip
    assert json.dumps({"task": seen}) == '{"task": "default"}'  # recorded as the name it is
    # copies and introspection see the name, a str, never the Task's protocol
    assert type(copy.deepcopy(seen)) is str and copy.deepcopy(seen) == "default" and pickle.loads(pickle.dumps(seen))
    assert not hasattr(seen, "__dataclass_fields__")
