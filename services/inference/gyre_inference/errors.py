"""OpenAI-shaped errors: every failure answers `{"error": {"message", "type", "param", "code"}}`.

Client mistakes are 4xx and never take the server down: malformed JSON, validation errors (FastAPI's
422 is turned into OpenAI's 400 with `param` naming the field), unknown routes and models, bad keys.
Only a bug or an engine failure is a 5xx ("server_error").
"""

from __future__ import annotations

import ast
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gyre_inference.backend import AdapterGoneError, BackendStoppedError

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 503: "unavailable"}


class APIError(Exception):
    """Raise anywhere in a route to answer with this status and OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None, type=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        """The OpenAI error body of this error (a response's, or a stream's error event)."""
        return error_body(self.status, self.message, self.param, self.code, self.type)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None, type=None) -> dict:
    kind = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


_SCALARS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean", "none": "null"}


def _is_member(part: Any) -> bool:
    """A loc entry pydantic inserts to name a union member (`str`, `list[constrained-int]`, ...)."""
    return isinstance(part, str) and (part in _SCALARS or not part.isidentifier())


def _field_path(loc: tuple[Any, ...]) -> str | None:
    # ("body", "messages", 0, "user", "content") -> "messages.0.content": drop the body prefix and the
    # names pydantic inserts for union members (tags, type names and model class names such as
    # `TokenizeChatRequest`), keep field names, indices and dict keys that are numbers (logit_bias.5).
    # a dict key that failed its own check (logit_bias's "-1") is named by its message: the path is the dict's
    loc = loc[:-2] if loc[-1:] == ("[key]",) else loc
    parts = [p for p in loc[1:] if isinstance(p, int) or (isinstance(p, str) and (p.isdigit() or (
        p.isidentifier() and not p[0].isupper())))]  # fmt: skip
    # a message's role tag follows its index (messages.0.user.content); elsewhere `user` is the request's field
    kept = [p for i, p in enumerate(parts) if not (i and isinstance(parts[i - 1], int) and p in _ROLES)]
    return ".".join(str(p) for p in kept if p not in _SCALARS) or None


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _readable(member: str) -> str:
    """`list[list[constrained-int]]` -> "a list of lists of integers"; `literal['auto','none']` -> "one of 'auto',
    'none'"."""
    member = member.replace("constrained-", "")
    if member in _SCALARS:
        return _SCALARS[member]
    if member.startswith("tagged-union["):  # the kinds of a list's items (the Responses API's input items)
        return "an object"
    if member.startswith("literal[") and member.endswith("]"):
        return "one of " + ", ".join(repr(value) for value in ast.literal_eval(member[7:]))
    if member.startswith("list[") and member.endswith("]"):
        return "a list of " + _plural(_readable(member[5:-1]))
    return _OBJECTS.get(member, f"an object ({member})")


def _plural(phrase: str) -> str:
    noun = phrase.split(" ", 1)[1]  # drop the article
    if not any(mark in noun for mark in (" of ", "(", ",")):  # "text part" -> "text parts"
        return f"{noun}s"
    head, _, rest = noun.partition(" ")  # "list of integers" -> "lists of integers"
    return f"{head}s {rest}".rstrip()


# Union members that are objects, by what a client calls them (their class names meant nothing to one)
_OBJECTS = {
    "TextPart": "a text part",
    "NamedToolChoice": 'a named tool, {"type": "function", "function": {"name": ...}}',
    "NamedFunctionChoice": 'a named tool, {"type": "function", "name": ...}',
}


def _union_message(errors: list[dict]) -> tuple[str, str | None] | None:
    """One message for a value that matched no member of a multi-type field, instead of the first member's
    complaint: the complaint of a member whose type the value had (it broke a constraint there), else
    what the field accepts; with the param, the field that message names."""
    first = tuple(errors[0].get("loc", ()))
    cut = next((i for i, part in enumerate(first) if i and _is_member(part)), None)
    if cut is None:
        return None
    prefix = first[:cut]
    same = [e for e in errors if tuple(e.get("loc", ()))[:cut] == prefix and len(e.get("loc", ())) > cut]
    members = list(dict.fromkeys(e["loc"][cut] for e in same))
    if len(members) < 2:
        return None
    # a broken constraint (an empty list inside a list of lists) before a wrong type deeper down (the same value read
    # as a list of integers: its first item is no integer), which says less about what the client meant. A value
    # that is none of a literal member's values (tool_choice's 'auto', 'none', 'required') is of another member,
    # as a wrong type is: an object missing its `function` was "Input should be 'auto', 'none' or 'required' (as an
    # object (literal['auto','none','required']))", not "tool_choice.function: Field required".
    broken = [e for e in same if not e["type"].endswith("_type") and not _literal_member(e, cut)]
    right_type = broken or [e for e in same if len(e["loc"]) > cut + 1]
    if right_type:
        error = right_type[0]
        path = _field_path(tuple(error["loc"]))  # the param too: the field the message names (stop.1)
        return f"{path}: {_clean(error['msg'])} (as {_readable(error['loc'][cut])})", path
    accepted = ", ".join(_readable(m) for m in members[:-1]) + " or " + _readable(members[-1])
    return f"{_field_path(prefix)}: must be {accepted}", _field_path(prefix)


