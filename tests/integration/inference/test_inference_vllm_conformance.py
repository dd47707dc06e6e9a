"""What clients written against vLLM's OpenAI server rely on, checked on a real `gyre inference` process.

The behaviours are those vLLM's own OpenAI-server tests check that apply to one model with the chat,
completions, tokenize, detokenize and models routes (docs/inference.md, "Compatibility"): the
`stream_options` usage variants, `min_tokens`, `logit_bias`, `include_stop_str_in_output`, `echo`,
`continue_final_message`, `return_tokens_as_token_ids`, log-prob shapes and bounds, batch prompts, the
64-bit seed bound, `/tokenize` and `/detokenize` shapes, `/version`, `/health` and the model card.
Driven by the official `openai` client (vLLM's extensions through `extra_body`) or plain HTTP.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

STORY = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Tell me a story."}]
PROMPT = "Once upon a time"


def extra(obj) -> dict:
    return obj.model_extra or {}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def end_of_turn(http) -> int:
    [token] = http.post("/tokenize", json={"prompt": "<|im_end|>"}).json()["tokens"]
    return token


def test_version_health_and_the_model_card(http, server, tool_model):
    assert http.get("/health").status_code == 200
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200  # vLLM's (SageMaker's)
    version = http.get("/version")
    assert version.status_code == 200 and isinstance(version.json()["version"], str)
    [card] = http.get("/v1/models").json()["data"]
    assert card["id"] == str(tool_model) and card["root"] == str(tool_model) and card["parent"] is None
    assert card["object"] == "model" and card["max_model_len"] == 256 and isinstance(card["created"], int)
    # vLLM's card carries a permission entry (its ModelPermission); a client reading vLLM's card whole found none
    [permission] = card["permission"]
    assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")
    assert permission["allow_sampling"] and permission["allow_logprobs"] and not permission["allow_fine_tuning"]
    assert permission["organization"] == "*" and permission["group"] is None and not permission["is_blocking"]
    assert http.get(f"/v1/models/{card['id']}").json()["permission"][0]["object"] == "model_permission"


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/chat/completions", {"messages": STORY}),
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 16}),
    ],
)
@pytest.mark.parametrize("model", ["left out", None])
def test_a_request_without_a_model_is_for_the_served_model(http, model_id, route, body, model):
    """vLLM's request models take no model (or null) as the served one: a curl or script written against vLLM that
    leaves it out was a 400 "model: Field required" here. The answer names the served model, streamed or not."""
    body = {**body, "temperature": 0.0, **({} if model == "left out" else {"model": model})}
    if route != "/v1/responses":
        body["max_tokens"] = 4
    answer = http.post(route, json=body)
    assert answer.status_code == 200 and answer.json()["model"] == model_id, answer.text
    with_model = http.post(route, json={**body, "model": model_id}).json()
    text = {"/v1/chat/completions": lambda b: b["choices"][0]["message"]["content"],
            "/v1/completions": lambda b: b["choices"][0]["text"],
            "/v1/responses": lambda b: b["output"][0]["content"][0]["text"]}[route]  # fmt: skip
    assert text(answer.json()) == text(with_model)
    with http.stream("POST", route, json={**body, "stream": True}) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert events and all(event.get("model", event.get("response", {}).get("model")) == model_id
                          for event in events if "model" in event or "response" in event), events  # fmt: skip


def test_an_unknown_model_is_still_404(http):
    answer = http.post("/v1/chat/completions", json={"model": "nope", "messages": STORY, "max_tokens": 2})
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found", answer.text


# ---- stream_options ---------------------------------------------------------------------------------
def _stream(client, model_id, kind: str, options, **kwargs):
    common = dict(model=model_id, max_tokens=6, temperature=0.0, stream=True, stream_options=options,
                  extra_body={"ignore_eos": True}, **kwargs)  # fmt: skip
    if kind == "chat":
        return list(client.chat.completions.create(messages=STORY, **common))
    return list(client.completions.create(prompt=PROMPT, **common))


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_stream_options_usage_variants(client, model_id, kind):
    for options in ({}, {"include_usage": False}, {"include_usage": False, "continuous_usage_stats": True}):
        assert all(chunk.usage is None for chunk in _stream(client, model_id, kind, options)), options

    # include_usage only: one last chunk with usage and no choices, after the finishing chunk
    chunks = _stream(client, model_id, kind, {"include_usage": True, "continuous_usage_stats": False})
    assert all(chunk.usage is None for chunk in chunks[:-1]) and chunks[-2].choices[0].finish_reason == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 6 and last.usage.prompt_tokens > 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens

    # continuous_usage_stats (vLLM): every chunk carries the usage so far, growing with each token chunk
    chunks = _stream(client, model_id, kind, {"include_usage": True, "continuous_usage_stats": True})
    seen = 0
    for chunk in chunks:
        usage = chunk.usage
        assert usage.prompt_tokens == last.usage.prompt_tokens
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert usage.completion_tokens > seen or seen == 0 or not chunk.choices
        seen = usage.completion_tokens
    assert seen == 6 and chunks[-1].choices == []


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_continuous_usage_is_that_of_each_chunk_s_own_choice(client, model_id, http, kind):
    """n = 2 (and two prompts on completions): as vLLM, a chunk's usage is its own choice's so far (its prompt's
    tokens, its tokens), not the request's; the last chunk has the request's. It summed every choice's tokens and
    every prompt's, so a client tracking a choice's length by its chunks counted the others too."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    common = dict(model=model_id, max_tokens=5, temperature=1.0, seed=1, n=2, stream=True, stream_options=options,
                  extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip  # a chunk per token
    if kind == "chat":
        chunks = list(client.chat.completions.create(messages=STORY, **common))
        prompt_of = dict.fromkeys(range(2), chunks[-1].usage.prompt_tokens)  # one prompt
    else:
        prompts = [PROMPT, PROMPT + " there was a dragon"]
        chunks = list(client.completions.create(prompt=prompts, **common))
        lengths = [http.post("/tokenize", json={"prompt": p}).json()["count"] for p in prompts]
        prompt_of = {0: lengths[0], 1: lengths[0], 2: lengths[1], 3: lengths[1]}  # index counts prompts x n
    tokens: dict[int, int] = {}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        tokens[choice.index] = tokens.get(choice.index, 0) + len(extra(choice).get("token_ids") or [])
        usage = chunk.usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_of[choice.index], tokens[choice.index])
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert tokens == dict.fromkeys(prompt_of, 5)
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 5 * len(prompt_of)
    assert last.usage.prompt_tokens == sum(set(prompt_of.values()))  # each prompt once, whatever n


