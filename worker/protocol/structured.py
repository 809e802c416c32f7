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
"""

from __future__ import annotations

import json
import math
import re
import re._constants as sre
import re._parser as sre_parse
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_CHOICES = 256
MAX_SPEC_CHARS = 64 << 10
MAX_SCHEMA_NODES = 2048
MAX_PROPERTIES = 256
MAX_COUNT = 100_000
MAX_REGEX_SIZE = 1000
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_DECIMALS = 6  # the decimals xgrammar writes a number with bounds to
_IMPLICIT_BOUND = 10**18 - 1  # a one-sided range's other side: 18 digits, as an unbounded integer's

# The wire's error codes for a refused spec (worker.protocol.jobs.ErrorCode, which imports this module).
INVALID_STRUCTURED_OUTPUT = "invalid_structured_output"
SCHEMA_TOO_COMPLEX = "schema_too_complex"


class SpecError(ValueError):
    """Why a structured_outputs spec is refused; `code` is the wire's error code for it."""

    code = INVALID_STRUCTURED_OUTPUT


class SpecTooComplexError(SpecError):
    """A spec beyond the budget: too big to check or to compile in reasonable time."""

    code = SCHEMA_TOO_COMPLEX


# --- JSON schema keywords -------------------------------------------------------------------------

# Keywords that apply to one kind of value, and that kind (a number's apply to integers too).
_APPLIES_TO = {
    "properties": "object", "required": "object", "additionalProperties": "object",
    "items": "array", "prefixItems": "array", "minItems": "array", "maxItems": "array",
    "minLength": "string", "maxLength": "string", "pattern": "string", "format": "string",
    "minimum": "number", "maximum": "number", "exclusiveMinimum": "number", "exclusiveMaximum": "number",
}
ENFORCED = ("type", "enum", "const", "anyOf", "$ref", "$defs", "definitions", *_APPLIES_TO)
ANNOTATIONS = (
    "title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly", "$comment", "$schema",
)
# Keywords the grammar cannot enforce, and what to write instead where there is something.
REFUSED = {
    "allOf": "merge the subschemas into one",
    "oneOf": "use anyOf",
    "not": "",
    "if": "", "then": "", "else": "",
    "dependentRequired": "", "dependentSchemas": "", "dependencies": "",
    "multipleOf": "list the values with enum, or bound the number",
    "uniqueItems": "",
    "contains": "use prefixItems", "minContains": "", "maxContains": "",
    "patternProperties": "declare the properties", "propertyNames": "declare the properties",
    "minProperties": "use required", "maxProperties": "declare the properties",
    "unevaluatedProperties": "use additionalProperties", "unevaluatedItems": "use items",
    "additionalItems": "use items",
    "$id": "", "$anchor": "", "$dynamicRef": "", "$dynamicAnchor": "", "$vocabulary": "",
    "$recursiveRef": "", "$recursiveAnchor": "",
    "contentEncoding": "", "contentMediaType": "", "contentSchema": "",
}
_DIALECTS = ("https://json-schema.org/draft/2020-12/schema", "https://json-schema.org/draft/2020-12/schema#")
_TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")
_ALONE_WITH_ANNOTATIONS = ("anyOf", "$ref")
_TWO_DIGITS = "[0-9]{2}"
_DATE = (
    "(000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})-((0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])"
    "|(0[13-9]|1[0-2])-(29|30)|(0[13578]|1[02])-31)"
    f"|({_TWO_DIGITS}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)-02-29"
)
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,9})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
# `format` values the grammar enforces: the pattern compiled for it, or None where the
# compiler's own grammar for the format is exact.
FORMATS = {
    "date": f"^({_DATE})$",
    "time": f"^{_TIME}$",
    "date-time": f"^({_DATE})T{_TIME}$",
    "ipv4": f"^{_OCTET}(\\.{_OCTET}){{3}}$",
    "ipv6": None,
    "uuid": None,
    "email": None,
}


def _too_big(what: str, limit: int) -> SpecTooComplexError:
    return SpecTooComplexError(f"{what} (at most {limit}): the grammar would take too long to compile")


