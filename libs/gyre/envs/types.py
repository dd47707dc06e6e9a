"""The data that crosses the environment boundary: tasks, model turns, rollouts, scores, and the model client.

Messages are OpenAI chat messages (plain dicts): `{"role": "system"|"user"|"assistant"|"tool", "content": str}`;
an assistant message may carry `tool_calls` in OpenAI shape
(`[{"id", "type": "function", "function": {"name", "arguments": "<json text>"}}]`) and a tool message carries
`tool_call_id`. These are exactly what the orchestrator sends to the inference server's `/v1/chat/completions`.

Everything here is torch-free and JSON-friendly (`dataclasses.asdict` gives a dumpable dict).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

Message = dict[str, Any]
Messages = list[Message]
# verifiers' names of a rollout's state and a task's info (a verifiers environment's annotations use them)
State = dict[str, Any]
Info = dict[str, Any]
Split = Literal["train", "eval"]
_TOOL_CALL_START = "<tool_call>"
# Why a rollout ended: the environment said so, the turn budget ran out, the model hit max_tokens, the
# prompt of a later turn no longer extended the training sequence, or environment code raised.
StopReason = Literal["done", "max_turns", "length", "drift", "error"]


def derive_seed(seed: int, *key: int | str) -> int:
    """A 63-bit seed from `seed` and `key`: the same in every process and run, unrelated for different keys."""
    digest = hashlib.blake2b(":".join(map(str, (seed, *key))).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


#: Sampling fields every chat request Gyre sends (the orchestrator's rollouts and evals, judges) pins to their neutral
#: values. vLLM's server fills what a request leaves out from the model's generation_config.json (Qwen3: top_k 20;
#: Qwen2.5 instruct: repetition_penalty 1.05), Gyre's server does not: without them the same request sampled
#: differently by server, off the policy the trainer recomputes (log_softmax(logits / T) alone) for a rollout, another
#: verdict for a judge (greedy decoding too, under the penalty).
NEUTRAL_SAMPLING: dict[str, float] = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request sampling settings; field names match `gyre.config.orchestrator.SamplingConfig`.

    Environments pass the same object to every model turn of a rollout.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 128
    seed: int | None = None
    # the chat template's own variables (vLLM's chat_template_kwargs, e.g. enable_thinking): they change the prompt.
    # Left out of the hash (a dict has none; equal params still hash equal) and copied at creation, so an environment
    # that edits its copy changes neither the run's config nor any other rollout's requests.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict, hash=False)

    def for_request(self, *key: int | str) -> SamplingParams:
        """These settings with the seed of one request named by `key` (e.g. step, task index, rollout index).

        With a seed, every request of a run gets its own (`derive_seed(seed, *key)`), so the rollouts of a group
        differ and a rerun reproduces them; without one the server draws a fresh seed per request."""
        return self if self.seed is None else dataclasses.replace(self, seed=derive_seed(self.seed, *key))

    def __post_init__(self) -> None:
        object.__setattr__(self, "chat_template_kwargs", dict(self.chat_template_kwargs))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True, kw_only=True)
class ToolCall:
    """One function call requested by the model.

    `arguments` is the decoded JSON object. `raw_arguments` keeps the JSON text exactly as the server returned
    it, so the assistant message sent back on the next turn renders to the same tokens the model sampled.
    `error` is set (and `arguments` is empty) when the arguments were not a JSON object; the tool is then not
    run and the model is told why.
    """

    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw_arguments: str | None = None
    error: str | None = None

    @classmethod
    def from_openai(cls, call: Any) -> ToolCall:
        """Build from an OpenAI tool call: a dict `{"id", "function": {"name", "arguments"}}` or the SDK object."""
        if isinstance(call, dict):
            call_id, function = call.get("id") or "", call.get("function") or call
            name, raw = function.get("name"), function.get("arguments")
        else:
            call_id, name, raw = call.id or "", call.function.name, call.function.arguments
        if not isinstance(name, str) or not name:
            raise ValueError(f"tool call {call_id!r} has no function name")
        if isinstance(raw, dict):
            return cls(id=call_id, name=name, arguments=raw, raw_arguments=json.dumps(raw))
        arguments, error = decode_arguments(raw)
        return cls(id=call_id, name=name, arguments=arguments, raw_arguments=raw, error=error)

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI `tool_calls` entry of an assistant message."""
        text = self.raw_arguments if self.raw_arguments is not None else json.dumps(self.arguments)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": text}}


