"""OpenAI's Responses API through the real stack (API + worker on a random-weight model) with the
official `openai` client: answers equal chat completions' on the same conversation, streams carry
gapless typed events, background responses are jobs that outlive their client and resume their
stream from a sequence number, and a conversation chains through previous_response_id."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.api.conftest import KEY_A, KEY_B, MODEL, Proc, api_keys_setting, free_port, stack_env, wait_until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]

GREEDY = {"temperature": 0.0}
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                         "required": ["city"]}}]


@pytest.fixture
def client(stack):
    with openai.OpenAI(base_url=stack.url + "/v1", api_key=KEY_A, max_retries=0, timeout=60) as c:
        yield c


def chat_answer(client, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, **GREEDY)
    return r.choices[0].message.content, r.usage.prompt_tokens


def events_of(stream) -> list:
    return list(stream)


def check_gapless(events, start: int = 0) -> None:
    assert [e.sequence_number for e in events] == list(range(start, start + len(events)))


def test_a_response_is_the_chat_answer_to_the_same_conversation(client):
    r = client.responses.create(model=MODEL, input="Tell me about ships", instructions="Be brief.",
                                max_output_tokens=12, **GREEDY)
    text, prompt_tokens = chat_answer(client, [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Tell me about ships"}], 12)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.output_text == text
    assert r.instructions == "Be brief."
    assert r.usage.input_tokens == prompt_tokens and r.usage.output_tokens <= 12
    assert r.status == ("incomplete" if r.usage.output_tokens == 12 else "completed")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    # Stored: it reads back the same, in a body the client's own type takes strictly (not only leniently).
    again = client.responses.retrieve(r.id)
    assert again.output_text == text and again.status == r.status
    raw = client.responses.with_raw_response.retrieve(r.id).http_response.json()
    assert Response.model_validate(raw).output_text == text


def test_a_stream_is_gapless_typed_events_that_add_up_to_the_answer(client):
    events = events_of(client.responses.create(model=MODEL, input="Hello there", max_output_tokens=10, stream=True,
                                               **GREEDY))
    check_gapless(events)
    for event in events:  # each event as the client's own types take it, strictly
        STREAM_EVENT.validate_python(event.model_dump(exclude_unset=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == deltas
    assert deltas == chat_answer(client, [{"role": "user", "content": "Hello there"}], 10)[0]
    done = [e for e in events if e.type == "response.output_text.done"]
    assert [d.text for d in done] == [deltas]
    assert client.responses.retrieve(final.id).output_text == deltas


def test_a_background_response_is_queued_then_read_back_and_its_stream_resumes(client):
    created = client.responses.create(model=MODEL, input="Once upon a time", max_output_tokens=24, background=True,
                                      **GREEDY)
    assert created.status in ("queued", "in_progress") and created.background
    # Follow its stream for a few events, drop the connection, and pick the stream up where it was.
    first_part = []
    with client.responses.retrieve(created.id, stream=True) as stream:
        for event in stream:
            first_part.append(event)
            if event.type == "response.output_text.delta" or len(first_part) > 6:
                break
    resumed_at = first_part[-1].sequence_number
    rest = events_of(client.responses.retrieve(created.id, stream=True, starting_after=resumed_at))
    check_gapless(first_part + rest)
    whole = events_of(client.responses.retrieve(created.id, stream=True))
    assert [e.model_dump() for e in whole] == [e.model_dump() for e in first_part + rest]
    final = client.responses.retrieve(created.id)
    assert final.status in ("completed", "incomplete")
    assert final.output_text == "".join(e.delta for e in whole if e.type == "response.output_text.delta")
    assert final.output_text == chat_answer(client, [{"role": "user", "content": "Once upon a time"}], 24)[0]


def test_previous_response_id_chains_the_conversation(client):
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=8, **GREEDY)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=8, **GREEDY)
    expected, _ = chat_answer(client, [{"role": "user", "content": "My name is Ada."},
                                       {"role": "assistant", "content": first.output_text},
                                       {"role": "user", "content": "What is my name?"}], 8)
    assert second.output_text == expected
    assert second.previous_response_id == first.id


def test_an_unstored_response_cannot_be_read_or_chained(client):
    r = client.responses.create(model=MODEL, input="secret", max_output_tokens=4, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=MODEL, input="again", previous_response_id=r.id, max_output_tokens=4)
    assert info.value.body["code"] == "previous_response_not_found"


def test_another_tenant_never_sees_a_response(client, stack):
    r = client.responses.create(model=MODEL, input="mine", max_output_tokens=4, **GREEDY)
    with openai.OpenAI(base_url=stack.url + "/v1", api_key=KEY_B, max_retries=0) as other:
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.create(model=MODEL, input="x", previous_response_id=r.id, max_output_tokens=4)


def _process_state(pid: int) -> str:
    """The one-letter state /proc gives a process ("T": stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_cancel_and_delete(client, stack):
    live = client.responses.create(model=MODEL, input="a", max_output_tokens=4, **GREEDY)
    with pytest.raises(openai.ConflictError):
        client.responses.cancel(live.id)  # only a background response can be cancelled
    # The worker stopped (SIGSTOP) from before the response is created until it is cancelled: the
    # tiny model could otherwise end it (its EOS comes in about 140 tokens) before the cancel lands.
    worker = stack.procs["worker"].popen
    try:
        os.killpg(worker.pid, signal.SIGSTOP)
        wait_until(lambda: _process_state(worker.pid) == "T", 10, "the worker to stop")
        queued = client.responses.create(model=MODEL, input="Write a long story", max_output_tokens=2000,
                                         background=True, **GREEDY)
        cancelled = client.responses.cancel(queued.id)
    finally:
        os.killpg(worker.pid, signal.SIGCONT)
    assert cancelled.status == "cancelled"
    stream = events_of(client.responses.retrieve(queued.id, stream=True))
    check_gapless(stream)
    assert stream[-1].type == "response.cancelled"
    client.responses.delete(queued.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(queued.id)


def test_a_required_tool_call_is_a_function_call_item_streamed_in_pieces(client):
    events = events_of(client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS,
                                               tool_choice="required", max_output_tokens=120, stream=True, **GREEDY))
    check_gapless(events)
    final = events[-1].response
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id.startswith("call_") for c in calls)
    for call in calls:
        pieces = [e.delta for e in events
                  if e.type == "response.function_call_arguments.delta" and e.item_id == call.id]
        assert "".join(pieces) == call.arguments and len(pieces) > 1  # streamed as the model wrote it
        if call.status == "completed":  # greedy, the model may add calls until max_output_tokens cuts one
            jsonschema.validate(json.loads(call.arguments), TOOLS[0]["parameters"])
    assert calls[0].status == "completed"
    stored = [item for item in client.responses.retrieve(final.id).output if item.type == "function_call"]
    assert [(c.arguments, c.status) for c in stored] == [(c.arguments, c.status) for c in calls]
    # The call's result goes back as the next turn's input.
    answer = client.responses.create(
        model=MODEL, previous_response_id=final.id, max_output_tokens=6, **GREEDY,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert answer.status in ("completed", "incomplete")


def test_a_json_schema_format_shapes_the_output(client):
    r = client.responses.create(model=MODEL, input="Where?", max_output_tokens=60, **GREEDY,
                                text={"format": {"type": "json_schema", "name": "place", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema" and r.text.format.name == "place"


@pytest.mark.parametrize("field, value", [("include", ["reasoning.encrypted_content"]), ("truncation", "auto"),
                                          ("top_logprobs", 2), ("service_tier", "flex"), ("not_a_field", 1)])
def test_a_field_ferry_does_not_implement_is_refused_by_name(client, field, value):
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.responses.create(model=MODEL, input="x", max_output_tokens=2, extra_body={field: value})
    assert info.value.body["code"] == "unsupported_parameter" and field in info.value.body["message"]


def test_an_unknown_model_and_a_bad_input_item_are_clear_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="x")
    with pytest.raises(openai.UnprocessableEntityError):
        client.responses.create(model=MODEL, input=[{"type": "input_image", "image_url": "http://x/y.png"}])


def test_input_items_list_what_the_model_read(client):
    first = client.responses.create(model=MODEL, input="One", instructions="Be kind.", max_output_tokens=3, **GREEDY)
    second = client.responses.create(model=MODEL, input="Two", previous_response_id=first.id, max_output_tokens=3,
                                     **GREEDY)
    items = list(client.responses.input_items.list(second.id, order="asc"))
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert [i.content[0].text for i in items] == ["One", first.output_text, "Two"]
    newest_first = client.responses.input_items.list(second.id, limit=2)
    assert [i.id for i in newest_first.data] == [items[2].id, items[1].id] and newest_first.has_more


def test_a_background_response_webhook_is_signed_and_delivered(client, receiver):
    r = client.responses.create(model=MODEL, input="ping", max_output_tokens=3, background=True, **GREEDY,
                                extra_body={"webhook": {"url": receiver.base + "/responses",
                                                        "events": ["job.completed"]}})
    [delivery] = receiver.wait_for(1, path="/responses")
    body = delivery.json()
    assert body["type"] == "job.completed" and "resp_" + body["data"]["id"] == r.id
    assert body["data"]["output"]["text"] == client.responses.retrieve(r.id).output_text


def test_a_background_stream_resumes_on_another_api_process_after_its_own_was_killed(client, stack, tmp_path):
    port = free_port()
    env = stack_env(stack.prefix, tmp_path, FERRY_API_KEYS=api_keys_setting())
    doomed = Proc("api-doomed", ["api", "--host", "127.0.0.1", "--port", str(port)], env, tmp_path)
    try:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200, 60, "the second API",
                   [doomed])
        first_part = []
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY_A, max_retries=0) as other:
            stream = other.responses.create(model=MODEL, input="A tale of two APIs", max_output_tokens=30,
                                            background=True, stream=True, **GREEDY)
            for event in stream:
                first_part.append(event)
                if event.type == "response.output_text.delta":
                    break
            doomed.popen.kill()  # SIGKILL mid-stream: the API process is gone, the job is not
            doomed.popen.wait()
    finally:
        doomed.stop()
    rest = events_of(client.responses.retrieve(first_part[0].response.id, stream=True,
                                               starting_after=first_part[-1].sequence_number))
    check_gapless(first_part + rest)
    text = "".join(e.delta for e in first_part + rest if e.type == "response.output_text.delta")
    assert rest[-1].type in ("response.completed", "response.incomplete")
    assert text == rest[-1].response.output_text
    assert text == chat_answer(client, [{"role": "user", "content": "A tale of two APIs"}], 30)[0]
