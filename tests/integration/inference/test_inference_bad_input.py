"""Bad input gets a 4xx with OpenAI's error JSON naming the problem; never a 5xx; the server stays up."""

from __future__ import annotations

import copy
import gzip
import json

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from inference_testlib import TOOLS
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

# Responses must match the OpenAPI document: documented status, media type, headers and body schema.
CONFORMANCE = [not_a_server_error, status_code_conformance, content_type_conformance,
               response_headers_conformance, response_schema_conformance]  # fmt: skip

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def assert_error(response: httpx.Response, status: int, param: str | None = "any", code: str | None = "any"):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error"}.get(
        status, error["type"]
    )
    if param != "any":
        assert error["param"] == param, error
    if code != "any":
        assert error["code"] == code, error
    return error


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        # wrong types (strict: no coercion across JSON types)
        ("/v1/chat/completions", {"n": "2"}, "n"),
        ("/v1/chat/completions", {"logprobs": 0}, "logprobs"),
        ("/v1/chat/completions", {"temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ("/v1/chat/completions", {"stream": "yes"}, "stream"),
        ("/v1/chat/completions", {"seed": 1.5}, "seed"),
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt.1"),
        ("/v1/chat/completions", {"user": 5}, "user"),  # a top-level `user` is named (only a role tag is dropped)
        ("/v1/completions", {"user": ["u"]}, "user"),
        # values out of range
        ("/v1/chat/completions", {"n": 0}, "n"),
        ("/v1/chat/completions", {"n": -1}, "n"),
        ("/v1/chat/completions", {"n": 129}, "n"),
        ("/v1/chat/completions", {"max_tokens": -5}, "max_tokens"),
        ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"max_completion_tokens": -1}, "max_completion_tokens"),
        ("/v1/completions", {"max_tokens": -1}, "max_tokens"),
        ("/v1/chat/completions", {"temperature": -0.1}, "temperature"),
        ("/v1/chat/completions", {"top_p": 0}, "top_p"),
        ("/v1/chat/completions", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages.0.role"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}, {"content": "y"}]}, "messages.1.role"),
        ("/v1/chat/completions", {"stop": [""]}, "stop.0"),  # the item the message names
        ("/v1/chat/completions", {"stop": ""}, "stop"),  # a plain empty string too (OpenAI refuses it)
        ("/v1/completions", {"stop": ""}, "stop"),
        ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),  # without tools
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "structural_tag"}}, "response_format.type"),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format.json_schema.name",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "assistant", "content": "x", "refusal": "no"}]},
            "messages.0.refusal",
        ),  # fmt: skip
        # unknown fields, anywhere
        ("/v1/chat/completions", {"frobnicate": 1}, "frobnicate"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "mood": "sad"}]}, "messages.0.mood"),
        ("/v1/completions", {"frobnicate": 1}, "frobnicate"),
        # features this server does not implement are refused, not silently ignored
        ("/v1/chat/completions", {"presence_penalty": 2.5}, "presence_penalty"),  # vLLM's and OpenAI's [-2, 2]
        ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),  # vLLM: > 0
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("/v1/completions", {"echo": True, "logprobs": 1, "stream": True}, None),  # non-streaming only
        ("/v1/chat/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"-1": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"5": 100.5}}, "logit_bias.5"),
        ("/v1/chat/completions", {"min_tokens": -1}, "min_tokens"),
        ("/v1/chat/completions", {"seed": 2**63}, "seed"),
        ("/v1/chat/completions", {"stream": True, "stream_options": {"usage": True}}, "stream_options.usage"),
        ("/v1/chat/completions", {"continue_final_message": True}, None),  # add_generation_prompt is true
        ("/tokenize", {"prompt": "x", "return_token_strs": 1}, "return_token_strs"),
        ("/v1/completions", {"best_of": 2}, "best_of"),
        ("/v1/completions", {"suffix": "x"}, "suffix"),
        ("/tokenize", {"prompt": 3}, None),
        ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ],
)
def test_invalid_fields_are_400_naming_the_field(http, model_id, route, body, param):
    base = {"model": model_id, **(CHAT if route == "/v1/chat/completions" else {})}
    if route == "/v1/completions":
        base |= {"prompt": "hi", "max_tokens": 2}
    if route == "/tokenize":
        base = {}
    if route == "/detokenize":
        base = {}
    error = assert_error(http.post(route, json=base | body), 400)
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize(
    ("field", "literal"),
    [("temperature", "NaN"), ("top_p", "NaN"), ("temperature", "-Infinity"), ("logit_bias", '{"5": NaN}')],
)
def test_nan_and_infinity_are_refused_as_not_finite(http, model_id, field, literal):
    """Python's json (and clients built on it) writes float("nan") as NaN: the 400 said "temperature: Input
    should be less than or equal to 2", which a user reading 0.7 in their config cannot make sense of."""
    body = json.dumps({"model": model_id, **CHAT})[:-1] + f', "{field}": {literal}}}'
    response = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    error = assert_error(response, 400)
    assert error["param"].startswith(field) and "finite number" in error["message"], error


