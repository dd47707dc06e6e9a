"""`gyre inference --runner pooling`: a reward model on vLLM's `/classify`, exact against a transformers forward.

The model is a tiny LlamaForSequenceClassification with one label (`support.models.reward_model_path`). Scores
are the score head at each input's last token; inputs of one request run as one right-padded batch.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from support.models import reward_model_path

CONVERSATION = [{"role": "user", "content": "Reverse: abc"}, {"role": "assistant", "content": "cba"}]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return reward_model_path(tmp_path_factory)


@pytest.fixture(scope="module")
def rm_server(start_server, reward_model):
    return start_server("--runner", "pooling", "--run-id", "reward-model", model_path=reward_model)


@pytest.fixture(scope="module")
def reference(reward_model):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(reward_model, dtype=torch.float32).eval()

    def score(ids: list[int]) -> float:
        with torch.no_grad():  # one unpadded row: the head at the last token, whatever the pad id is
            hidden = model.base_model(torch.tensor([ids])).last_hidden_state[0, -1]
            return model.score(hidden).item()

    return score


def classify(server, expect: int = 200, **body) -> dict:
    response = httpx.post(f"{server.url}/classify", json=body, timeout=60)
    assert response.status_code == expect, response.text
    return response.json()


def test_scores_of_a_batch_equal_a_transformers_forward(rm_server, reference):
    inputs = [[1, 705, 201, 74, 75, 2, 201], [5, 6], list(range(10, 90)), [300, 301, 302, 2]]  # 2 = <|im_end|>
    body = classify(rm_server, input=inputs, use_activation=False)
    assert [row["index"] for row in body["data"]] == [0, 1, 2, 3]
    for ids, row in zip(inputs, body["data"], strict=True):
        assert row["num_classes"] == 1 and row["label"] == "reward"
        assert row["probs"][0] == pytest.approx(reference(ids), abs=1e-4)
    activated = classify(rm_server, input=inputs[:1])["data"][0]["probs"][0]  # default: sigmoid of one label
    assert activated == pytest.approx(torch.tensor(reference(inputs[0])).sigmoid().item(), abs=1e-5)
    assert body["usage"]["prompt_tokens"] == sum(len(i) for i in inputs)


def test_text_and_chat_inputs_are_rendered_by_the_models_tokenizer(rm_server, reference):
    ids = httpx.post(f"{rm_server.url}/tokenize", json={"messages": CONVERSATION, "add_generation_prompt": False},
                     timeout=30).json()["tokens"]  # fmt: skip
    chat = classify(rm_server, messages=CONVERSATION, use_activation=False)["data"][0]["probs"][0]
    assert chat == pytest.approx(reference(ids), abs=1e-4)
    text = httpx.post(f"{rm_server.url}/tokenize", json={"prompt": "hello there"}, timeout=30).json()["tokens"]
    v1 = httpx.post(f"{rm_server.url}/v1/classify", json={"input": "hello there", "activation": False}, timeout=30)
    assert v1.json()["data"][0]["probs"][0] == pytest.approx(reference(text), abs=1e-4)


@pytest.mark.parametrize(
    ("route", "body", "reason"),
    [
        ("/v1/chat/completions", {"messages": CONVERSATION}, "runner = pooling"),
        ("/v1/completions", {"prompt": "x"}, "runner = pooling"),
        ("/inference/v1/generate", {"token_ids": [1, 2]}, "runner = pooling"),
        ("/classify", {"input": "x", "messages": CONVERSATION}, "exactly one"),
        ("/classify", {"input": [[10**6]]}, "out of vocabulary"),
        ("/classify", {"input": "x", "truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
    ],
)
def test_what_a_reward_model_refuses(rm_server, route, body, reason):
    response = httpx.post(f"{rm_server.url}{route}", json={"model": rm_server.model_name, **body}, timeout=30)
    assert response.status_code == 400 and reason in response.json()["error"]["message"], response.text


def test_a_generative_server_refuses_classify(start_server):
    server = start_server("--run-id", "not-a-reward-model")
    response = httpx.post(f"{server.url}/classify", json={"input": "x"}, timeout=30)
    assert response.status_code == 400 and "runner pooling" in response.json()["error"]["message"]


def test_classify_requests_are_counted_under_endpoint_classify(rm_server):
    """A reward-model server's requests reach its metrics (they recorded nothing: its dashboards showed no
    traffic and the error-ratio alert could not see it fail)."""
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        text = httpx.get(f"{rm_server.url}/metrics", timeout=30).text
        return {(s.name, s.labels.get("endpoint"), s.labels.get("outcome")): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip

    before = scrape()
    classify(rm_server, input=[[1, 2, 3], [4, 5]])
    classify(rm_server, expect=400, input=[[]])
    after = scrape()
    assert after[("gyre_inference_requests_total", "classify", "success")] - before[
        ("gyre_inference_requests_total", "classify", "success")] == 1  # fmt: skip
    assert after[("gyre_inference_requests_total", "classify", "client_error")] - before[
        ("gyre_inference_requests_total", "classify", "client_error")] == 1  # fmt: skip
    assert after[("gyre_inference_prompt_tokens_total", None, None)] - before[
        ("gyre_inference_prompt_tokens_total", None, None)] == 5  # fmt: skip
