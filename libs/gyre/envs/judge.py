"""LLM judges and reward models as reward functions of a `Rubric` (docs/environments.md, "Judges and reward models").

    from gyre.envs.judge import Judge, RewardModel
    rubric.add(Judge(url="http://127.0.0.1:8001", prompt="...{question}...{response}...", max_score=10))
    rubric.add(RewardModel(url="http://127.0.0.1:8002"), weight=0.5)

or, without code, `[[orchestrator.judges]]` / `[[orchestrator.reward_models]]` (added to the environment's rubric).

A `Judge` renders its prompt from the task and the rollout, asks an OpenAI-compatible server (`gyre.endpoint`:
timeouts, retries, bounded concurrency, counted) and reads a score from the reply: a number (divided by
`max_score`), a choice (word -> reward) or a JSON object's key. Identical calls (same messages, model and
sampling) are answered once: from an LRU cache, and shared while in flight. A reply without a readable score, or
cut at `max_tokens` (finish_reason "length": its verdict never came), is asked again (counted as `unparsed`).
When every attempt fails for the server (no answer, no text) the judge raises `ScoringError`, which the rubric lets
through and the orchestrator counts and scores again: a failed judge is never a silent 0. When every reply came and
none held a verdict, that completion is `Unjudged` (counted as `unreadable`, below), and `MAX_UNREADABLE_IN_A_ROW`
such completions in a row are a `ScoringError` (a judge whose `score` or `choices` are not what it writes).

A rendered prompt longer than the judge's context (a long completion) is refused (400 `context_length_exceeded`,
413): the prompt is rendered again with its longest fields cut in the middle, a marker in their place saying so to
the judge, sized from the counts of tokens the refusal gives (vLLM, Gyre and OpenAI say the context and the
prompt's length), and judged (counted as `cut`, the first logged). It was refused every time and scored 0, so a
long completion never had a grade. A judge that refuses one request for anything else (a hosted API's content
filter), or a prompt no cut fits (too little of the rollout fits beside the template, no room for `max_tokens`,
still refused after `MAX_CUTS` cuts), cannot grade that rollout however often it is asked: the judge raises
`Unjudged`, an ordinary reward-function error, so the rubric scores that function 0 for the sample and names it
in `Score.errors`, and the orchestrator counts it (`reward_errors`, plus `refused` in the judge's `signals`) and
logs the first one. Setup errors (401, 403, 404, or `gyre.endpoint.MAX_REFUSED_IN_A_ROW` refusals in a row) stay
`ScoringError`s that stop the run.

A `RewardModel` scores whole conversations (each assistant message after its reasoning, as a judge's {response})
with a sequence-classification model behind vLLM's `/classify`
(`gyre inference --runner pooling`, or `vllm serve --runner pooling`): each conversation is rendered by the
server's own chat template (`/tokenize` with its messages), and concurrent calls are gathered into batches of up
to `max_batch` token lists per `/classify` request (waiting at most `batch_wait_ms` for others to join). A
conversation longer than the model's context (the `max_model_len` its `/tokenize` answers) is cut like a judge's
prompt, its longest texts in the middle with a marker (`cut`), before it is sent: it was refused and scored 0. A
batch the server refuses for what it holds (a conversation no cut fits) is scored again one conversation at a time,
so only the refused one is `Unjudged` (the others are scored).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
import string
from collections import Counter, OrderedDict
from typing import Any

import openai

from gyre.config.endpoint import JudgeConfig, RewardModelConfig
from gyre.endpoint import MAX_REFUSED_IN_A_ROW, Endpoint, EndpointError, RequestRefused
from gyre.envs.inflight import InFlight
from gyre.envs.parsers import strip_reasoning
from gyre.envs.types import NEUTRAL_SAMPLING, Messages, ScoringError

log = logging.getLogger(__name__)

# The number mode's grammar (docs/environments.md, "Reading a judge's number"). A number: an optional minus sign
# (never a range's dash: the 10 of "0-10" is not -10), digits, and an exponent ("1e1" is 10: it was read as 1). A
# comma between digits is read by what follows it: groups of exactly three digits are thousands ("1,000" is 1000,
# "12,345,678.5" is 12345678.5: "1,000" was read as 1.0), one comma before other digits is a decimal comma ("7,5"
# is 7.5: it was read as 5; "0,25"), and a run of commas is a list ("1,2,3": 1, 2 and 3, like "7, 8"). A number
# never starts inside another's digits or decimal part; a list's element after "1," is read alone (the 2 of
# "1,2,3" is 2, never the 2.3 of a decimal comma).
_THOUSANDS = r"\d{1,3}(?:,\d{3})+(?!,?\d)"  # not "1,0000" nor "1,000,5": a list then
_COMMA_FORMS = rf"(?<!\d[.,])(?:{_THOUSANDS}(?:\.\d+)?|\d+,\d+(?![.,]?\d))"
_DIGITS = rf"(?<!\d)(?:{_COMMA_FORMS}|(?<!\d\.)\d+(?:\.\d+)?)"
_NUM = rf"(?:(?<![\w.,])[-\u2212])?{_DIGITS}(?:[eE][+-]?\d+)?"
#: markdown around a number ("**7**", "`7`"): dropped before reading
_MARKUP = re.compile(r"[*_`]")
#: what the reply may say before its score; the last number after one of these is the score
_LABEL = re.compile(r"\b(?:score|rating|grade)\b[^\w\n]*(?:\b(?:is|of|was|would\s+be|=)\b[^\w\n]*)?$", re.IGNORECASE)
#: a judge declining to grade ("I can't rate this", "I am unable to assign a score"): its numbers are no verdict
_DECLINES = re.compile(r"(?:\b(?:cannot|unable\s+to|not\s+able\s+to|will\s+not|refuse\s+to|decline\s+to|"
                       r"impossible\s+to)|n['\u2019]t)\s+(?:\w+\s+){0,2}?(?:rate|score|grade|evaluate|assess|judge|assign|give|provide)\b",
                       re.IGNORECASE)  # fmt: skip
#: what may follow a bare number that ends the reply: words of a mention of the scale ("7 on a scale of 0-10")
_SCALE_WORDS = re.compile(r"\b(?:on|in|a|the|scale|range|of|from|out|to|points?)\b", re.IGNORECASE)


def _number(text: str) -> float:
    """The value of a number `_NUM` matched: thousands commas dropped, a decimal comma read as a point."""
    text = text.replace("\u2212", "-")
    if re.search(_THOUSANDS, text):
        return float(text.replace(",", ""))
    return float(text.replace(",", "."))


def _terms(reply: str, max_score: float) -> list[tuple[float, float | None, bool, bool]]:
    """The numbers of a reply, each as (value, its scale or None, labelled, last): "8/10", "8 out of 10" and "8 of 10"
    give 8 on a scale of 10, "80%" 80 on a scale of 100; `last`: nothing but punctuation and a mention of the scale
    follows it (it ends the reply: "so: 7."). Mentions of the judge's own scale are not numbers: a bare "/10",
    "out of 10", "of 10", ranges "0-10", "1 to 10" (their lower end too: "7 on a scale of 0-10" is 7) and "a
    10-point scale"."""
    text = _MARKUP.sub("", reply)
    # the top of the scale as the judge may write it: "1000" or "1,000"
    top = rf"(?:{re.escape(f'{max_score:g}')}|{re.escape(f'{max_score:,g}')})(?:\.0+)?(?![.,]?\d)"
    text = re.sub(rf"(?<![\w.])[01](?:\.0+)?\s*(?:-|\u2013|\u2014|\bto\b)\s*{top}", " ", text, flags=re.IGNORECASE)
    # "a 10-point scale": "I can't rate this on a 10-point scale" read as 10, the full reward
    text = re.sub(rf"(?<![\w.]){top}[-\s]?points?\b", " ", text, flags=re.IGNORECASE)
    of = r"(?:/|\bout\s+of\b|\bof\b)"
    pattern = re.compile(rf"(?P<value>{_NUM})(?:\s*{of}\s*(?P<scale>{_NUM})|(?P<percent>\s*%))?|{of}\s*{top}",
                         re.IGNORECASE)  # fmt: skip
    terms = []
    for match in pattern.finditer(text):
        if match.group("value") is None:  # the scale alone: "on a scale of 10"
            continue
        value = _number(match.group("value"))
        scale = match.group("scale")
        scale = _number(scale) if scale else (100.0 if match.group("percent") else None)
        tail = _SCALE_WORDS.sub(" ", re.sub(rf"{of}\s*{top}", " ", text[match.end() :], flags=re.IGNORECASE))
        terms.append((value, scale, bool(_LABEL.search(text[: match.start()])), not re.search(r"\w", tail)))
    return terms


