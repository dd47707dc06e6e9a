"""The OpenAI-compatible API of a real `gyre inference` process, driven by the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import torch
from inference_testlib import TOOL_ANSWER, TOOL_MESSAGES, TOOLS
from openai import AsyncOpenAI

STORY = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Tell me a story."}]
TOKEN_PROMPT = [1, 705, 201, 74, 75, 2, 201, 1, 739, 201]


def extra(obj) -> dict:
    """Fields outside OpenAI's schema (vLLM/Gyre extensions) that the client keeps as extras."""
    return obj.model_extra or {}


def tokenize(server, **body) -> list[int]:
    response = httpx.post(f"{server.url}/tokenize", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


@pytest.fixture(scope="module")
def reference(tool_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tool_model, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tool_model)


def reference_logprobs(model, prompt: list[int], tokens: list[int], temperature: float, k: int = 0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0], logprobs.topk(k, dim=-1) if k else None


def test_models_lists_the_served_model(client, server, tool_model):
    [card] = client.models.list().data
    assert card.id == str(tool_model) and card.owned_by == "gyre"
    assert extra(card)["max_model_len"] == 256 and extra(card)["policy_version"] == 0


def test_chat_completion_reports_tokens_usage_and_versions(client, server, model_id):
    raw = client.chat.completions.with_raw_response.create(
        model=model_id, messages=STORY, max_tokens=8, seed=0, extra_body={"return_token_ids": True}
    )
    assert raw.headers["x-gyre-policy-version"] == "0"
    response = raw.parse()
    [choice] = response.choices
    assert extra(response)["prompt_token_ids"] == tokenize(server, messages=STORY)
    token_ids = extra(choice)["token_ids"]
    assert 1 <= len(token_ids) <= 8 and choice.finish_reason in ("stop", "length")
    assert response.usage.prompt_tokens == len(extra(response)["prompt_token_ids"])
    assert response.usage.completion_tokens == len(token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + len(token_ids)
    assert {k: extra(choice)[k] for k in ("policy_version", "policy_version_min", "policy_version_max")} == {
        "policy_version": 0,
        "policy_version_min": 0,
        "policy_version_max": 0,
    }
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_token_limits_with_ignore_eos_give_exact_lengths(client, model_id, field):
    response = client.chat.completions.create(
        model=model_id, messages=STORY, seed=1, **{field: 7}, extra_body={"ignore_eos": True}
    )
    assert response.usage.completion_tokens == 7 and response.choices[0].finish_reason == "length"


def test_n_choices_and_seeds(client, model_id):
    def ask(seed):
        r = client.chat.completions.create(
            model=model_id, messages=STORY, n=3, seed=seed, max_tokens=12, extra_body={"return_token_ids": True}
        )
        assert [c.index for c in r.choices] == [0, 1, 2]
        return [extra(c)["token_ids"] for c in r.choices]

    first = ask(5)
    assert ask(5) == first  # same seed + request + weights = same output
    assert len({tuple(t) for t in first}) == 3  # the choices are different samples
    assert ask(6) != first


@pytest.mark.asyncio
async def test_a_seeded_request_does_not_depend_on_concurrent_traffic(server, model_id):
    async with AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as client:

        async def ask(seed, max_tokens=16):
            r = await client.completions.create(model=model_id, prompt=TOKEN_PROMPT, max_tokens=max_tokens, seed=seed,
                                                extra_body={"return_token_ids": True})  # fmt: skip
            return extra(r.choices[0])["token_ids"]

        alone = await ask(42)
        crowd = await asyncio.gather(*(ask(None, 10 + i) for i in range(6)), ask(42))
        assert crowd[-1] == alone


@pytest.mark.parametrize(("temperature", "top_p"), [(0.8, 0.9), (1.3, 1.0), (0.0, 1.0)])
def test_chat_logprobs_match_an_independent_forward_pass(client, model_id, reference, temperature, top_p):
    model, _ = reference
    response = client.chat.completions.create(
        model=model_id, messages=STORY, n=2, max_tokens=24, temperature=temperature, top_p=top_p, seed=3,
        logprobs=True, top_logprobs=3, extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    prompt = extra(response)["prompt_token_ids"]
    for choice in response.choices:
        tokens = extra(choice)["token_ids"]
        content = choice.logprobs.content
        assert len(tokens) == len(content) == 24
        expected, (top_values, _) = reference_logprobs(model, prompt, tokens, temperature, k=3)
        assert torch.allclose(torch.tensor([e.logprob for e in content]), expected, atol=1e-4)
        for entry, values in zip(content, top_values, strict=True):
            assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
            assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-6


def test_completion_logprobs_on_a_token_prompt_match_the_forward_pass(client, model_id, reference):
    model, _ = reference
    response = client.completions.create(
        model=model_id, prompt=TOKEN_PROMPT, max_tokens=20, temperature=0.6, seed=11, logprobs=2,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    [choice] = response.choices
    tokens = extra(choice)["token_ids"]
    assert extra(choice)["prompt_token_ids"] == TOKEN_PROMPT == extra(response)["prompt_token_ids"]
    expected, _ = reference_logprobs(model, TOKEN_PROMPT, tokens, 0.6)
    assert torch.allclose(torch.tensor(choice.logprobs.token_logprobs), expected, atol=1e-4)
    assert len(choice.logprobs.tokens) == len(choice.logprobs.text_offset) == 20
    entries = zip(choice.logprobs.top_logprobs, choice.logprobs.tokens, choice.logprobs.token_logprobs, strict=True)
    for top, token, logprob in entries:
        assert top[token] == logprob and len(top) <= 3


def test_stop_strings_cut_the_text_and_keep_every_sampled_token(client, model_id, reference):
    _, tokenizer = reference

    def greedy(**kwargs):
        return client.completions.create(
            model=model_id, prompt=TOKEN_PROMPT, max_tokens=40, temperature=0, logprobs=0,
            extra_body={"return_token_ids": True, "ignore_eos": True}, **kwargs,
        ).choices[0]  # fmt: skip

    full = greedy()
    text, tokens = full.text, extra(full)["token_ids"]
    assert len(text) > 20
    stop = next(text[i : i + 3] for i in range(10, len(text) - 3) if text.find(text[i : i + 3]) == i)
    cut = greedy(stop=[stop, "never-generated"])
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop)]
    cut_tokens = extra(cut)["token_ids"]
    assert cut_tokens == tokens[: len(cut_tokens)]  # every token up to the one completing the stop string
    assert len(cut.logprobs.token_logprobs) == len(cut_tokens)
    assert cut.logprobs.token_logprobs == pytest.approx(full.logprobs.token_logprobs[: len(cut_tokens)], abs=1e-5)
    decoded = tokenizer.decode(cut_tokens, skip_special_tokens=True)
    assert decoded.startswith(cut.text) and stop in decoded and stop not in tokenizer.decode(cut_tokens[:-1])

    streamed = client.completions.create(
        model=model_id, prompt=TOKEN_PROMPT, max_tokens=40, temperature=0, stop=stop, stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == cut.text
    assert [t for c in chunks for t in extra(c.choices[0]).get("token_ids", [])] == cut_tokens
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_token_ids_end_a_choice_on_that_token(client, model_id):
    def greedy(**body):
        r = client.completions.create(model=model_id, prompt=TOKEN_PROMPT, max_tokens=30, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True, **body})  # fmt: skip
        return r.choices[0]

    tokens = extra(greedy())["token_ids"]
    stopped = greedy(stop_token_ids=[tokens[6]])
    assert extra(stopped)["token_ids"] == tokens[: tokens.index(tokens[6]) + 1] and stopped.finish_reason == "stop"


def test_a_temperature_below_1e_5_is_greedy_on_every_route(client, server, model_id):
    # as vLLM: a float32 logit divided by 1e-40 is inf, and such a request got an empty answer with null log-probs
    def chat(temperature):
        r = client.chat.completions.create(model=model_id, messages=STORY, max_tokens=8, temperature=temperature,
                                           logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
        content = r.choices[0].logprobs.content
        return r.choices[0].message.content, [x for e in content for x in (e.logprob, *(t.logprob for t in
                                                                                      e.top_logprobs))]  # fmt: skip

    greedy_text, greedy_logprobs = chat(0.0)
    assert greedy_text and len(greedy_logprobs) == 8 * 3
    for tiny in (1e-40, 1e-6):
        text, logprobs = chat(tiny)
        assert text == greedy_text and logprobs == pytest.approx(greedy_logprobs, abs=1e-5), tiny

    def generate(temperature):
        params = {"max_tokens": 8, "ignore_eos": True, "logprobs": 0, "temperature": temperature}
        body = {"model": model_id, "token_ids": TOKEN_PROMPT, "sampling_params": params}
        return httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=60).json()["choices"][0]

    greedy, tiny = generate(0.0), generate(1e-40)
    assert tiny["token_ids"] == greedy["token_ids"]
    lps = [[e["logprob"] for e in choice["logprobs"]["content"]] for choice in (tiny, greedy)]
    assert lps[0] == pytest.approx(lps[1], abs=1e-5)


def test_penalties_reach_the_sampler_and_the_log_probs_are_of_the_penalised_distribution(client, server, model_id,
                                                                                          reference):  # fmt: skip
    """presence/frequency (OpenAI fields) and repetition_penalty (vLLM's, in extra_body) over HTTP, on every route
    that samples; they were a 400 unless off. Greedy, so the penalised argmax is checked too."""
    model, _ = reference
    penalties = {"presence_penalty": 0.8, "frequency_penalty": 0.6}
    repetition = 1.8

    def completion(**kwargs):
        answer = client.completions.create(model=model_id, prompt=TOKEN_PROMPT, max_tokens=12, temperature=0,
                                           logprobs=1, extra_body={"return_token_ids": True, **kwargs.pop("extra", {})},
                                           **kwargs)  # fmt: skip
        choice = answer.choices[0]
        return extra(choice)["token_ids"], choice.logprobs.token_logprobs

    plain_tokens, _ = completion()
    tokens, logprobs = completion(**penalties, extra={"repetition_penalty": repetition})
    assert tokens != plain_tokens
    with torch.no_grad():
        logits = model(torch.tensor([TOKEN_PROMPT + tokens])).logits[0, len(TOKEN_PROMPT) - 1 : -1]
    for t, token in enumerate(tokens):
        x, output = logits[t].clone(), tokens[:t]
        for seen in set(TOKEN_PROMPT) | set(output):
            x[seen] = x[seen] / repetition if x[seen] > 0 else x[seen] * repetition
        for seen in set(output):
            x[seen] -= penalties["frequency_penalty"] * output.count(seen) + penalties["presence_penalty"]
        assert token == int(x.argmax()) and logprobs[t] == pytest.approx(float(torch.log_softmax(x, -1)[token]),
                                                                          abs=1e-4)  # fmt: skip
    chat = client.chat.completions.create(model=model_id, messages=STORY, max_tokens=8, temperature=0, seed=1,
                                          extra_body={"repetition_penalty": repetition}, **penalties)  # fmt: skip
    assert chat.choices[0].finish_reason in ("length", "stop")
    body = {
        "model": model_id,
        "token_ids": TOKEN_PROMPT,
        "sampling_params": {"max_tokens": 12, "temperature": 0, "repetition_penalty": repetition, **penalties},
    }
    generated = httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=60).json()["choices"][0]
    assert generated["token_ids"] == tokens


def test_each_choice_says_its_stop_reason_as_vllm_does(client, model_id):
    """vLLM's stop_reason: the stop string or the request's stop token id that ended a choice, null for the length
    or the end-of-turn token; streamed on the finishing chunk. It was missing (agent code reading it failed)."""
    kwargs = dict(model=model_id, messages=STORY, max_tokens=12, temperature=0, extra_body={"return_token_ids": True})
    free = client.chat.completions.create(**kwargs)
    text, ids = free.choices[0].message.content, extra(free.choices[0])["token_ids"]
    assert extra(free.choices[0])["stop_reason"] is None
    stop = text[3:6].strip() or text[3:6]
    by_string = client.chat.completions.create(**kwargs, stop=[stop, "never-seen"])
    assert by_string.choices[0].finish_reason == "stop" and extra(by_string.choices[0])["stop_reason"] == stop
    chunks = [c for c in client.chat.completions.create(**kwargs, stop=[stop], stream=True) if c.choices]
    assert extra(chunks[-1].choices[0])["stop_reason"] == stop and chunks[-1].choices[0].finish_reason == "stop"
    assert all("stop_reason" not in extra(c.choices[0]) for c in chunks[:-1])  # per-token chunks stay as they were
    completion = client.completions.create(
        model=model_id,
        prompt=TOKEN_PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [ids[2]], "return_token_ids": True},
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and extra(choice)["stop_reason"] == extra(choice)["token_ids"][-1]
    assert isinstance(extra(choice)["stop_reason"], int)


def test_a_named_tool_call_cut_by_max_tokens_is_still_that_call_as_vllm_returns_it(client, model_id):
    """tool_choice naming a function, max_tokens reached mid-call: the call (that name, the arguments written so far),
    finish "length", as vLLM answers; it was content holding the raw <tool_call> markup and no tool_calls, so agent
    code reading message.tool_calls[0] failed. Streamed the same."""
    named = {"type": "function", "function": {"name": "add"}}
    kwargs = dict(model=model_id, messages=TOOL_MESSAGES, tools=TOOLS, tool_choice=named, temperature=0)
    whole = client.chat.completions.create(**kwargs, max_tokens=60).choices[0]
    assert whole.finish_reason == "stop"  # a named call ends "stop", as on OpenAI and vLLM
    full_arguments = whole.message.tool_calls[0].function.arguments
    for max_tokens in (3, 14):  # before the arguments, and inside them
        cut = client.chat.completions.create(**kwargs, max_tokens=max_tokens).choices[0]
        assert cut.finish_reason == "length" and cut.message.content is None, cut
        [call] = cut.message.tool_calls
        assert call.function.name == "add" and full_arguments.startswith(call.function.arguments), call
        chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, max_tokens=max_tokens, stream=True)
                  if c.choices]  # fmt: skip
        streamed = [t for c in chunks for t in c.delta.tool_calls or []]
        assert [(t.function.name, t.function.arguments) for t in streamed] == [("add", call.function.arguments)]
        assert "".join(c.delta.content or "" for c in chunks) == "" and chunks[-1].finish_reason == "length"
    assert client.chat.completions.create(**kwargs, max_tokens=14).choices[0].message.tool_calls[0].function.arguments


