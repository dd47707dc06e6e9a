"""`parse_turn`: the token-level record of one OpenAI chat completion with gyre's extras."""

from __future__ import annotations

import pytest
from gyre_orchestrator.client import BadResponse, parse_turn


def completion(**choice_extra) -> dict:
    choice = {
        "index": 0,
        "finish_reason": "stop",
        "message": {"role": "assistant", "content": "olleh"},
        "logprobs": {
            "content": [
                {"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in (("ol", -0.5), ("leh", -0.25), ("<|im_end|>", -0.1))
            ]
        },  # fmt: skip
        "token_ids": [11, 12, 2],
        **choice_extra,
    }
    top = {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "prompt_token_ids": [1, 5, 6, 7]}
    return {**top, "choices": [choice]}


def test_turn_from_a_completion_with_versions():
    turn = parse_turn(completion(policy_version_min=3, policy_version_max=4), fallback_version=None)
    assert turn.prompt_token_ids == [1, 5, 6, 7]
    assert turn.completion_token_ids == [11, 12, 2]
    assert turn.completion_logprobs == [-0.5, -0.25, -0.1]
    assert (turn.policy_version_min, turn.policy_version_max, turn.text) == (3, 4, "olleh")


def test_version_falls_back_to_the_replicas_known_version():
    assert parse_turn(completion(), fallback_version=2).policy_version_max == 2
    turn = parse_turn(completion(), fallback_version=4, sent_version=3)  # swapped while it generated
    assert (turn.policy_version_min, turn.policy_version_max) == (3, 4)
    with pytest.raises(BadResponse, match="no policy version"):
        parse_turn(completion(), None)


def test_tool_calls_are_kept():
    call = {"id": "c0", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1+2"}'}}
    body = completion(policy_version_min=0, policy_version_max=0)
    body["choices"][0]["message"]["tool_calls"] = [call]
    (parsed,) = parse_turn(body, None).tool_calls
    assert (parsed.name, parsed.arguments, parsed.raw_arguments) == (
        "calculator",
        {"expression": "1+2"},
        '{"expression": "1+2"}',
    )


def test_responses_that_cannot_be_trained_on_are_rejected():
    with pytest.raises(BadResponse, match="lacks prompt_token_ids"):
        parse_turn(completion(token_ids=None), 0)
    with pytest.raises(BadResponse, match="2 log-probs for 3"):
        parse_turn(completion(token_ids=[1, 2, 3], logprobs={"content": [
            {"token": "a", "logprob": -1.0, "bytes": None, "top_logprobs": []},
            {"token": "b", "logprob": -1.0, "bytes": None, "top_logprobs": []}]}), 0)  # fmt: skip
    with pytest.raises(BadResponse, match="no choices"):
        parse_turn({"choices": []}, 0)
    with pytest.raises(BadResponse, match="log-probabilities"):
        parse_turn(completion(logprobs={"content": [{"logprob": 0.5}, {"logprob": -1}, {"logprob": -1}]}), 0)


def sampled(tokens: list[str], message: dict) -> dict:
    """A completion whose sampled tokens are `tokens` (log-prob entries with their bytes, as vLLM and Gyre send)."""
    body = completion(policy_version_min=0, policy_version_max=0, token_ids=list(range(len(tokens))))
    body["choices"][0]["message"] = {"role": "assistant", **message}
    body["choices"][0]["logprobs"] = {"content": [
        {"token": t, "logprob": -0.5, "bytes": list(t.encode()), "top_logprobs": []} for t in tokens]}  # fmt: skip
    return body


CALL = {"id": "c0", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1+2"}'}}
# a reply with a blank line before its call: the chat template writes content + "\n" + the call block
BLANK_LINE_CALL = ["Let me", " compute.", "\n\n", "<tool_call>", '\n{"name": "calculator", "arguments": '
                   '{"expression": "1+2"}}\n', "</tool_call>", "<|im_end|>"]  # fmt: skip


@pytest.mark.parametrize(
    "server_content",
    [
        "Let me compute.\n\n",  # vLLM's hermes parser (recorded shape): the text before the first block, verbatim
        "Let me compute.\n",  # Gyre's server: less the newline the template writes back
    ],
)
def test_a_tool_call_replys_content_re_renders_the_sampled_newlines(server_content):
    """Both servers' answers give the content the template turns back into the sampled text: one newline before
    the call (old code stripped every trailing newline: the next prompt had one newline where two were sampled)."""
    turn = parse_turn(sampled(BLANK_LINE_CALL, {"content": server_content, "tool_calls": [CALL]}), None)
    message = turn.assistant_message()
    assert message["content"] == "Let me compute.\n"
    assert message["tool_calls"][0]["function"]["arguments"] == '{"expression": "1+2"}'


def test_content_stays_as_sent_where_the_sampled_tokens_say_nothing():
    """No log-prob bytes or tokens, or a call format without hermes blocks: the server's content, verbatim."""
    body = sampled(BLANK_LINE_CALL, {"content": "Let me compute.\n", "tool_calls": [CALL]})
    body["choices"][0]["logprobs"]["content"] = [{"logprob": -0.5} for _ in BLANK_LINE_CALL]
    assert parse_turn(body, None).assistant_message()["content"] == "Let me compute.\n"
    mistral = ["Sure.", "\n", "[TOOL_CALLS]", '[{"name": "calculator"}]', "</s>"]
    turn = parse_turn(sampled(mistral, {"content": "Sure.\n", "tool_calls": [CALL]}), None)
    assert turn.assistant_message()["content"] == "Sure.\n"


# vLLM with --reasoning-parser qwen3 (recorded shapes): the <think> block's inside apart, the rest as content;
# vLLM < 0.11 names the field reasoning_content, later versions reasoning
THINK = ["<think>", "\n", "1+2 is 3", "\n", "</think>", "\n\n", "It is 3.", "<|im_end|>"]


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_reasoning_returned_apart_goes_back_into_the_reply_as_sampled(field):
    """The thinking the model sampled stays in the reply: in `text` (rubrics and parsers see it as without the
    parser) and in the message the next turn's prompt renders (old code dropped it: the history lacked it)."""
    turn = parse_turn(sampled(THINK, {"content": "\n\nIt is 3.", field: "\n1+2 is 3\n"}), None)
    assert turn.text == "<think>\n1+2 is 3\n</think>\n\nIt is 3."
    assert turn.reasoning is None
    assert turn.assistant_message() == {"role": "assistant", "content": "<think>\n1+2 is 3\n</think>\n\nIt is 3."}


def test_reasoning_after_a_think_the_template_opened_and_with_a_tool_call():
    """A generation prompt that opens the block (the model samples no <think>) is not given one; a tool call
    after the thinking keeps the content rule."""
    tokens = THINK[1:6] + ["Calling.", "\n", *BLANK_LINE_CALL[3:]]
    body = sampled(tokens, {"content": "\n\nCalling.\n", "reasoning_content": "\n1+2 is 3\n", "tool_calls": [CALL]})
    turn = parse_turn(body, None)
    assert turn.text == "\n1+2 is 3\n</think>\n\nCalling."
    assert turn.assistant_message()["content"] == "\n1+2 is 3\n</think>\n\nCalling."


def test_reasoning_not_in_think_tags_is_sent_back_as_reasoning_content():
    """Another parser's format (no </think> sampled): the content as text, the reasoning kept apart and sent back in
    the field chat templates read."""
    tokens = ["analysis", " hmm", "final", " It is 3.", "<|im_end|>"]
    turn = parse_turn(sampled(tokens, {"content": "It is 3.", "reasoning": "hmm"}), None)
    assert (turn.text, turn.reasoning) == ("It is 3.", "hmm")
    assert turn.assistant_message() == {"role": "assistant", "content": "It is 3.", "reasoning_content": "hmm"}