def test_cross_field_rules(http, model_id):
    """A rule across fields names the field out of place (param was null: pydantic puts such an error on the body)."""
    for route, body, param in (
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"max_tokens": 2, "max_completion_tokens": 2}, "max_tokens"),
        ("/v1/chat/completions", {"min_tokens": 3}, "min_tokens"),
        ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1, "stream": True}, "logprobs"),
    ):
        base = {"model": model_id, **(CHAT if route == "/v1/chat/completions" else {"max_tokens": 2})}
        assert_error(http.post(route, json={**base, **body}), 400, param=param)
    # OpenAI's own words and code (clients such as langchain's ChatOpenAI hit it when both are set)
    body = {"model": model_id, **CHAT, "max_completion_tokens": 2}
    response = http.post("/v1/chat/completions", json=body)
    error = assert_error(response, 400, "max_tokens", "invalid_parameter_combination")
    assert error["message"] == "Setting 'max_tokens' and 'max_completion_tokens' at the same time is not supported."


@pytest.mark.parametrize("body", [b"not json", b'{"model": ', b"[1, 2]", b'"a string"', b"", b"\xff\xfe"])
def test_bodies_that_are_not_a_json_object(http, body):
    error = assert_error(
        http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"}), 400
    )
    assert "JSON" in error["message"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "it is not UTF-8 (byte 0xe9 at position 46)"),
        (b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "it is nested too deeply"),
        (b'{"messages": [], "n": ' + b"9" * 5000 + b"}", "an integer in it has more than 4300 digits"),
    ],
)
def test_a_body_the_json_parser_cannot_read_says_why(http, body, says):
    """Latin-1 text, nesting past the parser's recursion limit, an integer past Python's digit limit: FastAPI's
    400 said "There was an error parsing the body", which did not say what to fix."""
    response = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    error = assert_error(response, 400, param=None)
    assert error["message"] == f"request body is not valid JSON: {says}", error


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize"])
def test_a_json_object_under_another_content_type_is_told_so(http, model_id, route, content_type):
    # `curl -d` sends form-urlencoded: the body is a good JSON object, the header is what is wrong
    body = {"model": model_id, "prompt": "hi", "max_tokens": 2} if route != "/v1/chat/completions" else \
        {"model": model_id, **CHAT}  # fmt: skip
    if route == "/v1/responses":
        body = {"model": model_id, "input": "hi", "max_output_tokens": 16}
    headers = {"content-type": content_type} if content_type else {}
    error = assert_error(http.post(route, content=json.dumps(body), headers=headers), 400, param=None)
    assert "Content-Type: application/json" in error["message"], error
    assert (content_type or "no Content-Type") in error["message"], error


def test_prompts_too_long_for_the_context(http, model_id):
    error = assert_error(
        http.post("/v1/completions", json={"model": model_id, "prompt": [5] * 250, "max_tokens": 10}),
        400,
        param="prompt",
        code="context_length_exceeded",
    )
    assert "256" in error["message"] and "260" in error["message"]
    assert_error(http.post("/v1/completions", json={"model": model_id, "prompt": [5] * 300, "max_tokens": None}), 400,
                 code="context_length_exceeded")  # fmt: skip
    long_chat = {"model": model_id, "messages": [{"role": "user", "content": "word " * 400}]}
    error = assert_error(
        http.post("/v1/chat/completions", json=long_chat), 400, param="messages", code="context_length_exceeded"
    )
    # no max_tokens given: the message is about the prompt alone (it said "1 in the completion", asked of nobody)
    assert "maximum context length is 256 tokens" in error["message"] and "in the completion" not in error["message"]
    assert "in the messages, which leaves no room for the completion" in error["message"], error
    assert_error(http.post("/v1/completions", json={"model": model_id, "prompt": ""}), 400, param="prompt")
    assert_error(http.post("/v1/completions", json={"model": model_id, "prompt": [5, 99999]}), 400, param="prompt")
    assert_error(http.post("/detokenize", json={"tokens": [99999]}), 400, param="tokens")