@pytest.mark.parametrize(
    "options", [{"include_usage": True}, {"include_usage": None}, {"continuous_usage_stats": True}]
)
def test_stream_options_without_stream_is_400(client, model_id, options):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_id, prompt=PROMPT, max_tokens=2, stream=False, stream_options=options)


# ---- sampling controls ----------------------------------------------------------------------------
def test_logit_bias_steers_sampling_and_min_tokens_holds_off_the_end_of_turn(client, model_id, end_of_turn):
    def ask(**body):
        r = client.chat.completions.create(model=model_id, messages=STORY, max_tokens=12, seed=3,
                                           extra_body={"return_token_ids": True, **body})  # fmt: skip
        return extra(r.choices[0])["token_ids"], r.choices[0].finish_reason

    bias = {str(end_of_turn): 100.0}  # the end-of-turn token becomes (almost) certain
    assert ask(logit_bias=bias) == ([end_of_turn], "stop")
    tokens, finish = ask(logit_bias=bias, min_tokens=5)  # ... but not before 5 tokens
    assert len(tokens) == 6 and end_of_turn not in tokens[:5] and tokens[5] == end_of_turn and finish == "stop"
    tokens, finish = ask(logit_bias={"7": 100.0}, ignore_eos=True)
    assert tokens == [7] * 12 and finish == "length"
    tokens, _ = ask(min_tokens=12)  # min_tokens == max_tokens: exactly that many, like ignore_eos
    assert len(tokens) == 12 and end_of_turn not in tokens


def test_logit_bias_outside_the_vocabulary_is_400_naming_it(client, model_id, http):
    vocabulary = 1024
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model_id, messages=STORY, max_tokens=2, logit_bias={"1025": 1.0})
    assert "1025" in str(refused.value) and str(vocabulary) in str(refused.value)
    for bad in ({"x": 1.0}, {"5": 101.0}, {"5": "1"}):
        response = http.post("/v1/completions", json={"model": model_id, "prompt": PROMPT, "logit_bias": bad})
        assert response.status_code == 400 and response.json()["error"]["param"].startswith("logit_bias")


