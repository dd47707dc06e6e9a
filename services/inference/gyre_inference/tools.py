"""Hermes-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in model output.

Parsing is all-or-nothing: when every block is a JSON object with a string `name` and an object `arguments`,
and only whitespace sits between and after the blocks, the output becomes `content` (the text before the first
block) + `tool_calls`; otherwise it stays plain content. Text before the first block must end in a newline: the
template always writes one between content and calls, so "text<tool_call>" as content + calls would re-render
"text\n<tool_call>" (drift); it stays plain content too. Stricter than vLLM's hermes parser, which also drops text
after the calls and parses a last block whose `</tool_call>` never came: either would make a message that does
not re-render the sampled tokens (the round-trip rule below).

`tool_choice` "required" or a named function constrains the output to such blocks with a grammar
(`forced_call_grammar`): only well-formed calls of the allowed tools, their arguments following each
tool's parameter schema.

Round-trip rule (multi-turn RL needs the next prompt to extend the sampled tokens): `arguments` is the
model's raw JSON text (not re-serialised), and the content drops the one newline the chat template
puts back between content and the first call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from gyre_inference.structured import with_json_options

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
    if content and not content.endswith("\n"):
        # "text<tool_call>": the template writes a newline between content and calls, so the message would
        # re-render "text\n<tool_call>", not the sampled tokens; the blocks stay text (environments parse them)
        return text, []
    content = content[:-1] if content.endswith("\n") else content
    return (content or None), calls


def cut_call(text: str, name: str) -> ParsedToolCall | None:
    """The call of the named (forced) tool in `text` that max_tokens cut short, as vLLM returns it for a named
    tool_choice: that name, and the arguments as far as they were written (their exact text when they were
    complete, else the partial JSON; empty when the cut came before them). None when `text` holds no call."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return None
    key = _ARGUMENTS_KEY.search(text, start)
    if key is None:
        return ParsedToolCall(name, "")
    try:
        _, end = json.JSONDecoder().raw_decode(text, key.end())
    except ValueError:
        return ParsedToolCall(name, text[key.end() :])
    return ParsedToolCall(name, text[key.end() : end])


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


def forced_call_grammar(tools: list[dict], *, parallel: bool, tags_are_tokens: bool) -> str:
    """A Lark grammar (llguidance's dialect) whose sentences are exactly hermes calls of `tools`: one call
    (`parallel` False) or several separated by newlines, each `<tool_call>\n{"name": N, "arguments": A}\n
    </tool_call>` with N one of the tools' names and A valid for that tool's parameter schema.

    `tags_are_tokens`: the tokenizer has `<tool_call>` / `</tool_call>` as added tokens (Qwen's have), which
    the model emits as one token each; the grammar then names those tokens (`<tool_call>` in Lark) instead
    of spelling the tag's characters, which a tokenizer never produces as separate pieces.
    """

    def literal(text: str) -> str:
        return json.dumps(text, ensure_ascii=False)

    start, end = (TOOL_CALL_START, TOOL_CALL_END) if tags_are_tokens else (literal(TOOL_CALL_START),
                                                                            literal(TOOL_CALL_END))  # fmt: skip
    rules = ["start: call" + (' ("\\n" call)*' if parallel else ""), ""]
    for i, tool in enumerate(tools):
        function = tool["function"]
        schema = with_json_options(function.get("parameters") or {"type": "object"})
        head = literal('\n{"name": ' + json.dumps(function["name"]) + ', "arguments": ')
        rules.append(f"call_{i}: {start} {head} args_{i} {literal('}' + chr(10))} {end}")
        rules.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    rules[1] = "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))
    return "\n".join(rules)