@pytest.mark.parametrize(
    ("route", "body", "says"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "the 10 of the messages"),
        ("/v1/completions", {"prompt": [[5] * 3, [5] * 10], "max_tokens": None}, "the 10 of prompt.1"),
        ("/v1/completions", {"prompt": [5] * 10, "max_tokens": None}, "the 10 of the prompt"),
    ],
)
def test_min_tokens_over_what_the_context_leaves_is_400(http, model_id, route, body, says):
    """Without max_tokens a choice may run to the end of the context: min_tokens past that was accepted and the choice
    ended by length before it (vLLM refuses it, as a given max_tokens below min_tokens is refused here)."""
    error = assert_error(http.post(route, json={"model": model_id, **body, "min_tokens": 250}), 400, "min_tokens")
    assert error["message"] == f"min_tokens (250) must be at most max_tokens, which is 246 here: the context's 256 " \
                               f"tokens less {says}", error  # fmt: skip
    ok = http.post(route, json={"model": model_id, **body, "min_tokens": 246, "ignore_eos": True})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    ("prompt", "says"),
    [
        (["hi", ""], "prompt.1: the prompt is empty"),
        (["hi", "word " * 300], " in prompt.1, 2 in the completion). Please reduce the length of prompt.1 or"),
        ([[5, 6], [5] * 300], "(300 in prompt.1, 2 in the completion)"),
    ],
)
def test_one_prompt_of_a_list_is_named_by_its_index(http, model_id, prompt, says):
    """As an out-of-vocabulary id in one of them is (prompt.1): an empty or too long prompt of a batch of 256 was
    "prompt", leaving the client to find which."""
    response = http.post("/v1/completions", json={"model": model_id, "prompt": prompt, "max_tokens": 2})
    error = assert_error(response, 400, param="prompt.1")
    assert says in error["message"], error


def test_stop_token_ids_out_of_vocabulary_are_a_400_and_other_requests_run_on(http, client, model_id):
    # With min_tokens the engine suppresses the stop ids by biasing their logits: an id past the vocabulary failed
    # the engine step, a 500 for this request and for every other one in the batch
    hi = [{"role": "user", "content": "hi"}]
    with client.chat.completions.create(
        model=model_id, messages=hi, max_tokens=40, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
    ) as other:
        chunks = iter(other)
        next(chunks)
        bad = {"min_tokens": 2, "stop_token_ids": [7, 99999]}
        for create in (
            lambda: client.chat.completions.create(model=model_id, messages=hi, max_tokens=4, extra_body=bad),
            lambda: client.completions.create(model=model_id, prompt="hi", max_tokens=4, extra_body=bad),
            lambda: client.completions.create(model=model_id, prompt="hi", max_tokens=4, stream=True, extra_body=bad),
        ):  # fmt: skip
            with pytest.raises(openai.BadRequestError) as refused:
                create()
            assert (refused.value.body["param"], refused.value.body["code"]) == ("stop_token_ids", None)
            assert "token id 99999 is out of vocabulary" in refused.value.body["message"]
        generate = {"model": model_id, "token_ids": [5, 6], "sampling_params": {"max_tokens": 4, **bad}}
        tokens_in = http.post("/inference/v1/generate", json=generate)
        assert_error(tokens_in, 400, param="sampling_params.stop_token_ids")
        rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "length"  # the request in flight was not failed with them


def test_unknown_model_route_and_method(http):
    # OpenAI: 404, type invalid_request_error, code model_not_found
    for route, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "x"}), ("/tokenize", {})):
        response = http.post(route, json={"model": "gpt-9", "prompt": "x", **body} if route == "/tokenize" else
                             {"model": "gpt-9", **body})  # fmt: skip
        assert response.status_code == 404, response.text
        assert response.json()["error"] | {"message": ""} == {
            "message": "", "type": "invalid_request_error", "param": "model", "code": "model_not_found"
        }  # fmt: skip
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/v1/chat/completions"), 405)


