"""Chat and text completions on top of a Backend: prompts in, OpenAI-shaped responses and SSE chunks out.

Per choice, tokens from the backend go through one `Choice` (choice.py: detokenizing, stop strings, tool-call
text, and the rules clients rely on: alignment of tokens and log-probs, policy versions, seeds). The checks that
refuse a request with a 400 are in request_checks.py, the handling of a client that goes away in disconnects.py
(both shared with tokens_in.py's `/inference/v1/generate`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import Response, StreamingResponse

from gyre_inference.backend import AdapterGoneError, Backend, BackendStoppedError, SamplingParams
from gyre_inference.chat_messages import NamedToolChoice
from gyre_inference.choice import Choice, Delta, choice_seed
from gyre_inference.disconnects import ClientGone, all_or_none, unless_client_gone
from gyre_inference.errors import APIError, backend_failure, error_body, unknown_model
from gyre_inference.json_body import FastJSONResponse, dumps
from gyre_inference.metrics import InferenceMetrics
from gyre_inference.prompt_logprobs import to_vllm
from gyre_inference.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from gyre_inference.request_checks import (
    check_tool_replies,
    check_tool_schemas,
    checked_top_k,
    context_exceeded,
    named_prompt,
    truncated,
)
from gyre_inference.structured import Guide, GuideError
from gyre_inference.text import ModelText
from gyre_inference.tools import TOOL_CALL_END, TOOL_CALL_START, forced_call_grammar

VERSION_HEADER = "x-gyre-policy-version"


@dataclass
class Job:
    """The choices of one request, each with its prompt (ids) and sampling params."""

    kind: str  # "chat" | "completions"
    request: SamplingRequest
    prompts: list[list[int]]
    choices: list[tuple[int, Choice, SamplingParams]]  # (prompt index, choice, params)
    started: float
    first_token_at: float | None = None


class JobStream:
    """The choices of a streaming job running as tasks, their tokens in arrival order (`next()`).

    `close()` cancels what still runs (each cancelled task closes its backend stream, which aborts its
    sequence) and records the request's outcome; it has no await on purpose: when the client disconnects,
    Starlette cancels the generator's scope, and an await would be cancelled again before the bookkeeping.
    """

    def __init__(self, serving: Serving, job: Job):
        self.serving, self.job = serving, job
        self.outcome = "aborted"  # unless the stream gets to its end: the client went away (or the server stops)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._remaining = len(job.choices)
        self._tasks = [asyncio.create_task(self._choice(p, c, params)) for p, c, params in job.choices]

    async def _choice(self, p: int, choice: Choice, params: SamplingParams) -> None:
        try:
            await self.serving._run_choice(self.job, p, choice, params, lambda c, d: self._queue.put_nowait((c, d)))
        except Exception as error:
            self._queue.put_nowait(error)

    async def next(self) -> tuple[Choice, Delta] | None:
        """The next token of any choice (None once every choice finished); raises a choice's failure."""
        if not self._remaining:
            return None
        item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        self._remaining -= item[1].finish_reason is not None
        return item

    def failed(self, error: Exception) -> dict:
        """The error body a stream ends with for `error` (and the outcome it counts as)."""
        if isinstance(error, BackendStoppedError | AdapterGoneError):
            self.outcome = "unavailable" if isinstance(error, BackendStoppedError) else "client_error"
            return backend_failure(error, self.job.request.model, self.serving.model_id).body()
        self.outcome = "server_error"
        return error_body(500, f"generation failed: {type(error).__name__}: {error}")

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.serving._finish_metrics(self.job, self.outcome)


