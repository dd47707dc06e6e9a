"""Test double for tests/unit/envs: `ScriptedClient`, a fake `ModelClient` that replies from a script.

It is NOT the real model path (the orchestrator's integration tests run environments against the tiny model
served by the inference service). It stands in for the server's token bookkeeping so the rollout protocol can be
checked exactly:

- the prompt is rendered with a ChatML-like text template and tokenised one character per token (token id =
  code point), so the rendering is append-only just like the real template, and every id is traceable;
- a reply's completion ids are its characters plus END_ID (the end-of-turn token the model samples);
- each completion token's "log-prob" is distinct (-(call * 1000 + i + 1) / 1e4), so any misalignment between
  tokens, mask and log-probs shows up as a wrong number;
- `mutate_prompt(call_index, ids) -> ids` lets a test inject retokenisation drift.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from gyre.envs import Messages, SamplingParams, ToolCall, Turn

END_ID = 2  # stands in for <|im_end|>


def render(messages: Messages, tools: list[dict[str, Any]] | None) -> str:
    """Append-only ChatML-like rendering (mirrors the real template's shape: tool calls after the content)."""
    out = "<tools>" + json.dumps(tools) + "</tools>\n" if tools else ""
    for m in messages:
        out += f"<{m['role']}>" + (m.get("content") or "")
        for call in m.get("tool_calls") or []:
            fn = call["function"]
            out += f'<tool_call>{{"name": "{fn["name"]}", "arguments": {fn["arguments"]}}}</tool_call>'
        out += "\x02\n" if m["role"] == "assistant" else "\n"
    return out + "<assistant>"


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


class Reply:
    """One scripted model turn: the text the model "samples" and, optionally, tool calls the server parsed."""

    def __init__(
        self, text: str, tool_calls: list[ToolCall] | None = None, finish_reason: str = "stop", versions=(0, 0)
    ):
        self.text, self.tool_calls, self.finish_reason, self.versions = text, tool_calls or [], finish_reason, versions


class ScriptedClient:
    def __init__(
        self,
        replies: list[Reply | str],
        mutate_prompt: Callable[[int, list[int]], list[int]] | None = None,
    ) -> None:
        self.replies = [r if isinstance(r, Reply) else Reply(r) for r in replies]
        self.mutate_prompt = mutate_prompt
        self.calls: list[dict[str, Any]] = []

    async def chat(self, messages: Messages, *, tools=None, sampling: SamplingParams) -> Turn:
        index = len(self.calls)
        self.calls.append({"messages": [dict(m) for m in messages], "tools": tools, "sampling": sampling})
        if index >= len(self.replies):
            raise AssertionError(
                f"the environment asked for model turn {index + 1}; the script has {len(self.replies)}"
            )
        reply = self.replies[index]
        prompt_ids = encode(render(messages, tools))
        if self.mutate_prompt:
            prompt_ids = self.mutate_prompt(index, prompt_ids)
        # What the model "sampled": structured calls are rendered back into the text the template would produce.
        sampled = reply.text + "".join(
            f'<tool_call>{{"name": "{c.name}", "arguments": {c.raw_arguments}}}</tool_call>' for c in reply.tool_calls
        )
        completion = encode(sampled) + ([END_ID] if reply.finish_reason == "stop" else [])
        return Turn(
            prompt_token_ids=prompt_ids,
            completion_token_ids=completion,
            completion_logprobs=[-(index * 1000 + i + 1) / 1e4 for i in range(len(completion))],
            text=reply.text,
            tool_calls=reply.tool_calls,
            finish_reason=reply.finish_reason,
            policy_version_min=reply.versions[0],
            policy_version_max=reply.versions[1],
        )