def test_a_named_tool_call_cut_by_a_stop_string_is_still_that_call(client, model_id):
    """tool_choice naming a function, a stop string matched inside the forced call: the call as far as it was
    written (as for max_tokens, and as vLLM, which returns a named choice's whole output as that call's arguments);
    it was content holding the raw <tool_call> markup and no tool_calls. Streamed the same."""
    named = {"type": "function", "function": {"name": "add"}}
    kwargs = dict(model=model_id, messages=TOOL_MESSAGES, tools=TOOLS, tool_choice=named, temperature=0,
                  max_tokens=60, stop=['"arguments"'])  # fmt: skip
    cut = client.chat.completions.create(**kwargs).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content is None, cut
    assert [(t.function.name, t.function.arguments) for t in cut.message.tool_calls] == [("add", "")]
    chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    streamed = [t for c in chunks for t in c.delta.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [("add", "")]
    assert "".join(c.delta.content or "" for c in chunks) == "" and chunks[-1].finish_reason == "stop"


def test_streaming_chat_equals_the_non_streaming_answer(client, model_id):
    kwargs = dict(model=model_id, messages=STORY, max_tokens=16, seed=9, logprobs=True, n=2,
                  extra_body={"return_token_ids": True})  # fmt: skip
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump()["completion_tokens"] == sum(
        len(extra(c)["token_ids"]) for c in whole.choices
    )
    assert extra(chunks[0])["prompt_token_ids"] == extra(whole)["prompt_token_ids"]
    for index, choice in enumerate(whole.choices):
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [t for c in mine for t in extra(c).get("token_ids", [])] == extra(choice)["token_ids"]
        streamed_logprobs = [e.logprob for c in mine if c.logprobs for e in c.logprobs.content]
        assert streamed_logprobs == pytest.approx([e.logprob for e in choice.logprobs.content], abs=1e-6)
        last = mine[-1]
        assert last.finish_reason == choice.finish_reason
        assert extra(last)["policy_version_min"] == extra(last)["policy_version_max"] == 0


def test_completion_prompt_forms_and_batches(client, server, model_id):
    text = "Once upon a time"
    ids = tokenize(server, prompt=text)

    def ask(prompt, n=1):
        r = client.completions.create(model=model_id, prompt=prompt, max_tokens=6, seed=4, n=n,
                                      extra_body={"return_token_ids": True})  # fmt: skip
        return r

    by_text, by_ids = ask(text), ask(ids)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert extra(by_text)["prompt_token_ids"] == ids
    batch = ask([TOKEN_PROMPT, ids], n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [extra(c)["prompt_token_ids"] for c in batch.choices] == [TOKEN_PROMPT, TOKEN_PROMPT, ids, ids]
    assert batch.choices[2].text == by_ids.choices[0].text  # a prompt in a batch samples as when alone
    assert batch.usage.prompt_tokens == len(TOKEN_PROMPT) + len(ids)
    assert "prompt_token_ids" not in extra(batch)
    two_texts = ask([text, "The fox"])
    assert len(two_texts.choices) == 2


def test_streaming_completion_equals_the_non_streaming_answer(client, model_id):
    kwargs = dict(model=model_id, prompt=TOKEN_PROMPT, max_tokens=12, seed=2)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_tool_calls_are_parsed_from_what_the_model_generates(client, server, model_id, reference):
    _, tokenizer = reference
    response = client.chat.completions.create(
        model=model_id, messages=TOOL_MESSAGES, tools=TOOLS, temperature=0, extra_body={"return_token_ids": True}
    )
    [choice] = response.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add"
    assert call.function.arguments == '{"a": 1, "b": 2}' and call.id.startswith("call_")
    tokens = extra(choice)["token_ids"]
    assert tokenizer.decode(tokens) == TOOL_ANSWER

    # Multi-turn bookkeeping: the next prompt, rendered with the returned assistant message, extends
    # exactly the tokens of this turn (prompt + sampled completion).
    assistant = choice.message.model_dump(exclude_none=True)
    history = TOOL_MESSAGES + [assistant]
    rendered = tokenize(server, messages=history, tools=TOOLS, add_generation_prompt=False)
    this_turn = extra(response)["prompt_token_ids"] + tokens
    assert rendered[: len(this_turn)] == this_turn
    tool_reply = {"role": "tool", "tool_call_id": call.id, "content": "3"}
    follow_up = client.chat.completions.create(
        model=model_id, messages=history + [tool_reply], tools=TOOLS, max_tokens=5
    )
    assert follow_up.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_streamed_tool_calls(client, model_id):
    chunks = list(
        client.chat.completions.create(model=model_id, messages=TOOL_MESSAGES, tools=TOOLS, temperature=0, stream=True)
    )
    calls = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [(0, "add", '{"a": 1, "b": 2}')]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_neither_shows_nor_parses_tools(client, server, model_id):
    response = client.chat.completions.create(
        model=model_id, messages=TOOL_MESSAGES, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=30,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert extra(response)["prompt_token_ids"] == tokenize(server, messages=TOOL_MESSAGES)
    assert response.choices[0].message.tool_calls is None and response.choices[0].finish_reason != "tool_calls"
    # without tools too, as vLLM takes it (clients send "none" on their tool-less requests; it was a 400)
    plain = client.chat.completions.create(model=model_id, messages=TOOL_MESSAGES, tool_choice="none", temperature=0,
                                           max_tokens=30, extra_body={"return_token_ids": True})  # fmt: skip
    assert extra(plain)["prompt_token_ids"] == extra(response)["prompt_token_ids"]
    assert plain.choices[0].message.content == response.choices[0].message.content


def test_tokenize_and_detokenize(server, model_id, reference):
    _, tokenizer = reference
    text = "Hello world, café 東京 😀"
    body = httpx.post(f"{server.url}/tokenize", json={"model": model_id, "prompt": text}).json()
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": text}
    with_tools = tokenize(server, messages=TOOL_MESSAGES, tools=TOOLS)
    rendered = tokenizer.decode(with_tools)
    # a rendered chat prompt reads back with its special tokens, as in vLLM (they were dropped: no role markers), and
    # so does the echo of a token-id prompt
    detokenized = httpx.post(f"{server.url}/detokenize", json={"tokens": with_tools}).json()["prompt"]
    assert detokenized == rendered and detokenized.startswith("<|im_start|>system")
    echo = {"model": model_id, "prompt": with_tools, "echo": True, "max_tokens": 1}
    assert httpx.post(f"{server.url}/v1/completions", json=echo).json()["choices"][0]["text"].startswith(rendered)
    assert '"name": "add"' in rendered and rendered.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(tokenize(server, messages=TOOL_MESSAGES, add_generation_prompt=False)).endswith(
        "<|im_end|>\n"
    )
    roles = [
        {"role": "system", "content": [{"type": "text", "text": "sys"}]},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
    ]  # fmt: skip
    assert json.dumps({"a": 1}) in tokenizer.decode(tokenize(server, messages=roles))


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_frees_its_sequences(server, model_id, stream):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape(name: str, outcome: str | None = None) -> float:
        for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
            for s in family.samples:
                labels = (s.labels.get("outcome"), s.labels.get("endpoint", "completions"))
                if s.name == name and labels == (outcome, "completions"):
                    return s.value
        raise AssertionError(name)

    aborted = scrape("gyre_inference_requests_total", "aborted")
    generated = scrape("gyre_inference_generation_tokens_total")
    body = {"model": model_id, "prompt": [5, 6, 7], "n": 32, "max_tokens": 240, "stream": stream, "ignore_eos": True}
    timeout = httpx.Timeout(30, read=0.3)
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=timeout) as response:
            for n, _ in enumerate(response.iter_lines()):
                if n == 10:
                    break  # a streaming client that stops reading and closes the connection
    except httpx.ReadTimeout:
        assert not stream  # a non-streaming client that gives up waiting
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and scrape("gyre_inference_running_requests") > 0:
        time.sleep(0.05)
    assert scrape("gyre_inference_running_requests") == 0
    assert scrape("gyre_inference_requests_total", "aborted") == aborted + 1
    assert scrape("gyre_inference_generation_tokens_total") - generated < 32 * 240  # cancelled long before the end


def test_an_idle_keep_alive_connection_outlives_the_clients_own_expiry(server):
    """httpx (the openai client) drops an idle connection after 5 s, uvicorn's default closed it after 5 s too: a
    request sent as the server closed the connection failed as a connection error (seen at 256 concurrent clients).
    The server keeps idle connections longer (server.keep_alive_s), so the client closes them first."""
    import http.client
    from urllib.parse import urlsplit

    address = urlsplit(server.url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
    try:
        connection.request("GET", "/health")
        first = connection.getresponse()
        first.read()
        sock = connection.sock
        time.sleep(5.5)  # longer than httpx's keepalive_expiry and uvicorn's own default
        connection.request("GET", "/health")
        second = connection.getresponse()  # http.client.RemoteDisconnected if the server had closed it
        second.read()
        assert (first.status, second.status) == (200, 200) and connection.sock is sock  # the same connection
    finally:
        connection.close()
