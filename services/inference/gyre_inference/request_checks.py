"""Checks of a generation request that need more than its model's validation (the served model's context and
vocabulary, the tools' schemas, the order of the messages), each turning a bad request into an OpenAI-style 400
that names the field. The chat / completions engine (serving.py) and `/inference/v1/generate` (tokens_in.py) run
them, and api.py runs the tool checks for `/tokenize` too: one wording of each error, whichever route refuses.
"""

from __future__ import annotations

from collections.abc import Collection

from gyre_inference.chat_messages import Tool, tool_reply_error
from gyre_inference.errors import APIError
from gyre_inference.structured import GuideError, check_schema


def truncated(prompts: list[list[int]], keep: int | None, max_model_len: int, param: str) -> list[list[int]]:
    """vLLM's truncate_prompt_tokens: each prompt's last `keep` tokens (-1: max_model_len; None: as they are),
    left-truncated as vLLM does, before the context check (keep plus max_tokens must still fit)."""
    if keep is None:
        return prompts
    keep = max_model_len if keep == -1 else keep
    if keep > max_model_len:
        raise APIError(400, f"{param}: {keep} is greater than max_model_len ({max_model_len})", param=param)
    return [prompt[-keep:] for prompt in prompts]


def check_tool_replies(messages: list[dict]) -> None:
    """400 naming the first tool message that answers no tool call of the assistant turn before it (as OpenAI)."""
    if (wrong := tool_reply_error(messages)) is not None:
        i, field, reason = wrong
        raise APIError(400, f"messages.{i}.{field}: {reason}", param=f"messages.{i}.{field}")


def check_tool_schemas(tools: list[Tool], forced: Collection[str] = ()) -> None:
    """400 naming the tool whose `parameters` is not a valid JSON schema, whatever `tool_choice` says (as
    OpenAI); the tools a call is forced to (`forced`: their names) must also be schemas the grammar engine can
    enforce."""
    for i, tool in enumerate(tools):
        function = tool.function
        if function.parameters is None:
            continue
        param = f"tools.{i}.function.parameters"
        try:
            check_schema(function.parameters, enforced=False)
        except GuideError as error:
            raise APIError(400, f"{param}: invalid JSON schema for function {function.name!r}: {error}",
                           param=param) from None  # fmt: skip
        if function.name in forced:
            try:
                check_schema(function.parameters, enforced=True)
            except GuideError as error:
                raise APIError(400, f"{param}: tool_choice forces a call of {function.name!r}, and the grammar "
                                    f"engine cannot enforce its schema: {error}", param=param) from None  # fmt: skip


def checked_top_k(top_k: int | None, vocab_size: int, param: str) -> int:
    """vLLM's top_k as the engine takes it (0 = off, for vLLM's -1 too); above the vocabulary size a 400, as vLLM."""
    if top_k is not None and top_k > vocab_size:
        raise APIError(400, f"{param}: {top_k} is greater than the vocabulary size ({vocab_size})", param=param)
    return max(top_k or 0, 0)


def context_exceeded(limit: int, prompt_len: int, requested: int | None, param: str) -> APIError:
    """The 400 of a prompt (`param`) plus the `requested` completion tokens over the context `limit`; requested None
    (no max_tokens: the rest of the context) means the prompt alone leaves no room. "maximum context length is L
    tokens" is what clients (and the orchestrator) read."""
    where = named_prompt(param)
    if requested is None:
        detail = f"{prompt_len} tokens in {where}, which leaves no room for the completion. Please reduce the "
        detail += f"length of {where}."
    else:
        detail = f"{prompt_len + requested} tokens ({prompt_len} in {where}, {requested} in the completion). "
        detail += f"Please reduce the length of {where} or completion."
    return APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested {detail}",
                    param=param, code="context_length_exceeded")  # fmt: skip


def named_prompt(param: str) -> str:
    """A prompt named in a message: "prompt.1" (one of a list of prompts), else "the prompt" / "the messages"."""
    return param if "." in param else f"the {param}"
