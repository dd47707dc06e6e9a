"""The FastAPI app: OpenAI routes, vLLM's /tokenize and /detokenize, probes and /metrics.

Routes:
- `GET /health` (liveness: the process answers), `GET /ready` (200 once the model is loaded, 503
  before and while shutting down; `GET`/`POST /ping`, vLLM's, the same), `GET /version` (vLLM's route:
  the gyre version), `GET /metrics` (when `metrics.port` is unset).
- `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions`, `POST /v1/completions`,
  `POST /v1/responses` (`gyre_inference.responses`), `POST /tokenize`,
  `POST /detokenize`, `POST /inference/v1/generate` (`gyre_inference.tokens_in`), `POST /classify` and
  `POST /v1/classify` (`gyre_inference.classify`, a reward model served with `runner = pooling`): these need
  `Authorization: Bearer <auth.api_key>` when a key is configured, and answer 503 until the model is
  loaded. One gate (`_Gate`) checks both, for every one of them, before the body is read. A key read from
  `auth.api_key_file` is read again when the file is rotated (`gyre_inference.api_key`).
- With `lora.runtime_updates`: `POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`
  (`gyre_inference.lora_routes`). An operator action, like a gRPC UpdateWeights: they need the control token when
  one is configured (the API key, which clients that only sample hold, does not do), else the API key.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gyre_inference.api_key import ServerKey
from gyre_inference.backend import Backend
from gyre_inference.classify import add_classify_route
from gyre_inference.disconnects import client_gone
from gyre_inference.errors import APIError, error_body, error_response, install_error_handlers, unknown_model
from gyre_inference.lora_routes import ROUTES as LORA_ROUTES
from gyre_inference.lora_routes import add_lora_routes
from gyre_inference.metrics import InferenceMetrics
from gyre_inference.openapi import truthful_openapi
from gyre_inference.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeRequest,
)
from gyre_inference.request_checks import check_tool_replies, check_tool_schemas
from gyre_inference.responses import ResponsesRequest, respond
from gyre_inference.serving import Serving
from gyre_inference.text import ModelText
from gyre_inference.tokens_in import ROUTE as GENERATE_ROUTE
from gyre_inference.tokens_in import add_generate_route

_PROTECTED = ("/v1/", "/tokenize", "/detokenize", GENERATE_ROUTE, "/classify")
_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses",
              GENERATE_ROUTE: "generate", "/classify": "classify", "/v1/classify": "classify"}  # fmt: skip
# what a pooling model cannot serve
_GENERATION = ("/v1/chat/completions", "/v1/completions", "/v1/responses", GENERATE_ROUTE)


@dataclass
class AppState:
    """What the routes need; `text`/`serving` appear once the model is loaded."""

    model_id: str
    model_path: str
    backend: Backend
    metrics: InferenceMetrics
    api_key: ServerKey | str | None = None  # a str: a fixed key (ServerKey re-reads a rotated key file)
    serve_metrics: bool = True
    text: ModelText | None = None
    serving: Serving | None = None
    draining: bool = False
    max_request_bytes: int = 4 * 2**20
    created: int = field(default_factory=lambda: int(time.time()))
    runtime_lora: bool = False  # lora.runtime_updates: serve /v1/load_lora_adapter and /v1/unload_lora_adapter
    control_token: ServerKey | str | None = None  # what those two routes need when set (instead of the API key)

    def __post_init__(self):
        if isinstance(self.api_key, str):
            self.api_key = ServerKey(self.api_key)
        if isinstance(self.control_token, str):
            self.control_token = ServerKey(self.control_token, name="auth.control_token")

    @property
    def ready(self) -> bool:
        return self.serving is not None and self.backend.ready and not self.draining


class _Gate:
    """ASGI middleware in front of the routes: body size limit; for the API routes also arrival time, API
    key, readiness.

    Runs before the body is read, so a request without a valid key is refused with 401 whatever its body,
    and a body over `max_request_bytes` gets 413 without being read (by its Content-Length) or as soon as
    the bytes read pass the limit (chunked uploads): nobody can make the server buffer or parse it.
    """

    def __init__(self, app, state: AppState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        send = _response_headers(send, _request_id(scope))
        limit = self.state.max_request_bytes
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            return await self._refuse(scope, receive, send, _too_large(limit))
        receive = _limited(receive, limit)
        encoding = dict(scope.get("headers") or []).get(b"content-encoding", b"identity").decode("latin-1")
        if encoding.strip().lower() not in ("", "identity"):
            # the body would be read as plain JSON and fail as garbage; decoding it would let a few compressed KB
            # inflate past max_request_bytes. 415 is HTTP's answer to a content coding the server does not take.
            refused = APIError(415, f"Content-Encoding {encoding!r} is not supported: send the body uncompressed")
            return await self._refuse(scope, receive, send, refused)
        if not scope["path"].startswith(_PROTECTED):
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrival"] = time.monotonic()
        failure = None
        key, what = self.state.api_key, "API key (Authorization: Bearer <key>)"
        if self.state.runtime_lora and scope["path"] in LORA_ROUTES and self.state.control_token is not None:
            key, what = self.state.control_token, "control token (Authorization: Bearer <auth.control_token>)"
        if key is not None:
            headers = dict(scope.get("headers") or [])
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not key.accepts(given):
                failure = APIError(401, f"Incorrect or missing {what}.", code="invalid_api_key")
        retry_after = None
        if failure is None and not self.state.ready:
            reason = "the server is shutting down" if self.state.draining else "the model is still loading"
            failure = APIError(503, f"{reason}; retry shortly", code="not_ready")
            retry_after = None if self.state.draining else LOADING_RETRY_AFTER_S
        if failure is None and scope["path"] in _GENERATION and getattr(self.state.backend, "runner", "") == "pooling":
            failure = APIError(400, "this server runs a reward model (runner = pooling): it answers /classify, "
                                    "not generation", param="model")  # fmt: skip
        if failure is None:
            return await self.app(scope, receive, send)
        await self._refuse(scope, receive, send, failure, retry_after)

    async def _refuse(self, scope, receive, send, failure: APIError, retry_after: int | None = None) -> None:
        endpoint = _ENDPOINTS.get(scope["path"])
        if endpoint:
            self.state.metrics.request_done(endpoint, "client_error" if failure.status < 500 else "unavailable")
        headers = {"www-authenticate": "Bearer"} if failure.status == 401 else {}
        if retry_after is not None:
            headers["retry-after"] = str(retry_after)
        await error_response(failure, headers or None)(scope, receive, send)


# Retry-After of a 503 (seconds). The official OpenAI clients retry a 503 twice by default, after about 0.5 s
# and 1 s of their own backoff, which ends before most models are loaded; they wait a Retry-After of up to
# 60 s instead. Loading: a few seconds per try. Otherwise (draining, the engine stopped): the replica is going
# away, and a retry soon through the Service reaches another one.
LOADING_RETRY_AFTER_S = 5
RETRY_AFTER_S = 1


def _request_id(scope) -> bytes:
    """The request's id: the client's X-Request-Id (a tracing id a proxy or app set) when it is a short printable
    token, else a new one, as vLLM's server (--enable-request-id-headers) and OpenAI's API answer it."""
    given = dict(scope.get("headers") or []).get(b"x-request-id", b"")
    if 0 < len(given) <= 256 and all(0x21 <= byte <= 0x7E for byte in given):
        return given
    return uuid.uuid4().hex.encode()


def _response_headers(send, request_id: bytes):
    """`send` that adds X-Request-Id to every response, and Retry-After (RETRY_AFTER_S unless the refusal set
    its own) to every 503."""

    async def wrapped(message):
        if message["type"] == "http.response.start":
            headers = [*(message.get("headers") or []), (b"x-request-id", request_id)]
            if message["status"] == 503 and not any(name.lower() == b"retry-after" for name, _ in headers):
                headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
            message = {**message, "headers": headers}
        await send(message)

    return wrapped


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds the limit of {limit} bytes (server.max_request_bytes)",
                    code="request_too_large")  # fmt: skip


class _BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` while the route reads the body (FastAPI re-raises HTTP exceptions as they are)."""

    def __init__(self, limit: int):
        error = _too_large(limit)
        super().__init__(error.status, error.message)
        self.code = error.code


