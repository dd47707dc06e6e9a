"""`POST /inference/v1/generate`: vLLM's tokens-in, tokens-out route, plus Gyre's per-choice policy versions.

Clients that render prompts themselves (verifiers' renderer client, PRIME-RL-style trainers) send token ids
and get token ids back, so nothing is re-tokenised between turns:

    request:  {"model", "token_ids": [int], "sampling_params": {"max_tokens", "temperature", "top_p", "seed",
               "n", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", ...}}
    response: {"request_id", "model", "prompt_token_ids", "policy_version", "prompt_logprobs",
               "choices": [{"index", "token_ids", "text", "finish_reason",
                            "logprobs": {"content": [{"token": "token_id:<id>", "logprob", "top_logprobs"}]} | null,
                            "policy_version_min", "policy_version_max"}],
               "usage": {"prompt_tokens", "completion_tokens", "total_tokens"}}

As in vLLM, generation stops at the end-of-sequence token unless `ignore_eos`, and at any `stop_token_ids`; the
stopping token is the last of `token_ids` (finish "stop"); "length" when `max_tokens` ran out (default: the rest of
the context). `logprobs: k` returns the sampled token's log-prob plus the top k (k = 0: only the sampled one;
omitted/null: none). `prompt_logprobs: k` (vLLM's field and shape) fills the top-level `prompt_logprobs`: None for
the first prompt token, then per prompt token {"<id>": {"logprob", "rank", "decoded_token"}} with the token itself
and its k most likely alternatives, raw model log-probs (T = 1) as vLLM's. Choice i of a request with `seed` s
samples exactly like choice i of a chat request with that seed. The policy-version fields mean what they mean
on /v1/chat/completions (docs/inference.md).

The route goes through the `Backend` interface, so the torch and vLLM backends both serve it. It stands behind the
API gate of `gyre_inference.api` like the other API routes: the bearer key when one is configured, 503 until the
model is loaded, the request size limit.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field, model_validator

from gyre_inference.backend import AdapterGoneError, BackendStoppedError, SamplingParams
from gyre_inference.choice import choice_seed
from gyre_inference.disconnects import ClientGone, all_or_none, client_gone, unless_client_gone
from gyre_inference.errors import APIError, backend_failure, unknown_model
from gyre_inference.json_body import FastJSONResponse
from gyre_inference.prompt_logprobs import to_vllm
from gyre_inference.protocol import (
    ALLOWED_HELP,
    BAD_WORDS_HELP,
    CACHE_SALT_HELP,
    FREQUENCY_HELP,
    MAX_BAD_WORDS,
    MAX_N,
    MAX_TOP_LOGPROBS,
    PRESENCE_HELP,
    REPETITION_HELP,
    TRUNCATE_HELP,
    AllowedTokenIds,
    CacheSalt,
    MinP,
    Penalty,
    RepetitionPenalty,
    TopK,
    TruncatePromptTokens,
)
from gyre_inference.request_checks import checked_top_k, context_exceeded, truncated
from gyre_inference.serving import VERSION_HEADER
from gyre_inference.strict import ParamError, StrictModel

ROUTE = "/inference/v1/generate"


class GenerateSamplingParams(StrictModel):
    """vLLM `SamplingParams` fields this server honours (others are refused by name, not silently ignored)."""

    n: int = Field(1, ge=1, le=MAX_N, description="Choices to sample from the prompt.")
    max_tokens: int | None = Field(None, ge=1, description="Tokens per choice (default: the rest of the context).")
    temperature: float = Field(1.0, ge=0, le=2, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    seed: int | None = Field(None, ge=-(2**63), lt=2**64, description="Same seed + request + weights = same output.")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=64, description="Stop tokens.")
    ignore_eos: bool = Field(False, description="Do not stop at the end-of-sequence token.")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="Sampled token's log-prob plus this many top alternatives."
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Log-prob of every prompt token given the ones before it (T = 1) plus this many alternatives.",
    )
    min_tokens: int = Field(0, ge=0, description="No end-of-sequence or stop token before this many tokens.")
    # vLLM fields renderer clients send that change nothing here: token ids are always returned verbatim.
    skip_special_tokens: bool = Field(True, description="Only affects `text` (token ids are returned verbatim).")
    detokenize: bool = Field(True, description="false: `text` is left empty.")
    # vLLM sampling fields a PRIME-RL-style client sends at their neutral value: accepted only so (as on chat).
    top_k: TopK | None = Field(None, description="Draw from the k most likely tokens; -1 or 0 = off.")
    min_p: MinP | None = Field(
        None, description="Draw only tokens with at least min_p times the top probability; 0 = off."
    )
    repetition_penalty: RepetitionPenalty | None = Field(None, description=REPETITION_HELP)
    presence_penalty: Penalty = Field(0.0, description=PRESENCE_HELP)
    frequency_penalty: Penalty = Field(0.0, description=FREQUENCY_HELP)
    allowed_token_ids: AllowedTokenIds | None = Field(None, description=ALLOWED_HELP)
    truncate_prompt_tokens: TruncatePromptTokens | None = Field(None, description=TRUNCATE_HELP)
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, max_length=MAX_BAD_WORDS, description=BAD_WORDS_HELP
    )

    @model_validator(mode="after")
    def _min_tokens_fit(self):
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError(
                "min_tokens", f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})"
            )
        return self


class GenerateRequest(StrictModel):
    model: str = Field(description="Served model id (see GET /v1/models).")
    token_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1, description="The prompt, already tokenised.")
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = Field(False, description="Only false is supported.")
    cache_salt: CacheSalt | None = Field(None, description=CACHE_SALT_HELP)
    priority: int = Field(0, ge=-(2**31), lt=2**31, description="Scheduling priority, lower is served first.")


async def _sample(state, prompt: list[int], params: SamplingParams, index: int, sp: GenerateSamplingParams) -> dict:
    ids: list[int] = []
    entries: list[dict[str, Any]] = []
    versions: list[int] = []
    finish = None
    prompt_lps = None
    stream = state.backend.generate(prompt, params)
    try:
        async for event in stream:
            prompt_lps = prompt_lps or event.prompt_logprobs
            ids.append(event.token_id)
            versions.append(event.version)
            entry: dict[str, Any] = {"token": f"token_id:{event.token_id}", "logprob": event.logprob}
            if sp.logprobs:
                entry["top_logprobs"] = [{"token": f"token_id:{t}", "logprob": lp} for t, lp in event.top_logprobs]
            entries.append(entry)
            finish = event.finish_reason or finish
    finally:
        await stream.aclose()
    # the stop token that ended the choice is not text (vLLM's detokenizer leaves it out): with skip_special_tokens
    # false, "<|im_end|>" ended every text
    shown = ids[:-1] if finish == "stop" and ids and ids[-1] in params.stop_token_ids else ids
    text = state.text.tokenizer.decode(shown, skip_special_tokens=sp.skip_special_tokens) if sp.detokenize else ""
    return {
        "index": index,
        "token_ids": ids,
        "text": text,
        "finish_reason": finish or "length",
        "logprobs": {"content": entries} if sp.logprobs is not None else None,
        "policy_version_min": min(versions, default=state.backend.version),
        "policy_version_max": max(versions, default=state.backend.version),
        "_prompt_logprobs": prompt_lps,
    }


def add_generate_route(app: FastAPI, state) -> None:
    """Register `POST /inference/v1/generate` on the inference app (`state`: api.AppState)."""

    @app.post(ROUTE, summary="vLLM-compatible tokens in, tokens out (with per-choice policy versions).")
    async def generate(body: GenerateRequest, request: Request) -> FastJSONResponse:
        started = time.monotonic()
        try:
            adapter = state.backend.adapter_for(body.model, state.model_id)
        except KeyError:
            raise unknown_model(body.model, state.model_id) from None
        run = state.metrics.run_of(adapter)
        if body.stream:
            raise APIError(400, "stream: true is not supported on this route", param="stream")
        sp = body.sampling_params
        limit = state.backend.max_model_len
        prompt = state.text.check_ids(body.token_ids, "token_ids")
        [prompt] = truncated([prompt], sp.truncate_prompt_tokens, limit, "sampling_params.truncate_prompt_tokens")
        max_tokens = sp.max_tokens if sp.max_tokens is not None else limit - len(prompt)
        if max_tokens < 1 or len(prompt) + max_tokens > limit:
            raise context_exceeded(limit, len(prompt), sp.max_tokens, "token_ids")
        if sp.min_tokens > max_tokens:  # the default limit, the rest of the context (a given one: validation)
            raise APIError(400, f"min_tokens ({sp.min_tokens}) must be at most max_tokens, which is {max_tokens} "
                                f"here: the context's {limit} tokens less the {len(prompt)} of token_ids",
                           param="sampling_params.min_tokens")  # fmt: skip
        # out of vocabulary: a 400, not a failed engine step for the whole batch (as on the OpenAI routes)
        stops = set(state.text.check_ids(sp.stop_token_ids or [], "sampling_params.stop_token_ids"))
        stops |= set() if sp.ignore_eos else set(state.text.eos_token_ids)
        top_k = checked_top_k(sp.top_k, state.text.vocab_size, "sampling_params.top_k")
        allowed = sp.allowed_token_ids
        if allowed is not None:
            allowed = frozenset(state.text.check_ids(allowed, "sampling_params.allowed_token_ids"))
        bad_words = tuple(sp.bad_words or ())
        bad_word_ids = state.text.bad_word_ids(list(bad_words), "sampling_params.bad_words")
        params = [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=sp.temperature,
                top_p=sp.top_p,
                top_k=top_k,
                min_p=sp.min_p or 0.0,
                seed=None if sp.seed is None else choice_seed(sp.seed, i),
                stop_token_ids=frozenset(stops),
                top_logprobs=sp.logprobs or 0,
                adapter=adapter,
                prompt_logprobs=sp.prompt_logprobs if i == 0 else None,  # one prompt: computed once
                min_tokens=min(sp.min_tokens, max_tokens),
                priority=body.priority,
                repetition_penalty=sp.repetition_penalty or 1.0,
                presence_penalty=sp.presence_penalty,
                frequency_penalty=sp.frequency_penalty,
                allowed_token_ids=allowed,
                bad_words=bad_words,
                bad_word_ids=bad_word_ids,
                cache_salt=body.cache_salt,
            )
            for i in range(sp.n)
        ]
        try:  # a client that goes away (timed out) cancels its sequences, as on the OpenAI routes
            choices = await unless_client_gone(
                all_or_none(*(_sample(state, prompt, p, i, sp) for i, p in enumerate(params))), client_gone(request)
            )
        except ClientGone:
            state.metrics.request_done("generate", "aborted", time.monotonic() - started, run)
            return Response(status_code=499)  # nobody is listening
        except (BackendStoppedError, AdapterGoneError) as error:  # 503 / 404 as on the OpenAI routes, not a 500
            if isinstance(error, BackendStoppedError):  # a 404 is counted by the app's client-error handler
                state.metrics.request_done("generate", "unavailable", time.monotonic() - started, run)
            raise backend_failure(error, body.model, state.model_id) from None
        except Exception:
            state.metrics.request_done("generate", "server_error", time.monotonic() - started, run)
            raise
        prompt_lps = choices[0].pop("_prompt_logprobs")
        for choice in choices[1:]:
            del choice["_prompt_logprobs"]
        completion_tokens = sum(len(c["token_ids"]) for c in choices)
        state.metrics.prompt_tokens.labels(run).inc(len(prompt))
        state.metrics.generation_tokens.labels(run).inc(completion_tokens)
        state.metrics.request_done("generate", "success", time.monotonic() - started, run)
        newest = max(c["policy_version_max"] for c in choices)
        payload = {
            "request_id": f"gen-{uuid.uuid4().hex}",
            "model": body.model,
            "prompt_token_ids": prompt,
            "policy_version": newest,
            "choices": list(choices),
            "prompt_logprobs": None
            if sp.prompt_logprobs is None
            else to_vllm(prompt_lps, prompt, lambda t: f"token_id:{t}"),
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt) + completion_tokens,
            },
        }
        return FastJSONResponse(payload, headers={VERSION_HEADER: str(newest)})