class Unjudged(RuntimeError):
    """The judge or reward model refused to score this rollout (its request, e.g. too long for the model's context):
    a reward-function error (0 for this function, named in `Score.errors`), not a `ScoringError`."""


def _text(content: Any) -> Any:
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
        "question": _text(users[-1].get("content")) if users else "",
        "response": _reply(_text(replies[-1].get("content"))) if replies else "",
        "answer": answer,
        "conversation": "\n".join(f"{m.get('role')}: {_text(m.get('content'))}" for m in prompt + completion),
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
    return _messages(config, fields_of(prompt, completion, answer))


def _messages(config: JudgeConfig, fields: dict[str, str]) -> list[dict]:
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
#: completions in a row whose every reply held no readable verdict before the judge is taken as misconfigured (its
#: `score`, `choices` or prompt not what it writes) and the run stops: as many as refusals in a row
MAX_UNREADABLE_IN_A_ROW = MAX_REFUSED_IN_A_ROW
#: how often a prompt is cut again when the judge still refuses it (each cut from its new count of tokens)
MAX_CUTS = 3
#: the fewest characters of a cut field kept (beside its marker): less is no cut but a loss of the field
MIN_KEPT = 64
#: what stands in a cut field for its middle; {n} is the number of characters cut
CUT_MARKER = "\n[... {n} characters cut here to fit the judge's context ...]\n"


