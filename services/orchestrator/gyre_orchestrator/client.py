"""`InferenceClient`: the `gyre.envs.ModelClient` the orchestrator runs environments against.

One `chat()` = one `/v1/chat/completions` call with the official `openai` client, asking the server
for token ids (`"return_token_ids": true`, the vLLM extension) and log-probs, so the orchestrator
trains on exactly the tokens the model sampled (docs/architecture.md, "Alignment").

- **Load balancing**: each request goes to the replica with the fewest requests in flight among
  those in rotation (`ReplicaSet.acquire`).
- **Bounded concurrency**: at most `max_concurrency` requests in flight across all replicas.
- **Demand**: `demand` counts the requests outstanding now, `inflight` (sent to a replica) and `queued`
  (waiting for a concurrency slot, an eligible replica or a retry): what inference autoscaling follows.
- **Timeouts, retries with backoff**: a connection error, timeout or 5xx/429 takes the replica out of
  rotation (circuit breaker, retried later) and the request is retried on another replica after an
  exponential backoff, `retries` times; 4xx errors are the request's fault and raise at once. A replica
  whose status probe fails (frozen, hung, cut off) has its requests in flight cancelled and retried the
  same way (`ReplicaSet.abandon`) instead of waiting out `timeout_s`.
- **Priority**: `for_version(v, priority=s)` also sends `"priority": s` (vLLM's field: lower is served first).
  A rollout for batch `s` is sent with priority `s`, so when more requests are in flight than a replica has
  batch rows, the oldest batch's rollouts take the rows first and a newer batch never delays it.
- **Policy versions**: `for_version(v)` returns a view that only uses replicas known to serve a
  version >= v — how the async bound is enforced at dispatch. The version that produced each
  completion is read from the response (per choice `policy_version_min/max`; a server without them
  is taken to serve the replica's known version) and fed back into the replica's known version.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import Any

import httpx
import openai
from gyre.endpoint import RotatingKey, describe, first_model
from gyre.envs import ContextLengthExceeded, Messages, SamplingParams, ToolCall, Turn
from gyre.envs.types import NEUTRAL_SAMPLING, derive_seed
from gyre.eos import served_end_of_turn_id

from gyre_orchestrator.replicas import NoReplicaAvailable, Replica, ReplicaSet

log = logging.getLogger(__name__)

CONNECTIONS_PER_CLIENT = 8
# An idle pooled connection is dropped after this long. It must be shorter than the server's keep-alive
# (uvicorn's and vLLM's default: 5 s): at equal timeouts (httpx's default is also 5 s) the client
# sometimes sends on a connection the server is closing, and the request fails as a connection error
# that takes a healthy replica out of rotation.
KEEPALIVE_EXPIRY_S = 2.0
_RETRYABLE = (openai.APIConnectionError, openai.APITimeoutError, openai.InternalServerError, openai.RateLimitError)


class InferenceError(RuntimeError):
    """A request failed for good: the server rejected it (4xx), or every retry failed."""


class SetupRefused(InferenceError):
    """A 401, 403, or a 404 before any answer: the server refuses the configuration (a key, a model, a URL), not this
    request; every other request would be refused too, so it is not generated again (a run stopped after each
    rollout's attempts, with a traceback; `gyre eval` after three attempts of a sample). A 404 after answers (a
    replica that lost a named adapter) stays an `InferenceError`: the rollout is generated again."""


class ContextTooLong(InferenceError, ContextLengthExceeded):
    """The server refused the conversation as longer than the model's context (400 context_length_exceeded)."""


class ReplicaStopped(RuntimeError):
    """A request abandoned in flight: its replica stopped answering, the request is retried on another."""


class BadResponse(InferenceError):
    """The server answered something that cannot be trained on (missing token ids, misaligned log-probs)."""


def _context_overflow(error: openai.APIStatusError) -> bool:
    """A 400 saying the prompt plus max_tokens is over the model's context (Gyre and OpenAI set the code; vLLM's
    message names the maximum context length)."""
    return error.status_code == 400 and (
        getattr(error, "code", None) == "context_length_exceeded" or "maximum context length" in str(error)
    )