def test_allowed_token_ids_limit_what_is_sampled(client, http, model_id, server):
    allowed = sorted(set(http.post("/tokenize", json={"prompt": " the cat sat on a mat"}).json()["tokens"]))
    ask = {"max_tokens": 10, "seed": 1, "extra_body": {"allowed_token_ids": allowed, "return_token_ids": True}}
    chat = client.chat.completions.create(model=model_id, messages=STORY, logprobs=True, **ask)
    completion = client.completions.create(model=model_id, prompt=PROMPT, n=2, **ask)
    generated = httpx.post(
        f"{server.url}/inference/v1/generate",
        timeout=60,
        json={
            "model": model_id,
            "token_ids": [5, 6, 7],
            "sampling_params": {"max_tokens": 10, "allowed_token_ids": allowed},
        },
    )
    choices = [*chat.choices, *completion.choices]
    outputs = [extra(choice)["token_ids"] for choice in choices] + [generated.json()["choices"][0]["token_ids"]]
    for tokens in outputs:  # the end-of-turn token is not allowed either: every choice runs to its length
        assert len(tokens) == 10 and set(tokens) <= set(allowed), tokens
    assert len({tuple(tokens) for tokens in outputs}) > 1  # sampled, not one forced token


def test_bad_words_are_never_written(client, http, model_id, server):
    ask = dict(model=model_id, prompt=PROMPT, max_tokens=16, temperature=0.0,
               extra_body={"return_token_ids": True, "ignore_eos": True})  # fmt: skip
    plain = extra(client.completions.create(**ask).choices[0])["token_ids"]

    def alone(token: int) -> str | None:  # the token's text, when that text tokenizes back to the token alone
        text = http.post("/detokenize", json={"tokens": [token]}).json()["prompt"]
        ok = text.strip() and http.post("/tokenize", json={"prompt": text.lstrip(), "add_special_tokens": False}
                                        ).json()["tokens"] == [token]  # fmt: skip
        return text if ok else None

    at, word = next((i, alone(t)) for i, t in enumerate(plain) if alone(t))
    for extra_body in ({"bad_words": [word]}, {"bad_words": ["  " + word.lstrip()]}):  # leading spaces: the same
        banned = extra(client.completions.create(**ask | {"extra_body": ask["extra_body"] | extra_body}).choices[0])
        assert banned["token_ids"][:at] == plain[:at] and plain[at] not in banned["token_ids"], (word, plain)
    generated = httpx.post(
        f"{server.url}/inference/v1/generate",
        timeout=60,
        json={
            "model": model_id,
            "token_ids": extra(client.completions.create(**ask))["prompt_token_ids"],
            "sampling_params": {"max_tokens": 16, "temperature": 0, "ignore_eos": True, "bad_words": [word]},
        },
    )
    assert generated.json()["choices"][0]["token_ids"] == banned["token_ids"]


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [("allowed_token_ids", [], None), ("allowed_token_ids", [3, 1025], "1025 is out of vocabulary"),
     ("allowed_token_ids", [-1], None), ("bad_words", ["   "], "only spaces"), ("bad_words", [""], None),
     ("bad_words", "word", None)],
)  # fmt: skip
def test_bad_allowed_token_ids_and_bad_words_are_400_naming_them(http, model_id, field, value, words):
    for route, body in (("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, field: value}),
                        ("/v1/chat/completions", {"messages": STORY, "max_tokens": 2, field: value}),
                        ("/inference/v1/generate", {"token_ids": [5, 6],
                                                    "sampling_params": {"max_tokens": 2, field: value}})):  # fmt: skip
        response = http.post(route, json={"model": model_id, **body})
        error = response.json()["error"]
        param = f"sampling_params.{field}" if "sampling_params" in body else field
        assert response.status_code == 400 and error["param"].startswith(param), (route, error)
        assert words is None or words in error["message"], (route, error)


def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens(client, http, model_id):
    long = " ".join(["the cat sat on the mat"] * 60)  # well over the 256-token context
    ids = http.post("/tokenize", json={"prompt": long}).json()["tokens"]
    assert len(ids) > 256
    ask = {"model": model_id, "max_tokens": 6, "seed": 5, "echo": True}
    cut = client.completions.create(prompt=long, **ask, extra_body={"truncate_prompt_tokens": 100,
                                                                    "return_token_ids": True})  # fmt: skip
    kept = ids[-100:]
    assert extra(cut.choices[0])["prompt_token_ids"] == kept and cut.usage.prompt_tokens == 100
    sent = client.completions.create(prompt=kept, **ask, extra_body={"return_token_ids": True})
    assert extra(cut.choices[0])["token_ids"] == extra(sent.choices[0])["token_ids"]  # what the model saw: the cut
    assert cut.choices[0].text == sent.choices[0].text  # the echo is the prompt kept, then the completion
    with pytest.raises(openai.BadRequestError, match="context"):  # without it, as before: too long
        client.completions.create(prompt=long, **ask)
    # chat: the rendered prompt's last tokens; -1 = the context length (no room left for a token: too long)
    whole = http.post("/tokenize", json={"messages": STORY}).json()["tokens"]
    chat = client.chat.completions.create(
        model=model_id, messages=STORY, max_tokens=2, extra_body={"truncate_prompt_tokens": 5, "return_token_ids": True}
    )
    assert extra(chat)["prompt_token_ids"] == whole[-5:] and chat.usage.prompt_tokens == 5
    short = client.completions.create(
        prompt=PROMPT, max_tokens=2, model=model_id, extra_body={"truncate_prompt_tokens": -1, "return_token_ids": True}
    )
    assert (
        extra(short.choices[0])["prompt_token_ids"] == http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    )
    # the tokens-in route (a vLLM SamplingParams field): the same cut of the ids sent
    generated = http.post("/inference/v1/generate", json={"model": model_id, "token_ids": ids, "sampling_params": {
        "max_tokens": 6, "seed": 5, "truncate_prompt_tokens": 100}}).json()  # fmt: skip
    assert generated["prompt_token_ids"] == kept and generated["usage"]["prompt_tokens"] == 100
    assert generated["choices"][0]["token_ids"] == extra(sent.choices[0])["token_ids"]


@pytest.mark.parametrize(("value", "words"), [(0, "at least 1"), (-2, None), (257, "max_model_len (256)"),
                                              ("4", None)])  # fmt: skip
def test_truncate_prompt_tokens_out_of_range_is_400_naming_it(http, model_id, value, words):
    field = "truncate_prompt_tokens"
    for route, body, param in (
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, field: value}, field),
        ("/v1/chat/completions", {"messages": STORY, "max_tokens": 2, field: value}, field),
        (
            "/inference/v1/generate",
            {"token_ids": [5, 6], "sampling_params": {field: value}},
            f"sampling_params.{field}",
        ),
    ):
        response = http.post(route, json={"model": model_id, **body})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == param, (route, error)
        assert words is None or words in error["message"], error


