"""Settings of the other models a run takes signals from: LLM judges, reward models and a distillation teacher.

Each is an OpenAI-compatible endpoint (another `gyre inference`, a vLLM server or a hosted API). API keys never
live in config files: `api_key_env` names an environment variable and `api_key_file` a file (a mounted Kubernetes
Secret) that holds the key; a key under any other name is refused. docs/environments.md ("Judges and reward
models") and docs/algorithms.md ("On-policy distillation") explain each field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from gyre.config.loader import Section

DEFAULT_JUDGE_PROMPT = """You grade answers. Question:
{question}

Reference answer:
{answer}

Answer to grade:
{response}

How good is the answer, from 0 (wrong) to 10 (matches the reference)? Reply with the number only."""


#: `startup_timeout_s` in `gyre eval` unless set: one evaluation is not worth a training run's 30 min wait
EVAL_STARTUP_TIMEOUT_S = 300.0

#: routes the client adds to the URL itself (a URL ending in one was pasted from an API's docs)
_ROUTES = ("/chat/completions", "/completions", "/classify", "/tokenize", "/models", "/inference/v1/generate")


def route_problem(url: str) -> str | None:
    """What to write instead of a URL that ends in an API route the client adds itself (pasted from an API's docs:
    `.../v1/chat/completions` was sent to `.../v1/chat/completions/v1/chat/completions`, a 404 at the first call);
    None for a server's root or OpenAI base. Shared by every setting that names an OpenAI-compatible server."""
    from urllib.parse import urlsplit

    try:
        path = urlsplit(url).path.rstrip("/")
    except ValueError:
        return None  # not a URL at all: the setting's own check says so
    route = next((r for r in _ROUTES if path.endswith(r)), None)
    if route is None:
        return None
    return (f"{url!r} ends in the route {route}, which the client adds itself: give the server's root or its /v1 "
            f"base ({url[: url.rfind(route)]})")  # fmt: skip


class EndpointConfig(Section):
    """An OpenAI-compatible server: where it is, which model, how to authenticate, how patiently to call it."""

    url: str = Field(
        description="The server: its root (http://judge:8000, no path: the OpenAI routes are under /v1) or its OpenAI "
        "base URL as the openai client takes it (https://api.openai.com/v1, "
        "https://generativelanguage.googleapis.com/v1beta/openai)."
    )
    model: str | None = Field(None, description="Model id sent in requests (default: the first of /v1/models).")
    api_key_env: str | None = Field(None, description="Environment variable holding the API key (never the key).")
    api_key_file: str | None = Field(None, description="File holding the API key, e.g. a mounted Secret.")
    # allow_inf_nan=False here and below: an infinite deadline was accepted (a judge that hangs held the run for ever),
    # and so were max_score = inf (every grade read as 0) and batch_wait_ms = inf (a partial batch never sent)
    timeout_s: float = Field(
        60.0, gt=0, allow_inf_nan=False, description="Deadline of one request's whole answer; past it, retried."
    )
    retries: int = Field(
        3,
        ge=0,
        description="Retries of a request (timeouts, connection errors, answers that are not JSON, 5xx, 429, 408, "
        "409), after a jittered backoff doubling up to 30 s (or a 429/503's Retry-After, up to 60 s).",
    )
    max_concurrency: int = Field(16, ge=1, description="Requests in flight to this endpoint at once.")
    startup_timeout_s: float = Field(
        1800.0,
        ge=0,
        allow_inf_nan=False,
        description="Before the first rollout (and gyre eval's first score; there "
        f"{EVAL_STARTUP_TIMEOUT_S:g} s unless set), wait this long for the server's /v1/models to answer (a model "
        "still loading: connection refused, 5xx, 429), logged every 30 s, then fail; 401, 403, 404 and a host name "
        "that does not resolve fail at once. 0 = don't wait (nor ask).",
    )

    @field_validator("url")
    @classmethod
    def _a_url(cls, value: str) -> str:
        # without a scheme the client failed each call as a retried "Connection error.", naming nothing
        if not value.startswith(("http://", "https://", "server:")):
            raise ValueError(f"{value!r} is not an http(s) URL: give http://host:port or https://host/v1 (or, in "
                             "gyre rl, server:<name> of a [[servers]] entry)")  # fmt: skip
        if value.startswith("server:"):
            return value
        from urllib.parse import urlsplit

        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 (a port that is not a number raises here)
        except ValueError as error:
            raise ValueError(f"{value!r} is not a valid URL ({error})") from None
        if not parts.hostname:  # "http://" or "http://:8000": every call failed as a retried connection error
            raise ValueError(f"{value!r} names no host: give http://host:port or https://host/v1")
        if problem := route_problem(value):
            raise ValueError(problem)
        return value

    @model_validator(mode="before")
    @classmethod
    def _no_key_in_files(cls, data: Any) -> Any:
        if isinstance(data, dict) and "api_key" in data:
            raise ValueError("api_key: keys never go in config files; set api_key_env (an environment variable "
                             "name) or api_key_file (a file, e.g. a mounted Secret)")  # fmt: skip
        return data

    @model_validator(mode="after")
    def _one_key_source(self) -> EndpointConfig:
        if self.api_key_env and self.api_key_file:
            raise ValueError("give api_key_env or api_key_file, not both")
        return self

    @property
    def root(self) -> str:
        """The server's root URL (where vLLM's /classify and /inference/v1/generate live)."""
        url = self.url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    @property
    def base_url(self) -> str:
        """The OpenAI base URL: the URL as given when it has a path (…/v1, or another API's base: Gemini's
        …/v1beta/openai got /v1 appended, a 404 at the first call), else the root's /v1."""
        from urllib.parse import urlsplit

        url = self.url.rstrip("/")
        return url if urlsplit(url).path else f"{url}/v1"

    def api_key(self) -> str | None:
        """The key from the environment variable or the file; ValueError naming the setting when it is missing."""
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if key is None:
                raise ValueError(f"api_key_env: the environment variable {self.api_key_env} is not set")
            if not key.strip():  # set from an empty Secret: every call went out as "unused" and stopped on a 401
                raise ValueError(f"api_key_env: the environment variable {self.api_key_env} is empty")
            return key.strip()
        if self.api_key_file:
            try:
                key = Path(self.api_key_file).read_text().strip()
            except OSError as error:
                raise ValueError(f"api_key_file: cannot read {self.api_key_file} ({error.strerror})") from None
            if not key:  # an empty Secret: every call went out without a key and the run died on a 401 later
                raise ValueError(f"api_key_file: {self.api_key_file} is empty")
            return key
        return None


