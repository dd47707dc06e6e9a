"""The environments' messages against the REAL tokenizer and chat template of `gyre model init` (no model, no torch).

`TemplateClient` is a test double for the inference server's bookkeeping only: it renders each prompt with the
real chat template (as the server does) and "samples" the reference reply's tokens. Playing every built-in's SFT
example through `env.rollout` must then (1) never drift, (2) give exactly the tokens the template produces for the
whole conversation, and (3) put the loss mask exactly on the template's assistant tokens (what SFT trains on).
That ties the environments' message format, the training-sequence rule and the chat template together.
"""

from __future__ import annotations

import json

import pytest
from gyre.envs import Messages, SamplingParams, ToolCall, Turn, load_environment

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer():
    from gyre.tiny_tokenizer import build_tokenizer

    return build_tokenizer(1024)


def canonical_call(call: dict) -> str:
    fn = call["function"]
    return '<tool_call>\n{"name": ' + json.dumps(fn["name"]) + ', "arguments": ' + fn["arguments"] + "}\n</tool_call>"


class TemplateClient:
    def __init__(self, tokenizer, replies: list[dict], server_parses_calls: bool) -> None:
        self.tokenizer, self.replies, self.server_parses_calls = tokenizer, replies, server_parses_calls
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def chat(self, messages: Messages, *, tools=None, sampling: SamplingParams) -> Turn:
        prompt = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_dict=True)
        reply = self.replies.pop(0)
        calls = reply.get("tool_calls") or []
        sampled = reply["content"] + ("\n" if reply["content"] and calls else "")
        sampled += "\n".join(canonical_call(c) for c in calls)
        completion = self.tokenizer.encode(sampled) + [self.im_end]
        if self.server_parses_calls:
            text, tool_calls = reply["content"], [ToolCall.from_openai(c) for c in calls]
        else:
            text, tool_calls = sampled, []
        return Turn(
            prompt_token_ids=list(prompt["input_ids"]),
            completion_token_ids=completion,
            completion_logprobs=[-0.5] * len(completion),
            text=text,
            tool_calls=tool_calls,
        )


@pytest.mark.asyncio
@pytest.mark.parametrize("server_parses_calls", [True, False])
@pytest.mark.parametrize("name", ["reverse_text", "arithmetic", "alphabet_sort", "calculator", "code"])
async def test_reference_conversations_splice_exactly(tokenizer, name, server_parses_calls):
    env = load_environment(name, **({"num_rounds": 3} if name == "alphabet_sort" else {}))
    for task in list(env.tasks("eval"))[:5]:
        reference = env.sft_example(task)
        replies = [m for m in reference if m["role"] == "assistant"]
        client = TemplateClient(tokenizer, list(replies), server_parses_calls)
        rollout = await env.rollout(client, task, SamplingParams())
        assert rollout.stop_reason == "done" and rollout.sequence_turns == rollout.num_turns == len(replies)
        full = tokenizer.apply_chat_template(
            reference, tools=env.tool_schemas, return_dict=True, return_assistant_tokens_mask=True
        )
        # The template ends the conversation with "\n" after the last <|im_end|>; the model never samples it.
        n = len(rollout.token_ids)
        assert full["input_ids"][:n] == rollout.token_ids and len(full["input_ids"]) == n + 1
        assert [bool(m) for m in full["assistant_masks"][:n]] == rollout.loss_mask
        assert (await env.score(task, rollout)).reward == pytest.approx(sum(env.rubric.weights))


@pytest.mark.asyncio
@pytest.mark.parametrize("content", ["Let me compute.\n", "Let me compute.\n\n", "Let me compute."])
async def test_a_reply_ending_in_blank_lines_before_its_call_splices_exactly(tokenizer, content):
    """The template renders content, a newline, the call: a reply that sampled a blank line (or two) before its call
    gets its content back with those newlines (Gyre's server returns it less the template's one), and the next turn's
    prompt extends the sampled tokens. Old code stripped every trailing newline: such a sample drifted."""
    env = load_environment("calculator")
    task = env.tasks("eval")[0]
    reference = env.sft_example(task)
    reference[2]["content"] = content  # the call turn, with prose before its call
    replies = [m for m in reference if m["role"] == "assistant"]
    rollout = await env.rollout(TemplateClient(tokenizer, replies, server_parses_calls=True), task, SamplingParams())
    assert rollout.stop_reason == "done" and rollout.sequence_turns == 2
    full = tokenizer.apply_chat_template(reference, tools=env.tool_schemas, return_dict=True)
    assert full["input_ids"][: len(rollout.token_ids)] == rollout.token_ids
    assert rollout.completion[0]["content"] == content
