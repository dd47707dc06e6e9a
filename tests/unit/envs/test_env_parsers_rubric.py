"""Parsers (answers, tags, tool-call text) and the rubric's weighting, argument passing and error capture."""

from __future__ import annotations

import asyncio

import pytest
from gyre.envs import Parser, Rollout, Rubric, Task, ToolCall, XMLParser, parse_tool_calls


def test_plain_parser_takes_the_last_assistant_message():
    completion = [
        {"role": "assistant", "content": "first"},
        {"role": "tool", "content": "ignored"},
        {"role": "assistant", "content": [{"type": "text", "text": " 4"}, {"type": "text", "text": "2 "}]},
    ]
    assert Parser().parse_answer(completion) == "42"
    assert Parser().parse_answer("  raw text ") == "raw text"
    assert Parser().parse_answer([{"role": "user", "content": "no reply"}]) is None
    assert Parser().parse_answer([{"role": "assistant", "content": None}]) is None
    assert Parser().parse_answer([{"role": "assistant", "content": 'x <tool_call>{"name": "f"}</tool_call>'}]) == "x"


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("<think>maybe 7</think>\nThe answer is 8", "The answer is 8"),
        ("<think>it is 7", None),  # cut by max_tokens mid-thought: the model never answered
        ("<think>it is 7</think>", None),
        ("<think>it is 7</think>   ", None),
        ("it is 7</think>8", "8"),  # the template opened <think> in the prompt (Qwen3-style)
        ("<think>a</think>7<think>b</think>8", "8"),
        ("8 <think>but maybe 7", "8"),  # thinking again after the reply, never closed: the reply stands
        ("no reasoning at all", "no reasoning at all"),
        ('<think>x</think>7 <tool_call>{"name": "f"}</tool_call>', "7"),
    ],
)
def test_parser_answer_leaves_reasoning_out(text, answer):
    """A number the model only thought about is no answer (an unclosed <think> with the right number scored 1)."""
    assert Parser().parse_answer([{"role": "assistant", "content": text}]) == answer


def test_xml_parser_fields():
    parser = XMLParser(["think", "answer"])
    text = "<think>hmm</think>\n<answer>1</answer> then <answer> 2 </answer>"
    assert parser.parse(text) == {"think": "hmm", "answer": "2"}  # the last block wins
    assert parser.parse("<answer>cut off mid-gener") == {"think": None, "answer": "cut off mid-gener"}
    assert parser.parse_answer([{"role": "assistant", "content": "no tags"}]) is None
    assert parser.format(think="a", answer="b") == "<think>a</think>\n<answer>b</answer>"
    assert parser.parse(parser.format(think="a", answer="b")) == {"think": "a", "answer": "b"}
    with pytest.raises(ValueError, match="unknown"):
        parser.format(reason="x")


@pytest.mark.parametrize("fields", [["think", "answer"], ["answer"]])
def test_xml_parser_answer_only_after_reasoning(fields):
    """An <answer> block the model wrote while thinking is not its answer: the right number considered inside
    <think> must not score (Parser's rule)."""
    parser = XMLParser(fields)
    assert parser.parse_answer("<think>maybe <answer>42</answer></think>") is None
    assert parser.parse_answer("<think>cut off <answer>42</answer> wait") is None  # max_tokens mid-thought
    assert parser.parse_answer("prompt-opened <answer>42</answer> hmm</think>") is None  # Qwen3: <think> in prompt
    assert parser.parse_answer("<think>a <answer>4</answer></think><answer>7</answer>") == "7"
    assert parser.parse_answer("<answer>7</answer>") == "7"
    assert XMLParser(["think", "answer"], answer_field="think").parse_answer("<think>r</think>x") == "r"


def test_xml_format_reward():
    parser = XMLParser(["think", "answer"])
    good = {"role": "assistant", "content": "<think>a</think><answer>b</answer>"}
    missing = {"role": "assistant", "content": "<answer>b</answer>"}
    doubled = {"role": "assistant", "content": "<think>a</think><answer>b</answer><answer>c</answer>"}
    assert parser.format_reward([good]) == 1.0
    assert parser.format_reward([good, missing]) == 0.5
    assert parser.format_reward([doubled]) == 0.0
    assert parser.format_reward([]) == 0.0
    # one of each tag, the close before the open: no block at all (parse reads an empty answer), so no format credit
    backwards = {"role": "assistant", "content": "<think>a</think></answer>b<answer>"}
    assert parser.parse_answer([backwards]) == ""
    assert parser.format_reward([backwards]) == 0.0