def test_the_openai_client_sees_typed_errors(client, model_id):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "x"}], n=0)
    assert error.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("call", "param", "code", "says"),
    [
        # OpenAI's minimum for the Responses API (it accepted 1 to 15)
        (lambda c, m: c.responses.create(model=m, input="hi", max_output_tokens=15), "max_output_tokens",
         "integer_below_min_value", "Expected a value >= 16, but got 15 instead."),
        (lambda c, m: c.chat.completions.create(model=m, messages=HI, max_completion_tokens=0),
         "max_completion_tokens", "integer_below_min_value", "Expected a value >= 1, but got 0 instead."),
        (lambda c, m: c.chat.completions.create(model=m, messages=HI, n=129), "n", "integer_above_max_value",
         "Expected a value <= 128, but got 129 instead."),
        (lambda c, m: c.chat.completions.create(model=m, messages=HI, temperature=2.5), "temperature",
         "decimal_above_max_value", "Expected a value <= 2, but got 2.5 instead."),
        (lambda c, m: c.chat.completions.create(model=m, messages=HI, temperature=3), "temperature",
         "decimal_above_max_value", "Expected a value <= 2, but got 3 instead."),  # the field's type, not the value's
        (lambda c, m: c.chat.completions.create(model=m, messages=HI, top_p=0), "top_p", "decimal_below_min_value",
         "Expected a value > 0, but got 0 instead."),
        (lambda c, m: c.chat.completions.create(model=m, messages=HI, logprobs=True, top_logprobs=21), "top_logprobs",
         "integer_above_max_value", "Expected a value <= 20, but got 21 instead."),
        (lambda c, m: c.completions.create(model=m, prompt="hi", logprobs=21), "logprobs", "integer_above_max_value",
         "Expected a value <= 20"),
        (lambda c, m: c.chat.completions.create(model=m, messages=HI, seed=2**63), "seed", "integer_above_max_value",
         "Expected a value <= 9223372036854775807"),
        (lambda c, m: c.chat.completions.create(model=m, messages=HI, stop=[str(i) for i in range(17)]), "stop",
         "array_above_max_length", "Expected an array with maximum length 16, but got an array with length 17"),
        (lambda c, m: c.chat.completions.create(model=m, messages=[]), "messages", "empty_array",
         "Expected an array with minimum length 1, but got an empty array instead."),
        # vLLM's (and OpenAI's) ranges of the penalties
        (lambda c, m: c.chat.completions.create(model=m, messages=HI, presence_penalty=2.5), "presence_penalty",
         "decimal_above_max_value", "Expected a value <= 2, but got 2.5 instead."),
        (lambda c, m: c.completions.create(model=m, prompt="hi", frequency_penalty=-3), "frequency_penalty",
         "decimal_below_min_value", "Expected a value >= -2, but got -3 instead."),
        (lambda c, m: c.completions.create(model=m, prompt="hi", extra_body={"repetition_penalty": 0}),
         "repetition_penalty", "decimal_below_min_value", "Expected a value > 0, but got 0 instead."),
    ],
)  # fmt: skip
def test_values_out_of_range_get_openai_s_error_code_and_message(client, model_id, call, param, code, says):
    """What OpenAI answers a value out of its range: a 400 whose code clients match on (`integer_below_min_value`
    ...) and whose message names the bound and the value sent. Before, every such error had code null, and
    /v1/responses accepted max_output_tokens below 16."""
    with pytest.raises(openai.BadRequestError) as error:
        call(client, model_id)
    body = error.value.body
    assert (body["param"], body["code"], body["type"]) == (param, code, "invalid_request_error"), body
    assert says in body["message"], body
    if code is not None:
        assert body["message"].startswith(f"Invalid '{param}': "), body


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"stop": 5}, "stop: must be a string or a list of strings"),
        ({"stop": ["a", ""]}, "stop.1: String should have at least 1 character"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content: must be a string or a list of"),
        ({"response_format": {"type": "json_schema"}}, "json_schema is required with type 'json_schema'"),
        ({"tool_choice": "auto"}, "tool_choice is only allowed when tools are specified"),
        # was "logit_bias: String should match pattern '^[0-9]{1,10}$'", not naming the key
        ({"logit_bias": {"5": 1, "-1": 1}}, "logit_bias: key '-1' is not a token id (a non-negative integer, as a"),
        ({"logit_bias": {"5.0": 1}}, "logit_bias: key '5.0' is not a token id"),
        # a message's role missing or none of the roles was "messages.0: Unable to extract tag using discriminator
        # 'role'" / "messages.0: Input tag 'function' found using 'role' does not match any of the expected tags"
        ({"messages": [{"content": "x"}]}, "messages.0.role: Field required"),
        (
            {"messages": [{"role": "function", "name": "f", "content": "x"}]},
            "messages.0.role: Input should be one of 'system', 'developer', 'user', 'assistant', 'tool' (got 'function",
        ),
        # tool_choice is a string or an object: each says what is wrong with it as what it is (both were "Input
        # should be 'auto', 'none' or 'required' (as an object (literal['auto','none','required']))")
        (
            {"tools": TOOLS, "tool_choice": "any"},
            "tool_choice: must be one of 'auto', 'none', 'required' or a named tool, "
            '{"type": "function", "function": {"name": ...}}',
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function"}},
            "tool_choice.function: Field required (as a named tool",
        ),
        # a union member's class name meant nothing to a client: "(as a list of objects (TextPart))"
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages.0.content.0.text: Field required (as a list of text parts)",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
            "tool_choice.function.name: Field required",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}},
            "tool_choice.type: 'allowed_tools' is not supported",
        ),
    ],
)
def test_messages_say_what_a_multi_type_field_accepts(http, model_id, body, says):
    error = assert_error(http.post("/v1/chat/completions", json={"model": model_id, **CHAT, **body}), 400)
    assert says in error["message"], error
    # param is the field the message names (tool_choice.function), as for a field of one type
    assert error["message"].startswith(f"{error['param']}: "), error
    completion = {"model": model_id, "prompt": 3.5}
    message = assert_error(http.post("/v1/completions", json=completion), 400, param="prompt")["message"]
    assert message == "prompt: must be a string, a list of integers, a list of strings or a list of lists of integers"
    # the broken constraint is named, not the first item read as an integer ("prompt.0: Input should be a valid
    # integer (as a list of integers)")
    completion = {"model": model_id, "prompt": [[5, 6], []]}  # param: the field the message names (was "prompt")
    message = assert_error(http.post("/v1/completions", json=completion), 400, param="prompt.1")["message"]
    assert message.startswith("prompt.1: List should have at least 1 item") and "(as a list of lists of" in message


CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
ASK = {"role": "user", "content": "1 plus 2?"}


@pytest.mark.parametrize(
    ("messages", "param", "says"),
    [
        ([ASK, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "3"}],
         "messages.2.tool_call_id", "Field required"),
        ([ASK, {"role": "tool", "tool_call_id": "call_1", "content": "3"}], "messages.1.role",
         "must follow an assistant message"),
        ([ASK, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_2", "content": "3"}],
         "messages.2.tool_call_id", "'call_2' is not the id of one of the previous assistant message's tool_calls"),
        ([ASK, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_1", "content": "3"},
          ASK, {"role": "tool", "tool_call_id": "call_1", "content": "3"}], "messages.4.role", "must follow"),
    ],
)  # fmt: skip
def test_a_tool_message_must_answer_a_tool_call(client, model_id, messages, param, says):
    """As OpenAI (and vLLM for the missing id): a tool message names the call it answers, one of the
    previous assistant message's tool_calls; it was accepted and rendered whatever it said."""
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=model_id, messages=messages, max_tokens=2)
    body = error.value.body
    assert body["param"] == param and says in body["message"] and body["type"] == "invalid_request_error", body


@pytest.mark.parametrize("assistant", [{"role": "assistant", "content": None}, {"role": "assistant"},
                                       {"role": "assistant", "content": None, "tool_calls": []}])  # fmt: skip
def test_an_assistant_message_needs_content_or_tool_calls(client, model_id, assistant):
    """As OpenAI ("required unless tool_calls is specified"); it rendered as an empty assistant turn."""
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=model_id, messages=[ASK, assistant, ASK], max_tokens=2)
    assert error.value.body["param"] == "messages.1" and "needs content" in error.value.body["message"]
    empty = client.chat.completions.create(model=model_id, messages=[ASK, {"role": "assistant", "content": ""}, ASK],
                                           max_tokens=2)  # fmt: skip
    assert empty.choices[0].finish_reason in ("stop", "length")


def test_tool_replies_that_answer_their_calls_are_accepted(client, model_id):
    """Several calls answered in any order; and calls the model left as `<tool_call>` text (no structured
    tool_calls: a client such as gyre's environments parsed them itself) answered with the client's ids."""
    second = {**CALL, "id": "call_2"}
    structured = [ASK, {"role": "assistant", "content": None, "tool_calls": [CALL, second]},
                  {"role": "tool", "tool_call_id": "call_2", "content": "3"},
                  {"role": "tool", "tool_call_id": "call_1", "content": "3"}]  # fmt: skip
    as_text = [ASK, {"role": "assistant", "content": '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>'},
               {"role": "tool", "tool_call_id": "call_0_0", "content": "3"}]  # fmt: skip
    # OpenAI's cookbook names the function in its result: a 400 "messages.2.name: Extra inputs are not permitted"
    named = [ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]},
             {"role": "tool", "tool_call_id": "call_1", "name": "add", "content": "3"}]  # fmt: skip
    for messages in (structured, as_text, named):
        answer = client.chat.completions.create(model=model_id, messages=messages, max_tokens=2)
        assert answer.choices[0].finish_reason in ("stop", "length")


