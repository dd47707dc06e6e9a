"""The `my_pkg` examples of docs/environments.md run as written: through the loader, a rollout and the rubric.

Each ```python block whose first line is `# my_pkg/<module>.py`, and each block whose fence names a `my_pkg/` file
(```jsonl my_pkg/capitals.jsonl), is written into a `my_pkg` folder on sys.path, as a user copying the page would;
each module's `load_environment` is loaded by its import path and plays one eval task against the scripted model
(envs_doubles.py). An example that drifted from the API (an argument renamed, a file it reads not shown) fails here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from envs_doubles import ScriptedClient
from gyre.envs import load_environment

DOCS = Path(__file__).resolve().parents[3] / "docs" / "environments.md"
BLOCKS = re.findall(r"^```(\w*)(?: (my_pkg/\S+))?\n(.*?)^```", DOCS.read_text(), re.MULTILINE | re.DOTALL)


def example_files() -> dict[str, str]:
    files = {}
    for _, named, body in BLOCKS:
        first = re.match(r"# (my_pkg/\S+\.py)\n", body)
        if named or first:
            files[named or first.group(1)] = body
    return files


MODULES = sorted(Path(name).stem for name in example_files() if name.endswith(".py"))


@pytest.fixture
def my_pkg(tmp_path, monkeypatch):
    for name, body in example_files().items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(body)
    (tmp_path / "my_pkg" / "__init__.py").touch()
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    import sys

    for module in [m for m in sys.modules if m == "my_pkg" or m.startswith("my_pkg.")]:
        del sys.modules[module]


def test_the_page_has_its_examples():
    assert {"envs", "guess", "weather", "capitals"} <= set(MODULES)
    assert "my_pkg/capitals.jsonl" in example_files()


@pytest.mark.asyncio
@pytest.mark.parametrize("module", MODULES)
async def test_each_example_loads_plays_and_scores(my_pkg, module, sampling):
    env = load_environment(f"my_pkg.{module}:load_environment")
    task = env.tasks("eval")[0]
    assert env.tasks("train", seed=0)[0].id != task.id
    rollout = await env.rollout(ScriptedClient(["x"] * env.max_turns), task, sampling)
    assert rollout.error is None and rollout.num_turns >= 1
    score = await env.score(task, rollout)
    assert score.errors == {} and set(score.per_function) == set(env.rubric.names)


@pytest.mark.asyncio
async def test_the_dataset_tool_example_rewards_a_good_episode_by_its_weights(my_pkg, sampling):
    env = load_environment("my_pkg.capitals:load_environment")
    assert [t.answer for t in env.tasks("eval")] == ["nairobi"]  # the row marked "test"
    assert sorted(env.tasks("train", seed=0)[i].answer for i in range(3)) == ["lima", "paris", "tokyo"]
    task = env.tasks("eval")[0]
    call = "<tool_call>\n" + json.dumps({"name": "lookup", "arguments": {"country": "kenya"}}) + "\n</tool_call>"
    rollout = await env.rollout(ScriptedClient([call, "Nairobi"]), task, sampling)
    score = await env.score(task, rollout)
    assert score.per_function == {"correct": 1.0, "used_tool": 1.0, "asked_for_its_country": 1.0, "brief": 1.0}
    assert score.reward == pytest.approx(1.5)
