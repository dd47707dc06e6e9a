"""Structured outputs and forced tool calls on a real `gyre inference` process, through real clients' own
code paths: the `openai` SDK's `parse()` / `stream()` with a pydantic model, langchain-openai's
`with_structured_output` (json_schema and function_calling), vLLM's `structured_outputs` / `guided_*`
fields, and `tool_choice` required / named, streamed and not.

The model is the session's tiny tool model (fine-tuned only to call `add`): whatever it would say, the
grammar makes its output follow the schema, so every object parses and validates.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from inference_testlib import TOOL_MESSAGES, TOOLS
from pydantic import BaseModel, Field

QUESTION = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    confidence: int = Field(ge=0, le=9)
    reason: str = Field(max_length=8)


NEG = {"type": "function", "function": {"name": "neg", "description": "Negate a number.",
       "parameters": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99}},
                      "required": ["x"], "additionalProperties": False}}}  # fmt: skip
ADD_SCHEMA = TOOLS[0]["function"]["parameters"]


@pytest.fixture(scope="module")
def server(start_server, tool_model):
    """The tool model with its whole context (two tool definitions do not fit the shared server's 256)."""
    return start_server("--run-id", "structured-tests", model_path=tool_model)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(server) -> str:
    return server.model_name


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


# ---- the openai SDK's parse() ------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_openai_parse_returns_the_pydantic_object(client, model_id, temperature):
    completion = client.chat.completions.parse(
        model=model_id, messages=QUESTION, response_format=Verdict, temperature=temperature, seed=3
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Verdict)
    assert Verdict.model_validate_json(choice.message.content) == choice.message.parsed


def test_openai_stream_with_a_response_format_returns_the_pydantic_object(client, model_id):
    with client.chat.completions.stream(
        model=model_id, messages=QUESTION, response_format=Verdict, temperature=1.0, seed=5, n=3
    ) as stream:
        deltas = [event.delta for event in stream if event.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(final.choices) == 3 and deltas
    for choice in final.choices:
        assert isinstance(choice.message.parsed, Verdict)
    assert len({choice.message.content for choice in final.choices}) > 1  # sampled, yet always valid


def test_json_object_mode_gives_a_json_object(client, model_id):
    completion = client.chat.completions.create(
        model=model_id, messages=QUESTION, response_format={"type": "json_object"}, temperature=0.0,
        max_tokens=200,
    )  # fmt: skip
    choice = completion.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # an unbounded object may run out of tokens (as on OpenAI); what is there is still its start
        assert choice.message.content.startswith("{")


# ---- tool_choice required / named ----------------------------------------------------------------------
def _calls(message):
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "neg"}}])
def test_tool_choice_required_and_named_return_calls_of_the_allowed_tools(client, model_id, tool_choice):
    wanted = "neg" if isinstance(tool_choice, dict) else None
    for temperature in (0.0, 1.0):
        completion = client.chat.completions.create(
            model=model_id, messages=TOOL_MESSAGES, tools=[*TOOLS, NEG], tool_choice=tool_choice,
            temperature=temperature, seed=11, parallel_tool_calls=False,
        )  # fmt: skip
        choice = completion.choices[0]
        # a named call ends "stop", as on OpenAI and vLLM; required (and auto) end "tool_calls"
        assert choice.finish_reason == ("stop" if wanted else "tool_calls")
        [(name, arguments)] = _calls(choice.message)
        assert name == wanted if wanted else name in ("add", "neg")
        jsonschema.validate(arguments, NEG["function"]["parameters"] if name == "neg" else ADD_SCHEMA)


# exactly two calls of `add` (the tags as the tool model's single tokens), whatever the model would write
TWO_CALLS = (
    'start: call "\\n" call\n'
    'call: <tool_call> "\\n{\\"name\\": \\"add\\", \\"arguments\\": {\\"a\\": 1}}\\n" </tool_call>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_returns_one_call_when_the_model_writes_two(client, model_id, stream):
    # tool_choice auto: the model may write several calls; OpenAI then promises at most one, vLLM keeps the first
    def calls(parallel: bool | None) -> list[tuple[str, str]]:
        options = {} if parallel is None else {"parallel_tool_calls": parallel}
        response = client.chat.completions.create(
            model=model_id, messages=TOOL_MESSAGES, tools=TOOLS, temperature=0, stream=stream,
            extra_body={"structured_outputs": {"grammar": TWO_CALLS}}, **options,
        )  # fmt: skip
        if not stream:
            assert response.choices[0].finish_reason == "tool_calls"
            return [(c.function.name, c.function.arguments) for c in response.choices[0].message.tool_calls]
        found, finish = [], None
        for chunk in response:
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                found += [(c.function.name, c.function.arguments) for c in choice.delta.tool_calls or []]
        assert finish == "tool_calls"
        return found

    assert calls(None) == calls(True) == [("add", '{"a": 1}')] * 2
    assert calls(False) == [("add", '{"a": 1}')]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "neg"}}])
