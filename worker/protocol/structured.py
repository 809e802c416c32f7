"""Structured outputs on the wire: the `structured_outputs` field of a job's input and of the
OpenAI-compatible routes (vLLM's names: exactly one of json, json_object, regex, choice, grammar).

Checked here, before anything is queued, with what needs no grammar compiler: a JSON schema
must be a valid Draft 2020-12 schema (`jsonschema`), a regex must compile (`re`). The worker's
compiler (xgrammar) has the last word; what it refuses fails the job with the code
`invalid_structured_output` and the compiler's message. No torch here: the API imports it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_CHOICES = 256
MAX_SPEC_CHARS = 64 << 10  # a regex, a grammar, one choice or a schema as JSON text


def check_json_schema(value: dict[str, Any] | str) -> dict[str, Any]:
    """The schema (parsed if given as JSON text) if it is a valid Draft 2020-12 JSON schema object;
    ValueError saying where it is not."""
    if isinstance(value, str):
        if len(value) > MAX_SPEC_CHARS:
            raise ValueError(f"a schema of at most {MAX_SPEC_CHARS} characters")
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError("a JSON schema must be an object")
    try:
        jsonschema.Draft202012Validator.check_schema(value)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise ValueError(f"not a valid JSON schema{f' at {where}' if where else ''}: {exc.message}") from None
    return value


class StructuredOutputsRequest(BaseModel):
    """Exactly one field set. `json` is a JSON schema (an object, or its JSON text)."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json", description="a JSON schema")
    json_object: bool | None = Field(default=None, description="any JSON object")
    regex: str | None = Field(default=None, max_length=MAX_SPEC_CHARS, description="the whole output matches it")
    choice: list[str] | None = Field(
        default=None, min_length=1, max_length=MAX_CHOICES, description="the output is exactly one of these"
    )
    grammar: str | None = Field(
        default=None, min_length=1, max_length=MAX_SPEC_CHARS, description="an EBNF grammar with a `root` rule"
    )

    @field_validator("json_schema")
    @classmethod
    def _schema(cls, value: dict[str, Any] | str | None) -> dict[str, Any] | None:
        return None if value is None else check_json_schema(value)

    @field_validator("regex")
    @classmethod
    def _regex(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value:
            raise ValueError("must not be empty")
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        return value

    @field_validator("choice")
    @classmethod
    def _choice(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not all(value):
            raise ValueError("every choice must be a non-empty string")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsRequest:
        given = [name for name, value in self.engine_kwargs().items() if value not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of json, json_object, regex, choice, grammar; "
                f"got {', '.join(given) if given else 'none'}"
            )
        return self

    def engine_kwargs(self) -> dict[str, Any]:
        """The engine's `StructuredOutputs` fields."""
        return {
            "json": self.json_schema,
            "json_object": bool(self.json_object),
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
        }
