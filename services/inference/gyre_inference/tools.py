"""Hermes-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in model output.

Parsing is all-or-nothing, like vLLM's hermes parser: when every block is a JSON object with a string
`name` and an object `arguments`, and only whitespace sits between and after the blocks, the output
becomes `content` (the text before the first block) + `tool_calls`; otherwise it stays plain content.

Round-trip rule (multi-turn RL needs the next prompt to extend the sampled tokens): `arguments` is the
model's raw JSON text (not re-serialised), and the content drops the one newline the chat template
puts back between content and the first call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)
_ARGUMENTS_KEY = re.compile(r'"arguments"\s*:\s*')


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # raw JSON text of an object

    def to_openai(self) -> dict:
        return {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """Split model output into (content, tool calls); ([text], []) when it holds no well-formed calls."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return text, []
    calls: list[ParsedToolCall] = []
    position = start
    for match in _BLOCK.finditer(text, start):
        if text[position : match.start()].strip():
            return text, []  # prose between blocks: not a clean tool-call turn
        call = _parse_block(match.group(1))
        if call is None:
            return text, []
        calls.append(call)
        position = match.end()
    if not calls or text[position:].strip():
        return text, []  # an unterminated block, or prose after the calls
    content = text[:start]
    content = content[:-1] if content.endswith("\n") else content
    return (content or None), calls


def _parse_block(block: str) -> ParsedToolCall | None:
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    if set(value) - {"name", "arguments"} or not isinstance(value.get("arguments", {}), dict):
        return None
    return ParsedToolCall(value["name"], _raw_arguments(block, value.get("arguments", {})))


def _raw_arguments(block: str, parsed: dict) -> str:
    """The exact text of the `arguments` value inside `block` (falls back to re-serialising)."""
    decoder = json.JSONDecoder()
    for key in _ARGUMENTS_KEY.finditer(block):
        try:
            value, end = decoder.raw_decode(block, key.end())
        except ValueError:
            continue
        if value == parsed and re.fullmatch(r"\s*}\s*", block[end:]):
            return block[key.end() : end]
    return json.dumps(parsed, ensure_ascii=False)