def test_forced_tool_calls_stream(client, model_id, tool_choice):
    stream = client.chat.completions.create(
        model=model_id, messages=TOOL_MESSAGES, tools=[*TOOLS, NEG], tool_choice=tool_choice, stream=True,
        temperature=1.0, seed=2,
    )  # fmt: skip
    calls, finish = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    assert finish == ("stop" if isinstance(tool_choice, dict) else "tool_calls") and calls
    for call in calls.values():
        assert call["name"] == "neg" if isinstance(tool_choice, dict) else call["name"] in ("add", "neg")
        schema = NEG["function"]["parameters"] if call["name"] == "neg" else ADD_SCHEMA
        jsonschema.validate(json.loads(call["arguments"]), schema)


def test_the_openai_sdk_parses_forced_strict_tool_arguments(client, model_id):
    import openai

    tool = openai.pydantic_function_tool(Verdict)
    completion = client.chat.completions.parse(
        model=model_id, messages=QUESTION, tools=[tool], temperature=1.0, seed=8,
        tool_choice={"type": "function", "function": {"name": "Verdict"}},
    )  # fmt: skip
    [call] = completion.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Verdict)


def test_the_sdk_stream_helper_ends_every_streamed_tool_call(client, model_id):
    """`chat.completions.stream()` fires `tool_calls.function.arguments.done` (with the parsed arguments of a
    strict tool) for each call, the last one too: it did not when the calls came in the finishing chunk."""
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    for options in ({}, {"logprobs": True, "stream_options": {"include_usage": True}}):
        with client.chat.completions.stream(
            model=model_id, messages=TOOL_MESSAGES, tools=strict, temperature=0,
            extra_body={"structured_outputs": {"grammar": TWO_CALLS}}, **options,
        ) as stream:  # fmt: skip
            ends = [(e.index, e.name, e.parsed_arguments) for e in stream if e.type.endswith("arguments.done")]
            final = stream.get_final_completion()
        assert ends == [(0, "add", {"a": 1}), (1, "add", {"a": 1})]
        choice = final.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [call.function.parsed_arguments for call in choice.message.tool_calls] == [{"a": 1}] * 2


def test_the_sdk_helpers_messages_go_back_as_the_next_turn(client, model_id):
    """The agent loop of OpenAI's guide: append the message the SDK returned, then the tool results. The message
    of `parse()` / `stream()` carries the SDK's own `parsed`, `parsed_arguments` and (stream) `index`, which it
    sends back: accepted and ignored (the prompt is that of the plain message), not a 400."""
    import openai

    tool = openai.pydantic_function_tool(Verdict)
    forced = {"type": "function", "function": {"name": "Verdict"}}
    ask = {"model": model_id, "messages": QUESTION, "tools": [tool], "tool_choice": forced, "temperature": 0}
    parsed = client.chat.completions.parse(**ask).choices[0].message
    with client.chat.completions.stream(**ask) as stream:
        streamed = stream.get_final_completion().choices[0].message
    for message in (parsed, streamed):
        assert isinstance(message.tool_calls[0].function.parsed_arguments, Verdict)
        replies = [{"role": "tool", "tool_call_id": call.id, "content": "done"} for call in message.tool_calls]
        plain = {"role": "assistant", "content": message.content or None, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls]}  # fmt: skip
        usage = [
            client.chat.completions.create(model=model_id, messages=[*QUESTION, sent, *replies], tools=[tool],
                                           max_tokens=2, temperature=0).usage.prompt_tokens
            for sent in (message, plain)
        ]  # fmt: skip
        assert usage[0] == usage[1]


# ---- langchain-openai --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model(server, model_id):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=server.base_url, api_key="unused", model=model_id, temperature=1.0, seed=4,
                      max_retries=0, timeout=120)  # fmt: skip


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(chat_model, method):
    structured = chat_model.with_structured_output(Verdict, method=method)
    assert isinstance(structured.invoke(QUESTION[0]["content"]), Verdict)
    streamed = list(structured.stream(QUESTION[0]["content"]))
    assert streamed and isinstance(streamed[-1], Verdict)


