"""The OpenAPI document of the inference API, made to say what the server really answers.

FastAPI's generated document describes the request models well but the responses wrongly for this
server: it lists 422 with FastAPI's own error shape (we answer 400 with OpenAI's), omits 401, 404,
413 and 503, knows nothing of `text/event-stream`, and calls `/metrics` JSON. `truthful_openapi`
post-processes it: every operation documents the statuses it can send with the OpenAI error body,
200 bodies get their real schemas, streaming routes also offer `text/event-stream`, `/metrics` is
Prometheus text. Schemathesis checks responses against this document (tests/integration/inference).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from gyre_inference.lora_routes import ROUTES as LORA_ROUTES

_ERROR = {"$ref": "#/components/schemas/ErrorResponse"}
_NULLABLE_STRING = {"anyOf": [{"type": "string"}, {"type": "null"}]}
_INT_LIST = {"type": "array", "items": {"type": "integer"}}
# vLLM's stop_reason: the stop string or stop token id that ended a choice, else null
_STOP_REASON = {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}

SCHEMAS: dict[str, dict[str, Any]] = {
    "ErrorResponse": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": _NULLABLE_STRING,
                    "code": _NULLABLE_STRING,
                },
            }
        },
    },
    "Usage": {
        "type": "object",
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
        "properties": {
            name: {"type": "integer", "minimum": 0} for name in ("prompt_tokens", "completion_tokens", "total_tokens")
        },
    },  # fmt: skip
    "ChatCompletion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "usage": {"$ref": "#/components/schemas/Usage"},
            "prompt_token_ids": _INT_LIST,
            "prompt_logprobs": {"type": "array", "items": {"anyOf": [{"type": "object"}, {"type": "null"}]}},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "message", "finish_reason", "policy_version"],
                    "properties": {
                        "index": {"type": "integer"},
                        "message": {
                            "type": "object",
                            "required": ["role", "content"],
                            "properties": {
                                "role": {"const": "assistant"},
                                "content": _NULLABLE_STRING,
                                "tool_calls": {"type": "array", "items": {"type": "object"}},
                            },
                        },
                        "logprobs": {"anyOf": [{"type": "object"}, {"type": "null"}]},
                        "finish_reason": {"enum": ["stop", "length", "tool_calls", "abort"]},
                        "stop_reason": _STOP_REASON,
                        "policy_version": {"type": "integer"},
                        "policy_version_min": {"type": "integer"},
                        "policy_version_max": {"type": "integer"},
                        "token_ids": _INT_LIST,
                    },
                },
            },
        },
    },
    "Completion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "text_completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "usage": {"$ref": "#/components/schemas/Usage"},
            "prompt_token_ids": _INT_LIST,
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "text", "finish_reason", "policy_version"],
                    "properties": {
                        "index": {"type": "integer"},
                        "text": {"type": "string"},
                        "logprobs": {"anyOf": [{"type": "object"}, {"type": "null"}]},
                        "finish_reason": {"enum": ["stop", "length", "abort"]},
                        "stop_reason": _STOP_REASON,
                        "policy_version": {"type": "integer"},
                        "prompt_logprobs": {
                            "type": "array",
                            "items": {"anyOf": [{"type": "object"}, {"type": "null"}]},
                        },
                        "prompt_token_ids": _INT_LIST,
                        "token_ids": _INT_LIST,
                    },
                },
            },
        },
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": {"$ref": "#/components/schemas/Model"}},
        },
    },
    "Model": {
        "type": "object",
        "required": ["id", "object", "created", "owned_by", "max_model_len", "policy_version"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "root": {"type": "string"},
            "parent": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "max_model_len": {"type": "integer"},
            "permission": {"type": "array", "items": {"type": "object"}},
            "policy_version": {"type": "integer"},
        },
    },
    "Response": {
        "type": "object",
        "required": ["id", "object", "created_at", "status", "model", "output", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "response"},
            "created_at": {"type": "integer"},
            "status": {"enum": ["completed", "incomplete"]},
            "model": {"type": "string"},
            "output": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["type", "id", "status"],
                    "properties": {"type": {"enum": ["message", "function_call"]}, "id": {"type": "string"}},
                },
            },
            "incomplete_details": {"anyOf": [{"type": "object"}, {"type": "null"}]},
            "usage": {
                "type": "object",
                "required": ["input_tokens", "output_tokens", "total_tokens"],
                "properties": {
                    name: {"type": "integer", "minimum": 0}
                    for name in ("input_tokens", "output_tokens", "total_tokens")
                },
            },
            "policy_version": {"type": "integer"},
        },
    },  # fmt: skip
    "TokenizeResponse": {
        "type": "object",
        "required": ["count", "max_model_len", "tokens", "token_strs"],
        "properties": {
            "count": {"type": "integer"},
            "max_model_len": {"type": "integer"},
            "tokens": _INT_LIST,
            "token_strs": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
        },
    },
    "DetokenizeResponse": {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
    "Health": {"type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}},
    "Version": {"type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}},
    "Ready": {
        "type": "object",
        "required": ["status", "model", "policy_version"],
        "properties": {
            "status": {"const": "ready"},
            "model": {"type": "string"},
            "policy_version": {"type": "integer"},
        },
    },
}

# One server-sent event: `data` holds a JSON chunk, an `{"error": ...}` object, or the final `[DONE]`.
_SSE = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "required": ["data"],
            "properties": {"data": {"type": "string", "contentMediaType": "application/json"}},
        },
        "example": 'data: {"id": "...", "object": "chat.completion.chunk", "choices": [...]}\n\ndata: [DONE]\n\n',
    }
}
# Responses API events: `event: <type>` and `data: {"type": <type>, "sequence_number", ...}`.
_RESPONSE_EVENTS = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "required": ["event", "data"],
            "properties": {
                "event": {"type": "string"},
                "data": {"type": "string", "contentMediaType": "application/json"},
            },
        },
        "example": 'event: response.created\ndata: {"type": "response.created", "sequence_number": 0, ...}\n\n',
    }
}
_VERSION_HEADER = {
    "x-gyre-policy-version": {"description": "Weights version (see docs/inference.md).", "schema": {"type": "string"}}
}


def _always(name: str, description: str) -> dict:
    """A response header the server always sends (checked by schemathesis against real responses)."""
    return {name: {"description": description, "required": True, "schema": {"type": "string"}}}


_REQUEST_ID_HEADER = _always("x-request-id", "The request's id: the client's X-Request-Id, else a new one.")
_RETRY_AFTER_HEADER = _always("retry-after", "Seconds to wait before retrying (5 while loading, else 1).")

_WHY = {
    400: "Invalid request (OpenAI error; `param` names the field).",
    401: "Missing or wrong API key (when one is configured).",
    404: "Unknown model (`code: model_not_found`).",
    409: "Every adapter slot serves queued or running requests (`code: adapter_slots_busy`, lora.max_loras).",
    413: "Request body over `server.max_request_bytes`.",
    415: "A compressed request body (`Content-Encoding` other than identity): send it uncompressed.",
    499: "The client went away before the answer (nobody reads this; nginx's convention).",
    503: "The model is loading or the server is shutting down (`code: not_ready`).",
}

# the runtime LoRA routes (LORA_ROUTES) change what a replica serves: they take the control token, not the API key
_CONTROL_401 = "Missing or wrong control token (auth.control_token; the API key when no control token is set)."

# path -> (200 schema name, extra statuses). Every route of the API can also answer 401 and 503.
_API = {
    "/v1/models": ("ModelList", ()),
    "/v1/models/{model_id}": ("Model", (404,)),
    "/v1/responses": ("Response", (400, 404, 413, 415, 499)),
    "/v1/chat/completions": ("ChatCompletion", (400, 404, 413, 415, 499)),
    "/v1/completions": ("Completion", (400, 404, 413, 415, 499)),
    "/tokenize": ("TokenizeResponse", (400, 404, 413, 415)),
    "/detokenize": ("DetokenizeResponse", (400, 404, 413, 415)),
}


def truthful_openapi(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document with real responses (cached on the app like FastAPI's own)."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 shape: never sent
        components.pop(name, None)
    components.update(SCHEMAS)
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            operation["responses"] = _responses(path, operation.get("responses", {}))
            for status, response in operation["responses"].items():  # what api._response_headers adds
                if status != "499":  # nobody reads a 499
                    extra = _RETRY_AFTER_HEADER if status == "503" else {}
                    response["headers"] = {**response.get("headers", {}), **_REQUEST_ID_HEADER, **extra}
    app.openapi_schema = schema
    return schema


def _json(name: str) -> dict:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}


def _error(status: int) -> dict:
    return {"description": _WHY[status], "content": {"application/json": {"schema": _ERROR}}}


def _responses(path: str, generated: dict[str, Any]) -> dict[str, Any]:
    if path not in _API and path not in ("/health", "/ready", "/ping", "/metrics", "/version"):
        # A route registered by another module (e.g. the tokens-in route): keep its 200, and document the
        # errors every API route can send instead of FastAPI's 422.
        kept = {status: response for status, response in generated.items() if status != "422"}
        gone = {"499": {"description": _WHY[499]}} if path == "/inference/v1/generate" else {}
        busy = {"409": _error(409)} if path == "/v1/load_lora_adapter" else {}  # lora.max_loras reached
        control = {"401": _error(401) | {"description": _CONTROL_401}} if path in LORA_ROUTES else {}
        return kept | {str(status): _error(status) for status in (400, 401, 404, 413, 415, 503)} | busy | gone | control
    if path == "/health":
        return {"200": {"description": "The process answers.", "content": _json("Health")}}
    if path == "/version":
        return {"200": {"description": "The gyre version serving.", "content": _json("Version")}}
    if path in ("/ready", "/ping"):
        return {"200": {"description": "Ready.", "content": _json("Ready")}, "503": _error(503)}
    if path == "/metrics":
        text = {"text/plain": {"schema": {"type": "string"}}}
        return {"200": {"description": "Prometheus text exposition (gyre_inference_*).", "content": text}}
    name, extra = _API[path]
    ok: dict[str, Any] = {"description": "Success.", "content": _json(name)}
    if path in ("/v1/chat/completions", "/v1/completions"):
        ok["content"] |= _SSE
        ok["description"] = "The completion (JSON), or with `stream: true` server-sent events ending in [DONE]."
        ok["headers"] = _VERSION_HEADER
    if path == "/v1/responses":
        ok["content"] |= _RESPONSE_EVENTS
        ok["description"] = "The Response (JSON), or with `stream: true` its events (response.created ... completed)."
        ok["headers"] = _VERSION_HEADER
    responses: dict[str, Any] = {"200": ok}
    for status in sorted({401, 503, *extra}):
        responses[str(status)] = (
            {"description": _WHY[499]} if status == 499 else _error(status)  # 499 has no body
        )
    return responses
