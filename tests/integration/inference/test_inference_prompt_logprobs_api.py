"""`prompt_logprobs` (vLLM's field and shape) on a real `gyre inference`, exact against a transformers forward.

Routes: the tokens-in route (top-level `prompt_logprobs`), `/v1/completions` through the official `openai` client
(per choice `prompt_logprobs`), chat (top-level, over the rendered prompt, as vLLM), and `echo` with `logprobs` (the
prompt's tokens in the legacy lists, as lm-eval reads them).
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

PROMPT = [1, 705, 201, 74, 75, 2, 201, 1, 739, 201, 88, 12]


def reference(tiny_model, prompt: list[int]):
    """Per prompt position after the first: (log-prob, rank, top-3 ids) of a plain transformers forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        rows = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    chosen = rows.gather(1, torch.tensor(prompt[1:])[:, None])
    ranks = ((rows > chosen).sum(-1) + 1).tolist()
    return chosen[:, 0].tolist(), ranks, rows.topk(3).indices.tolist()


@pytest.fixture(scope="module")
def expected(tiny_model):
    return reference(tiny_model, PROMPT)


@pytest.fixture(scope="module")
def plain(start_server):
    return start_server("--run-id", "prompt-logprobs")


@pytest.fixture(scope="module")
def plain_id(plain) -> str:
    return httpx.get(f"{plain.url}/v1/models", timeout=30).json()["data"][0]["id"]


def check(shaped: list, expected, prompt: list[int] = PROMPT) -> None:
    logprobs, ranks, tops = expected
    assert len(shaped) == len(prompt) and shaped[0] is None
    for i, position in enumerate(shaped[1:]):
        token = str(prompt[i + 1])
        assert list(position)[0] == token  # the prompt token first
        assert position[token]["logprob"] == pytest.approx(logprobs[i], abs=1e-4)
        assert position[token]["rank"] == ranks[i]
        assert set(position) == {token} | {str(t) for t in tops[i]}
        for rank, alternative in enumerate(tops[i], start=1):
            assert position[str(alternative)]["rank"] == rank


def test_tokens_in_route(plain, plain_id, expected):
    body = {"model": plain_id, "token_ids": PROMPT,
            "sampling_params": {"max_tokens": 1, "temperature": 0.6, "prompt_logprobs": 3, "n": 2}}  # fmt: skip
    response = httpx.post(f"{plain.url}/inference/v1/generate", json=body, timeout=60).json()
    check(response["prompt_logprobs"], expected)
    assert response["prompt_logprobs"][1][str(PROMPT[1])]["decoded_token"] == f"token_id:{PROMPT[1]}"
    body["sampling_params"].pop("prompt_logprobs")
    assert httpx.post(f"{plain.url}/inference/v1/generate", json=body, timeout=60).json()["prompt_logprobs"] is None


def test_completions_through_the_openai_client(plain, plain_id, expected):
    from openai import OpenAI

    with OpenAI(base_url=plain.base_url, api_key="unused", max_retries=0, timeout=60) as client:
        completion = client.completions.create(model=plain_id, prompt=PROMPT, max_tokens=2, n=2, temperature=1.3,
                                               extra_body={"prompt_logprobs": 3})  # fmt: skip
    for choice in completion.choices:  # every choice of the prompt carries them (vLLM)
        check(choice.model_extra["prompt_logprobs"], expected)


