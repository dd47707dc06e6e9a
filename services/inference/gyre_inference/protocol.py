"""Strict request models of the OpenAI-compatible API (plus vLLM's extensions we implement).

Strict means: unknown fields are errors, and values are never coerced across JSON types
(`"logprobs": 0` is not a bool, `"n": "2"` is not an int, `"temperature": 1` is a fine float).
Every validation failure becomes a 400 with OpenAI's error JSON naming the field (see errors.py).

Fields OpenAI defines but this server cannot honour (penalties, best_of > 1, suffix, ...) are
accepted only with their neutral value, so a client that sends the default explicitly still works
and one that relies on the feature gets a clear 400 instead of a silently different answer.
Responses are built as plain dicts in serving.py; their shape is documented in docs/inference.md.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_PROMPTS = 256  # prompts in one completions request (each gets n choices)
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)


# vLLM request fields this server refuses, with the reason the 400 gives (docs/inference.md, "Compatibility").
_NO_PROMPT_LOGPROBS = "prompt log-probs are served on /v1/completions and /inference/v1/generate"
_NO_PENALTIES = "the sampler has temperature, top_p, logit_bias and min_tokens only"
_NO_CONSTRAINTS = "this server has no constrained (structured-output) decoding"
UNSUPPORTED_FIELDS = {
    "prompt_logprobs": _NO_PROMPT_LOGPROBS,
    "use_beam_search": "no beam search (ask for n choices instead)",
    "repetition_penalty": _NO_PENALTIES, "top_k": _NO_PENALTIES, "min_p": _NO_PENALTIES,
    "structured_outputs": _NO_CONSTRAINTS, "guided_json": _NO_CONSTRAINTS, "guided_regex": _NO_CONSTRAINTS,
    "guided_choice": _NO_CONSTRAINTS, "guided_grammar": _NO_CONSTRAINTS,
    "truncate_prompt_tokens": "prompts are never truncated (a prompt too long is a 400)",
    "prompt_embeds": "prompts are text or token ids",
}  # fmt: skip


_NEUTRAL = {"top_k": (-1, 0), "min_p": (0.0,), "repetition_penalty": (1.0,), "use_beam_search": (False,),
            "skip_special_tokens": (True,)}  # fmt: skip
UNSUPPORTED_FIELDS["skip_special_tokens"] = "special tokens are always left out of the text"


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]


class StreamOptions(StrictModel):
    include_usage: bool | None = Field(None, description="Send a last chunk with usage and no choices before [DONE].")
    continuous_usage_stats: bool | None = Field(
        None, description="vLLM extension: with include_usage, every chunk also carries the usage so far."
    )


class SamplingRequest(StrictModel):
    """Fields shared by chat and text completions."""

    model: str = Field(description="Served model id (see GET /v1/models).")
    n: int = Field(1, ge=1, le=MAX_N, description="Number of choices per prompt.")
    temperature: float | None = Field(None, ge=0, le=2, description="Sampling temperature; 0 = greedy. Default 1.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling mass. Default 1.")
    stop: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, max_length=MAX_STOP_STRINGS, description="Stop strings (excluded from the returned text); never empty."
    )
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, max_length=64, description="vLLM extension: extra token ids that end a choice."
    )
    seed: int | None = Field(
        None, ge=-(2**63), le=2**63 - 1, description="Same seed + request + weights = same output (a 64-bit integer)."
    )
    stream: bool = Field(False, description="Server-sent events, ending with data: [DONE].")
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="Ignored.")
    presence_penalty: float = Field(0.0, ge=0, le=0, description="Not supported; only 0 is accepted.")
    frequency_penalty: float = Field(0.0, ge=0, le=0, description="Not supported; only 0 is accepted.")
    ignore_eos: bool = Field(False, description="vLLM extension: do not stop at the end-of-sequence token.")
    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="Token id (as a string) -> bias added to its logit."
    )
    min_tokens: int = Field(
        0, ge=0, description="vLLM extension: no end-of-turn token, stop token id or stop string before this many."
    )
    include_stop_str_in_output: bool = Field(
        False, description="vLLM extension: keep the stop string that ended a choice in its text."
    )
    return_tokens_as_token_ids: bool = Field(
        False, description='vLLM extension: log-prob entries name tokens as "token_id:{id}".'
    )
    return_token_ids: bool = Field(
        False, description="vLLM extension: prompt_token_ids and per-choice token_ids in the response."
    )
    # vLLM sampling fields clients send at their neutral value (RL frameworks often do): accepted only so.
    top_k: int | None = Field(None, description="vLLM extension; only -1 or 0 (off).")
    min_p: float | None = Field(None, description="vLLM extension; only 0 (off).")
    repetition_penalty: float | None = Field(None, description="vLLM extension; only 1 (off).")
    use_beam_search: bool = Field(False, description="vLLM extension; only false.")
    skip_special_tokens: bool = Field(True, description="vLLM extension; only true (special tokens never shown).")

    @field_validator("top_k", "min_p", "repetition_penalty", "use_beam_search", "skip_special_tokens")
    @classmethod
    def _neutral_only(cls, value, info):
        if value is not None and value not in _NEUTRAL[info.field_name]:
            name = info.field_name
            raise ValueError(f"only {_NEUTRAL[name][0]!r} is supported: {UNSUPPORTED_FIELDS[name]}")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    def check_min_tokens(self, max_tokens: int | None) -> None:
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({max_tokens})")

    @property
    def usage_every_chunk(self) -> bool:
        options = self.stream_options
        return bool(options and options.include_usage and options.continuous_usage_stats)


# ---- chat -------------------------------------------------------------------------------------------
class TextPart(StrictModel):
    type: Literal["text"]
    text: str


Content = str | list[TextPart]


class FunctionCall(StrictModel):
    name: str = Field(min_length=1)
    arguments: str = Field(description="JSON text of the arguments, as the model wrote it.")


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


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
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None
    name: str | None = None
    refusal: None = Field(None, description="Only null (this server never refuses).")
    audio: None = Field(None, description="Only null (no audio output).")
    annotations: None = Field(None, description="Only null (no web search).")
    function_call: None = Field(None, description="Only null (deprecated; use tool_calls).")


class ToolMessage(StrictModel):
    role: Literal["tool"]
    content: Content
    tool_call_id: str | None = None


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


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _only_text(self):
        if self.type != "text":
            raise ValueError(
                f"type {self.type!r} is not supported: this server has no structured-output decoding; "
                "use 'text' (or leave response_format out)"
            )
        return self


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Default: the rest of the context.")
    logprobs: bool = Field(False, description="Return the log-prob of every generated token.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="Alternatives per token.")
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["auto", "none"] | None = Field(
        None, description="auto (default with tools): parse <tool_call> blocks; none: plain text, tools not shown."
    )
    parallel_tool_calls: bool | None = Field(None, description="Accepted; several calls are always parsed.")
    add_generation_prompt: bool = Field(True, description="vLLM extension: end the prompt with the assistant header.")
    continue_final_message: bool = Field(
        False, description="vLLM extension: the prompt ends inside the last (assistant) message; the model goes on."
    )
    echo: bool = Field(
        False, description="vLLM extension: content starts with the last message's content when it is an assistant's."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM extension: extra variables for the chat template (e.g. enable_thinking)."
    )
    response_format: ResponseFormat | None = Field(None, description='Only {"type": "text"}.')

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_needs_tools(cls, value, info):
        if value is not None and not info.data.get("tools"):
            raise ValueError("tool_choice is only allowed when tools are specified")
        return value

    @model_validator(mode="after")
    def _check(self):
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_completion_tokens or max_tokens, not both")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false (they contradict each other)")
        self.check_min_tokens(self.completion_limit)
        return self

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- text completions -------------------------------------------------------------------------------
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingRequest):
    prompt: (
        str
        | TokenIds
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    max_tokens: int | None = Field(16, ge=1, description="Default 16 (OpenAI); null = the rest of the context.")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="Legacy: alternatives per token.")
    echo: bool = Field(False, description="Each choice's text starts with its prompt (with logprobs: its tokens too).")
    add_special_tokens: bool = Field(True, description="vLLM extension: tokenize a text prompt with special tokens.")
    best_of: int | None = Field(None, ge=1, le=1, description="Not supported beyond 1.")
    suffix: None = Field(None, description="Not supported.")
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="vLLM extension: per choice, the log-prob of every prompt token given the ones before it "
        "(T = 1) plus this many alternatives.",
    )

    @model_validator(mode="after")
    def _check(self):
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are not available when stream is true (as in vLLM)")
        if self.stream and self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not available when stream is true (send stream: false)")
        self.check_min_tokens(self.max_tokens)
        return self

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        """Alternatives per prompt token the engine must compute: `prompt_logprobs`, or `logprobs` for echo."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of single prompts (a string or pre-tokenized ids each)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)


# ---- vLLM-compatible tokenizer routes ---------------------------------------------------------------
class TokenizeCompletionRequest(StrictModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (BOS...), as vLLM.")
    return_token_strs: bool = Field(False, description="Also return each token's string (token_strs).")


class TokenizeChatRequest(StrictModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = Field(False, description="Add special tokens on top of the template's, as vLLM.")
    return_token_strs: bool = Field(False, description="Also return each token's string (token_strs).")

    @model_validator(mode="after")
    def _check(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false (they contradict each other)")
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
