"""Anthropic's Messages API through the real stack (API + worker on a random-weight model) with the
official `anthropic` client: the same greedy answer as /v1/chat/completions, whole and streamed,
Anthropic's stop reasons, tool use, and errors in Anthropic's shape."""

from __future__ import annotations

import json
import uuid

import anthropic
import jsonschema
import openai
import pytest

from tests.api.conftest import KEY_A, MODEL
from tests.api.test_openai import wait_job

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]

SYSTEM = "You are terse."
MESSAGES = [{"role": "user", "content": "Name three rivers of Europe."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
         {"name": "get_time", "description": "The time now", "input_schema": {"type": "object", "properties": {}}}]


@pytest.fixture
def client(stack):
    with anthropic.Anthropic(base_url=stack.url, api_key=KEY_A, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def oai(stack):
    with openai.OpenAI(base_url=stack.url + "/v1", api_key=KEY_A, max_retries=0, timeout=60) as c:
        yield c


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


GREEDY = {"temperature": 0.0}  # sent as an extra: the client's newer versions no longer name it


def greedy(client, extra: dict | None = None, **kwargs):
    return client.messages.create(model=MODEL, system=SYSTEM, messages=MESSAGES, extra_body=GREEDY | (extra or {}),
                                  **kwargs)


def test_whole_and_streamed_messages_match_chat_completions(client, oai):
    whole = greedy(client, max_tokens=12)
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": SYSTEM}, *MESSAGES],
                                       max_tokens=12, temperature=0.0)
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert text_of(whole) == chat.choices[0].message.content and text_of(whole)
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert whole.usage.cache_creation_input_tokens == 0

    with client.messages.stream(model=MODEL, system=SYSTEM, messages=MESSAGES, max_tokens=12,
                                extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(final) == text_of(whole)
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_max_tokens_ends_with_max_tokens(client):
    reference = greedy(client, max_tokens=24)
    assert reference.stop_reason == "max_tokens" and reference.usage.output_tokens == 24  # no early end here
    short = greedy(client, max_tokens=5)
    assert (short.stop_reason, short.stop_sequence, short.usage.output_tokens) == ("max_tokens", None, 5)
    assert text_of(reference).startswith(text_of(short))


def test_a_stop_sequence_ends_the_text_before_it_and_is_named(client):
    reference = text_of(greedy(client, max_tokens=24))
    middle = len(reference) // 2
    stop = next(reference[i:i + 2] for i in range(middle, len(reference) - 1) if reference[i:i + 2].strip())
    for stream in (False, True):
        if stream:
            with client.messages.stream(model=MODEL, system=SYSTEM, messages=MESSAGES, max_tokens=24,
                                        extra_body=GREEDY, stop_sequences=[stop]) as s:
                message = s.get_final_message()
        else:
            message = greedy(client, max_tokens=24, stop_sequences=["\u2603 never", stop])
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
        assert text_of(message) == reference[:reference.index(stop)]


def tool_blocks(message) -> list:
    return [block for block in message.content if block.type == "tool_use"]


def test_tool_choice_any_calls_a_tool_whose_input_fits_its_schema(client):
    message = greedy(client, max_tokens=150, tools=TOOLS,
                     tool_choice={"type": "any", "disable_parallel_tool_use": True})
    [call] = tool_blocks(message)
    assert message.stop_reason == "tool_use" and call.id
    jsonschema.validate(call.input, next(t["input_schema"] for t in TOOLS if t["name"] == call.name))


def streamed_calls(events) -> tuple[list[dict], str | None]:
    """The tool_use blocks of a raw event stream, each input joined from its input_json_delta pieces."""
    blocks: dict[int, dict] = {}
    stop = None
    for event in events:
        if event.type == "content_block_start" and event.content_block.type == "tool_use":
            blocks[event.index] = {"id": event.content_block.id, "name": event.content_block.name, "json": ""}
        elif event.type == "content_block_delta" and event.delta.type == "input_json_delta":
            blocks[event.index]["json"] += event.delta.partial_json
        elif event.type == "message_delta":
            stop = event.delta.stop_reason
    return [{"name": b["name"], "input": json.loads(b["json"])} for _, b in sorted(blocks.items())], stop


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_streamed_input_json_pieces_join_to_the_whole_input(client, choice):
    whole = greedy(client, max_tokens=150, tools=TOOLS, tool_choice=choice)
    calls, stop = streamed_calls(greedy(client, max_tokens=150, tools=TOOLS, tool_choice=choice, stream=True))
    assert calls == [{"name": b.name, "input": b.input} for b in tool_blocks(whole)] and calls
    assert stop == whole.stop_reason == "tool_use"
    if choice["type"] == "tool":
        assert [c["name"] for c in calls] == ["get_weather"]
        jsonschema.validate(calls[0]["input"], WEATHER)


def test_a_tool_result_turn_is_the_chat_of_a_tool_call_and_its_result(client, oai):
    anthropic_turns = [*MESSAGES,
                       {"role": "assistant", "content": [
                           {"type": "text", "text": "Let me look."},
                           {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                       {"role": "user", "content": [
                           {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text",
                                                                                         "text": "sunny"}]},
                           {"type": "text", "text": "And tomorrow?"}]}]
    call = {"id": "toolu_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
    chat_turns = [{"role": "system", "content": SYSTEM}, *MESSAGES,
                  {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
                  {"role": "user", "content": "And tomorrow?"}]
    openai_tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                      "parameters": t["input_schema"]}} for t in TOOLS]
    message = client.messages.create(model=MODEL, system=SYSTEM, messages=anthropic_turns, tools=TOOLS,
                                     max_tokens=10, extra_body=GREEDY)
    chat = oai.chat.completions.create(model=MODEL, messages=chat_turns, tools=openai_tools, max_tokens=10,
                                       temperature=0.0)
    assert text_of(message) == (chat.choices[0].message.content or "")
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_a_failed_tool_result_is_marked_for_the_model(client):
    def prompt_tokens(is_error: bool) -> int:
        turns = [*MESSAGES,
                 {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_time", "input": {}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "down",
                                               "is_error": is_error}]}]
        usage = client.messages.create(model=MODEL, messages=turns, tools=TOOLS, max_tokens=1).usage
        return usage.input_tokens + usage.cache_read_input_tokens

    assert prompt_tokens(True) > prompt_tokens(False)


