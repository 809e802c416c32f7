"""Structured outputs through the API: bad specs refused before anything is queued (in-process app),
and schema-valid output through the real stack with the official `openai` client."""

from __future__ import annotations

import contextlib
import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import redis
from fastapi.testclient import TestClient

from ferry.api.main import create_app
from ferry.api.settings import ApiSettings
from ferry.worker.protocol import Keys
from tests.api.conftest import KEY_A, MODEL, REDIS_URL, delete_prefix, new_prefix

pytestmark = pytest.mark.redis

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "n", "tags"],
}
MESSAGES = [{"role": "user", "content": "Describe a user."}]


@contextlib.contextmanager
def local_app():
    prefix = new_prefix()
    try:
        with TestClient(create_app(ApiSettings(redis_url=REDIS_URL, key_prefix=prefix, models="tiny"))) as client:
            client.keys = Keys(prefix)
            yield client
    finally:
        delete_prefix(prefix)


def _queued(api) -> int:
    r = redis.Redis.from_url(REDIS_URL)
    try:
        return sum(r.xlen(q) for q in api.keys.queues("tiny"))
    finally:
        r.close()


CHAT = {"model": "tiny", "messages": MESSAGES}
BAD = [
    ("/v1/chat/completions", CHAT | {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": 12}}}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", CHAT | {"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ("/v1/chat/completions", CHAT | {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("/v1/chat/completions", CHAT | {"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ("/v1/chat/completions", CHAT | {"response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", CHAT | {"tools": [{"type": "function", "function": {"name": "f"}}],
                                     "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("/v1/chat/completions", CHAT | {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": 12}}}}}]}, "tools[0].function.parameters"),
    ("/v1/chat/completions", CHAT | {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", CHAT | {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", CHAT | {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "messages[0]"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user"}]}, "messages[0]"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
    ("/v1/chat/completions", CHAT | {"guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "structured_outputs": {"choice": []}},
     "structured_outputs.choice"),
    ("/v1/jobs", {"input": {"prompt": "x", "structured_outputs": {"json": {"type": "objectx"}}}},
     "input.structured_outputs.json"),
    ("/v1/jobs", {"input": {"prompt": "x", "min_tokens": 2, "structured_outputs": {"choice": ["a"]}}}, "input"),
]


@pytest.mark.parametrize(("path", "body", "field"), BAD, ids=[f"{p}:{f}" for p, _, f in BAD])
def test_bad_structured_outputs_are_refused_with_the_field_named_and_nothing_queued(path, body, field):
    with local_app() as api:
        r = api.post(path, json=body)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error.get("field") == field or error["message"].startswith(field), error
        assert _queued(api) == 0


def _schema_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


# Issue 35: schemas that were accepted and not enforced (fault 5), or that stalled other tenants
# while they compiled (fault 4); refused before anything is queued, the keyword or the excess named.
UNENFORCEABLE = [
    ("/v1/chat/completions", CHAT | _schema_format({"type": "object", "allOf": [{"required": ["a"]}],
                                                     "properties": {"a": {"type": "integer"}}}),
     "response_format.json_schema.schema", "'allOf' at # cannot be enforced"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "structured_outputs": {"json": {"not": {"type": "number"}}}},
     "structured_outputs.json", "'not' at # cannot be enforced"),
    ("/v1/jobs", {"input": {"prompt": "x", "structured_outputs": {"json": {
        "allOf": [{"type": "object", "properties": {f"p{i}": {"type": "integer"}}} for i in range(500)]}}}},
     "input.structured_outputs.json", "'allOf' at #"),
    ("/v1/chat/completions", CHAT | _schema_format({"type": "object", "properties": {"a": {
        "type": "string", "maxLenght": 3}}}), "response_format.json_schema.schema", "'maxLenght' at #/properties/a"),
    ("/v1/chat/completions", CHAT | {"structured_outputs": {"json": {"enum": [f"v{i:05d}" for i in range(100_000)]}}},
     "structured_outputs.json", "characters as compact JSON (at most 65536)"),
    ("/v1/chat/completions", CHAT | {"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs.regex",
     "a lookaround is not supported"),
    ("/v1/chat/completions", CHAT | {"tools": [{"type": "function", "function": {"name": "f"}}] * 3,
                                     "tool_choice": "required"}, None, "'f' is the name of tools[0], tools[1]"),
]


@pytest.mark.parametrize(("path", "body", "field", "words"), UNENFORCEABLE,
                         ids=["allOf-required", "not", "allOf-500", "typo", "enum-100k", "lookbehind", "tools"])
def test_what_the_grammar_cannot_enforce_or_afford_is_refused_by_name_and_nothing_queued(path, body, field, words):
    with local_app() as api:
        r = api.post(path, json=body)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["param"] == field and words in error["message"], error
        assert "Check failed" not in error["message"]
        assert _queued(api) == 0


def test_a_job_carries_structured_outputs_as_given():
    with local_app() as api:
        r = api.post("/v1/jobs", json={"input": {"prompt": "x", "structured_outputs": {"json": SCHEMA}}})
        assert r.status_code == 202, r.text
        assert _queued(api) == 1


# --- through the real stack -------------------------------------------------------------------------


@pytest.fixture
def client(stack):
    with openai.OpenAI(base_url=stack.url + "/v1", api_key=KEY_A, max_retries=0, timeout=60) as c:
        yield c


@pytest.mark.timeout(120)
def test_json_schema_response_format_validates_on_a_random_model(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA, "strict": True}}
    for temperature in (0.0, 1.0):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt, max_tokens=120,
                                           temperature=temperature)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


@pytest.mark.timeout(120)
def test_json_object_and_vllm_extras_on_both_routes(client):
    # Any object: its strings are unbounded, which a random model may never close; bounded by
    # a schema, they always close (test_twenty_varied_schemas_all_validate_on_a_random_model).
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"},
                                       max_tokens=200, temperature=0.0)
    content = r.choices[0].message.content
    assert content.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 200
    r = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=10,
                                  extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert r.choices[0].text in ("left", "right")
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, stream=True,
                                            extra_body={"structured_outputs": {"regex": "[a-c]{3}-[0-9]"}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert len(text) == 5 and text[3] == "-"


@pytest.mark.timeout(120)
def test_a_spec_only_the_compiler_refuses_is_a_422_in_our_words(client):
    # The API cannot parse EBNF, so it queues the grammar; the worker's compiler refuses it, and
    # the client reads the compiler's words about the text, not its source location.
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                       extra_body={"structured_outputs": {"grammar": 'root ::= "a'}})
    assert info.value.body["code"] == "invalid_structured_output"
    assert info.value.body["message"].endswith(
        'structured_outputs.grammar cannot be compiled: EBNF lexer error at line 1, column 12: Expect " in string '
        'literal')