# ---- vLLM's fields -----------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 50},
          "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["n", "tags"], "additionalProperties": False}  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "check"),
    [
        ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
        ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
        ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        ({"guided_regex": r"(yes|no)!"}, lambda t: t in ("yes!", "no!")),
        ({"structured_outputs": {"json": SCHEMA}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"guided_json": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"structured_outputs": {"grammar": 'start: "x" /[0-9]/ "y"'}}, lambda t: re.fullmatch(r"x[0-9]y", t)),
        ({"guided_grammar": 'root ::= "ab" | "cd"'}, lambda t: t in ("ab", "cd")),
    ],
)
def test_vllm_structured_output_fields_on_chat_and_completions(client, model_id, fields, check):
    chat = client.chat.completions.create(model=model_id, messages=QUESTION, temperature=1.0, seed=1, n=2,
                                          extra_body=fields)  # fmt: skip
    text = client.completions.create(model=model_id, prompt="Answer:", temperature=1.0, seed=1, max_tokens=60,
                                     extra_body=fields)  # fmt: skip
    outputs = [c.message.content for c in chat.choices] + [text.choices[0].text]
    assert all(check(output) for output in outputs), outputs
    assert {c.finish_reason for c in chat.choices} | {text.choices[0].finish_reason} == {"stop"}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"structured_outputs": {"regex": r"ok <tool_call> done"}}, "ok <tool_call> done"),
        ({"guided_choice": ["a<|im_end|>b"]}, "a<|im_end|>b"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "tag", "schema": {
            "type": "object", "properties": {"tag": {"enum": ["</tool_call>!"]}}, "required": ["tag"],
            "additionalProperties": False}}}}, '{"tag": "</tool_call>!"}'),
    ],
)  # fmt: skip
def test_a_literal_holding_a_special_tokens_text_comes_back_whole(http, model_id, fields, expected):
    """The tool model's tokenizer has <tool_call> as an added token and <|im_end|> as its end of turn: a
    grammar literal holding their text is generated as that text, to its end (it stopped right after
    the added token's text, or before the end-of-turn's, with finish_reason "stop")."""
    for stream in (False, True):
        body = {"model": model_id, "messages": QUESTION, "temperature": 1.0, "seed": 3, "n": 2, **fields}
        if not stream:
            choices = http.post("/v1/chat/completions", json=body).json()["choices"]
            assert [(c["message"]["content"], c["finish_reason"]) for c in choices] == [(expected, "stop")] * 2
            continue
        with http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        for index in (0, 1):
            deltas = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
            assert "".join(d["delta"].get("content") or "" for d in deltas) == expected
            assert deltas[-1]["finish_reason"] == "stop"


def test_constrained_logprobs_are_those_of_the_masked_distribution_and_stay_json(http, model_id):
    body = {"model": model_id, "messages": QUESTION, "logprobs": True, "top_logprobs": 5, "temperature": 1.0,
            "seed": 2, "structured_outputs": {"choice": ["yes", "no"]}}  # fmt: skip
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200 and "Infinity" not in response.text
    entries = response.json()["choices"][0]["logprobs"]["content"]
    for entry in entries:
        assert entry["logprob"] <= 0.0
        # alternatives the grammar ruled out show as -9999.0 (vLLM's convention), never as -Infinity
        assert all(alt["logprob"] == -9999.0 or alt["logprob"] <= 0 for alt in entry["top_logprobs"])
    assert sum(1 for e in entries[0]["top_logprobs"] if e["logprob"] > -9999.0) <= 2  # "yes" / "no" starts


# ---- refusals ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
         "response_format", "grammar engine refused"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "grammar engine refused"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "not several"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "not one of the tools"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "already constrains"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "only null is supported: the grammar"),
        ({"reasoning_effort": "high"}, "reasoning_effort", "only null is supported: the served model has no"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400_naming_the_field(http, model_id, fields, param, says):
    response = http.post("/v1/chat/completions", json={"model": model_id, "messages": QUESTION, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert says in error["message"] and (param is None or error["param"] == param), error


@pytest.mark.parametrize(
    "fields, param, says",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
            {"type": "function", "function": {"name": "add"}}]}}}, "tool_choice.type", "'allowed_tools' is not"),
        ({"tools": TOOLS, "tool_choice": {"type": "custom", "custom": {"name": "x"}}}, "tool_choice.type",
         "'custom' is not supported"),
        ({"tools": [*TOOLS, {"type": "custom", "custom": {"name": "x"}}]}, "tools.1.type",
         "'custom' tools are not supported: only {type: function} tools"),
    ],
)  # fmt: skip
def test_openai_s_newer_tool_shapes_are_one_400_naming_the_param(client, model_id, fields, param, says):
    """OpenAI's allowed_tools / custom tool_choice and custom tools: one 400 naming the param and what is taken;
    they were pydantic's union errors ("Input should be 'function' (and 2 more errors)")."""
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=model_id, messages=QUESTION, **fields)
    body = error.value.body
    assert body["param"] == param and says in body["message"] and "more errors" not in body["message"], body
