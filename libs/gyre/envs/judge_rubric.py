"""verifiers' `JudgeRubric` (0.1-0.3), for environments ported with `import gyre.envs as vf`, asking through Gyre's
judge (`gyre.envs.judge.Judge`: timeouts, retries, bounded concurrency, counters, long prompts cut to the judge's
context, failures as Gyre's judges report them).

    rubric = vf.JudgeRubric(judge_client=AsyncOpenAI(base_url="http://judge:8000/v1", api_key="..."),
                            judge_model="judge-model", judge_prompt="...{question}...{answer}...{response}...")

    async def correct(judge, prompt, completion, answer, state) -> float:
        return 1.0 if "yes" in (await judge(prompt, completion, answer, state)).lower() else 0.0

    rubric.add_reward_func(correct)

`await rubric.judge(prompt, completion, answer, state)` is the judge's reply text; it is kept per rollout in
`state["judge_response"]` (keyed by the rendered prompt, as verifiers does), and reward functions of one rollout
that ask at once share one request: the judge is asked once per rollout however many functions read it.
docs/environments.md, "Porting a verifiers 0.1-0.3 environment", says what differs from verifiers.
"""

from __future__ import annotations

import os
from typing import Any

import openai
from pydantic import ValidationError

from gyre.config.endpoint import JudgeConfig
from gyre.envs.inflight import InFlight
from gyre.envs.judge import Judge
from gyre.envs.judge_prompt import text_of
from gyre.envs.parsers import Parser
from gyre.envs.rubric import REWARD_TIMEOUT_S, RewardFunc, Rubric
from gyre.envs.types import Messages

#: verifiers' default judge prompt (a yes / no verdict on the response against the ground truth)
DEFAULT_JUDGE_PROMPT = """Given a ground truth answer \
and a response, determine if the response is correct.

Question:
```
{question}
```

Ground truth answer:
```
{answer}
```

Response:
```
{response}
```

Respond either "yes" or "no" only."""

#: request keys a judge's sampling args may not set: Gyre sets them (the model, the prompt) or cannot read the answer
_NOT_SAMPLING = ("model", "messages", "stream", "n")


class JudgeRubric(Rubric):
    """A rubric whose reward functions may take `judge` (and `judge_client`, `judge_model`, `judge_prompt`,
    `judge_sampling_args`) by name, as verifiers' (module docstring)."""

    def __init__(
        self,
        parser: Parser | None = None,
        parallelize_scoring: bool = False,  # verifiers' switch; Gyre scores a rollout's functions concurrently
        judge_client: openai.AsyncOpenAI | openai.OpenAI | None = None,
        judge_model: str = "gpt-4.1-nano",
        judge_sampling_args: dict[str, Any] | None = None,
        judge_prompt: str = DEFAULT_JUDGE_PROMPT,
        funcs: list[RewardFunc] | None = None,
        weights: list[float] | None = None,
        timeout_s: float | None = REWARD_TIMEOUT_S,
        startup_timeout_s: float | None = None,  # Gyre's (not verifiers'): the wait for the judge's server at start
    ) -> None:
        self.judge_client = _async_client(judge_client)
        self.judge_model = judge_model
        self.judge_prompt = judge_prompt
        self.judge_sampling_args = dict(judge_sampling_args or {})
        #: the Gyre judge asked through (its `stats` count requests, retries, timeouts, failures; `aclose`)
        self.gyre_judge = _gyre_judge(self.judge_client, judge_model, judge_prompt, self.judge_sampling_args,
                                      startup_timeout_s)  # fmt: skip
        self._inflight = InFlight()  # by (id of a rollout's state, rendered prompt)
        self.class_objects = {"judge": self.judge, "judge_client": self.judge_client, "judge_model": judge_model,
                              "judge_prompt": judge_prompt,
                              "judge_sampling_args": self.judge_sampling_args}  # fmt: skip
        super().__init__(funcs, weights, parser, timeout_s)

    async def judge(self, prompt: Messages | str, completion: Messages | str, answer: str,
                    state: dict[str, Any] | None = None, **kwargs: Any) -> str:  # fmt: skip
        """The judge's reply text for this rollout: its prompt filled with the last prompt message (`question`), the
        reference (`answer`) and the parser's answer from the completion (`response`; "" when it finds none).
        Asked once per rollout and prompt (kept in `state["judge_response"]`); the server failing after its retries
        is a `ScoringError` (scored again, never a 0) and a refusal of this prompt `Unjudged` (0 for the function
        that asked, named in `Score.errors`), as every Gyre judge."""
        if isinstance(prompt, list):
            question = text_of(prompt[-1].get("content")) if prompt and isinstance(prompt[-1], dict) else ""
        else:
            question = str(prompt)
        response = self.parser.parse_answer(completion)
        conversation = prompt + completion if isinstance(prompt, list) and isinstance(completion, list) else []
        fields = {"question": str(question), "answer": str(answer), "response": "" if response is None else response,
                  "conversation": "\n".join(f"{m.get('role')}: {text_of(m.get('content'))}"
                                            for m in conversation)}  # fmt: skip
        rendered = self.judge_prompt.format(**fields)
        cached = state.get("judge_response") if state is not None else None
        if isinstance(cached, dict) and rendered in cached:
            return cached[rendered]
        if state is None:
            return await self.gyre_judge.reply(fields)
        # the first function of this rollout to ask sends the request; the others wait for its answer
        reply = await self._inflight.share((id(state), rendered), lambda: self.gyre_judge.reply(fields))
        cached = state.get("judge_response")
        if not isinstance(cached, dict):
            cached = state["judge_response"] = {}
        cached[rendered] = reply
        return reply

    def judges(self) -> dict[str, object]:
        """Its judge, named by `judge_model` (the orchestrator waits for its server and counts its calls as a
        configured judge's: `Rubric.judges`), beside any the rubric holds as reward functions."""
        return {self.judge_model: self.gyre_judge, **super().judges()}

    async def aclose(self) -> None:
        await self.gyre_judge.aclose()


