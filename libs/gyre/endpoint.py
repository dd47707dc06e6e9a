"""`Endpoint`: calls to an OpenAI-compatible server that a run takes signals from (judge, reward model, teacher).

One small client for all three, over the official `openai` client (auth, timeouts, HTTP errors as exceptions):

- **bounded concurrency**: at most `max_concurrency` requests in flight;
- **timeouts and retries**: a timeout (`timeout_s` bounds the whole answer, not each read), connection error,
  answer that is not JSON, 5xx, 429, 408 or 409 is retried after a jittered exponential backoff (at most
  `MAX_BACKOFF_S`; or the `Retry-After` a 429/503 asks for, up to a minute, when that is longer), `retries` times;
  a 4xx fails at once. A 400, 413 or 422 refuses what the request holds (a sample too long for the server's
  context, a token out of its vocabulary) and raises `RequestRefused`: the caller may skip that one sample (the
  teacher, a judge) instead of stopping the run. Any other 4xx (401, 403, 404: a key, a model, a URL) is the
  configuration's fault, and so are `MAX_REFUSED_IN_A_ROW` refusals with no success between them (a judge
  asking for what the server never serves, a teacher of another vocabulary): both raise a plain
  `EndpointError`, which stops the run with the reason;
- **a rotated key is taken up**: a 401 or 403 re-reads the key (`api_key_file`, `api_key_env`) and, when it has
  changed since the request was sent, asks once more with the new one: a Kubernetes Secret updated in place (the
  kubelet rewrites the mounted file) reached a running orchestrator only through a restart, and every call failed
  meanwhile. A key that has not changed, or a second refusal, fails as any 401/403 does, naming the setting;
- **counted**: `stats` counts requests, successes, retries, timeouts and failures, read by the orchestrator
  into its step events and metrics (a judge that keeps timing out is visible, not silent);
- failures raise `EndpointError` (the caller decides: a rubric turns it into a `ScoringError`);
- **waited for at start**: `wait_ready` (all of a run's endpoints: `wait_all_ready`) asks `/v1/models` until it
  answers, up to `startup_timeout_s`: a judge pod still loading its model (the Helm chart starts it beside the
  orchestrator) failed the first rollouts' scoring, and after `retries` and `sample_attempts` stopped the run.

The server is given by `EndpointConfig.url` (its root, or its OpenAI base URL: /v1 or another API's); `post(path,
body)` takes a path from the root (`/v1/chat/completions`, sent under the OpenAI base; `/classify`,
`/inference/v1/generate`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import socket
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import openai

from gyre.config.endpoint import EndpointConfig

log = logging.getLogger(__name__)

_RETRYABLE = (openai.APIConnectionError, openai.InternalServerError, openai.RateLimitError)
#: other statuses worth another try, as the openai client's own rule: a proxy's 408 Request Timeout, 409 Conflict
_RETRYABLE_STATUSES = frozenset({408, 409})


#: statuses that refuse what one request holds (OpenAI's and vLLM's context-length error is a 400), not the setup
REFUSED_STATUSES = frozenset({400, 413, 422})
#: the longest `Retry-After` honoured (a larger one is waited this long, then retried)
MAX_RETRY_AFTER_S = 60.0
#: the longest backoff between two attempts: a server down for longer is waited for with more `retries`, not with
#: longer sleeps (the exponential backoff of retries = 20 was a sleep of up to three days before the last attempt)
MAX_BACKOFF_S = 30.0
#: this many refusals in a row, none answered between them: the configuration is at fault, not the samples
MAX_REFUSED_IN_A_ROW = 16
#: how often `wait_ready` asks a server that is not up yet
READY_POLL_S = 2.0
#: how often `wait_ready` says it still waits: one line at the start only left a wait of up to startup_timeout_s
#: (30 min) looking like a hang, above all in `gyre eval`
READY_LOG_S = 30.0
# getaddrinfo's "no such name" answers (a temporary DNS failure, EAI_AGAIN, is waited out)
_NO_SUCH_HOST = frozenset(getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, name))


def unknown_host(error: BaseException) -> bool:
    """Whether `error` was caused by a host name that does not resolve (the gaierror httpx wraps, twice)."""
    seen: BaseException | None = error
    for _ in range(16):  # bounded: a chain can loop back on itself
        if seen is None:
            break
        if isinstance(seen, socket.gaierror):
            return seen.errno in _NO_SUCH_HOST
        seen = seen.__cause__ or seen.__context__
    return False


class EndpointError(RuntimeError):
    """A request failed for good: refused (4xx), or every attempt failed."""


class RequestRefused(EndpointError):
    """The server refused what this one request holds (400, 413, 422); another request may well be answered."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class RotatingKey:
    """A bearer key read from a file or an environment variable, read again after a 401 or 403: when it has changed
    since the refused request was sent (a Kubernetes Secret updated in place: the kubelet rewrites the mounted file),
    the caller asks once more with the new one (`value`). Shared by `Endpoint` and the policy's inference client."""

    def __init__(self, key: str | None, reread: Callable[[], str | None] | None, *, name: str, setting: str):
        self.value = key
        self.name = name
        self.setting = setting
        self._reread = reread  # None: a key given as such (or none), nothing to read again

    def rekey(self, status: int, sent: str | None) -> bool:
        """After a `status` answer to a request sent with the key `sent`: whether to ask again, with `value` (the key
        re-read has changed). False for any status but 401 and 403 and for a key not read from anywhere;
        ValueError naming the setting when the key can no longer be read."""
        if status not in (401, 403) or self._reread is None:
            return False
        fresh = self._reread()
        if fresh is None or fresh == sent:  # None: not read from a file (nor a variable) after all
            return False
        if fresh != self.value:  # another request may have taken the new key up already
            self.value = fresh
            log.info("%s: the key changed (%s re-read after a %d); asking again with it", self.name, self.setting,
                     status)  # fmt: skip
        return True


