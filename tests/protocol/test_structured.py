"""structured_outputs on the wire: checked without a compiler (the one check the API runs before
queueing and the engine runs before compiling), stored and read back as given."""

from __future__ import annotations

import random
import re
from pathlib import Path

import jsonschema
import pytest
from pydantic import ValidationError

from ferry.worker.engine import SamplingParams, StructuredOutputs
from ferry.worker.engine.structured import InvalidStructuredOutputError, SchemaTooComplexError
from ferry.worker.protocol import ErrorCode, JobRecord, JobRequest, StructuredOutputsRequest
from ferry.worker.protocol.structured import (
    ANNOTATIONS,
    ENFORCED,
    FORMATS,
    INVALID_STRUCTURED_OUTPUT,
    REFUSED,
    SCHEMA_TOO_COMPLEX,
    SpecError,
    SpecTooComplexError,
    check_spec,
    grammar_regex,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
INT64_MAX = 2**63 - 1
BIG = 10**18 - 1  # 18 digits


def test_a_job_with_a_schema_round_trips_through_its_record_and_reaches_the_engine():
    request = JobRequest(model="m", prompt="x", structured_outputs={"json": SCHEMA})
    stored = JobRecord.new("j1", request).to_redis()
    assert '"structured_outputs":{"json":' in stored["request"]
    back = JobRecord.from_redis(stored).request
    assert back.structured_outputs.json_schema == SCHEMA
    params = SamplingParams(**back.sampling_kwargs())
    assert params.structured_outputs == StructuredOutputs(json=SCHEMA)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"json": {"type": 7}}, "type at #: one of"),
        ({"json": "[1,"}, "not valid JSON"),
        ({"regex": "(unclosed"}, "not a valid regular expression"),
        ({"choice": ["a", ""]}, "non-empty"),
        ({"regex": "a", "grammar": "root ::= \"a\""}, "exactly one"),
        ({}, "exactly one"),
        ({"json_object": False}, "exactly one"),
        ({"tools": []}, "Extra inputs"),
    ],
)
def test_bad_specs_are_refused_before_queueing(spec, message):
    with pytest.raises(ValidationError, match=message):
        StructuredOutputsRequest(**spec)


def test_json_text_is_parsed_and_every_kind_maps_to_the_engine():
    assert StructuredOutputsRequest(json='{"type": "string"}').engine_kwargs()["json"] == {"type": "string"}
    for spec in ({"json_object": True}, {"regex": "[ab]+"}, {"choice": ["x"]}, {"grammar": 'root ::= "a"'}):
        StructuredOutputs(**StructuredOutputsRequest(**spec).engine_kwargs())


# --- keywords: enforced, annotations, refused ------------------------------------------------------

# Issue 35, fault 5: accepted, then not enforced (the output was a bare number).
UNENFORCED = [
    ({"type": "object", "allOf": [{"required": ["a"]}], "properties": {"a": {"type": "integer"}}}, "'allOf' at #"),
    ({"not": {"type": "number"}}, "'not' at #"),
    ({"allOf": [{"type": "object", "properties": {f"p{i}": {"type": "integer"}}} for i in range(500)]},
     "'allOf' at #"),
    ({"type": "object", "properties": {"a": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}},
     "'oneOf' at #/properties/a"),
]


@pytest.mark.parametrize(("schema", "named"), UNENFORCED, ids=["allOf-required", "not", "allOf-500", "oneOf"])
def test_a_keyword_the_grammar_does_not_enforce_is_refused_by_name_and_place(schema, named):
    with pytest.raises(SpecError, match=re.escape(named)) as info:
        check_spec("json", schema)
    assert info.value.code == INVALID_STRUCTURED_OUTPUT
    with pytest.raises(ValidationError) as wire:
        StructuredOutputsRequest(json=schema)
    assert wire.value.errors()[0]["type"] == ErrorCode.INVALID_STRUCTURED_OUTPUT  # the API's 422 carries it
    with pytest.raises(InvalidStructuredOutputError, match=re.escape(named)):
        StructuredOutputs(json=schema)  # the engine refuses it with the same words