def _async_client(client: openai.AsyncOpenAI | openai.OpenAI | None) -> openai.AsyncOpenAI:
    """The judge's client: the one given (a sync `openai.OpenAI`, as verifiers 0.1 took, as an async one with its
    URL, key, organization and project); without one, verifiers' default `AsyncOpenAI()` only where
    OPENAI_BASE_URL names a server (api.openai.com is not assumed: a Gyre cluster may have no way out)."""
    if isinstance(client, openai.AsyncOpenAI):
        return client
    if isinstance(client, openai.OpenAI):
        return openai.AsyncOpenAI(api_key=client.api_key, organization=client.organization, project=client.project,
                                  base_url=client.base_url)  # fmt: skip
    if client is not None:
        raise ValueError(f"JudgeRubric: judge_client must be an openai.AsyncOpenAI, got {type(client).__name__}")
    if os.environ.get("OPENAI_BASE_URL"):
        return openai.AsyncOpenAI(api_key=os.environ.get("OPENAI_API_KEY") or "unused")
    raise ValueError("JudgeRubric: no judge_client; pass judge_client=openai.AsyncOpenAI(base_url='http://<judge "
                     "server>/v1', api_key=...) and judge_model=<its model>, or set OPENAI_BASE_URL (verifiers' "
                     "default, api.openai.com, is not assumed)")  # fmt: skip


def _gyre_judge(
    client: openai.AsyncOpenAI, model: str, prompt: str, sampling_args: dict[str, Any], startup_timeout_s: float | None
) -> Judge:
    """A Gyre `Judge` asking `model` through `client`. verifiers' sampling args map onto its settings: temperature
    (unset: 0, Gyre's judges'), max_tokens or max_completion_tokens (unset: Gyre's judges' 256), timeout (seconds
    per request); extra_body's keys and any other key go into each request's body. The client's own timeout and
    max_retries are kept where set (openai's defaults, 600 s and 2, give way to Gyre's judges', 60 s and 3).
    `startup_timeout_s` (unset: a configured judge's default) bounds the wait for its server before the first
    rollout."""
    args = dict(sampling_args)
    refused = [key for key in _NOT_SAMPLING if key in args]
    if refused:
        raise ValueError(f"JudgeRubric: judge_sampling_args may not set {', '.join(refused)} (Gyre sets the model and "
                         "prompt and reads one whole answer)")  # fmt: skip
    settings: dict[str, Any] = {"url": str(client.base_url), "model": model, "prompt": prompt, "name": model}
    if (temperature := args.pop("temperature", None)) is not None:
        settings["temperature"] = temperature
    tokens = [args.pop(key, None) for key in ("max_tokens", "max_completion_tokens")]
    if (max_tokens := next((t for t in tokens if t is not None), None)) is not None:
        settings["max_tokens"] = max_tokens
    timeout = args.pop("timeout", None)
    if timeout is None and not _default(client.timeout, openai.DEFAULT_TIMEOUT):
        timeout = client.timeout.read if hasattr(client.timeout, "read") else client.timeout
    if timeout is not None:
        settings["timeout_s"] = timeout
    if startup_timeout_s is not None:
        settings["startup_timeout_s"] = startup_timeout_s
    if client.max_retries != openai.DEFAULT_MAX_RETRIES:
        settings["retries"] = client.max_retries
    sampling = {**(args.pop("extra_body", None) or {}), **args}
    try:
        config = JudgeConfig(**settings)
    except ValidationError as error:
        where = {"prompt": "judge_prompt", "url": "judge_client's base_url", "model": "judge_model",
                 "name": "judge_model", "startup_timeout_s": "startup_timeout_s"}  # fmt: skip
        problems = "; ".join(f"{where.get(str(e['loc'][0]), 'judge_sampling_args ' + str(e['loc'][0]))}: {e['msg']}"
                             for e in error.errors() if e["loc"])  # fmt: skip
        raise ValueError(f"JudgeRubric: {problems or error}") from None
    return Judge(config, client=client, sampling=sampling)


def _default(value: Any, default: Any) -> bool:
    return value == default or value is openai.NOT_GIVEN
