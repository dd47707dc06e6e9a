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
