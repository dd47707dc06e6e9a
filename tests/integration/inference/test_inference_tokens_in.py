"""`POST /inference/v1/generate` (vLLM's tokens-in route) on a real `gyre inference` process.

The oracle is the server's own /v1/completions on the same token prompt and seed (a separately tested path):
the tokens-in route must sample exactly the same tokens with the same log-probs, in vLLM's response shape.
"""

from __future__ import annotations

import time

import httpx
import pytest

TOKEN_PROMPT = [1, 705, 201, 74, 75, 2, 201, 1, 739, 201]


def generate(server, expect: int = 200, **body) -> dict:
    response = httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=60)
    assert response.status_code == expect, response.text
    return response.json()


def test_same_tokens_and_logprobs_as_a_completion_with_that_seed(server, model_id):
    params = {"n": 2, "max_tokens": 12, "seed": 5, "temperature": 0.8, "logprobs": 2}
    body = generate(server, model=model_id, token_ids=TOKEN_PROMPT, sampling_params=params)
    completion = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": model_id, "prompt": TOKEN_PROMPT, "n": 2, "max_tokens": 12, "seed": 5, "temperature": 0.8,
        "logprobs": 2, "return_token_ids": True}).json()  # fmt: skip
    assert body["prompt_token_ids"] == TOKEN_PROMPT and body["model"] == model_id
    for choice, reference in zip(body["choices"], completion["choices"], strict=True):
        assert choice["token_ids"] == reference["token_ids"]
        content = choice["logprobs"]["content"]
        assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
        assert [c["logprob"] for c in content] == pytest.approx(reference["logprobs"]["token_logprobs"], abs=1e-5)
        assert all(len(c["top_logprobs"]) == 2 for c in content)
        assert choice["finish_reason"] == reference["finish_reason"]
        assert choice["policy_version_min"] == choice["policy_version_max"] == body["policy_version"] == 0
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(TOKEN_PROMPT)
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in body["choices"])


def test_finish_reasons_and_stop_tokens(server, model_id):
    long = generate(server, model=model_id, token_ids=TOKEN_PROMPT,
                    sampling_params={"max_tokens": 7, "ignore_eos": True, "seed": 1})  # fmt: skip
    choice = long["choices"][0]
    assert len(choice["token_ids"]) == 7 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    stop_on = choice["token_ids"][3]
    stopped = generate(server, model=model_id, token_ids=TOKEN_PROMPT,
                       sampling_params={"max_tokens": 7, "ignore_eos": True, "seed": 1, "stop_token_ids": [stop_on],
                                        "logprobs": 0})  # fmt: skip
    ids = stopped["choices"][0]["token_ids"]
    assert ids[-1] == stop_on and len(ids) <= 4 and stopped["choices"][0]["finish_reason"] == "stop"
    assert "top_logprobs" not in stopped["choices"][0]["logprobs"]["content"][0]


def test_vllm_sampling_fields_at_their_neutral_values_and_min_tokens(server, model_id):
    """What a PRIME-RL-style client sends in `sampling_params` (vLLM's defaults spelled out) samples exactly
    what leaving them out does, as on the OpenAI routes, and `min_tokens` holds the stop tokens back (all were
    a 400 here: "Extra inputs are not permitted")."""
    params = {"max_tokens": 6, "seed": 4, "ignore_eos": True}
    plain = generate(server, model=model_id, token_ids=TOKEN_PROMPT, sampling_params=params)["choices"][0]
    neutral = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
               "frequency_penalty": 0.0, "min_tokens": 0}  # fmt: skip
    spelled = generate(server, model=model_id, token_ids=TOKEN_PROMPT, sampling_params=params | neutral)
    assert spelled["choices"][0]["token_ids"] == plain["token_ids"]
    first = plain["token_ids"][0]
    stops = params | {"stop_token_ids": [first]}
    early = generate(server, model=model_id, token_ids=TOKEN_PROMPT, sampling_params=stops)["choices"][0]
    assert early["token_ids"] == [first] and early["finish_reason"] == "stop"
    held = generate(server, model=model_id, token_ids=TOKEN_PROMPT, sampling_params=stops | {"min_tokens": 3})
    ids = held["choices"][0]["token_ids"]
    assert len(ids) >= 3 and first not in ids[:3], ids
    for field, value in (("top_k", 10**6), ("min_p", 1.5), ("repetition_penalty", 0), ("presence_penalty", 3),
                         ("min_tokens", 7)):  # fmt: skip
        error = generate(server, expect=400, model=model_id, token_ids=TOKEN_PROMPT,
                         sampling_params=params | {field: value})["error"]  # fmt: skip
        assert error["param"] in (f"sampling_params.{field}", "sampling_params"), error


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"token_ids": [10**6]}, 400, "token_ids"),
        ({"token_ids": []}, 400, "token_ids"),
        ({"token_ids": TOKEN_PROMPT, "sampling_params": {"max_tokens": 10_000}}, 400, "token_ids"),
        ({"token_ids": TOKEN_PROMPT, "sampling_params": {"top_k": 10**6}}, 400, "sampling_params.top_k"),
        ({"token_ids": TOKEN_PROMPT, "stream": True}, 400, "stream"),
        ({"token_ids": TOKEN_PROMPT, "model": "other"}, 404, "model"),
        # more than the rest of the context, the default max_tokens: it ran to that length (vLLM refuses it)
        ({"token_ids": TOKEN_PROMPT, "sampling_params": {"min_tokens": 1000}}, 400, "sampling_params.min_tokens"),
    ],
)
def test_bad_requests_name_the_field(server, model_id, body, status, param):
    error = generate(server, expect=status, **{"model": model_id, **body})["error"]
    assert error["param"] == param, error


