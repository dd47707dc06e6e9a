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

A reply is read by `gyre.envs.judge_scores`; what the judge is shown, and the cuts, are
`gyre.envs.judge_prompt`. `RewardModel` (`gyre.envs.reward_model`) is the other served scorer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections import Counter, OrderedDict
from typing import Any

import openai

from gyre.config.endpoint import JudgeConfig, RewardModelConfig
from gyre.endpoint import MAX_REFUSED_IN_A_ROW, Endpoint, EndpointError, RequestRefused
from gyre.envs.inflight import InFlight
from gyre.envs.judge_prompt import MAX_CUTS, Unjudged, cut_to_fit, fields_of, judge_messages, length_overflow, text_of
from gyre.envs.judge_scores import parse_score
from gyre.envs.parsers import strip_reasoning
from gyre.envs.reward_model import RewardModel
from gyre.envs.types import NEUTRAL_SAMPLING, Messages, ScoringError

log = logging.getLogger(__name__)

#: completions in a row whose every reply held no readable verdict before the judge is taken as misconfigured (its
#: `score`, `choices` or prompt not what it writes) and the run stops: as many as refusals in a row
MAX_UNREADABLE_IN_A_ROW = MAX_REFUSED_IN_A_ROW


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
        messages = judge_messages(self.config, fields)
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
        messages = judge_messages(self.config, fields)
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
            reply = text_of(body["choices"][0]["message"]["content"])
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
                overflow = length_overflow(error, cfg.max_tokens)
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
                            fields, messages = cut, judge_messages(cfg, cut)
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
