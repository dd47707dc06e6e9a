"""verifiers' `JudgeRubric` in an environment ported with `import gyre.envs as vf`
(tests/verifiers_envs/vf_hub_judge.py): `vf.JudgeRubric` was refused with a pointer to Gyre's judges.

The judge is a real HTTP server (tests/support/judge_server.py, uvicorn) asked through the official `openai` client
the environment makes; the policy's turns come from the scripted model client (envs_doubles.py): the judge's
verdict, not the policy, is under test.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from envs_doubles import ScriptedClient
from gyre.envs import ScoringError, load_environment
from support.judge_server import ScriptedServer

VF_ENVS = Path(__file__).resolve().parents[2] / "verifiers_envs"


@pytest.fixture(autouse=True)
def vf_envs_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(VF_ENVS))


@pytest.fixture(scope="module")
def judge_server():
    with ScriptedServer() as server:
        yield server


@pytest.fixture
def server(judge_server):
    judge_server.script.clear()
    judge_server.requests.clear()
    judge_server.auth.clear()
    return judge_server


def judged_env(server, **args):
    return load_environment("vf_hub_judge:load_environment", judge_base_url=f"{server.url}/v1", **args)


async def rollout_of(env, task, reply, sampling):
    return await env.rollout(ScriptedClient([reply]), task, sampling)


@pytest.mark.asyncio
async def test_a_reasoning_judges_thinking_is_not_in_the_reply_the_functions_read(server, sampling):
    """A reasoning judge served without a reasoning parser (Gyre's server) answers with its <think> block in the
    content: the environment's `"yes" in judge_response` read the "yes" it only considered, and a wrong answer
    scored 1. The reply the functions read is the text after the thinking, as a server with a reasoning parser
    answers it."""
    env = judged_env(server)
    task = env.tasks("eval")[0]
    server.script[:] = ["<think>Is Lyon right? If it said Paris, yes; it does not.</think>\n\nno"]
    wrong = await rollout_of(env, task, "<answer>Lyon</answer>", sampling)
    score = await env.score(task, wrong)
    assert score.per_function == {"correct_answer_reward_func": 0.0, "decisive_judge": 1.0}
    await env.rubric.aclose()
    await env.rubric.judge_client.close()


@pytest.mark.asyncio
async def test_a_ported_judge_rubric_scores_through_the_judge_server_once_per_rollout(server, sampling):
    env = judged_env(server)
    task = env.tasks("eval")[0]
    server.script[:] = ["yes", "No."]
    rollout = await rollout_of(env, task, "<answer>Paris</answer>", sampling)
    score = await env.score(task, rollout)
    assert score.errors == {}
    assert score.per_function == {"correct_answer_reward_func": 1.0, "decisive_judge": 1.0}
    assert score.reward == pytest.approx(1.2)
    # two reward functions read the verdict, scored at once: one request
    assert server.count("chat") == 1
    _, body = server.requests[0]
    assert body["model"] == "judge-model" and body["temperature"] == 0 and body["max_tokens"] == 16
    prompt = body["messages"][-1]["content"]
    assert "Question: What is the capital of France?" in prompt
    assert "Reference answer: Paris" in prompt and "Response: Paris\n" in prompt  # the parser's answer
    assert server.auth == ["Bearer EMPTY"]  # the judge client's key
    assert rollout.state["judge_response"] == {prompt: "yes"}
    # scored again (the orchestrator's retry of another function's failure): the verdict kept in the state
    assert (await env.score(task, rollout)).per_function["correct_answer_reward_func"] == 1.0
    assert server.count("chat") == 1

    wrong = await rollout_of(env, task, "<answer>Lyon</answer>", sampling)
    score = await env.score(task, wrong)
    assert score.per_function == {"correct_answer_reward_func": 0.0, "decisive_judge": 1.0}
    assert server.count("chat") == 2
    await env.rubric.aclose()  # Gyre's judge lets go of its connections, not of the environment's client
    assert not env.rubric.judge_client.is_closed()
    await env.rubric.judge_client.close()


@pytest.mark.asyncio
async def test_a_judge_rubric_judge_failure_is_reported_as_gyre_judges_report_it(server, sampling):
    """A judge down after its retries is a ScoringError (counted, scored again; never a 0), a timed-out one too; a
    refusal of one prompt is that rollout's reward error (Unjudged), as `gyre.envs.judge.Judge` reports them."""
    env = judged_env(server)  # the client's max_retries=0: one attempt
    task = env.tasks("eval")[0]
    rollout = await rollout_of(env, task, "<answer>Paris</answer>", sampling)
    server.script[:] = [("status", 500)]
    with pytest.raises(ScoringError, match=r"judge 'judge-model': http://127\.0\.0\.1:\d+ failed 1 times: .*500"):
        await env.score(task, rollout)
    assert server.count("chat") == 1 and env.rubric.gyre_judge.stats["failures"] == 1
    assert "judge_response" not in rollout.state  # a failure is not a verdict: asked again next time

    server.script[:] = [("status", 400)]
    score = await env.score(task, rollout)
    assert score.per_function == {"correct_answer_reward_func": 0.0, "decisive_judge": 0.0}
    assert set(score.errors) == {"correct_answer_reward_func", "decisive_judge"}
    assert all(e.startswith("Unjudged: judge 'judge-model'") and "400" in e for e in score.errors.values())
    assert server.count("chat") == 2

    server.script[:] = [("raw", '{"choices": []}', "application/json")]  # an answer without a reply
    with pytest.raises(ScoringError, match=r"judge 'judge-model': no reply after 1 answers \(the answer has no text"):
        await env.score(task, rollout)

    # a reply that is all thinking (an unclosed <think>) reached the functions as "": a silent "no". Asked again,
    # then that rollout's reward error (Unjudged, counted as unreadable), as a Gyre judge's unreadable verdict
    server.script[:] = ["<think>Paris? Then yes, it may well be"]
    score = await env.score(task, rollout)
    assert score.per_function == {"correct_answer_reward_func": 0.0, "decisive_judge": 0.0}
    assert all("holds nothing after its reasoning" in error for error in score.errors.values()) and score.errors
    assert env.rubric.gyre_judge.stats["unreadable"] == 1

    server.script[:] = [("length", "yes, but")]  # cut at max_tokens: read as it came, counted
    assert (await env.score(task, rollout)).per_function["correct_answer_reward_func"] == 1.0
    assert env.rubric.gyre_judge.stats["length"] == 1

    slow = judged_env(server, judge_timeout=0.3)
    server.script[:] = [("sleep", 1.5, "yes")]
    with pytest.raises(ScoringError, match="judge 'judge-model'.*failed 1 times"):
        await slow.score(task, await rollout_of(slow, task, "<answer>Paris</answer>", sampling))
    assert slow.rubric.gyre_judge.stats["timeouts"] == 1
    for made in (env, slow):  # the environment's clients, closed in this event loop
        await made.rubric.judge_client.close()


def test_a_judge_rubric_without_a_client_names_what_to_pass(server, monkeypatch):
    import gyre.envs as vf

    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(ValueError, match=r"JudgeRubric: no judge_client; pass judge_client=openai\.AsyncOpenAI"):
        vf.JudgeRubric()
    monkeypatch.setenv("OPENAI_BASE_URL", f"{server.url}/v1")  # verifiers' default client, pointed at a server
    assert str(vf.JudgeRubric().judge_client.base_url) == f"{server.url}/v1/"
    with pytest.raises(ValueError, match=r"JudgeRubric: judge_prompt: .*unknown placeholders \{reply\}"):
        vf.JudgeRubric(judge_client=openai.AsyncOpenAI(base_url=server.url, api_key="x"), judge_prompt="{reply}")
    with pytest.raises(ValueError, match="judge_sampling_args may not set model"):
        vf.JudgeRubric(judge_client=openai.AsyncOpenAI(base_url=server.url, api_key="x"),
                       judge_sampling_args={"model": "other"})  # fmt: skip


def test_the_judges_an_environment_holds_are_found_by_name_for_the_orchestrator(server):
    """`Rubric.judges` / `held_by`: a JudgeRubric's judge (named by its judge_model), a Judge added in code, one in a
    RubricGroup's rubric; a configured judge (already a signal) is not found twice, and a name taken is prefixed
    with the environment's label. The orchestrator waited for none of them and counted none."""
    from gyre.envs import Rubric, RubricGroup
    from gyre.envs.judge import Judge, held_by

    env = judged_env(server)
    own = Judge(url=server.url, name="style", prompt="Rate: {response}")
    env.rubric.add(own, 0.0)
    configured = Judge(url=server.url, name="judge-model", prompt="Grade: {response}")
    env.rubric.add(configured, 1.0, name="configured")
    assert env.rubric.judges() == {"judge-model": env.rubric.gyre_judge, "style": own, "configured": configured}
    other = judged_env(server)
    grouped = Judge(url=server.url, name="grouped", prompt="{response}")
    other.rubric = RubricGroup([other.rubric, Rubric([grouped])])
    held = held_by({"a": env, "b": other}, {"judge-model": configured})
    assert held == {"a/judge-model": env.rubric.gyre_judge, "style": own,
                    "b/judge-model": other.rubric.rubrics[0].gyre_judge, "grouped": grouped}  # fmt: skip
    assert held["a/judge-model"].endpoint.name == "judge 'judge-model'"


@pytest.mark.asyncio
async def test_a_judge_rubric_sets_its_judges_start_up_wait(server):
    """The start-up error names startup_timeout_s; a JudgeRubric user could not set it (verifiers has no such
    keyword), so a judge served elsewhere waited the training default, 1800 s. Gyre's keyword sets it, gyre eval's
    shorter default does not override it, and a bad value names it."""
    import gyre.envs as vf
    from gyre.endpoint import EndpointError
    from gyre.envs.judge import held_by

    client = openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="x")  # nothing listens there
    waited = vf.JudgeRubric(judge_client=client, judge_model="far", startup_timeout_s=0.5)
    assert waited.gyre_judge.config.startup_timeout_s == 0.5
    assert "startup_timeout_s" in waited.gyre_judge.config.model_fields_set  # kept by gyre eval (eval_command.py)
    assert vf.JudgeRubric(judge_client=client).gyre_judge.config.startup_timeout_s == 1800
    with pytest.raises(EndpointError, match=r"judge 'far': .* did not answer within startup_timeout_s = 0\.5s"):
        await waited.gyre_judge.endpoint.wait_ready()
    with pytest.raises(ValueError, match=r"JudgeRubric: startup_timeout_s: .*greater than or equal to 0"):
        vf.JudgeRubric(judge_client=client, startup_timeout_s=-1)
    env = judged_env(server)
    assert held_by({"a": env}, {})["judge-model"].config.startup_timeout_s == 1800
    await client.close()
