"""JSON encoding of response bodies and stream events with orjson.

A non-streaming chat completion of 128 tokens with log-probs (what the orchestrator asks for) is a body of ~10 KB:
json.dumps took 142 µs to encode it, orjson 8 µs, on the event loop that every token of the replica also
passes through (docs/benchmarks.md, "Serving cost"). Output differs from json.dumps only in spacing (none) and
in NaN, written null (json.dumps with allow_nan=False, Starlette's default, raised instead); a sampled token's
log-prob is never NaN.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import JSONResponse


def _plain(value: Any) -> Any:
    """What orjson does not encode by itself: numpy scalars (their Python value)."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def dumps(payload: Any) -> str:
    """`payload` as compact JSON text (UTF-8 characters as they are, like json.dumps(ensure_ascii=False))."""
    return orjson.dumps(payload, default=_plain).decode()


class FastJSONResponse(JSONResponse):
    """Starlette's JSONResponse, encoded by orjson."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, default=_plain)
