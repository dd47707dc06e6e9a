"""Request models of the OpenAI-compatible API (plus vLLM's extensions we implement): sampling, chat and text
completions, tokenize / detokenize. All are strict (strict.py); chat messages and tools are in chat_messages.py,
the structured-output fields (response_format, structured_outputs) in structured_requests.py.

Fields OpenAI defines but this server cannot honour (penalties, best_of > 1, suffix, ...) are
accepted only with their neutral value, so a client that sends the default explicitly still works
and one that relies on the feature gets a clear 400 instead of a silently different answer.
Responses are built as plain dicts in serving.py; their shape is documented in docs/inference.md.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    Discriminator,
    Field,
    Tag,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from gyre_inference.chat_messages import ChatMessage, NamedToolChoice, Prediction, Tool
from gyre_inference.strict import ParamError, StrictModel
from gyre_inference.structured import Guide
from gyre_inference.structured_requests import Choices, ResponseFormat, SchemaObject, StructuredOutputs

MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_PROMPTS = 256  # prompts in one completions request (each gets n choices)
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
MAX_BAD_WORDS = 128  # entries of bad_words (each is a sparse bias entry of its row, or two)


# vLLM request fields this server refuses, with the reason the 400 gives (docs/inference.md, "Compatibility").
_NO_PROMPT_LOGPROBS = "prompt log-probs are served on chat, /v1/completions and /inference/v1/generate"
UNSUPPORTED_FIELDS = {
    "prompt_logprobs": _NO_PROMPT_LOGPROBS,
    "use_beam_search": "no beam search (ask for n choices instead)",
    "truncate_prompt_tokens": "prompts are truncated on chat, completions and /inference/v1/generate only",
    "prompt_embeds": "prompts are text or token ids",
    # fields accepted as null only (the 400 says "only null is supported: <reason>")
    "guided_decoding_backend": "the grammar engine is fixed (llguidance)",
    "guided_whitespace_pattern": "JSON whitespace is fixed (the separators ', ' and ': ')",
    "whitespace_pattern": "JSON whitespace is fixed (the separators ', ' and ': ')",
    "structural_tag": "structural tags are not supported (use tool_choice or a grammar)",
    "audio": "this server has no audio output",
    "reasoning_effort": "the served model has no reasoning-effort setting",
    "verbosity": "the served model has no verbosity setting",
    "web_search_options": "this server has no web search",
    "moderation": "this server runs no moderation",
    "functions": "deprecated by OpenAI: use tools",
    "function_call": "deprecated by OpenAI: use tools / tool_choice / tool_calls",
    "refusal": "this server never refuses",
    "annotations": "this server has no web search",
    "suffix": "no fill-in-the-middle",
    "previous_response_id": "this server stores no responses: send the whole conversation in input",
    # vLLM request fields whose default a client spelling out vLLM's request sends (accepted at it only)
    "length_penalty": "it weighs beams, and there is no beam search",
    "spaces_between_special_tokens": "special tokens are decoded as the tokenizer joins them",
    "include_reasoning": "no reasoning parser runs: reasoning stays in the content",
    "logits_processors": "no custom logits processors run here",
    "mm_processor_kwargs": "the served model takes text only",
    "documents": "documents are not passed to the chat template (put them in the messages)",
    "chat_template": "the chat template is the model's own",
    "kv_transfer_params": "no disaggregated prefill",
    "vllm_xargs": "no custom extensions read them",
    "conversation": "this server stores no conversations: send the whole conversation in input",
}  # fmt: skip


# vLLM's request models take no model as the served one (its own id then in the response): a curl or script written
# against vLLM that leaves it out was a 400 "model: Field required" here
MODEL_HELP = "Served model id (see GET /v1/models); omitted or null: the served model itself (as vLLM)."


_NEUTRAL = {"use_beam_search": (False,), "length_penalty": (1.0,), "spaces_between_special_tokens": (True,),
            "include_reasoning": (True,)}  # fmt: skip


def _token_id_key(value: str) -> str:
    if not (value.isascii() and value.isdigit() and len(value) <= 10):
        raise ValueError(f'key {value!r} is not a token id (a non-negative integer, as a string: "50256")')
    return value


# logit_bias's keys: the pattern stays in the OpenAPI document; the error names the key (pydantic's said "String
# should match pattern '^[0-9]{1,10}$'", and for a key like "-1" its param did not even name the key)
TokenIdKey = Annotated[
    str, WithJsonSchema({"type": "string", "pattern": r"^[0-9]{1,10}$"}), AfterValidator(_token_id_key)
]
# vLLM's top_k (-1 and 0 = off; above the vocabulary size is a 400, checked where the vocabulary is known) and min_p
TopK = Annotated[int, Field(ge=-1, lt=2**31)]
MinP = Annotated[float, Field(ge=0, le=1)]
# vLLM's (and OpenAI's) penalty ranges: presence and frequency in [-2, 2], repetition > 0 (1 = off)
Penalty = Annotated[float, Field(ge=-2, le=2)]
RepetitionPenalty = Annotated[float, Field(gt=0, le=100)]
# vLLM's allowed_token_ids and bad_words (ids beyond the vocabulary are a 400, checked where it is known)
AllowedTokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
ALLOWED_HELP = "vLLM extension: only these token ids may be sampled (the others' logits are -inf); never empty."
BAD_WORDS_HELP = (
    "vLLM extension: words the output may not contain: each word's last token cannot be sampled right after its "
    "other tokens (tokenized alone and after a space, as vLLM)."
)


def _keeps_a_token(value: int) -> int:
    if value == 0:
        raise ValueError("must be -1 (the model's context length) or at least 1 (0 leaves an empty prompt)")
    return value


# vLLM's truncate_prompt_tokens: keep the prompt's last k tokens; -1 = max_model_len (above it: a 400 where it is known)
TruncatePromptTokens = Annotated[int, Field(ge=-1), AfterValidator(_keeps_a_token)]
TRUNCATE_HELP = "vLLM extension: keep only the last k tokens of the (rendered) prompt; -1 = max_model_len."


CacheSalt = Annotated[str, Field(min_length=1, max_length=256)]
CACHE_SALT_HELP = (
    "vLLM extension: cached prompt blocks are shared only between requests of the same salt (a non-empty string)."
)
PRESENCE_HELP = "Subtracted from the logit of every token the output already holds (0 = off; vLLM's semantics)."
FREQUENCY_HELP = "Times a token's count in the output so far, subtracted from its logit (0 = off)."
REPETITION_HELP = (
    "vLLM extension: a token of the prompt or output has its logit divided by this when positive, "
    "multiplied when negative (1 = off)."
)


def neutral_only(cls, value, info):
    """A vLLM field accepted at its neutral value only (_NEUTRAL), refused otherwise with the reason."""
    if value is not None and value not in _NEUTRAL[info.field_name]:
        name = info.field_name
        raise ValueError(f"only {_NEUTRAL[name][0]!r} is supported: {UNSUPPORTED_FIELDS[name]}")
    return value


class PromptCacheOptions(StrictModel):
    """OpenAI's prompt caching options: a hint, accepted and ignored (the prefix cache here is automatic and never
    changes an output)."""

    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


class StreamOptions(StrictModel):
    include_usage: bool | None = Field(None, description="Send a last chunk with usage and no choices before [DONE].")
    continuous_usage_stats: bool | None = Field(
        None, description="vLLM extension: with include_usage, every chunk also carries the usage so far."
    )
    include_obfuscation: bool | None = Field(
        None, description="Accepted; chunks carry no obfuscation padding (it only hides sizes on the network)."
    )


class SamplingRequest(StrictModel):
    """Fields shared by chat and text completions."""

    NULL_IS_DEFAULT: ClassVar[frozenset[str]] = frozenset({
        "n", "stream", "presence_penalty", "frequency_penalty", "ignore_eos", "min_tokens",
        "include_stop_str_in_output",
        "return_tokens_as_token_ids", "return_token_ids", "use_beam_search", "skip_special_tokens", "priority",
    })  # fmt: skip

    model: str | None = Field(None, description=MODEL_HELP)
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
    presence_penalty: Penalty = Field(0.0, description=PRESENCE_HELP)
    frequency_penalty: Penalty = Field(0.0, description=FREQUENCY_HELP)
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
    priority: int = Field(
        0, ge=-(2**31), lt=2**31, description="vLLM extension: scheduling priority, lower is served first (default 0)."
    )
    top_k: TopK | None = Field(None, description="vLLM extension: draw from the k most likely tokens; -1 or 0 = off.")
    min_p: MinP | None = Field(
        None, description="vLLM extension: draw only tokens with at least min_p times the top probability; 0 = off."
    )
    repetition_penalty: RepetitionPenalty | None = Field(None, description=REPETITION_HELP)
    # vLLM sampling fields clients send at their neutral value (RL frameworks often do): accepted only so.
    use_beam_search: bool = Field(False, description="vLLM extension; only false.")
    skip_special_tokens: bool = Field(
        True,
        description="vLLM extension: false keeps special tokens (<|im_start|>, ...) in the text; the stop token that "
        "ended a choice stays out unless include_stop_str_in_output, as vLLM.",
    )
    # vLLM's other request fields at their defaults (a dump of vLLM's request model, an RL framework's sampling dict
    # spelling them out, were a 400 "Extra inputs are not permitted"); anything else is refused saying why.
    length_penalty: float | None = Field(None, description="vLLM extension (beam search); only 1.")
    spaces_between_special_tokens: bool | None = Field(None, description="vLLM extension; only true.")
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, max_length=MAX_BAD_WORDS, description=BAD_WORDS_HELP
    )
    allowed_token_ids: AllowedTokenIds | None = Field(None, description=ALLOWED_HELP)
    truncate_prompt_tokens: TruncatePromptTokens | None = Field(None, description=TRUNCATE_HELP)
    logits_processors: None = Field(None, description="Only null: no custom logits processors.")
    mm_processor_kwargs: None = Field(None, description="Only null: text only.")
    structural_tag: None = Field(None, description="Only null: structural tags are not supported.")
    cache_salt: CacheSalt | None = Field(None, description=CACHE_SALT_HELP)
    kv_transfer_params: None = Field(None, description="Only null: no disaggregated prefill.")
    vllm_xargs: None = Field(None, description="Only null: no custom extensions.")
    # structured outputs (OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields)
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object (any JSON object) or json_schema (output follows the schema)."
    )
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM extension: json, regex, choice, grammar or json_object."
    )
    guided_json: SchemaObject | None = Field(None, description="vLLM extension (older name of structured_outputs).")
    guided_regex: str | None = Field(None, min_length=1, description="vLLM extension (older name).")
    guided_choice: Choices | None = Field(None, description="vLLM extension (older name).")
    guided_grammar: str | None = Field(None, min_length=1, description="vLLM extension (older name).")
    guided_decoding_backend: None = Field(None, description="Only null: the grammar engine is llguidance.")
    guided_whitespace_pattern: None = Field(None, description="Only null: JSON whitespace is fixed.")

    _neutral_only = field_validator("use_beam_search", "length_penalty",
                                    "spaces_between_special_tokens")(neutral_only)  # fmt: skip

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed with stream: true")
        guides = self._guides()
        if len(guides) > 1:
            raise ParamError(
                list(guides)[1], f"give one structured-output constraint, not several ({', '.join(guides)})"
            )
        return self

    def _guides(self) -> dict[str, Guide]:
        """The structured-output constraints the request gives, by field."""
        guides = {}
        if self.response_format is not None and (guide := self.response_format.guide()) is not None:
            guides["response_format"] = guide
        if self.structured_outputs is not None:
            guides["structured_outputs"] = self.structured_outputs.guide()
        for kind, name in (("json", "guided_json"), ("regex", "guided_regex"), ("choice", "guided_choice"),
                           ("grammar", "guided_grammar")):  # fmt: skip
            value = getattr(self, name)
            if value is not None:
                guides[name] = Guide(kind, tuple(value) if kind == "choice" else value, name)
        return guides

    def guide(self) -> Guide | None:
        """What the output must match (None: free text)."""
        return next(iter(self._guides().values()), None)

    def check_min_tokens(self, max_tokens: int | None) -> None:
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise ParamError("min_tokens", f"min_tokens ({self.min_tokens}) must be at most max_tokens ({max_tokens})")

    @property
    def usage_every_chunk(self) -> bool:
        options = self.stream_options
        return bool(options and options.include_usage and options.continuous_usage_stats)


class ChatCompletionRequest(SamplingRequest):
    NULL_IS_DEFAULT: ClassVar[frozenset[str]] = SamplingRequest.NULL_IS_DEFAULT | {
        "logprobs", "add_generation_prompt", "continue_final_message", "echo", "add_special_tokens"}  # fmt: skip

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Default: the rest of the context.")
    logprobs: bool = Field(False, description="Return the log-prob of every generated token.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="Alternatives per token.")
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = Field(
        None,
        description="auto (default with tools): parse <tool_call> blocks; none: plain text, tools not shown; "
        "required: the output is one or more calls of the tools (grammar-constrained); {type: function, function: "
        "{name}}: one call of that tool.",
    )
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one tool call per choice (the first the model wrote, as vLLM)."
    )
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
    add_special_tokens: bool = Field(
        False, description="vLLM extension: add the tokenizer's special tokens (BOS) on top of the template's."
    )
    # vLLM chat fields at their defaults only (see SamplingRequest)
    best_of: int | None = Field(None, ge=1, le=1, description="vLLM extension; only 1.")
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="vLLM extension: top-level, the log-prob of every token of the rendered prompt given the ones "
        "before it (T = 1) plus this many alternatives; not with stream.",
    )
    include_reasoning: bool | None = Field(None, description="vLLM extension; only true.")
    documents: None = Field(None, description="Only null: documents are not passed to the template.")
    chat_template: None = Field(None, description="Only null: the chat template is the model's own.")
    _chat_neutral_only = field_validator("include_reasoning")(neutral_only)
    # OpenAI fields that change nothing a client can observe here, at any value (their effect is storage,
    # billing, latency or abuse tracking), or that are accepted at their neutral value only.
    store: bool | None = Field(None, description="Only false: this server keeps no completions.")
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16, description="Accepted and ignored (OpenAI uses it for stored completions only)."
    )
    service_tier: Literal["auto", "default"] | None = Field(None, description="auto or default (one tier here).")
    modalities: list[Literal["text"]] | None = Field(None, description='Only ["text"] (no audio output).')
    audio: None = Field(None, description="Only null (no audio output).")
    prediction: Prediction | None = Field(
        None, description="Accepted and ignored: predicted outputs only change latency, never the output."
    )
    safety_identifier: str | None = Field(None, description="Accepted and ignored.")
    prompt_cache_key: str | None = Field(None, description="Accepted and ignored (a caching hint).")
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(
        None, description="Accepted and ignored (a caching hint)."
    )
    prompt_cache_options: PromptCacheOptions | None = Field(None, description="Accepted and ignored (a caching hint).")
    moderation: None = Field(None, description="Only null: no moderation runs here.")
    reasoning_effort: None = Field(None, description="Only null: the served model has no reasoning-effort setting.")
    verbosity: None = Field(None, description="Only null: no verbosity setting.")
    web_search_options: None = Field(None, description="Only null: no web search.")
    functions: None = Field(None, description="Only null (deprecated: use tools).")
    function_call: None = Field(None, description="Only null (deprecated: use tool_choice).")

    @field_validator("store")
    @classmethod
    def _not_stored(cls, value):
        if value:
            raise ValueError("only false is supported: this server keeps no completions (nothing to retrieve)")
        return value

    @field_validator("tools", "tool_choice", mode="before")
    @classmethod
    def _function_tools_only(cls, value, info):
        # OpenAI's newer shapes (`custom` tools; tool_choice `allowed_tools`, `custom`, ...) failed every member of
        # the union ("Input should be 'function' (and 2 more errors)"): one 400 saying what this server takes
        if info.field_name == "tools" and isinstance(value, list):
            for i, tool in enumerate(value):
                if isinstance(tool, dict) and isinstance(tool.get("type"), str) and tool["type"] != "function":
                    raise ParamError(f"{i}.type", f"tools.{i}.type: {tool['type']!r} tools are not supported: "
                                     "only {type: function} tools")  # fmt: skip
        if info.field_name == "tool_choice" and isinstance(value, dict):
            kind = value.get("type")
            if isinstance(kind, str) and kind != "function":
                raise ParamError("type", f"tool_choice.type: {kind!r} is not supported: tool_choice is 'auto', "
                                 "'none', 'required' or {type: function, function: {name}}")  # fmt: skip
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_needs_tools(cls, value, info):
        # "none" asks for no tool calls, which holds without tools too (vLLM accepts it: clients send it on their
        # tool-less requests), and so does "auto" over an empty list (vLLM accepts it: an agent with no tool
        # registered sends tools: [] and tool_choice: "auto"); otherwise auto, required and a named tool need tools
        # (OpenAI and vLLM refuse them)
        tools = info.data.get("tools")
        if value == "auto" and tools is not None and len(tools) == 0:
            return value
        if value not in (None, "none") and not tools:
            raise ValueError("tool_choice is only allowed when tools are specified")
        if isinstance(value, NamedToolChoice):
            names = [tool.function.name for tool in info.data.get("tools") or []]
            if value.function.name not in names:
                raise ValueError(f"function {value.function.name!r} is not one of the tools ({', '.join(names)})")
        return value

    @model_validator(mode="after")
    def _check(self):
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs: true")
        if self.stream and self.prompt_logprobs is not None:
            raise ParamError("prompt_logprobs", "prompt_logprobs are not available when stream is true (as in vLLM)")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ParamError("max_tokens", "Setting 'max_tokens' and 'max_completion_tokens' at the same time is not "
                             "supported.", code="invalid_parameter_combination")  # OpenAI's words  # fmt: skip
        if self.continue_final_message and self.add_generation_prompt:
            raise ParamError(
                "continue_final_message",
                "continue_final_message needs add_generation_prompt: false (they contradict each other)",
            )
        if self.forced_tools is not None and self.guide() is not None:
            raise ParamError("tool_choice", "tool_choice required or named already constrains the output: give no "
                             "other structured-output constraint with it")  # fmt: skip
        self.check_min_tokens(self.completion_limit)
        return self

    @property
    def forced_tools(self) -> list[Tool] | None:
        """The tools a call must be made to (tool_choice required: all; named: that one), else None."""
        if self.tool_choice == "required":
            return list(self.tools)
        if isinstance(self.tool_choice, NamedToolChoice):
            return [tool for tool in self.tools if tool.function.name == self.tool_choice.function.name]
        return None

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- text completions -------------------------------------------------------------------------------
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingRequest):
    NULL_IS_DEFAULT: ClassVar[frozenset[str]] = SamplingRequest.NULL_IS_DEFAULT | {"echo", "add_special_tokens"}

    prompt: (
        str
        | TokenIds
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    max_tokens: int | None = Field(
        16, ge=0, description="Default 16 (OpenAI); null = the rest of the context; 0: only with echo."
    )
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
            raise ParamError("prompt_logprobs", "prompt_logprobs are not available when stream is true (as in vLLM)")
        if self.stream and self.echo and self.logprobs is not None:
            raise ParamError("logprobs", "echo with logprobs is not available when stream is true (send stream: false)")
        self.check_min_tokens(self.max_tokens)
        return self

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0 (OpenAI's and vLLM's way to score a prompt): each choice is its prompt alone."""
        return self.echo and self.max_tokens == 0

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
            raise ParamError(
                "continue_final_message",
                "continue_final_message needs add_generation_prompt: false (they contradict each other)",
            )
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def _tokenize_form(body: Any) -> str:
    return "chat-form" if isinstance(body, dict) and "messages" in body else "prompt-form"


# The body of /tokenize: the chat form when it has messages, else the prompt form. Tagged so that a chat body's
# error names its own field (messages.1.tool_call_id), not the other form's ("prompt: Field required"); the tags
# are not identifiers, so errors.py leaves them out of the field's path.
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("prompt-form")] | Annotated[TokenizeChatRequest, Tag("chat-form")],
    Discriminator(_tokenize_form),
]
