"""Hermes tool-call parsing: well-formed blocks become tool calls, anything else stays text."""

from __future__ import annotations

import json

import pytest
from gyre_inference.tools import parse_tool_calls

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def test_a_single_call_with_raw_arguments_kept_verbatim():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"b":2,  "a": 1}}\n</tool_call>')
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [("add", '{"b":2,  "a": 1}')]
    openai = calls[0].to_openai()
    assert openai["type"] == "function" and openai["id"].startswith("call_")
    assert json.loads(openai["function"]["arguments"]) == {"a": 1, "b": 2}


def test_content_before_the_calls_drops_the_separator_newline_the_template_adds_back():
    content, calls = parse_tool_calls("Let me add.\n" + CALL + "\n" + CALL.replace('"a": 1', '"a": 5') + "\n")
    assert content == "Let me add."
    assert [json.loads(c.arguments) for c in calls] == [{"a": 1, "b": 2}, {"a": 5, "b": 2}]


def test_missing_arguments_means_an_empty_object():
    _, calls = parse_tool_calls('<tool_call>{"name": "now"}</tool_call>')
    assert calls[0].name == "now" and json.loads(calls[0].arguments) == {}


@pytest.mark.parametrize(
    "text",
    [
        "no calls at all",
        '<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>',  # invalid JSON
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}',  # never closed
        '<tool_call>["add"]</tool_call>',  # not an object
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',  # empty name
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "add", "arguments": {}, "extra": 1}</tool_call>',  # unknown key
        CALL + " and some prose after",  # prose after the calls
        CALL + " prose between " + CALL,  # prose between the calls
        CALL + '\n<tool_call>{"name": "add", "arguments": {"a": }</tool_call>',  # one bad block spoils all
    ],
)
def test_malformed_output_stays_plain_content(text):
    assert parse_tool_calls(text) == (text, [])


def test_parsed_calls_re_render_to_the_same_text_through_the_chat_template(model_text):
    """Multi-turn bookkeeping: the assistant message built from the parse renders the sampled text."""
    generated = "Sure.\n" + '<tool_call>\n{"name": "add", "arguments": {"a": 1,  "b": 2}}\n</tool_call>'
    content, calls = parse_tool_calls(generated)
    message = {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}
    rendered = model_text.render_chat([{"role": "user", "content": "hi"}, message], None, add_generation_prompt=False)
    assert generated + "<|im_end|>" in rendered


def test_a_call_right_after_prose_stays_text_so_the_message_re_renders_as_sampled(model_text):
    """A reply "Sure.<tool_call>" (no newline): as content "Sure." + calls the template renders "Sure.\\n<tool_call>",
    not the sampled text, so the next turn's prompt would not extend it (drift); as plain text it renders back."""
    generated = "Sure." + '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    content, calls = parse_tool_calls(generated)
    assert (content, calls) == (generated, [])
    message = {"role": "assistant", "content": content}
    rendered = model_text.render_chat([{"role": "user", "content": "hi"}, message], None, add_generation_prompt=False)
    assert generated + "<|im_end|>" in rendered