class JudgeConfig(EndpointConfig):
    """An LLM judge: a reward function that asks a served model to grade a rollout."""

    name: str = Field("judge", min_length=1, description="Reward function name (in rewards, dumps and metrics).")
    weight: float = Field(
        1.0, allow_inf_nan=False, description="Weight in the reward (0 = logged and evaluated, not rewarded)."
    )
    prompt: str = Field(
        DEFAULT_JUDGE_PROMPT,
        description="User message template: {question} (the task's last user message), {response} (the rollout's "
        "last assistant message, after its reasoning: the text after its last </think>), {answer} (the reference), "
        "{conversation} (the whole rollout as text).",
    )
    system: str | None = Field(None, description="System message sent before the prompt.")
    score: Literal["number", "choice", "json"] = Field(
        "number",
        description="How the reply becomes a reward: number (its score divided by max_score: the last number after "
        "'score', 'rating' or 'grade', else the last on the scale (7/10), else a bare number ending the reply; a judge "
        "declining to grade gives none; '7,5' is 7.5, '8/10' "
        "and '8 out of 10' are 8 on a scale that must be max_score: docs/environments.md, Reading a judge's number), "
        "choice (the verdict among `choices`, whole word, case-insensitive: the last one after a label such as "
        "'Verdict:', else one opening the reply, else the last named; 'not X' is the other of two choices: "
        "docs/environments.md, Reading a judge's choice), json (a JSON object's json_key).",
    )
    max_score: float = Field(
        10.0, gt=0, allow_inf_nan=False, description="number/json: the top of the judge's scale (reward = n / max)."
    )
    choices: dict[str, Annotated[float, Field(allow_inf_nan=True)]] = Field(  # refused by _choices_readable, by word
        default_factory=dict, description="choice: word -> reward, e.g. yes = 1."
    )
    json_key: str = Field("score", description="json: the key holding the score.")
    structured: bool = Field(
        False,
        description="json: ask the server to constrain the reply to {json_key: number in 0..max_score} "
        "(response_format json_schema: served by vLLM, Gyre and OpenAI).",
    )
    temperature: float = Field(0.0, ge=0, allow_inf_nan=False, description="Judge sampling temperature.")
    max_tokens: int = Field(256, ge=1, description="Longest judge reply.")
    cache_size: int = Field(
        4096, ge=0, description="Identical judge calls answered from memory (0 = off); also shared while in flight."
    )

    @field_validator("prompt")
    @classmethod
    def _known_fields(cls, value: str) -> str:
        import string

        # a bare {} (name "") is a positional field: it passed here and failed every render, scoring 0
        fields = [(name, conversion, spec) for _, name, spec, conversion in string.Formatter().parse(value)
                  if name is not None]  # fmt: skip
        names = {name for name, _, _ in fields}
        unknown = names - {"question", "response", "answer", "conversation"}
        if unknown:
            shown = ", ".join("{" + name + "}" for name in sorted(unknown))
            raise ValueError(
                f"unknown placeholders {shown}: use {{question}}, {{response}}, {{answer}}, {{conversation}}; write a "
                'literal brace twice ({{ and }}), e.g. Reply with {{"score": 7}}'
            )
        # {response:d} or {answer!x} passed and failed every render: each rollout scored 0 as a reward error
        odd = ["{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
               for name, conversion, spec in fields if conversion or spec]  # fmt: skip
        if odd:
            raise ValueError(f"placeholders take no conversion or format ({', '.join(odd)}): write them bare, as "
                             "{response}; a literal brace is written twice")  # fmt: skip
        return value

    @field_validator("choices")
    @classmethod
    def _choices_readable(cls, value: dict[str, float]) -> dict[str, float]:
        import math

        for word, reward in value.items():
            if not word.strip():  # "" matched at the start of every reply: every rollout got its reward
                raise ValueError(f"choice {word!r} is empty: give the word the judge answers with")
            if not math.isfinite(reward):
                raise ValueError(f"choice {word!r}: its reward must be a finite number, got {reward}")
        return value

    @model_validator(mode="after")
    def _choices_for_choice(self) -> JudgeConfig:
        if self.score == "choice" and not self.choices:
            raise ValueError("score = 'choice' needs choices (word -> reward), e.g. {yes = 1.0, no = 0.0}")
        # a key of another mode was ignored: choices without score = 'choice' read the judge's "yes" as a number
        # (none: every reply unparsed, the run stopped after its rollouts were made), a json_key as no key. By value,
        # not by the keys set: a config written back whole (`gyre rl`'s children, the chart) holds every default
        if self.choices and self.score != "choice":
            raise ValueError(f"choices are read by score = 'choice' only, but score = '{self.score}': set "
                             "score = 'choice', or leave choices out")  # fmt: skip
        if self.json_key != "score" and self.score != "json":
            raise ValueError(f"json_key is read by score = 'json' only, but score = '{self.score}': set "
                             "score = 'json', or leave json_key out")  # fmt: skip
        if self.structured and self.score != "json":
            raise ValueError("structured = true constrains a JSON reply: it needs score = 'json'")
        return self

    def response_format(self) -> dict | None:
        """The `response_format` of a structured judge (None otherwise)."""
        if not self.structured:
            return None
        whole = float(self.max_score).is_integer()  # an integer scale: no endless decimals from a weak judge
        number = {"type": "integer" if whole else "number", "minimum": 0,
                  "maximum": int(self.max_score) if whole else self.max_score}  # fmt: skip
        schema = {"type": "object", "properties": {self.json_key: number}, "required": [self.json_key],
                  "additionalProperties": False}  # fmt: skip
        return {"type": "json_schema", "json_schema": {"name": "score", "schema": schema, "strict": True}}


class RewardModelConfig(EndpointConfig):
    """A reward model (sequence classification) served on vLLM's /classify: scores whole conversations in batches."""

    name: str = Field("reward_model", min_length=1, description="Reward function name.")
    weight: float = Field(1.0, allow_inf_nan=False, description="Weight in the reward (0 = logged, not rewarded).")
    label: int = Field(0, ge=0, description="Which output of the classifier is the score.")
    activation: bool = Field(
        False, description="false: the raw logit (Bradley-Terry reward); true: the server's sigmoid/softmax."
    )
    max_batch: int = Field(32, ge=1, description="Conversations per /classify request.")
    batch_wait_ms: float = Field(
        20.0, ge=0, allow_inf_nan=False, description="How long a request waits for others to fill its batch."
    )


class TeacherConfig(EndpointConfig):
    """On-policy distillation: the teacher model's log-probs of every token the student sampled."""

    route: Literal["generate", "completions"] = Field(
        "generate",
        description="generate: the tokens-in route /inference/v1/generate (Gyre, recent vLLM); completions: "
        "/v1/completions with token-id prompts (any vLLM).",
    )
