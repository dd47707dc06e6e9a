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
answered); calls on the last turn the budget allows are not run (nothing would read their results). A tool never
crashes a rollout: unknown tools, bad arguments, exceptions and timeouts all become an
`Error: ...` tool message the model can react to.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gyre.envs.base import MultiTurnEnv
from gyre.envs.parsers import message_text, parse_tool_calls, strip_reasoning
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
        if state["turn"] >= self.max_turns:
            # The turn budget is spent: no model turn would read the results, so the calls are not run (nor put in
            # state["tool_calls"]), as in verifiers, which asks `is_completed` (max_turns) before `env_response`.
            # Run, they were credited (calculator's used_calculator) for a call whose answer never came.
            return [], False
        replies: Messages = []
        for i, call in enumerate(calls):
            if i >= self.max_tool_calls:
                result, ok = f"Error: at most {self.max_tool_calls} tool calls per turn", False
            else:
                result, ok = await self.run_tool(await self.prepare_call(call, messages, state))
            state["tool_calls"].append(
                {"turn": state["turn"], "name": call.name, "arguments": call.arguments, "ok": ok, "result": result}
            )
            replies.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return replies, False

    async def prepare_call(self, call: ToolCall, messages: Messages, state: dict[str, Any]) -> ToolCall:
        """The call as it is run (`StatefulToolEnv` fills arguments from the rollout's state); `state["tool_calls"]`
        records it as the model made it."""
        return call

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


class StatefulToolEnv(ToolEnv):
    """verifiers' `StatefulToolEnv` (0.1-0.3): a `ToolEnv` whose tools take arguments the model never sees, filled
    from the rollout's state (a sandbox id, a connection, a per-task secret):

        class SandboxEnv(vf.StatefulToolEnv):
            def __init__(self, **kwargs):
                super().__init__(tools=[], **kwargs)
                self.add_tool(run_code, args_to_skip=["sandbox_id"])   # not in the schema the model gets

            def update_tool_args(self, tool_name, tool_args, messages, state, **kwargs) -> dict:
                if tool_name == "run_code":
                    tool_args["sandbox_id"] = state["sandbox_id"]
                return tool_args

    `add_tool(tool, args_to_skip=[...])` removes those arguments from the tool's schema (properties and required);
    each parsed call's arguments pass through `update_tool_args` (verifiers 0.1.3-0.1.4's
    `update_tool_args(tool_args, messages, state)` too; sync or async) before the tool runs. A value the model
    writes for a skipped argument anyway is dropped before `update_tool_args` sees it: only the environment sets it
    (an `update_tool_args` that fills it only when missing let the model choose another rollout's sandbox).
    `state["tool_calls"]` records the call as the model made it, without the values filled in.
    """

    def __init__(self, *, tools: list[Callable[..., Any] | Tool] | None = None, **kwargs: Any) -> None:
        if type(self).update_tool_args is StatefulToolEnv.update_tool_args:
            raise TypeError(f"{type(self).__name__}: a StatefulToolEnv defines update_tool_args(self, tool_name, "
                            "tool_args, messages, state, **kwargs) -> dict (the arguments to call the tool "
                            "with)")  # fmt: skip
        super().__init__(tools=list(tools or []), **kwargs)
        self.skipped_args: dict[str, list[str]] = {name: [] for name in self.tools}
        positional = [p for p in inspect.signature(self.update_tool_args).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]  # fmt: skip
        # verifiers 0.1.3-0.1.4 called update_tool_args(tool_args, messages, state); 0.1.5 on adds tool_name first
        self._with_name = len(positional) >= 4 or any(p.name == "tool_name" for p in positional)

    def add_tool(self, tool: Callable[..., Any] | Tool, args_to_skip: list[str] | tuple[str, ...] = ()) -> None:
        """Offer `tool` to the model, without the arguments named in `args_to_skip` (`update_tool_args` gives
        them); ValueError for a name the tool does not take (a typo left the argument in the model's schema)."""
        made = tool if isinstance(tool, Tool) else Tool.from_function(tool)
        if made.name in self.tools:
            raise ValueError(f"add_tool: a tool named {made.name!r} is already in this environment")
        if isinstance(args_to_skip, str):  # args_to_skip="sandbox_id" skipped its letters
            args_to_skip = [args_to_skip]
        params = inspect.signature(made.function).parameters
        unknown = [arg for arg in args_to_skip if arg not in params]
        if unknown:
            raise ValueError(f"add_tool({made.name}): args_to_skip {unknown} are not parameters of the tool "
                             f"(it takes {list(params)})")  # fmt: skip
        schema = copy.deepcopy(made.schema)
        parameters = schema["function"].get("parameters") or {}
        for arg in args_to_skip:
            if isinstance(parameters.get("properties"), dict):
                parameters["properties"].pop(arg, None)
            if isinstance(parameters.get("required"), list) and arg in parameters["required"]:
                parameters["required"].remove(arg)
        self.tools[made.name] = Tool(name=made.name, function=made.function, schema=schema)
        self.skipped_args[made.name] = list(args_to_skip)
        self.tool_schemas = [t.schema for t in self.tools.values()]

    def remove_tool(self, tool: Callable[..., Any] | Tool | str) -> None:
        """Withdraw a tool (by itself or its name) from the model's schemas and from the calls it may make."""
        name = tool if isinstance(tool, str) else getattr(tool, "name", getattr(tool, "__name__", None))
        if name not in self.tools:
            raise ValueError(f"remove_tool: no tool named {name!r} (tools: {', '.join(self.tools)})")
        del self.tools[name]
        self.skipped_args.pop(name, None)
        self.tool_schemas = [t.schema for t in self.tools.values()]

    def update_tool_args(
        self, tool_name: str, tool_args: dict[str, Any], messages: Messages, state: dict[str, Any], **kwargs: Any
    ) -> dict[str, Any]:
        """The arguments to call `tool_name` with: the model's (`tool_args`, skipped ones dropped) with what the
        rollout's state gives; a subclass defines it (checked at construction)."""
        raise NotImplementedError

    async def prepare_call(self, call: ToolCall, messages: Messages, state: dict[str, Any]) -> ToolCall:
        if call.error:  # not parsed: the model is told why; there are no arguments to fill
            return call
        skipped = self.skipped_args.get(call.name, [])
        arguments = {key: value for key, value in call.arguments.items() if key not in skipped}
        if self._with_name:
            updated = self.update_tool_args(call.name, arguments, messages, state)
        else:
            updated = self.update_tool_args(arguments, messages, state)  # type: ignore[call-arg]
        if inspect.isawaitable(updated):
            updated = await updated
        if not isinstance(updated, dict):  # forgetting `return tool_args` called every tool with nothing
            raise TypeError(f"update_tool_args must return the arguments (a dict), got {type(updated).__name__} for "
                            f"a call of {call.name!r}")  # fmt: skip
        return dataclasses.replace(call, arguments=updated)


def tool_calls_of(message: Message, id_prefix: str = "call") -> list[ToolCall]:
    """Tool calls of an assistant message: its structured `tool_calls`, else `<tool_call>` blocks in its reply text
    (reasoning left out: a call the model only considered inside `<think>` is no call, as with vLLM's reasoning
    parser, which parses calls from the content after the reasoning)."""
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
    return parse_tool_calls(strip_reasoning(message_text(message)), id_prefix=id_prefix)


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
