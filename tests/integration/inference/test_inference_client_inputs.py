"""Inputs real OpenAI clients send that the server used to get wrong (issue 30's defects), on a real server:
text the tokenizer cannot encode (lone UTF-16 surrogates), refused huge prompts that kept memory, explicit
nulls where OpenAI's reference allows them, OpenAI's fields at their neutral values, and content parts a
text model cannot take.
"""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _error(response, status=400):
    assert response.status_code == status, response.text
    return response.json()["error"]


# ---- lone surrogates ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab\ud800cd"}]}, "messages.0.content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                   {"type": "text", "text": "\udfff"}]}]}, "messages.0.content.1.text"),
        ("/v1/completions", {"prompt": "emoji cut \ud83d"}, "prompt"),
        ("/v1/completions", {"prompt": ["fine", "cut \ud83d"]}, "prompt.1"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "\udc00"}]}, "messages.0.content"),
    ],
)  # fmt: skip
def test_lone_surrogates_are_a_400_naming_the_text(http, model_id, route, body, param):
    # json.dumps writes the str's lone surrogate as the JSON escape "\ud800", as a JavaScript client does
    body = {"model": model_id, "max_tokens": 2, **body} if route != "/tokenize" else body
    error = _error(http.post(route, content=json.dumps(body), headers={"content-type": "application/json"}))
    assert error["param"] == param and "lone UTF-16 surrogate" in error["message"], error