def test_xml_parser_rejects_bad_declarations():
    with pytest.raises(ValueError):
        XMLParser([])
    with pytest.raises(ValueError):
        XMLParser(["a b"])
    with pytest.raises(ValueError):
        XMLParser(["think"], answer_field="answer")


def test_parse_tool_calls_from_text():
    text = (
        'Let me check.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "1+2"}}\n</tool_call>'
        '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"3\\"}"}</tool_call>'
        "<tool_call>not json</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "calc", "arguments": [1]}</tool_call>'
        '<tool_call>{"name": "calc"}'  # cut off by max_tokens
    )
    calls = parse_tool_calls(text, id_prefix="t")
    assert [c.id for c in calls] == [f"t_{i}" for i in range(6)]
    assert calls[0].name == "calc" and calls[0].arguments == {"expression": "1+2"} and calls[0].error is None
    assert calls[1].arguments == {"expression": "3"} and calls[1].error is None
    assert "not valid JSON" in calls[2].error
    assert "name" in calls[3].error
    assert "object" in calls[4].error
    assert calls[5].name == "calc" and calls[5].arguments == {} and calls[5].error is None
    assert parse_tool_calls("no calls here") == []


def test_tool_call_from_openai_shapes():
    class Fn:
        name, arguments = "calc", '{"expression": "2"}'

    class Call:
        id, function = "c1", Fn()

    assert ToolCall.from_openai(Call()).arguments == {"expression": "2"}
    openai_dict = {"id": "c2", "type": "function", "function": {"name": "calc", "arguments": "[1, 2]"}}
    assert ToolCall.from_openai(openai_dict).error == "arguments must be a JSON object, got list"
    assert ToolCall.from_openai(openai_dict).to_openai() == openai_dict  # raw argument text is preserved
    with pytest.raises(ValueError, match="name"):
        ToolCall.from_openai({"id": "c3", "function": {"arguments": "{}"}})


TASK = Task(id="t", prompt=[{"role": "user", "content": "q"}], answer="yes", info={"k": 1})
ROLLOUT = Rollout(
    task_id="t",
    prompt=TASK.prompt,
    completion=[{"role": "assistant", "content": "yes"}],
    turns=[],
    token_ids=[],
    loss_mask=[],
    logprobs=[],
    prompt_len=0,
    sequence_turns=0,
    policy_version_min=0,
    policy_version_max=0,
    stop_reason="done",
    state={"s": 2},
)


@pytest.mark.asyncio
async def test_rubric_weights_and_argument_passing():
    seen = {}

    def exact(completion, answer, parser) -> float:
        return parser.parse_answer(completion) == answer

    async def from_state(state, info, task, prompt, messages, rollout) -> float:
        await asyncio.sleep(0)
        seen.update(state=state, info=info, task=task, prompt=prompt, messages=messages, rollout=rollout)
        return state["s"] + info["k"]

    def everything(**kwargs) -> float:
        seen["kwargs"] = set(kwargs)
        return 0.5

    score = await Rubric([exact, from_state, everything], weights=[1.0, 0.5, -2.0]).score(TASK, ROLLOUT)
    assert score.per_function == {"exact": 1.0, "from_state": 3.0, "everything": 0.5}
    assert score.reward == pytest.approx(1.0 + 1.5 - 1.0) and score.errors == {}
    # `task` is verifiers' task name (a str: "default" without a `task` entry in info) that reads as the Task too
    assert seen["task"] == "default" and seen["task"].info is TASK.info and seen["task"].id == TASK.id
    assert seen["rollout"] is ROLLOUT and seen["messages"] == ROLLOUT.messages
    assert seen["kwargs"] == {
        "completion",
        "prompt",
        "messages",
        "answer",
        "task",
        "info",
        "state",
        "rollout",
        "parser",
    }


@pytest.mark.asyncio
async def test_rubric_errors_score_zero_and_are_reported():
    def crash(completion) -> float:
        raise RuntimeError("bug")

    def nan(completion) -> float:
        return float("nan")

    def text(completion):
        return "high"

    def one(completion) -> float:
        return 1.0

    score = await Rubric([crash, nan, text, one]).score(TASK, ROLLOUT)
    assert score.reward == 1.0
    assert score.per_function == {"crash": 0.0, "nan": 0.0, "text": 0.0, "one": 1.0}
    assert set(score.errors) == {"crash", "nan", "text"} and "RuntimeError: bug" in score.errors["crash"]


