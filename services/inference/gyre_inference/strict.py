"""`StrictModel`, the base of every request model of the HTTP API (protocol.py, chat_messages.py, responses.py,
tokens_in.py, classify.py).

Strict means: unknown fields are errors, numbers are finite (NaN and Infinity, which Python clients send for
float("nan"), are refused as such), and values are never coerced across JSON types
(`"logprobs": 0` is not a bool, `"n": "2"` is not an int, `"temperature": 1` is a fine float).
Every validation failure becomes a 400 with OpenAI's error JSON naming the field (see errors.py).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, model_validator


class ParamError(ValueError):
    """A rule across fields, broken (raised by a model validator): the 400 names `param` (pydantic places such an
    error at the request itself, which names no field)."""

    def __init__(self, param: str, message: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class StrictModel(BaseModel):
    """Unknown fields are errors, types are never coerced. Fields listed in `NULL_IS_DEFAULT` (those OpenAI's
    reference marks nullable whose null means "the default") may be sent as null."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)  # NaN is no temperature
    NULL_IS_DEFAULT: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if isinstance(data, dict) and cls.NULL_IS_DEFAULT:
            nulls = [key for key in cls.NULL_IS_DEFAULT if key in data and data[key] is None]
            if nulls:
                data = {key: value for key, value in data.items() if key not in nulls}
        return data
