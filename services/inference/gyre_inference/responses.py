"""`POST /v1/responses`: OpenAI's Responses API (text and function tools, streaming events) on the chat engine.

A Responses request is translated into a chat completion request (`to_chat`): `instructions` become a system
message, input items become messages (function calls become an assistant turn's `tool_calls`, their outputs
`tool` messages), `text.format` becomes `response_format`, flat function tools become chat tools. The chat
machinery then does everything it does for `/v1/chat/completions` (template, structured outputs and forced
tool calls, sampling, hermes tool-call parsing), and this module shapes the choice as a Response: a
`message` output item with one `output_text` part (when there is text), then one `function_call` item per
call; status `completed`, or `incomplete` with reason `max_output_tokens`.

Streaming sends the events OpenAI's SDK parses, in its order: `response.created`, `response.in_progress`,
for the message `response.output_item.added`, `response.content_part.added`, `response.output_text.delta`
per token that releases text, `response.output_text.done`, `response.content_part.done`,
`response.output_item.done`; per function call `response.output_item.added`,
`response.function_call_arguments.delta`, `response.function_call_arguments.done`,
`response.output_item.done`; then `response.completed` (or `response.incomplete`). Every event has a
`sequence_number`.

Not kept: this server stores no responses, so `previous_response_id`, `store: true`, `conversation` and
`background` are refused with the reason (a stateless replica behind a load balancer cannot answer them
correctly); the client sends the whole conversation in `input`, as with chat completions.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from gyre_inference.chat_messages import Content, tool_reply_error
from gyre_inference.errors import APIError
from gyre_inference.json_body import dumps
from gyre_inference.protocol import (
    MAX_TOP_LOGPROBS,
    MODEL_HELP,
    ChatCompletionRequest,
    PromptCacheOptions,
    StreamOptions,
)
from gyre_inference.strict import ParamError, StrictModel
from gyre_inference.structured_requests import FORMAT_NAME, JSONSchemaFormat, SchemaObject

# ---- request models ----------------------------------------------------------------------------------
MIN_OUTPUT_TOKENS = 16  # OpenAI refuses less (integer_below_min_value)
_NOT_STORED = "this server stores no responses: send the whole conversation in input"


def _parts_as_chat(content):
    """Responses content parts (input_text / output_text) as chat text parts; other kinds are refused by
    Content's validator with the feature they need."""
    if isinstance(content, list):
        return [{"type": "text", "text": part["text"]} if isinstance(part, dict) and part.get("type") in
                ("input_text", "output_text") and "text" in part else part for part in content]  # fmt: skip
    return content


class InputMessage(StrictModel):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[Content, Field(description="Text, or input_text / output_text parts.")]
    id: str | None = None
    status: str | None = None
    # an output message's label (reasoning models'), which `item.model_dump()` of the SDK's object sends back (null
    # for this server's messages): accepted and not rendered
    phase: Literal["commentary", "final_answer"] | None = Field(None, description="Accepted and ignored.")

    @field_validator("content", mode="before")
    @classmethod
    def _as_chat_parts(cls, value):
        return _parts_as_chat(value)


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None
    # fields of the SDK's ResponseFunctionToolCall this server never fills (namespaced tools, programmatic callers):
    # `item.model_dump()` sends them back as null
    namespace: None = Field(None, description="Only null (tools are not namespaced here).")
    caller: None = Field(None, description="Only null.")


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(StrictModel):
    type: Literal["function"]
    name: str = Field(min_length=1)


class TextFormat(StrictModel):
    """`text.format`: text, json_object, or json_schema with the schema's fields inline (Responses' shape)."""

    type: Literal["text", "json_object", "json_schema"]
    # checked here, where the client wrote it (a name chat's response_format refuses was a 500 in to_chat)
    name: str | None = Field(None, pattern=FORMAT_NAME)
    schema_: SchemaObject | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_fields(self):
        if self.type == "json_schema" and self.name is None:
            raise ValueError("a json_schema format needs a name")
        if self.type != "json_schema" and (self.name, self.schema_) != (None, None):
            raise ValueError("name and schema are only allowed with type 'json_schema'")
        return self

    def as_response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        schema = JSONSchemaFormat.model_validate({"name": self.name, "schema": self.schema_, "strict": self.strict,
                                                  "description": self.description})  # fmt: skip
        return {"type": "json_schema", "json_schema": schema.model_dump(by_alias=True, exclude_none=True)}


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: None = Field(None, description="Only null: the served model has no verbosity setting.")