def decode_arguments(raw: Any) -> tuple[dict[str, Any], str | None]:
    """Decode tool-call arguments text; returns `(arguments, None)` or `({}, reason)`."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}, None
    try:
        value = json.loads(raw)
    except (TypeError, ValueError) as exc:
        return {}, f"arguments are not valid JSON: {exc}"
    except RecursionError:  # `[[[[...` a thousand deep: json's recursion limit, not a crash of the rollout
        return {}, "arguments are nested too deeply"
    if not isinstance(value, dict):
        return {}, f"arguments must be a JSON object, got {type(value).__name__}"
    return value, None


@dataclass(frozen=True, kw_only=True)
class Turn:
    """One model call as the inference server answered it.

    Invariants (checked on construction):
    - `completion_logprobs[i]` is the inference log-prob of `completion_token_ids[i]`, same length.
    - `completion_token_ids` are exactly the tokens the model sampled, including the end-of-turn token
      (`<|im_end|>`) when it sampled one (finish_reason "stop"), so the policy learns to end its turn and the
      next turn's prompt (which the chat template renders with that token) extends this one.
    - `prompt_token_ids` is the full prompt the server fed the model (chat template applied).
    - `text` is the completion decoded without special tokens. `tool_calls` are the calls the server parsed out
      of it (then `text` may or may not still contain the `<tool_call>` blocks); when the server does not parse
      calls, they stay in `text` and `ToolEnv` parses them itself. With parsed calls and no blocks left, `text` is
      the content as the chat template takes it back: the text before the first call less the one newline the
      template writes between content and calls (Gyre's server returns it so; the orchestrator's client makes
      vLLM's answer so from the sampled tokens).
    - `reasoning` is reasoning the server returned apart from the content (vLLM's `--reasoning-parser`) that
      `text` does not hold; it goes back as the assistant message's `reasoning_content`. None normally: the
      orchestrator's client puts a `<think>` block back into `text`, as it was sampled.
    - `policy_version_min <= policy_version_max`: the weight versions that produced the completion (they differ
      when weights were swapped mid-generation).
    """

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str | None = None
    finish_reason: str = "stop"
    policy_version_min: int = 0
    policy_version_max: int = 0

    def __post_init__(self) -> None:
        if len(self.completion_logprobs) != len(self.completion_token_ids):
            raise ValueError(
                f"completion_logprobs ({len(self.completion_logprobs)}) must align 1:1 with "
                f"completion_token_ids ({len(self.completion_token_ids)})"
            )
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids is empty: the server must report the prompt it generated from")
        # A hair above 0 is float rounding of log(1); anything else is not a log-probability.
        if any(not math.isfinite(lp) or lp > 1e-4 for lp in self.completion_logprobs):
            raise ValueError("completion_logprobs must be finite log-probabilities (<= 0)")
        if self.policy_version_min > self.policy_version_max:
            raise ValueError(f"policy_version_min {self.policy_version_min} > max {self.policy_version_max}")

    def assistant_message(self) -> Message:
        """The assistant message to append to the conversation for the next turn: what the chat template renders
        back to the tokens the model sampled.

        Without structured tool calls the content is the server's text verbatim (any `<tool_call>` blocks in it
        re-render as they were sampled). With them, the calls go in OpenAI shape with their raw argument text and
        the content is the text as returned, or, when a server left the call blocks in it, the text before the
        first block less one newline (the one the template writes back before the calls), so the template renders
        the calls once. Nothing more is stripped: a reply ending in a blank line before its call keeps it (all
        trailing newlines were stripped, so the next prompt rendered one newline where two were sampled: drift).
        """
        message: Message = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            start = self.text.find(_TOOL_CALL_START)
            if start >= 0:
                before = self.text[:start]
                message["content"] = before[:-1] if before.endswith("\n") else before
            message["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        return message


@runtime_checkable
class ModelClient(Protocol):
    """How an environment talks to the policy; the orchestrator implements it over the OpenAI API.

    `chat` runs one model turn on `messages` (with `tools` as OpenAI function schemas, or None) and returns the
    token-level record of it. It raises on transport failure after its own retries; environments do not catch
    that (a half-finished rollout is useless for training), so the caller decides whether to retry the rollout.
    A conversation grown past the model's context raises `ContextLengthExceeded`, which ends the episode.
    Implementations must be safe to call concurrently.
    """

    async def chat(
        self, messages: Messages, *, tools: list[dict[str, Any]] | None = None, sampling: SamplingParams
    ) -> Turn: ...


@dataclass(frozen=True, kw_only=True)
class Task:
    """One problem: the prompt to start from and what a correct answer is.

    - `id`: unique and stable within an environment (e.g. "train-0-17", "eval-3").
    - `prompt`: the opening messages (system + user); treat as read-only, rollouts copy it.
    - `answer`: reference answer text (what the SFT example replies, what rewards compare against).
    - `info`: JSON-serialisable metadata the environment needs (e.g. later turns' inputs, difficulty).
    """

    id: str
    prompt: Messages
    answer: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # checked here, where a make_task draws them: a text prompt failed every rollout as a TypeError deep in the
        # client, and an int answer (answer=a + b) compared unequal to every reply's text: a reward of 0, silently
        if not isinstance(self.prompt, list) or not self.prompt:
            hint = ": for a text prompt, prompt=self.format_prompt(text)" if isinstance(self.prompt, str) else ""
            raise TypeError(f"Task {self.id!r}: prompt must be a non-empty list of chat messages, got "
                            f"{type(self.prompt).__name__} {str(self.prompt)[:80]!r}{hint}")  # fmt: skip
        for message in self.prompt:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise TypeError(f"Task {self.id!r}: each prompt message is a dict with a 'role' (and 'content'), got "
                                f"{str(message)[:80]!r}")  # fmt: skip
        if not isinstance(self.answer, str):
            raise TypeError(f"Task {self.id!r}: answer must be text (str), got {type(self.answer).__name__} "
                            f"{self.answer!r}: write answer=str(...) (rewards compare it with reply text)")  # fmt: skip
        if not isinstance(self.info, dict):
            raise TypeError(f"Task {self.id!r}: info must be a dict, got {type(self.info).__name__}")

    @property
    def key(self) -> str:
        """Content fingerprint (of the prompt): two tasks with the same key are the same problem."""
        text = json.dumps(self.prompt, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(kw_only=True)
class Rollout:
    """One episode of a task, plus its training sequence.

    Conversation: `prompt` (the task's messages) + `completion` (assistant, user/tool messages that followed).
    `turns` holds every model call, including one rejected for drift; the conversation then ends at the last turn
    in the training sequence (the rejected reply and the environment messages it answered are left out), so the
    rubric scores exactly what the trainer sees.

    Training sequence (see `gyre.envs.sequence`): `token_ids`, `loss_mask`, `logprobs` have equal length;
    `loss_mask[t]` is True iff token t was sampled by the model; `logprobs[t]` is its inference log-prob there
    and 0.0 elsewhere; `token_ids[:prompt_len]` is the first turn's prompt (never in the loss). It covers the
    first `sequence_turns` turns; `sequence_turns < num_turns` only when `stop_reason == "drift"`.
    `policy_version_min/max` span the turns in the sequence.
    """

    task_id: str
    prompt: Messages
    completion: Messages
    turns: list[Turn]
    token_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float]
    prompt_len: int
    sequence_turns: int
    policy_version_min: int
    policy_version_max: int
    stop_reason: StopReason
    error: str | None = None
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def messages(self) -> Messages:
        return self.prompt + self.completion

    @property
    def num_turns(self) -> int:
        """Model turns taken in the episode (the completion holds `num_turns` assistant messages, or one fewer
        after drift)."""
        return len(self.turns)

    @property
    def truncated(self) -> bool:
        """The episode did not end on its own terms (length, turn budget, drift, or an environment error)."""
        return self.stop_reason != "done"

    @property
    def num_completion_tokens(self) -> int:
        return sum(self.loss_mask)


class ContextLengthExceeded(RuntimeError):
    """`ModelClient.chat` raises it when the conversation no longer fits the model's context (the prompt plus
    `max_tokens` is over the server's limit: vLLM's and Gyre's 400 `context_length_exceeded`). A rollout that has
    taken turns already ends there as a length stop; on the first turn it goes through (the task cannot run)."""


class ScoringError(RuntimeError):
    """A reward function could not score, through no fault of the rollout: a judge or reward model failed after
    its retries, or its answer held no score. Rubrics let it through (it is never a silent 0): the orchestrator
    counts it and scores the same completion again (`sample_attempts`, then the run stops)."""

    #: False where this completion cannot be scored again on its own (verifiers scores inside its episode, and the
    #: failure is recorded with the trace): the orchestrator generates the sample again instead
    rescorable: bool = True


@dataclass(frozen=True, kw_only=True)
class Score:
    """Result of a rubric: `reward = sum(weight_f * per_function[f])`.

    `per_function` holds each reward function's unweighted value; `errors` names the functions that raised or
    returned a non-finite/non-numeric value (they count as 0.0).
    """

    reward: float
    per_function: dict[str, float]
    errors: dict[str, str] = field(default_factory=dict)
