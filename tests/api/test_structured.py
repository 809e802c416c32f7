"""Structured outputs through the API: bad specs refused before anything is queued (in-process app),
and schema-valid output through the real stack with the official `openai` client."""

from __future__ import annotations

import contextlib
import json

import jsonschema
import openai
import pytest
import redis
from fastapi.testclient import TestClient

from api.main import create_app
from api.settings import ApiSettings
from tests.api.conftest import KEY_A, MODEL, REDIS_URL, delete_prefix, new_prefix
from worker.protocol import Keys

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
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"},
                                       max_tokens=200, temperature=0.0)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=10,
                                  extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert r.choices[0].text in ("left", "right")
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, stream=True,
                                            extra_body={"structured_outputs": {"regex": "[a-c]{3}-[0-9]"}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert len(text) == 5 and text[3] == "-"


@pytest.mark.timeout(120)
def test_a_schema_the_compiler_refuses_is_a_422_with_its_message(client):
    # Valid Draft 2020-12 (so the API queues it), but xgrammar cannot compile a grammar for it.
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}, "required": ["a"]}
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                       extra_body={"structured_outputs": {"json": schema}})
    assert info.value.body["code"] == "invalid_structured_output"