def parse_turn(body: dict[str, Any], fallback_version: int | None, sent_version: int | None = None) -> Turn:
    """Build a `Turn` from a `/v1/chat/completions` JSON body that carries gyre's token-level extras:
    top-level (or per-choice) `prompt_token_ids`, per-choice `token_ids`, `logprobs.content[].logprob`
    and `policy_version_min/max`. Without per-choice versions (vLLM), the replica's known versions are used: the
    one known when the request was sent (`sent_version`) as the oldest, the one known now as the newest, since the
    relay may have swapped its weights while it generated."""
    if not isinstance(body, dict):
        raise BadResponse(f"response is not a JSON object but {type(body).__name__}")
    choices = body.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        raise BadResponse("response has no choices")
    choice = choices[0]
    prompt_ids = body.get("prompt_token_ids") or choice.get("prompt_token_ids")
    token_ids = choice.get("token_ids")
    if prompt_ids is None or token_ids is None:
        raise BadResponse("response lacks prompt_token_ids / token_ids: is return_token_ids supported by the server?")
    content = (choice.get("logprobs") or {}).get("content") or []
    try:
        logprobs = [float(item["logprob"]) for item in content]
    except (KeyError, TypeError, ValueError) as e:
        raise BadResponse(f"malformed logprobs: {e}") from None
    if len(logprobs) != len(token_ids):
        raise BadResponse(f"{len(logprobs)} log-probs for {len(token_ids)} completion tokens")
    vmin, vmax = choice.get("policy_version_min"), choice.get("policy_version_max")
    if vmin is None or vmax is None:
        if fallback_version is None:
            raise BadResponse("response carries no policy version and the replica's version is unknown")
        oldest = fallback_version if sent_version is None else min(sent_version, fallback_version)
        vmin = oldest if vmin is None else vmin
        vmax = fallback_version if vmax is None else vmax
    message = choice.get("message") or {}
    try:
        text, calls = message.get("content") or "", message.get("tool_calls") or []
        # newer vLLM names it `reasoning`, older `reasoning_content`
        reasoning = message.get("reasoning") or message.get("reasoning_content")
        sampled = _sampled_text(content) if calls or reasoning else None
        if calls:
            text = _content_before_calls(text, sampled)
        if reasoning:
            text, reasoning = _with_reasoning(text, reasoning, sampled)
        return Turn(
            prompt_token_ids=[int(t) for t in prompt_ids],
            completion_token_ids=[int(t) for t in token_ids],
            completion_logprobs=logprobs,
            text=text,
            tool_calls=[ToolCall.from_openai(call) for call in calls],
            reasoning=reasoning,
            finish_reason=choice.get("finish_reason") or "stop",
            policy_version_min=int(vmin),
            policy_version_max=int(vmax),
        )
    except (ValueError, TypeError, AttributeError) as e:
        raise BadResponse(str(e)) from None


def _sampled_text(logprobs: list[Any]) -> str | None:
    """The completion as sampled: the bytes of its tokens' log-prob entries (OpenAI's `bytes`, else `token`)
    joined; None when an entry has neither. Asked only of a reply with tool calls or reasoning."""
    parts = []
    for item in logprobs:
        data = item.get("bytes") if isinstance(item, dict) else None
        if isinstance(data, list):
            parts.append(bytes(data))  # ValueError/TypeError for non-bytes: a BadResponse
        elif isinstance(item, dict) and isinstance(item.get("token"), str):
            parts.append(item["token"].encode())
        else:
            return None
    return b"".join(parts).decode("utf-8", "replace")


def _content_before_calls(content: str, sampled: str | None) -> str:
    """A tool-call reply's content as the chat template must get it back to render the sampled tokens (`Turn.text`).

    The template writes the content, one newline, then the `<tool_call>` blocks, so the content must end in one
    newline fewer than the sampled text before its first block. Servers differ: Gyre's returns it so, vLLM's hermes
    parser returns the text before the first block verbatim (one newline more). The sampled tokens decide; without
    them (or without a hermes block in them, or with nothing to adjust) the content stays as the server sent it."""
    start = -1 if sampled is None or "<tool_call>" in content else sampled.find("<tool_call>")
    body = content.rstrip("\n")
    if start < 0 or not body:
        return content
    before = sampled[:start]
    newlines = len(before) - len(before.rstrip("\n"))
    return body + "\n" * (newlines - 1) if newlines else content