class Reasoning(StrictModel):
    effort: None = Field(None, description="Only null: the served model has no reasoning-effort setting.")
    summary: None = None
    generate_summary: None = None


# The tags of the input item kinds are not identifiers, so errors.py leaves them out of a field's path: an item's
# bad role is input.0.role, as docs/inference.md names the Responses fields (it was input.0.message.role).
_ITEM_TAGS = {"message": "message-item", "function_call": "function-call-item",
              "function_call_output": "function-call-output-item"}  # fmt: skip


def _item_kind(item) -> str | None:
    if isinstance(item, dict):
        # an item with content and no role is a message missing its role (input.0.role: Field required)
        kind = item.get("type") or ("message" if "role" in item or "content" in item else None)
    else:
        kind = getattr(item, "type", None) or "message"
    return _ITEM_TAGS.get(kind, kind) if isinstance(kind, str) else None


InputItem = Annotated[
    Annotated[InputMessage, Tag("message-item")] | Annotated[FunctionCallItem, Tag("function-call-item")]
    | Annotated[FunctionCallOutputItem, Tag("function-call-output-item")],
    Discriminator(_item_kind, custom_error_type="input_item", custom_error_message=(
        "an input item is a message, a function_call or a function_call_output (this server stores no responses, "
        "so item references, and has no built-in tools or reasoning items)")),
]  # fmt: skip
# include values this server honours (logprobs) or that name output it never produces (so nothing to add)
_INCLUDES = Literal["message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
                    "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
                    "computer_call_output.output.image_url", "code_interpreter_call.outputs"]  # fmt: skip