def test_a_function_call_output_must_answer_a_function_call(client, model_id):
    """The Responses API's form of the same rule, naming the input item."""
    call = {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": "{}"}
    for items, param in (
        ([call, {"type": "function_call_output", "call_id": "call_9", "output": "3"}], "input.1"),
        ([{"type": "function_call_output", "call_id": "call_1", "output": "3"}], "input.0"),
    ):
        with pytest.raises(openai.BadRequestError) as error:
            client.responses.create(model=model_id, input=items, max_output_tokens=16)
        assert error.value.body["param"] == param and "no function_call with call_id" in error.value.body["message"]
    ok = client.responses.create(model=model_id, max_output_tokens=16, input=[
        call, {"type": "function_call_output", "call_id": "call_1", "output": "3"}])  # fmt: skip
    assert ok.status in ("completed", "incomplete")


GOOD_TOOL = {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("tool_choice", [None, "auto", "none", "required", {"type": "function", "function":
                                                                            {"name": "bad"}}])  # fmt: skip
@pytest.mark.parametrize(
    ("parameters", "says"),
    [
        ({"type": "frob"}, "Invalid type: frob"),
        ({"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}, "minimum"),
        ({"type": "object", "required": "a"}, "required"),
    ],
)
def test_an_invalid_tool_schema_is_400_whatever_the_tool_choice(client, model_id, tool_choice, parameters, says):
    """OpenAI validates every tool's schema; it was checked only when a call was forced (and then named
    tool_choice), so with auto / none / no tool_choice an invalid schema went to the template unnoticed."""
    tools = [GOOD_TOOL, {"type": "function", "function": {"name": "bad", "parameters": parameters}}]
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=model_id, messages=CHAT["messages"], max_tokens=2, tools=tools, **extra)
    body = error.value.body
    assert body["param"] == "tools.1.function.parameters" and body["type"] == "invalid_request_error", body
    assert "invalid JSON schema for function 'bad'" in body["message"] and says in body["message"], body
    with pytest.raises(openai.BadRequestError) as error:  # the Responses API names its own field
        client.responses.create(model=model_id, input="hi", max_output_tokens=16,
                                tools=[{"type": "function", **t["function"]} for t in tools],
                                **({} if isinstance(tool_choice, dict) else extra))  # fmt: skip
    assert error.value.body["param"] == "tools.1.parameters", error.value.body


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"messages": CHAT["messages"], "tools": [{"type": "function", "function": {"name": "f", "parameters":
          {"type": "frob"}}}]}, "tools.0.function.parameters", "invalid JSON schema for function 'f'"),
        ({"messages": [ASK, {"role": "tool", "content": "3"}]}, "messages.1.tool_call_id", "Field required"),
        ({"messages": [ASK, {"role": "tool", "tool_call_id": "call_1", "content": "3"}]}, "messages.1.role",
         "must follow an assistant message"),
        ({"prompt": 5}, "prompt", "valid string"),
    ],
)  # fmt: skip
def test_tokenize_refuses_what_a_chat_request_refuses_naming_the_field(http, body, param, says):
    """/tokenize of chat messages is the prompt the chat request gets: an invalid tool schema and a tool message that
    answers no call are refused there too (both were tokenized), and a chat body's error names its own field (a tool
    message without tool_call_id said "prompt: Field required (and 2 more errors)", the prompt form's complaint)."""
    error = assert_error(http.post("/tokenize", json=body), 400, param=param)
    assert says in error["message"], error
    error = assert_error(http.post("/tokenize", content=b"[1, 2]", headers={"content-type": "application/json"}), 400)
    assert error["message"] == "request body must be a JSON object", error


def test_a_schema_the_grammar_cannot_enforce_is_refused_only_when_the_call_is_forced(client, model_id):
    """`not`, `uniqueItems`, ... are valid JSON schema that llguidance cannot enforce: fine for a tool the
    model may call (auto), a 400 naming the tool when tool_choice would have to enforce it."""
    tools = [{"type": "function", "function": {"name": "u", "parameters": {"type": "array", "uniqueItems": True}}}]
    auto = client.chat.completions.create(model=model_id, messages=CHAT["messages"], max_tokens=2, tools=tools)
    assert auto.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=model_id, messages=CHAT["messages"], max_tokens=2, tools=tools,
                                       tool_choice="required")  # fmt: skip
    body = error.value.body
    assert body["param"] == "tools.0.function.parameters" and "uniqueItems" in body["message"], body
    assert "cannot enforce its schema" in body["message"], body


def test_what_the_openai_client_sends_back_is_accepted(client, model_id):
    """The assistant message as `model_dump()` gives it (null refusal/audio/function_call/annotations), the
    developer role and response_format text: what real OpenAI clients send."""
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    first = client.chat.completions.create(model=model_id, messages=messages, max_tokens=4,
                                           response_format={"type": "text"})  # fmt: skip
    echoed = first.choices[0].message.model_dump()
    assert {"refusal", "audio", "function_call", "annotations"} <= set(echoed)
    second = client.chat.completions.create(
        model=model_id, messages=[*messages, echoed, {"role": "user", "content": "more"}], max_tokens=4
    )
    assert second.choices[0].finish_reason in ("stop", "length")


def test_the_developer_role_renders_as_system(http, model_id):
    def tokens(role):
        body = {
            "model": model_id,
            "messages": [{"role": role, "content": "Be brief."}, {"role": "user", "content": "x"}],
        }
        return http.post("/tokenize", json=body).json()["tokens"]

    assert tokens("developer") == tokens("system")


