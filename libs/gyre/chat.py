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


# Content parts OpenAI defines that a text-only model cannot take, by what they need: the server refuses them in a
# request (gyre_inference.chat_messages) and `gyre sft` in its data (`content_problem`).
NOT_TEXT_PARTS = {
    "image_url": "image input (image_url parts)",
    "input_image": "image input (input_image parts)",
    "input_audio": "audio input (input_audio parts)",
    "file": "file input (file parts)",
    "input_file": "file input (input_file parts)",
}


def content_problem(message: dict[str, Any]) -> tuple[str, str] | None:
    """(field, what is wrong) when `message` holds what OpenAI's chat format does not give a text model, else None.

    Accepted, as the server accepts them: content a string or a list of text parts (`{"type": "text", "text": ...}`,
    joined by `template_messages`; an assistant's may also hold refusal parts, `{"type": "refusal", "refusal": ...}`,
    as OpenAI's SDK types them, rendered as their text), and null or absent content on an assistant message with
    `tool_calls`, each an object with a `function` that has a `name`. A template renders anything else its own way,
    without a word: None as "None" or nothing, an image part dropped, a dict as nothing, and an assistant turn of null
    content without tool calls as an empty reply (SFT taught the model to answer nothing)."""
    role, content, calls = message.get("role"), message.get("content"), message.get("tool_calls")
    if role == "assistant" and calls is not None:
        if not isinstance(calls, list):
            return "tool_calls", f"a {type(calls).__name__}, not a list of tool calls"
        for k, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
                return f"tool_calls[{k}]", 'expected {"type": "function", "function": {"name": ..., "arguments": ...}}'
    if content is None:
        if role == "assistant" and calls:
            return None
        what = "an assistant message needs content unless it has tool_calls" if role == "assistant" else \
            f"a {role} message needs content"  # fmt: skip
        return "content", f"{'null' if 'content' in message else 'missing'}: {what}"
    if isinstance(content, str):
        return None
    if not isinstance(content, list):
        return "content", f"expected a string or a list of text parts, not {type(content).__name__}"
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in NOT_TEXT_PARTS:
            return f"content[{j}]", f"{NOT_TEXT_PARTS[kind]} is not supported: Gyre trains and serves text models"
        if role == "assistant" and kind == "refusal":
            if not isinstance(part.get("refusal"), str):
                return f"content[{j}].refusal", "a refusal part needs its text as a string"
            continue
        if kind != "text" or not isinstance(part.get("text"), str):
            return f"content[{j}]", 'expected a text part, {"type": "text", "text": "..."}'
    return None


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
        if _text_parts(m.get("content"), refusals=m.get("role") == "assistant"):
            m = {**m, "content": "\n".join(part.get("text", part.get("refusal")) for part in m["content"])}
        out.append(m)
    return out


def _text_parts(content: Any, refusals: bool = False) -> bool:
    """Whether `content` is parts that are all text (or, for an assistant, refusals: the server makes them text)."""
    return isinstance(content, list) and all(
        isinstance(p, dict)
        and (
            (p.get("type") == "text" and isinstance(p.get("text"), str))
            or (refusals and p.get("type") == "refusal" and isinstance(p.get("refusal"), str))
        )
        for p in content
    )