class Endpoint:
    """Calls to one OpenAI-compatible server; safe to use from many tasks at once (one event loop)."""

    def __init__(
        self, config: EndpointConfig, *, name: str, backoff_s: float = 0.5, client: openai.AsyncOpenAI | None = None
    ):
        """`client`: an `openai.AsyncOpenAI` the caller made (a ported verifiers `JudgeRubric`'s `judge_client`): its
        key and headers are used, with this endpoint's retries, deadline and concurrency bound; it is not closed."""
        self.config = config
        self._given = client
        self.name = name
        self.backoff_s = backoff_s
        self.stats: Counter[str] = Counter()
        if config.url.startswith("server:"):  # every call failed as a retried "Connection error." naming nothing
            raise ValueError(f"{name}: url = {config.url!r} names a server that only gyre rl and the Helm chart "
                             "resolve ([[servers]]); run directly, give its http(s) URL")  # fmt: skip
        try:
            key = config.api_key()  # before anything runs
        except ValueError as error:  # whose key: several judges, reward models and a teacher each name one
            raise ValueError(f"{name}: {error}") from None
        setting = "api_key_env" if config.api_key_env else "api_key_file"
        self._keys = RotatingKey(key, config.api_key if config.api_key_env or config.api_key_file else None,
                                 name=name, setting=setting)  # fmt: skip
        self._client: openai.AsyncOpenAI | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._model: asyncio.Future | None = None
        self._model_waiting = 0  # callers awaiting `_model` now
        self._refused_in_a_row = 0

    def _openai(self) -> openai.AsyncOpenAI:
        if self._client is None and self._given is not None:  # its key and headers; our retries and deadline
            self._client = self._given.with_options(max_retries=0, timeout=self.config.timeout_s)
            self._semaphore = asyncio.Semaphore(self.config.max_concurrency)
        if self._client is None:  # created on first use: inside the event loop that will use it
            self._client = openai.AsyncOpenAI(
                base_url=self.config.base_url,
                api_key=self._key or "unused",
                max_retries=0,  # retries are ours: counted, with our backoff
                timeout=self.config.timeout_s,
                http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(keepalive_expiry=2.0)),
            )
            self._semaphore = asyncio.Semaphore(self.config.max_concurrency)
        return self._client

    async def model(self) -> str:
        """The configured model id, else the first one the server lists (asked once)."""
        if self.config.model:
            return self.config.model
        if self._model is None or (self._model.done() and self._model.exception() is not None):
            self._model = asyncio.ensure_future(self._list_model())
            self._model.add_done_callback(self._model_listed)
        self._model_waiting += 1
        try:
            return await asyncio.shield(self._model)
        finally:
            self._model_waiting -= 1

    def _model_listed(self, lookup: asyncio.Future) -> None:
        """A failed lookup is read here: when every caller was cancelled before it failed (a rollout dropped while
        the server is down), shield() had unhooked them, and asyncio logged "Task exception was never retrieved" with
        a traceback. Its callers raise it; with none left, it is logged here, once."""
        if lookup.cancelled() or (error := lookup.exception()) is None:
            return
        if not self._model_waiting:  # runs before the callers' shields hand it on: they are still counted
            log.warning("%s (listing its models; no request was waiting for them)", error)

    async def _list_model(self) -> str:
        # a plain JSON body, read here: the typed models.list() raised AttributeError on an HTML page (a proxy's
        # login, a URL pointing at a web UI), which a rubric scored as the rollout's 0
        url = f"{self.config.base_url}/models"
        models = await self._call(lambda client: client.get(url, cast_to=object))
        try:
            return first_model(models)
        except ValueError as error:
            raise EndpointError(f"{self.name}: {url} {error}") from None

    def _rekey_or_raise(self, error: openai.APIStatusError, sent: str | None) -> bool:
        """`_rekey`, its ValueError (the key can no longer be read) an `EndpointError` with the refusal."""
        try:
            return self._rekey(error.status_code, sent)
        except ValueError as reread:
            raise EndpointError(f"{self.name}: {self.config.root} refused the request: {error.status_code} "
                                f"{describe(error)}; re-reading the key: {reread}") from error  # fmt: skip

    def _rekey(self, status: int, sent: str | None) -> bool:
        """`RotatingKey.rekey`, the client given the new key."""
        if not self._keys.rekey(status, sent):
            return False
        if self._client is not None:
            self._client.api_key = self._keys.value  # read into each request's Authorization header
        return True

    @property
    def _key(self) -> str | None:
        return self._keys.value

    async def wait_ready(self, *, poll_s: float = READY_POLL_S, log_s: float = READY_LOG_S) -> None:
        """Return once the server answers `/v1/models` (with the key), asking every `poll_s` for up to
        `startup_timeout_s` (0: return at once), logging that it waits at once and then every `log_s`; not counted in
        `stats`. Waited out: no connection, a timeout, 5xx,
        429, 408, 409 (a model still loading). `EndpointError` past the bound, and at once for any other 4xx (401, 403,
        404: a key, a URL, which no wait mends), with the message a call would give."""
        limit = self.config.startup_timeout_s
        if limit <= 0:
            return
        url = f"{self.config.base_url}/models"
        start = time.monotonic()
        waited = rekeyed = False
        logged = 0.0
        while True:
            remaining = limit - (time.monotonic() - start)
            sent = self._key
            try:
                async with asyncio.timeout(max(min(self.config.timeout_s, remaining), 0.1)):
                    await self._openai().get(url, cast_to=object)
            except openai.APIStatusError as error:
                status = error.status_code
                if not rekeyed and self._rekey_or_raise(error, sent):
                    rekeyed = True
                    continue
                if status < 500 and status not in (429, *_RETRYABLE_STATUSES):
                    raise EndpointError(f"{self.name}: {self.config.root} refused the request: {status} "
                                        f"{describe(error)}{self._setup_hint(status)}") from error  # fmt: skip
                reason = describe(error)
            except (openai.APIError, json.JSONDecodeError, TimeoutError) as error:
                if unknown_host(error):  # a typo, not a pod starting: a Service's name resolves before its pods run
                    raise EndpointError(f"{self.name}: the host of {self.config.root} does not exist "
                                        f"({describe(error)}): check url") from error  # fmt: skip
                reason = describe(error) if not isinstance(error, TimeoutError) else "no answer in time"
            else:
                if waited:
                    log.info("%s at %s is up (after %.0fs)", self.name, self.config.root, time.monotonic() - start)
                return
            elapsed = time.monotonic() - start
            if elapsed >= limit:
                raise EndpointError(f"{self.name}: {url} did not answer within startup_timeout_s = {limit:g}s "
                                    f"(last: {reason})")  # fmt: skip
            if not waited:
                waited, logged = True, elapsed
                log.info("waiting for %s at %s (%s); up to startup_timeout_s = %gs", self.name, self.config.root,
                         reason, limit)  # fmt: skip
            elif elapsed - logged >= log_s:  # every log_s, not every poll: a loading model answers the same for minutes
                # a warning: nothing is scored meanwhile, and `gyre rl`'s console shows the services' warnings only (a
                # judge at a wrong port left its progress bar at rollouts=0 for startup_timeout_s, saying nothing)
                logged = elapsed
                log.warning("still waiting for %s at %s (%s): %.0fs of startup_timeout_s = %gs", self.name,
                            self.config.root, reason, elapsed, limit)  # fmt: skip
            await asyncio.sleep(min(poll_s, limit - elapsed))

    async def post(self, path: str, body: dict[str, Any], *, again: bool = False) -> Any:
        """POST `body` (JSON) to `path` from the server's root (an OpenAI route, /v1/..., under its OpenAI base URL);
        the decoded JSON answer. `again`: another form of a request just refused (the teacher's fallbacks): its refusal
        is counted, but not again toward `MAX_REFUSED_IN_A_ROW`, which counts refused samples, not forms of one."""
        url = self.url(path)
        return await self._call(lambda client: client.post(url, cast_to=object, body=body), again=again)

    async def post_once(self, path: str, body: dict[str, Any]) -> Any:
        """One attempt, not counted in `stats` (a check before the run, not one of its calls); EndpointError."""
        try:
            async with asyncio.timeout(self.config.timeout_s):  # the whole answer, as in `_call`
                return await self._openai().post(self.url(path), cast_to=object, body=body)
        except (openai.APIError, json.JSONDecodeError, TimeoutError) as error:
            raise EndpointError(f"{self.name}: {self.url(path)}: {describe(error)}") from error

    def url(self, path: str) -> str:
        """The URL of `path` from the server's root: an OpenAI route (/v1/...) under the configured OpenAI base URL
        (`EndpointConfig.base_url`, which need not end in /v1), any other (/classify, /tokenize) under the root."""
        if path.startswith("/v1/"):
            return f"{self.config.base_url}{path[len('/v1') :]}"
        return f"{self.config.root}{path}"

    async def chat(self, messages: list[dict], **params: Any) -> dict:
        """One chat completion (a plain JSON body: no typed transform); the decoded answer."""
        body = {"model": await self.model(), "messages": messages, **params}
        return await self.post("/v1/chat/completions", body)

    async def _call(self, request, *, again: bool = False) -> Any:
        client = self._openai()
        last: BaseException | None = None
        # a rotated key is tried once per call, at once: the refused attempt again, not a retry (nor a backoff)
        rekeyed = at_once = False
        async with self._semaphore:
            attempt = -1
            while at_once or attempt < self.config.retries:
                if at_once:
                    at_once = False
                else:
                    attempt += 1
                    if attempt:
                        self.stats["retries"] += 1
                        backoff = random.uniform(0, min(self.backoff_s * 2 ** min(attempt - 1, 40), MAX_BACKOFF_S))
                        await asyncio.sleep(max(backoff, retry_after(last)))
                self.stats["requests"] += 1
                sent = self._key
                # the client's timeout bounds each read, not the answer: a server trickling a byte at a time (or a
                # proxy's keep-alive spaces) held the request, and the rollout, for ever
                deadline = asyncio.timeout(self.config.timeout_s)
                try:
                    async with deadline:
                        answer = await request(client)
                except openai.APITimeoutError as error:  # before APIConnectionError: it is one
                    self.stats["timeouts"] += 1
                    last = error
                except TimeoutError:
                    if not deadline.expired():
                        raise
                    self.stats["timeouts"] += 1
                    last = TimeoutError(f"no whole answer within timeout_s = {self.config.timeout_s:g}s")
                except json.JSONDecodeError as error:
                    # a JSON content type with a broken body (a proxy's cut answer): the server's fault, asked again;
                    # it escaped as a plain ValueError, which a rubric scored as this rollout's 0
                    self.stats["errors"] += 1
                    last = EndpointError(f"the answer is not JSON ({error})")
                except _RETRYABLE as error:
                    self.stats["errors"] += 1
                    last = error
                except openai.APIStatusError as error:
                    if error.status_code in _RETRYABLE_STATUSES:
                        self.stats["errors"] += 1
                        last = error
                        continue
                    if not rekeyed and self._rekey_or_raise(error, sent):
                        rekeyed = at_once = True
                        continue
                    self.stats["failures"] += 1
                    raise self._refusal(error, again) from error
                else:
                    self.stats["ok"] += 1
                    self._refused_in_a_row = 0
                    return answer
        self.stats["failures"] += 1
        attempts = self.config.retries + 1
        raise EndpointError(f"{self.name}: {self.config.root} failed {attempts} times: {describe(last)}")

    def _refusal(self, error: openai.APIStatusError, again: bool = False) -> EndpointError:
        message = f"{self.name}: {self.config.root} refused the request: {error.status_code} {describe(error)}"
        if error.status_code not in REFUSED_STATUSES:  # a key, a model, a URL: every request would be refused
            return EndpointError(f"{message}{self._setup_hint(error.status_code)}")
        self.stats["refused"] += 1
        self._refused_in_a_row += not again
        if self._refused_in_a_row >= MAX_REFUSED_IN_A_ROW:
            return EndpointError(f"{message} ({self._refused_in_a_row} requests refused in a row, none answered: "
                                 "the configuration, not the samples, is at fault)")  # fmt: skip
        return RequestRefused(message, error.status_code)

    def _setup_hint(self, status: int) -> str:
        """Which settings a refusal of the setup points at (the server's message rarely names them)."""
        if status in (401, 403):
            source = "no api key set" if self._given is None else "the api_key of the client given"
            if self.config.api_key_env or self.config.api_key_file:
                key = "api_key_env" if self.config.api_key_env else "api_key_file"
                source = f"{key} = {getattr(self.config, key)!r}"
            return f" (check the key: {source})"
        if status == 404:
            model = repr(self.config.model) if self.config.model else "none set: the first the server lists"
            return f" (check url = {self.config.url!r} and model = {model})"
        return ""

    async def aclose(self) -> None:
        if self._client is not None and self._given is None:  # a given client's connections are its owner's
            await self._client.close()
        self._client = None


