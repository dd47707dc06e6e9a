"""Environments written for verifiers 0.1-0.3 (the environments hub's `load_environment` modules), run by Gyre
with `import gyre.envs as vf` as their one change: tests/verifiers_envs/vf_hub_ports.py, through the loader, a
rollout (the scripted model) and the rubric. And one not ported (tests/verifiers_envs/vf_hub_unported.py), whose
load error says how to port it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from envs_doubles import ScriptedClient
from gyre.envs import (
    EnvironmentLoadError,
    MathRubric,
    Parser,
    Rubric,
    RubricGroup,
    ScoringError,
    ThinkParser,
    XMLParser,
    extract_boxed_answer,
    load_environment,
)

VF_ENVS = Path(__file__).resolve().parents[2] / "verifiers_envs"


@pytest.fixture(autouse=True)
def vf_envs_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(VF_ENVS))


async def score_of(env, task, reply, sampling):
    rollout = await env.rollout(ScriptedClient([reply]), task, sampling)
    return rollout, await env.score(task, rollout)


@pytest.mark.asyncio
async def test_a_hub_reverse_text_environment_runs_as_written(sampling):
    """verifiers' names the hub environment uses were missing: XMLParser.get_format_str / get_format_reward_func,
    attribute access to a parsed field, `few_shot`, a dataset of `question` rows without prompt_key."""
    env = load_environment("vf_hub_ports:load_environment")
    task = env.tasks("eval")[0]
    assert [m["role"] for m in task.prompt] == ["system", "user", "assistant", "user"]  # system, few_shot, question
    assert "<answer>\n...\n</answer>" in task.prompt[0]["content"] and task.prompt[-1]["content"] == "gyre"
    assert task.answer == "eryg" and len(env.tasks("eval")) == 2

    rollout, score = await score_of(env, task, "<think>\nBack to front.\n</think>\n<answer>\neryg\n</answer>", sampling)
    assert rollout.completion[-1]["role"] == "assistant"
    assert score.errors == {}
    assert score.per_function == {"lcs_reward_func": 1.0, "format_reward_func": 1.0, "length_known": 1.0}
    assert score.reward == pytest.approx(1.3)
    _, wrong = await score_of(env, task, "eryx", sampling)  # no tags: no answer, no format
    assert wrong.per_function == {"lcs_reward_func": 0.0, "format_reward_func": 0.0, "length_known": 0.0}


@pytest.mark.asyncio
async def test_a_hub_math_environment_with_a_rubric_group_and_a_think_parser(sampling):
    env = load_environment("vf_hub_ports:load_math_environment", num_eval=2)
    tasks = {t.info["question"]: t for t in [*env.tasks("eval"), *(env.tasks("train", 0)[i] for i in range(4))]}
    fraction = tasks.get("What is 3 / 4?") or next(t for t in tasks.values() if t.info["task"] == "fractions")
    a, b = fraction.answer.removeprefix("\\frac{").removesuffix("}").split("}{")
    reply = f"<think>\nDivide.\n</think>\nIt is \\boxed{{{int(a) / int(b)}}}."
    _, score = await score_of(env, fraction, reply, sampling)
    assert score.errors == {}
    assert score.per_function == {"correct_answer_reward_func": 1.0, "brief_sums": 1.0, "format_reward_func": 1.0}
    assert score.reward == pytest.approx(1.0 + 0.1 + 0.2)
    # ThinkParser: a reply without </think> has no answer (and no format), as in verifiers
    _, unthought = await score_of(env, fraction, f"\\boxed{{{int(a) / int(b)}}}", sampling)
    assert unthought.per_function["correct_answer_reward_func"] == 0.0
    assert unthought.per_function["format_reward_func"] == 0.0


def test_an_environment_not_ported_names_the_port():
    with pytest.raises(EnvironmentLoadError, match=r"vf_hub_unported.*written for verifiers 0\.1-0\.3.*"
                                                   r"`import gyre\.envs as vf`"):  # fmt: skip
        load_environment("vf_hub_unported:load_environment")


def test_an_old_verifiers_call_inside_the_loader_names_the_port(tmp_path, monkeypatch):
    (tmp_path / "vf_hub_late.py").write_text(
        "import verifiers as vf\n\n\ndef load_environment():\n    return vf.SingleTurnEnv(dataset=[])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(EnvironmentLoadError, match=r"SingleTurnEnv.*written for verifiers 0\.1-0\.3"):
        load_environment("vf_hub_late:load_environment")
    (tmp_path / "vf_hub_late2.py").write_text(
        "from verifiers import SingleTurnEnv\n\n\ndef load_environment():\n    return SingleTurnEnv(dataset=[])\n"
    )
    with pytest.raises(EnvironmentLoadError, match=r"SingleTurnEnv.*written for verifiers 0\.1-0\.3"):
        load_environment("vf_hub_late2:load_environment")


def test_verifiers_parser_names():
    parser = XMLParser(["think", "answer"])
    parsed = parser.parse("<think>a</think><answer>b</answer>")
    assert parsed.answer == "b" and parsed["think"] == "a"
    with pytest.raises(AttributeError, match="'reasoning' is not a field of this XMLParser; its fields"):
        parsed.reasoning  # noqa: B018
    assert parser.get_format_str() == "<think>\n...\n</think>\n<answer>\n...\n</answer>"
    boxed = XMLParser(["answer"], extract_fn=extract_boxed_answer)
    assert boxed.parse_answer([{"role": "assistant", "content": "<answer>so \\boxed{\\frac{1}{2}}</answer>"}]) == (
        "\\frac{1}{2}"
    )
    assert Parser(extract_fn=extract_boxed_answer).parse_answer("x \\boxed{a{b}c} y") == "a{b}c"
    assert Parser(extract_fn=lambda text: None).parse_answer("anything") is None
    assert Parser().get_format_reward_func()([{"role": "assistant", "content": "x"}]) == 1.0
    assert ThinkParser().parse_answer("<think>x</think> 42") == "42" and ThinkParser().parse_answer("42") is None
    assert Parser().get_assistant_messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
                                           ) == [{"role": "assistant", "content": "a"}]  # fmt: skip
    assert extract_boxed_answer("no box") == "no box" and extract_boxed_answer("\\boxed{open") == "\\boxed{open"
    with pytest.raises(ValueError, match=r"XMLParser fields are tag names \(str\), got \('code', 'answer'\)"):
        XMLParser(["think", ("code", "answer")])


def test_few_shot_mistakes_are_named():
    env_rows = [{"prompt": [{"role": "user", "content": "q"}], "answer": "a"}] * 3
    from gyre.envs import SingleTurnEnv

    with pytest.raises(ValueError, match="few_shot: a list of {'role', 'content'} messages"):
        SingleTurnEnv(dataset=[{"question": "q", "answer": "a"}] * 3, few_shot={"role": "user"}, num_eval=1)
    with pytest.raises(ValueError, match="'prompt' is a message list, and few_shot examples go before a text"):
        SingleTurnEnv(dataset=env_rows, few_shot=[{"role": "user", "content": "x"}], num_eval=1)


@pytest.mark.asyncio
async def test_a_rubric_group_sums_its_rubrics_and_refuses_a_name_twice(sampling):
    def one(completion) -> float:
        return 1.0

    def parsed(completion, parser) -> float:  # each function gets its own rubric's parser
        return float(parser.parse_answer(completion) == "x")

    env = load_environment("vf_hub_ports:load_math_environment", num_eval=2)
    task = env.tasks("eval")[0]
    rollout, _ = await score_of(env, task, "<answer>x</answer>", sampling)
    group = RubricGroup([Rubric([one], weights=[2.0]), Rubric([parsed], parser=XMLParser(["answer"]))])
    score = await group.score(task, rollout)
    assert score.per_function == {"one": 1.0, "parsed": 1.0} and score.reward == 3.0
    with pytest.raises(ValueError, match="reward function 'one' is in two of its rubrics"):
        RubricGroup([Rubric([one]), Rubric([one])])
    with pytest.raises(ValueError, match="'parsed' is already in this RubricGroup"):
        group.add(parsed)

    async def failed_judge(completion) -> float:
        raise ScoringError("judge down")

    group.add(failed_judge)  # a judge joined to the group: its failure is scored again, as in a Rubric
    with pytest.raises(ScoringError, match="judge down"):
        await group.score(task, rollout)
    assert isinstance(MathRubric(), Rubric)


@pytest.mark.asyncio
async def test_a_hub_multi_turn_game_in_verifiers_protocol(sampling):
    """setup_state, is_completed after every model turn, env_response's (messages, state), max_turns_reached: the
    game as verifiers runs it (before, the hooks never ran and the state returned ended the episode as an error)."""
    env = load_environment("vf_hub_ports:load_guess_environment", num_eval=2)
    task = env.tasks("eval")[0]
    secret = int(task.answer)
    low, high = str(secret - 1 if secret > 1 else 0), str(secret + 1)
    rollout = await env.rollout(ScriptedClient([low, high, task.answer]), task, sampling)
    assert rollout.error is None and rollout.stop_reason == "done" and rollout.num_turns == 3
    assert [m["content"] for m in rollout.completion] == [low, "No, higher.", high, "No, lower.", task.answer]
    assert rollout.state["guesses"] == [low, high]
    score = await env.score(task, rollout)
    assert score.per_function == {"solved": 1.0, "few_guesses": pytest.approx(1 / 3)} and score.errors == {}
    # never right: is_completed's max_turns_reached ends it after max_turns (4) model turns
    rollout = await env.rollout(ScriptedClient([low] * 5), task, sampling)
    assert rollout.error is None and rollout.num_turns == 4 and len(rollout.state["guesses"]) == 3


def test_the_answer_field_defaults_to_answer_wherever_it_is_declared():
    """verifiers reads the "answer" field by default; Gyre read the last field, so a ported
    XMLParser(["answer", "explanation"]) answered with the explanation and every reward compared that."""
    reply = [{"role": "assistant", "content": "<answer>42</answer><explanation>six sevens</explanation>"}]
    assert XMLParser(["answer", "explanation"]).parse_answer(reply) == "42"
    assert XMLParser(["think", "result"]).parse_answer([{"role": "assistant", "content": "<result>7</result>"}]) == "7"
    assert XMLParser(["answer", "explanation"], answer_field="explanation").parse_answer(reply) == "six sevens"


def test_verifiers_message_type_and_sampling_args(caplog):
    """verifiers' `message_type` and `sampling_args` were TypeErrors at load ("unexpected keyword argument"): a
    chat environment loads, a text-completion one is refused saying why, and sampling_args are named as not applied
    (sampling is the run's)."""
    from gyre.envs import SingleTurnEnv

    rows = [{"question": f"q{i}", "answer": "a"} for i in range(3)]
    with caplog.at_level("WARNING", logger="gyre.envs.base"):
        SingleTurnEnv(dataset=rows, num_eval=1, message_type="chat", sampling_args={"temperature": 0.3})
    assert "sampling_args {'temperature': 0.3} are not applied: sampling is the run's [orchestrator.sampling]" in (
        caplog.text
    )
    with pytest.raises(ValueError, match="message_type='completion': Gyre environments are chat"):
        SingleTurnEnv(dataset=rows, num_eval=1, message_type="completion")


@pytest.mark.asyncio
async def test_a_verifiers_metric_is_reported_and_adds_nothing(sampling):
    """verifiers' `rubric.add_metric(f)` was an AttributeError at load."""

    def reply_length(completion) -> float:
        return float(len(completion[-1]["content"]))

    env = load_environment("vf_hub_ports:load_environment")
    env.rubric.add_metric(reply_length)
    task = env.tasks("eval")[0]
    _, score = await score_of(env, task, "<think>\nx\n</think>\n<answer>\neryg\n</answer>", sampling)
    assert score.per_function["reply_length"] > 1 and score.reward == pytest.approx(1.3)


def test_a_verifiers_name_gyre_lacks_says_what_plays_its_part():
    """`vf.EnvGroup(...)` in a ported environment was "module 'gyre.envs' has no attribute 'EnvGroup'"; JudgeRubric
    and StatefulToolEnv are Gyre's own now (test_env_verifiers_judge_tools.py)."""
    import gyre.envs as vf

    assert vf.JudgeRubric.__module__ == "gyre.envs.judge_rubric" and issubclass(vf.StatefulToolEnv, vf.ToolEnv)
    with pytest.raises(AttributeError, match=r"has no EnvGroup .*\[\[orchestrator.env\]\]"):
        vf.EnvGroup  # noqa: B018
    with pytest.raises(AttributeError, match="module 'gyre.envs' has no attribute 'Nonesuch'"):
        vf.Nonesuch  # noqa: B018
    assert not hasattr(vf, "ToolRubric")
