"""The request fields that constrain a completion's output (structured outputs): OpenAI's `response_format`
(JSON mode, a JSON schema), vLLM's `structured_outputs` (json, regex, choice, grammar, json_object), and the value
types of vLLM's older `guided_*` fields. Each gives a `Guide` (structured.py), which the grammar engine compiles;
these models only parse and check what the client sent. Chat and text completions take them (protocol.py), and
so does the Responses API's `text.format` (responses.py).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from gyre_inference.strict import StrictModel
from gyre_inference.structured import Guide


def _json_text(value):
    """vLLM takes a JSON schema as an object or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise ValueError(f"not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError("a JSON schema must be a JSON object")
    return value


SchemaObject = Annotated[dict[str, Any], BeforeValidator(_json_text)]
Choices = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1024)]


FORMAT_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a json_schema format's name


class JSONSchemaFormat(StrictModel):
    name: str = Field(pattern=FORMAT_NAME, description="Name of the format (OpenAI's rules).")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="The JSON schema (none: any JSON).")
    strict: bool | None = Field(None, description="Accepted either way: the output always follows the schema.")


class ResponseFormat(StrictModel):
    """OpenAI's response_format: text, JSON mode (any JSON object) or a JSON schema (structured outputs)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only allowed with it")
        return self

    def guide(self) -> Guide | None:
        if self.type == "json_object":
            return Guide("json_object", param="response_format")
        if self.type == "json_schema":
            schema = self.json_schema.schema_
            return Guide("json", schema, "response_format") if schema else Guide("json_object", param="response_format")
        return None


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs` (its StructuredOutputsParams): exactly one constraint."""

    json_: SchemaObject | None = Field(None, alias="json", description="A JSON schema (object or JSON text).")
    regex: str | None = Field(None, min_length=1)
    choice: Choices | None = None
    grammar: str | None = Field(None, min_length=1, description="A Lark (llguidance dialect) or GBNF grammar.")
    json_object: bool | None = None
    disable_any_whitespace: bool | None = Field(None, description="Accepted; JSON whitespace is always fixed.")
    disable_fallback: bool | None = Field(None, description="Accepted; there is one grammar engine.")
    disable_additional_properties: bool | None = Field(None, description="Only false: schemas say it themselves.")
    whitespace_pattern: None = Field(None, description="Only null: JSON whitespace is fixed.")
    structural_tag: None = Field(None, description="Only null: structural tags are not supported.")

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object") if self._value(name)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, regex, choice, grammar, json_object (got {given or 'none'})")
        if self.disable_additional_properties:
            raise ValueError("disable_additional_properties: only false is supported (set additionalProperties in "
                             "the schema)")  # fmt: skip
        return self

    def _value(self, name: str):
        return getattr(self, "json_" if name == "json" else name)

    def guide(self) -> Guide:
        param = "structured_outputs"
        if self.json_ is not None:
            return Guide("json", self.json_, param)
        if self.regex is not None:
            return Guide("regex", self.regex, param)
        if self.choice is not None:
            return Guide("choice", tuple(self.choice), param)
        if self.grammar is not None:
            return Guide("grammar", self.grammar, param)
        return Guide("json_object", param=param)