class _Schema:
    """One walk over a JSON schema: refuses what the grammar cannot enforce, naming the keyword
    and its place (a JSON pointer), and builds the schema the compiler gets."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.nodes = 0

    def check(self) -> dict[str, Any]:
        root = self.root
        if not isinstance(root, dict):
            raise SpecError("a JSON schema must be an object")
        if root.get("$schema", _DIALECTS[0]) not in _DIALECTS:
            raise SpecError(f"$schema {root['$schema']!r}: Ferry reads schemas as Draft 2020-12 ({_DIALECTS[0]})")
        out = self.schema(root, "#")
        for defs in ("$defs", "definitions"):
            if defs in root:
                if not isinstance(root[defs], dict):
                    raise SpecError(f"{defs} at #: must be an object of schemas")
                out[defs] = {name: self.schema(s, f"#/{defs}/{_escape(name)}") for name, s in root[defs].items()}
        return out

    def schema(self, node: Any, where: str) -> Any:
        self.nodes += 1
        if self.nodes > MAX_SCHEMA_NODES:
            raise _too_big(f"more than {MAX_SCHEMA_NODES} subschemas", MAX_SCHEMA_NODES)
        if node is True:
            return True
        if node is False:
            raise SpecError(f"the schema false at {where} allows no value (leave the property or item out)")
        if not isinstance(node, dict):
            raise SpecError(f"at {where}: a schema must be an object (or true)")
        for key in node:
            if key in ENFORCED or key in ANNOTATIONS:
                continue
            if key in REFUSED:
                hint = f"; {REFUSED[key]}" if REFUSED[key] else ""
                raise SpecError(f"{key!r} at {where} cannot be enforced by the grammar{hint}")
            raise SpecError(f"{key!r} at {where} is not a JSON Schema keyword Ferry knows")
        if where != "#":
            for key in ("$defs", "definitions", "$schema"):
                if key in node:
                    raise SpecError(f"{key!r} at {where}: only at the schema's root")
        given = [k for k in node if k in ENFORCED and k not in ("$defs", "definitions")]
        for keyword in _ALONE_WITH_ANNOTATIONS:
            if keyword in node and len(given) > 1:
                others = ", ".join(k for k in given if k != keyword)
                raise SpecError(f"{keyword!r} at {where} cannot be combined with {others} (the grammar would "
                                f"ignore them): move them into its subschemas")
        if "$ref" in node:
            return {"$ref": self.ref(node["$ref"], where)}
        if "anyOf" in node:
            options = node["anyOf"]
            if not isinstance(options, list) or not options:
                raise SpecError(f"anyOf at {where}: must be a non-empty list of schemas")
            return {"anyOf": [self.schema(s, f"{where}/anyOf/{i}") for i, s in enumerate(options)]}
        types = self.types(node, where, given)
        if "enum" in node or "const" in node:
            return self.values(node, where, given, types)
        out: dict[str, Any] = {} if types is None else {"type": types[0] if len(types) == 1 else types}
        if "object" in (types or ()):
            self.object(node, where, out)
        if "array" in (types or ()):
            self.array(node, where, out)
        if "string" in (types or ()):
            self.string(node, where, out)
        if {"number", "integer"} & set(types or ()):
            self.numbers(node, where, out, types)
        return out

    def types(self, node: dict, where: str, given: list[str]) -> list[str] | None:
        """The schema's types (None: any value); without `type`, the kinds its keywords apply to."""
        implied = sorted({_APPLIES_TO[k] for k in given if k in _APPLIES_TO})
        if "type" not in node:
            return implied or None
        declared = node["type"]
        names = [declared] if isinstance(declared, str) else declared
        if not isinstance(names, list) or not names or len(set(map(str, names))) != len(names) or not all(
            isinstance(t, str) and t in _TYPES for t in names
        ):
            raise SpecError(f"type at {where}: one of {', '.join(_TYPES)}, or a non-empty list of them")
        if "number" in names and "integer" in names:  # a number already is
            names = [t for t in names if t != "integer"]
        for keyword in given:
            kind = _APPLIES_TO.get(keyword)
            if kind is not None and kind not in names and not (kind == "number" and "integer" in names):
                raise SpecError(f"{keyword!r} at {where} applies to {kind}s, but type is {declared!r}")
        return names

    def values(self, node: dict, where: str, given: list[str], types: list[str] | None) -> dict[str, Any]:
        keyword = "enum" if "enum" in node else "const"
        extra = [k for k in given if k not in (keyword, "type")]
        if extra:
            raise SpecError(f"{keyword!r} at {where} cannot be combined with {', '.join(extra)} (the grammar would "
                            f"ignore them): list only the values wanted")
        values = node["enum"] if keyword == "enum" else [node["const"]]
        if not isinstance(values, list) or not values:
            raise SpecError(f"enum at {where}: must be a non-empty list")
        for value in values:
            problem = _json_value_problem(value)
            if problem is None and types is not None and not any(_is_type(value, t) for t in types):
                problem = f"is not of type {node['type']!r}"
            if problem is not None:
                raise SpecError(f"{keyword} at {where}: the value {_short(value)} {problem}")
        return {keyword: node[keyword]}

    def object(self, node: dict, where: str, out: dict) -> None:
        properties = node.get("properties", {})
        if not isinstance(properties, dict):
            raise SpecError(f"properties at {where}: must be an object of schemas")
        if len(properties) > MAX_PROPERTIES:
            raise _too_big(f"properties at {where}: {len(properties)} properties", MAX_PROPERTIES)
        if "properties" in node:  # even empty: then the compiler allows no property (beyond additionalProperties)
            out["properties"] = {
                name: self.schema(s, f"{where}/properties/{_escape(name)}") for name, s in properties.items()
            }
        required = node.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required) or len(
            set(required)
        ) != len(required):
            raise SpecError(f"required at {where}: must be a list of distinct property names")
        missing = [r for r in required if r not in properties]
        if missing:
            raise SpecError(f"required at {where} names {missing[0]!r}, which properties does not declare "
                            f"(the grammar can only require a declared property)")
        if required:
            out["required"] = required
        if "additionalProperties" in node:
            extra = node["additionalProperties"]
            if isinstance(extra, bool):
                out["additionalProperties"] = extra
            else:
                out["additionalProperties"] = self.schema(extra, f"{where}/additionalProperties")

    def array(self, node: dict, where: str, out: dict) -> None:
        prefix = node.get("prefixItems")
        if prefix is not None:
            if not isinstance(prefix, list) or not prefix:
                raise SpecError(f"prefixItems at {where}: must be a non-empty list of schemas")
            out["prefixItems"] = [self.schema(s, f"{where}/prefixItems/{i}") for i, s in enumerate(prefix)]
        if "items" in node:
            items = node["items"]
            out["items"] = items if items is False else self.schema(items, f"{where}/items")
        low, high = self.counts(node, where, "minItems", "maxItems", out)
        closed = prefix is not None and node.get("items", False) is False  # the compiler adds no items then
        if closed and low > len(prefix):
            raise SpecError(f"minItems at {where} is {low}, but prefixItems allows {len(prefix)} items and items "
                            f"none beyond them")
        if node.get("items") is False and prefix is None and low:
            raise SpecError(f"minItems at {where} is {low}, but items is false: no item is allowed")

    def string(self, node: dict, where: str, out: dict) -> None:
        self.counts(node, where, "minLength", "maxLength", out)
        shaped = [k for k in ("pattern", "format") if k in node]
        sized = [k for k in ("minLength", "maxLength") if k in node]
        if shaped and (sized or len(shaped) == 2):
            raise SpecError(f"{shaped[0]!r} at {where} cannot be combined with {', '.join((shaped + sized)[1:])} "
                            f"(the grammar would ignore them): put the length into a pattern")
        if "pattern" in node:
            pattern = node["pattern"]
            if not isinstance(pattern, str):
                raise SpecError(f"pattern at {where}: must be a string")
            out["pattern"] = grammar_regex(pattern, f"pattern at {where}")
        if "format" in node:
            fmt = node["format"]
            if fmt not in FORMATS:
                raise SpecError(f"format {fmt!r} at {where} cannot be enforced by the grammar; it enforces "
                                f"{', '.join(FORMATS)} (or write a pattern)")
            if FORMATS[fmt] is None:
                out["format"] = fmt
            else:
                out["pattern"] = grammar_regex(FORMATS[fmt], f"format {fmt}")

    def counts(self, node: dict, where: str, low_key: str, high_key: str, out: dict) -> tuple[int, int | None]:
        bounds = []
        for key in (low_key, high_key):
            value = node.get(key)
            if value is not None:
                whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
                if isinstance(value, bool) or not whole or value < 0:
                    raise SpecError(f"{key} at {where}: must be a non-negative integer")
                if value > MAX_COUNT:
                    raise _too_big(f"{key} at {where} is {value}", MAX_COUNT)
                out[key] = int(value)
            bounds.append(None if value is None else int(value))
        low, high = bounds[0] or 0, bounds[1]
        if high is not None and low > high:
            raise SpecError(f"{low_key} at {where} ({low}) is above {high_key} ({high})")
        return low, high

    def numbers(self, node: dict, where: str, out: dict, types: list[str]) -> None:
        bounds = {}
        for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
            if key in node:
                value = node[key]
                if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                    raise SpecError(f"{key} at {where}: must be a finite number")
                lower = key in ("minimum", "exclusiveMinimum")
                if (value > INT64_MAX) if lower else (value < INT64_MIN):
                    raise SpecError(f"{key} at {where} is {value}: the grammar writes numbers within int64's range")
                bounds[key] = min(max(value, INT64_MIN), INT64_MAX)  # tighter, never looser
        if not bounds:
            return  # the grammar's own rules: at most 18 digits for an integer, a bounded number otherwise
        if "integer" in types:
            low = max([INT64_MIN]
                      + ([math.ceil(bounds["minimum"])] if "minimum" in bounds else [])
                      + ([math.floor(bounds["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in bounds else []))
            high = min([INT64_MAX]
                       + ([math.floor(bounds["maximum"])] if "maximum" in bounds else [])
                       + ([math.ceil(bounds["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in bounds else []))
            if "minimum" not in bounds and "exclusiveMinimum" not in bounds:
                low = -_IMPLICIT_BOUND if high >= -_IMPLICIT_BOUND else INT64_MIN
            if "maximum" not in bounds and "exclusiveMaximum" not in bounds:
                high = _IMPLICIT_BOUND if low <= _IMPLICIT_BOUND else INT64_MAX
            if low > high:
                raise SpecError(f"no integer at {where} lies within its bounds (and int64's)")
            out["minimum"], out["maximum"] = low, high
            return
        out.update(bounds)
        if "minimum" not in bounds and "exclusiveMinimum" not in bounds:
            out["minimum"] = -_IMPLICIT_BOUND if min(bounds.values()) >= -_IMPLICIT_BOUND else INT64_MIN
        if "maximum" not in bounds and "exclusiveMaximum" not in bounds:
            out["maximum"] = _IMPLICIT_BOUND if max(bounds.values()) <= _IMPLICIT_BOUND else INT64_MAX
        if not _decimal_within(out):
            raise SpecError(f"no number of at most {_DECIMALS} decimals at {where} lies within its bounds "
                            f"(and int64's): the grammar writes a bounded number so")

    def ref(self, ref: Any, where: str) -> str:
        parts = ref.split("/") if isinstance(ref, str) else []
        if ref != "#" and not (len(parts) == 3 and parts[0] == "#" and parts[1] in ("$defs", "definitions")):
            raise SpecError(f"$ref at {where} is {_short(ref)}: the grammar follows '#', '#/$defs/<name>' and "
                            f"'#/definitions/<name>' only")
        if ref != "#":
            defs = self.root.get(parts[1])
            if not isinstance(defs, dict) or _unescape(parts[2]) not in defs:
                raise SpecError(f"$ref at {where}: {ref!r} names no schema of this document")
        return ref


def _decimal_within(bounds: dict) -> bool:
    """Whether a number of at most `_DECIMALS` decimals satisfies the bounds (xgrammar writes a
    bounded number so; with none, its grammar would allow only an empty output)."""
    step = Decimal(1).scaleb(-_DECIMALS)
    low = high = None
    for key, rounding, edge in (("minimum", ROUND_CEILING, 0), ("exclusiveMinimum", ROUND_CEILING, 1),
                                ("maximum", ROUND_FLOOR, 0), ("exclusiveMaximum", ROUND_FLOOR, -1)):
        if key in bounds:
            exact = Decimal(repr(bounds[key]) if isinstance(bounds[key], float) else bounds[key])
            value = exact.quantize(step, rounding=rounding)
            value += edge * step if value == exact else 0
            if key.endswith("inimum"):
                low = value if low is None else max(low, value)
            else:
                high = value if high is None else min(high, value)
    return low <= high


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _unescape(part: str) -> str:
    return part.replace("~1", "/").replace("~0", "~")


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_type(value: Any, name: str) -> bool:
    if name == "integer":
        whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        return whole and not isinstance(value, bool)
    return {
        "null": value is None,
        "boolean": isinstance(value, bool),
        "number": isinstance(value, int | float) and not isinstance(value, bool),
        "string": isinstance(value, str),
        "array": isinstance(value, list),
        "object": isinstance(value, dict),
    }[name]


def _fits_double(value: int) -> bool:
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _json_value_problem(value: Any) -> str | None:
    """Why a value of enum or const cannot be written (a number that is no finite double), or None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return "is not a finite number"
        if isinstance(item, int) and not isinstance(item, bool) and not _fits_double(item):
            return "is beyond a double's range"
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return None


# --- regular expressions --------------------------------------------------------------------------

# Constructs of Python's regexes that the grammar compiler does not have.
_REGEX_REFUSED = {
    sre.ASSERT: "a lookaround", sre.ASSERT_NOT: "a lookaround", sre.GROUPREF: "a backreference",
    sre.GROUPREF_EXISTS: "a conditional group", sre.ATOMIC_GROUP: "an atomic group",
    sre.POSSESSIVE_REPEAT: "a possessive repeat",
}
_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT)
_ANCHORS = (sre.AT_BEGINNING, sre.AT_END, sre.AT_BEGINNING_STRING, sre.AT_END_STRING)  # the others: \\b, \\B


def grammar_regex(pattern: str, what: str, json_string: bool = True) -> str:
    """A regex as the compiler gets it (checked by `check_regex`): the same language or less of
    it, spelt so that xgrammar 0.2.9 reads it right. Its JSON-string regexes (a schema's
    `pattern`) lose the first item of a group under `?` when the group ends in a variable repeat
    (`^a(x[0-9]{1,3})?$` accepted "a1"; `^\\d+(\\.\\d{1,2})?$`, a price, accepted "1234"), where
    `{0,1}` reads right, and mishandle some classes (`_UTF8_SPANS`); its plain regexes let `.` and
    negated classes take surrogates, and `.` a newline. So the regex is written anew from its
    parse, `?` as `{0,1}` and every class as ranges. `json_string`: the text goes into a JSON
    string (a schema's `pattern`), not the whole output (`regex`)."""
    parsed = check_regex(pattern, what)
    try:
        return _RegexWriter(json_string).text(parsed)
    except SpecError as exc:
        raise SpecError(f"{what}: {exc}") from None


def check_regex(pattern: str, what: str) -> list:
    """The parsed regex; SpecError if `pattern` does not compile as a regex, uses what the grammar
    compiler does not have (lookarounds, backreferences, word boundaries, inline flags, named
    groups), or unrolls to more than `MAX_REGEX_SIZE` characters (SpecTooComplexError)."""
    if len(pattern) > MAX_SPEC_CHARS:
        raise _too_big(f"{what}: {len(pattern)} characters", MAX_SPEC_CHARS)
    try:
        parsed = sre_parse.parse(pattern)
    except re.error as exc:
        raise SpecError(f"{what} is not a valid regular expression: {exc}") from None
    if parsed.state.flags & ~(re.UNICODE | re.NOFLAG) or parsed.state.groupdict:
        raise SpecError(f"{what}: inline flags and named groups are not supported")
    size = _regex_size(parsed, what)
    if size > MAX_REGEX_SIZE:
        raise _too_big(f"{what} unrolls to {size} characters", MAX_REGEX_SIZE)
    return list(parsed)


def _regex_size(items, what: str) -> int:
    """How many characters the regex spells out at most once its repetitions are unrolled (an
    unbounded repeat counts its minimum, at least once)."""
    size = 0
    for op, arg in items:
        if op in _REGEX_REFUSED:
            raise SpecError(f"{what}: {_REGEX_REFUSED[op]} is not supported")
        if op in _REPEATS:
            low, high, sub = arg
            size += (max(low, 1) if high == sre.MAXREPEAT else high) * _regex_size(sub, what)
        elif op == sre.SUBPATTERN:
            if arg[1] or arg[2]:
                raise SpecError(f"{what}: inline flags are not supported")
            size += _regex_size(arg[3], what)
        elif op == sre.BRANCH:
            size += max(_regex_size(branch, what) for branch in arg[1])
        elif op == sre.AT:  # an anchor spells nothing
            if arg not in _ANCHORS:
                raise SpecError(f"{what}: a word boundary is not supported")
        else:
            size += 1
    return size


_PRINTABLE = ((0x20, 0x10FFFF),)  # what `.` and a negated class choose from in a JSON string
_ASCII_PRINTABLE = ((0x20, 0x7E),)
_DIGITS = ((0x30, 0x39),)
_WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_SPACE = ((0x09, 0x0D), (0x20, 0x20))
# Python's classes are Unicode's; the grammar's are ASCII's. A class stands for its ASCII part (a
# subset: the grammar is stricter, never looser), and a negated one for its complement within
# printable ASCII (the complement within Unicode would hold, say, the Arabic digits `[^\\d]` refuses).
_CATEGORY_RANGES = {
    sre.CATEGORY_DIGIT: _DIGITS, sre.CATEGORY_WORD: _WORD, sre.CATEGORY_SPACE: _SPACE,
    sre.CATEGORY_NOT_DIGIT: None, sre.CATEGORY_NOT_WORD: None, sre.CATEGORY_NOT_SPACE: None,
}
_NEGATED = {sre.CATEGORY_NOT_DIGIT: _DIGITS, sre.CATEGORY_NOT_WORD: _WORD, sre.CATEGORY_NOT_SPACE: _SPACE}
# xgrammar's JSON-string regexes take UTF-8 overlongs (E0 80 A7 for "'") for a class whose range
# crosses a UTF-8 length, and a negated class or `.` also takes them and the encodings of
# surrogates: bytes a byte-level model can write that decode to U+FFFD, not to what matched; and
# they write a class's '"', '\\' and control characters raw, which ends or breaks the JSON. So a
# class is written as positive ranges cut at those lengths, without the surrogates and without
# the characters JSON escapes.
_ESCAPED = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))  # control characters, '"' and '\\'
_UTF8_SPANS = ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF))
_ANCHOR_TEXT = {sre.AT_BEGINNING: "^", sre.AT_END: "$", sre.AT_BEGINNING_STRING: "\\A", sre.AT_END_STRING: "\\Z"}
_SPECIAL = frozenset(".^$*+?()[]{}|\\/")
_CLASS_SPECIAL = frozenset("[]\\^-")
_ATOMS = (sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN, sre.SUBPATTERN, sre.BRANCH)


class _RegexWriter:
    """Writes a parsed regex anew (`grammar_regex`)."""

    def __init__(self, json_string: bool) -> None:
        # What `.` and a negated class choose from, and what no class may yield: xgrammar writes a
        # JSON string's class characters raw, so no '"', '\\' or control character there.
        self.anything = _PRINTABLE if json_string else ((0, 0x10FFFF),)
        self.unwritable = _ESCAPED if json_string else ()

    def text(self, items) -> str:
        return "".join(self.item(op, arg) for op, arg in items)

    def item(self, op, arg) -> str:
        if op == sre.LITERAL:
            if _minus([(arg, arg)], self.unwritable) != [(arg, arg)]:
                raise SpecError("a quote, a backslash or a control character is not supported (JSON escapes them)")
            return _char(arg, _SPECIAL)
        if op == sre.NOT_LITERAL:
            return self.char_class(_minus(self.anything, [(arg, arg)]))
        if op == sre.ANY:
            return self.char_class(_minus(self.anything, [(0x0A, 0x0A)]))
        if op == sre.IN:
            return self.char_class(_class_ranges(arg, self.anything))
        if op == sre.AT:
            return _ANCHOR_TEXT[arg]
        if op == sre.BRANCH:
            return "(" + "|".join(self.text(branch) for branch in arg[1]) + ")"
        if op == sre.SUBPATTERN:
            sub = arg[3]
            return self.text(sub) if len(sub) == 1 and sub[0][0] == sre.BRANCH else "(" + self.text(sub) + ")"
        low, high, sub = arg  # a repeat (check_regex let no other construct through)
        atom = self.text(sub)
        if not (len(sub) == 1 and sub[0][0] in _ATOMS):
            atom = "(" + atom + ")"
        if high == sre.MAXREPEAT:
            return atom + ("*" if low == 0 else "+" if low == 1 else f"{{{low},}}")
        return atom + (f"{{{low}}}" if low == high else f"{{{low},{high}}}")

    def char_class(self, ranges) -> str:
        """A class of these code points: one per UTF-8 length, as alternatives (xgrammar merges
        the ranges of one class, and a merged range across lengths takes overlongs)."""
        ranges = _minus(ranges, self.unwritable)
        classes = []
        for span_low, span_high in _UTF8_SPANS:
            pieces = []
            for low, high in ranges:
                a, b = max(low, span_low), min(high, span_high)
                if a <= b:
                    pieces.append(_char(a, _CLASS_SPECIAL) + ("" if a == b else "-" + _char(b, _CLASS_SPECIAL)))
            if pieces:
                classes.append("[" + "".join(pieces) + "]")
        if not classes:
            raise SpecError("a class that allows no character")
        return classes[0] if len(classes) == 1 else "(" + "|".join(classes) + ")"


def _class_ranges(items, anything) -> list[tuple[int, int]]:
    """The code points a parsed class stands for, as sorted ranges (see `_CATEGORY_RANGES`); a
    negated one's are taken from `anything`."""
    negate = bool(items) and items[0][0] == sre.NEGATE
    ranges: list[tuple[int, int]] = []
    ascii_only = False
    for op, arg in items[negate:]:
        if op == sre.LITERAL:
            ranges.append((arg, arg))
        elif op == sre.RANGE:
            ranges.append(arg)
        elif arg in _NEGATED:  # \\D, \\W, \\S
            ranges += _minus(_ASCII_PRINTABLE, _NEGATED[arg])
            ascii_only = True
        else:
            ranges += _CATEGORY_RANGES[arg]
            ascii_only = True
    if not negate:
        return _minus(ranges, [])
    return _minus(_ASCII_PRINTABLE if ascii_only else anything, ranges)


def _minus(ranges, removed) -> list[tuple[int, int]]:
    """`ranges` without `removed` and without the surrogates, merged and sorted."""
    points: list[tuple[int, int]] = []
    for low, high in sorted(ranges):
        if points and low <= points[-1][1] + 1:
            points[-1] = (points[-1][0], max(points[-1][1], high))
        else:
            points.append((low, high))
    for cut_low, cut_high in [*removed, (0xD800, 0xDFFF)]:
        kept = []
        for low, high in points:
            if high < cut_low or low > cut_high:
                kept.append((low, high))
                continue
            if low < cut_low:
                kept.append((low, cut_low - 1))
            if high > cut_high:
                kept.append((cut_high + 1, high))
        points = kept
    return points


def _char(code: int, special: frozenset) -> str:
    """One character of a regex: escaped where special, a control character as \\xHH, any other
    as itself (xgrammar reads \\U00010000 as letters and digits)."""
    if code < 0x20 or code == 0x7F:
        return f"\\x{code:02x}"
    char = chr(code)
    return "\\" + char if char in special else char


# --- every kind ------------------------------------------------------------------------------------


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
                raise _too_big(f"a schema of {size} characters as compact JSON", MAX_SPEC_CHARS)
        return _Schema(value).check()
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
            raise _too_big(f"a grammar of {len(value)} characters", MAX_SPEC_CHARS)
        return value
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise SpecError("must be a non-empty list of non-empty strings")
        if len(value) > MAX_CHOICES:
            raise _too_big(f"{len(value)} choices", MAX_CHOICES)
        total = sum(map(len, value))
        if total > MAX_SPEC_CHARS:
            raise _too_big(f"choices of {total} characters together", MAX_SPEC_CHARS)
        return value
    raise SpecError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")


def pydantic_error(exc: SpecError) -> PydanticCustomError:
    """`exc` as a pydantic error whose type is the wire's code (the API's 422 carries it)."""
    return PydanticCustomError(exc.code, "{reason}", {"reason": str(exc)})


def check_json_schema(value: dict[str, Any] | str) -> dict[str, Any]:
    """For pydantic validators: the schema (parsed if given as JSON text) if Ferry can enforce it;
    a PydanticCustomError with the wire's code saying why not."""
    try:
        if isinstance(value, str):
            if len(value) > MAX_SPEC_CHARS:
                raise _too_big(f"a schema of {len(value)} characters", MAX_SPEC_CHARS)
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
