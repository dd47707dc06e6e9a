"""Parsers: pull the answer (and tool calls) out of model text.

`Parser` answers with the last assistant message's text after its reasoning (`<think>` blocks) and tool-call
blocks; `XMLParser(["think", "answer"])` reads tagged fields. Parsers never raise on model output: malformed text
gives None / empty results, which rewards score 0.

The names a verifiers (0.1-0.3) environment calls work as there, so its parser code ports unchanged: `extract_fn`
(applied to the reply, e.g. a boxed-answer extractor), `get_format_reward_func()` (a reward function),
`XMLParser.get_format_str()` (the format for a system prompt), `XMLParser.parse(text).answer` (attribute access to
a field), `get_assistant_messages(completion)`, and `ThinkParser` / `MaybeThinkParser`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from gyre.envs.types import Message, Messages, ToolCall, decode_arguments

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def message_text(message: Message) -> str:
    """A message's text: string content, or the concatenated text parts of list content."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")


def assistant_texts(completion: str | Messages) -> list[str]:
    """Text of every assistant message in order (a plain string counts as one assistant message)."""
    if isinstance(completion, str):
        return [completion]
    return [message_text(m) for m in completion if m.get("role") == "assistant"]


def strip_reasoning(text: str) -> str:
    """The text a reasoning model meant as its reply: what follows its last `</think>`, cut at a `<think>` it
    opened again and never closed.

    Everything before the last `</think>` is reasoning (the opening tag may be in the prompt: Qwen3-style templates
    put `<think>` in the generation prompt), and so is an unclosed `<think>` block (generation cut by max_tokens
    mid-thought), so a number the model only considered while thinking is never graded as its answer.
    """
    _, closed, after = text.rpartition(THINK_CLOSE)
    reply = after if closed else text
    return reply.split(THINK_OPEN, 1)[0]


def split_reasoning(text: str) -> tuple[str | None, str]:
    """`(reasoning, reply)` of a reply whose reasoning is in its text, as a server's reasoning parser returns them
    apart (vLLM's `reasoning_content`; verifiers' renderers): the reply is `strip_reasoning(text)` and the reasoning
    the rest without its `<think>` tags, both stripped. `(None, text)` for a text without reasoning."""
    if THINK_CLOSE not in text and THINK_OPEN not in text:
        return None, text
    reply = strip_reasoning(text)
    _, closed, after = text.rpartition(THINK_CLOSE)
    thought = text[: len(text) - len(after) - len(closed)]
    if THINK_OPEN in after:  # a block opened again and never closed (generation cut mid-thought)
        thought += after.split(THINK_OPEN, 1)[1]
    thought = thought.strip()
    return thought.removeprefix(THINK_OPEN).strip(), reply.strip()


class Parser:
    """Base parser: the answer is the last assistant message's reply text, stripped (None if there is none).

    The reply text is the message without its reasoning (`strip_reasoning`) and tool-call blocks. `extract_fn`
    (verifiers' argument) maps that text to the answer, e.g. a `\\boxed{}` extractor; it returning None or "" is no
    answer. A verifiers parser built with it was a TypeError at load.
    """

    extract_fn: Callable[[str], str | None] | None = None  # also for a subclass whose __init__ skips this one's

    def __init__(self, extract_fn: Callable[[str], str | None] | None = None) -> None:
        self.extract_fn = extract_fn

    def parse(self, text: str) -> str | None:
        text = text.strip()
        return self.extract_fn(text) if self.extract_fn is not None else text

    def get_assistant_messages(self, completion: Messages) -> Messages:
        """verifiers' helper: the assistant messages of a completion."""
        return [m for m in completion if m.get("role") == "assistant"]

    def get_format_reward_func(self) -> Callable[..., float]:
        """A reward function for the parser's format (verifiers' name; a rubric of a ported environment lists
        `parser.get_format_reward_func()`, an AttributeError at load here). The base parser has no format: 1.0."""

        def format_reward_func(completion) -> float:
            return 1.0

        return format_reward_func

    def parse_reply(self, text: str) -> str | None:
        """`parse` of one assistant message's reply text (None when nothing is left)."""
        answer = self.parse(strip_tool_calls(strip_reasoning(text)))
        return answer or None

    def parse_answer(self, completion: str | Messages) -> str | None:
        texts = assistant_texts(completion)
        return self.parse_reply(texts[-1]) if texts else None


