"""The one check of a spec, by kind, that the API (before anything is queued) and the engine
(before it compiles) both run: `check_spec(kind, value)` returns what the grammar compiler gets,
and `chosen_kind` finds the one kind a structured_outputs sets.
"""

from __future__ import annotations

import json
from typing import Any

from ferry.worker.protocol.structured.limits import MAX_CHOICES, MAX_SPEC_CHARS, SpecError, too_big
from ferry.worker.protocol.structured.regexes import grammar_regex
from ferry.worker.protocol.structured.schema import JsonSchema

KINDS = ("json", "json_object", "regex", "choice", "grammar")


def chosen_kind(values: dict[str, Any]) -> str:
    """The one kind set in `values` (kind -> value; None or False: not set); SpecError otherwise."""
    given = [kind for kind in KINDS if values.get(kind) not in (None, False)]
    if len(given) != 1:
        raise SpecError(f"give exactly one of {', '.join(KINDS)}; got {', '.join(given) or 'none'}")
    return given[0]


def check_spec(kind: str, value: Any) -> Any:
    """What the grammar compiler gets for this spec (a JSON schema rewritten for it, any other
    kind as given); SpecError (SpecTooComplexError beyond the budget) saying why it is refused."""
    if kind == "json":
        if isinstance(value, dict | list):
            size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False))
            if size > MAX_SPEC_CHARS:
                raise too_big(f"a schema of {size} characters as compact JSON", MAX_SPEC_CHARS)
        return JsonSchema(value).check()
    if kind == "json_object":
        if value is not True:
            raise SpecError("must be true")
        return True
    if kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise SpecError("must be a non-empty string")
        if kind == "regex":
            return grammar_regex(value, "the regex", json_string=False)
        if len(value) > MAX_SPEC_CHARS:
            raise too_big(f"a grammar of {len(value)} characters", MAX_SPEC_CHARS)
        return value
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise SpecError("must be a non-empty list of non-empty strings")
        if len(value) > MAX_CHOICES:
            raise too_big(f"{len(value)} choices", MAX_CHOICES)
        total = sum(map(len, value))
        if total > MAX_SPEC_CHARS:
            raise too_big(f"choices of {total} characters together", MAX_SPEC_CHARS)
        return value
    raise SpecError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