# One value for each refused keyword, in a schema that is otherwise enforced.
REFUSED_VALUES = {
    "allOf": [{"type": "integer"}], "oneOf": [{"type": "integer"}], "not": {"type": "string"},
    "if": {"minimum": 1}, "then": {"maximum": 3}, "else": {"minimum": 0},
    "dependentRequired": {"a": ["b"]}, "dependentSchemas": {"a": {"required": ["b"]}}, "dependencies": {"a": ["b"]},
    "multipleOf": 3, "uniqueItems": True, "contains": {"type": "integer"}, "minContains": 1, "maxContains": 2,
    "patternProperties": {"^x": {"type": "integer"}}, "propertyNames": {"maxLength": 3},
    "minProperties": 1, "maxProperties": 2, "unevaluatedProperties": False, "unevaluatedItems": False,
    "additionalItems": False, "$id": "https://example.com/s", "$anchor": "a", "$dynamicRef": "#a",
    "$dynamicAnchor": "a", "$vocabulary": {}, "$recursiveRef": "#", "$recursiveAnchor": True,
    "contentEncoding": "base64", "contentMediaType": "application/json", "contentSchema": {"type": "object"},
}


@pytest.mark.parametrize("keyword", sorted(REFUSED))
def test_every_refused_keyword_is_named(keyword):
    schema = {"type": "object", "properties": {"x": {keyword: REFUSED_VALUES[keyword]}}}
    with pytest.raises(SpecError, match=re.escape(f"{keyword!r} at #/properties/x")):
        check_spec("json", schema)


def test_the_keyword_sets_are_disjoint_and_cover_draft_2020_12():
    enforced, annotations, refused = set(ENFORCED), set(ANNOTATIONS), set(REFUSED)
    assert not enforced & annotations and not enforced & refused and not annotations & refused
    assert set(REFUSED_VALUES) == refused
    # Every keyword jsonschema validates with is in one of the sets (annotation keywords it does not
    # validate are in ANNOTATIONS or REFUSED above).
    validated = set(jsonschema.Draft202012Validator.VALIDATORS) | {"$defs", "definitions", "$schema"}
    assert validated <= enforced | annotations | refused, validated - enforced - annotations - refused


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "string", "maxLenght": 3}, "'maxLenght' at # is not a JSON Schema keyword"),
        ({"type": "string", "enum": ["a", "bb"], "minLength": 2}, "'enum' at # cannot be combined with minLength"),
        ({"type": "string", "enum": ["a", 1]}, "the value 1 is not of type 'string'"),
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]},
         "'anyOf' at # cannot be combined with type, properties"),
        ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2}, "'$ref' at # cannot be combined"),
        ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "'pattern' at # cannot be combined with maxLength"),
        ({"type": "string", "format": "date", "pattern": "^2"}, "'pattern' at # cannot be combined with format"),
        ({"type": "string", "format": "hostname"}, "format 'hostname' at #"),
        ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required at # names 'b'"),
        ({"type": "object", "properties": {"a": False}}, "the schema false at #/properties/a"),
        ({"type": "string", "minimum": 3}, "'minimum' at # applies to numbers, but type is 'string'"),
        ({"type": "integer", "minimum": 5, "maximum": 4.5}, "no integer at # lies within its bounds"),
        ({"type": "number", "minimum": 0.1234561, "maximum": 0.1234569}, "no number of at most 6 decimals"),
        ({"type": "integer", "minimum": 1e19}, "minimum at # is 1e+19"),
        ({"type": "array", "minItems": 3, "maxItems": 2}, "minItems at # (3) is above maxItems (2)"),
        ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False, "minItems": 2},
         "prefixItems allows 1 items"),
        ({"$ref": "https://example.com/s.json"}, "the grammar follows '#'"),
        ({"$ref": "#/$defs/missing"}, "names no schema of this document"),
        ({"type": "object", "properties": {"a": {"$defs": {}, "type": "integer"}}}, "'$defs' at #/properties/a"),
        ({"$schema": "http://json-schema.org/draft-07/schema#"}, "Draft 2020-12"),
        ({"enum": [1e308 * 10]}, "is not a finite number"),
        ({"type": "string", "pattern": "(?<=a)b"}, "a lookaround is not supported"),
        ({"type": "string", "pattern": "(a)\\1"}, "a backreference is not supported"),
        ({"type": "string", "pattern": "\\bword"}, "a word boundary is not supported"),
        ({"type": "string", "pattern": "(?i)abc"}, "inline flags"),
        ({"type": "string", "pattern": "(?P<n>a)"}, "named groups"),
        ({"type": "string", "pattern": 'say "hi"'}, "a quote, a backslash or a control character"),
    ],
)
def test_what_the_grammar_would_ignore_or_misread_is_refused_with_its_place(schema, message):
    with pytest.raises(SpecError, match=re.escape(message)) as info:
        check_spec("json", schema)
    assert info.value.code == INVALID_STRUCTURED_OUTPUT


