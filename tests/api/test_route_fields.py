"""No field silently ignored on `/v1/responses` and `/v1/messages` (test_openai_fields.py walks the
chat and completions routes): every field of each route's request schema, walked from the pydantic
model itself, either changes the answer or is refused with 422 `unsupported_parameter` naming it.

Both routes echo some request fields in their answers, so "the answer" is what was generated (the
body without ids and timestamps, and the echoed request fields left out) together with the job
the request made, as the queue holds it: a field changes either what the model produced or what
the worker is told to do (which test_openai_fields.py checks the worker honours, field by field).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from transformers import AutoTokenizer

from ferry.api.anthropic_schemas import MessagesRequest
from ferry.api.responses_schemas import ResponseCreate
from ferry.worker.protocol import Keys
from tests.api import conftest as stacks
from tests.serve.test_render import THINKING_TEMPLATE
from tests.tiny_models import make_model

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]

BASE = {
    "responses": {"model": stacks.MODEL, "input": "Say something.", "max_output_tokens": 8, "temperature": 0},
    "messages": {"model": stacks.MODEL, "messages": [{"role": "user", "content": "Say something."}],
                 "max_tokens": 8, "temperature": 0},
}
FLAT_TOOL = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": FLAT_TOOL["parameters"]}
# Request fields a Response echoes (and item ids): left out of the answer, so only what was generated counts.
ECHOED = {"instructions", "max_output_tokens", "model", "parallel_tool_calls", "previous_response_id", "reasoning",
          "store", "temperature", "top_p", "text", "tool_choice", "tools", "user", "metadata", "background"}


@dataclass(frozen=True)
class Case:
    value: Any  # the field's value, or a function of the plain answer's id and text giving it
    context: dict = field(default_factory=dict)  # in both requests
    refused: bool = False  # 422 unsupported_parameter naming the field, rather than a changed answer


def _stop(base: tuple[str, str]) -> list[str]:
    text = base[1]
    start = next(i for i in range(1, len(text) - 2) if "\ufffd" not in text[i:i + 2] and text[i:i + 2].strip())
    return [text[start:start + 2]]


CASES = {
    "responses": {
        "model": Case("no-such-model"),
        "input": Case("Another input, entirely."),
        "instructions": Case("Be terse."),
        "previous_response_id": Case(lambda base: base[0]),
        "tools": Case([FLAT_TOOL]),
        "tool_choice": Case("required", {"tools": [FLAT_TOOL]}),
        "parallel_tool_calls": Case(False, {"tools": [FLAT_TOOL]}),
        "text": Case({"format": {"type": "json_object"}}),
        "reasoning": Case({"effort": "low"}),
        "max_output_tokens": Case(3),
        "temperature": Case(50.0),
        "top_p": Case(0.01, {"temperature": 5.0}),
        "metadata": Case({"run": "a"}),
        "store": Case(False),
        "stream": Case(True),
        "background": Case(True),
        "user": Case("someone"),
        "safety_identifier": Case("someone"),
        "priority": Case("high"),
        "webhook": Case({"url": "http://127.0.0.1:9/hook"}),
        "include": Case(["reasoning.encrypted_content"], refused=True),
        "top_logprobs": Case(2, refused=True),
        "max_tool_calls": Case(1, refused=True),
        "prompt": Case({"id": "pmpt_1"}, refused=True),
        "conversation": Case("conv_1", refused=True),
        "prompt_cache_key": Case("k", refused=True),
        "stream_options": Case({"include_obfuscation": False}, refused=True),
        "service_tier": Case("flex", refused=True),
        "truncation": Case("auto", refused=True),
    },
    "messages": {
        "model": Case("no-such-model"),
        "max_tokens": Case(3),
        "messages": Case([{"role": "user", "content": "Another message, entirely."}]),
        "system": Case("Be terse."),
        "stop_sequences": Case(_stop),
        "temperature": Case(50.0),
        "top_p": Case(0.01, {"temperature": 5.0}),
        "top_k": Case(1, {"temperature": 5.0}),
        "tools": Case([ANTHROPIC_TOOL]),
        "tool_choice": Case({"type": "any"}, {"tools": [ANTHROPIC_TOOL]}),
        "metadata": Case({"user_id": "someone"}),
        "stream": Case(True),
        "thinking": Case({"type": "enabled", "budget_tokens": 1024}, refused=True),
        "service_tier": Case("standard_only", refused=True),
        "cache_control": Case({"type": "ephemeral"}, refused=True),
        "container": Case("container_1", refused=True),
        "mcp_servers": Case([{"type": "url", "url": "https://mcp.example", "name": "m"}], refused=True),
    },
}
SCHEMAS = {"responses": ResponseCreate, "messages": MessagesRequest}
DOCS = {"responses": "responses.md", "messages": "api.md"}
WALK = [(route, name) for route, schema in SCHEMAS.items() for name in schema.model_fields]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url, Redis, key names): API + worker on a tiny model whose chat template reads reasoning_effort."""
    model_dir = make_model(tmp_path_factory.mktemp("fields-model"), "llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    prefix, port = stacks.new_prefix(), stacks.free_port()
    env = stacks.stack_env(prefix, model_dir, FERRY_API_KEYS=stacks.api_keys_setting(), FERRY_WEBHOOK_ALLOW_PRIVATE="1")
    logs = tmp_path_factory.mktemp("route-fields-logs")
    procs = [stacks.Proc("worker", ["worker"], env, logs),
             stacks.Proc("api", ["api", "--host", "127.0.0.1", "--port", str(port)], env, logs)]
    url = f"http://127.0.0.1:{port}"
    client = redis.Redis.from_url(stacks.REDIS_URL, decode_responses=True)
    try:
        stacks.wait_until(lambda: httpx.get(url + "/readyz").status_code == 200, 120, "the stack", procs)
        yield url, client, Keys(prefix)
    finally:
        for proc in procs:
            proc.stop()
        client.close()
        stacks.delete_prefix(prefix)


def _job_id(route: str, text: str) -> str:
    prefix = "resp_" if route == "responses" else "msg_"
    return re.search(rf'"id": ?"{prefix}([^"]+)"', text).group(1)


def _generated(route: str, text: str, job_id: str) -> str:
    """The answer without its ids, timestamps and (Responses) echoed request fields."""
    if route == "responses" and not text.startswith("event:"):
        body = json.loads(text)
        text = json.dumps({k: v for k, v in body.items() if k not in ECHOED | {"created_at", "completed_at"}})
    return re.sub(r'"(created_at|completed_at)": ?\d+', "", text.replace(job_id, "JOB"))


def _ask(served, route: str, body: dict) -> tuple[int, Any]:
    """(status, (generated answer, the job as queued)), or for an error (status, (code, param))."""
    url, client, keys = served
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {stacks.KEY_A}"}, timeout=60) as http:
        r = http.post(f"/v1/{route}", json=body)
    if r.status_code != 200:
        error = r.json()["error"]
        return r.status_code, (error.get("code"), error.get("param"))
    job_id = _job_id(route, r.text)
    queued = json.loads(client.hget(keys.job(job_id), "request"))
    queued.pop("created_at")
    return 200, (_generated(route, r.text, job_id), queued)


def test_every_field_of_both_routes_has_a_case_and_a_line_in_the_docs():
    docs = Path(__file__).resolve().parents[2] / "docs"
    for route, schema in SCHEMAS.items():
        assert set(schema.model_fields) == set(CASES[route]), route
        text = (docs / DOCS[route]).read_text()
        assert [name for name in schema.model_fields if f"`{name}`" not in text] == [], route


@pytest.mark.parametrize(("route", "name"), WALK, ids=[f"{r}-{n}" for r, n in WALK])
def test_a_field_changes_the_answer_or_is_refused_by_name(served, route, name):
    case = CASES[route][name]
    value = case.value(_plain(served, route)) if callable(case.value) else case.value
    without = _ask(served, route, BASE[route] | case.context)
    status, answer = _ask(served, route, BASE[route] | case.context | {name: value})
    if case.refused:
        assert (status, answer) == (422, ("unsupported_parameter", name))
    else:
        assert status != 422 or answer[0] != "unsupported_parameter", answer
        assert (status, answer) != without, f"{name}={value!r} changed nothing"


def _plain(served, route: str) -> tuple[str, str]:
    """(the id, the text) of the plain request's answer."""
    url = served[0]
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {stacks.KEY_A}"}, timeout=60) as http:
        body = http.post(f"/v1/{route}", json=BASE[route]).json()
    if route == "responses":
        text = "".join(part["text"] for item in body["output"] if item["type"] == "message" for part in item["content"])
    else:
        text = "".join(block["text"] for block in body["content"] if block["type"] == "text")
    return body["id"], text