@pytest.mark.parametrize("stream", [False, True])
def test_skip_special_tokens_false_keeps_special_tokens_but_not_the_stop_token(client, http, model_id, end_of_turn,
                                                                               stream):  # fmt: skip
    [start] = http.post("/tokenize", json={"prompt": "<|im_start|>"}).json()["tokens"]

    def text(route: str, **body) -> tuple[str, str]:
        common = dict(model=model_id, max_tokens=3, seed=2, stream=stream, extra_body=body)
        if route == "chat":
            answer = client.chat.completions.create(messages=STORY, **common)
            pieces = [c.choices[0].delta.content or "" for c in answer if c.choices] if stream else None
            return ("".join(pieces) if stream else answer.choices[0].message.content), route
        answer = client.completions.create(prompt=PROMPT, **common)
        return ("".join(c.choices[0].text for c in answer if c.choices) if stream else answer.choices[0].text), route

    for route in ("chat", "completions"):
        forced = {"logit_bias": {str(start): 100.0}, "ignore_eos": True}
        assert text(route, **forced) == ("", route)  # skipped, as by default
        assert text(route, **forced, skip_special_tokens=False) == ("<|im_start|>" * 3, route)
        ended = {"logit_bias": {str(end_of_turn): 100.0}, "skip_special_tokens": False}  # ends at once, by the token
        assert text(route, **ended) == ("", route)  # the stop token is not text (vLLM)...
        assert text(route, **ended, include_stop_str_in_output=True) == ("<|im_end|>", route)  # ... unless asked
    # the tokens-in route: the same (its text held "<|im_end|>" with skip_special_tokens false)
    sampling = {"max_tokens": 3, "allowed_token_ids": [start, end_of_turn], "seed": 1, "n": 4}
    for skip in (True, False):
        body = {"model": model_id, "token_ids": [5, 6], "sampling_params": sampling | {"skip_special_tokens": skip}}
        for choice in http.post("/inference/v1/generate", json=body).json()["choices"]:
            kept = [t for t in choice["token_ids"] if t != end_of_turn]  # a start token, or the end at last
            assert choice["text"] == ("" if skip else "<|im_start|>" * len(kept)), choice
            assert choice["finish_reason"] == ("stop" if choice["token_ids"][-1] == end_of_turn else "length")


def _cached_prompt_tokens(http) -> float:
    lines = http.get("/metrics").text.splitlines()
    name = "gyre_inference_engine_prompt_tokens_total{"
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name) and 'source="cached"' in line)


