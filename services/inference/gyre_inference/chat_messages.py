"""The messages and tools of a chat request (OpenAI's shapes): text content only, tool calls and tool results.

What `resp.choices[0].message.model_dump()` gives back is accepted as the next turn's assistant message, so a
client can send a conversation back as it got it (fields this server never fills are accepted as null only).
That holds for the messages of the openai SDK's helpers too: `chat.completions.parse()` and the final message of
`chat.completions.stream()` carry `parsed`, `function.parsed_arguments` and (stream) each call's `index`, which
the SDK sends back when the message object is appended to the conversation; they are ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from gyre.chat import NOT_TEXT_PARTS
from pydantic import AfterValidator, BeforeValidator, Discriminator, Field, Tag, model_validator

from gyre_inference.strict import ParamError, StrictModel


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


def _text_parts_only(value):
    """Content parts OpenAI defines that a text-only model cannot take (`NOT_TEXT_PARTS`, shared with `gyre sft`):
    refused by what they need, not by their tag."""
    if isinstance(value, list):
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in NOT_TEXT_PARTS:
                raise ValueError(f"part {i}: {NOT_TEXT_PARTS[kind]} is not supported: the served model takes text only")
    return value


Content = Annotated[str | list[TextPart], BeforeValidator(_text_parts_only)]


class RefusalPart(StrictModel):
    """A refusal an assistant wrote, as OpenAI's SDK types an assistant message's content part (a conversation
    replayed from another server); its text is rendered as a text part's, as vLLM renders it."""

    type: Literal["refusal"]
    refusal: str


def _refusals_as_text(value):
    if isinstance(value, list):
        return [TextPart(type="text", text=p.refusal) if isinstance(p, RefusalPart) else p for p in value]
    return value


def _part_kind(part) -> str | None:
    return {"text": "text-part", "refusal": "refusal-part"}.get(part.get("type")) if isinstance(part, dict) else None


# An assistant's content part, chosen by its type (an error names the broken field of that kind, not the other's);
# the tags are not identifiers, so errors.py leaves them out of the field's path
AssistantPart = Annotated[
    Annotated[TextPart, Tag("text-part")] | Annotated[RefusalPart, Tag("refusal-part")],
    Discriminator(_part_kind, custom_error_type="part_type",
                  custom_error_message="an assistant's content part has type 'text' or 'refusal'"),
]  # fmt: skip
# An assistant's content: text, or text and refusal parts (OpenAI's ChatCompletionAssistantMessageParam), the
# refusals made text parts once validated, so the template, the echo and the tokenizer routes see text only
AssistantContent = Annotated[
    str | list[AssistantPart], BeforeValidator(_text_parts_only), AfterValidator(_refusals_as_text)
]


# The openai SDK's own additions to a message it returned (parse() / stream() helpers): sent back verbatim when
# that message object is appended to the next request's messages, never rendered (excluded from model_dump).
_SDK_ADDED = "Ignored: the openai SDK's parse()/stream() helpers add it to the message they return."


class FunctionCall(StrictModel):
    name: str = Field(min_length=1)
    arguments: str = Field(description="JSON text of the arguments, as the model wrote it.")
    parsed_arguments: Any = Field(None, exclude=True, description=_SDK_ADDED)


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = Field(None, exclude=True, description=_SDK_ADDED + " (its position in the stream)")


class SystemMessage(StrictModel):
    role: Literal["system"]
    content: Content
    name: str | None = None


class UserMessage(StrictModel):
    role: Literal["user"]
    content: Content
    name: str | None = None


class DeveloperMessage(StrictModel):
    """OpenAI's newer name for system instructions; rendered as a system message."""

    role: Literal["developer"]
    content: Content
    name: str | None = None


class AssistantMessage(StrictModel):
    """What `resp.choices[0].message.model_dump()` gives back: the fields this server never produces
    (refusal, audio, annotations, the deprecated function_call) are accepted as null only."""

    role: Literal["assistant"]
    content: AssistantContent | None = None
    tool_calls: list[ToolCall] | None = None
    name: str | None = None
    refusal: None = Field(None, description="Only null (this server never refuses).")
    audio: None = Field(None, description="Only null (no audio output).")
    annotations: None = Field(None, description="Only null (no web search).")
    function_call: None = Field(None, description="Only null (deprecated; use tool_calls).")
    parsed: Any = Field(None, exclude=True, description=_SDK_ADDED)
    # vLLM's fields for the reasoning of an earlier reply (what its `--reasoning-parser` returned apart): clients
    # (verifiers, agent loops) send the assistant message back with it. As with vLLM, the template gets it under
    # every name templates read (transformers' apply_chat_template fills `reasoning_content` and `thinking` from
    # either): Qwen3-style templates render it in a <think> block, others leave it out.
    reasoning_content: str | None = Field(None, description="The reply's reasoning (vLLM's field), for the template.")
    reasoning: str | None = Field(None, description="Newer vLLM's name for reasoning_content.")

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not self.tool_calls:  # OpenAI: content is required unless tool_calls is given
            raise ValueError("an assistant message needs content unless it has tool_calls (content is null)")
        if None not in (self.reasoning, self.reasoning_content) and self.reasoning != self.reasoning_content:
            raise ParamError(
                "reasoning", "reasoning and reasoning_content are two names for one field and differ; send one"
            )
        return self


class ToolMessage(StrictModel):
    role: Literal["tool"]
    content: Content
    tool_call_id: str = Field(description="The id of the assistant's tool call this message answers.")
    # OpenAI's function-calling guide and cookbook send the function's name with its result (vLLM passes it to the
    # template, as here: a template may show it; ChatML ones do not)
    name: str | None = Field(None, description="The name of the function whose result this is (optional).")


ChatMessage = Annotated[
    SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]


class FunctionDefinition(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str = Field(min_length=1)


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class Prediction(StrictModel):
    type: Literal["content"]
    content: Content


def tool_reply_error(messages: list[dict]) -> tuple[int, str, str] | None:
    """(message index, field, what is wrong) for the first tool message that answers no tool call, else None.

    As OpenAI: a tool message follows an assistant message (and that message's other tool replies), and
    when that assistant message carries `tool_calls` its `tool_call_id` is one of their ids. An assistant
    message whose calls are only `<tool_call>` text in its content (a client that parses calls itself,
    as gyre's environments do when the server left them as text) may be answered with any ids.
    """
    calls: set[str] | None = None  # ids the tool messages may answer (None: none may follow here)
    calls_as_text = False
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "assistant":
            structured = message.get("tool_calls")
            calls = {call["id"] for call in structured} if structured else set()
            calls_as_text = not structured
        elif role != "tool":
            calls = None
        elif calls is None:
            return i, "role", "a message with role 'tool' must follow an assistant message (its tool calls' replies)"
        elif not calls_as_text and message["tool_call_id"] not in calls:
            return i, "tool_call_id", (f"{message['tool_call_id']!r} is not the id of one of the previous assistant "
                                       f"message's tool_calls ({', '.join(sorted(map(repr, calls)))})")  # fmt: skip
    return None
