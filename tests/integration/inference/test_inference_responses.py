"""`POST /v1/responses` and `GET /v1/models/{id}` on a real server, through the openai SDK's own code paths
(`client.responses.create / stream / parse`, `client.models.retrieve`), whose stream helper checks the event
order as it accumulates. The model is the session's tiny tool model (it calls `add` for TOOL_MESSAGES)."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from inference_testlib import TOOL_MESSAGES, TOOLS
from pydantic import BaseModel, Field

FLAT_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]  # the Responses API's flat function tools


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    confidence: int = Field(ge=0, le=9)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def test_text_response_is_the_chat_completion_of_the_same_request(client, model_id):
    messages = [{"role": "user", "content": "Tell me a story."}]
    response = client.responses.create(model=model_id, input=messages, instructions="You tell stories.",
                                       max_output_tokens=16, temperature=0.0)  # fmt: skip
    chat = client.chat.completions.create(
        model=model_id, messages=[{"role": "system", "content": "You tell stories."}, *messages], max_tokens=16,
        temperature=0.0,
    )  # fmt: skip
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    finished = chat.choices[0].finish_reason
    assert response.status == ("incomplete" if finished == "length" else "completed")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert item.status == response.status  # the item max_output_tokens cut says so too (it said "completed")
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_streamed_events_follow_openais_order_and_add_up(client, model_id):
    events = list(client.responses.create(model=model_id, input="Once upon a time", max_output_tokens=16,
                                          temperature=1.0, stream=True))  # fmt: skip
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        events[-1].type,
    ] and events[-1].type in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == events[-4].text
    # sampled at temperature 1, the model may end the message (eos; the 16th token too) or be cut at max_output_tokens
    if final.status == "incomplete":
        assert final.incomplete_details.reason == "max_output_tokens" and final.usage.output_tokens == 16
    else:
        assert final.status == "completed" and 1 <= final.usage.output_tokens <= 16
    assert events[-2].item.status == final.output[0].status == final.status


def test_an_answer_cut_by_max_output_tokens_is_an_incomplete_item(client, model_id):
    for stream in (False, True):
        request = {"model": model_id, "input": "Tell me a story.", "max_output_tokens": 16, "temperature": 0.0}
        if stream:
            events = list(client.responses.create(**request, stream=True))
            response, done = events[-1].response, events[-2]
            assert done.type == "response.output_item.done" and done.item.status == "incomplete"
        else:
            response = client.responses.create(**request)
        assert response.status == "incomplete" and response.usage.output_tokens == 16
        assert [item.status for item in response.output] == ["incomplete"]


def test_function_tools_give_function_call_items_streamed_or_not_and_round_trip(client, model_id):
    first = client.responses.create(model=model_id, input=TOOL_MESSAGES, tools=FLAT_TOOLS, temperature=0.0)
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "add" and json.loads(call.arguments) == {"a": 1, "b": 2}
    with client.responses.stream(model=model_id, input=TOOL_MESSAGES, tools=FLAT_TOOLS, temperature=0.0) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    assert [(c.name, c.arguments) for c in streamed.output] == [(call.name, call.arguments)]
    # the tool result goes back as input items, after the call the model made: the next turn renders both
    follow = [*TOOL_MESSAGES, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": "3"}]  # fmt: skip
    second = client.responses.create(model=model_id, input=follow, tools=FLAT_TOOLS, max_output_tokens=16)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # history kept as item.model_dump() dicts: the SDK's fields this server never fills come back as nulls (phase,
    # namespace, caller were a 400 "Extra inputs are not permitted"), accepted and not rendered
    [message] = client.responses.create(model=model_id, input="Hello", max_output_tokens=16).output
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "3"}
    for items in ([call, answer], [message, {"role": "user", "content": "Again"}]):
        lean, full = (
            client.responses.create(model=model_id, input=[*TOOL_MESSAGES, *(dump(item) for item in items)],
                                    tools=FLAT_TOOLS, max_output_tokens=16).usage.input_tokens
            for dump in (lambda item: item if isinstance(item, dict) else item.model_dump(exclude_none=True),
                         lambda item: item if isinstance(item, dict) else item.model_dump())
        )  # fmt: skip
        assert full == lean


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "add"}])
def test_forced_tool_choice(client, model_id, tool_choice):
    response = client.responses.create(model=model_id, input="What is 5 plus 7?", tools=FLAT_TOOLS,
                                       tool_choice=tool_choice, temperature=1.0)  # fmt: skip
    assert [item.type for item in response.output] == ["function_call"] * len(response.output) and response.output
    assert all(item.name == "add" for item in response.output)


def test_structured_text_format_parses_with_the_sdk(client, model_id):
    parsed = client.responses.parse(model=model_id, input="Is water wet?", text_format=Verdict, temperature=1.0)
    assert isinstance(parsed.output_parsed, Verdict)
    with client.responses.stream(model=model_id, input="Is fire hot?", text_format=Verdict) as stream:
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Verdict)


def test_output_text_logprobs_when_included(client, model_id):
    response = client.responses.create(model=model_id, input="hi", max_output_tokens=16, top_logprobs=2,
                                       include=["message.output_text.logprobs"])  # fmt: skip
    logprobs = response.output[0].content[0].logprobs
    # one entry per output token (an early eos may end the message before max_output_tokens)
    assert len(logprobs) == response.usage.output_tokens and 1 <= len(logprobs) <= 16
    assert len(logprobs) == 16 or response.status == "completed"
    assert all(len(entry.top_logprobs) == 2 for entry in logprobs)


def test_streamed_deltas_carry_the_logprobs_of_every_token_they_hold(client, model_id):
    # A token whose text is held back (with tools: text that may begin a "\n<tool_call>" tag; a token ending inside a
    # character) releases none: its log-prob comes with the next delta (it was lost)
    for words in ("hi", "tell me more", "what now"):
        deltas, final = [], None
        for event in client.responses.create(model=model_id, input=words, max_output_tokens=30, top_logprobs=1,
                                             include=["message.output_text.logprobs"], tools=FLAT_TOOLS,
                                             stream=True):  # fmt: skip
            if event.type == "response.output_text.delta":
                deltas += [entry.model_dump() for entry in event.logprobs]
            final = event.response if event.type in ("response.completed", "response.incomplete") else final
        if [item.type for item in final.output] != ["message"]:
            continue  # the model called the tool (rare with these inputs): not the case under test
        every = [entry.model_dump() for entry in final.output[0].content[0].logprobs]
        assert len(every) == final.usage.output_tokens
        # in order, all of them but the end-of-turn token when it came after the last text
        assert deltas == every[: len(deltas)], words
        assert len(deltas) == len(every) or (len(deltas) == len(every) - 1 and final.status == "completed"), words


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id", "stores no responses"),
        ({"store": True}, "store", "stores no responses"),
        ({"background": True}, "background", "stores no responses"),
        ({"conversation": "conv_1"}, "conversation", "stores no conversations"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "input",
         "image input"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", None),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item references"),
        ({"truncation": "auto"}, "truncation", None),
    ],
)  # fmt: skip
def test_what_a_stateless_text_server_cannot_do_is_a_clear_400(http, model_id, fields, param, says):
    response = http.post("/v1/responses", json={"model": model_id, "input": "hi", **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith(param) and (says is None or says in error["message"]), error


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"input": "word " * 600}, "input", "in the input"),  # the context
        ({"max_output_tokens": 100_000}, "input", "100000 in the completion"),
        ({"tools": [{"type": "function", "name": "add"}], "tool_choice": {"type": "function", "name": "sub"}},
         "tool_choice", "not one of the tools"),
        ({"tools": [{"type": "function", "name": "add"}], "tool_choice": "required",
          "text": {"format": {"type": "json_object"}}}, "tool_choice", "constrains the output"),  # was param null
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format",
         "text.format: the grammar engine refused it"),  # was response_format
        ({"input": []}, "input", "Invalid 'input': empty array"),  # as chat's empty messages (code empty_array)
        # an input item's role was named input.0.message.role, "(as a list of objects (tagged-union[InputMessage,
        # FunctionCallItem,FunctionCallOutputItem]))"; without a role it was "an input item is a message, ..."
        ({"input": [{"role": "wizard", "content": "x"}]}, "input.0.role",
         "input.0.role: Input should be 'user', 'system', 'developer' or 'assistant' (as a list of objects)"),
        ({"input": [{"content": "x"}]}, "input.0.role", "input.0.role: Field required (as a list of objects)"),
        ({"input": [{"type": "message", "role": "user", "content": "x", "mood": 1}]}, "input.0.mood",
         "input.0.mood: Extra inputs are not permitted"),
        # an object missing its name was "Input should be 'auto', 'none' or 'required' (as an object (literal[...]))"
        ({"tools": [{"type": "function", "name": "add"}], "tool_choice": {"type": "function"}}, "tool_choice.name",
         "tool_choice.name: Field required"),
    ],
)  # fmt: skip
def test_errors_name_this_requests_fields_not_the_chat_requests(http, model_id, fields, param, says):
    # a Responses request runs as a chat completion: its errors must still name fields the client sent
    response = http.post("/v1/responses", json={"model": model_id, "input": "hi", **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"] and "messages" not in error["message"], error


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ('"input": "hi \\ud800"', "input"),
        ('"instructions": "be \\ud800", "input": "hi"', "instructions"),
        ('"instructions": "x", "input": [{"role": "user", "content": "a"}, {"role": "user", "content": "\\ud800"}]',
         "input.1.content"),  # the instructions' system message is messages.0: this was messages.2.content
        ('"input": [{"role": "user", "content": [{"type": "input_text", "text": "\\ud800"}]}]',
         "input.0.content.0.text"),
        ('"input": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"type": "function_call", '
         '"call_id": "c", "name": "f", "arguments": "{}"}, {"type": "function_call", "call_id": "d", "name": "f", '
         '"arguments": "\\ud800"}]', "input.3.arguments"),  # the second call of the assistant turn at messages.1
        ('"input": [{"role": "user", "content": "a"}, {"type": "function_call", "call_id": "c", "name": "f", '
         '"arguments": "{}"}, {"type": "function_call_output", "call_id": "c", "output": "\\ud800"}]',
         "input.2.output"),
        ('"input": "hi", "tools": [{"type": "function", "name": "f", "description": "\\ud800"}]',
         "tools.0.description"),
    ],
)  # fmt: skip
def test_errors_of_the_prompt_name_the_input_item_and_field(http, model_id, fields, param):
    # Text that cannot be tokenized (a lone surrogate) is found while the chat prompt is built: its error named the
    # chat request's messages.N (N off by one after instructions) and tools.N.function.description
    body = f'{{"model": "{model_id}", "max_output_tokens": 16, {fields}}}'
    response = http.post("/v1/responses", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: the text holds a lone"), error


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("responses", "chat", "param"),
    [
        # the options of a stream nobody asked for: chat refused them, responses ignored them
        ({"stream_options": {"include_usage": True}}, {"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {"include_obfuscation": False}},
         {"stream": False, "stream_options": {"include_obfuscation": False}}, "stream_options"),
        # a format name OpenAI refuses: a 400 on chat, a 500 (ValidationError while translating) on responses
        ({"text": {"format": {"type": "json_schema", "name": "my format", "schema": SCHEMA}}},
         {"response_format": {"type": "json_schema", "json_schema": {"name": "my format", "schema": SCHEMA}}},
         ("text.format.name", "response_format.json_schema.name")),
        ({"tool_choice": "required"}, {"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "name": "add"}},
         {"tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x" * 65, "schema": SCHEMA}}},
         {"response_format": {"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": SCHEMA}}},
         ("text.format.name", "response_format.json_schema.name")),
    ],
)  # fmt: skip
def test_responses_refuse_what_chat_refuses_with_the_same_error(client, model_id, responses, chat, param):
    ours, theirs = param if isinstance(param, tuple) else (param, param)
    with pytest.raises(openai.BadRequestError) as chat_error:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       **chat)  # fmt: skip
    with pytest.raises(openai.BadRequestError) as responses_error:
        client.responses.create(model=model_id, input="hi", max_output_tokens=16, **responses)
    got, expected = responses_error.value.body, chat_error.value.body
    assert expected["param"] == theirs, expected
    assert (got["type"], got["code"], got["param"]) == (expected["type"], expected["code"], ours), got
    assert got["message"] == expected["message"].replace(theirs, ours), got


def test_a_model_card_by_id(client, model_id, http):
    card = client.models.retrieve(model_id)  # the id is a folder path: slashes and all
    assert card.id == model_id and card.object == "model"
    assert http.get(f"/v1/models/{model_id}").json() == http.get("/v1/models").json()["data"][0]
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve("gpt-9")
    assert error.value.body["code"] == "model_not_found"