def test_a_prompt_over_the_context_is_a_400_that_says_how_it_is_over(server, model_id):
    """As on the OpenAI routes: with max_tokens, prompt + completion; without, the prompt alone (it said "1 in the
    completion", a size nobody asked for)."""
    asked = generate(server, expect=400, model=model_id, token_ids=[5] * 200, sampling_params={"max_tokens": 100})
    assert "you requested 300 tokens (200 in the token_ids, 100 in the completion)" in asked["error"]["message"]
    alone = generate(server, expect=400, model=model_id, token_ids=[5] * 256)["error"]
    assert alone["code"] == "context_length_exceeded" and "maximum context length is 256 tokens" in alone["message"]
    assert "you requested 256 tokens in the token_ids, which leaves no room" in alone["message"], alone


def test_in_the_openapi_schema(server):
    schema = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    operation = schema["paths"]["/inference/v1/generate"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("GenerateRequest")


def test_a_client_that_goes_away_frees_its_sequences(server, model_id):
    # as on the OpenAI routes: a client that times out cancels its sequences instead of leaving them generating
    from prometheus_client.parser import text_string_to_metric_families

    def scrape(name: str) -> float:
        for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
            for sample in family.samples:
                if sample.name == name:
                    return sample.value
        raise AssertionError(name)

    steps = scrape("gyre_inference_engine_decode_steps_total")
    params = {"n": 32, "max_tokens": 240, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/inference/v1/generate", json={"model": model_id, "token_ids": [5, 6, 7],
                   "sampling_params": params}, timeout=httpx.Timeout(30, read=0.3))  # fmt: skip
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and scrape("gyre_inference_running_requests") > 0:
        time.sleep(0.05)
    assert scrape("gyre_inference_running_requests") == 0
    assert scrape("gyre_inference_engine_decode_steps_total") - steps < 239  # cancelled long before the end


def test_requests_and_tokens_are_counted_under_endpoint_generate(server, model_id):
    """The route a teacher's log-probs and token-in clients use is counted like the OpenAI ones (it recorded
    nothing: a busy teacher server showed no requests, tokens or errors on the dashboards and alerts)."""
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        return {(s.name, s.labels.get("endpoint"), s.labels.get("outcome")): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip

    before = scrape()
    body = generate(server, model=model_id, token_ids=TOKEN_PROMPT, sampling_params={"n": 2, "max_tokens": 5})
    generate(server, expect=400, model=model_id, token_ids=TOKEN_PROMPT, stream=True)
    after = scrape()

    def grew(*key) -> float:
        return after[key] - before.get(key, 0.0)

    assert grew("gyre_inference_requests_total", "generate", "success") == 1
    assert grew("gyre_inference_requests_total", "generate", "client_error") == 1
    assert grew("gyre_inference_request_latency_seconds_count", "generate", None) == 1
    assert grew("gyre_inference_prompt_tokens_total", None, None) == len(TOKEN_PROMPT)
    assert grew("gyre_inference_generation_tokens_total", None, None) == body["usage"]["completion_tokens"]
