"""No field silently ignored: every field of each OpenAI route's request schema, walked from the
pydantic model itself (a field added later fails here until it has a case), either changes the
answer (against the same request without it) or is refused with 422 `unsupported_parameter`
naming it. Real API and worker processes on a tiny model, through the official `openai` client.

"The answer" is the response (its ids and timestamps aside) plus what the job keeps of the request
(its priority lane and metadata: `user` and `priority` change where and how a job runs, not its text).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from ferry.api.openai_schemas import ChatCompletionRequest, CompletionRequest
from tests.api import conftest as stacks
from tests.serve.test_render import THINKING_TEMPLATE
from tests.tiny_models import make_model

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]

EOS = "1"  # the tiny tokenizer's </s>, as a logit_bias key
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
NO_ARGUMENTS = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
BASE = {
    "completions": {"model": stacks.MODEL, "prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 8,
                    "temperature": 0},
    "chat": {"model": stacks.MODEL, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8,
             "temperature": 0},
}
FLAT = {"temperature": 5.0, "seed": 0}  # sampling from a flat distribution: greedy-making filters show


@dataclass(frozen=True)
class Base:
    """What the plain request (with a case's context) answered: some cases are made from it."""

    text: str
    token_ids: list[int]
    tokenizer: Any


@dataclass(frozen=True)
class Case:
    value: Any  # the field's value, or a function of the plain answer giving it
    context: dict | Callable[[Base], dict] = field(default_factory=dict)  # in both requests
    refused: bool = False  # 422 unsupported_parameter naming the field, rather than a changed answer


def _a_generated_word(base: Base) -> str:
    """The text of a generated token that, as a bad word, is that one token."""
    for token in base.token_ids:
        word = base.tokenizer.decode([token])
        if word.strip() and base.tokenizer.encode(word.lstrip(), add_special_tokens=False) == [token]:
            return word
    raise AssertionError(f"no generated token is a word of its own: {base.token_ids}")


def _forced_calls(base: Base) -> dict:
    """tool_choice required with a function of no arguments, whitespace tokens masked and commas
    favoured: the grammar lets a second call follow only with parallel_tool_calls."""
    text = {token: base.tokenizer.decode([token]) for token in range(len(base.tokenizer))}
    bias = {str(t): -100 for t, s in text.items() if s and not s.strip()}
    bias |= {str(t): 30 for t, s in text.items() if s.startswith(",")}
    return {"tools": [NO_ARGUMENTS], "tool_choice": "required", "max_tokens": 64, "logit_bias": bias}


def _stop(base: Base) -> list[str]:
    start = next(i for i in range(2, len(base.text) - 2) if "\ufffd" not in base.text[i:i + 2])
    return [base.text[start:start + 2]]


COMMON = {
    "model": Case("no-such-model"),
    "n": Case(2),
    "stream": Case(True),
    "stream_options": Case({"include_usage": True}, {"stream": True}),
    "logit_bias": Case({"9": 100}),
    "user": Case("someone"),
    "structured_outputs": Case({"choice": ["yes", "no"]}),
    "response_format": Case({"type": "json_object"}),
    "functions": Case([{"name": "f"}], refused=True),
    "function_call": Case({"name": "f"}, refused=True),
    "guided_json": Case({"type": "object"}, refused=True),
    "guided_regex": Case("a+", refused=True),
    "guided_choice": Case(["a"], refused=True),
    "guided_grammar": Case("root ::= 'a'", refused=True),
    "guided_decoding_backend": Case("xgrammar", refused=True),
    "prompt_logprobs": Case(1),
    "max_tokens": Case(3),
    "temperature": Case(50.0, {"seed": 0}),
    "top_p": Case(0.01, FLAT),
    "top_k": Case(1, FLAT),
    "min_p": Case(1.0, FLAT),
    "repetition_penalty": Case(100.0, {"max_tokens": 16}),
    "presence_penalty": Case(-2.0, {"max_tokens": 16}),
    "frequency_penalty": Case(-2.0, {"max_tokens": 16}),
    "seed": Case(1, {"temperature": 5.0}),
    "stop": Case(_stop),
    "stop_token_ids": Case(lambda base: [base.token_ids[2]]),
    "ignore_eos": Case(True, {"logit_bias": {EOS: 100}}),
    "min_tokens": Case(4, {"logit_bias": {EOS: 100}}),
    "allowed_token_ids": Case([40, 41, 42]),
    "bad_words": Case(lambda base: [_a_generated_word(base)]),
    "include_stop_str_in_output": Case(True, lambda base: {"stop": _stop(base)}),
    "skip_special_tokens": Case(False, {"logit_bias": {EOS: 100}, "ignore_eos": True}),
    "spaces_between_special_tokens": Case(False, {"logit_bias": {EOS: 100}, "ignore_eos": True,
                                                  "skip_special_tokens": False}),
    "truncate_prompt_tokens": Case(2),
    "priority": Case("high"),
}
CASES = {
    "completions": COMMON | {
        "prompt": Case("Another prompt, entirely."),
        "logprobs": Case(2),
        "echo": Case(True),
        "suffix": Case("and then", refused=True),
        "best_of": Case(2, refused=True),
        "tools": Case(TOOLS, refused=True),
        "tool_choice": Case("required", refused=True),
    },
    "chat": COMMON | {
        "messages": Case([{"role": "user", "content": "Something else, then."}]),
        "max_completion_tokens": Case(3),
        "logprobs": Case(True),
        "top_logprobs": Case(2, {"logprobs": True}),
        "tools": Case(TOOLS),
        "tool_choice": Case("required", {"tools": TOOLS}),
        "parallel_tool_calls": Case(False, _forced_calls),
        "chat_template_kwargs": Case({"enable_thinking": False}),
        "reasoning_effort": Case("low"),
    },
}
SCHEMAS = {"completions": CompletionRequest, "chat": ChatCompletionRequest}
WALK = [(route, name) for route, schema in SCHEMAS.items() for name in schema.model_fields]


@pytest.fixture(scope="module")
def fields_stack(tmp_path_factory):
    """API + worker on a tiny model whose chat template reads enable_thinking and reasoning_effort."""
    model_dir = make_model(tmp_path_factory.mktemp("thinking-model"), "llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    prefix, port = stacks.new_prefix(), stacks.free_port()
    env = stacks.stack_env(prefix, model_dir, FERRY_API_KEYS=stacks.api_keys_setting())
    logs = tmp_path_factory.mktemp("fields-logs")
    procs = {"worker": stacks.Proc("worker", ["worker"], env, logs),
             "api": stacks.Proc("api", ["api", "--host", "127.0.0.1", "--port", str(port)], env, logs)}
    url = f"http://127.0.0.1:{port}"
    try:
        stacks.wait_until(lambda: httpx.get(url + "/readyz").status_code == 200, 120, "the stack", procs.values())
        yield url, tokenizer
    finally:
        for proc in procs.values():
            proc.stop()
        stacks.delete_prefix(prefix)


@pytest.fixture(scope="module")
def client(fields_stack):
    with openai.OpenAI(base_url=fields_stack[0] + "/v1", api_key=stacks.KEY_A, max_retries=0, timeout=60) as c:
        yield c


def _ask(client: openai.OpenAI, url: str, route: str, body: dict) -> tuple[int, Any, list[dict]]:
    """(status, answer, jobs): the response without ids and timestamps, and the job's lane and
    metadata, or for an error its code and param; and the jobs the request made (GET /v1/jobs/{id})."""
    body = dict(body)
    create = client.chat.completions if route == "chat" else client.completions
    required = {name: body.pop(name) for name in ("model", "messages" if route == "chat" else "prompt")}
    try:
        raw = create.with_raw_response.create(**required, extra_body=body)
    except openai.APIStatusError as exc:
        return exc.status_code, (exc.code, exc.body.get("param") if isinstance(exc.body, dict) else None), []
    text = raw.http_response.text
    job_ids = sorted(set(re.findall(r'"id": ?"(?:chatcmpl|cmpl)-([^"]+)"', text)))
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {stacks.KEY_A}"}, timeout=30) as http:
        jobs = [http.get(f"/v1/jobs/{job_id}").json() for job_id in job_ids]
    answer = re.sub(r'"(id|created)": ?("[^"]*"|\d+)', "", text), [(job["priority"], job["metadata"]) for job in jobs]
    return raw.http_response.status_code, answer, jobs


def _base(client, url, tokenizer, route: str) -> Base:
    status, _, jobs = _ask(client, url, route, BASE[route])
    assert status == 200
    return Base(jobs[0]["output"]["text"], jobs[0]["output"]["token_ids"], tokenizer)


def test_every_field_of_every_route_has_a_case_and_a_line_in_the_docs():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    for route, schema in SCHEMAS.items():
        assert set(schema.model_fields) == set(CASES[route]), route
        assert [name for name in schema.model_fields if f"`{name}`" not in docs] == [], route


@pytest.mark.parametrize(("route", "name"), WALK, ids=[f"{r}-{n}" for r, n in WALK])
def test_a_field_changes_the_answer_or_is_refused_by_name(fields_stack, client, route, name):
    url, tokenizer = fields_stack
    case = CASES[route][name]
    needs_base = callable(case.value) or callable(case.context)
    base = _base(client, url, tokenizer, route) if needs_base else None
    context = case.context(base) if callable(case.context) else case.context
    value = case.value(base) if callable(case.value) else case.value
    without = _ask(client, url, route, BASE[route] | context)[:2]
    status, answer, _ = _ask(client, url, route, BASE[route] | context | {name: value})
    if case.refused:
        assert (status, answer) == (422, ("unsupported_parameter", name))
    else:
        assert status != 422 or answer[0] != "unsupported_parameter", answer
        assert (status, answer) != without, f"{name}={value!r} changed nothing"


@pytest.mark.parametrize("route", list(SCHEMAS))
def test_an_unknown_field_is_refused_by_name(fields_stack, client, route):
    url, _ = fields_stack
    assert _ask(client, url, route, BASE[route] | {"use_beam_search": True})[:2] == (
        422, ("unsupported_parameter", "use_beam_search"))


def test_a_template_variable_the_template_does_not_read_is_refused_by_name(fields_stack, client):
    url, _ = fields_stack
    body = BASE["chat"] | {"chat_template_kwargs": {"enable_thinking": False, "add_vision_id": True}}
    assert _ask(client, url, "chat", body)[:2] == (422, ("unsupported_parameter", "chat_template_kwargs.add_vision_id"))