def test_cache_salt_keeps_cached_prompts_apart(client, http, model_id):
    """vLLM's cache_salt (extra_body; the tokens-in route's top-level field): a prompt cached under one salt is
    computed again under another and hit under its own; the answer is the same whatever the salt."""
    messages = [{"role": "user", "content": "Salted prompt: " + "the cat sat on the mat " * 6}]

    def cached_by(salt) -> tuple[float, list[int]]:
        before = _cached_prompt_tokens(http)
        extra_body = {"return_token_ids": True} | ({"cache_salt": salt} if salt else {})
        answer = client.chat.completions.create(model=model_id, messages=messages, max_tokens=3, seed=1,
                                                extra_body=extra_body)  # fmt: skip
        return _cached_prompt_tokens(http) - before, extra(answer.choices[0])["token_ids"]

    runs = [cached_by(salt) for salt in (None, "tenant-a", "tenant-a", "tenant-b", None)]
    hits = [cached for cached, _ in runs]
    assert hits[1] == 0 and hits[2] > 0 and hits[3] == 0 and hits[4] > 0, hits
    assert len({tuple(tokens) for _, tokens in runs}) == 1
    prompt = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    before = _cached_prompt_tokens(http)
    body = {"model": model_id, "token_ids": prompt, "sampling_params": {"max_tokens": 1}, "cache_salt": "tenant-c"}
    assert http.post("/inference/v1/generate", json=body).status_code == 200
    assert _cached_prompt_tokens(http) == before  # another salt: nothing shared
    for route, bad in (("/v1/chat/completions", {"messages": STORY, "cache_salt": ""}),
                       ("/inference/v1/generate", {"token_ids": [5], "cache_salt": ""})):  # fmt: skip
        response = http.post(route, json={"model": model_id, "max_tokens": 2, **bad} if "messages" in bad else
                             {"model": model_id, **bad})  # fmt: skip
        assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt", response.text


def test_min_tokens_above_max_tokens_is_400(http, model_id):
    response = http.post("/v1/completions", json={"model": model_id, "prompt": PROMPT, "max_tokens": 3,
                                                  "min_tokens": 4})  # fmt: skip
    assert response.status_code == 400 and "min_tokens" in response.json()["error"]["message"]


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_stop_strings_with_and_without_include_stop_str_in_output(client, model_id, kind):
    def ask(**body):
        common = dict(model=model_id, max_tokens=24, temperature=0.0, extra_body={"ignore_eos": True, **body})
        if kind == "chat":
            return client.chat.completions.create(messages=STORY, **common).choices[0]
        return client.completions.create(prompt=PROMPT, **common).choices[0]

    def text(choice) -> str:
        return choice.message.content if kind == "chat" else choice.text

    full = text(ask())
    # a two-character stop string from the middle of the greedy answer, whose first occurrence is not at 0
    stop = next(full[i : i + 2] for i in range(len(full) // 2, len(full) - 1) if full.find(full[i : i + 2]) > 0)
    cut = ask(stop=[stop])
    assert text(cut) == full[: full.find(stop)] and cut.finish_reason == "stop"
    kept = ask(stop=[stop], include_stop_str_in_output=True)
    assert text(kept) == full[: full.find(stop) + len(stop)] and kept.finish_reason == "stop"


def test_seed_is_a_64_bit_integer(http, model_id):
    for seed, status in ((2**63 - 1, 200), (-(2**63), 200), (2**63, 400), (-(2**63) - 1, 400)):
        body = {"model": model_id, "prompt": PROMPT, "max_tokens": 1, "seed": seed}
        assert http.post("/v1/completions", json=body).status_code == status, seed


# ---- echo and continue_final_message ------------------------------------------------------------------
def test_completion_echo_prepends_the_prompt(client, model_id, http):
    tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    for prompt, shown in ((PROMPT, PROMPT), (tokens, PROMPT), ([PROMPT, PROMPT], PROMPT), ([tokens] * 2, PROMPT)):
        kwargs = dict(model=model_id, prompt=prompt, max_tokens=5, temperature=0.0)
        plain = client.completions.create(**kwargs)
        echoed = client.completions.create(**kwargs, echo=True)
        assert [c.text for c in echoed.choices] == [shown + c.text for c in plain.choices]
        streamed = {}
        for chunk in client.completions.create(**kwargs, echo=True, stream=True):
            for c in chunk.choices:
                streamed[c.index] = streamed.get(c.index, "") + c.text
        assert [streamed[c.index] for c in echoed.choices] == [c.text for c in echoed.choices]
    with_logprobs = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=2, echo=True, logprobs=1)
    assert with_logprobs.choices[0].logprobs.token_logprobs[0] is None  # the prompt's first token (vLLM)
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=model_id, prompt=PROMPT, max_tokens=2, echo=True, logprobs=1, stream=True)