def first_model(models: Any) -> str:
    """The first model id of a `/v1/models` answer read as plain JSON (`get(..., cast_to=object)`); ValueError saying
    what came instead. The SDK's typed `models.list()` raised AttributeError on an HTML page (a proxy's login, a URL
    pointing at a web UI) and took an entry without an id as the model `None`."""
    data = models.get("data") if isinstance(models, dict) else None
    if data == []:
        raise ValueError("lists no model")
    if not (isinstance(data, list) and isinstance(data[0], dict) and isinstance(data[0].get("id"), str)):
        raise ValueError(f"answered no model list: {str(models)[:200]!r}")
    if not data[0]["id"]:
        raise ValueError("lists a model without an id")
    return data[0]["id"]


async def wait_all_ready(endpoints) -> None:
    """`wait_ready` of every endpoint at once; the first failure cancels the others' waits and is raised."""
    waits = [asyncio.ensure_future(endpoint.wait_ready()) for endpoint in endpoints]
    try:
        await asyncio.gather(*waits)
    finally:
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)


def retry_after(error: BaseException | None) -> float:
    """Seconds a 429 or 503 asks the client to wait (`Retry-After` in seconds), at most `MAX_RETRY_AFTER_S`; 0 when
    it asks nothing. A hosted judge's rate limit says when its window opens: retrying within our own short backoff
    used every retry up in a few seconds, failed the sample, and after `sample_attempts` the run."""
    response = getattr(error, "response", None)
    if not isinstance(error, openai.APIStatusError) or response is None:
        return 0.0
    try:
        seconds = float(response.headers.get("retry-after", "0"))
    except ValueError:  # an HTTP date: rare from model APIs; our backoff then
        return 0.0
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S) if math.isfinite(seconds) else 0.0


def describe(error: BaseException | None) -> str:
    """An exception as one line naming its type (for error messages and logs)."""
    if error is None:
        return "no attempt was made"
    text = str(error).strip() or type(error).__name__
    return text if type(error).__name__ in text else f"{type(error).__name__}: {text}"