def test_a_body_over_the_limit_is_413_without_stalling_health(http, server, model_id):
    huge = {"model": model_id, "prompt": "x" * (5 * 10**6)}  # 5 MB > the 4 MiB default
    error = assert_error(http.post("/v1/completions", json=huge), 413, code="request_too_large")
    assert "4194304" in error["message"]

    def chunks():  # no Content-Length: the limit counts the bytes as they arrive
        yield b'{"model": "' + model_id.encode() + b'", "prompt": "'
        for _ in range(50):
            yield b"y" * 100_000
        yield b'"}'

    response = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error(response, 413, code="request_too_large")
    assert http.get("/health").status_code == 200


def test_tokenizing_a_large_prompt_does_not_stall_the_event_loop(http, server, model_id):
    """A 1.5 MB chat prompt takes seconds to render and tokenize; /health must keep answering meanwhile
    (it froze for the whole time when this ran on the event loop)."""
    import threading
    import time

    body = {"model": model_id, "messages": [{"role": "user", "content": "The quick brown fox 42. " * 60_000}]}
    outcome = {}

    def big():
        started = time.perf_counter()
        with httpx.Client(base_url=server.url, timeout=120) as other:
            outcome["response"] = other.post("/v1/chat/completions", json=body)
        outcome["seconds"] = time.perf_counter() - started

    worker = threading.Thread(target=big)
    worker.start()
    time.sleep(0.2)
    latencies = []
    while worker.is_alive():
        started = time.perf_counter()
        assert http.get("/health").status_code == 200
        latencies.append(time.perf_counter() - started)
        time.sleep(0.05)
    worker.join()
    assert_error(outcome["response"], 400, code="context_length_exceeded")  # tokenized, then refused
    assert outcome["seconds"] > 1.0 and len(latencies) >= 5, (outcome, latencies)
    assert max(latencies) < 1.0, latencies


def test_the_server_is_still_up_and_counted_the_client_errors(http, client, model_id):
    assert http.get("/health").status_code == 200
    assert client.completions.create(model=model_id, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    metrics = http.get("/metrics").text
    assert 'gyre_inference_requests_total{endpoint="chat",outcome="client_error",run_id="api-tests"}' in metrics
    assert 'gyre_inference_requests_total{endpoint="chat",outcome="server_error",run_id="api-tests"} 0.0' in metrics


# ---- generated requests ---------------------------------------------------------------------------------
def _tighten(schema: dict, model_id: str, cheap: bool = True) -> dict:
    """The served model id; with `cheap`, also keep generated requests cheap and able to reach generation:
    n <= 2, max_tokens <= 8, token ids inside the vocabulary. Negative mode must use `cheap=False`: a value
    outside these test-only limits (n = 3) is still a valid request that the server rightly accepts."""
    limits = {"n": 2, "max_tokens": 8, "max_completion_tokens": 8, "max_output_tokens": 16, "top_logprobs": 3,
              "logprobs": 3} if cheap else {}  # fmt: skip

    def integers(node):
        if isinstance(node, dict):
            if node.get("type") == "integer":
                yield node
            for value in node.values():
                yield from integers(value)
        elif isinstance(node, list):
            for value in node:
                yield from integers(value)

    for component in schema["components"]["schemas"].values():
        for name, prop in component.get("properties", {}).items():
            if name == "model":
                component["properties"][name] = {"type": "string", "enum": [model_id]}
            elif name in limits:
                for node in integers(prop):
                    node["maximum"] = limits[name]
            elif cheap and name in ("prompt", "tokens", "stop_token_ids"):
                for node in integers(prop):
                    node["maximum"] = 1023
    return schema


@pytest.mark.slow
def test_generated_requests_never_get_a_server_error(server, http, model_id):
    document = http.get("/openapi.json").json()
    seen: dict[tuple[str, str], set[int]] = {}
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        schema = schemathesis.openapi.from_dict(
            _tighten(copy.deepcopy(document), model_id, cheap=mode == GenerationMode.POSITIVE)
        )
        schema.config.update(base_url=server.url)
        for result in schema.get_all_operations():
            operation = result.ok()
            post = operation.method.upper() == "POST"
            # negative cases are bodies that break the schema: an operation without a body (GET, POST /ping) has none
            takes_body = "requestBody" in document["paths"][operation.path][operation.method.lower()]
            if mode == GenerationMode.NEGATIVE and not (post and takes_body):
                continue
            statuses = seen.setdefault((operation.label, mode.value), set())

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=25 if post else 3, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))  # fmt: skip
            def check(case):
                response = case.call(timeout=60)
                statuses.add(response.status_code)  # noqa: B023 (check runs inside this iteration)
                assert response.status_code < 500, (case.body, response.text)
                if response.status_code >= 400:
                    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
                case.validate_response(response, checks=CONFORMANCE)

            check()
    # the positive requests really reached generation, the negative ones were refused
    assert 200 in seen[("POST /v1/chat/completions", "positive")], seen
    assert 200 in seen[("POST /v1/completions", "positive")], seen
    assert seen[("POST /v1/chat/completions", "negative")] <= {400, 404}, seen
    assert http.get("/health").status_code == 200


