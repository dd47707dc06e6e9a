"""Tool calling: tools are plain Python functions; the model calls them, the results come back as `tool` messages.

    def calculator(expression: str) -> str:
        '''Evaluate an arithmetic expression.

        Args:
            expression: e.g. "3 * (4 + 5)"
        '''

    env = ToolEnv(tools=[calculator], ...)

The JSON schema of a tool's arguments is derived from its signature (type hints) and docstring (first paragraph
= description, Google-style `Args:` = argument descriptions), or declared with `Tool(name, function, schema)`.
Calls are read from the assistant message's structured `tool_calls`, or from `<tool_call>{json}</tool_call>`
blocks in its text when the server returned raw text. A turn without tool calls ends the episode (the model
answered). A tool never crashes a rollout: unknown tools, bad arguments, exceptions and timeouts all become an
`Error: ...` tool message the model can react to.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gyre.envs.base import MultiTurnEnv
from gyre.envs.parsers import message_text, parse_tool_calls
from gyre.envs.types import Message, Messages, ToolCall

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object"}


@dataclass(frozen=True)
class Tool:
    """A callable the model may use. `schema` is the OpenAI function schema sent to the server."""

    name: str
    function: Callable[..., Any]
    schema: dict[str, Any]

    @classmethod
    def from_function(
        cls,
        function: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        parameters: dict[str, Any] | None = None,
    ) -> Tool:
        name = name or function.__name__
        doc_description, arg_docs = _parse_docstring(inspect.getdoc(function) or "")
        schema = {
            "type": "function",
            "function": {
                "name": name,
                "description": description if description is not None else doc_description,
                "parameters": parameters if parameters is not None else _parameters_schema(function, arg_docs),
            },
        }
        return cls(name=name, function=function, schema=schema)

    async def call(self, arguments: dict[str, Any], timeout: float | None = None) -> str:
        """Run the tool; raises TypeError for arguments that do not fit its signature."""
        inspect.signature(self.function).bind(**arguments)
        result = self.function(**arguments)
        if inspect.isawaitable(result):
            async with asyncio.timeout(timeout):  # not wait_for: on Python 3.11 it can lose a cancellation
                result = await result
        # anything JSON cannot hold (a date, a Decimal, a set, a dataclass) as its str: json.dumps raised, and a
        # tool that had run was told to the model (and to state["tool_calls"]) as an error
        return result if isinstance(result, str) else json.dumps(result, default=_as_text)


def _as_text(value: Any) -> Any:
    return sorted(value, key=repr) if isinstance(value, set | frozenset) else str(value)


class ToolEnv(MultiTurnEnv):
    """Multi-turn environment whose replies are tool results.

    Args: `tools` (functions or `Tool`s), `max_turns` (model turns, tool-calling ones included),
    `max_tool_calls` per model turn, `max_tool_output_chars` (longer results and errors are cut, keeping contexts
    short),
    `tool_timeout` seconds for async tools (sync tools run inline on the event loop: keep them fast).
    Each executed call is recorded in `state["tool_calls"]` as `{"turn", "name", "arguments", "ok", "result"}`.
    """

    def __init__(
        self,
        *,
        tools: list[Callable[..., Any] | Tool],
        max_turns: int = 4,
        max_tool_calls: int = 4,
        max_tool_output_chars: int = 1000,
        tool_timeout: float = 10.0,
        **kwargs: Any,
    ) -> None:
        self.tools = {t.name: t for t in (t if isinstance(t, Tool) else Tool.from_function(t) for t in tools)}
        if len(self.tools) != len(tools):
            raise ValueError("tool names must be unique")
        super().__init__(max_turns=max_turns, tool_schemas=[t.schema for t in self.tools.values()], **kwargs)
        self.max_tool_calls = max_tool_calls
        self.max_tool_output_chars = max_tool_output_chars
        self.tool_timeout = tool_timeout

    def initial_state(self, task):  # type: ignore[no-untyped-def]
        return super().initial_state(task) | {"tool_calls": []}

    async def env_response(self, messages: Messages, state: dict[str, Any]) -> tuple[Messages, bool]:
        calls = tool_calls_of(messages[-1], id_prefix=f"call_{state['turn']}")
        if not calls:
            return [], True
        replies: Messages = []
        for i, call in enumerate(calls):
            if i >= self.max_tool_calls:
                result, ok = f"Error: at most {self.max_tool_calls} tool calls per turn", False
            else:
                result, ok = await self.run_tool(call)
            state["tool_calls"].append(
                {"turn": state["turn"], "name": call.name, "arguments": call.arguments, "ok": ok, "result": result}
            )
            replies.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return replies, False

    async def run_tool(self, call: ToolCall) -> tuple[str, bool]:
        """Execute one call; returns (text for the model, whether the tool ran successfully).

        The text, an error's included, is cut at `max_tool_output_chars`: errors echo model-written text (an
        unknown tool's name, an unexpected argument), which must not outgrow the context either.
        """
        result, ok = await self._run_tool(call)
        if len(result) > self.max_tool_output_chars:
            result = result[: self.max_tool_output_chars] + "...[truncated]"
        return result, ok

    async def _run_tool(self, call: ToolCall) -> tuple[str, bool]:
        tool = self.tools.get(call.name)
        if call.error:
            return f"Error: {call.error}", False
        if tool is None:
            return f"Error: unknown tool {call.name!r}; available: {', '.join(self.tools)}", False
        try:
            result = await tool.call(call.arguments, timeout=self.tool_timeout)
        except TimeoutError:
            return f"Error: {call.name} timed out after {self.tool_timeout}s", False
        except Exception as exc:  # the model sees the failure and can retry; the rollout goes on
            return f"Error: {type(exc).__name__}: {exc}", False
        return result, True


def tool_calls_of(message: Message, id_prefix: str = "call") -> list[ToolCall]:
    """Tool calls of an assistant message: its structured `tool_calls`, else `<tool_call>` blocks in its text."""
    if message.get("role") != "assistant":
        return []
    if message.get("tool_calls"):
        calls = []
        for i, raw in enumerate(message["tool_calls"]):
            try:
                calls.append(ToolCall.from_openai(raw))
            except (ValueError, AttributeError, TypeError) as exc:
                calls.append(ToolCall(id=f"{id_prefix}_{i}", name="", error=f"malformed tool call: {exc}"))
        return calls
    return parse_tool_calls(message_text(message), id_prefix=id_prefix)


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description = first paragraph, {argument: description} from a Google-style `Args:` section)."""
    description = doc.split("\n\n", 1)[0].strip()
    args: dict[str, str] = {}
    match = re.search(r"^(?:Args|Arguments|Parameters):\s*\n(.*?)(?:\n\s*\n|\Z)", doc, re.MULTILINE | re.DOTALL)
    if match:
        current = None
        for line in match.group(1).splitlines():
            entry = re.match(r"\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)", line)
            if entry:
                current = entry.group(1)
                args[current] = entry.group(2).strip()
            elif current and line.strip():
                args[current] += " " + line.strip()
    return description, args


def _parameters_schema(function: Callable[..., Any], arg_docs: dict[str, str]) -> dict[str, Any]:
    hints = typing.get_type_hints(function)
    properties: dict[str, Any] = {}
    required = []
    for param in inspect.signature(function).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise ValueError(f"tool {function.__name__}: parameter {param.name!r} must be a plain keyword argument")
        prop = _type_schema(hints.get(param.name, Any))
        if param.name in arg_docs:
            prop["description"] = arg_docs[param.name]
        properties[param.name] = prop
        if param.default is param.empty:
            required.append(param.name)
    return {"type": "object", "properties": properties, "required": required}


def _type_schema(hint: Any) -> dict[str, Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        return _type_schema(options[0]) if len(options) == 1 else {"anyOf": [_type_schema(a) for a in options]}
    if hint is list or origin is list:
        return {"type": "array", "items": _type_schema(args[0])} if args else {"type": "array"}
    if origin is dict:
        return {"type": "object"}
    return {}
