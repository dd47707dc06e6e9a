"""verifiers 0.4 environments through Gyre: real `gyre inference` replicas, the orchestrator's `InferenceClient`.

The verifiers environment is built for the tests (tests/verifiers_envs/vf_gyre_tasks.py: a taskset of Gyre tasks
and an in-process chat-loop harness; no hub, no network). Multi-turn episodes run on the tiny model taught the
calculator and alphabet_sort conversations (the `chat_model` fixture of test_orchestrator_env_rollouts), so greedy
decoding makes a real tool call and ends its turns; the loss mask is checked token by token against what the
server reported for every turn, and the tool-calling sequence must equal the built-in calculator's on the same task.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import test_orchestrator_env_rollouts as env_rollouts
from gyre.envs import SamplingParams, load_environment
from gyre.events import read_events
from gyre_orchestrator.client import InferenceClient, close_replica_clients
from gyre_orchestrator.replicas import Endpoint, ReplicaSet
from orchestrator_testlib import first_batch, orchestrator_config

pytest.importorskip("verifiers.v1")
pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(900), pytest.mark.slow]  # the chat model trains first

# the tiny model taught calculator / alphabet_sort conversations, served by a replica of its own
chat_model, chat_replica = env_rollouts.chat_model, env_rollouts.chat_replica
check_sequence = env_rollouts.check_sequence
VF_ENVS = Path(__file__).resolve().parents[2] / "verifiers_envs"
GREEDY = SamplingParams(temperature=0, max_tokens=48)


@pytest.fixture(autouse=True)
def vf_envs_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(VF_ENVS))
    import vf_gyre_tasks

    vf_gyre_tasks._FAILED.clear()  # each test sees every `fail_first` task fail once


def vf_env(source: str, *, turns: int = 2, tools: bool = True, **taskset):
    harness = {"id": "vf_gyre_tasks", "turns": turns, "tools": tools}
    taskset = {"source": source, "num_tasks": 8, **taskset}
    return load_environment("verifiers:vf_gyre_tasks", taskset=taskset, agent={"harness": harness}, num_eval=2)


async def run(env, replica, tasks, sampling=GREEDY):
    replicas = ReplicaSet([Endpoint(replica.url, replica.control)])
    client = InferenceClient(replicas, timeout_s=60)
    try:
        out = []
        for task in tasks:
            rollout = await env.rollout(client, task, sampling)
            out.append((rollout, await env.score(task, rollout)))
        return out
    finally:
        if hasattr(env, "aclose"):  # a verifiers env holds servers; built-ins hold nothing
            await env.aclose()
        await close_replica_clients(list(replicas))


def task_with_answer(env, answer: str):
    return next(task for task in env.train_tasks + env.eval_tasks if task.answer == answer)


async def test_tool_turn_is_masked_and_matches_the_builtin_environment(chat_replica):
    builtin = load_environment("calculator")
    taught = builtin.tasks("train", seed=0)[0]  # the conversation the chat model was taught
    env = vf_env("calculator", turns=2)
    task = task_with_answer(env, taught.answer)
    [(rollout, score)] = await run(env, chat_replica, [task])
    assert rollout.error is None and rollout.stop_reason == "done", rollout.error
    assert [m["role"] for m in rollout.completion] == ["assistant", "tool", "assistant"]
    assert rollout.turns[0].tool_calls and rollout.turns[0].tool_calls[0].name == "calculator"
    check_sequence(rollout)  # tool-result tokens: mask 0, log-prob 0; sampled tokens: mask 1, the server's log-probs
    tool_tokens = (
        len(rollout.turns[1].prompt_token_ids)
        - len(rollout.turns[0].prompt_token_ids)
        - len(rollout.turns[0].completion_token_ids)
    )
    assert tool_tokens > 0
    assert score.reward == 1.0 and score.per_function == {"correct": 1.0}

    [(reference, _)] = await run(builtin, chat_replica, [taught])
    assert rollout.token_ids == reference.token_ids and rollout.loss_mask == reference.loss_mask
    assert rollout.policy_version_min == rollout.policy_version_max == 0


async def test_user_turn_between_model_turns_is_masked(chat_replica):
    env = vf_env("alphabet_sort", turns=2, tools=False)
    task = task_with_answer(env, load_environment("alphabet_sort").tasks("train", seed=0)[0].answer)
    [(rollout, _)] = await run(env, chat_replica, [task])
    assert rollout.error is None, rollout.error
    assert [m["role"] for m in rollout.completion] == ["assistant", "user", "assistant"]
    assert rollout.completion[1]["content"] == "Try again."
    assert rollout.sequence_turns == 2 and rollout.stop_reason in ("done", "length")
    check_sequence(rollout)
    assert not any(rollout.loss_mask[len(rollout.turns[0].prompt_token_ids) + len(rollout.turns[0].completion_token_ids)
                                     : len(rollout.turns[1].prompt_token_ids)])  # fmt: skip


async def test_an_episode_that_raises_comes_back_as_an_error_rollout(replicas):
    env = vf_env("reverse_text", tools=False, fail_first=[0, 1, 2, 3, 4, 5, 6, 7])
    task = env.tasks("train", seed=0)[0]
    sampling = SamplingParams(temperature=1.0, max_tokens=8)
    [(failed, score), (ok, _)] = await run(env, replicas[0], [task, task], sampling)
    assert failed.stop_reason == "error" and "fails the first episode on purpose" in failed.error
    assert failed.loss_mask == [] and score.reward == 0.0
    assert ok.error is None and any(ok.loss_mask) and len(ok.token_ids) == len(ok.logprobs)


async def test_orchestrator_counts_and_retries_failed_episodes(
    replicas, tiny_model, tmp_path, redis_url, unique_run_id
):
    args = {"taskset": {"source": "reverse_text", "num_tasks": 12, "fail_first": list(range(12))},
            "agent": {"harness": {"id": "vf_gyre_tasks", "turns": 1, "tools": False}}, "num_eval": 2}  # fmt: skip
    cfg = orchestrator_config(
        tmp_path, redis_url, unique_run_id, replicas, env={"name": "verifiers:vf_gyre_tasks", "args": args},
        max_steps=1, batch_size=2, rollouts_per_example=2, sampling={"max_tokens": 8, "temperature": 1.0},
        advantage={"drop_zero_signal": False},
    )  # fmt: skip
    batch = await first_batch(cfg, tiny_model)
    assert batch.step == 1 and batch.num_samples == 4
    assert all(s["env"] == "verifiers:vf_gyre_tasks" and s["num_loss_tokens"] >= 1 for s in batch.samples)
    [step] = read_events(Path(cfg.output_dir) / "events/orchestrator_steps.jsonl")
    assert step["failed_rollouts"] >= 2  # each task's first episode raised, was counted, and was generated again