def test_the_openapi_document_says_what_the_server_answers(http):
    """No FastAPI 422 (the server sends 400 with OpenAI's body), the error statuses it really sends with
    that body, streaming as text/event-stream, /metrics as Prometheus text."""
    document = http.get("/openapi.json").json()
    assert '"422"' not in json.dumps(document) and "HTTPValidationError" not in json.dumps(document)
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert set(chat) == {"200", "400", "401", "404", "413", "415", "499", "503"}
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "x-gyre-policy-version" in chat["200"]["headers"]
    for status in ("400", "401", "404", "413", "415", "503"):
        assert chat[status]["content"]["application/json"]["schema"] == error
    for status in ("200", "400", "401", "404", "413", "503"):  # every response says its id, a 503 when to retry
        assert set(chat[status]["headers"]) >= {"x-request-id", *(("retry-after",) if status == "503" else ())}
    assert set(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert set(document["paths"]["/ready"]["get"]["responses"]) == {"200", "503"}
    for method in ("get", "post"):
        assert set(document["paths"]["/ping"][method]["responses"]) == {"200", "503"}
    assert set(document["paths"]["/health"]["get"]["responses"]) == {"200"}


def test_real_responses_conform_to_the_document(server, http, model_id):
    """One request per kind, checked by schemathesis against the document (the generated run below does
    this for hundreds of cases)."""
    schema = schemathesis.openapi.from_dict(http.get("/openapi.json").json())
    schema.config.update(base_url=server.url)
    requests = [
        ("POST", "/v1/chat/completions", {"model": model_id, **CHAT, "logprobs": True, "top_logprobs": 2}),
        ("POST", "/v1/chat/completions", {"model": model_id, **CHAT, "stream": True}),
        ("POST", "/v1/completions", {"model": model_id, "prompt": [5, 6], "max_tokens": 2, "logprobs": 1,
                                     "extra": "field"}),  # a 400
        ("POST", "/v1/completions", {"model": model_id, "prompt": ["a", "b"], "max_tokens": 2,
                                     "return_token_ids": True}),
        ("POST", "/v1/completions", {"model": "gpt-9", "prompt": "x"}),  # a 404
        ("POST", "/tokenize", {"prompt": "hello"}),
        ("POST", "/detokenize", {"tokens": [5, 6]}),
        ("GET", "/v1/models", None),
        ("POST", "/v1/responses", {"model": model_id, "input": "hi", "max_output_tokens": 16}),
        ("POST", "/v1/responses", {"model": model_id, "input": "hi", "max_output_tokens": 16, "stream": True}),
        ("POST", "/v1/responses", {"model": model_id, "input": "hi", "previous_response_id": "resp_1"}),  # a 400
        ("GET", "/metrics", None),
        ("GET", "/ready", None),
        ("GET", "/ping", None),
        ("POST", "/ping", None),
        ("GET", "/health", None),
    ]  # fmt: skip
    seen = set()
    for method, path, body in requests:
        operation = schema[path][method]
        case = operation.Case(body=body) if body is not None else operation.Case()
        response = case.call(timeout=60)
        seen.add(response.status_code)
        case.validate_response(response, checks=CONFORMANCE)
    for name in (model_id, "gpt-9"):  # a model card by id (the id is a folder path, slashes and all), a 404
        case = schema["/v1/models/{model_id}"]["GET"].Case(path_parameters={"model_id": name})
        response = case.call(timeout=60)
        seen.add(response.status_code)
        case.validate_response(response, checks=CONFORMANCE)
    assert {200, 400, 404} <= seen


def test_a_compressed_request_body_is_415_naming_the_encoding(http, client, model_id):
    """Content-Encoding was ignored: gzip bytes were read as JSON (400 "not valid JSON"), and a body declared gzip
    was served as plain JSON. Refused with 415 naming the coding, as HTTP says for one the server does not take."""
    body = gzip.compress(json.dumps({"model": model_id, **CHAT}).encode())
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    error = assert_error(http.post("/v1/chat/completions", content=body, headers=headers), 415, param=None)
    assert "Content-Encoding 'gzip' is not supported" in error["message"], error
    with pytest.raises(openai.APIStatusError) as refused:  # the official client, the header set by its user
        client.chat.completions.create(model=model_id, **CHAT, extra_headers={"Content-Encoding": "gzip"})
    assert refused.value.status_code == 415 and "uncompressed" in refused.value.body["message"], refused.value.body