class XMLParser(Parser):
    """Reads `<field>...</field>` blocks, e.g. `XMLParser(["think", "answer"])`.

    `parse(text)` maps each field to the stripped content of its LAST block, or None when absent. A block left
    open at the very end of the text (generation cut by max_tokens) still counts, so partial answers get
    partial credit rather than none. The answer (`parse_answer`) is `answer_field`: by default the "answer" field,
    else the last one.
    """

    def __init__(
        self,
        fields: Sequence[str],
        answer_field: str | None = None,
        extract_fn: Callable[[str], str | None] | None = None,
    ) -> None:
        super().__init__(extract_fn)
        if not fields:
            raise ValueError("XMLParser needs at least one field")
        for name in fields:
            if not isinstance(name, str):  # verifiers allows a tuple of alternative tags: TypeError deep in `re`
                raise ValueError(f"XMLParser fields are tag names (str), got {name!r}; tuples of alternative tags "
                                 "(verifiers) are not supported")  # fmt: skip
            if not re.fullmatch(r"[A-Za-z_][\w-]*", name):
                raise ValueError(f"invalid XML field name {name!r}")
        self.fields = list(fields)
        # verifiers' default is the "answer" field wherever it is declared: the last field by default read
        # XMLParser(["answer", "explanation"]) answers as its explanation (a ported reward scored them, silently)
        self.answer_field = answer_field or ("answer" if "answer" in self.fields else self.fields[-1])
        if self.answer_field not in self.fields:
            raise ValueError(f"answer_field {self.answer_field!r} is not one of {self.fields}")
        self._patterns = {
            name: re.compile(rf"<{re.escape(name)}>(.*?)(?:</{re.escape(name)}>|$)", re.DOTALL) for name in fields
        }

    def parse(self, text: str) -> Fields:  # type: ignore[override]
        out = Fields()
        for name, pattern in self._patterns.items():
            matches = pattern.findall(text)
            out[name] = matches[-1].strip() if matches else None
        return out

    def parse_reply(self, text: str) -> str | None:
        """The answer field of one assistant message, through `extract_fn` when given. It is read from the reply
        after its reasoning (`strip_reasoning`), as `Parser` reads it: an `<answer>` block the model only wrote
        while thinking (inside `<think>`, or before a `</think>` whose `<think>` is in the prompt, or in a `<think>`
        cut off by max_tokens) is no answer. A `think` answer field is read from the whole text."""
        reply = text if self.answer_field == "think" else strip_reasoning(text)
        answer = self.parse(reply)[self.answer_field]
        if answer is not None and self.extract_fn is not None:
            answer = self.extract_fn(answer) or None
        return answer

    def get_format_str(self) -> str:
        """The format, for a system prompt (verifiers' name): each field as an empty block, in declared order."""
        return "\n".join(f"<{name}>\n...\n</{name}>" for name in self.fields)

    def get_format_reward_func(self) -> Callable[..., float]:
        """`format_reward` as a reward function named `format_reward_func` (verifiers' name and shape)."""

        def format_reward_func(completion) -> float:
            return self.format_reward(completion)

        return format_reward_func

    def parse_answer(self, completion: str | Messages) -> str | None:
        texts = assistant_texts(completion)
        return self.parse_reply(texts[-1]) if texts else None

    def format(self, **values: str) -> str:
        """Render fields in declared order: `format(answer="42")` -> "<answer>42</answer>"."""
        unknown = set(values) - set(self.fields)
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)}; declared: {self.fields}")
        return "\n".join(f"<{name}>{values[name]}</{name}>" for name in self.fields if name in values)

    def format_reward(self, completion: str | Messages) -> float:
        """Share of assistant messages in which every declared field appears exactly once, properly closed."""
        texts = assistant_texts(completion)
        if not texts:
            return 0.0
        # the close after the open: "</answer>7<answer>" has one of each, and no answer (parse reads "")
        good = sum(
            all(text.count(f"<{name}>") == 1 and text.count(f"</{name}>") == 1
                and text.index(f"<{name}>") < text.index(f"</{name}>") for name in self.fields)
            for text in texts
        )  # fmt: skip
        return good / len(texts)