def _overflow(refused: RequestRefused, max_tokens: int) -> tuple[int | None, int | None] | None:
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


def _json_value(reply: str, key: str) -> Any:
    """`key` of the last JSON object in the reply that has it (None if none does). Each `{` is tried as the start
    of an object, so braces in the text around it (LaTeX's \\frac{1}{2}, a set {a, b}) do not hide it."""
    decoder, value = json.JSONDecoder(), None
    for start in (i for i, char in enumerate(reply) if char == "{"):
        try:
            obj, _ = decoder.raw_decode(reply, start)
        except ValueError:
            continue
        if isinstance(obj, dict) and key in obj:
            value = obj[key]
    return value


# The choice mode's verdict rule (docs/environments.md, "Reading a judge's choice"). A choice right after a verdict
# label ("Verdict: incorrect", "the final answer is yes") is the verdict, the last such one; else a choice that opens
# the reply ("Incorrect. The correct answer is 5": a judge leading with its verdict); else the last choice named (a
# judge reasoning first concludes last: "a correct answer would be 5, so it is incorrect" read the first, "correct",
# and rewarded a wrong reply 1). A negated choice ("not correct", "isn't entirely correct", "cannot be correct",
# "nothing incorrect", "no incorrect step") is no vote for it: with two choices it is the other one, with more no
# verdict. It read as the choice it negates: "The response is not correct." rewarded 1, and "The response is correct;
# nothing incorrect in it." 0 (its last choice, "incorrect", under a negation the rule did not know).
_NEGATORS = r"not|never|cannot|no|nothing|none|without"
_NEGATED = re.compile(rf"(?:\b(?:{_NEGATORS})|n't)[\s*_`\"']+(?:(?:be|is|was|are|were)[\s*_`\"']+)?"
                      r"(?:(?:quite|\w+ly)[\s*_`\"']+)?$", re.IGNORECASE)  # fmt: skip
#: what may come before a choice that opens the reply: markdown, punctuation and a negation ("**Not correct.**")
_LEADS = re.compile(rf"[^\w]*(?:(?:{_NEGATORS})[^\w]+)?$", re.IGNORECASE)
#: a choice before one of these nouns is an adjective ("the correct answer") or a determiner ("no errors": a yes/no
#: judge's "It has no errors." read its "no"), not a verdict
_DESCRIBES = re.compile(r"[\s*_`]+(?:answers?|responses?|replies|reply|ones?|solutions?|results?|values?|steps?|"
                        r"errors?|mistakes?|issues?|problems?|flaws?|typos?)\b", re.IGNORECASE)  # fmt: skip
_VERDICT = re.compile(r"\b(?:verdict|judge?ment|decision|conclusion|answer|grade|label|assessment)\b[^\w\n]*"
                      r"(?:\bis\b[^\w\n]*)?$", re.IGNORECASE)  # fmt: skip


