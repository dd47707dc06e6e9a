"""`InferenceClient`: the `gyre.envs.ModelClient` the orchestrator runs environments against.

One `chat()` = one `/v1/chat/completions` call with the official `openai` client, asking the server
for token ids (`extra_body={"return_token_ids": True}`) and log-probs, so the orchestrator trains on
exactly the tokens the model sampled (docs/architecture.md, "Alignment").

- **Load balancing**: each request goes to the replica with the fewest requests in flight among
  those in rotation (`ReplicaSet.acquire`).
- **Bounded concurrency**: at most `max_concurrency` requests in flight across all replicas.
- **Timeouts, retries with backoff**: a connection error, timeout or 5xx/429 takes the replica out of
  rotation (circuit breaker, retried later) and the request is retried on another replica after an
  exponential backoff, `retries` times; 4xx errors are the request's fault and raise at once.
- **Policy versions**: `for_version(v)` returns a view that only uses replicas known to serve a
  version >= v — how the async bound is enforced at dispatch. The version that produced each
  completion is read from the response (per choice `policy_version_min/max`, else the
  `x-gyre-policy-version` header) and fed back into the replica's known version.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import openai
from gyre.envs import Messages, SamplingParams, ToolCall, Turn

from gyre_orchestrator.replicas import NoReplicaAvailable, Replica, ReplicaSet

log = logging.getLogger(__name__)

VERSION_HEADER = "x-gyre-policy-version"
_RETRYABLE = (openai.APIConnectionError, openai.APITimeoutError, openai.InternalServerError, openai.RateLimitError)


class InferenceError(RuntimeError):
    """A request failed for good: the server rejected it (4xx), or every retry failed."""


class BadResponse(InferenceError):
    """The server answered something that cannot be trained on (missing token ids, misaligned log-probs)."""


def _extra(obj: Any, name: str) -> Any:
    value = getattr(obj, name, None)
    if value is None:
        value = (getattr(obj, "model_extra", None) or {}).get(name)
    return value


def parse_turn(completion: Any, header_version: int | None, fallback_version: int | None) -> Turn:
    """Build a `Turn` from an OpenAI ChatCompletion that carries gyre's token-level extras."""
    if not completion.choices:
        raise BadResponse("response has no choices")
    choice = completion.choices[0]
    prompt_ids = _extra(completion, "prompt_token_ids") or _extra(choice, "prompt_token_ids")
    token_ids = _extra(choice, "token_ids")
    if prompt_ids is None or token_ids is None:
        raise BadResponse("response lacks prompt_token_ids / token_ids: is return_token_ids supported by the server?")
    content = choice.logprobs.content if choice.logprobs is not None and choice.logprobs.content else []
    logprobs = [float(item.logprob) for item in content]
    if len(logprobs) != len(token_ids):
        raise BadResponse(f"{len(logprobs)} log-probs for {len(token_ids)} completion tokens")
    vmin = _extra(choice, "policy_version_min")
    vmax = _extra(choice, "policy_version_max")
    if vmin is None or vmax is None:
        version = header_version if header_version is not None else fallback_version
        if version is None:
            raise BadResponse("response carries no policy version (per choice or x-gyre-policy-version header)")
        vmin = version if vmin is None else vmin
        vmax = version if vmax is None else vmax
    message = choice.message
    tool_calls = [ToolCall.from_openai(call) for call in (message.tool_calls or [])]
    try:
        return Turn(
            prompt_token_ids=list(prompt_ids),
            completion_token_ids=list(token_ids),
            completion_logprobs=logprobs,
            text=message.content or "",
            tool_calls=tool_calls,
            finish_reason=choice.finish_reason or "stop",
            policy_version_min=int(vmin),
            policy_version_max=int(vmax),
        )
    except ValueError as e:
        raise BadResponse(str(e)) from None