def _literal_member(error: dict, cut: int) -> bool:
    """`error` says that the value is none of a literal member's values (the member itself, not a field in it)."""
    return error["type"] == "literal_error" and len(error["loc"]) == cut + 1


def _clean(message: str) -> str:
    return message.removeprefix("Value error, ")


_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _out_of_range(error: dict, param: str | None) -> tuple[str, str] | None:
    """OpenAI's message and code for a number out of range or an array of the wrong length ("Invalid 'n': integer
    above maximum value. Expected a value <= 128, but got 129 instead.", code `integer_above_max_value`): clients
    match on the code."""
    kind, value, ctx = error.get("type"), error.get("input"), error.get("ctx") or {}
    if param is None:
        return None
    if kind in _BOUNDS and isinstance(value, int | float) and not isinstance(value, bool):
        bound = next(iter(ctx.values()), "?")
        number = "decimal" if isinstance(bound, float) else "integer"  # the field's type, as OpenAI says it
        bound = int(bound) if isinstance(bound, float) and bound.is_integer() else bound
        low = kind.startswith("greater")
        return (f"Invalid '{param}': {number} {'below minimum' if low else 'above maximum'} value. Expected a value "
                f"{_BOUNDS[kind]} {bound}, but got {value} instead.",
                f"{number}_{'below_min' if low else 'above_max'}_value")  # fmt: skip
    if kind in ("too_long", "too_short") and isinstance(value, list):
        limit = ctx.get("max_length" if kind == "too_long" else "min_length")
        if kind == "too_short" and not value:
            return (f"Invalid '{param}': empty array. Expected an array with minimum length {limit}, but got an empty "
                    "array instead.", "empty_array")  # fmt: skip
        side = "maximum" if kind == "too_long" else "minimum"
        return (f"Invalid '{param}': array too {'long' if kind == 'too_long' else 'short'}. Expected an array with "
                f"{side} length {limit}, but got an array with length {len(value)} instead.",
                f"array_{'above_max' if kind == 'too_long' else 'below_min'}_length")  # fmt: skip
    return None


def validation_message(errors: list[dict]) -> tuple[str, str | None, str | None]:
    """(message, param, code) of a request that failed validation."""
    message, param = _validation_message(errors)
    from gyre_inference.strict import ParamError

    if isinstance(broken := (errors[0].get("ctx") or {}).get("error"), ParamError) and broken.code:
        return message, param, broken.code
    # one field's one complaint that is not a wrong type (a union's other members complain of the type)
    values = [error for error in errors if not error.get("type", "").endswith("_type")]
    fields = {_field_path(tuple(error.get("loc", ()))) for error in errors}
    if len(values) == 1 and len(fields) == 1 and (openai := _out_of_range(values[0], param)) is not None:
        message, code = openai
        return message, param, code
    return message, param, None


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    # the body itself (behind a union's tag on /tokenize) is missing or no object
    if loc[:1] == ("body",) and _field_path(loc) is None and first.get("type") in (
        "missing", "model_attributes_type", "dict_type", "model_type"
    ):  # fmt: skip
        return "request body must be a JSON object", None
    param = _field_path(loc)
    from gyre_inference.protocol import UNSUPPORTED_FIELDS  # (protocol does not import this module)
    from gyre_inference.strict import ParamError

    if isinstance(broken := (first.get("ctx") or {}).get("error"), ParamError):  # a rule across fields
        param = ".".join(filter(None, (param, broken.param)))
        return _clean(first["msg"]), param

    if (tagged := _tag_message(first, param)) is not None:
        return tagged
    if first.get("type") == "extra_forbidden" and param in UNSUPPORTED_FIELDS:
        return f"{param}: not supported: {UNSUPPORTED_FIELDS[param]}", param
    if first.get("type") == "none_required" and param:  # a field accepted at its neutral value (null) only
        reason = UNSUPPORTED_FIELDS.get(param.rsplit(".", 1)[-1])
        return f"{param}: only null is supported" + (f": {reason}" if reason else ""), param
    union = _union_message(errors)
    if union is not None:
        return union
    message = f"{param}: {_clean(first['msg'])}" if param else _clean(first["msg"])
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return message, param