def test_chat_through_the_openai_client(plain, plain_id, tiny_model):
    """vLLM's chat field: top-level, over the rendered prompt (template and all), computed once whatever n (it was a
    400 "served on /v1/completions")."""
    from openai import OpenAI

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
    rendered = httpx.post(f"{plain.url}/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    with OpenAI(base_url=plain.base_url, api_key="unused", max_retries=0, timeout=60) as client:
        chat = client.chat.completions.create(model=plain_id, messages=messages, max_tokens=2, n=2, temperature=1.3,
                                              extra_body={"prompt_logprobs": 3})  # fmt: skip
        plain_chat = client.chat.completions.create(model=plain_id, messages=messages, max_tokens=2)
    check(chat.model_extra["prompt_logprobs"], reference(tiny_model, rendered), rendered)
    assert "prompt_logprobs" not in plain_chat.model_extra  # only when asked for


def test_echo_with_logprobs_lists_the_prompt_tokens_first(plain, plain_id, expected):
    body = {"model": plain_id, "prompt": PROMPT, "max_tokens": 2, "echo": True, "logprobs": 1, "temperature": 0}
    choice = httpx.post(f"{plain.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    lists = choice["logprobs"]
    assert len(lists["tokens"]) == len(PROMPT) + 2 and lists["token_logprobs"][0] is None
    assert lists["top_logprobs"][0] is None and lists["text_offset"][0] == 0
    assert lists["token_logprobs"][1 : len(PROMPT)] == pytest.approx(expected[0], abs=1e-4)
    assert all(len(top) in (1, 2) for top in lists["top_logprobs"][1:])
    assert "prompt_logprobs" not in choice  # only when asked for by name


def test_echo_with_max_tokens_0_scores_the_prompt_alone(plain, plain_id, expected):
    """OpenAI's and vLLM's way to score a prompt (HELM, older lm-eval): echo with max_tokens 0 returns the prompt,
    its log-probs and no completion. It was a 400 (max_tokens must be >= 1); without echo it still is."""
    from openai import OpenAI

    with OpenAI(base_url=plain.base_url, api_key="unused", max_retries=0, timeout=60) as client:
        scored = client.completions.create(model=plain_id, prompt=[PROMPT, PROMPT[:3]], max_tokens=0, echo=True,
                                           logprobs=1, n=2)  # fmt: skip
        streamed = list(client.completions.create(model=plain_id, prompt=PROMPT, max_tokens=0, echo=True,
                                                  stream=True, stream_options={"include_usage": True}))  # fmt: skip
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=plain_id, prompt=PROMPT, max_tokens=0)
    decoded = [client_text(plain, PROMPT), client_text(plain, PROMPT[:3])]
    assert [c.text for c in scored.choices] == [decoded[0], decoded[0], decoded[1], decoded[1]]
    assert {c.finish_reason for c in scored.choices} == {"length"}
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(PROMPT) + 3
    lists = scored.choices[0].logprobs
    assert len(lists.tokens) == len(PROMPT) and lists.token_logprobs[0] is None
    assert lists.token_logprobs[1:] == pytest.approx(expected[0], abs=1e-4)
    assert len(scored.choices[2].logprobs.tokens) == 3
    assert "".join(c.choices[0].text for c in streamed if c.choices) == decoded[0]
    assert streamed[-1].usage.completion_tokens == 0
    assert (refused.value.body["param"], refused.value.body["code"]) == ("max_tokens", "integer_below_min_value")


def client_text(server, ids: list[int]) -> str:
    return httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]


@pytest.mark.parametrize(
    ("route", "body", "param", "reason"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1,
                                  "stream": True}, "prompt_logprobs", "stream"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 21},
         "prompt_logprobs", "20"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, None, "stream"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", "20"),
        ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1, "stream": True}, None, "stream"),
    ],
)  # fmt: skip
def test_refused_with_the_reason(plain, plain_id, route, body, param, reason):
    response = httpx.post(f"{plain.url}{route}", json={"model": plain_id, "max_tokens": 1, **body}, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and reason in error["message"], error
    if param:
        assert error["param"] == param


def test_echo_with_max_tokens_0_scores_a_prompt_that_fills_the_context(start_server, plain, plain_id):
    """A distillation teacher scores a sample that fills the policy's context (prompt + completion = max_model_len)
    on a server of the same context: echo with max_tokens 0 takes a prompt of exactly max_model_len (it was a 400
    'you requested max_model_len + 1 tokens': the one token the engine samples and the choice drops was counted),
    with the log-probs a server of a longer context gives; one token more is still the context-length error."""
    prompt = PROMPT + PROMPT[1:5]  # 16 tokens: the shortest context the engine takes
    full = start_server("--run-id", "full-context", "--engine.max-model-len", str(len(prompt)))
    model = httpx.get(f"{full.url}/v1/models", timeout=30).json()["data"][0]
    assert model["max_model_len"] == len(prompt)
    body = {"model": model["id"], "prompt": prompt, "max_tokens": 0, "echo": True, "prompt_logprobs": 0}
    scored = httpx.post(f"{full.url}/v1/completions", json=body, timeout=60)
    assert scored.status_code == 200, scored.text
    reference = httpx.post(f"{plain.url}/v1/completions", json={**body, "model": plain_id, "max_tokens": 1},
                           timeout=60).json()["choices"][0]["prompt_logprobs"]  # fmt: skip
    entries = scored.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    for t in range(1, len(prompt)):
        got, want = entries[t][str(prompt[t])]["logprob"], reference[t][str(prompt[t])]["logprob"]
        assert got == pytest.approx(want, abs=1e-4)
    refused = httpx.post(f"{full.url}/v1/completions", json={**body, "prompt": prompt + [5]}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    one_more = httpx.post(f"{full.url}/v1/completions", json={**body, "max_tokens": 1}, timeout=60)
    assert one_more.status_code == 400 and "17 tokens" in one_more.json()["error"]["message"]
