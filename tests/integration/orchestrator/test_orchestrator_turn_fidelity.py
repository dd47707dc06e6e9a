"""A tool-call reply that ends in a blank line before its call, end to end: real `gyre inference` replica, real
chat template, the orchestrator's `InferenceClient` and `ToolEnv`.

The tiny model is taught (a few seconds) to answer the calculator task with "Let me compute." then a blank line,
then the call. The server returns the content less the newline the chat template writes back before the call;
the assistant message sent with the next turn must keep the other one, or the next prompt no longer extends the
sampled tokens and the sample is cut after its first turn (stop_reason drift).
"""

from __future__ import annotations

import pytest
from gyre.envs import SamplingParams, load_environment
from gyre_orchestrator.client import InferenceClient, close_replica_clients
from gyre_orchestrator.replicas import Endpoint, ReplicaSet
from support.models import teach

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300), pytest.mark.slow]

PROSE = "Let me compute.\n"  # the content the template renders as "Let me compute.\n\n<tool_call>..."


@pytest.fixture(scope="module")
def blank_line_model(tiny_model, tmp_path_factory):
    import torch
    from transformers import AutoTokenizer

    path = tmp_path_factory.getbasetemp() / "orchestrator-blank-line-model"
    env = load_environment("calculator")
    messages = env.sft_example(env.tasks("train", seed=0)[0])
    messages[2]["content"] = PROSE
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    enc = tokenizer.apply_chat_template(
        messages, tools=env.tool_schemas, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids = torch.tensor([enc["input_ids"]])
    labels = torch.where(torch.tensor([enc["assistant_masks"]], dtype=torch.bool), ids, -100)
    return teach(tiny_model, path, ids, labels, max_steps=600)


async def test_a_blank_line_before_a_call_keeps_the_sequence_whole(start_replica, blank_line_model):
    replica = start_replica(model=blank_line_model)
    rollout = await _calculator_rollout(replica)
    first = rollout.turns[0]
    assert first.tool_calls and first.text == PROSE  # the server dropped the template's newline, kept the other
    assert rollout.stop_reason == "done" and rollout.sequence_turns == rollout.num_turns == 2
    assert rollout.completion[0]["content"] == PROSE
    # the second prompt extends the first turn's tokens, so the training sequence is both turns, whole
    sequence = first.prompt_token_ids + first.completion_token_ids
    assert rollout.turns[1].prompt_token_ids[: len(sequence)] == sequence


GLUED = "Let me compute."  # sampled right before "<tool_call>", no newline between


@pytest.fixture(scope="module")
def glued_call_model(tiny_model, tmp_path_factory):
    """Taught to reply "Let me compute.<tool_call>...": a text the template cannot write (it puts a newline
    between content and calls), so the sample is the template's rendering with that newline taken out."""
    import torch
    from transformers import AutoTokenizer

    path = tmp_path_factory.getbasetemp() / "orchestrator-glued-call-model"
    env = load_environment("calculator")
    messages = env.sft_example(env.tasks("train", seed=0)[0])
    messages[2]["content"] = GLUED
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    schemas = env.tool_schemas
    prompt_text = tokenizer.apply_chat_template(messages[:2], tools=schemas, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    text = tokenizer.apply_chat_template(messages[:3], tools=env.tool_schemas, tokenize=False)
    assert GLUED + "\n<tool_call>" in text
    text = text.replace(GLUED + "\n<tool_call>", GLUED + "<tool_call>")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[: len(prompt)] == prompt
    labels = [-100] * len(prompt) + ids[len(prompt) :]
    return teach(tiny_model, path, torch.tensor([ids]), torch.tensor([labels]), max_steps=600)


async def test_a_call_glued_to_its_prose_keeps_the_sequence_whole(start_replica, glued_call_model):
    replica = start_replica(model=glued_call_model)
    rollout = await _calculator_rollout(replica)
    first = rollout.turns[0]
    # the environment ran the call it read from the text (the untaught second turn may run to max_tokens), and
    # the second prompt extends the first turn's tokens: no drift, both turns trained
    assert [m["role"] for m in rollout.completion][:2] == ["assistant", "tool"]
    assert rollout.stop_reason != "drift" and rollout.sequence_turns == rollout.num_turns == 2
    assert first.text.startswith(GLUED + "<tool_call>") and not first.tool_calls  # sampled as taught, left as text
    sequence = first.prompt_token_ids + first.completion_token_ids
    assert rollout.turns[1].prompt_token_ids[: len(sequence)] == sequence


async def _calculator_rollout(replica):
    """The calculator task a model was taught, rolled out greedily through the orchestrator's client."""
    env = load_environment("calculator")
    task = env.tasks("train", seed=0)[0]
    replicas = ReplicaSet([Endpoint(replica.url, replica.control)])
    client = InferenceClient(replicas, timeout_s=60)
    try:
        return await env.rollout(client, task, SamplingParams(temperature=0, max_tokens=48))
    finally:
        await close_replica_clients(list(replicas))
