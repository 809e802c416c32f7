"""Structured outputs on the wire, and the one check of a spec that both the API (before anything
is queued) and the engine (before it compiles) run.

`structured_outputs` is vLLM's field: exactly one of json, json_object, regex, choice, grammar.
`check_spec(kind, value)` checks one and returns what the engine's compiler (xgrammar) gets: for a
JSON schema, a copy rewritten so that the grammar enforces exactly what the schema says.

A JSON schema (Draft 2020-12) may only say what the grammar enforces. Every keyword is in one of
three sets, listed in docs/structured-outputs.md: `ENFORCED`, `ANNOTATIONS` (they constrain
nothing) and everything else, refused with the keyword and its place named (`allOf`, `not`,
`oneOf`, `if`, `multipleOf`, `uniqueItems`, ...; an unknown keyword too, since a misspelt one
would constrain nothing). Some enforced keywords hold only in company the compiler honours, so
they must come so: `enum`/`const` with nothing beside them but `type` (each value of that type);
`anyOf` and `$ref` with nothing beside them but annotations; `pattern` and `format` alone among the
string keywords; `required` naming only declared `properties`; `$ref` only to `#`, `#/$defs/...` or
`#/definitions/...`. Rewritten for the compiler: a schema without `type` gets the type its
keywords apply to (`{"minimum": 0}` is a number); bounds are clamped to int64's range (tighter,
never looser), an integer's fractional one rounded inward, and a range with one side gets the
other at 18 digits (int64's past it), as the grammar writes an integer without bounds in at most
18 digits, so every integer is an int64; `format` date, time, date-time and ipv4 become exact
patterns (the compiler's own allow Feb 31, second 60 and leading zeros); a `pattern` is written
anew from its parse, so that the compiler reads it right (`grammar_regex`).

Budget, so that no spec takes long to check or to compile (`schema_too_complex`): a spec of at
most `MAX_SPEC_CHARS` (a schema as compact JSON, a regex, a grammar, all choices together), at most
`MAX_SCHEMA_NODES` subschemas, `MAX_PROPERTIES` properties per object (the compiler's time grows
with the fourth power of an object's optional properties: 512 take 0.2 s, 2,000 take 56 s), counts
(`maxLength`, `maxItems`, ...) up to `MAX_COUNT`, and regexes (`pattern` too) that spell out at
most `MAX_REGEX_SIZE` characters once their repetitions are unrolled (`[a-z]{50000}` took minutes).
What only a compile can tell (a nested repetition, an EBNF grammar) the worker bounds in time
(worker.engine.structured.manager). No torch here: the API imports it.

- `spec`: `check_spec`, `chosen_kind`, the kinds; `request`: the pydantic model and its errors;
- `schema`: the walk over a JSON schema; `keywords`: the keyword sets it applies;
- `regexes`: a regex's check and rewrite; `limits`: the budget and the errors of a refused spec.
"""

from ferry.worker.protocol.structured.keywords import ANNOTATIONS, ENFORCED, FORMATS, REFUSED
from ferry.worker.protocol.structured.limits import (
    INVALID_STRUCTURED_OUTPUT,
    MAX_CHOICES,
    MAX_COUNT,
    MAX_PROPERTIES,
    MAX_REGEX_SIZE,
    MAX_SCHEMA_NODES,
    MAX_SPEC_CHARS,
    SCHEMA_TOO_COMPLEX,
    SpecError,
    SpecTooComplexError,
)
from ferry.worker.protocol.structured.regexes import check_regex, grammar_regex
from ferry.worker.protocol.structured.request import StructuredOutputsRequest, check_json_schema, pydantic_error
from ferry.worker.protocol.structured.schema import INT64_MAX, INT64_MIN
from ferry.worker.protocol.structured.spec import KINDS, check_spec, chosen_kind

__all__ = [
    "ANNOTATIONS",
    "ENFORCED",
    "FORMATS",
    "INT64_MAX",
    "INT64_MIN",
    "INVALID_STRUCTURED_OUTPUT",
    "KINDS",
    "MAX_CHOICES",
    "MAX_COUNT",
    "MAX_PROPERTIES",
    "MAX_REGEX_SIZE",
    "MAX_SCHEMA_NODES",
    "MAX_SPEC_CHARS",
    "REFUSED",
    "SCHEMA_TOO_COMPLEX",
    "SpecError",
    "SpecTooComplexError",
    "StructuredOutputsRequest",
    "check_json_schema",
    "check_regex",
    "check_spec",
    "chosen_kind",
    "grammar_regex",
    "pydantic_error",
]
