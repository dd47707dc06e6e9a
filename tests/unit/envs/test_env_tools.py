"""Tool calling: schemas from signatures, the tool protocol end to end, and failures the model is told about."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest
from envs_doubles import Reply, ScriptedClient
from gyre.envs import Task, Tool, ToolCall, ToolEnv, load_environment
from gyre.envs.tools import tool_calls_of


def text_call(name: str, arguments: dict) -> str:
    """A tool call as a server that does not parse calls returns it: raw text in the canonical form."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def structured_call(call_id: str, name: str, arguments: dict) -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments=arguments, raw_arguments=json.dumps(arguments))


def test_schema_from_signature_and_docstring():
    def search(
        query: str, limit: int = 5, exact: bool = False, tags: list[str] | None = None, mode: Literal["a", "b"] = "a"
    ):
        """Search the notes.

        More detail that is not part of the description.

        Args:
            query: what to look for,
                over several lines
            limit (int): how many results
        """

    schema = Tool.from_function(search).schema
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "search" and fn["description"] == "Search the notes."
    props = fn["parameters"]["properties"]
    assert props["query"] == {"type": "string", "description": "what to look for, over several lines"}
    assert props["limit"] == {"type": "integer", "description": "how many results"}
    assert props["exact"] == {"type": "boolean"}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert props["mode"] == {"enum": ["a", "b"]}
    assert fn["parameters"]["required"] == ["query"]


def test_declared_schema_wins_and_varargs_are_refused():
    params = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    tool = Tool.from_function(lambda x: x, name="ident", description="Identity.", parameters=params)
    assert tool.schema["function"] == {"name": "ident", "description": "Identity.", "parameters": params}
    with pytest.raises(ValueError, match="keyword"):
        Tool.from_function(lambda *xs: 0, name="sum_all")


def test_calculator_env_sends_its_schema():
    env = load_environment("calculator")
    assert [s["function"]["name"] for s in env.tool_schemas] == ["calculator"]
    assert env.tool_schemas[0]["function"]["parameters"]["required"] == ["expression"]


@pytest.mark.asyncio
@pytest.mark.parametrize("server_parses_calls", [True, False])
async def test_calculator_rollout_end_to_end(sampling, server_parses_calls):
    env = load_environment("calculator")
    task = env.tasks("train", 0)[0]
    arguments = {"expression": task.info["expression"]}
    if server_parses_calls:
        first = Reply("", tool_calls=[structured_call("call_abc", "calculator", arguments)])
    else:
        first = Reply(text_call("calculator", arguments))
    client = ScriptedClient([first, Reply(task.answer)])
    rollout = await env.rollout(client, task, sampling)
    assert rollout.stop_reason == "done" and rollout.num_turns == rollout.sequence_turns == 2
    assert client.calls[0]["tools"] == env.tool_schemas == client.calls[1]["tools"]
    tool_message = rollout.completion[1]
    assert tool_message["role"] == "tool" and tool_message["content"] == task.answer
    assert tool_message["tool_call_id"] == ("call_abc" if server_parses_calls else "call_1_0")
    if server_parses_calls:
        assert rollout.completion[0]["tool_calls"][0]["id"] == "call_abc"
    # The tool result is in the sequence but not in the loss.
    second = rollout.turns[1]
    end_first = len(rollout.turns[0].prompt_token_ids) + len(rollout.turns[0].completion_token_ids)
    tool_tokens = second.prompt_token_ids[end_first:]
    assert task.answer in "".join(map(chr, tool_tokens))
    assert not any(rollout.loss_mask[end_first : len(second.prompt_token_ids)])
    assert rollout.loss_mask[len(second.prompt_token_ids) :] == [True] * len(second.completion_token_ids)
    assert rollout.state["tool_calls"] == [
        {"turn": 1, "name": "calculator", "arguments": arguments, "ok": True, "result": task.answer}
    ]
    score = await env.score(task, rollout)
    assert score.reward == pytest.approx(1.2) and score.per_function == {"correct_answer": 1.0, "used_calculator": 1.0}


