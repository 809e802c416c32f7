"""The check of a JSON schema and its rewrite for the grammar compiler: `JsonSchema(root).check()`
walks the schema once, refuses what the grammar cannot enforce (the keyword and its place, a JSON
pointer, named) and builds the copy the compiler gets: a type where the keywords imply one,
numeric bounds clamped to int64 and given an implicit other side, a `format` or `pattern` as a
regex the compiler reads right (`regexes.grammar_regex`).
"""

from __future__ import annotations

import json
import math
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from typing import Any

from ferry.worker.protocol.structured.keywords import ANNOTATIONS, APPLIES_TO, ENFORCED, FORMATS, REFUSED
from ferry.worker.protocol.structured.limits import (
    MAX_COUNT,
    MAX_PROPERTIES,
    MAX_SCHEMA_NODES,
    SpecError,
    too_big,
)
from ferry.worker.protocol.structured.regexes import grammar_regex

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_DECIMALS = 6  # the decimals xgrammar writes a number with bounds to
_IMPLICIT_BOUND = 10**18 - 1  # a one-sided range's other side: 18 digits, as an unbounded integer's
_DIALECTS = ("https://json-schema.org/draft/2020-12/schema", "https://json-schema.org/draft/2020-12/schema#")
_TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")
_ALONE_WITH_ANNOTATIONS = ("anyOf", "$ref")


class JsonSchema:
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
            raise too_big(f"more than {MAX_SCHEMA_NODES} subschemas", MAX_SCHEMA_NODES)
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
        implied = sorted({APPLIES_TO[k] for k in given if k in APPLIES_TO})
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
            kind = APPLIES_TO.get(keyword)
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
            raise too_big(f"properties at {where}: {len(properties)} properties", MAX_PROPERTIES)
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
                    raise too_big(f"{key} at {where} is {value}", MAX_COUNT)
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