def _s(max_length: int = 8) -> dict:
    return {"type": "string", "maxLength": max_length}


# Twenty varied schemas: nested objects, arrays, enums, bounded numbers, required and optional fields.
# Strings and arrays are bounded: a random-weight model never chooses to close an unbounded one.
SCHEMAS = [
    {"type": "object", "properties": {"a": _s()}, "required": ["a"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["n"]},
    {"type": "object", "properties": {"flag": {"type": "boolean"}, "none": {"type": "null"}},
     "required": ["flag", "none"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"kind": {"const": "point"},
                                      "x": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["kind", "x"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": _s(4), "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {"b": _s()}, "required": ["b"]}},
     "required": ["inner"]},
    {"type": "object", "properties": {"a": _s(), "b": {"type": "integer", "minimum": 0, "maximum": 9}},
     "required": ["a"]},  # b optional
    {"type": "object", "properties": {"points": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}}}, "required": ["points"]},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 3}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, _s(3)]}},
     "required": ["v"]},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}, "label": _s(5)}, "required": ["level", "label"],
     "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "boolean"}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 1}}}},
     "required": ["matrix"]},
    {"type": "object", "properties": {"name": _s(6), "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "email": _s(10)}, "required": ["name", "age"]},
    {"enum": ["yes", "no", "maybe"]},
    {"type": "object", "properties": {"status": {"enum": ["ok", "error"]}, "code": {"type": "integer", "minimum": 100,
                                      "maximum": 599}}, "required": ["status", "code"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}, "tags": {
            "type": "array", "maxItems": 2, "items": {"enum": ["x", "y"]}}}, "required": ["id", "tags"]}}},
     "required": ["items"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "reason": {"type": ["string", "null"], "maxLength": 4}},
     "required": ["ok", "reason"]},
    {"type": "object", "properties": {"a": {"enum": ["p", "q"]}, "b": {"enum": [True, False]}, "c": _s(2)},
     "required": ["a", "b", "c"], "additionalProperties": False},
]


@pytest.mark.timeout(300)
def test_twenty_varied_schemas_all_validate_on_a_random_model(client):
    # On random weights only the grammar can make the output valid.
    def ask(index_schema):
        index, schema = index_schema
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{index}", "schema": schema, "strict": True}}
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt, max_tokens=400,
                                           temperature=0.0)
        return schema, r.choices[0]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, enumerate(SCHEMAS)))
    assert len(SCHEMAS) == 20
    for schema, choice in answers:
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)