class ResponsesRequest(StrictModel):
    # priority as on chat completions (a client that sends the field with its extension's null default)
    NULL_IS_DEFAULT: ClassVar[frozenset[str]] = frozenset({"stream", "parallel_tool_calls", "truncation", "priority"})

    model: str | None = Field(None, description=MODEL_HELP)
    input: str | list[InputItem] = Field(description="Text, or a list of messages and function call items.")
    instructions: str | None = Field(None, description="A system message put before the input.")
    max_output_tokens: int | None = Field(
        None, ge=MIN_OUTPUT_TOKENS, description="At least 16 (as OpenAI). Default: the rest of the context."
    )
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[FunctionTool] | None = Field(None, max_length=128, description="Function tools (no built-in ones).")
    tool_choice: Literal["auto", "none", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    include: list[_INCLUDES] | None = None
    user: str | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None  # caching hints: ignored, as prompt_cache_key
    prompt_cache_options: PromptCacheOptions | None = None
    moderation: None = Field(None, description="Only null: no moderation runs here.")
    service_tier: Literal["auto", "default"] | None = None
    max_tool_calls: int | None = Field(None, ge=1, description="Accepted: no built-in tools run here.")
    truncation: Literal["disabled"] = Field("disabled", description="Only disabled: a prompt too long is a 400.")
    reasoning: Reasoning | None = None
    store: bool | None = Field(None, description="Only false (or left out): " + _NOT_STORED + ".")
    previous_response_id: None = Field(None, description="Only null: " + _NOT_STORED + ".")
    conversation: None = Field(None, description="Only null: " + _NOT_STORED + ".")
    background: bool | None = Field(None, description="Only false: responses are not kept to poll.")
    prompt: None = Field(None, description="Only null: no stored prompt templates.")
    priority: int = Field(
        0, ge=-(2**31), lt=2**31, description="vLLM extension: scheduling priority, lower is served first (default 0)."
    )

    @field_validator("store", "background")
    @classmethod
    def _not_kept(cls, value, info):
        if value:
            raise ValueError(f"only false is supported: {_NOT_STORED}")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        # chat's rule (and OpenAI's): options of a stream that is not asked for are a mistake, not a no-op
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed with stream: true")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or []) or bool(self.top_logprobs)


def to_chat(request: ResponsesRequest) -> tuple[ChatCompletionRequest, ChatNames]:
    """The chat completion request that computes `request`'s response (validated like any chat request), and how
    its fields are called in `request` (for the errors the chat machinery raises)."""
    messages: list[dict] = []
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
    origin: list[list[int]] = [[] for _ in messages]  # per message, the input items it comes from (none: instructions)
    items = [InputMessage(role="user", content=request.input)] if isinstance(request.input, str) else request.input
    for j, item in enumerate(items):
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": _plain(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # calls after the assistant's text: one turn
                last.setdefault("tool_calls", []).append(call)
                origin[-1].append(j)
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        origin.append([j])
    names = ChatNames(items if isinstance(request.input, list) else None, origin)
    if not messages:
        raise APIError(
            400,
            "Invalid 'input': empty array. Expected an array with minimum length 1, but got an empty array instead.",
            param="input",
            code="empty_array",
        )  # chat's error for no messages
    if (wrong := tool_reply_error(messages)) is not None:
        j = origin[wrong[0]][0]
        raise APIError(400, f"input.{j}: no function_call with call_id {items[j].call_id!r} in the turn before this "
                            "function_call_output", param=f"input.{j}")  # fmt: skip
    chat: dict[str, Any] = {"model": request.model, "messages": messages, "stream": request.stream,
                            "max_completion_tokens": request.max_output_tokens, "temperature": request.temperature,
                            "top_p": request.top_p, "user": request.user, "priority": request.priority}  # fmt: skip
    if request.tools:
        chat["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                         for tool in request.tools]  # fmt: skip
        chat["parallel_tool_calls"] = request.parallel_tool_calls
        if isinstance(request.tool_choice, NamedFunctionChoice):
            chat["tool_choice"] = {"type": "function", "function": {"name": request.tool_choice.name}}
        elif request.tool_choice is not None:
            chat["tool_choice"] = request.tool_choice
    elif request.tool_choice not in (None, "none", "auto"):
        # chat's error; "auto" and "none" are fine without tools here: a Response says tool_choice "auto" either way
        raise APIError(400, "tool_choice: tool_choice is only allowed when tools are specified", param="tool_choice")
    if request.text is not None and request.text.format is not None:
        chat["response_format"] = request.text.format.as_response_format()
    if request.wants_logprobs:
        chat |= {"logprobs": True, "top_logprobs": request.top_logprobs or 0}
    if request.stream and request.stream_options is not None:
        chat["stream_options"] = request.stream_options.model_dump(exclude_none=True)
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None}), names
    except ValidationError as error:  # what the chat rules refuse, named by this request's field
        first = error.errors()[0]
        message = first["msg"].removeprefix("Value error, ")
        if not first["loc"]:  # a rule across fields (tool_choice required with text.format, ...): the field it names
            broken = (first.get("ctx") or {}).get("error")
            param = names.param(broken.param) if isinstance(broken, ParamError) else None
            raise APIError(400, message, param=param, code=getattr(broken, "code", None)) from None
        param = names.param(".".join(str(p) for p in first["loc"]))
        raise APIError(400, f"{param}: {message}", param=param) from None


