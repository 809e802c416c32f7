"""Tool calling through the real stack (API + worker on a random-weight model) with the official
`openai` client: forced calls come from the grammar, `auto` calls from the worker's parser."""

from __future__ import annotations

import json
import re
import uuid

import jsonschema
import openai
import pytest

from tests.api.conftest import KEY_A, MODEL, wait_until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# What a model that calls get_weather writes in the hermes format: forced here with a regex, so a
# random-weight model produces it and the worker's `auto` parser has a call to find.
HERMES_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture
def client(stack):
    with openai.OpenAI(base_url=stack.url + "/v1", api_key=KEY_A, max_retries=0, timeout=60) as c:
        yield c


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_makes_a_random_model_call_a_tool(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       max_tokens=150, temperature=0.0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls)
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)


def test_tools_that_share_a_name_are_a_422_naming_it(client):
    # Issue 35, fault 6: three tools named f and tool_choice required answered 200 with neither
    # content nor a call.
    tools = [{"type": "function", "function": {"name": "f", "parameters": WEATHER}}] * 3
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=tools, tool_choice="required",
                                       max_tokens=20)
    assert "'f' is the name of tools[0], tools[1], tools[2]" in info.value.body["message"]


def test_required_without_parallel_calls_makes_one_call(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=150, temperature=0.7, seed=3)
    assert len(r.choices[0].message.tool_calls) == 1


def test_a_named_function_is_called_with_valid_arguments(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                       max_tokens=150, temperature=1.0, seed=1)
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"]
    check_calls(calls)
    assert r.choices[0].finish_reason == "stop"  # OpenAI's: a named call was not the model's choice


def streamed_calls(stream) -> tuple[list[dict], str | None]:
    """The calls of a streamed chat as a client rebuilds them (each with its arguments' fragments),
    and its finish reason; the call's text never comes as content."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        assert not delta.content
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "fragments": []})
            call["id"] = d.id or call["id"]
            call["name"] += (d.function.name or "") if d.function else ""
            if d.function and d.function.arguments:
                call["fragments"].append(d.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_call_arguments_stream_in_fragments_that_join_to_the_answers(client, choice):
    # Only get_weather: its arguments hold a city, so they are many tokens long. One call: greedy, a
    # random-weight model would add calls to the array until max_tokens cuts one.
    kwargs = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS[:1], "tool_choice": choice, "max_tokens": 150,
              "temperature": 0.0, "parallel_tool_calls": False}
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls, finish = streamed_calls(client.chat.completions.create(**kwargs, stream=True))
    assert finish == whole.finish_reason == ("tool_calls" if choice == "required" else "stop")
    assert [(c["name"], "".join(c["fragments"])) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    check_calls(whole.message.tool_calls)
    assert all(len(c["fragments"]) > 1 for c in calls)  # as the model wrote them, not one piece at the end


def test_auto_parses_hermes_calls_whole_and_streamed(client):
    forced = {"structured_outputs": {"regex": re.escape(HERMES_CALL)}}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                       temperature=0.0, extra_body=forced)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})

    calls, finish = streamed_calls(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0.0, extra_body=forced, stream=True))
    assert finish == "tool_calls"
    # The arguments are the model's text, streamed as written: the same as the whole answer's.
    assert [(c["name"], "".join(c["fragments"])) for c in calls] == [("get_weather", call.function.arguments)]
    assert call.function.arguments == '{"city": "Paris"}' and len(calls[0]["fragments"]) > 1
    assert calls[0]["id"].startswith("call_")  # ids are per job: this stream's differs from the call above


def test_tool_choice_none_answers_in_text(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                       max_tokens=8, temperature=0.0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_a_conversation_with_tool_calls_and_results_is_accepted(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=6, temperature=0.0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 0


def test_n_returns_n_choices_in_order(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, max_tokens=5, temperature=0.0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) == 1  # greedy: the same answer three times
    assert r.usage.completion_tokens <= 15
    r = client.completions.create(model=MODEL, prompt=["a b", "c d"], n=2, max_tokens=3, temperature=0.0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text


def test_n_choices_prefill_the_prompt_once(client):
    # A prompt no earlier test sent: the first choice computes it, the other two take its full
    # blocks (16 tokens each, the worker's default) from the prefix cache.
    prompt = " ".join(f"w{uuid.uuid4().hex[:6]}" for _ in range(40))
    r = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=2, temperature=0.0)
    per_choice = r.usage.prompt_tokens // 3
    assert per_choice > 48
    assert r.usage.prompt_tokens_details.cached_tokens == 2 * ((per_choice - 1) // 16 * 16)


def test_a_job_with_forced_tools_records_its_calls(api):
    # Greedy: sampled at the model's default temperature, a random-weight model may keep adding
    # parallel calls to the forced array until max_tokens ends it mid-call ("length"), as any
    # model could; this test is about the job API recording calls, not about one sampled draw.
    body = {"input": {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 150,
                      "temperature": 0.0}}
    r = api.post("/v1/jobs", json=body)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    wait_until(lambda: api.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded", 90, "the job")
    output = api.get(f"/v1/jobs/{job_id}").json()["output"]
    assert output["finish_reason"] == "tool_calls" and output["tool_calls"]
    for call in output["tool_calls"]:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