def test_a_schema_without_type_gets_the_type_its_keywords_apply_to():
    assert check_spec("json", {"minimum": 0})["type"] == "number"
    assert check_spec("json", {"properties": {"a": {}}})["type"] == "object"
    assert check_spec("json", {"maxLength": 3, "maxItems": 2})["type"] == ["array", "string"]
    assert "type" not in check_spec("json", {"description": "anything"})
    assert "type" not in check_spec("json", {"enum": [1, "a"]})


def test_bounds_stay_within_int64_and_a_one_sided_range_is_closed():
    # Unbounded numbers keep the grammar's own bounded rules (an integer: 18 digits at most).
    assert check_spec("json", {"type": "integer"}) == {"type": "integer"}
    assert check_spec("json", {"type": "number"}) == {"type": "number"}
    assert check_spec("json", {"type": "integer", "exclusiveMinimum": 1.5, "maximum": 9.9}) == {
        "type": "integer", "minimum": 2, "maximum": 9}
    assert check_spec("json", {"type": "integer", "minimum": 0}) == {"type": "integer", "minimum": 0, "maximum": BIG}
    assert check_spec("json", {"type": "integer", "minimum": 5e18}) == {
        "type": "integer", "minimum": 5 * 10**18, "maximum": INT64_MAX}
    assert check_spec("json", {"type": "integer", "maximum": 1e30, "minimum": 0})["maximum"] == INT64_MAX  # tighter
    assert check_spec("json", {"type": ["integer", "number"], "exclusiveMaximum": 0}) == {
        "type": "number", "exclusiveMaximum": 0, "minimum": -BIG}


def test_formats_the_compiler_writes_loosely_become_exact_patterns():
    for fmt, pattern in FORMATS.items():
        compiled = check_spec("json", {"type": "string", "format": fmt})
        assert compiled == ({"type": "string", "format": fmt} if pattern is None
                            else {"type": "string", "pattern": grammar_regex(pattern, fmt)})
    date = re.compile(FORMATS["date"])
    assert date.fullmatch("2024-02-29") and date.fullmatch("2000-02-29") and date.fullmatch("0001-01-31")
    assert not any(date.fullmatch(d) for d in ("2023-02-29", "1900-02-29", "2024-04-31", "2024-02-30", "0000-01-01"))
    for value in ("12:00:00Z", "23:59:59.123+05:30"):
        assert re.fullmatch(FORMATS["time"], value)
    assert not re.fullmatch(FORMATS["time"], "23:59:60Z") and not re.fullmatch(FORMATS["ipv4"], "01.2.3.4")


PATTERNS = [
    r"^\d+(\.\d{1,2})?$", r"^a(bc+)?$", r"^((x[0-9]{1,2})?y)$", r"[0-9]{2}", r"^(cat|dog|bird)s?$",
    r"^.{1,3}$", r"^[^a]{1,3}$", r"^[a-zé]{2}$", r"^\w+@\w+\.[a-z]{2,3}$", r"^[^\d\s]*$", r"^\W?x*?$",
    r"^[A-Z]{3}-\d{4}$", r"^(a|b)*c$", r"^\/path\.txt$", r"^$",
]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_pattern_is_rewritten_to_the_same_language_or_less(pattern):
    # Written anew from its parse (xgrammar misreads `?` on some groups and some classes); a
    # string the rewritten pattern takes, the original takes too.
    rewritten = grammar_regex(pattern, "pattern")
    rng = random.Random(0)
    alphabet = "abcxyz019 .-@/é\"\\\n٣_ZA"
    samples = ["", "12", "1.25", "abc", "ac", "x1y", "1y", "cats", "a", "ab", "zé", "a@b.cd", "ABC-1234", "/path.txt"]
    samples += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6))) for _ in range(3000)]
    for text in samples:
        if re.search(rewritten, text):
            assert re.search(pattern, text), (pattern, rewritten, text)


# --- the budget: schema_too_complex, before anything is queued -----------------------------------------