def _with_reasoning(content: str, reasoning: str, sampled: str | None) -> tuple[str, str | None]:
    """`(text, reasoning)` of a reply whose reasoning the server returned apart (vLLM's `--reasoning-parser`): where
    it was sampled as a `<think>` block, the block goes back in front of the content as it was sampled (the text
    a server without the parser returns: rubrics, parsers and the chat template then see the reply as sampled, and
    the next turn's prompt renders it); otherwise the text is the content and the reasoning stays apart (sent
    back as `reasoning_content`, the field chat templates read)."""
    if sampled is None or "</think>" not in sampled:
        return content, reasoning
    opened = "<think>" if "<think>" in sampled.split("</think>", 1)[0] else ""  # a template may open the block
    return f"{opened}{reasoning}</think>{content}", None


class InferenceClient:
    """`ModelClient` over every replica of a `ReplicaSet`. Safe to call concurrently."""

    def __init__(
        self,
        replicas: ReplicaSet,
        *,
        model: str | None = None,
        api_key: str | None = None,
        reread_key: Callable[[], str | None] | None = None,
        max_concurrency: int = 64,
        timeout_s: float = 300.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        wait_for_replica_s: float | None = None,
        min_version: int = 0,
    ):
        self.replicas = replicas
        self.model = model
        # a 401/403 reads `reread_key` (inference.api_key_file) again: a Secret rotated in place is taken up
        self.keys = RotatingKey(api_key, reread_key, name="inference", setting="inference.api_key_file")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.wait_for_replica_s = timeout_s if wait_for_replica_s is None else wait_for_replica_s
        self.min_version = min_version
        self.priority: int | None = None  # sent as the request's "priority" (None: not sent, the server's 0)
        self.max_concurrency = max_concurrency
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self.stats = {"requests": 0, "retries": 0}  # shared with every for_version() view
        self.demand = {"inflight": 0, "queued": 0}  # likewise

    @property
    def api_key(self) -> str | None:
        return self.keys.value

    def rekey(self, status: int, sent: str | None) -> bool:
        """`RotatingKey.rekey` (True: ask again), every replica's clients given the new key."""
        if not self.keys.rekey(status, sent):
            return False
        for replica in list(self.replicas):
            for client in replica.clients.get("openai") or []:
                client.api_key = self.keys.value  # read into each request's Authorization header
        return True

    def for_version(self, min_version: int, *, priority: int | None = None) -> InferenceClient:
        """A view of this client (same replicas, same concurrency budget) that needs version >= min_version and
        sends `priority` with each request (lower is served first)."""
        view = object.__new__(InferenceClient)
        view.__dict__.update(self.__dict__)
        view.min_version = min_version
        view.priority = priority
        return view

    # ---- ModelClient ----------------------------------------------------------------------------
    async def chat(
        self, messages: Messages, *, tools: list[dict[str, Any]] | None = None, sampling: SamplingParams
    ) -> Turn:
        request: dict[str, Any] = {
            "messages": messages,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            # not the model's generation_config.json's (vLLM's server fills them from it): off-policy without a word
            **NEUTRAL_SAMPLING,
            "max_tokens": sampling.max_tokens,
            "logprobs": True,
            "return_token_ids": True,  # gyre / vLLM extension: prompt and completion token ids
        }
        if sampling.seed is not None:
            # every turn of a multi-turn rollout gets its own seed, derived from the rollout's and the turn's place
            request["seed"] = derive_seed(sampling.seed, "turn", len(messages))
        if tools:
            request["tools"] = tools
        if sampling.chat_template_kwargs:
            request["chat_template_kwargs"] = sampling.chat_template_kwargs
        if self.priority is not None:
            request["priority"] = self.priority
        self.demand["queued"] += 1
        try:
            async with self._semaphore:
                return await self._with_retries(request)
        finally:
            self.demand["queued"] -= 1

    async def _with_retries(self, request: dict[str, Any]) -> Turn:
        last: BaseException | None = None
        # a rotated key is tried once per request, at once: the refused attempt again, not a retry (nor a backoff)
        attempt, rekeyed, again = -1, False, False
        while again or attempt < self.retries:
            if again:
                again = False
            else:
                attempt += 1
                if attempt:
                    # full jitter: concurrent retries after a replica dies must not stampede the survivors
                    await asyncio.sleep(random.uniform(0, self.backoff_s * 2 ** (attempt - 1)))
            try:
                replica = await self.replicas.acquire(self.min_version, timeout=self.wait_for_replica_s)
            except NoReplicaAvailable as e:
                raise InferenceError(str(e)) from None
            self.demand["queued"] -= 1
            self.demand["inflight"] += 1
            sent = self.keys.value
            call = asyncio.ensure_future(self._request(replica, request))
            replica.calls.add(call)  # cancelled by `ReplicaSet.abandon` when the replica stops answering
            try:
                try:
                    turn, reported = await call
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling() or not call.cancelled():
                        raise  # this request itself was cancelled, not the replica abandoned
                    raise ReplicaStopped(f"{replica.url} stopped answering (its status probe failed)") from None
            except ReplicaStopped as e:
                last = e  # the probe that abandoned it took the replica out of rotation, naming why
                self.stats["retries"] += 1
                continue
            except _RETRYABLE as e:
                last = e
                self.stats["retries"] += 1
                self.replicas.mark_failed(replica, describe(e))
                continue
            except BadResponse as e:
                last = e  # a broken answer from this replica: try another
                self.stats["retries"] += 1
                self.replicas.mark_failed(replica, e)
                continue
            except openai.APIStatusError as e:
                message = f"{replica.url} rejected the request: {e.status_code} {describe(e)}"
                try:
                    if not rekeyed and self.rekey(e.status_code, sent):
                        rekeyed = again = True
                        continue
                except ValueError as reread:  # the key file can no longer be read
                    raise InferenceError(f"{message}; re-reading the key: {reread}") from e
                if e.status_code in (401, 403):  # the server's message rarely names the setting
                    message += " (check inference.api_key / inference.api_key_file)"
                elif e.status_code == 404:  # a model the server does not serve, or a path that is not an OpenAI API
                    message += f" (check inference.model = {self.model!r} and inference.urls)"
                # a 404 once this client has been answered is no setup mistake: a named adapter a replica lost (its
                # pod restarted, the adapter evicted) is generated again like any failed rollout, not the run's end
                if e.status_code in (401, 403) or (e.status_code == 404 and not self.stats["requests"]):
                    raise SetupRefused(message) from e
                raise (ContextTooLong if _context_overflow(e) else InferenceError)(message) from e
            finally:
                replica.calls.discard(call)
                self.replicas.release(replica)
                self.demand["inflight"] -= 1
                self.demand["queued"] += 1
            self.stats["requests"] += 1
            replica.requests += 1
            self.replicas.mark_ok(replica)
            if reported:  # an answer without versions (vLLM) was tagged with the version known: no evidence of it
                self.replicas.observe_version(replica, turn.policy_version_max)
            return turn
        raise InferenceError(f"request failed after {self.retries + 1} attempts: {describe(last)}")

    async def _request(self, replica: Replica, request: dict[str, Any]) -> tuple[Turn, bool]:
        """The turn, and whether the answer reported the policy versions that produced it."""
        client = self._openai(replica)
        model = self.model or await self._model_name(replica, client)
        sent = replica.version  # an answer without versions may come from this one, or any version up to the newest
        # `post` with a plain JSON body: the official client still does auth, timeouts and maps HTTP
        # errors to openai exceptions, but skips the typed-parameter transform and the pydantic response
        # model, which cost more CPU than the rest of a rollout (see docs/benchmarks.md).
        # vLLM's server stops only at the configs' eos ids: a base model's ChatML reply ran past its <|im_end|> into
        # made-up turns up to max_tokens. Gyre's server stops there anyway; the ids are the same there.
        stops = await self._end_of_turn(replica, client)
        body = {"model": model, **request, **({"stop_token_ids": stops} if stops else {})}
        body = await client.post("/chat/completions", cast_to=object, body=body)
        turn = parse_turn(body, replica.version, sent)
        choices = body.get("choices") if isinstance(body, dict) else None  # a dict with choices: parse_turn checked
        return turn, "policy_version_max" in choices[0]

    def _openai(self, replica: Replica) -> openai.AsyncOpenAI:
        # Several small connection pools per replica instead of one big one: httpx scans every pooled
        # connection on each request, so CPU per request grows with the pool (measured in the bench).
        pool = replica.clients.get("openai")
        if pool is None:
            size = max(1, -(-self.max_concurrency // CONNECTIONS_PER_CLIENT))
            pool = replica.clients["openai"] = [self._new_openai(replica) for _ in range(size)]
        replica.clients["next"] = (replica.clients.get("next", -1) + 1) % len(pool)
        return pool[replica.clients["next"]]

    def _new_openai(self, replica: Replica) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{replica.url}/v1",
            api_key=self.api_key or "unused",
            max_retries=0,  # retries are ours: they move to another replica
            timeout=self.timeout_s,
            http_client=openai.DefaultAsyncHttpxClient(
                limits=httpx.Limits(
                    max_connections=1000, max_keepalive_connections=100, keepalive_expiry=KEEPALIVE_EXPIRY_S
                )
            ),
        )

    async def _end_of_turn(self, replica: Replica, client: openai.AsyncOpenAI) -> list[int]:
        # one probe per replica, however many requests start at once; one that could not reach it is made again
        lookup = replica.clients.get("end_of_turn")
        if lookup is None or (lookup.done() and lookup.exception() is not None):
            lookup = replica.clients["end_of_turn"] = asyncio.ensure_future(self._probe_end_of_turn(replica, client))
            lookup.add_done_callback(lambda f: f.cancelled() or f.exception())  # as in _model_name
        try:
            return await asyncio.shield(lookup)
        except (openai.AuthenticationError, openai.PermissionDeniedError):
            return []  # the request itself meets the refused key (`rekey`); the next one asks again

    @staticmethod
    async def _probe_end_of_turn(replica: Replica, client: openai.AsyncOpenAI) -> list[int]:
        """`[id]` of the token `replica`'s chat template ends a reply with (`gyre.eos.served_end_of_turn_id`), sent
        as every request's `stop_token_ids`; `[]` when the server cannot say (no /tokenize: a hosted API)."""

        async def post(path: str, body: dict) -> dict:
            return await client.post(f"{replica.url}{path}", cast_to=object, body=body)  # the root, not /v1

        try:
            end = await served_end_of_turn_id(post)
        except _RETRYABLE:
            raise  # the replica is unreachable: the request moves on, the next one asks again
        except (openai.AuthenticationError, openai.PermissionDeniedError):
            raise  # a key rotated in place: asked again with the new key
        except (openai.APIStatusError, KeyError, TypeError, ValueError) as error:
            log.warning("%s: cannot read its chat template's end-of-turn token from /tokenize (%s): replies stop "
                        "only where the server stops them", replica.url, describe(error))  # fmt: skip
            return []
        return [] if end is None else [end]

    async def served_model(self, replica: Replica) -> str:
        """The first model of `replica`'s `/v1/models`, asked once and kept (what a request names when
        `inference.model` is unset): an answer says the replica is up and takes this client's key."""
        return await self._model_name(replica, self._openai(replica))

    async def check_model(self, replica: Replica) -> None:
        """InferenceError when `inference.model` is set and `replica`'s `/v1/models` does not list it: every request
        would be refused (a 404, which `gyre eval` retried as a failed sample three times), as a vLLM user's hub id
        against a server started with --served-model-name."""
        if not self.model:
            return
        models = await self._openai(replica).get("/models", cast_to=object)
        data = models.get("data") if isinstance(models, dict) else None
        served = [m["id"] for m in data if isinstance(m, dict) and m.get("id")] if isinstance(data, list) else []
        if served and self.model not in served:
            raise InferenceError(f"{replica.url} does not serve inference.model = {self.model!r}: it serves "
                                 f"{', '.join(map(repr, served))} (unset, the first one is used)")  # fmt: skip

    async def _model_name(self, replica: Replica, client: openai.AsyncOpenAI) -> str:
        # one /v1/models call per replica, however many requests start at once
        lookup = replica.clients.get("model")
        if lookup is None or (lookup.done() and lookup.exception() is not None):
            lookup = replica.clients["model"] = asyncio.ensure_future(self._list_model(replica, client))
            # its failure is read by the next request; when none comes (the requests awaiting it were abandoned with
            # their replica), asyncio would log "exception was never retrieved"
            lookup.add_done_callback(lambda f: f.cancelled() or f.exception())
        return await asyncio.shield(lookup)

    @staticmethod
    async def _list_model(replica: Replica, client: openai.AsyncOpenAI) -> str:
        models = await client.get("/models", cast_to=object)
        try:
            return first_model(models)
        except ValueError as e:  # a broken replica (or what stands in front of it): the request moves to another
            raise BadResponse(f"{replica.url}/v1/models {e}") from None


async def close_replica_clients(replicas: list[Replica]) -> None:
    """Close the HTTP clients of replicas that left the set (and any gRPC channels the relay opened)."""
    for replica in replicas:
        for client in replica.clients.pop("openai", None) or []:
            await client.close()
        channel = replica.clients.pop("channel", None)
        if channel is not None:
            await channel.close()