@pytest.mark.asyncio
@pytest.mark.timeout(20)
async def test_a_hung_async_reward_function_is_a_scoring_error_not_a_hang():
    """An awaited call with no deadline of its own held the rollout, and the whole step, for ever."""
    from gyre.envs.types import ScoringError

    async def hangs(completion) -> float:
        await asyncio.Event().wait()
        return 1.0

    async def own_timeout(completion) -> float:
        raise TimeoutError("the function's own client gave up")

    async def quick(completion) -> float:
        await asyncio.sleep(0)
        return 1.0

    with pytest.raises(ScoringError, match=r"'hangs' did not finish within 0.2s"):
        await Rubric([hangs, quick], timeout_s=0.2).score(TASK, ROLLOUT)
    rubric = Rubric([quick]).add(hangs, timeout_s=0.1).add(own_timeout)
    with pytest.raises(ScoringError, match=r"'hangs' did not finish within 0.1s"):
        await rubric.score(TASK, ROLLOUT)
    score = await Rubric([quick, own_timeout], timeout_s=5).score(TASK, ROLLOUT)
    assert score.reward == 1.0 and "TimeoutError: the function's own" in score.errors["own_timeout"]
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        Rubric(timeout_s=0)


@pytest.mark.asyncio
async def test_a_scoring_error_cancels_the_other_functions_of_the_rubric():
    """They ran on unawaited (a judge's request for a score nobody would read, a hung call up to its timeout)."""
    from gyre.envs.types import ScoringError

    cancelled = asyncio.Event()

    async def slow(completion) -> float:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 1.0

    async def judge_down(completion) -> float:
        await asyncio.sleep(0)
        raise ScoringError("judge unreachable")

    with pytest.raises(ScoringError):
        await Rubric([slow, judge_down]).score(TASK, ROLLOUT)
    await asyncio.wait_for(cancelled.wait(), 1)


def test_judges_have_their_own_deadlines_not_the_rubric_s(monkeypatch):
    from gyre.config.endpoint import JudgeConfig
    from gyre.envs import load_environment
    from gyre.envs.judge import add_to_rubric

    env = load_environment("reverse_text", num_eval=2)
    add_to_rubric(env, [JudgeConfig(url="http://127.0.0.1:9/v1", prompt="{response}")], [])
    assert env.rubric._timeouts == [env.rubric.timeout_s, None]


def test_rubric_rejects_bad_declarations():
    with pytest.raises(ValueError, match="completoin"):
        Rubric([lambda completoin: 1.0])
    with pytest.raises(ValueError, match="weights"):
        Rubric([lambda completion: 1.0], weights=[1.0, 2.0])
    rubric = Rubric().add(lambda completion: 1.0, name="a")
    with pytest.raises(ValueError, match="already"):
        rubric.add(lambda answer: 0.0, name="a")
    with pytest.raises(ValueError, match="finite"):
        rubric.add(lambda answer: 0.0, weight=float("inf"), name="b")


def test_names_and_weights_a_verifiers_user_writes_are_named_in_the_errors():
    """Two functools.partial rewards were both named "partial" ("already in this rubric", nothing else); a weight
    written as text ("0.5", from a config) was a TypeError naming nothing, and True a weight of 1."""
    import functools

    import numpy as np

    def scaled(completion, answer, scale=1.0) -> float:
        return scale

    rubric = Rubric([functools.partial(scaled, scale=2.0)], weights=[np.float32(0.5)])
    assert rubric.names == ["scaled"] and rubric.weights == [0.5]
    with pytest.raises(ValueError, match=r"'scaled' is already in this rubric: give this one its own name, rubric.add"):
        rubric.add(functools.partial(scaled, scale=3.0))
    rubric.add(functools.partial(scaled, scale=3.0), name="scaled_3")
    rubric.add_reward_func(lambda completion: 1.0, weight=0.25)  # verifiers' name for add: an AttributeError
    assert rubric.names[-1] == "<lambda>" and rubric.weights[-1] == 0.25
    for weight in ("0.5", True, None):
        with pytest.raises(ValueError, match=f"weight of 'w' must be a finite number, got {weight!r}"):
            rubric.add(lambda answer: 0.0, weight=weight, name="w")


@pytest.mark.parametrize(
    ("text", "split"),
    [
        ("42", (None, "42")),  # no reasoning: the text untouched
        ("<think>\nadd them\n</think>\n\n42", ("add them", "42")),
        ("add them\n</think>\n\n42", ("add them", "42")),  # the template opened the block
        ("<think>\nadd th", ("add th", "")),  # cut mid-thought: all reasoning, no reply
        ("<think>a</think>42<think>b", ("ab", "42")),  # opened again and never closed: reasoning too
    ],
)
def test_split_reasoning_is_what_a_reasoning_parser_returns_apart(text, split):
    from gyre.envs.parsers import split_reasoning, strip_reasoning

    assert split_reasoning(text) == split
    assert split[0] is None or split[1] == strip_reasoning(text).strip()
