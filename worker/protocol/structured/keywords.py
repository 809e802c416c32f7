"""The JSON schema keywords Ferry knows, each in one of three sets: `ENFORCED` (the grammar holds
them), `ANNOTATIONS` (they constrain nothing) and `REFUSED` (the grammar cannot enforce them; with
what to write instead where there is something); any other keyword is refused as unknown.
`FORMATS` are the `format` values the grammar enforces. docs/structured-outputs.md lists the same
sets; the walk that applies them is `schema`.
"""

from __future__ import annotations

# Keywords that apply to one kind of value, and that kind (a number's apply to integers too).
APPLIES_TO = {
    "properties": "object", "required": "object", "additionalProperties": "object",
    "items": "array", "prefixItems": "array", "minItems": "array", "maxItems": "array",
    "minLength": "string", "maxLength": "string", "pattern": "string", "format": "string",
    "minimum": "number", "maximum": "number", "exclusiveMinimum": "number", "exclusiveMaximum": "number",
}
ENFORCED = ("type", "enum", "const", "anyOf", "$ref", "$defs", "definitions", *APPLIES_TO)
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