@pytest.mark.asyncio
async def test_a_call_on_the_last_turn_is_not_run_nor_credited(sampling):
    """The budget is spent after the call: no turn reads its result, so (as verifiers, which checks max_turns before
    env_response) the tool does not run and calculator's used_calculator gives no credit for it."""
    ran = []

    def calculator(expression: str) -> str:
        """Evaluate."""
        ran.append(expression)
        return "7"

    env = load_environment("calculator", max_turns=2)
    env.tools["calculator"] = Tool.from_function(calculator)
    task = env.tasks("train", 0)[0]
    replies = [text_call("calculator", {"expression": "3+4"}), text_call("calculator", {"expression": "1+1"})]
    rollout = await env.rollout(ScriptedClient(replies), task, sampling)
    assert rollout.stop_reason == "max_turns" and rollout.sequence_turns == 2
    assert ran == ["3+4"]  # the first turn's call ran; the last turn's did not
    assert [c["arguments"] for c in rollout.state["tool_calls"]] == [{"expression": "3+4"}]
    assert [m["role"] for m in rollout.completion] == ["assistant", "tool", "assistant"]

    one_turn = load_environment("calculator", max_turns=1)
    rollout = await one_turn.rollout(ScriptedClient([replies[0]]), task, sampling)
    assert rollout.stop_reason == "max_turns" and rollout.state["tool_calls"] == []
    assert (await one_turn.score(task, rollout)).per_function["used_calculator"] == 0.0


@pytest.mark.asyncio
async def test_answer_without_tool_ends_the_episode(sampling):
    env = load_environment("calculator")
    task = env.tasks("train", 0)[1]
    rollout = await env.rollout(ScriptedClient(["42"]), task, sampling)
    assert rollout.stop_reason == "done" and rollout.num_turns == 1 and rollout.state["tool_calls"] == []


@pytest.mark.asyncio
async def test_tool_failures_become_messages_not_crashes(sampling):
    env = load_environment("calculator", max_turns=6)
    task = env.tasks("train", 0)[2]
    replies = [
        text_call("calculator", {"expression": "__import__('os').system('true')"}),
        text_call("search", {"q": "x"}),
        text_call("calculator", {"expr": "1+1"}),
        "<tool_call>\n{not json}\n</tool_call>",
        Reply(
            "", tool_calls=[ToolCall.from_openai({"id": "c9", "function": {"name": "calculator", "arguments": "{x"}})]
        ),
        "7",
    ]
    rollout = await env.rollout(ScriptedClient(replies), task, sampling)
    tool_texts = [m["content"] for m in rollout.completion if m["role"] == "tool"]
    assert len(tool_texts) == 5 and all(t.startswith("Error: ") for t in tool_texts)
    assert "not allowed" in tool_texts[0]
    assert "unknown tool 'search'" in tool_texts[1] and "calculator" in tool_texts[1]
    assert "TypeError" in tool_texts[2] and "expr" in tool_texts[2]
    assert "not valid JSON" in tool_texts[3] and "not valid JSON" in tool_texts[4]
    assert (
        rollout.stop_reason == "done"
        and rollout.sequence_turns == 6
        and not any(c["ok"] for c in rollout.state["tool_calls"])
    )
    assert (await env.score(task, rollout)).per_function["used_calculator"] == 0.0


class Slow(ToolEnv):
    name = "slow"

    def make_task(self, rng, task_id):
        return Task(id=task_id, prompt=[{"role": "user", "content": "go"}])


async def nap(seconds: float) -> str:
    """Sleep, then say so."""
    await asyncio.sleep(seconds)
    return "slept"


def shout(text: str) -> dict:
    """Upper-case the text (returns JSON)."""
    return {"text": text.upper() * 100}


@pytest.mark.asyncio
async def test_async_tools_time_out_and_outputs_are_capped(sampling):
    env = Slow(tools=[nap, shout], tool_timeout=0.05, max_tool_output_chars=50, max_tool_calls=2, num_eval=1)
    calls = text_call("nap", {"seconds": 5}) + text_call("nap", {"seconds": 0}) + text_call("shout", {"text": "a"})
    rollout = await env.rollout(ScriptedClient([calls, "done"]), env.tasks("eval")[0], sampling)
    results = [m["content"] for m in rollout.completion if m["role"] == "tool"]
    assert results[0] == "Error: nap timed out after 0.05s"
    assert results[1] == "slept"
    assert results[2] == "Error: at most 2 tool calls per turn"
    env = Slow(tools=[shout], max_tool_output_chars=50, num_eval=1)
    rollout = await env.rollout(
        ScriptedClient([text_call("shout", {"text": "a"}), "ok"]), env.tasks("eval")[0], sampling
    )
    assert rollout.completion[1]["content"] == json.dumps({"text": "A" * 100})[:50] + "...[truncated]"