def test_a_whole_surrogate_pair_is_an_ordinary_character(http, model_id):
    pair = json.dumps({"model": model_id, "prompt": "smile \ud83d\ude00", "max_tokens": 2})
    assert "\\ud83d\\ude00" in pair  # the escaped pair, which a JSON parser joins into one character
    response = http.post("/v1/completions", content=pair, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text


# ---- memory of refused long prompts -----------------------------------------------------------------
def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def test_refused_long_prompts_leave_no_lasting_memory(start_server, tiny_model):
    """A burst of ~1 MB prompts (far over the context, under the body limit), tokenized in parallel worker
    threads and refused with context_length_exceeded: the server's resident memory comes back to where it was
    (it kept ~150 MB per prompt and thread before: the tokenizer's buffers stayed in each thread's malloc arena)."""
    server = start_server("--run-id", "memory-tests", model_path=tiny_model)
    text = ("lorem ipsum dolor sit amet, consectetur adipiscing " * 20_000)[:1_000_000]
    bodies = [("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
              ("/v1/completions", {"prompt": text}), ("/v1/chat/completions", {"messages": [{"role": "user",
              "content": text[::-1]}]})]  # fmt: skip
    with httpx.Client(base_url=server.url, timeout=300) as http:
        http.post("/v1/chat/completions", json={"model": server.model_name, **CHAT}).raise_for_status()
        before = _rss_mb(server.proc.pid)

        def refused(route_body) -> str:
            route, body = route_body
            return _error(http.post(route, json={"model": server.model_name, **body}))["code"]

        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            assert list(pool.map(refused, bodies)) == ["context_length_exceeded"] * len(bodies)
        after = _rss_mb(server.proc.pid)
    assert after - before < 100, f"RSS {before:.0f} MB -> {after:.0f} MB after {len(bodies)} refused 1 MB prompts"


# ---- explicit nulls and OpenAI's neutral values -----------------------------------------------------
CHAT_NULLABLE = ["n", "logprobs", "stream", "presence_penalty", "frequency_penalty", "temperature", "top_p",
                 "top_logprobs", "stop", "seed", "user", "max_completion_tokens", "stream_options", "logit_bias",
                 "response_format", "store", "metadata", "service_tier", "modalities", "prediction", "audio",
                 "reasoning_effort", "parallel_tool_calls", "safety_identifier", "prompt_cache_key",
                 "web_search_options", "verbosity", "prompt_cache_retention", "prompt_cache_options",
                 "moderation"]  # fmt: skip
COMPLETIONS_NULLABLE = [
    "n",
    "logprobs",
    "stream",
    "presence_penalty",
    "frequency_penalty",
    "echo",
    "best_of",
    "suffix",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "user",
    "stream_options",
    "logit_bias",
]


RESPONSES_NULLABLE = ["instructions", "max_output_tokens", "temperature", "top_p", "top_logprobs", "tools",
                      "tool_choice", "parallel_tool_calls", "text", "stream", "stream_options", "include", "user",
                      "metadata", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                      "prompt_cache_options", "moderation", "service_tier", "max_tool_calls", "truncation",
                      "reasoning", "store", "previous_response_id", "conversation", "background", "prompt",
                      "priority"]  # fmt: skip


def test_null_is_accepted_wherever_openai_allows_it(http, model_id):
    # the vLLM extension priority too, on /v1/responses as on chat (there it was "Input should be a valid integer")
    responses = http.post("/v1/responses", json={"model": model_id, "input": "hi"} | dict.fromkeys(RESPONSES_NULLABLE))
    assert responses.status_code == 200, responses.text
    chat = http.post("/v1/chat/completions", json={"model": model_id, **CHAT} | dict.fromkeys(CHAT_NULLABLE))
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 1 and chat.json()["choices"][0]["logprobs"] is None
    body = {"model": model_id, "prompt": "hi", "max_tokens": 2} | dict.fromkeys(COMPLETIONS_NULLABLE)
    completion = http.post("/v1/completions", json=body)
    assert completion.status_code == 200, completion.text


def test_openai_fields_at_neutral_values_through_the_sdk(client, model_id):
    completion = client.chat.completions.create(
        model=model_id, messages=CHAT["messages"], max_tokens=2, store=False, metadata={}, service_tier="auto",
        modalities=["text"], prediction=None, safety_identifier="user-1", prompt_cache_key="k",
        stream_options=None, parallel_tool_calls=None,
    )  # fmt: skip
    # caching hints the SDK has (a client written for OpenAI's caching got "Extra inputs are not permitted")
    for hints in ({"prompt_cache_retention": "24h"}, {"prompt_cache_retention": "in_memory"},
                  {"prompt_cache_options": {"mode": "explicit", "ttl": "30m"}}):  # fmt: skip
        client.chat.completions.create(model=model_id, messages=CHAT["messages"], max_tokens=2, **hints)
        client.responses.create(model=model_id, input="hi", max_output_tokens=16, **hints)
    assert completion.choices[0].finish_reason in ("stop", "length")
    # ignored as OpenAI ignores them without the feature: tags, a prediction (only latency), obfuscation
    client.chat.completions.create(
        model=model_id, messages=CHAT["messages"], max_tokens=2, metadata={"experiment": "a"},
        prediction={"type": "content", "content": "hello"}, service_tier="default", stream=False,
    )  # fmt: skip
    stream = client.chat.completions.create(
        model=model_id,
        messages=CHAT["messages"],
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
    )
    assert list(stream)[-1].usage is not None


def test_tool_choice_auto_over_an_empty_tool_list_is_a_plain_answer(client, http, model_id):
    """An agent with no tool registered sends tools: [] and tool_choice: "auto"; vLLM answers it, here it was a 400.
    Without tools at all (OpenAI and vLLM refuse it) and with required it stays a 400."""
    answer = client.chat.completions.create(model=model_id, messages=CHAT["messages"], max_tokens=4, tools=[],
                                            tool_choice="auto")  # fmt: skip
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")
    for body in ({"tool_choice": "auto"}, {"tools": [], "tool_choice": "required"}):
        response = http.post("/v1/chat/completions", json={"model": model_id, **CHAT, "max_tokens": 2, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice", body


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("store", True, "keeps no completions"),
        ("service_tier", "flex", "auto"),
        ("modalities", ["text", "audio"], "text"),
        ("audio", {"voice": "alloy", "format": "wav"}, "no audio output"),
        ("reasoning_effort", "low", "no reasoning-effort setting"),
        ("web_search_options", {}, "no web search"),
        ("moderation", {"model": "omni-moderation-latest"}, "no moderation"),
        ("functions", [{"name": "f"}], "use tools"),
        ("metadata", {"k": 5}, "string"),
    ],
)
def test_openai_fields_the_server_cannot_honour_are_refused_with_a_reason(http, model_id, field, value, says):
    error = _error(http.post("/v1/chat/completions", json={"model": model_id, **CHAT, field: value}))
    assert error["param"].split(".")[0] == field and says in error["message"], error
    assert "Extra inputs" not in error["message"]


# ---- content parts a text model cannot take -------------------------------------------------------------
@pytest.mark.parametrize(
    ("part", "feature"),
    [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "image input"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio input"),
        ({"type": "file", "file": {"file_id": "file-1"}}, "file input"),
    ],
)
def test_non_text_content_parts_name_the_missing_feature(http, model_id, part, feature):
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    error = _error(http.post("/v1/chat/completions", json={"model": model_id, "messages": messages}))
    assert error["param"] == "messages.0.content" and feature in error["message"], error
    assert "text only" in error["message"] and "tag" not in error["message"]


def test_an_assistant_s_refusal_parts_are_rendered_as_its_text(client, http, model_id):
    """OpenAI's SDK types an assistant message's content parts as text or refusal parts (a conversation replayed from
    another server); the refusal part was a 400 "Input should be 'text'". Its text renders as a text part's (vLLM)."""
    import openai

    def prompt_ids(assistant_part):
        messages = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": [{"type": "text", "text": "Sorry,"}, assistant_part]},
                    {"role": "user", "content": "why?"}]  # fmt: skip
        response = client.chat.completions.create(model=model_id, messages=messages, max_tokens=1,
                                                  extra_body={"return_token_ids": True})  # fmt: skip
        return response.model_extra["prompt_token_ids"]

    refused = prompt_ids({"type": "refusal", "refusal": "I can't help with that."})
    assert refused == prompt_ids({"type": "text", "text": "I can't help with that."})
    rendered = http.post("/detokenize", json={"tokens": refused}).json()["prompt"]
    assert "Sorry,\nI can't help with that." in rendered, rendered

    for part, param, says in [
        ({"type": "refusal"}, "messages.0.content.0.refusal", "Field required"),
        ({"type": "weird", "text": "x"}, "messages.0.content.0", "type 'text' or 'refusal'"),
    ]:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=model_id, max_tokens=1,
                                           messages=[{"role": "assistant", "content": [part]}])  # fmt: skip
        assert error.value.body["param"] == param and says in error.value.body["message"], error.value.body
    with pytest.raises(openai.BadRequestError) as error:  # OpenAI's types allow refusal parts on assistants only
        client.chat.completions.create(
            model=model_id, max_tokens=1, messages=[{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]
        )
    assert error.value.body["param"].startswith("messages.0.content"), error.value.body


# ---- request ids -----------------------------------------------------------------------------------------
def test_every_response_carries_the_client_s_request_id_or_a_new_one(client, http, model_id):
    """The openai SDK reads X-Request-Id into `.request_id` (responses and errors) for tracing, and proxies set it
    on the way in. Responses had none: the client's id is echoed (a streamed response and an error too), else each
    response gets its own (as vLLM with --enable-request-id-headers, and OpenAI's API)."""
    import openai

    traced = client.with_options(default_headers={"X-Request-Id": "trace-7f3a"})
    raw = traced.chat.completions.with_raw_response.create(model=model_id, **CHAT)
    assert raw.request_id == "trace-7f3a" and raw.parse().choices
    with traced.completions.with_streaming_response.create(model=model_id, prompt="hi", max_tokens=2,
                                                           stream=True) as streamed:  # fmt: skip
        assert streamed.request_id == "trace-7f3a" and list(streamed.iter_lines())
    with pytest.raises(openai.NotFoundError) as error:
        traced.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert error.value.request_id == "trace-7f3a"

    ids = [client.models.with_raw_response.list().request_id for _ in range(2)]
    body = {"model": model_id, "prompt": "hi", "max_tokens": 1}
    for bad in ("has space", "x" * 300):
        ids.append(http.post("/v1/completions", json=body, headers={"X-Request-Id": bad}).headers["x-request-id"])
    assert len(set(ids)) == 4 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids), ids  # new ones, not the bad
