"""What a judge or reward model is shown of a rollout: the judge prompt's fields (`fields_of`, `render`), the
conversation without its reasoning (`without_reasoning`), and how a prompt longer than the model's context is cut to
fit (`cut_to_fit`, `cut_messages`: the longest texts in the middle, a marker in their place) from the counts its
refusal gives (`length_overflow`). `Unjudged`: a rollout the judge or reward model cannot score."""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

from gyre.config.endpoint import JudgeConfig
from gyre.endpoint import RequestRefused
from gyre.envs.parsers import strip_reasoning
from gyre.envs.types import Messages


class Unjudged(RuntimeError):
    """The judge or reward model refused to score this rollout (its request, e.g. too long for the model's context):
    a reward-function error (0 for this function, named in `Score.errors`), not a `ScoringError`."""


def text_of(content: Any) -> Any:
    """The text of a message's content: a string, or the text parts of a list (anything else is returned as is)."""
    if isinstance(content, list):
        return "".join(part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str))
    return content or ""


def fields_of(prompt: Messages, completion: Messages, answer: str) -> dict[str, str]:
    """The values of the prompt's placeholders for one rollout. `response` is the last assistant message's reply
    after its reasoning (`strip_reasoning`, as a `Parser` and verifiers' JudgeRubric read it): a reasoning policy's
    <think> block went to the judge as its response, which graded a right answer it only considered while thinking
    (and read whatever the policy wrote there to it); `conversation` keeps every message whole."""
    users = [m for m in prompt if m.get("role") == "user"]
    replies = [m for m in completion if m.get("role") == "assistant"]
    return {
        "question": text_of(users[-1].get("content")) if users else "",
        "response": _reply(text_of(replies[-1].get("content"))) if replies else "",
        "answer": answer,
        "conversation": "\n".join(f"{m.get('role')}: {text_of(m.get('content'))}" for m in prompt + completion),
    }


def without_reasoning(messages: Messages) -> Messages:
    """The conversation a reward model scores: each assistant message's text after its reasoning (`strip_reasoning`,
    the rule of a judge's {response}). A policy's <think> block was scored with its reply: a right answer it only
    considered while thinking, or whatever it wrote there for the reward model to read, moved its reward, and a long
    thinking filled the model's context (cut). Text parts of a list content are stripped alike."""
    stripped = []
    for message in messages:
        content = message.get("content")
        if message.get("role") == "assistant" and isinstance(content, str):
            message = {**message, "content": strip_reasoning(content)}
        elif message.get("role") == "assistant" and isinstance(content, list):
            texts = [isinstance(part, dict) and isinstance(part.get("text"), str) for part in content]
            parts = [{**part, "text": strip_reasoning(part["text"])} if text else part
                     for part, text in zip(content, texts, strict=True)]  # fmt: skip
            message = {**message, "content": parts}
        stripped.append(message)
    return stripped


def _reply(text: Any) -> Any:
    return strip_reasoning(text) if isinstance(text, str) else text


def render(config: JudgeConfig, prompt: Messages, completion: Messages, answer: str) -> list[dict]:
    """The judge's messages for one rollout (the placeholders of `config.prompt` filled in)."""
    return judge_messages(config, fields_of(prompt, completion, answer))


def judge_messages(config: JudgeConfig, fields: dict[str, str]) -> list[dict]:
    messages = [{"role": "system", "content": config.system}] if config.system else []
    return messages + [{"role": "user", "content": config.prompt.format(**fields)}]


# A judge's refusal of a prompt longer than its context, as vLLM, Gyre and OpenAI word it: the context, and the
# prompt's tokens (or the prompt's and the completion's together: `requested`, less max_tokens)
_CONTEXT = re.compile(r"maximum (?:context|model) length (?:is|of) (\d+)", re.IGNORECASE)
_PROMPT_TOKENS = [re.compile(r"(\d+) (?:tokens )?in the messages", re.IGNORECASE),
                  re.compile(r"(?:resulted in|has|contains(?: at least)?) (\d+) (?:input |prompt )?tokens",
                             re.IGNORECASE),
                  re.compile(r"prompt \(length (\d+)\)", re.IGNORECASE)]  # fmt: skip
