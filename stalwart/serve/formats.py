"""The request fields that ask for a structured output, read into one ``infer.structured.Constraint``.

Two ways to ask, on both completions and chat completions (at most one per request):
- OpenAI's ``response_format``: ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``,
  ``{"type": "json_object"}`` (any JSON object), or ``{"type": "text"}`` (no constraint, the default);
- vLLM's ``structured_outputs`` (its current name for the older ``guided_*`` fields), exactly one of
  ``{"json": SCHEMA}`` (an object, or its JSON text), ``{"regex": "..."}``, ``{"grammar": "..."}`` (Lark,
  or GBNF as llama.cpp writes it), ``{"choice": ["...", ...]}`` or ``{"json_object": true}``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from stalwart.infer.sampling import SamplingError
from stalwart.infer.structured import Constraint

STRICT = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class JsonSchemaFormat(BaseModel):
    model_config = STRICT

    name: str | None = None
    description: str | None = None
    # ``schema`` is the field's JSON name (pydantic's BaseModel has a method of that name)
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(BaseModel):
    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    model_config = STRICT

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None


def constraint_of(response_format: ResponseFormat | None,
                  structured_outputs: StructuredOutputs | None) -> Constraint | None:
    """The request's constraint (None: free text); a request naming two, or none in a structured_outputs
    it sends, is a SamplingError naming the field."""
    wanted = []
    if response_format is not None and response_format.type != "text":
        wanted.append(_from_response_format(response_format))
    if structured_outputs is not None:
        wanted.append(_from_structured_outputs(structured_outputs))
    if len(wanted) > 1:
        raise SamplingError("response_format and structured_outputs each ask for a structured output; send one",
                            "structured_outputs")
    return wanted[0] if wanted else None


def _from_response_format(f: ResponseFormat) -> Constraint:
    if f.type == "json_object":
        return Constraint.json_object("response_format")
    if f.json_schema is None:
        raise SamplingError("response_format: type json_schema needs a json_schema with its schema",
                            "response_format.json_schema")
    return Constraint.json_schema(f.json_schema.json_schema, "response_format.json_schema.schema")


def _from_structured_outputs(s: StructuredOutputs) -> Constraint:
    given = {k: v for k, v in (("json", s.json_), ("regex", s.regex), ("grammar", s.grammar),
                               ("choice", s.choice), ("json_object", s.json_object or None)) if v is not None}
    if len(given) != 1:
        raise SamplingError("structured_outputs must name exactly one of json, regex, grammar, choice, json_object "
                            f"(got {', '.join(given) or 'none'})", "structured_outputs")
    (key, value), = given.items()
    param = f"structured_outputs.{key}"
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise SamplingError(f"{param}: not JSON ({e})", param) from None
        if not isinstance(value, dict):
            raise SamplingError(f"{param}: a JSON schema is an object", param)
        return Constraint.json_schema(value, param)
    if key == "json_object":
        return Constraint.json_object(param)
    if key == "choice":
        if not value or any(not c for c in value):
            raise SamplingError(f"{param}: give at least one non-empty choice", param)
        return Constraint("choice", json.dumps(value), param)
    if not value:
        raise SamplingError(f"{param}: must not be empty", param)
    return Constraint(key, value, param)
