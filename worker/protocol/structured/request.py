"""The `structured_outputs` field on the wire as a pydantic model, `StructuredOutputsRequest`, and
the glue its validators (and the API's other models) use: a refused spec becomes a pydantic error
whose type is the wire's code, so that the API's 422 carries it.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ferry.worker.protocol.structured.limits import MAX_SPEC_CHARS, SpecError, too_big
from ferry.worker.protocol.structured.spec import check_spec, chosen_kind


def pydantic_error(exc: SpecError) -> PydanticCustomError:
    """`exc` as a pydantic error whose type is the wire's code (the API's 422 carries it)."""
    return PydanticCustomError(exc.code, "{reason}", {"reason": str(exc)})


def check_json_schema(value: dict[str, Any] | str) -> dict[str, Any]:
    """For pydantic validators: the schema (parsed if given as JSON text) if Ferry can enforce it;
    a PydanticCustomError with the wire's code saying why not."""
    try:
        if isinstance(value, str):
            if len(value) > MAX_SPEC_CHARS:
                raise too_big(f"a schema of {len(value)} characters", MAX_SPEC_CHARS)
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise SpecError(f"not valid JSON: {exc}") from None
        check_spec("json", value)
    except SpecError as exc:
        raise pydantic_error(exc) from None
    return value


class StructuredOutputsRequest(BaseModel):
    """Exactly one field set. `json` is a JSON schema (an object, or its JSON text)."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json", description="a JSON schema")
    json_object: bool | None = Field(default=None, description="any JSON object")
    regex: str | None = Field(default=None, description="the whole output matches it")
    choice: list[str] | None = Field(default=None, description="the output is exactly one of these")
    grammar: str | None = Field(default=None, description="an EBNF grammar with a `root` rule")

    @field_validator("json_schema")
    @classmethod
    def _schema(cls, value: dict[str, Any] | str | None) -> dict[str, Any] | None:
        return None if value is None else check_json_schema(value)

    @field_validator("regex", "choice", "grammar")
    @classmethod
    def _spec(cls, value: Any, info) -> Any:
        if value is not None:
            try:
                check_spec(info.field_name, value)
            except SpecError as exc:
                raise pydantic_error(exc) from None
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsRequest:
        try:
            chosen_kind(self.engine_kwargs())
        except SpecError as exc:
            raise pydantic_error(exc) from None
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
