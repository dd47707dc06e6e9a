"""`verifiers:<taskset-id>` environments: verifiers 0.4 episodes mapped onto Gyre rollouts, with the scripted client.

The verifiers environment is the tests' own (tests/verifiers_envs/vf_gyre_tasks.py: an in-process chat-loop harness
over Gyre tasks; no hub, no network). Its episodes run through verifiers' real interception server (local HTTP, the
official openai client in the harness); only the model is the scripted double (`envs_doubles.ScriptedClient`: one
character per token, distinct log-probs), so every token, mask bit and log-prob of the mapping is checked exactly.
The same environment runs against the real tiny model in tests/integration/orchestrator/test_verifiers_env.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from envs_doubles import Reply, ScriptedClient, encode
from gyre.envs import ContextLengthExceeded, EnvironmentLoadError, ToolCall, load_environment

pytest.importorskip("verifiers.v1")

VF_ENVS = Path(__file__).resolve().parents[2] / "verifiers_envs"
NAME = "verifiers:vf_gyre_tasks"


@pytest.fixture(autouse=True)
def vf_envs_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(VF_ENVS))
    import vf_gyre_tasks

    vf_gyre_tasks._FAILED.clear()


def vf_env(source="calculator", *, turns=2, tools=True, **taskset):
    harness = {"id": "vf_gyre_tasks", "turns": turns, "tools": tools}
    return load_environment(NAME, taskset={"source": source, "num_tasks": 8, **taskset}, agent={"harness": harness},
                            num_eval=2)  # fmt: skip


async def rollout_of(env, client, sampling, task=None):
    task = task or env.tasks("train", seed=0)[0]
    try:
        rollout = await env.rollout(client, task, sampling)
        return task, rollout, await env.score(task, rollout)
    finally:
        await env.aclose()


def sampled(rollout):
    return [t for t, m in zip(rollout.token_ids, rollout.loss_mask, strict=True) if m]


@pytest.mark.asyncio
async def test_tool_and_user_turns_are_masked_and_versions_span_the_episode(sampling):
    env = vf_env(turns=3)
    task = env.tasks("train", seed=0)[0]
    expression = task.prompt[-1]["content"].removeprefix("What is ").removesuffix("?")
    call = ToolCall(id="call_0", name="calculator", arguments={"expression": expression},
                    raw_arguments=json.dumps({"expression": expression}))  # fmt: skip
    client = ScriptedClient([Reply("", tool_calls=[call], versions=(3, 3)), Reply("wrong", versions=(3, 4)),
                             Reply(task.answer, versions=(4, 5))])  # fmt: skip
    task, rollout, score = await rollout_of(env, client, sampling, task)

    assert rollout.error is None and rollout.stop_reason == "done"
    assert [m["role"] for m in rollout.completion] == ["assistant", "tool", "assistant", "user", "assistant"]
    assert rollout.completion[1]["content"] == task.answer  # the harness ran the calculator
    assert rollout.completion[3]["content"] == "Try again."
    turns = client.calls
    assert len(turns) == 3 and turns[0]["tools"][0]["function"]["name"] == "calculator"
    tool_messages = [m for m in turns[1]["messages"] if m["role"] == "tool"]  # OpenAI's shape: no "name"
    assert tool_messages and all(set(m) == {"role", "content", "tool_call_id"} for m in tool_messages)
    # The training sequence is the last turn's prompt plus its completion; only sampled tokens are in the loss,
    # with the server's log-probs; the tool result and the user message between turns are not.
    last = rollout.turns[-1]
    assert rollout.token_ids == last.prompt_token_ids + last.completion_token_ids
    assert sampled(rollout) == [t for turn in rollout.turns for t in turn.completion_token_ids]
    assert [lp for lp, m in zip(rollout.logprobs, rollout.loss_mask, strict=True) if m] == [
        lp for turn in rollout.turns for lp in turn.completion_logprobs
    ]
    assert all(lp == 0.0 for lp, m in zip(rollout.logprobs, rollout.loss_mask, strict=True) if not m)
    assert rollout.prompt_len == len(rollout.turns[0].prompt_token_ids) and rollout.sequence_turns == 3
    tool_result = encode(f"\n<tool>{task.answer}\n")  # after the end-of-turn token the model sampled
    start = len(rollout.turns[0].prompt_token_ids) + len(rollout.turns[0].completion_token_ids)
    assert rollout.token_ids[start : start + len(tool_result)] == tool_result
    assert not any(rollout.loss_mask[start : len(rollout.turns[1].prompt_token_ids)])
    assert (rollout.policy_version_min, rollout.policy_version_max) == (3, 5)
    assert score.reward == 1.0 and score.per_function == {"correct": 1.0}


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_concurrent_episodes_each_get_their_own_model_calls(sampling, stream):
    """Episodes running at once on one environment share verifiers' interception server: each harness's calls (streamed
    or not) reach its own episode's client, and each sample holds exactly its own turns' tokens and log-probs."""
    import asyncio

    harness = {"id": "vf_gyre_tasks", "turns": 2, "tools": True, "stream": stream}
    env = load_environment(NAME, taskset={"source": "calculator", "num_tasks": 8}, agent={"harness": harness},
                           num_eval=2)  # fmt: skip
    tasks = [env.tasks("train", seed=0)[i] for i in range(4)]
    clients = []
    for i, task in enumerate(tasks):
        expression = task.prompt[-1]["content"].removeprefix("What is ").removesuffix("?")
        call = ToolCall(id=f"call_{i}", name="calculator", arguments={"expression": expression},
                        raw_arguments=json.dumps({"expression": expression}))  # fmt: skip
        # episode i: a tool call (odd ones) or a first try, then its answer; replies tell the episodes apart
        first = Reply("", tool_calls=[call], finish_reason="tool_calls") if i % 2 else Reply(f"try {i}")
        clients.append(ScriptedClient([first, Reply(task.answer, versions=(i, i))]))
    try:
        rollouts = await asyncio.gather(*(env.rollout(c, t, sampling) for c, t in zip(clients, tasks, strict=True)))
        scores = [await env.score(t, r) for t, r in zip(tasks, rollouts, strict=True)]
    finally:
        await env.aclose()
    for i, (task, client, rollout, score) in enumerate(zip(tasks, clients, rollouts, scores, strict=True)):
        assert rollout.error is None and rollout.stop_reason == "done" and len(client.calls) == 2
        assert [m["role"] for m in rollout.completion] == ["assistant", "tool" if i % 2 else "user", "assistant"]
        assert rollout.completion[-1]["content"] == task.answer and score.reward == 1.0
        assert client.calls[0]["messages"][-1]["content"] == task.prompt[-1]["content"]
        assert sampled(rollout) == [t for turn in rollout.turns for t in turn.completion_token_ids]
        assert [lp for lp, m in zip(rollout.logprobs, rollout.loss_mask, strict=True) if m] == [
            lp for turn in rollout.turns for lp in turn.completion_logprobs
        ]
        assert rollout.token_ids == rollout.turns[-1].prompt_token_ids + rollout.turns[-1].completion_token_ids
        assert rollout.policy_version_max == i


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_reaches_verifiers_apart_and_goes_back_as_it_was_sampled(sampling, stream):
    """verifiers' own client hands a reply's reasoning apart (`reasoning_content`, the content after it): the adapter
    gave the whole text as content, so a reward or parser reading the reply (`trace.last_reply`) read the thinking.
    The harness sends the reasoning back (as vLLM clients do) and the next prompt holds each reply as it was sampled
    (this template, like most, does not render `reasoning_content`): the tokens extend, one branch, no drift."""
    harness = {"id": "vf_gyre_tasks", "turns": 3, "tools": True, "stream": stream}
    env = load_environment(NAME, taskset={"source": "calculator", "num_tasks": 8}, agent={"harness": harness},
                           num_eval=2)  # fmt: skip
    task = env.tasks("train", seed=0)[0]
    expression = task.prompt[-1]["content"].removeprefix("What is ").removesuffix("?")
    call = ToolCall(id="call_0", name="calculator", arguments={"expression": expression},
                    raw_arguments=json.dumps({"expression": expression}))  # fmt: skip
    opened, thought = "<think>\nuse the tool\n</think>\n\n", "maybe 7?\n</think>\n\n"  # the template may open it
    texts = [opened, thought + "wrong", thought + task.answer]
    client = ScriptedClient([Reply(texts[0], tool_calls=[call], finish_reason="tool_calls"), Reply(texts[1]),
                             Reply(texts[2])])  # fmt: skip
    task, rollout, score = await rollout_of(env, client, sampling, task)

    trace = rollout.state["trace"]
    replies = [(m.reasoning_content, m.content or "") for m in trace.assistant_messages]
    assert replies == [("use the tool", ""), ("maybe 7?", "wrong"), ("maybe 7?", task.answer)]
    assert trace.last_reply == task.answer and score.reward == 1.0
    assert [m.get("reasoning_content") for m in rollout.completion if m["role"] == "assistant"] == [
        "use the tool",
        "maybe 7?",
        "maybe 7?",
    ]
    # the last turn's history: every earlier reply as sampled, its reasoning in the content, no reasoning_content
    history = [m for m in client.calls[2]["messages"] if m["role"] == "assistant"]
    assert [m["content"] for m in history] == texts[:2] and not any("reasoning_content" in m for m in history)
    assert history[0]["tool_calls"][0]["function"]["name"] == "calculator"
    assert rollout.error is None and rollout.stop_reason == "done" and rollout.state["branches"] == 1
    assert sampled(rollout) == [t for turn in rollout.turns for t in turn.completion_token_ids]
    assert rollout.token_ids == rollout.turns[-1].prompt_token_ids + rollout.turns[-1].completion_token_ids


@pytest.mark.asyncio
async def test_a_turn_that_no_longer_extends_the_tokens_keeps_the_first_branch(sampling):
    env = vf_env("reverse_text", tools=False)
    drift = lambda i, ids: ids if i == 0 else [7] + ids[1:]  # noqa: E731 (a re-tokenised prompt on turn 2)
    client = ScriptedClient(["first", "second"], mutate_prompt=drift)
    _, rollout, _ = await rollout_of(env, client, sampling)
    assert rollout.stop_reason == "drift" and rollout.state["branches"] == 2
    first = rollout.turns[0]
    assert rollout.token_ids == first.prompt_token_ids + first.completion_token_ids
    assert sampled(rollout) == first.completion_token_ids


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("limit", "stop"),
    [({"max_output_tokens": 3}, "length"), ({"max_total_tokens": 40}, "length"), ({"max_input_tokens": 30}, "length"),
     ({"max_turns": 1}, "max_turns")],
)  # fmt: skip
async def test_an_agent_out_of_its_token_budget_is_a_length_stop(sampling, limit, stop):
    """The agent's token budgets are length limits (its output tokens, its context): the episode was a "max_turns"
    stop, trained on with advantage.mask_truncated, which leaves out Gyre's own environments' length stops."""
    harness = {"id": "vf_gyre_tasks", "turns": 3, "tools": False}
    env = load_environment(NAME, taskset={"source": "reverse_text", "num_tasks": 8},
                           agent={"harness": harness, **limit}, num_eval=2)  # fmt: skip
    client = ScriptedClient(["first", "second", "third"])
    _, rollout, _ = await rollout_of(env, client, sampling)
    assert rollout.state["trace"].stop_condition == next(iter(limit))  # verifiers stopped the episode on it
    assert rollout.error is None and rollout.stop_reason == stop and rollout.num_turns == 1
    assert sampled(rollout) == encode("first") + [2]


@pytest.mark.asyncio
async def test_a_harness_listing_the_models_is_answered(sampling, caplog):
    """verifiers relays a harness's GET /v1/models to the client config's URL, an unused port here: it failed as a
    502 with a WARNING 'models call failed: All connection attempts failed' each time (an agent asks three times an
    episode: a log flood in training). It is answered with the episode's model."""
    import vf_gyre_tasks

    vf_gyre_tasks.MODELS_SEEN.clear()
    harness = {"id": "vf_gyre_tasks", "turns": 1, "tools": False, "list_models": True}
    env = load_environment(NAME, taskset={"source": "reverse_text", "num_tasks": 8}, agent={"harness": harness},
                           num_eval=2)  # fmt: skip
    with caplog.at_level("WARNING"):
        _, rollout, _ = await rollout_of(env, ScriptedClient(["olleh"]), sampling)
    assert rollout.error is None and vf_gyre_tasks.MODELS_SEEN == [["gyre"]]
    assert not [r.getMessage() for r in caplog.records if "models call failed" in r.getMessage()]