def _choice(choices: dict[str, float], reply: str) -> float:
    """The reward of the verdict a reply gives among `choices` (word -> reward), by the rule above; ValueError when
    it gives none. Whole words by lookaround, not \\b: a choice ending in a non-word character ("yes!", "A+") never
    matched \\b before a space. Where two choices overlap the longer is the one named ("A+" over "A")."""
    spans = sorted(((m.start(), m.end(), word) for word in choices
                    for m in re.finditer(rf"(?<!\w){re.escape(word)}(?!\w)", reply, re.IGNORECASE)),
                   key=lambda span: (span[0], -span[1]))  # fmt: skip
    named: list[tuple[str, bool, bool, int, int]] = []  # (choice, negated, labelled, start, end), in reply order
    end = -1
    for start, stop, word in spans:
        if start < end:  # inside a longer choice named here
            continue
        end = stop
        negated = _NEGATED.search(reply, 0, start)
        before = reply[: negated.start() if negated else start]
        named.append((word, negated is not None, _VERDICT.search(before) is not None, start, stop))
    if not named:
        raise ValueError(f"none of {sorted(choices)} in the reply")
    labelled = [one for one in named if one[2]]
    # a choice naming a noun ("the correct answer is cba") describes the reference, not the reply: no conclusion
    verdicts = [one for one in named if not _DESCRIBES.match(reply, one[4])]
    # an opening choice describing a noun ("No errors found, so yes") opens no verdict either
    leads = named[0] in verdicts and _LEADS.match(reply, 0, named[0][3]) is not None
    if not (labelled or leads or verdicts):
        raise ValueError(f"the reply names {sorted({one[0] for one in named})} only before a noun, as no verdict")
    word, negated, *_ = labelled[-1] if labelled else named[0] if leads else verdicts[-1]
    if not negated:
        return float(choices[word])
    others = [other for other in choices if other != word]
    if len(others) != 1:
        raise ValueError(f"the reply says not {word!r}, which names none of the other {len(others)} choices")
    return float(choices[others[0]])


def parse_score(config: JudgeConfig, reply: str) -> float:
    """The reward a judge's reply gives; ValueError saying why when it holds none. A reasoning judge's thinking is no
    part of its verdict (`strip_reasoning`: the text after its last `</think>`): served without a reasoning parser
    (Gyre's server, vLLM without `--reasoning-parser`) its reply holds the whole `<think>` block, and a choice
    considered there ("yes? no: ...") or a labelled number ("a score of 9 at first") was read as the grade."""
    reply = strip_reasoning(reply)
    if config.score == "choice":
        return _choice(config.choices, reply)
    if config.score == "json":
        value = _json_value(reply, config.json_key)
        if isinstance(value, str) and re.fullmatch(rf"\s*{_NUM}\s*", value):
            # {"score": "7"}: a weak judge quotes its number; every such reply was unreadable
            value = _number(value.strip())
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"no JSON object with a number under {config.json_key!r}")
    else:
        terms = _terms(reply, config.max_score)
        if not terms:
            raise ValueError("no number in the reply")
        # the last labelled number ("Score: 7"), else the last one on the judge's scale ("7/10 - misses 2 steps"
        # read 2), else a bare number that ends the reply ("so I'd say 7."), where a judge concludes. Any other
        # number is no verdict: a count in its reasoning, or a judge declining to grade ("I can't score this: it has
        # 2 answers" read 2, "I can't rate this on a 10-point scale" 10, the full reward)
        labelled = [term for term in terms if term[2]]
        on_scale = [term for term in terms if term[1] == config.max_score]
        if not (labelled or on_scale):
            if _DECLINES.search(reply):
                raise ValueError("the judge declined to grade: its numbers are no score")
            if not terms[-1][3]:
                raise ValueError("no score: no number after 'score', 'rating' or 'grade', none on the scale, and "
                                 "more than the scale follows the last number")  # fmt: skip
        value, scale, *_ = (labelled or on_scale or terms)[-1]
        if scale is not None and scale != config.max_score:  # another scale than the judge was asked for
            raise ValueError(f"score {value:g} is on a scale of {scale:g}, not of max_score = {config.max_score:g}")
    try:
        value = float(value)  # a JSON integer of 400 digits: OverflowError (it escaped as a rollout's error, 0)
    except OverflowError:
        raise ValueError(f"score {str(value)[:20]}... is outside 0..{config.max_score:g}") from None
    if not (math.isfinite(value) and 0 <= value <= config.max_score):
        raise ValueError(f"score {value} is outside 0..{config.max_score:g}")
    return value / config.max_score