@pytest.mark.asyncio
async def test_a_result_json_cannot_hold_is_sent_as_text_not_an_error(sampling):
    """A tool returning a date, a Decimal or a set had run, yet json.dumps raised: the model got 'Error: TypeError:
    Object of type date is not JSON serializable' and state["tool_calls"] said it failed."""
    import datetime
    import decimal

    def today() -> dict:
        """The date."""
        return {"date": datetime.date(2026, 11, 27), "price": decimal.Decimal("1.50"), "tags": {"b", "a"}}

    env = Slow(tools=[today], num_eval=1)
    rollout = await env.rollout(ScriptedClient([text_call("today", {}), "ok"]), env.tasks("eval")[0], sampling)
    assert rollout.completion[1]["content"] == '{"date": "2026-11-27", "price": "1.50", "tags": ["a", "b"]}'
    assert rollout.state["tool_calls"][0]["ok"] is True


@pytest.mark.asyncio
async def test_error_messages_echoing_model_text_are_capped_too(sampling):
    """An unknown tool's name or an unexpected argument is echoed in the error: a 5000-character name came back as
    a 5045-character tool message, past `max_tool_output_chars`."""
    env = Slow(tools=[shout], max_tool_output_chars=50, num_eval=1)
    calls = text_call("x" * 5000, {}) + text_call("shout", {"text": "a", "y" * 5000: 1})
    rollout = await env.rollout(ScriptedClient([calls, "ok"]), env.tasks("eval")[0], sampling)
    results = [m["content"] for m in rollout.completion if m["role"] == "tool"]
    assert [r[:20] for r in results] == ["Error: unknown tool ", "Error: TypeError: go"]
    assert all(len(r) == 50 + len("...[truncated]") and r.endswith("...[truncated]") for r in results)


@pytest.mark.asyncio
async def test_deeply_nested_arguments_are_a_tool_error(sampling):
    """JSON nested past the parser's recursion limit raised RecursionError out of the rollout (and out of building
    the turn, for a server's structured call) instead of telling the model."""
    deep = "[" * 5000 + "]" * 5000
    env = load_environment("calculator", num_eval=1)
    text = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": {deep}}}}}</tool_call>'
    as_string = text_call("calculator", {}).replace("{}", json.dumps(f'{{"expression": {deep}}}'))
    rollout = await env.rollout(ScriptedClient([text, as_string, "7"]), env.tasks("eval")[0], sampling)
    assert rollout.error is None and rollout.stop_reason == "done"
    results = [m["content"] for m in rollout.completion if m["role"] == "tool"]
    assert results == ["Error: tool call is nested too deeply", "Error: arguments are nested too deeply"]
    structured = ToolCall.from_openai({"id": "c", "function": {"name": "calculator", "arguments": deep}})
    assert structured.error == "arguments are nested too deeply" and structured.arguments == {}


def test_tool_calls_of_reads_structured_and_text_calls():
    structured = {"role": "assistant", "content": "", "tool_calls": [structured_call("x", "f", {"a": 1}).to_openai()]}
    assert tool_calls_of(structured)[0].arguments == {"a": 1}
    broken = {"role": "assistant", "content": "", "tool_calls": [{"id": "y", "function": {"arguments": "{}"}}]}
    assert tool_calls_of(broken)[0].error and tool_calls_of(broken)[0].name == ""
    assert tool_calls_of({"role": "user", "content": text_call("f", {})}) == []
    assert tool_calls_of({"role": "assistant", "content": "no calls"}) == []


@pytest.mark.asyncio
async def test_a_call_written_only_while_thinking_is_no_call(sampling):
    """A `<tool_call>` inside the reasoning is one the model considered, not made (vLLM parses calls from the
    content after the reasoning): the episode ends on the reply after `</think>`, and a real call after it is the
    only one run."""
    env = load_environment("calculator")
    task = env.tasks("train", 0)[0]
    considered = "<think>I could write " + text_call("calculator", {"expression": "2+2"}) + " but no.</think>4"
    rollout = await env.rollout(ScriptedClient([considered]), task, sampling)
    assert rollout.stop_reason == "done" and rollout.num_turns == 1 and rollout.state["tool_calls"] == []

    real = "<think>use <tool_call> for it</think>\n" + text_call("calculator", {"expression": "3*3"})
    assert [(c.name, c.arguments, c.error) for c in tool_calls_of({"role": "assistant", "content": real})] == [
        ("calculator", {"expression": "3*3"}, None)
    ]
    # Qwen3-style: `<think>` is in the generation prompt, so the reply holds only its close
    assert tool_calls_of({"role": "assistant", "content": "hmm " + text_call("f", {}) + "</think>4"}) == []


def test_tool_names_must_be_unique():
    with pytest.raises(ValueError, match="unique"):
        Slow(tools=[nap, Tool.from_function(shout, name="nap")], num_eval=1)


# ---- a tool environment over the user's own dataset (a verifiers user's `ToolEnv(dataset=...)`) ----------------