def _tag_message(error: dict, param: str | None) -> tuple[str, str] | None:
    """(message, param) naming the key a tagged union reads (a message's `role`) when it is missing or none of the
    tags: pydantic's "messages.0: Unable to extract tag using discriminator 'role'" named neither the field nor
    what it takes."""
    kind, ctx = error.get("type"), error.get("ctx") or {}
    key = str(ctx.get("discriminator", "")).strip("'")
    if kind not in ("union_tag_not_found", "union_tag_invalid") or not key.isidentifier():
        return None  # a callable discriminator (the /tokenize form) reads no single key
    param = f"{param}.{key}" if param else key
    if kind == "union_tag_not_found":
        return f"{param}: Field required", param
    given = error["input"].get(key) if isinstance(error.get("input"), dict) else ctx.get("tag")
    return f"{param}: Input should be one of {ctx.get('expected_tags')} (got {given!r})", param


def unknown_model(requested: str, served: str) -> APIError:
    # OpenAI answers 404 with type invalid_request_error (not not_found_error) and code model_not_found.
    return APIError(404, f"The model `{requested}` does not exist; this server serves `{served}`.",
                    param="model", code="model_not_found", type="invalid_request_error")  # fmt: skip


def backend_failure(error: BackendStoppedError | AdapterGoneError, model: str, served: str) -> APIError:
    """What a backend's failure to generate means for the client: the engine is not running (shutting down, or
    stopped) is a 503 to retry; a named adapter found gone only when generating is the same 404 as for a name
    never served."""
    if isinstance(error, BackendStoppedError):
        return APIError(503, "the inference engine is not running (shutting down); retry", code="not_ready")
    return unknown_model(model, served)


def _unparsed_body(cause: BaseException | None) -> str | None:
    """Why FastAPI could not read a body as JSON, for the failures its own message ("There was an error parsing the
    body") does not explain: bytes that are not UTF-8, nesting deeper than the parser's recursion limit, an integer
    of more digits than Python converts."""
    if isinstance(cause, UnicodeDecodeError):
        return f"it is not UTF-8 (byte 0x{cause.object[cause.start]:02x} at position {cause.start})"
    if isinstance(cause, RecursionError):
        return "it is nested too deeply"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return "an integer in it has more than 4300 digits"  # Python's int() limit (sys.get_int_max_str_digits)
    if isinstance(cause, ValueError):
        return str(cause)
    return None


def install_error_handlers(app: FastAPI, on_client_error: Callable[[Request, int], None] | None = None) -> None:
    """Answer every error with OpenAI's JSON; `on_client_error(request, status)` is told about each 4xx/5xx."""

    def seen(request: Request, status: int) -> None:
        if on_client_error is not None:
            on_client_error(request, status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        seen(request, error.status)
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, error: RequestValidationError) -> JSONResponse:
        seen(request, 400)
        errors = list(error.errors())
        if any(isinstance(e.get("input"), bytes) for e in errors):
            # FastAPI reads a body as JSON only under a JSON Content-Type and hands the raw bytes on otherwise:
            # the body may be a perfectly good JSON object (curl -d sends form-urlencoded), so say what is wrong
            given = request.headers.get("content-type")
            message = ("request body must be sent with Content-Type: application/json (got "
                       f"{repr(given) if given else 'no Content-Type'})")  # fmt: skip
            return JSONResponse(error_body(400, message), status_code=400)
        message, param, code = validation_message(errors)
        return JSONResponse(error_body(400, message, param, code), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.method} {request.url.path}"}.get(error.status_code, str(error.detail))
        if error.status_code == 400 and (reason := _unparsed_body(error.__cause__)) is not None:
            message = f"request body is not valid JSON: {reason}"
        return JSONResponse(
            error_body(error.status_code, message, code=getattr(error, "code", None)),
            status_code=error.status_code,
            headers=error.headers,
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        # the message too, as vLLM and the stream's error event do: the client's log (an orchestrator's
        # retries) is often the one a user reads first
        message = f"internal error: {type(error).__name__}: {str(error)[:500]}"
        return JSONResponse(error_body(500, message), status_code=500)
