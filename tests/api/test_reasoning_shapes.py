"""A reasoning worker's split (thinking apart from the answer, `worker.serve.reasoning_parsers`) in the
Responses and Anthropic shapes: the same job events render as a reasoning item then the message
(Responses) and a thinking block then text (Messages), streamed and whole, and the official clients'
own types read them. The chat route's split is checked through the real stack in test_reasoning.py."""

from __future__ import annotations

import anthropic
import pytest
from openai.types.responses import Response

from ferry.api.anthropic_responses import MessageBuilder
from ferry.api.responses_jobs import ResponseMeta
from ferry.api.responses_render import ResponseEvents, response_object
from ferry.worker.protocol import (
    CompletedEvent,
    JobRecord,
    JobRequest,
    JobState,
    StartedEvent,
    Timings,
    TokenEvent,
    Usage,
)
from ferry.worker.protocol.tools import ChatDelta
from tests.api.conftest import KEY_A, MODEL

JOB = "0190000000000000000000000000abcd-s0"
USAGE = Usage(prompt_tokens=9, completion_tokens=6, total_tokens=15)
# What a reasoning worker streams for "<think>let me see</think>Paris.": the thinking, then the answer.
EVENTS = [
    StartedEvent(seq=0, worker_id="w", attempt=1),
    TokenEvent(seq=1, text="<think>let", token_ids=[1, 2], chat=ChatDelta(reasoning_content="let")),
    TokenEvent(seq=2, text=" me see", token_ids=[3, 4], chat=ChatDelta(reasoning_content=" me see")),
    TokenEvent(seq=3, text="</think>Par", token_ids=[5, 6], chat=ChatDelta(content="Par")),
    TokenEvent(seq=4, text="is.", token_ids=[7], chat=ChatDelta(content="is.")),
    CompletedEvent(seq=5, finish_reason="stop", usage=USAGE, timings=Timings()),
]


def _request() -> JobRequest:
    meta = ResponseMeta()
    return JobRequest(model="m", messages=[{"role": "user", "content": "Capital of France?"}],
                      metadata={"api": "responses", "responses": {"store": meta.store}})


def test_a_response_streams_its_thinking_as_a_reasoning_item_before_the_message():
    request = _request()
    render = ResponseEvents(JOB, request, ResponseMeta.of(JobRecord.new(JOB, request)))
    events = render.begin() + [e for event in EVENTS for e in render.on_event(event)]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (reasoning, answer) == ("let me see", "Paris.")
    final = Response.model_validate(events[-1]["response"])
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "let me see" and final.output_text == "Paris."
    # The stored response reads back the same, from the job's record.
    record = JobRecord.new(JOB, request).model_copy(update={
        "state": JobState.succeeded, "text": "".join(e.text for e in EVENTS if e.type == "token"),
        "content": "Paris.", "reasoning_content": "let me see", "finish_reason": "stop", "usage": USAGE})
    stored = Response.model_validate(response_object(record, ResponseMeta.of(record)))
    assert [item.model_dump() for item in stored.output] == [item.model_dump() for item in final.output]


def test_a_message_carries_its_thinking_as_a_thinking_block_before_the_text():
    builder = MessageBuilder("msg_x", "m", tools=False)
    streamed = [part for event in EVENTS for part in builder.render(event)]
    body = builder.body(EVENTS[-1])
    message = anthropic.types.Message.model_validate(body)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "let me see" and message.content[1].text == "Paris."
    assert sum('"thinking_delta"' in part for part in streamed) == 2
    assert sum('"content_block_start"' in part for part in streamed) == 2  # one block each, in order


@pytest.mark.redis
def test_an_earlier_thinking_block_given_back_is_accepted_and_left_out(stack):
    with anthropic.Anthropic(base_url=stack.url, api_key=KEY_A, max_retries=0) as client:
        turns = [{"role": "user", "content": "Hi"},
                 {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                                   {"type": "text", "text": "Hello."}]},
                 {"role": "user", "content": "Again"}]
        without = [turns[0], {"role": "assistant", "content": "Hello."}, turns[2]]
        given_back = client.messages.create(model=MODEL, messages=turns, max_tokens=4)
        plain = client.messages.create(model=MODEL, messages=without, max_tokens=4)
    assert given_back.usage.input_tokens + given_back.usage.cache_read_input_tokens == \
        plain.usage.input_tokens + plain.usage.cache_read_input_tokens