def test_a_client_that_goes_away_cancels_its_job(client, stack):
    with greedy(client, max_tokens=1000, stream=True) as events:
        start = next(iter(events))
    assert start.type == "message_start"
    with stack.client() as http:
        assert wait_job(http, start.message.id.removeprefix("msg_"))["status"] == "cancelled"


def refusal(excinfo, kind: str, status: int) -> dict:
    error = excinfo.value
    assert error.status_code == status and error.body["type"] == "error", error.body
    assert error.body["error"]["type"] == kind and error.body["error"]["message"]
    return error.body["error"]


def test_missing_max_tokens_is_an_invalid_request_naming_it(client):
    with pytest.raises(anthropic.UnprocessableEntityError) as info:
        client.post("/v1/messages", cast_to=anthropic.types.Message, body={"model": MODEL, "messages": MESSAGES})
    assert refusal(info, "invalid_request_error", 422)["param"] == "max_tokens"


@pytest.mark.parametrize("field, value", [("frobnicate", 1), ("thinking", {"type": "enabled", "budget_tokens": 64}),
                                          ("service_tier", "auto")])
def test_a_field_ferry_does_not_implement_is_refused_by_name(client, field, value):
    with pytest.raises(anthropic.UnprocessableEntityError) as info:
        greedy(client, max_tokens=4, extra={field: value})
    error = refusal(info, "invalid_request_error", 422)
    assert (error["code"], error["param"]) == ("unsupported_parameter", field)


def test_an_image_block_is_refused(client):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.UnprocessableEntityError) as info:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [image]}])
    assert refusal(info, "invalid_request_error", 422)["param"].startswith("messages[0].content")


def test_an_unknown_model_is_not_found(client):
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="no-such-model", max_tokens=4, messages=MESSAGES)
    assert refusal(info, "not_found_error", 404)["code"] == "model_not_found"


def test_keys_come_as_x_api_key_or_bearer_and_a_bad_one_is_an_authentication_error(stack):
    with anthropic.Anthropic(base_url=stack.url, api_key=None, auth_token=KEY_A, max_retries=0) as bearer:
        assert bearer.messages.create(model=MODEL, max_tokens=2, messages=MESSAGES).usage.output_tokens == 2
    with anthropic.Anthropic(base_url=stack.url, api_key="sk-wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as info:
            wrong.messages.create(model=MODEL, max_tokens=2, messages=MESSAGES)
    assert refusal(info, "authentication_error", 401)["code"] == "unauthorized"


def test_other_routes_keep_openai_error_shape(oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="no-such-model", max_tokens=2, messages=MESSAGES)
    assert info.value.body["code"] == "model_not_found" and info.value.body["type"] == "invalid_request_error"


def test_an_idempotency_key_answers_a_retry_from_the_same_job_and_keeps_it_when_the_client_leaves(client, stack):
    key = f"msg-{uuid.uuid4().hex}"
    with greedy(client, max_tokens=20, stream=True, extra_headers={"Idempotency-Key": key}) as events:
        start = next(iter(events))
    job_id = start.message.id.removeprefix("msg_")
    with stack.client() as http:  # the client went away, but with a key its job goes on
        assert wait_job(http, job_id)["status"] == "succeeded"
    retried = greedy(client, max_tokens=20, extra_headers={"Idempotency-Key": key})
    assert retried.id == start.message.id and retried.stop_reason
    with pytest.raises(anthropic.ConflictError) as info:
        greedy(client, max_tokens=21, extra_headers={"Idempotency-Key": key})
    assert refusal(info, "invalid_request_error", 409)["code"] == "idempotency_conflict"