@pytest.mark.asyncio
async def test_a_harness_asking_for_its_own_sampling_is_told_once_per_key(sampling, caplog):
    """A harness's temperature / max_tokens are not applied (every turn is sampled with the run's settings): that
    was silent. Each key that differs is named once per environment; a value equal to the run's is not."""
    harness = {"id": "vf_gyre_tasks", "turns": 1, "tools": False,
               "sampling": {"temperature": 0.0, "max_tokens": 7, "top_p": sampling.top_p}}  # fmt: skip
    env = load_environment(NAME, taskset={"source": "reverse_text", "num_tasks": 8}, agent={"harness": harness},
                           num_eval=2)  # fmt: skip
    with caplog.at_level("WARNING", logger="gyre.envs.verifiers_env"):
        task = env.tasks("train", seed=0)[0]
        try:
            for _ in range(2):
                rollout = await env.rollout(ScriptedClient([task.answer]), task, sampling)
                assert rollout.error is None
        finally:
            await env.aclose()
    lines = [r.getMessage() for r in caplog.records if "which Gyre does not apply" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "temperature=0.0" in lines[0] and f"(temperature={sampling.temperature})" in lines[0]
    assert "max_tokens=7" in lines[1] and "[orchestrator.sampling]" in lines[1]


@pytest.mark.asyncio
async def test_an_episode_that_raises_is_an_error_rollout_and_the_retry_works(sampling):
    env = vf_env("reverse_text", turns=1, tools=False, fail_first=list(range(8)))
    task = env.tasks("train", seed=0)[0]
    _, failed, score = await rollout_of(env, ScriptedClient([]), sampling, task)
    assert failed.stop_reason == "error" and "fails the first episode on purpose" in failed.error
    assert failed.token_ids == [] and score.reward == 0.0
    _, again, _ = await rollout_of(env, ScriptedClient(["olleh"]), sampling, task)
    assert again.error is None and sampled(again) == encode("olleh") + [2]


@pytest.mark.asyncio
async def test_a_reward_that_raises_scores_zero_and_is_named_not_an_error_rollout(sampling):
    """verifiers records a raising reward as the trace's error: the sample was generated again and, the bug being in
    the reward, failed every time until the run stopped. As in a Gyre Rubric it now scores 0, named."""
    env = vf_env("reverse_text", turns=1, tools=False, reward_fails=True)
    _, rollout, score = await rollout_of(env, ScriptedClient(["olleh"]), sampling)
    assert rollout.error is None and rollout.stop_reason == "done" and sampled(rollout) == encode("olleh") + [2]
    assert score.reward == 0.0 and score.per_function == {}
    assert "ZeroDivisionError: the reward fails on purpose" in score.errors["correct"]


@pytest.mark.asyncio
async def test_a_verifiers_judge_whose_server_fails_is_a_scoring_error_not_a_zero(sampling):
    """A verifiers reward asking a judge whose server is down (connection refused, a timeout, a 5xx, a 429) was a
    reward bug: 0, named, and trained on for as long as the judge was down. As for Gyre's own judges it is a
    ScoringError: counted, the sample generated and scored again, the run stopped when the attempts run out."""
    from gyre.envs import ScoringError

    env = vf_env("reverse_text", turns=1, tools=False, judge_url="http://127.0.0.1:9/v1")  # nothing listens
    task = env.tasks("train", seed=0)[0]
    try:
        rollout = await env.rollout(ScriptedClient(["olleh"]), task, sampling)
        assert rollout.error is None
        with pytest.raises(ScoringError, match="a verifiers judge's server failed: .*APIConnectionError") as raised:
            await env.score(task, rollout)
        assert raised.value.rescorable is False  # scored inside the episode: generated again, not scored again
    finally:
        await env.aclose()


@pytest.mark.asyncio
async def test_an_inference_failure_is_raised_not_hidden(sampling):
    class Down(ScriptedClient):
        async def chat(self, messages, *, tools=None, sampling):
            raise ConnectionError("replica down")

    env = vf_env("reverse_text", turns=1, tools=False)
    with pytest.raises(ConnectionError, match="replica down"):
        await rollout_of(env, Down([]), sampling)


@pytest.mark.asyncio
async def test_an_inference_failure_the_harness_retried_past_keeps_the_episode(sampling):
    """The harness's SDK asks a 502 again; answered, the episode goes on and is sound (verifiers clears the session's
    error on the next exchange). It was raised all the same: the whole episode generated again. Unrecovered, it is
    raised (the test above)."""

    class Blip(ScriptedClient):
        async def chat(self, messages, *, tools=None, sampling):
            if not self.failed:
                self.failed = True
                raise ConnectionError("replica blipped")
            return await super().chat(messages, tools=tools, sampling=sampling)

    harness = {"id": "vf_gyre_tasks", "turns": 1, "tools": False, "sdk_retries": 1}
    env = load_environment(NAME, taskset={"source": "reverse_text", "num_tasks": 8}, agent={"harness": harness},
                           num_eval=2)  # fmt: skip
    client = Blip(["olleh"])
    client.failed = False
    _, rollout, _ = await rollout_of(env, client, sampling)
    assert client.failed and rollout.error is None and rollout.stop_reason == "done" and rollout.num_turns == 1
    assert sampled(rollout) == encode("olleh") + [2] and rollout.state["branches"] == 1


@pytest.mark.asyncio
async def test_a_non_finite_verifiers_reward_scores_zero_and_is_named(sampling):
    """verifiers keeps any float a reward returns; a NaN reached Score.reward (and the advantages) unchecked."""
    from verifiers.v1.trace import Reward

    env = vf_env(turns=1)
    task, rollout, _ = await rollout_of(env, ScriptedClient([Reply("0")]), sampling)
    trace = rollout.state["trace"]
    trace.rewards = {"correct": Reward(score=float("nan")), "style": Reward(score=0.5, weight=2.0),
                     "huge": Reward(score=float("inf"), weight=0.0), "skipped": None}  # fmt: skip
    score = await env.score(task, rollout)
    assert score.reward == 1.0
    assert score.per_function == {"correct": 0.0, "style": 0.5, "huge": 0.0}
    assert set(score.errors) == {"correct", "huge", "skipped"} and "nan" in score.errors["correct"]


def test_splits_are_disjoint_seeded_and_endless():
    env = vf_env("reverse_text", num_tasks=10)
    evals = [t.prompt for t in env.tasks("eval")]
    train = env.tasks("train", seed=3)
    assert len(evals) == 2 and train.size is None
    first_epoch = [train[i].prompt for i in range(8)]
    assert not any(p in evals for p in first_epoch) and len({json.dumps(p) for p in first_epoch}) == 8
    assert sorted(json.dumps(p) for p in first_epoch) == sorted(json.dumps(train[i + 8].prompt) for i in range(8))
    assert [t.prompt for t in vf_env("reverse_text", num_tasks=10).tasks("eval")] == evals


def test_an_eval_taskset_overlapping_the_train_one_stays_held_out():
    """With eval_taskset (or a task listed twice), eval tasks were trained on too: their train copies go."""
    harness = {"id": "vf_gyre_tasks", "turns": 1, "tools": False}
    env = load_environment(NAME, taskset={"source": "reverse_text", "num_tasks": 10}, agent={"harness": harness},
                           eval_taskset={"source": "reverse_text", "num_tasks": 3})  # fmt: skip
    evals = {t.key for t in env.tasks("eval")}
    train = env.tasks("train", seed=0)
    assert len(evals) == 3 and not {train[i].key for i in range(40)} & evals
    assert len({train[i].key for i in range(40)}) == 7
    with pytest.raises(ValueError, match="every train task is also in the eval split"):
        load_environment(NAME, taskset={"source": "reverse_text", "num_tasks": 3}, agent={"harness": harness},
                         eval_taskset={"source": "reverse_text", "num_tasks": 5})  # fmt: skip


@pytest.mark.asyncio
async def test_judges_joined_to_the_rubric_score_verifiers_rollouts(sampling):
    """`[[orchestrator.judges]]` are added to env.rubric; a verifiers env scored only its trace and dropped them."""
    from gyre.envs.types import ScoringError

    env = vf_env(turns=1)
    env.rubric.add(lambda completion: 0.25, weight=2.0, name="judge")
    env.rubric.add(lambda: 1 / 0, name="correct")  # a name verifiers uses too, and a failing function
    task, rollout, score = await rollout_of(env, ScriptedClient([Reply("0")]), sampling)
    assert score.per_function == {"correct": 0.0, "judge": 0.25, "gyre:correct": 0.0}
    assert score.reward == 0.5 and "ZeroDivisionError" in score.errors["gyre:correct"]

    def down() -> float:
        raise ScoringError("judge unreachable")

    env.rubric.add(down)
    with pytest.raises(ScoringError):  # never a silent 0, as with Gyre's own environments
        await env.score(task, rollout)


def test_a_taskset_in_the_working_directory_is_found(tmp_path, monkeypatch):
    """`gyre eval --env.name verifiers:my_taskset` run beside my_taskset.py failed with "taskset 'my_taskset' not
    found": the gyre command's sys.path does not start at the working directory. It is looked in last, as for
    Gyre's own import paths."""
    import sys

    module = f"vf_cwd_{tmp_path.name.replace('-', '_')}"
    source = (VF_ENVS / "vf_gyre_tasks.py").read_text()  # the tests' taskset, under another name
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    try:
        env = load_environment(f"verifiers:{module}", taskset={"num_tasks": 4}, num_eval=1)
        assert len(env.tasks("eval")) == 1 and sys.path[-1] == str(tmp_path)
    finally:
        sys.modules.pop(module, None)


def test_bad_taskset_ids_and_configs_are_named():
    with pytest.raises(ValueError, match="no_such_taskset"):
        load_environment("verifiers:no_such_taskset")
    with pytest.raises(ValueError, match="num_eval=8 leave none to train on"):
        load_environment(NAME, taskset={"num_tasks": 8}, num_eval=8)
    with pytest.raises(EnvironmentLoadError, match="verifers"):
        load_environment("verifers:vf_gyre_tasks")


def test_unknown_names_and_gyre_envs_point_at_the_verifiers_kind(capsys):
    from gyre.envs.registry import main

    with pytest.raises(EnvironmentLoadError, match=r"verifiers:<name>"):
        load_environment("no_such_env")
    assert main([]) == 0
    assert "verifiers:<taskset_id>" in capsys.readouterr().out


@pytest.mark.asyncio
async def test_a_turn_past_the_context_ends_the_episode_as_a_length_stop(sampling):
    # as for Gyre's own environments: the turns so far are trained; the refusal failed the rollout and its retries
    class ContextFull(ScriptedClient):
        """Turns past the scripted replies no longer fit the context."""

        async def chat(self, messages, *, tools=None, sampling):
            if len(self.calls) >= len(self.replies):
                raise ContextLengthExceeded("400 context_length_exceeded")
            return await super().chat(messages, tools=tools, sampling=sampling)

    env = vf_env("reverse_text", tools=False)
    _, rollout, _ = await rollout_of(env, ContextFull(["first"]), sampling)
    assert rollout.error is None and rollout.stop_reason == "length" and rollout.truncated
    assert rollout.completion == [{"role": "assistant", "content": "first"}]
    assert sampled(rollout) == encode("first") + [2]
    # the task's own prompt does not fit: nothing to train, the caller is told
    with pytest.raises(ContextLengthExceeded):
        await rollout_of(vf_env("reverse_text", tools=False), ContextFull([]), sampling)


def test_the_agents_max_turns_is_the_environments_turn_budget():
    """It sizes the generation budget (Dr.GRPO's normaliser, overlong shaping): it was 1 whatever the agent allowed,
    so a 3-turn agent's episodes were measured against one turn's max_tokens."""
    harness = {"id": "vf_gyre_tasks", "turns": 3, "tools": False}
    env = load_environment(NAME, taskset={"source": "reverse_text", "num_tasks": 8},
                           agent={"harness": harness, "max_turns": 3}, num_eval=2)  # fmt: skip
    assert env.max_turns == 3
    assert vf_env("reverse_text", turns=3, tools=False).max_turns == 1  # unset: the harness decides, 1 stands in
