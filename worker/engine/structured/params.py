"""What a request asks its output to match: one JSON schema, any JSON object, a regex, one of
some strings, or an EBNF grammar (vLLM's `structured_outputs` names)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ferry.worker.engine.errors import InvalidStructuredOutputError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


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
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidStructuredOutputError(
                f"structured_outputs needs exactly one of {', '.join(KINDS)}; got {', '.join(given) or 'none'}"
            )
        problem = self._problem()
        if problem is not None:
            raise InvalidStructuredOutputError(f"structured_outputs.{self.kind}: {problem}")

    def _problem(self) -> str | None:
        if self.json is not None and not isinstance(self.json, dict):
            return "a JSON schema must be an object"
        if self.json_object is not False and self.json_object is not True:
            return "must be true or false"
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                return "must be a non-empty string"
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice:
                return "must be a non-empty list of strings"
            if not all(isinstance(c, str) and c for c in self.choice):
                return "every choice must be a non-empty string"
        return None

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def key(self) -> str:
        """The spec as canonical text: equal specs, equal keys (the compile cache's)."""
        return json.dumps({self.kind: getattr(self, self.kind)}, sort_keys=True, separators=(",", ":"))