class Fields(dict):
    """`XMLParser.parse`'s fields: a dict (`fields["answer"]`) whose fields read as attributes too
    (`fields.answer`), as verifiers' parse result does: a ported reward reading `parser.parse(text).answer` was an
    AttributeError, a 0 for every sample. A field that was not declared is an AttributeError naming the fields."""

    def __getattr__(self, name: str) -> str | None:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"{name!r} is not a field of this XMLParser; its fields: {list(self)}") from None


class ThinkParser(Parser):
    """verifiers' `ThinkParser`: for a model that always writes `<think>...</think>` itself. The answer is the text
    after the last `</think>` (through `extract_fn`); a reply without `</think>` has none (None), as in verifiers.
    Its format reward: the share of assistant messages that open with one `<think>` block, close it once and reply
    after it. (Gyre's `Parser` already drops reasoning whether or not it is there: verifiers' `MaybeThinkParser`.)"""

    def parse_reply(self, text: str) -> str | None:
        if THINK_CLOSE not in text:
            return None
        return super().parse_reply(text)

    def get_format_reward_func(self) -> Callable[..., float]:
        def format_reward_func(completion) -> float:
            texts = assistant_texts(completion)
            good = sum(text.strip().startswith(THINK_OPEN) and text.count(THINK_OPEN) == 1
                       and text.count(THINK_CLOSE) == 1 and bool(text.split(THINK_CLOSE)[-1].strip())
                       for text in texts)  # fmt: skip
            return good / len(texts) if texts else 0.0

        return format_reward_func


#: verifiers' `MaybeThinkParser` (reasoning dropped when present, the reply kept either way) is Gyre's `Parser`
MaybeThinkParser = Parser

#: a `\boxed{` as TeX reads it: spaces between a control word and its argument are skipped, so `\boxed {7}` is a
#: box (verifiers' helper and math-verify look for `\boxed{` only: a final `\boxed {7}` was missed, and an earlier
#: `\boxed{5}` read as the answer)
BOXED = re.compile(r"\\boxed\s*\{")


def extract_boxed_answer(text: str) -> str:
    """The content of the last `\\boxed{...}` in `text` (nested braces kept; `\\boxed {...}` too, `BOXED`); the text
    itself when it has none or the box is never closed. verifiers' helper of that name, the usual `extract_fn` of a
    math environment's parser."""
    boxes = list(BOXED.finditer(text))
    if not boxes:
        return text
    depth, begin = 1, boxes[-1].end()
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
    return text


def parse_tool_calls(text: str, id_prefix: str = "call") -> list[ToolCall]:
    """Tool calls written as text: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

    For servers that return the raw completion instead of structured `tool_calls`. A malformed block still
    yields a ToolCall (with `error` set) so the model is told what was wrong instead of being ignored.
    """
    calls = []
    for i, body in enumerate(TOOL_CALL_RE.findall(text)):
        call_id = f"{id_prefix}_{i}"
        try:
            obj: Any = json.loads(body)
        except ValueError as exc:
            calls.append(ToolCall(id=call_id, name="", error=f"tool call is not valid JSON: {exc}"))
            continue
        except RecursionError:  # nested past json's recursion limit: the model is told, the rollout goes on
            calls.append(ToolCall(id=call_id, name="", error="tool call is nested too deeply"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            calls.append(ToolCall(id=call_id, name="", error='tool call must be {"name": str, "arguments": {...}}'))
            continue
        raw = obj.get("arguments")
        if isinstance(raw, dict):
            calls.append(ToolCall(id=call_id, name=obj["name"], arguments=raw, raw_arguments=json.dumps(raw)))
        elif raw is None or isinstance(raw, str):  # arguments sent as a JSON string (OpenAI style) or omitted
            arguments, error = decode_arguments(raw)
            calls.append(ToolCall(id=call_id, name=obj["name"], arguments=arguments, raw_arguments=raw, error=error))
        else:
            calls.append(ToolCall(id=call_id, name=obj["name"], error="arguments must be a JSON object"))
    return calls


def strip_tool_calls(text: str) -> str:
    """The text with its `<tool_call>` blocks removed."""
    return TOOL_CALL_RE.sub("", text)