class ChatNames:
    """Names a Responses request gives the fields of the chat request it runs as: `messages.3.content` is
    `input.2.content` after instructions (the system message first), `instructions` itself, or the `output` of a
    function_call_output; `response_format` is `text.format`, `tools.0.function.parameters` `tools.0.parameters`."""

    def __init__(self, items: list | None, origin: list[list[int]]):
        self.items, self.origin = items, origin  # items None: the input was one string

    def param(self, chat: str | None) -> str | None:
        if chat is None:
            return None
        head, *rest = chat.split(".")
        if head == "response_format":
            return ".".join(["text.format", *(rest[1:] if rest[:1] == ["json_schema"] else rest)])
        if head == "max_completion_tokens":
            return "max_output_tokens"
        if head == "tools" and rest[1:2] == ["function"]:
            return ".".join(["tools", rest[0], *rest[2:]])
        if head != "messages":
            return chat
        if not rest or not rest[0].isdigit() or int(rest[0]) >= len(self.origin):
            return "input"
        sources, rest = self.origin[int(rest[0])], rest[1:]
        if not sources:
            return "instructions"
        if self.items is None:
            return "input"
        calls = [j for j in sources if isinstance(self.items[j], FunctionCallItem)]
        if rest[:1] == ["tool_calls"] and len(rest) > 1 and rest[1].isdigit() and int(rest[1]) < len(calls):
            return ".".join([f"input.{calls[int(rest[1])]}", *rest[3:]])  # tool_calls.K.function.arguments
        j = sources[0]
        if isinstance(self.items[j], FunctionCallOutputItem):
            return f"input.{j}.output" if rest[:1] == ["content"] else f"input.{j}"
        return ".".join([f"input.{j}", *rest])

    def error(self, error: APIError) -> APIError:
        """`error`, raised by the chat machinery, with this request's names (param and the message's head)."""
        param = self.param(error.param)
        if param == error.param:
            return error
        message = error.message
        if error.param and message.startswith(error.param):
            message = param + message[len(error.param) :]
        return APIError(error.status, message, param=param, code=error.code, type=error.type)


def _plain(content) -> str | list[dict]:
    return content if isinstance(content, str) else [part.model_dump() for part in content]


async def respond(serving, request: ResponsesRequest, started: float, client_gone=None):
    """Answer `request` on `serving` (gyre_inference.serving.Serving): a Response body or its event stream."""
    chat, names = to_chat(request)
    try:
        job = await serving.chat_job(chat, started, kind="responses")
    except APIError as error:  # named as the chat request calls its fields: named as this one does
        raise names.error(error) from None
    shaper = ResponseShaper(request, serving, job)
    return await serving.respond(job, client_gone, body=shaper.body, stream=shaper.stream)