class Serving:
    def __init__(self, backend: Backend, text: ModelText, model_id: str, metrics: InferenceMetrics):
        self.backend, self.text, self.model_id, self.metrics = backend, text, model_id, metrics

    # ---- entry points -----------------------------------------------------------------------------
    async def chat(self, request: ChatCompletionRequest, started: float, client_gone=None):
        """`started`: arrival time (time.monotonic); `client_gone`: async () -> None, returns when the client
        disconnects (a non-streaming request is then cancelled)."""
        return await self.respond(await self.chat_job(request, started), client_gone)

    async def chat_job(self, request: ChatCompletionRequest, started: float, kind: str = "chat") -> Job:
        """The choices of a chat request, ready to run (`kind` names the endpoint in metrics)."""
        self._check_model(request.model)
        if request.tools:
            forced = {tool.function.name for tool in request.forced_tools or []}
            await asyncio.to_thread(check_tool_schemas, request.tools, forced)
        parse_tools = bool(request.tools) and request.tool_choice != "none"  # auto, required or named
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if parse_tools else None
        messages = [message.model_dump(exclude_none=True) for message in request.messages]
        check_tool_replies(messages)
        # Template rendering and tokenization of a large prompt take long: never on the event loop.
        prompt = await asyncio.to_thread(
            self.text.chat_prompt, messages, tools, request.add_generation_prompt,
            continue_final_message=request.continue_final_message, template_kwargs=request.chat_template_kwargs,
            add_special_tokens=request.add_special_tokens,
        )  # fmt: skip
        [prompt] = self._truncated(request, [prompt])
        # echo (vLLM): the content starts with the last message's when that is the assistant's being continued
        echo = _text_of(messages[-1].get("content")) if request.echo and messages[-1]["role"] == "assistant" else ""
        where = "input" if kind == "responses" else "messages"  # the request's own field in a context-length error
        job = self._job(kind, request, [prompt], request.completion_limit, where, parse_tools, started, [echo])
        await self._constrain(job, self._chat_guide(request))
        return job

    async def completions(self, request: CompletionRequest, started: float, client_gone=None):
        self._check_model(request.model)
        if request.max_tokens == 0 and not request.echo:
            raise APIError(400, "Invalid 'max_tokens': integer below minimum value. Expected a value >= 1 (0 only with "
                                "echo: the prompt alone), but got 0 instead.", param="max_tokens",
                           code="integer_below_min_value")  # fmt: skip
        whole = await asyncio.to_thread(self._completion_prompts, request)
        prompts = self._truncated(request, whole)
        echoes = None
        if request.echo:  # each prompt as text: the string sent, or the decoded ids (those kept, when truncated)
            sent = request.prompts()
            echoes = [p if isinstance(p, str) and len(kept) == len(ids) else
                      await asyncio.to_thread(self.text.decode_prompt, kept)
                      for p, ids, kept in zip(sent, whole, prompts, strict=True)]  # fmt: skip
        job = self._job("completions", request, prompts, request.max_tokens, "prompt", False, started, echoes)
        await self._constrain(job, request.guide())
        return await self.respond(job, client_gone)

    def _truncated(self, request, prompts: list[list[int]]) -> list[list[int]]:
        return truncated(prompts, request.truncate_prompt_tokens, self.backend.max_model_len, "truncate_prompt_tokens")

    def _completion_prompts(self, request: CompletionRequest) -> list[list[int]]:
        prompts = []
        for i, prompt in enumerate(request.prompts()):
            param = "prompt" if isinstance(request.prompt, str) or len(request.prompts()) == 1 else f"prompt.{i}"
            ids = self.text.check_ids(prompt, param) if isinstance(prompt, list) else None
            prompts.append(ids if ids is not None else self.text.encode(prompt, request.add_special_tokens, param))
        return prompts

    def _chat_guide(self, request: ChatCompletionRequest) -> Guide | None:
        """The request's structured-output guide; for tool_choice required / named, the forced-call grammar."""
        forced = request.forced_tools
        if forced is None:
            return request.guide()
        added = self.text.tokenizer.get_added_vocab()
        grammar = forced_call_grammar(
            [tool.model_dump(exclude_none=True) for tool in forced],
            parallel=request.tool_choice == "required" and request.parallel_tool_calls is not False,
            tags_are_tokens=TOOL_CALL_START in added and TOOL_CALL_END in added,
        )
        return Guide("grammar", grammar, "tool_choice")

    async def _constrain(self, job: Job, guide: Guide | None) -> None:
        """Attach `guide` to every choice (compiled once, in a worker thread: a large schema takes a while),
        with a fresh grammar matcher per choice when the backend drives them itself (the torch engine)."""
        if guide is None:
            return

        def compile_all() -> list:
            grammars = self.text.grammars
            grammars.check(guide)
            if not self.backend.uses_constraints:
                return [None] * len(job.choices)
            return [grammars.matcher(guide) for _ in job.choices]

        try:
            matchers = await asyncio.to_thread(compile_all)
        except GuideError as error:
            raise APIError(400, f"{guide.param}: the grammar engine refused it: {error}", param=guide.param) from None
        job.choices = [(p, choice, dataclasses.replace(params, guide=guide, constraint=matcher))
                       for (p, choice, params), matcher in zip(job.choices, matchers, strict=True)]  # fmt: skip

    def _check_model(self, model: str) -> str | None:
        """The named adapter `model` means (None: the served model); 404 for a name not served."""
        try:
            return self.backend.adapter_for(model, self.model_id)
        except KeyError:
            raise unknown_model(model, self.model_id) from None

    def _job(self, kind, request, prompts, limit, prompt_param, parse_tools, started, echoes=None) -> Job:
        stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        # an id the model cannot sample never stops anything, and with min_tokens it indexes the logits (its
        # suppression bias): the engine step failed, and with it every request in the batch
        stop_ids = set(self.text.check_ids(request.stop_token_ids or [], "stop_token_ids"))
        # vLLM's stop_reason names a stop token id the request gave, never the end-of-turn token
        own_stop_ids = frozenset(stop_ids - set(self.text.eos_token_ids))
        named = getattr(request, "tool_choice", None)
        forced_tool = named.function.name if isinstance(named, NamedToolChoice) else None
        stop_ids |= set() if request.ignore_eos else set(self.text.eos_token_ids)
        logit_bias = tuple((int(token), bias) for token, bias in (request.logit_bias or {}).items())
        if bad := [token for token, _ in logit_bias if token >= self.text.vocab_size]:
            raise APIError(400, f"logit_bias: token id {bad[0]} is out of vocabulary (vocabulary size "
                                f"{self.text.vocab_size})", param="logit_bias")  # fmt: skip
        top_k = checked_top_k(request.top_k, self.text.vocab_size, "top_k")
        allowed = request.allowed_token_ids
        allowed = None if allowed is None else frozenset(self.text.check_ids(allowed, "allowed_token_ids"))
        bad_words = tuple(request.bad_words or ())
        bad_word_ids = self.text.bad_word_ids(list(bad_words))
        if isinstance(request, ChatCompletionRequest):
            top, prompt_top = ((request.top_logprobs or 0) if request.logprobs else 0), request.prompt_logprobs
        else:
            top, prompt_top = request.logprobs or 0, request.prompt_logprobs_wanted
        # nothing reads a non-streaming choice without stop strings before it ends: handed over and decoded once
        final_only = not request.stream and not stops
        single_call = getattr(request, "parallel_tool_calls", None) is False  # chat (and responses) only
        choices = []
        echo_only = getattr(request, "echo_only", False)  # completions: the prompt alone (one token sampled, dropped)
        for p, prompt in enumerate(prompts):
            # one prompt of a list is named by its index (prompt.1), as an out-of-vocabulary id in it is
            param = prompt_param if len(prompts) == 1 else f"{prompt_param}.{p}"
            max_tokens = self._budget(len(prompt), 0 if echo_only else limit, param)
            if limit is None and request.min_tokens > max_tokens:  # a given max_tokens is checked in validation
                # the default limit, the rest of the context, is below min_tokens: the choice would end by length
                # before min_tokens (vLLM refuses it as well)
                raise APIError(400, f"min_tokens ({request.min_tokens}) must be at most max_tokens, which is "
                                    f"{max_tokens} here: the context's {self.backend.max_model_len} tokens less the "
                                    f"{len(prompt)} of {named_prompt(param)}", param="min_tokens")  # fmt: skip
            for i in range(request.n):
                params = SamplingParams(
                    max_tokens=max_tokens,
                    temperature=1.0 if request.temperature is None else request.temperature,
                    top_p=1.0 if request.top_p is None else request.top_p,
                    top_k=top_k,
                    min_p=request.min_p or 0.0,
                    seed=None if request.seed is None else choice_seed(request.seed, i),
                    stop_token_ids=frozenset(stop_ids),
                    top_logprobs=top,
                    adapter=self._check_model(request.model),
                    logit_bias=logit_bias,
                    min_tokens=request.min_tokens,
                    prompt_logprobs=prompt_top if i == 0 else None,  # once per prompt, shared by its choices
                    final_only=final_only,
                    priority=request.priority,
                    repetition_penalty=request.repetition_penalty or 1.0,
                    presence_penalty=request.presence_penalty or 0.0,
                    frequency_penalty=request.frequency_penalty or 0.0,
                    allowed_token_ids=allowed,
                    bad_words=bad_words,
                    bad_word_ids=bad_word_ids,
                    cache_salt=request.cache_salt,
                )
                choice = Choice(len(choices), self.text, stops, parse_tools, p, request.min_tokens,
                                request.include_stop_str_in_output, echoes[p] if echoes else "",
                                single_call=single_call, streamed=not final_only, echo_only=echo_only,
                                stop_token_ids=own_stop_ids, forced_tool=forced_tool,
                                skip_special=request.skip_special_tokens, ends=frozenset(stop_ids))  # fmt: skip
                choices.append((p, choice, params))
        return Job(kind, request, prompts, choices, started)

    def _budget(self, prompt_len: int, requested: int | None, param: str) -> int:
        limit = self.backend.max_model_len
        if prompt_len == 0:
            raise APIError(400, f"{param}: the prompt is empty", param=param)
        # requested 0 (echo alone, scoring a prompt): a prompt may fill the context, as in OpenAI; the engine
        # samples one token from the last position's logits and the choice drops it (nothing is written past it)
        if prompt_len + (1 if requested is None else requested) > limit:
            raise context_exceeded(limit, prompt_len, requested, param)
        if requested == 0:
            return 1
        return requested if requested is not None else limit - prompt_len

    # ---- running ----------------------------------------------------------------------------------
    async def _run_choice(self, job: Job, prompt_index: int, choice: Choice, params: SamplingParams, sink) -> None:
        """Feed the backend's tokens into `choice`, handing each Delta to `sink`; stops the backend early
        (closing its stream aborts the sequence) when a stop string ends the choice."""
        stream = self.backend.generate(job.prompts[prompt_index], params)
        try:
            async for event in stream:
                if job.first_token_at is None:
                    job.first_token_at = event.sampled_at or time.monotonic()
                    self.metrics.time_to_first_token.labels(self._run_label(job)).observe(
                        job.first_token_at - job.started
                    )
                delta = choice.add(event)
                sink(choice, delta)
                if choice.done:
                    break
        finally:
            await stream.aclose()

    async def respond(self, job: Job, client_gone, body=None, stream=None):
        """Run `job`: a JSON body (`body(job)`, default the chat/completions one) or an SSE stream
        (`stream(job)`, an async iterator of SSE text; default chat/completions chunks). The seam other API shapes
        (responses.py) answer through, with `chat_logprobs` and `JobStream`."""
        self.metrics.prompt_tokens.labels(self._run_label(job)).inc(sum(len(p) for p in job.prompts))
        if job.request.stream:
            return StreamingResponse(
                (stream or self._stream)(job),
                media_type="text/event-stream",
                headers={VERSION_HEADER: str(self._served_version(job)), "cache-control": "no-cache"},
            )
        try:
            outcome = await self._run_all(job, client_gone)
        except (BackendStoppedError, AdapterGoneError) as error:
            if isinstance(error, BackendStoppedError):  # the 404 of a gone adapter: the app's 4xx handler counts it
                self._finish_metrics(job, "unavailable")
            raise backend_failure(error, job.request.model, self.model_id) from None
        except BaseException:
            self._finish_metrics(job, "server_error")
            raise
        self._finish_metrics(job, outcome)
        if outcome == "aborted":
            return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
        if body is None:
            body = self._chat_body if job.kind == "chat" else self._completion_body
        newest = max(choice.version_max for _, choice, _ in job.choices)
        return FastJSONResponse(body(job), headers={VERSION_HEADER: str(newest)})

    def _served_version(self, job: Job) -> int:
        """The version the job's model name serves now: a named adapter's own, not the base model's."""
        adapter = job.choices[0][2].adapter
        if adapter is None:
            return self.backend.version
        try:
            return self.backend.adapter_version(adapter)
        except KeyError:  # forgotten since the request was checked: its stream ends with the 404
            return 0

    async def _run_all(self, job: Job, client_gone) -> str:
        """Run every choice to its end: "success", or "aborted" when the client went away first."""
        try:
            await unless_client_gone(
                all_or_none(*(self._run_choice(job, p, c, params, _ignore) for p, c, params in job.choices)),
                client_gone,
            )
        except ClientGone:
            return "aborted"
        return "success"

    def _finish_metrics(self, job: Job, outcome: str) -> None:
        run = self._run_label(job)
        self.metrics.generation_tokens.labels(run).inc(sum(len(choice.token_ids) for _, choice, _ in job.choices))
        self.metrics.request_done(job.kind, outcome, time.monotonic() - job.started, run)

    def _run_label(self, job: Job) -> str:
        """The run whose series count `job`: its named adapter's (multi-run), else the replica's."""
        return self.metrics.run_of(job.choices[0][2].adapter)

    async def _stream(self, job: Job) -> AsyncIterator[str]:
        """SSE: per choice a role chunk (chat), then one chunk per token that releases text or carries
        token ids / log-probs, the finishing chunk, an optional usage chunk, then [DONE]."""
        head = {"id": _request_id(job.kind), "object": _chunk_object(job), "created": int(time.time()),
                "model": job.request.model}  # fmt: skip
        every_token = job.request.return_token_ids or _wants_logprobs(job)
        usage_always = job.request.usage_every_chunk

        # Tokens each choice's chunks have covered so far. The usage of continuous_usage_stats counts these, not
        # the tokens the choices hold: a choice may already hold tokens whose chunks are still queued (the
        # engine delivers tokens in bursts), and a chunk must not report tokens that later chunks carry.
        covered: dict[int, int] = {}
        prompt_of = {choice.index: len(job.prompts[p]) for p, choice, _ in job.choices}

        def sse(choices: list[dict], extra: dict | None = None) -> str:
            chunk = {**head, "choices": choices, **(extra or {})}
            if usage_always:  # vLLM's continuous_usage_stats: the usage of the chunk's own choice so far
                # (its prompt, its tokens), as vLLM sends it; a request total would make a client that tracks
                # each choice's length by its chunks count the other choices' tokens too (n > 1, prompt lists)
                index = choices[0]["index"]
                chunk["usage"] = _usage(prompt_of[index], covered.get(index, 0))
            return _sse(chunk)

        run = JobStream(self, job)
        try:
            if job.kind == "chat":
                for _, choice, _ in job.choices:
                    entry = {"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}  # fmt: skip
                    first = choice.index == 0 and job.request.return_token_ids
                    yield sse([entry], {"prompt_token_ids": job.prompts[0]} if first else None)
            for _, choice, _ in job.choices:
                if choice.echo:
                    entry = {"index": choice.index, "logprobs": None, "finish_reason": None}
                    entry.update({"delta": {"content": choice.echo}} if job.kind == "chat" else {"text": choice.echo})
                    yield sse([entry])
            while (item := await run.next()) is not None:
                choice, delta = item
                covered[choice.index] = min(delta.position + 1, len(choice.token_ids))  # echo_only holds none
                if delta.text or delta.finish_reason or every_token:
                    for entry in self._chunk_choices(job, choice, delta):
                        yield sse([entry])
            if job.request.stream_options and job.request.stream_options.include_usage:
                yield _sse({**head, "choices": [], "usage": self._usage(job)})
            yield "data: [DONE]\n\n"
            run.outcome = "success"
        except Exception as error:  # a choice's generation failed: an error event ends the stream
            yield _sse(run.failed(error))
        finally:
            run.close()

    # ---- response bodies --------------------------------------------------------------------------
    def _usage(self, job: Job) -> dict:
        """Usage of the request: its prompts' tokens (each once, whatever `n`) and every choice's tokens."""
        return _usage(sum(len(p) for p in job.prompts), sum(len(choice.token_ids) for _, choice, _ in job.choices))

    def _chat_body(self, job: Job) -> dict:
        choices = []
        for _, choice, _ in job.choices:
            text = choice.echo + choice.text
            message = {"role": "assistant", "content": text if (text or not choice.tool_calls) else None}
            if choice.tool_calls:
                message["tool_calls"] = choice.tool_calls
            entry = {"index": choice.index, "message": message, "logprobs": self.chat_logprobs(job, choice),
                     "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason,
                     **choice.versions()}  # fmt: skip
            if job.request.return_token_ids:
                entry["token_ids"] = choice.token_ids
            choices.append(entry)
        body = {"id": _request_id("chat"), "object": "chat.completion", "created": int(time.time()),
                "model": job.request.model, "choices": choices, "usage": self._usage(job)}  # fmt: skip
        if job.request.return_token_ids:
            body["prompt_token_ids"] = job.prompts[0]
        if job.request.prompt_logprobs is not None:  # vLLM's top-level field (one prompt), computed with choice 0
            entries = next(choice.prompt_logprobs for _, choice, _ in job.choices if choice.prompt_logprobs)
            body["prompt_logprobs"] = to_vllm(entries, job.prompts[0], lambda t: self._token(job, t)[0])
        return body

    def _completion_body(self, job: Job) -> dict:
        choices = []
        prompt_lps = {p: choice.prompt_logprobs for p, choice, _ in job.choices if choice.prompt_logprobs}
        for p, choice, _ in job.choices:
            choice.prompt_logprobs = prompt_lps.get(p)
            entry = {"index": choice.index, "text": choice.echo + choice.text,
                     "logprobs": self._legacy_logprobs(job, choice), "finish_reason": choice.finish_reason,
                     "stop_reason": choice.stop_reason, **choice.versions()}  # fmt: skip
            if job.request.prompt_logprobs is not None:  # vLLM's per-choice field
                token_text = lambda t: self._token(job, t)[0]  # noqa: E731
                entry["prompt_logprobs"] = to_vllm(prompt_lps[p], job.prompts[p], token_text)
            if job.request.return_token_ids:
                entry["prompt_token_ids"] = job.prompts[p]
                entry["token_ids"] = choice.token_ids
            choices.append(entry)
        body = {"id": _request_id("completions"), "object": "text_completion", "created": int(time.time()),
                "model": job.request.model, "choices": choices, "usage": self._usage(job)}  # fmt: skip
        if job.request.return_token_ids and len(job.prompts) == 1:
            body["prompt_token_ids"] = job.prompts[0]
        return body

    def _chunk_choices(self, job: Job, choice: Choice, delta: Delta) -> list[dict]:
        """The choice entries of the chunks for one token: one, or for the last token of a choice that made tool
        calls two, the calls (with the token's data) and then the finish. The openai SDK's stream helper fires a
        call's `tool_calls.function.arguments.done` (with `parsed_arguments`) once a later chunk ends it, and
        never for a call first seen in the finishing chunk: when the calls came with the finish, the last one
        never got that event. OpenAI and vLLM send the finish after the calls too."""
        entry = self._chunk_choice(job, choice, delta)
        if not (job.kind == "chat" and delta.finish_reason and choice.tool_calls):
            return [entry]
        finish = {"index": choice.index, "delta": {}, "logprobs": None, "finish_reason": entry["finish_reason"],
                  "stop_reason": entry.pop("stop_reason"), **choice.versions()}  # fmt: skip
        if job.request.return_token_ids:
            finish["token_ids"] = []
        entry["finish_reason"] = None
        for key in ("policy_version_min", "policy_version_max"):
            del entry[key]
        return [entry, finish]

    def _chunk_choice(self, job: Job, choice: Choice, delta: Delta) -> dict:
        """The choice entry of the chunk for one token (the token at `delta.position`)."""
        span = slice(delta.position, delta.position + 1)
        entry = {"index": choice.index, "finish_reason": delta.finish_reason, "policy_version": delta.version}
        if job.kind == "chat":
            entry["delta"] = {"content": delta.text} if delta.text or not delta.finish_reason else {}
            if delta.finish_reason and choice.tool_calls:
                entry["delta"]["tool_calls"] = [{"index": i, **call} for i, call in enumerate(choice.tool_calls)]
            entry["logprobs"] = self.chat_logprobs(job, choice, span)
        else:
            entry["text"] = delta.text
            entry["logprobs"] = self._legacy_logprobs(job, choice, span)
        if job.request.return_token_ids:
            entry["token_ids"] = choice.token_ids[span]
            if job.kind == "completions" and delta.position == 0:
                entry["prompt_token_ids"] = job.prompts[choice.prompt_index]
        if delta.finish_reason:  # the finishing chunk only: per-token chunks stay small
            entry["stop_reason"] = choice.stop_reason
            entry.update(choice.versions())
        return entry

    def chat_logprobs(self, job: Job, choice: Choice, span: slice = slice(None)) -> dict | None:
        """The chat `logprobs` object of `choice`'s tokens in `span` (None when the request asked for none)."""
        if not (isinstance(job.request, ChatCompletionRequest) and job.request.logprobs):
            return None
        content = []
        for token_id, logprob, top in zip(
            choice.token_ids[span], choice.logprobs[span], choice.top_logprobs[span], strict=True
        ):
            token, data = self._token(job, token_id)
            alternatives = []
            for alternative, alternative_logprob in top:
                text, text_bytes = self._token(job, alternative)
                alternatives.append({"token": text, "logprob": _finite(alternative_logprob), "bytes": text_bytes})
            content.append({"token": token, "logprob": logprob, "bytes": data, "top_logprobs": alternatives})
        return {"content": content}

    def _legacy_logprobs(self, job: Job, choice: Choice, span: slice = slice(None)) -> dict | None:
        """OpenAI's legacy completions format; top_logprobs holds the alternatives plus the sampled token."""
        if not (isinstance(job.request, CompletionRequest) and job.request.logprobs is not None):
            return None
        start = span.start or 0
        offset = len(choice.echo) + sum(len(self.text.token(t)[0]) for t in choice.token_ids[:start])
        tokens, offsets, tops, token_logprobs = [], [], [], []
        if choice.echo and span == slice(None):  # echo with logprobs (vLLM, lm-eval): the prompt's tokens first
            tokens, offsets, tops, token_logprobs = self._echo_logprobs(job, choice)
        token_logprobs += choice.logprobs[span]
        for token_id, logprob, top in zip(
            choice.token_ids[span], choice.logprobs[span], choice.top_logprobs[span], strict=True
        ):
            token = self._token(job, token_id)[0]
            tokens.append(token)
            offsets.append(offset)
            offset += len(self.text.token(token_id)[0])
            tops.append({self._token(job, t)[0]: _finite(lp) for t, lp in top} | {token: logprob})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}  # fmt: skip

    def _echo_logprobs(self, job: Job, choice: Choice) -> tuple[list, list, list, list]:
        """The legacy log-prob lists of the echoed prompt: its first token has none (null), as in vLLM."""
        tokens, offsets, tops, logprobs = [], [], [], []
        offset = 0
        for token_id, entry in zip(job.prompts[choice.prompt_index], choice.prompt_logprobs, strict=True):
            token = self._token(job, token_id)[0]
            tokens.append(token)
            offsets.append(offset)
            offset += len(self.text.token(token_id)[0])
            logprobs.append(None if entry is None else entry.logprob)
            top = (
                None if entry is None else {self._token(job, t)[0]: lp for t, lp in entry.top} | {token: entry.logprob}
            )
            tops.append(top)
        return tokens, offsets, tops, logprobs

    def _token(self, job: Job, token_id: int) -> tuple[str, list[int]]:
        """(text, bytes) of a token in log-prob entries; "token_id:{id}" with return_tokens_as_token_ids (vLLM)."""
        if job.request.return_tokens_as_token_ids:
            name = f"token_id:{token_id}"
            return name, list(name.encode())
        return self.text.token(token_id)


def _text_of(content) -> str:
    """A message's content as text (a string, or its text parts joined by newlines, as the template got them:
    `gyre.chat.template_messages`)."""
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content)
    return content or ""


def _finite(logprob: float) -> float:
    """A log-prob as JSON can carry it: a token a grammar ruled out (-inf) is shown as -9999.0, as vLLM does."""
    return max(logprob, -9999.0)


def _ignore(*_) -> None:
    return None


def _wants_logprobs(job: Job) -> bool:
    request = job.request
    return bool(request.logprobs) if isinstance(request, ChatCompletionRequest) else request.logprobs is not None


def _chunk_object(job: Job) -> str:
    return "chat.completion.chunk" if job.kind == "chat" else "text_completion"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def _request_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def _sse(payload: dict) -> str:
    return f"data: {dumps(payload)}\n\n"