@pytest.mark.parametrize(
    ("kind", "value", "message"),
    [
        ("json", {"enum": [f"value{i:06d}" for i in range(100_000)]}, "a schema of 1"),  # issue 35, fault 4: 900 KB
        ("json", {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}},
         "2000 properties"),
        ("json", {"anyOf": [{"const": i} for i in range(3000)]}, "subschemas"),
        ("json", {"type": "string", "pattern": "^[a-z]{50000}$"}, "unrolls to 50000 characters"),
        ("json", {"type": "string", "pattern": "^(([a-z]{1,30}){1,30}){1,30}$"}, "unrolls to 27000 characters"),
        ("json", {"type": "string", "maxLength": 10**9}, "maxLength at # is 1000000000"),
        ("regex", "[a-z0-9]{1,20000}", "unrolls to 20000 characters"),
        ("choice", [f"choice number {i} " * 20 for i in range(256)], "choices of"),
        ("choice", [str(i) for i in range(300)], "300 choices"),
        ("grammar", "root ::= " + " | ".join(f'"{i}"' for i in range(20000)), "a grammar of"),
    ],
    ids=["enum-100k", "2000-properties", "3000-subschemas", "pattern-50000", "nested-repeats", "maxLength",
         "regex", "long-choices", "300-choices", "grammar"],
)
def test_specs_beyond_the_budget_are_refused_as_too_complex(kind, value, message):
    with pytest.raises(SpecTooComplexError, match=re.escape(message)) as info:
        check_spec(kind, value)
    assert info.value.code == SCHEMA_TOO_COMPLEX == ErrorCode.SCHEMA_TOO_COMPLEX
    with pytest.raises(ValidationError) as wire:
        StructuredOutputsRequest(**{kind: value})
    assert wire.value.errors()[0]["type"] == ErrorCode.SCHEMA_TOO_COMPLEX
    with pytest.raises(SchemaTooComplexError):
        StructuredOutputs(**{kind: value})


ACCEPTED = [
    SCHEMA,
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8, "title": "Name"},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
     "required": ["name"], "additionalProperties": False, "description": "a user"},
    {"$defs": {"n": {"type": ["integer", "null"], "minimum": 0}}, "type": "array", "items": {"$ref": "#/$defs/n"},
     "prefixItems": [{"const": 1}], "minItems": 1},
    {"anyOf": [{"type": "string", "format": "date-time"}, {"type": "number", "exclusiveMaximum": 1.5}]},
    {"type": "object", "additionalProperties": {"type": "boolean"}, "examples": [{"a": True}], "deprecated": False},
    {"definitions": {"node": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}},
     "$ref": "#/definitions/node", "$schema": "https://json-schema.org/draft/2020-12/schema"},
]


@pytest.mark.parametrize("schema", ACCEPTED)
def test_what_is_accepted_is_valid_draft_2020_12_and_checked_alike_on_both_sides(schema):
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator.check_schema(check_spec("json", schema))  # what the compiler gets, too
    StructuredOutputsRequest(json=schema)
    StructuredOutputs(json=schema)


def test_duplicate_tool_names_are_refused_with_the_name():
    # Issue 35, fault 6: three tools named f, tool_choice required, answered 200 with nothing.
    tool = {"type": "function", "function": {"name": "f"}}
    for choice in ("required", "auto", None):
        with pytest.raises(ValidationError, match=r"'f' is the name of tools\[0\], tools\[1\], tools\[2\]"):
            JobRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=[tool] * 3, tool_choice=choice)


def test_forced_calls_whose_schemas_together_are_too_big_are_refused_as_too_complex():
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {f"p{j}": {"type": "string", "description": "x" * 40} for j in range(40)}}}}
        for i in range(40)]
    JobRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=tools)  # auto: no grammar
    with pytest.raises(ValidationError) as info:
        JobRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice="required")
    assert info.value.errors()[0]["type"] == ErrorCode.SCHEMA_TOO_COMPLEX
    assert "every tool's together" in info.value.errors()[0]["msg"]


def test_the_docs_list_each_keyword_in_its_set():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "structured-outputs.md").read_text()
    rows = {line.split("|")[1].strip().split(" ")[0]: line for line in docs.splitlines() if line.startswith("| ")}
    for name, keywords in (("enforced", ENFORCED), ("annotations", ANNOTATIONS), ("refused", REFUSED)):
        listed = set(re.findall(r"`([$A-Za-z]+)`", rows[name].split("|")[2]))
        assert set(keywords) <= listed, (name, set(keywords) - listed)


def test_tool_parameters_must_be_enforceable_only_when_a_grammar_holds_them():
    # With auto a function's parameters only describe it to the model; forced, a grammar holds them.
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [tool]}
    JobRequest(**chat)
    JobRequest(**chat, tool_choice="none")
    for choice, place in (("required", "#/items/anyOf/0/properties/arguments/properties/tags"),
                          ({"type": "function", "function": {"name": "f"}}, "#/properties/tags")):
        with pytest.raises(ValidationError) as info:
            JobRequest(**chat, tool_choice=choice)
        assert info.value.errors()[0]["type"] == ErrorCode.INVALID_STRUCTURED_OUTPUT
        assert f"'uniqueItems' at {place} cannot be enforced" in info.value.errors()[0]["msg"]
    with pytest.raises(ValidationError, match="not a valid JSON schema"):
        JobRequest(**{**chat, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]})