_REQUESTED = re.compile(r"requested (\d+) tokens", re.IGNORECASE)
_TOO_LONG = re.compile(r"context.length|too long|too many tokens|maximum (?:context|model) length", re.IGNORECASE)
#: how often a prompt is cut again when the judge still refuses it (each cut from its new count of tokens)
MAX_CUTS = 3
#: the fewest characters of a cut field kept (beside its marker): less is no cut but a loss of the field
MIN_KEPT = 64
#: what stands in a cut field for its middle; {n} is the number of characters cut
CUT_MARKER = "\n[... {n} characters cut here to fit the judge's context ...]\n"


def length_overflow(refused: RequestRefused, max_tokens: int) -> tuple[int | None, int | None] | None:
    """(context, prompt tokens) of a refusal for length, each None where the server did not say; None when the
    refusal is for something else (a content filter: cutting would not help)."""
    message = str(refused)
    if refused.status != 413 and not _TOO_LONG.search(message):
        return None
    context = int(found.group(1)) if (found := _CONTEXT.search(message)) else None
    for pattern in _PROMPT_TOKENS:
        if found := pattern.search(message):
            return context, int(found.group(1))
    if found := _REQUESTED.search(message):
        return context, int(found.group(1)) - max_tokens
    return context, None


def _cut_middle(text: str, keep: int) -> str:
    """`text` in at most about `keep` characters: its beginning (a third) and its end (where a final answer is), the
    middle replaced by `CUT_MARKER`, which says so to the judge."""
    if len(text) <= keep:
        return text
    room = max(0, keep - len(CUT_MARKER) - 8)
    head = room // 3
    tail = room - head
    return text[:head] + CUT_MARKER.format(n=f"{len(text) - room:,}") + (text[len(text) - tail :] if tail else "")


def cut_to_fit(config: JudgeConfig, fields: dict[str, str], remove: int) -> dict[str, str] | None:
    """The fields with about `remove` characters fewer in the rendered prompt, taken from the longest ones first
    (every field longer than one cap is cut to it, so a long completion gives before a short question or reference),
    each cut in its middle (`_cut_middle`); None when the fields the prompt uses hold too little to take that many
    and keep `MIN_KEPT` characters of each beside its marker (a marker alone is no part of the rollout to judge)."""
    used = Counter(name for _, name, _, _ in string.Formatter().parse(config.prompt) if name)
    cap = _cap([(len(fields[name]), n) for name, n in used.items()], remove)
    if cap is None:
        return None
    return {name: _cut_middle(value, cap) if name in used else value for name, value in fields.items()}


def _cap(sizes: list[tuple[int, int]], remove: int) -> int | None:
    """The largest length that texts of these (length, times used) lose `remove` characters by being cut to; None
    when that keeps less than `MIN_KEPT` of each beside its marker (or they hold too little)."""
    if not sizes or sum(size * n for size, n in sizes) <= remove:
        return None
    low, high = 0, max(size for size, _ in sizes)
    while low < high:
        cap = (low + high + 1) // 2
        if sum(max(0, size - cap) * n for size, n in sizes) >= remove:
            low = cap
        else:
            high = cap - 1
    return None if low < len(CUT_MARKER) + 8 + MIN_KEPT else low


def cut_messages(messages: Messages, remove: int) -> Messages | None:
    """`messages` with about `remove` characters fewer, the longest texts cut in the middle (`cut_to_fit`'s rule):
    a reward model's conversation longer than its context. None when no cut keeps enough (`_cap`)."""
    texts = [i for i, m in enumerate(messages) if isinstance(m.get("content"), str)]
    cap = _cap([(len(messages[i]["content"]), 1) for i in texts], remove)
    if cap is None:
        return None
    return [{**m, "content": _cut_middle(m["content"], cap)} if i in texts else m for i, m in enumerate(messages)]