class Judge:
    """A reward function that asks an LLM judge (see the module docstring). `stats` counts requests, retries,
    timeouts, failures (from the endpoint), cache hits and unparsed replies."""

    #: what `Rubric.judges` looks for (gyre.envs.rubric cannot import this module, which imports it)
    asks_a_served_model = True

    def __init__(
        self,
        config: JudgeConfig | None = None,
        *,
        client: openai.AsyncOpenAI | None = None,
        sampling: dict[str, Any] | None = None,
        **settings: Any,
    ):
        """`client`: an `openai.AsyncOpenAI` to ask through (its key and headers; `Endpoint`'s retries and deadline);
        `sampling`: more keys of each request's body (verifiers' `judge_sampling_args` beyond temperature and
        max_tokens, e.g. `reasoning_effort`)."""
        self.config = config or JudgeConfig(**settings)
        self.__name__ = self.config.name  # the rubric's name for it
        self.sampling = dict(sampling or {})
        # not the judge model's generation_config.json's (vLLM's server fills them from it, Gyre's does not): the same
        # judge gave other verdicts by server; `sampling` sets its own; dropped for a server refusing them (OpenAI's)
        self._pinned = dict(NEUTRAL_SAMPLING)
        self.endpoint = Endpoint(self.config, name=f"judge {self.config.name!r}", client=client)
        self.stats: Counter[str] = self.endpoint.stats
        self._cache: OrderedDict[str, float] = OrderedDict()
        self._inflight = InFlight()
        self._unreadable_in_a_row = 0  # completions with no readable verdict since the last readable one

    async def __call__(self, prompt: Messages, completion: Messages, answer: str) -> float:
        fields = fields_of(prompt, completion, answer)
        messages = _messages(self.config, fields)
        cfg = self.config
        key = hashlib.sha256(json.dumps([cfg.model, messages, cfg.temperature, cfg.max_tokens, cfg.score,
                                         cfg.choices, cfg.json_key, cfg.max_score, self.sampling],
                                        default=str).encode()).hexdigest()  # fmt: skip
        if key in self._cache:
            self.stats["cache_hits"] += 1
            self._cache.move_to_end(key)
            return self._cache[key]
        if key in self._inflight:  # the same call is already on its way: its answer is shared
            self.stats["cache_hits"] += 1
        return await self._inflight.share(key, lambda: self._graded(key, fields, messages))

    async def _graded(self, key: str, fields: dict[str, str], messages: list[dict]) -> float:
        value = await self._grade(fields, messages)
        if self.config.cache_size:
            self._cache[key] = value
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)
        return value

    async def _grade(self, fields: dict[str, str], messages: list[dict]) -> float:
        problem, readable = "", False  # readable: the judge answered text, which held no verdict
        for _ in range(self.config.retries + 1):
            reply, cut, fields, messages, problem = await self._answer(fields, messages)
            if reply is not None:
                readable = readable or bool(reply.strip())  # an empty answer is the server's, as no answer
                if cut:  # its verdict never came: the last number of a reasoning cut short is not a score
                    problem = f"the reply was cut at max_tokens = {self.config.max_tokens} (raise it): {reply[-200:]!r}"
                    self.stats["unparsed"] += 1
                    continue
                try:
                    score = parse_score(self.config, reply)
                except ValueError as error:
                    problem = f"{error}: {reply[:200]!r}"
                else:
                    self._unreadable_in_a_row = 0
                    return score
            self.stats["unparsed"] += 1
        message = f"judge {self.config.name!r}: no score after {self.config.retries + 1} replies ({problem})"
        if not readable:  # no text at all: the server's fault, scored again by the orchestrator
            raise ScoringError(message)
        # The judge read this completion and gave no verdict (a refusal, a ramble, a verdict it never finished): this
        # completion's, as a refused request is. It was a ScoringError, so the sample was generated again and the
        # completions that confuse a judge never reached training; scored again, a judge at temperature 0 answers
        # alike. It is Unjudged: 0 for this function, named in Score.errors, counted (unreadable, reward_errors).
        # A judge no reply of which is readable (score or choices not what it writes) stops the run instead.
        self.stats["unreadable"] += 1
        self._unreadable_in_a_row += 1
        if self._unreadable_in_a_row >= MAX_UNREADABLE_IN_A_ROW:
            raise ScoringError(f"{message}; {self._unreadable_in_a_row} completions in a row had no readable verdict: "
                               "check the judge's score, choices, max_score and prompt (docs/environments.md, "
                               "Reading a judge's number)")  # fmt: skip
        raise Unjudged(f"{message} (scored 0 for this sample: its verdict was unreadable)")

    async def reply(self, fields: dict[str, str]) -> str:
        """The judge's reply, as text, to its prompt filled with `fields` (verifiers' `JudgeRubric.judge`: its reward
        functions read the text themselves), after its reasoning (`strip_reasoning`: what a server with a reasoning
        parser answers as the content; a `"yes" in reply` read the thinking's "yes?"). Failures as a score's: the
        server failing after its retries, or
        answering no text `retries + 1` times, is a `ScoringError`; a refusal of this one prompt (after the cuts
        that fit a long one to the judge's context), or replies that hold nothing after their reasoning (all
        thinking, an unclosed <think>) `retries + 1` times, is `Unjudged` (`unreadable`): that text went to the
        reward functions as "", which read it as a silent "no"."""
        messages = _messages(self.config, fields)
        problem, thinking = "", False
        for _ in range(self.config.retries + 1):
            reply, cut, fields, messages, problem = await self._answer(fields, messages)
            if reply is None:
                self.stats["unparsed"] += 1
                continue
            if reply.strip() and not strip_reasoning(reply).strip():
                self.stats["unparsed"] += 1
                problem, thinking = f"the reply holds nothing after its reasoning: {reply[-200:]!r}", True
                continue
            if cut:  # the reward functions read what came; the cut is counted and said once
                self.stats["length"] += 1
                if self.stats["length"] == 1:
                    log.warning("judge %r: a reply was cut at max_tokens = %d (raise max_tokens in "
                                "judge_sampling_args); further ones are only counted", self.config.name,
                                self.config.max_tokens)  # fmt: skip
            return strip_reasoning(reply)
        message = f"judge {self.config.name!r}: no reply after {self.config.retries + 1} answers ({problem})"
        if thinking:  # the judge answered this prompt and gave no reply: this completion's, as in `_grade`
            self.stats["unreadable"] += 1
            raise Unjudged(f"{message} (scored 0 for this sample: its verdict was unreadable)")
        raise ScoringError(message)

    async def _answer(
        self, fields: dict[str, str], messages: list[dict]
    ) -> tuple[str | None, bool, dict[str, str], list[dict], str]:
        """One answer: its text (None when it holds none, and why), whether it was cut at max_tokens, and the fields
        and messages it answered (a cut prompt is kept for retries). The server's failure is a `ScoringError`."""
        try:
            body, fields, messages = await self._ask(fields, messages)
        except EndpointError as error:
            raise ScoringError(str(error)) from error
        await self._note_model(body)
        try:
            reply = _text(body["choices"][0]["message"]["content"])
            cut = body["choices"][0].get("finish_reason") == "length"
            if not isinstance(reply, str):  # a number or an object: re.search raised TypeError, a 0 for the rollout
                raise TypeError
        except (KeyError, IndexError, TypeError, AttributeError):
            why = f"the answer has no text at choices[0].message.content: {str(body)[:200]!r}"
            return None, False, fields, messages, why
        return reply, cut, fields, messages, ""

    async def _ask(self, fields: dict[str, str], messages: list[dict]) -> tuple[Any, dict[str, str], list[dict]]:
        """The judge's answer to `messages`, and the fields and messages it answered. A prompt refused as longer than
        the judge's context (a long completion) is rendered again with its longest fields cut in the middle, a marker
        saying so (`cut_to_fit`), sized from the counts the refusal gives (`MAX_CUTS` times at most): a long
        completion was refused every time and scored 0 (`Unjudged`). Any other refusal, or one still refused, is
        `Unjudged`."""
        cfg = self.config
        extra = {**self.sampling, **({"response_format": fmt} if (fmt := cfg.response_format()) else {})}
        first: RequestRefused | None = None
        for attempt in range(MAX_CUTS + 1):
            body = {"model": await self.endpoint.model(), "messages": messages, "temperature": cfg.temperature,
                    "max_tokens": cfg.max_tokens, **extra}  # fmt: skip
            try:
                # a cut prompt is another form of the refused one: not counted again toward the refusals in a row
                answer = await self._post(body, again=attempt > 0)
            except RequestRefused as error:  # the same request is refused every time: this rollout's, not the run's
                first = first or error
                overflow = _overflow(error, cfg.max_tokens)
                why = "not a refusal for length" if overflow is None else ""
                if overflow is not None:
                    context, tokens = overflow
                    if context is not None and context <= cfg.max_tokens:
                        why = f"the judge's context of {context} tokens leaves no room for its max_tokens"
                    elif attempt == MAX_CUTS:
                        why = f"still too long after {MAX_CUTS} cuts"
                    else:
                        chars = sum(len(m["content"]) for m in messages)
                        if context and tokens and tokens > 0:  # the share of it that fits, less a tenth to be sure
                            remove = chars - math.floor(chars * (context - cfg.max_tokens) / tokens * 0.9) + 16
                        else:  # the server gave no counts: half of it, then half again
                            remove = chars // 2
                        cut = cut_to_fit(cfg, fields, remove)
                        if cut is None:
                            why = "too little of the rollout fits in the judge's context beside the template"
                        else:
                            fields, messages = cut, _messages(cfg, cut)
                            continue
                raise Unjudged(f"{first} (scored 0 for this sample: {why})") from error
            if attempt:
                self.stats["cut"] += 1
                if self.stats["cut"] == 1:
                    log.warning("judge %r: a prompt of this run is longer than the judge's context (%s); it is judged "
                                "with its longest fields cut in the middle, marked where: further ones are only "
                                "counted (cut in the judge's signals). Serve the judge a longer context to judge "
                                "whole completions", cfg.name, first)  # fmt: skip
            return answer, fields, messages
        raise AssertionError("unreachable")

    async def _post(self, body: dict[str, Any], *, again: bool) -> Any:
        """The answer to `body` with the neutral sampling fields (`NEUTRAL_SAMPLING`) it does not set itself. A hosted
        API that refuses one by name ("Unrecognized request argument supplied: top_k") is asked again without them,
        as are all later requests: it applies no generation config of its own."""
        pinned = self._pinned
        try:
            return await self.endpoint.post("/v1/chat/completions", {**pinned, **body}, again=again)
        except RequestRefused as error:
            named = [key for key in pinned if key not in body and key in str(error)]
            if not named:
                raise
            if self._pinned:
                log.warning("judge %r: its server refuses %s (%s); its requests leave them out", self.config.name,
                            ", ".join(named), error)  # fmt: skip
            self._pinned = {}
            return await self.endpoint.post("/v1/chat/completions", body, again=True)

    async def _note_model(self, body: Any) -> None:
        """Count (`other_model`) and log once an answer from another model than the one asked for: a proxy's
        fallback to another model grades with another judge. A dated snapshot of the name asked for (hosted APIs
        answer gpt-4o-mini-2024-07-18 for gpt-4o-mini) is the same model."""
        answered = body.get("model") if isinstance(body, dict) else None
        asked = await self.endpoint.model()
        if not isinstance(answered, str) or answered.startswith(asked):
            return
        self.stats["other_model"] += 1
        if self.stats["other_model"] == 1:
            log.warning("judge %r asked for model %r and was answered by %r (a proxy's fallback?); its grades are "
                        "used, and further answers are counted (other_model in the signals)", self.config.name, asked,
                        answered)  # fmt: skip

    async def aclose(self) -> None:
        await self.endpoint.aclose()