CAPITALS = {"france": "paris", "norway": "oslo", "peru": "lima", "egypt": "cairo", "japan": "tokyo", "kenya": "nairobi"}


def capital(country: str) -> str:
    """The capital of a country.

    Args:
        country: the country's name
    """
    return CAPITALS[country.lower()]


def capitals_file(tmp_path, held_out: bool = True) -> str:
    path = tmp_path / "capitals.jsonl"
    rows = [{"question": f"Capital of {c}?", "answer": city, "country": c} for c, city in CAPITALS.items()]
    if held_out:
        rows[0]["split"] = "test"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.asyncio
async def test_a_tool_env_over_a_dataset_file_plays_its_rows_with_a_weighted_rubric(tmp_path, sampling):
    """Without `dataset`, a multi-turn or tool environment over a file had to draw its rows in make_task (with
    replacement, and num_eval's default of 256 past a small file's size failed as a task space too small); a
    verifiers user's `ToolEnv(dataset=..., rubric=Rubric(funcs, weights))` raised TypeError. Now the rows are the
    tasks, split and checked as the dataset environment's, every column in `info` for the rewards."""
    from gyre.envs import Rubric

    def correct(completion, answer, parser) -> float:
        return float(parser.parse_answer(completion) == answer)

    def used_tool(state) -> float:
        return float(any(call["ok"] for call in state["tool_calls"]))

    def asked_right(state, info) -> float:
        return float(any(call["arguments"].get("country") == info["country"] for call in state["tool_calls"]))

    rubric = Rubric([correct, used_tool, asked_right], weights=[1.0, 0.2, 0.5])
    env = ToolEnv(dataset=capitals_file(tmp_path), prompt_key="question", tools=[capital], max_turns=3, rubric=rubric,
                  system_prompt="Be brief.")  # fmt: skip
    evals, train = env.tasks("eval"), env.tasks("train", seed=3)
    assert [t.answer for t in evals] == ["paris"]  # the row marked "test"
    epoch = sorted(train[i].answer for i in range(5))
    assert epoch == sorted(set(CAPITALS.values()) - {"paris"})  # each train row once an epoch, never the eval row
    assert train[0] == env.tasks("train", seed=3)[0]  # a pure function of the index: a resumed run continues
    task = next(train[i] for i in range(5) if train[i].answer == "lima")
    assert task.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of peru?"}]
    rollout = await env.rollout(ScriptedClient([text_call("capital", {"country": "peru"}), "lima"]), task, sampling)
    assert rollout.stop_reason == "done" and rollout.completion[1]["content"] == "lima"
    score = await env.score(task, rollout)
    assert score.per_function == {"correct": 1.0, "used_tool": 1.0, "asked_right": 1.0} and score.reward == 1.7


def test_a_dataset_given_in_code_and_its_mistakes_name_the_row_and_the_setting(tmp_path):
    rows = [{"question": "Capital of peru?", "answer": "lima"}, {"question": "Capital of oslo?", "answer": "x"}]
    env = ToolEnv(dataset=rows, eval_dataset=rows[:1], prompt_key="question", tools=[capital])
    assert [t.answer for t in env.tasks("eval")] == ["lima"] and env.tasks("train", 0)[0].answer == "x"
    problems = [{"problem": row["question"], "answer": row["answer"]} for row in rows]
    with pytest.raises(ValueError, match=r"dataset row 0: no 'prompt' field \(the row has: problem, answer\); set "
                                         'prompt_key, e.g. prompt_key = "problem"'):  # fmt: skip
        ToolEnv(dataset=problems, tools=[capital], num_eval=1)
    with pytest.raises(ValueError, match="capitals.jsonl: 6 rows and num_eval=256 leave no training rows"):
        ToolEnv(dataset=capitals_file(tmp_path, held_out=False), prompt_key="question", tools=[capital])
    with pytest.raises(ValueError, match="dataset: a .jsonl or .parquet path, or a list of row dicts, got dict"):
        ToolEnv(dataset={"question": "q", "answer": "a"}, tools=[capital])
    with pytest.raises(ValueError, match="eval_dataset row 0: a row is a dict of columns, got str"):
        ToolEnv(dataset=rows, eval_dataset=["q"], prompt_key="question", tools=[capital])
    # an eval_dataset alone is an eval-only environment (a verifiers benchmark): eval runs, training says why not
    eval_only = ToolEnv(eval_dataset=rows, prompt_key="question", tools=[capital])
    assert [t.answer for t in eval_only.tasks("eval")] == ["lima", "x"]
    with pytest.raises(ValueError, match="it has an eval_dataset only, no train rows: evaluate it"):
        eval_only.tasks("train", 0)