# ---- response shapes ---------------------------------------------------------------------------------
class ResponseShaper:
    """Builds the Response object and its stream events for one request from its (single) chat choice."""

    def __init__(self, request: ResponsesRequest, serving, job):
        self.request, self.serving, self.job = request, serving, job
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._sequence = 0

    @property
    def choice(self):
        return self.job.choices[0][1]

    def response(self, status: str, output: list[dict]) -> dict:
        request = self.request
        choice = self.choice
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        text_format = request.text.format.model_dump(by_alias=True, exclude_none=True) if (
            request.text and request.text.format) else {"type": "text"}  # fmt: skip
        tool_choice = request.tool_choice or "auto"
        body = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None, "incomplete_details": incomplete, "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens, "model": request.model, "output": output,
            "parallel_tool_calls": request.parallel_tool_calls, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False, "temperature": request.temperature,
            "text": {"format": text_format}, "top_p": request.top_p, "truncation": "disabled",
            "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
            "top_logprobs": request.top_logprobs, "user": request.user, "metadata": request.metadata or {},
            "service_tier": "default", "usage": None, **choice.versions(),
        }  # fmt: skip
        if status != "in_progress":
            prompt_tokens = sum(len(p) for p in self.job.prompts)
            body["usage"] = {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens": len(choice.token_ids),
                             "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": prompt_tokens + len(choice.token_ids)}  # fmt: skip
        return body

    def status(self) -> str:
        return "incomplete" if self.choice.finish_reason == "length" else "completed"

    def message(self, text: str, status: str) -> dict:
        part = {"type": "output_text", "text": text, "annotations": []}
        if self.request.wants_logprobs:
            part["logprobs"] = self.logprobs()
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [part] if status != "in_progress" else []}  # fmt: skip

    def logprobs(self, span: slice = slice(None)) -> list[dict]:
        chat = self.serving.chat_logprobs(self.job, self.choice, span)
        return chat["content"] if chat else []

    def calls(self) -> list[dict]:
        calls = [{"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
                  "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                  "status": "completed"} for call in self.choice.tool_calls]  # fmt: skip
        if calls:
            calls[-1]["status"] = self.status()  # the last item is the one max_output_tokens cut
        return calls

    def body(self, _job=None) -> dict:
        choice = self.choice
        output = [self.message(choice.text, self._message_status())] if choice.text or not choice.tool_calls else []
        return self.response(self.status(), output + self.calls())

    def _message_status(self) -> str:
        """The message item's final status: "incomplete" when it is the item max_output_tokens cut (OpenAI's
        item status; it said "completed" inside an incomplete response)."""
        return "completed" if self.choice.tool_calls else self.status()

    # ---- streaming ------------------------------------------------------------------------------
    def event(self, kind: str, **fields) -> str:
        self._sequence += 1
        payload = {"type": kind, "sequence_number": self._sequence - 1, **fields}
        return f"event: {kind}\ndata: {dumps(payload)}\n\n"

    async def stream(self, _job=None) -> AsyncIterator[str]:
        from gyre_inference.serving import JobStream

        run = JobStream(self.serving, self.job)
        text_started = False
        logged = 0  # tokens whose log-probs a delta carried: a delta carries those of every token since the last
        message = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        try:
            yield self.event("response.created", response=self.response("in_progress", []))
            yield self.event("response.in_progress", response=self.response("in_progress", []))
            while (item := await run.next()) is not None:
                _, delta = item
                if delta.text and not text_started:
                    text_started = True
                    yield self.event("response.output_item.added", output_index=0,
                                     item=self.message("", "in_progress"))  # fmt: skip
                    yield self.event("response.content_part.added", **message,
                                     part={"type": "output_text", "text": "", "annotations": []})  # fmt: skip
                if delta.text:  # the tokens whose text was held back (a partial character, ...) come with it
                    span, logged = slice(logged, delta.position + 1), delta.position + 1
                    logprobs = self.logprobs(span) if self.request.wants_logprobs else []
                    yield self.event("response.output_text.delta", **message, delta=delta.text, logprobs=logprobs)
            choice = self.choice
            output = []
            if text_started or not choice.tool_calls:
                if not text_started:  # no text at all (an empty answer): the message item still comes
                    yield self.event("response.output_item.added", output_index=0,
                                     item=self.message("", "in_progress"))  # fmt: skip
                    yield self.event("response.content_part.added", **message,
                                     part={"type": "output_text", "text": "", "annotations": []})  # fmt: skip
                done = self.message(choice.text, self._message_status())
                logprobs = done["content"][0].get("logprobs", [])
                yield self.event("response.output_text.done", **message, text=choice.text, logprobs=logprobs)
                yield self.event("response.content_part.done", **message, part=done["content"][0])
                yield self.event("response.output_item.done", output_index=0, item=done)
                output.append(done)
            for call in self.calls():
                index = len(output)
                yield self.event("response.output_item.added", output_index=index,
                                 item={**call, "arguments": "", "status": "in_progress"})  # fmt: skip
                yield self.event("response.function_call_arguments.delta", item_id=call["id"], output_index=index,
                                 delta=call["arguments"])  # fmt: skip
                yield self.event("response.function_call_arguments.done", item_id=call["id"], output_index=index,
                                 name=call["name"], arguments=call["arguments"])  # fmt: skip
                yield self.event("response.output_item.done", output_index=index, item=call)
                output.append(call)
            status = self.status()
            yield self.event(f"response.{status}", response=self.response(status, output))
            run.outcome = "success"
        except Exception as error:  # a generation failure ends the stream with an error event
            error = run.failed(error)["error"]
            yield self.event("error", code=error["code"] or error["type"], message=error["message"],
                             param=error["param"])  # fmt: skip
        finally:
            run.close()
