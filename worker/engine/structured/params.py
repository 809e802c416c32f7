"""What a request asks its output to match: one JSON schema, any JSON object, a regex, one of
some strings, or an EBNF grammar (vLLM's `structured_outputs` names).

A spec is checked when it is made, by the wire's own check (`worker.protocol.structured`), the
one the API runs before it queues a job: what the engine refuses is what the API refuses."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ferry.worker.engine.errors import InvalidStructuredOutputError
from ferry.worker.protocol.structured import KINDS, SpecError, SpecTooComplexError, check_spec, chosen_kind


class SchemaTooComplexError(InvalidStructuredOutputError):
    """A spec beyond the compile budget: refused before compiling (its size), or its compile did
    not end in time; the wire's code for it is `schema_too_complex`."""


def refusal(exc: SpecError, prefix: str) -> InvalidStructuredOutputError:
    """The engine's exception for a spec the wire's check refused."""
    cls = SchemaTooComplexError if isinstance(exc, SpecTooComplexError) else InvalidStructuredOutputError
    return cls(f"{prefix}{exc}")


@dataclass(slots=True)
class StructuredOutputs:
    """Exactly one of the fields is set."""

    json: dict[str, Any] | str | None = None  # a JSON schema (a dict, or its JSON text)
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None  # the whole output matches this regular expression
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # an EBNF grammar (xgrammar's dialect, GBNF-like) whose root rule is `root`

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as exc:
                raise InvalidStructuredOutputError(f"structured_outputs.json is not valid JSON: {exc}") from exc
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        try:
            kind = chosen_kind({k: getattr(self, k) for k in KINDS})
        except SpecError as exc:
            raise refusal(exc, "structured_outputs: ") from None
        try:
            check_spec(kind, getattr(self, kind))
        except SpecError as exc:
            raise refusal(exc, f"structured_outputs.{kind}: ") from None

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def key(self) -> str:
        """The spec as canonical text: equal specs, equal keys (the compile cache's)."""
        return json.dumps({self.kind: getattr(self, self.kind)}, sort_keys=True, separators=(",", ":"))