def test_chat_continue_final_message_with_and_without_echo(client, model_id, http):
    partial = "Once upon a"
    messages = [*STORY, {"role": "assistant", "content": partial}]
    options = {"continue_final_message": True, "add_generation_prompt": False, "return_token_ids": True}
    prompt = http.post("/tokenize", json={"messages": messages, "continue_final_message": True,
                                          "add_generation_prompt": False}).json()["tokens"]  # fmt: skip
    detokenized = http.post("/detokenize", json={"tokens": prompt}).json()["prompt"]
    assert detokenized.endswith("assistant\n" + partial)  # the turn is left open, not closed
    for echo in (False, True):
        response = client.chat.completions.create(model=model_id, messages=messages, max_tokens=6, temperature=0.0,
                                                  extra_body={**options, "echo": echo})  # fmt: skip
        assert extra(response)["prompt_token_ids"] == prompt
        content = response.choices[0].message.content
        assert content.startswith(partial) if echo else not content.startswith(partial)
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(model=model_id, messages=messages, max_tokens=2,
                                       extra_body={"continue_final_message": True})  # fmt: skip


def test_chat_template_kwargs_reach_the_template_but_cannot_override_request_fields(client, model_id):
    def ask(kwargs):
        body = {"chat_template_kwargs": kwargs}
        return client.chat.completions.create(model=model_id, messages=STORY, max_tokens=2, extra_body=body)

    assert ask({"enable_thinking": False}).choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
        ask({"add_generation_prompt": False})


# ---- log-probs -----------------------------------------------------------------------------------------
def test_logprobs_shapes_and_bounds(client, model_id):
    def completion(logprobs):
        return client.completions.create(model=model_id, prompt=[5, 6, 7], max_tokens=5, temperature=0.0,
                                         logprobs=logprobs).choices[0].logprobs  # fmt: skip

    assert completion(None) is None
    assert all(len(top) == 1 for top in completion(0).top_logprobs)  # the sampled token alone
    assert all(5 <= len(top) <= 6 for top in completion(5).top_logprobs)

    def chat(**kwargs):
        return client.chat.completions.create(model=model_id, messages=STORY, max_completion_tokens=5,
                                              temperature=0.0, **kwargs).choices[0].logprobs  # fmt: skip

    assert chat(logprobs=False) is None
    assert all(entry.top_logprobs == [] for entry in chat(logprobs=True, top_logprobs=0).content)
    assert all(len(entry.top_logprobs) == 5 for entry in chat(logprobs=True, top_logprobs=5).content)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError):
            list(client.chat.completions.create(model=model_id, messages=STORY, max_tokens=2, logprobs=True,
                                                top_logprobs=21, stream=stream))  # fmt: skip
        with pytest.raises(openai.BadRequestError):
            list(client.completions.create(model=model_id, prompt=PROMPT, max_tokens=2, logprobs=21, stream=stream))
    assert client.completions.create(model=model_id, prompt=PROMPT, max_tokens=2).choices  # still serving


def test_return_tokens_as_token_ids_names_tokens_by_id(client, model_id):
    body = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    choice = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=5, logprobs=1,
                                       extra_body=body).choices[0]  # fmt: skip
    ids = extra(choice)["token_ids"]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert all(key.startswith("token_id:") for top in choice.logprobs.top_logprobs for key in top)
    chat = client.chat.completions.create(model=model_id, messages=STORY, max_tokens=5, logprobs=True,
                                          top_logprobs=2, extra_body=body).choices[0]  # fmt: skip
    assert [e.token for e in chat.logprobs.content] == [f"token_id:{t}" for t in extra(chat)["token_ids"]]
    assert all(alt.token.startswith("token_id:") for e in chat.logprobs.content for alt in e.top_logprobs)