class InferenceClient:
    """`ModelClient` over every replica of a `ReplicaSet`. Safe to call concurrently."""

    def __init__(
        self,
        replicas: ReplicaSet,
        *,
        model: str | None = None,
        api_key: str | None = None,
        max_concurrency: int = 64,
        timeout_s: float = 300.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        wait_for_replica_s: float | None = None,
        min_version: int = 0,
    ):
        self.replicas = replicas
        self.model = model
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.wait_for_replica_s = timeout_s if wait_for_replica_s is None else wait_for_replica_s
        self.min_version = min_version
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self.stats = {"requests": 0, "retries": 0}  # shared with every for_version() view

    def for_version(self, min_version: int) -> InferenceClient:
        """A view of this client (same replicas, same concurrency budget) that needs version >= min_version."""
        view = object.__new__(InferenceClient)
        view.__dict__.update(self.__dict__)
        view.min_version = min_version
        return view

    # ---- ModelClient ----------------------------------------------------------------------------
    async def chat(
        self, messages: Messages, *, tools: list[dict[str, Any]] | None = None, sampling: SamplingParams
    ) -> Turn:
        request: dict[str, Any] = {
            "messages": messages,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
            "logprobs": True,
            "extra_body": {"return_token_ids": True},
        }
        if sampling.seed is not None:
            request["seed"] = sampling.seed
        if tools:
            request["tools"] = tools
        async with self._semaphore:
            return await self._with_retries(request)

    async def _with_retries(self, request: dict[str, Any]) -> Turn:
        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                # full jitter: concurrent retries after a replica dies must not stampede the survivors
                await asyncio.sleep(random.uniform(0, self.backoff_s * 2 ** (attempt - 1)))
            try:
                replica = await self.replicas.acquire(self.min_version, timeout=self.wait_for_replica_s)
            except NoReplicaAvailable as e:
                raise InferenceError(str(e)) from None
            try:
                turn = await self._request(replica, request)
            except _RETRYABLE as e:
                last = e
                self.stats["retries"] += 1
                self.replicas.mark_failed(replica, _describe(e))
                continue
            except BadResponse as e:
                last = e  # a broken answer from this replica: try another
                self.stats["retries"] += 1
                self.replicas.mark_failed(replica, e)
                continue
            except openai.APIStatusError as e:
                raise InferenceError(f"{replica.url} rejected the request: {e.status_code} {_describe(e)}") from e
            finally:
                self.replicas.release(replica)
            self.stats["requests"] += 1
            replica.requests += 1
            self.replicas.mark_ok(replica)
            self.replicas.observe_version(replica, turn.policy_version_max)
            return turn
        raise InferenceError(f"request failed after {self.retries + 1} attempts: {_describe(last)}")

    async def _request(self, replica: Replica, request: dict[str, Any]) -> Turn:
        client = self._openai(replica)
        model = self.model or await self._model_name(replica, client)
        raw = await client.chat.completions.with_raw_response.create(model=model, **request)
        completion = raw.parse()
        header = raw.headers.get(VERSION_HEADER)
        header_version = int(header) if header is not None and header.strip().lstrip("-").isdigit() else None
        return parse_turn(completion, header_version, replica.version)

    def _openai(self, replica: Replica) -> openai.AsyncOpenAI:
        client = replica.clients.get("openai")
        if client is None:
            client = openai.AsyncOpenAI(
                base_url=f"{replica.url}/v1",
                api_key=self.api_key or "unused",
                max_retries=0,  # retries are ours: they move to another replica
                timeout=self.timeout_s,
            )
            replica.clients["openai"] = client
        return client

    async def _model_name(self, replica: Replica, client: openai.AsyncOpenAI) -> str:
        # one /v1/models call per replica, however many requests start at once
        lookup = replica.clients.get("model")
        if lookup is None or (lookup.done() and lookup.exception() is not None):
            lookup = replica.clients["model"] = asyncio.ensure_future(self._list_model(replica, client))
        return await asyncio.shield(lookup)

    @staticmethod
    async def _list_model(replica: Replica, client: openai.AsyncOpenAI) -> str:
        models = await client.models.list()
        if not models.data:
            raise BadResponse(f"{replica.url}/v1/models lists no model")
        return models.data[0].id


def _describe(e: BaseException | None) -> str:
    if e is None:
        return "no attempt was made"
    text = str(e).strip() or type(e).__name__
    return f"{type(e).__name__}: {text}" if type(e).__name__ not in text else text


async def close_replica_clients(replicas: list[Replica]) -> None:
    """Close the HTTP clients of replicas that left the set (and any gRPC channels the relay opened)."""
    for replica in replicas:
        client = replica.clients.pop("openai", None)
        if client is not None:
            await client.close()
        channel = replica.clients.pop("channel", None)
        if channel is not None:
            await channel.close()