class RewardModel:
    """A reward function scoring the whole conversation with a served reward model, in batches (module docstring)."""

    asks_a_served_model = True  # see Judge

    def __init__(self, config: RewardModelConfig | None = None, **settings: Any):
        self.config = config or RewardModelConfig(**settings)
        self.__name__ = self.config.name
        self.endpoint = Endpoint(self.config, name=f"reward model {self.config.name!r}")
        self.stats: Counter[str] = self.endpoint.stats
        self._queue: list[tuple[list[int], asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()

    async def __call__(self, messages: Messages) -> float:
        messages = without_reasoning(messages)
        rendered = await self._tokenize(messages)
        tokens, context = rendered["tokens"], rendered.get("max_model_len")
        # A conversation longer than the model's context (its /tokenize says how long that is: vLLM's and Gyre's) was
        # refused by /classify and scored 0 (Unjudged): its longest texts are cut in the middle, marked, as a judge's
        original = len(tokens)
        for _ in range(MAX_CUTS):
            if not (isinstance(context, int) and context > 0 and len(tokens) > context):
                break
            chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
            cut = cut_messages(messages, chars - math.floor(chars * context / len(tokens) * 0.9) + 16)
            if cut is None:
                break  # nothing to cut that would do: /classify refuses it (Unjudged), as before
            messages = cut
            tokens = (await self._tokenize(messages))["tokens"]
        if len(tokens) < original and not (isinstance(context, int) and len(tokens) > context):
            self.stats["cut"] += 1
            if self.stats["cut"] == 1:
                log.warning("reward model %r: a conversation of %d tokens is longer than its context of %s; it is "
                            "scored with its longest texts cut in the middle, marked where: further ones are only "
                            "counted (cut in the signals)", self.config.name, original, context)  # fmt: skip
        future = asyncio.get_running_loop().create_future()
        self._queue.append((tokens, future))
        if len(self._queue) >= self.config.max_batch:
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.config.batch_wait_ms / 1000, self._flush)
        return await future

    async def _tokenize(self, messages: Messages) -> dict:
        """The server's /tokenize answer for a conversation (its own chat template); one without tokens is a
        ScoringError (the server's fault, not the rollout's: never a silent 0)."""
        try:
            body = {"model": await self.endpoint.model(), "messages": messages, "add_generation_prompt": False}
            rendered = await self.endpoint.post("/tokenize", body)
        except RequestRefused as error:
            raise Unjudged(str(error)) from error
        except EndpointError as error:
            raise ScoringError(str(error)) from error
        tokens = rendered.get("tokens") if isinstance(rendered, dict) else None
        if not (isinstance(tokens, list) and tokens):
            self.stats["unparsed"] += 1
            raise ScoringError(f"reward model {self.config.name!r}: /tokenize answered no token list")
        return rendered

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._queue:
            batch, self._queue = self._queue[: self.config.max_batch], self._queue[self.config.max_batch :]
            task = asyncio.get_running_loop().create_task(self._score(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _score(self, batch: list[tuple[list[int], asyncio.Future]]) -> None:
        try:
            body = {"model": await self.endpoint.model(), "input": [tokens for tokens, _ in batch],
                    "use_activation": self.config.activation}  # fmt: skip
            answer = await self.endpoint.post("/classify", body)
            rows = sorted(answer["data"], key=lambda row: row["index"])
            if any(len(row["probs"]) <= self.config.label for row in rows):  # the setting's fault: name it
                raise ValueError(f"label = {self.config.label}, but the classifier has {len(rows[0]['probs'])} "
                                 f"outputs (label counts from 0)")  # fmt: skip
            scores = [float(row["probs"][self.config.label]) for row in rows]
            if len(scores) != len(batch) or not all(math.isfinite(s) for s in scores):
                raise ValueError(f"{len(scores)} scores for {len(batch)} conversations, or a non-finite one")
        except RequestRefused as error:
            if len(batch) > 1:  # one conversation's fault (e.g. too long): each alone, so only that one fails
                await asyncio.gather(*(self._score([one]) for one in batch))
                return
            _, future = batch[0]
            if not future.done():
                future.set_exception(Unjudged(str(error)))  # it names the reward model
            return
        except Exception as error:  # the server's answer, whatever is wrong with it: an OverflowError (a 400-digit
            # integer score) escaped, ended this task and left every call of the batch waiting for ever
            served = isinstance(error, EndpointError)  # its message names the reward model already
            self.stats["unparsed"] += not served
            failure = ScoringError(str(error) if served else f"reward model {self.config.name!r}: {error}")
            for _, future in batch:
                if not future.done():
                    future.set_exception(failure)
            return
        self.stats["batches"] += 1
        for (_, future), score in zip(batch, scores, strict=True):
            if not future.done():
                future.set_result(score)

    async def aclose(self) -> None:
        await self.endpoint.aclose()


def add_to_rubric(
    env: Any,
    judges: list[JudgeConfig],
    reward_models: list[RewardModelConfig],
    *,
    signals: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`[[judges]]` and `[[reward_models]]` joined to the environment's rubric as reward functions (training and
    `gyre eval` alike); returns them by name (each has `stats` and `aclose`). `signals`: ones made for another
    environment of a mix, joined to this one's rubric too (one client, one count, per judge)."""
    from gyre.envs.rubric import Rubric

    if signals is None:
        signals = {judge.name: Judge(judge) for judge in judges}
        signals.update({model.name: RewardModel(model) for model in reward_models})
    made = signals
    if not made:
        return {}
    rubric = getattr(env, "rubric", None)
    if not isinstance(rubric, Rubric):
        raise ValueError(f"judges / reward_models: environment {getattr(env, 'name', env)!r} scores with its own "
                         "code, not a gyre Rubric; add them in the environment instead")  # fmt: skip
    for signal in made.values():
        # no rubric deadline: each request has its own (timeout_s, retries), and a call may wait its turn on the
        # concurrency bound behind many others
        rubric.add(signal, signal.config.weight, name=signal.config.name, timeout_s=None)
    return made


def held_by(envs: dict[str, Any], signals: dict[str, Any]) -> dict[str, Any]:
    """The judges and reward models the environments' rubrics hold beyond `signals` (the configured ones, the
    teacher), by name (`Rubric.judges`: a `JudgeRubric`'s judge by its `judge_model`): the orchestrator and `gyre eval`
    wait for them and count them as configured judges. `envs`: label -> environment. A name already taken (a
    configured judge's, another environment's judge of the same model) is prefixed with the environment's label,
    "<label>/<name>", so each judge's counters stay its own."""
    from gyre.envs.rubric import Rubric

    held: dict[str, Any] = {}
    known = list(signals.values())
    for label, env in envs.items():
        rubric = getattr(env, "rubric", None)
        if not isinstance(rubric, Rubric):
            continue
        for name, judge in rubric.judges().items():
            if any(judge is other for other in known):  # a configured one (joined to the rubric), or shared
                continue
            key = name if name not in signals and name not in held else f"{label}/{name}"
            while key in signals or key in held:
                key += "'"
            held[key] = judge
            known.append(judge)
    return held