# ---- batches ---------------------------------------------------------------------------------------------
def test_batch_prompts_with_n_and_streaming(client, model_id, http):
    tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    for prompts in ([PROMPT] * 2, [tokens] * 2):
        batch = client.completions.create(model=model_id, prompt=prompts, max_tokens=5, temperature=0.0)
        assert len(batch.choices) == 2 and batch.choices[0].text == batch.choices[1].text
        batch = client.completions.create(model=model_id, prompt=prompts, n=2, max_tokens=5, seed=1)
        texts = [c.text for c in batch.choices]
        assert [c.index for c in batch.choices] == [0, 1, 2, 3] and texts[:2] == texts[2:]  # per-prompt seeds
        streamed = ["", ""]
        for chunk in client.completions.create(model=model_id, prompt=prompts, max_tokens=5, temperature=0.0,
                                               stream=True):  # fmt: skip
            assert len(chunk.choices) == 1
            streamed[chunk.choices[0].index] += chunk.choices[0].text
        assert streamed[0] == streamed[1]
    response = http.post("/v1/completions", json={"model": model_id, "prompt": [], "max_tokens": 2})
    assert response.status_code == 400
    response = http.post("/v1/completions", json={"model": model_id, "prompt": [999999], "max_tokens": 2})
    assert response.status_code == 400 and "out of vocabulary" in response.json()["error"]["message"]