def _limited(receive, limit: int):
    """`receive` that fails the request with 413 once more than `limit` body bytes have arrived."""
    seen = 0

    async def wrapped():
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _BodyTooLarge(limit)
        return message

    return wrapped


def create_app(state: AppState) -> FastAPI:
    app = FastAPI(title="Gyre inference", version="1", summary="OpenAI-compatible API of one policy model.")

    def client_error(request: Request, status: int) -> None:
        endpoint = _ENDPOINTS.get(request.url.path)
        if endpoint and status < 500:
            state.metrics.request_done(endpoint, "client_error")

    app.openapi = lambda: truthful_openapi(app)
    install_error_handlers(app, on_client_error=client_error)
    app.add_middleware(_Gate, state=state)

    def arrival(request: Request) -> float:
        return request.scope.get("state", {}).get("arrival", time.monotonic())

    @app.get("/health", summary="Liveness: the process answers.")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/version", summary="The gyre version serving (vLLM's route).")
    async def version() -> dict:
        from gyre import __version__

        return {"version": __version__}

    @app.get("/ready", summary="Readiness: the model is loaded and the server is not shutting down.")
    async def ready():
        if not state.ready:
            return JSONResponse(error_body(503, "not ready", code="not_ready"), status_code=503)
        return {"status": "ready", "model": state.model_id, "policy_version": state.backend.version}

    # vLLM's /ping (SageMaker's health check, GET or POST): 200 once the server can serve. vLLM's HTTP server only
    # starts with its model loaded, so its /ping answering means ready; ours starts before the load, so /ping
    # answers as /ready does (503 while loading and while shutting down), never 200 for a server that cannot serve.
    app.get("/ping", summary="vLLM's (SageMaker's) health check: as /ready.")(ready)
    app.post("/ping", summary="vLLM's (SageMaker's) health check: as /ready.")(ready)

    if state.serve_metrics:

        @app.get("/metrics", summary="Prometheus metrics (gyre_inference_*).")
        async def metrics() -> Response:
            return Response(state.metrics.exposition(), media_type=state.metrics.content_type)

    def model_cards() -> list[dict]:
        card = {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "gyre",
                "root": state.model_path, "parent": None, "max_model_len": state.backend.max_model_len,
                "permission": [_permission(state.model_id, state.created)],
                "policy_version": state.backend.version}  # fmt: skip
        # named adapters (multi-run) in vLLM's shape: their own id, the served model as parent
        adapters = [
            {**card, "id": name, "root": name, "parent": state.model_id,
             "permission": [_permission(name, state.created)], "policy_version": state.backend.adapter_version(name)}
            for name in state.backend.adapter_names
        ]  # fmt: skip
        return [card, *adapters]

    @app.get("/v1/models", summary="The served model.")
    async def models() -> dict:
        return {"object": "list", "data": model_cards()}

    # `:path`: a model id may be a folder path (the default id is model.name), slashes included
    @app.get("/v1/models/{model_id:path}", summary="One model card (the served model or a named adapter).")
    async def model(model_id: str) -> dict:
        for card in model_cards():
            if card["id"] == model_id:
                return card
        raise unknown_model(model_id, state.model_id)

    @app.post("/v1/responses", summary="OpenAI Responses API: text and function tools, streaming or not.")
    async def responses(body: ResponsesRequest, request: Request):
        return await respond(state.serving, _served(state, body), arrival(request), client_gone(request))

    @app.post("/v1/chat/completions", summary="Chat completion (OpenAI), streaming or not.")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await state.serving.chat(_served(state, body), arrival(request), client_gone(request))

    @app.post("/v1/completions", summary="Text completion (OpenAI legacy); prompt may be token ids.")
    async def completions(body: CompletionRequest, request: Request):
        return await state.serving.completions(_served(state, body), arrival(request), client_gone(request))

    @app.post("/tokenize", summary="vLLM-compatible: prompt text or chat messages to token ids.")
    async def tokenize(body: TokenizeRequest) -> dict:
        _check_model(state, body.model)
        if isinstance(body, TokenizeChatRequest):
            # the prompt a chat request of these messages and tools gets, refused as that request would be
            if body.tools:
                await asyncio.to_thread(check_tool_schemas, body.tools)
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
            messages = [message.model_dump(exclude_none=True) for message in body.messages]
            check_tool_replies(messages)
            tokens = await asyncio.to_thread(
                state.text.chat_prompt, messages, tools, body.add_generation_prompt,
                continue_final_message=body.continue_final_message, template_kwargs=body.chat_template_kwargs,
                add_special_tokens=body.add_special_tokens,
            )  # fmt: skip
        else:
            tokens = await asyncio.to_thread(state.text.encode, body.prompt, body.add_special_tokens)
        strings = state.text.token_strings(tokens) if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": state.backend.max_model_len, "tokens": tokens,
                "token_strs": strings}  # fmt: skip

    @app.post("/detokenize", summary="vLLM-compatible: token ids to text.")
    async def detokenize(body: DetokenizeRequest) -> dict:
        _check_model(state, body.model)
        ids = state.text.check_ids(body.tokens, "tokens")
        return {"prompt": await asyncio.to_thread(state.text.decode_prompt, ids)}

    add_generate_route(app, state)  # POST /inference/v1/generate
    add_classify_route(app, state)  # POST /classify, /v1/classify (runner = pooling)
    if state.runtime_lora:
        add_lora_routes(app, state)  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter
    return app


def _permission(model_id: str, created: int) -> dict:
    """vLLM's model card's permission entry (its ModelPermission defaults), for clients that read vLLM's card whole;
    its id is the model's (vLLM draws one per call: the same card read twice compared unequal)."""
    return {"id": f"modelperm-{uuid.uuid5(uuid.NAMESPACE_URL, model_id).hex}", "object": "model_permission",
            "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False,
            "allow_view": True, "allow_fine_tuning": False, "organization": "*", "group": None,
            "is_blocking": False}  # fmt: skip


def _served(state: AppState, body):
    """`body` with its model filled in: a request without one is for the served model, named so in the answer (as
    vLLM's server takes it)."""
    if body.model is None:
        body.model = state.model_id
    return body


def _check_model(state: AppState, model: str | None) -> None:
    try:
        state.backend.adapter_for(model, state.model_id)
    except KeyError:
        raise unknown_model(model, state.model_id) from None
