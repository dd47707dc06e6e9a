"""How Gyre hands a chat to a model's chat template, the same way when serving (`/v1/chat/completions`) and
when training (`gyre sft`), so the model learns on exactly the text it is later given."""

from __future__ import annotations

from typing import Any

# apply_chat_template's own arguments: chat_template_kwargs (a request's, the orchestrator's sampling setting) must
# not override what the request's fields decide (the server refuses them, the orchestrator's config too)
TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as chat templates know them: OpenAI's `developer` role is what templates call `system` (a
    template that does not know the role renders it as a turn of its own, or refuses it), and a content given
    as OpenAI text parts is their text joined by newlines, as vLLM gives it to a template that reads strings
    (most real ones, SmolLM2's, Qwen's and Llama's among them, fail on a list: "can only concatenate str"). An
    assistant turn with tool calls and no content has content "" (vLLM's too): SmolLM2's template reads it."""
    out = []
    for m in messages:
        if m.get("role") == "developer":
            m = {**m, "role": "system"}
        if m.get("role") == "assistant" and m.get("content") is None:
            m = {**m, "content": ""}
        if _text_parts(m.get("content")):
            m = {**m, "content": "\n".join(part["text"] for part in m["content"])}
        out.append(m)
    return out


def _text_parts(content: Any) -> bool:
    return isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    )
