"""The reasoning of an earlier reply in a chat request, over real HTTP with the official `openai` client.

vLLM clients (verifiers, agent loops) send an assistant message back with vLLM's `reasoning_content` (newer vLLM:
`reasoning`). The server refused both as unknown fields; it now hands them to the chat template as vLLM does, so a
Qwen3-style template renders them, while a template that does not read them renders the content alone: the prompt
Gyre's own client builds (the sampled text as content) is still exactly what was sampled.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from gyre_orchestrator.client import parse_turn
from support.models import qwen3_templated
from transformers import AutoTokenizer

REASONING = "one and two make three"
# a tool turn: Qwen3's template renders an assistant message's reasoning only after the last user message
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
QUESTION = {"role": "user", "content": "What is 1 plus 2?"}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "3"}


@pytest.fixture(scope="module")
def qwen3_model(tiny_model, tmp_path_factory) -> Path:
    return qwen3_templated(tmp_path_factory, tiny_model)


@pytest.fixture(scope="module")
def qwen3_client(start_server, qwen3_model):
    server = start_server("--engine.max-model-len", "256", "--run-id", "reasoning-tests", model_path=qwen3_model)
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def prompt_text(client, model_path, messages) -> str:
    model = client.models.list().data[0].id
    response = client.chat.completions.create(model=model, messages=messages, max_tokens=1,
                                              extra_body={"return_token_ids": True})  # fmt: skip
    return AutoTokenizer.from_pretrained(model_path).decode(response.model_extra["prompt_token_ids"])


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_an_assistant_message_s_reasoning_reaches_a_qwen3_template(qwen3_client, qwen3_model, field):
    reply = {"role": "assistant", "content": "", "tool_calls": [CALL], field: REASONING}
    prompt = prompt_text(qwen3_client, qwen3_model, [QUESTION, reply, RESULT])
    assert f"<|im_start|>assistant\n<think>\n{REASONING}\n</think>\n\n<tool_call>" in prompt, prompt


def test_both_names_with_different_values_are_refused_naming_the_field(qwen3_client):
    reply = {"role": "assistant", "content": "", "tool_calls": [CALL], "reasoning": "a", "reasoning_content": "b"}
    with pytest.raises(openai.BadRequestError) as refused:
        qwen3_client.chat.completions.create(model="any", messages=[QUESTION, reply, RESULT], max_tokens=1)
    error = refused.value.body
    assert error["param"] == "messages.1.reasoning" and "differ" in error["message"], error


def test_history_from_gyre_s_client_is_what_was_sampled_on_a_template_without_reasoning(client, tool_model):
    """The shared server's template (gyre model init's) does not read reasoning: a reply sent back with it renders
    its content only, and the history Gyre's client sends (the sampled text as content) extends the last prompt by
    exactly the sampled tokens."""
    model = client.models.list().data[0].id
    first = client.chat.completions.create(model=model, messages=[QUESTION], max_tokens=8, logprobs=True, temperature=0,
                                           extra_body={"return_token_ids": True})  # fmt: skip
    turn = parse_turn(first.model_dump(), None, None)
    sampled = turn.prompt_token_ids + turn.completion_token_ids
    for reasoning in ({}, {"reasoning_content": REASONING}):
        history = [QUESTION, {**turn.assistant_message(), **reasoning}, {"role": "user", "content": "Again."}]
        second = client.chat.completions.create(model=model, messages=history, max_tokens=1,
                                                extra_body={"return_token_ids": True})  # fmt: skip
        assert second.model_extra["prompt_token_ids"][: len(sampled)] == sampled
        assert REASONING not in AutoTokenizer.from_pretrained(tool_model).decode(second.model_extra["prompt_token_ids"])