# ---- /tokenize and /detokenize ---------------------------------------------------------------------------
def test_tokenize_and_detokenize_shapes(http, model_id, tool_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    text = "This is a test prompt. vllm1"
    for add_special in (False, True):
        body = http.post("/tokenize", json={"model": model_id, "prompt": text, "add_special_tokens": add_special})
        assert body.json() == {"count": len(tokenizer.encode(text, add_special_tokens=add_special)),
                               "max_model_len": 256, "tokens": tokenizer.encode(text, add_special_tokens=add_special),
                               "token_strs": None}  # fmt: skip
    strs = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(strs["tokens"])
    conversation = [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Nice to meet you!"}]
    for add_generation, continue_final in ((True, False), (False, False), (False, True)):
        expected = tokenizer.encode(
            tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation,
                                          continue_final_message=continue_final, tokenize=False),
            add_special_tokens=False,
        )  # fmt: skip
        body = http.post("/tokenize", json={"model": model_id, "messages": conversation,
                                            "add_generation_prompt": add_generation,
                                            "continue_final_message": continue_final}).json()  # fmt: skip
        assert body["tokens"] == expected and body["count"] == len(expected) and body["token_strs"] is None
    assert http.post("/detokenize", json={"model": model_id, "tokens": tokenizer.encode(text)}).json() == {
        "prompt": text
    }
    assert http.post("/tokenize", json={"model": "other", "prompt": text}).status_code == 404


@pytest.mark.parametrize("filters", [{"top_k": 1}, {"min_p": 1.0}, {"top_k": 1, "min_p": 0.5, "top_p": 0.9}])
def test_top_k_and_min_p_filter_the_draw_on_every_route(client, model_id, server, filters):
    """vLLM's top_k / min_p (what Qwen's and Llama's model cards tell users to send through extra_body) were a 400
    beyond their neutral values. Keeping the most likely token only, they sample the greedy tokens at any seed;
    the reported log-probs stay log_softmax(logits / T) (T = 1 here), those of the greedy request."""
    greedy = client.chat.completions.create(model=model_id, messages=STORY, max_tokens=8, temperature=0,
                                            logprobs=True, extra_body={"ignore_eos": True})  # fmt: skip
    tokens = [entry.token for entry in greedy.choices[0].logprobs.content]
    logprobs = [entry.logprob for entry in greedy.choices[0].logprobs.content]
    for stream in (False, True):
        sampled = client.chat.completions.create(
            model=model_id, messages=STORY, max_tokens=8, temperature=1.0, n=3, seed=5, logprobs=True, stream=stream,
            extra_body={"ignore_eos": True, **filters},
        )  # fmt: skip
        entries: dict[int, list] = {}
        for choice in [c for chunk in sampled for c in chunk.choices] if stream else sampled.choices:
            entries.setdefault(choice.index, []).extend(choice.logprobs.content if choice.logprobs else [])
        assert len(entries) == 3
        for content in entries.values():
            assert [entry.token for entry in content] == tokens
            assert [entry.logprob for entry in content] == pytest.approx(logprobs, abs=1e-5)
    options = {"model": model_id, "prompt": PROMPT, "max_tokens": 6}
    ids = {"return_token_ids": True, "ignore_eos": True}
    plain = client.completions.create(**options, temperature=0, extra_body=ids)
    expected = extra(plain.choices[0])["token_ids"]
    filtered = client.completions.create(**options, temperature=1.0, n=2, seed=9, extra_body=ids | filters)
    assert [extra(choice)["token_ids"] for choice in filtered.choices] == [expected] * 2
    generated = httpx.post(
        f"{server.url}/inference/v1/generate",
        timeout=60,
        json={
            "model": model_id,
            "token_ids": extra(plain.choices[0])["prompt_token_ids"],
            "sampling_params": {"max_tokens": 6, "temperature": 1.0, "n": 2, "seed": 3, "ignore_eos": True, **filters},
        },
    )
    assert [choice["token_ids"] for choice in generated.json()["choices"]] == [expected] * 2


@pytest.mark.parametrize(("field", "value"), [("top_k", -2), ("top_k", 10**6), ("min_p", 1.5), ("min_p", -0.1)])
def test_top_k_and_min_p_out_of_range_are_400_naming_them(http, model_id, field, value):
    for route, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": STORY})):
        response = http.post(route, json={"model": model_id, "max_tokens": 2, **body, field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text


# What a client spelling out vLLM's request defaults sends (a dump of vLLM's own request model, an RL framework's
# sampling dict): each was a 400 "Extra inputs are not permitted" (nulls of vLLM's fields too).
VLLM_DEFAULTS = {
    "best_of": 1, "use_beam_search": False, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "length_penalty": 1.0,
    "stop_token_ids": [], "include_stop_str_in_output": False, "ignore_eos": False, "min_tokens": 0,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "truncate_prompt_tokens": None,
    "prompt_logprobs": None, "allowed_token_ids": None, "bad_words": [], "echo": False, "priority": 0,
    "logits_processors": None, "mm_processor_kwargs": None, "structural_tag": None, "cache_salt": None,
    "kv_transfer_params": None, "vllm_xargs": None, "return_tokens_as_token_ids": None, "guided_json": None,
    "guided_decoding_backend": None, "frequency_penalty": 0.0, "presence_penalty": 0.0,
}  # fmt: skip
VLLM_CHAT_DEFAULTS = {"add_generation_prompt": True, "continue_final_message": False, "add_special_tokens": False,
                      "documents": None, "chat_template": None, "chat_template_kwargs": None,
                      "include_reasoning": True}  # fmt: skip


def test_vllm_request_defaults_spelled_out_sample_what_leaving_them_out_does(http, model_id):
    ask = {"model": model_id, "max_tokens": 6, "seed": 3, "return_token_ids": True}
    for route, body, defaults in (("/v1/chat/completions", {"messages": STORY}, VLLM_DEFAULTS | VLLM_CHAT_DEFAULTS),
                                  ("/v1/completions", {"prompt": PROMPT}, VLLM_DEFAULTS)):  # fmt: skip
        plain, spelled = (http.post(route, json=ask | body | extra) for extra in ({}, defaults))
        assert spelled.status_code == 200, spelled.text
        assert spelled.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]
    refused = {"length_penalty": 0.5, "spaces_between_special_tokens": False, "best_of": 2,
               "include_reasoning": False, "chat_template": "{{ x }}", "documents": []}  # fmt: skip
    for field, value in refused.items():
        response = http.post("/v1/chat/completions", json=ask | {"messages": STORY, field: value})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == field, error
        assert "supported" in error["message"] or "maximum value" in error["message"], error


def test_chat_add_special_tokens_is_honoured_as_by_tokenize(http, model_id):
    for add in (False, True):
        chat = http.post(
            "/v1/chat/completions",
            json={
                "model": model_id,
                "messages": STORY,
                "max_tokens": 1,
                "return_token_ids": True,
                "add_special_tokens": add,
            },
        ).json()
        tokens = http.post("/tokenize", json={"model": model_id, "messages": STORY, "add_special_tokens": add}).json()
        assert chat["prompt_token_ids"] == tokens["tokens"]


# ---- what is refused, and why -------------------------------------------------------------------------
def test_vllm_sampling_fields_are_accepted_at_their_neutral_value_and_refused_otherwise(http, model_id):
    base = {"model": model_id, "prompt": PROMPT, "max_tokens": 2}
    neutral = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "use_beam_search": False,
               "skip_special_tokens": True, "presence_penalty": 0.0, "frequency_penalty": 0.0, "user": "u"}  # fmt: skip
    assert http.post("/v1/completions", json=base | neutral).status_code == 200
    assert http.post("/v1/completions", json=base | {"top_k": 0}).status_code == 200
    for field, value in (("length_penalty", 1.2), ("use_beam_search", True), ("best_of", 2)):
        response = http.post("/v1/completions", json=base | {field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field, (field, response.text)


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [("guided_decoding_backend", "xgrammar", "llguidance"), ("prompt_embeds", "x", "token ids")],
)  # fmt: skip
def test_unsupported_vllm_fields_say_why(http, model_id, field, value, reason):
    for route, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": STORY})):
        response = http.post(route, json={"model": model_id, "max_tokens": 2, **body, field: value})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == field and reason in error["message"], error
