"""Tool-call parsers: what they release depends on the text only, never on how it was cut."""

from __future__ import annotations

import json

import pytest

from ferry.worker.protocol.tools import ChatDelta, Tool, forced_tool_schema, tool_call_id
from ferry.worker.serve.tool_parsers import HermesParser, Llama3JsonParser, NamedCall, RequiredCalls

HERMES_OUTPUT = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
)
LLAMA_OUTPUT = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'


def run(parser, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    """Feed `text` cut at `cuts`; (content released, tool-call deltas) in stream order."""
    pieces, last = [], 0
    for cut in [*cuts, len(text)]:
        pieces.append(text[last:cut])
        last = cut
    deltas: list[ChatDelta] = [parser.feed(p) for p in pieces] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    return content, [t.model_dump(exclude_none=True) for d in deltas for t in d.tool_calls]


def merged_calls(deltas: list[dict]) -> list[dict]:
    """The calls a client rebuilds from stream deltas (OpenAI's accumulation rule)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"id": None, "name": "", "arguments": ""})
        call["id"] = d.get("id", call["id"])
        call["name"] += d["function"].get("name") or ""
        call["arguments"] += d["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


CUTS = [[], [1], [5, 13, 14, 40], list(range(1, len(HERMES_OUTPUT)))]


@pytest.mark.parametrize("cuts", CUTS, ids=["whole", "one", "some", "every-char"])
def test_hermes_calls_and_content_do_not_depend_on_the_cuts(cuts):
    parser = HermesParser("job-1")
    content, deltas = run(parser, HERMES_OUTPUT, cuts)
    assert content == "Let me check."
    calls = merged_calls(deltas)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert [c["id"] for c in calls] == [tool_call_id("job-1", 0), tool_call_id("job-1", 1)]
    assert [c.function.name for c in parser.calls] == ["get_weather", "get_time"]


def test_hermes_without_parallel_calls_keeps_the_first_only():
    _, deltas = run(HermesParser("j", parallel=False), HERMES_OUTPUT, [7])
    assert [c["name"] for c in merged_calls(deltas)] == ["get_weather"]


def test_hermes_text_that_only_looks_like_a_call_stays_content():
    text = "a <tool_c> b <tool_call>not json</tool_call> c"
    content, deltas = run(HermesParser("j"), text, [3, 9, 20])
    assert deltas == [] and content == text


@pytest.mark.parametrize("cuts", [[], [2], list(range(1, len(LLAMA_OUTPUT)))], ids=["whole", "one", "every-char"])
def test_llama3_json_calls_separated_by_semicolons(cuts):
    content, deltas = run(Llama3JsonParser("j"), LLAMA_OUTPUT, cuts)
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in merged_calls(deltas)] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_llama3_json_plain_text_and_broken_json_are_content():
    assert run(Llama3JsonParser("j"), "Paris is sunny.", [3]) == ("Paris is sunny.", [])
    assert run(Llama3JsonParser("j"), '{"city": ', [4]) == ('{"city":', [])


def test_a_resumed_parser_fed_the_streamed_text_goes_on_where_the_first_stopped():
    first = HermesParser("j")
    head, tail = HERMES_OUTPUT[:60], HERMES_OUTPUT[60:]
    released_before = [first.feed(head)]
    resumed = HermesParser("j")
    resumed.feed(head)  # what the worker does with the text a re-delivered job already streamed
    after = [resumed.feed(tail), resumed.finish()]
    deltas = [t.model_dump(exclude_none=True) for d in released_before + after for t in d.tool_calls]
    assert [c["name"] for c in merged_calls(deltas)] == ["get_weather", "get_time"]


TOOLS = [Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}),
    Tool.model_validate({"type": "function", "function": {"name": "get_time"}})]


def test_forced_schemas_name_the_tools():
    required = forced_tool_schema(TOOLS, "required", parallel=False)
    assert required["minItems"] == 1 and required["maxItems"] == 1
    assert [c["properties"]["name"]["const"] for c in required["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert forced_tool_schema(TOOLS, "auto", parallel=True) is None


def test_required_and_named_parsers_read_forced_output():
    _, deltas = run(RequiredCalls("j"), '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", '
                                        '"arguments": {"city": "Oslo"}}]', [10, 30])
    assert [c["name"] for c in merged_calls(deltas)] == ["get_time", "get_weather"]
    named = NamedCall("j", "get_weather")
    _, deltas = run(named, '{"city": "Oslo"}', [3])
    assert merged_calls(deltas) == [
        {"id": tool_call_id("j", 0), "name": "get_weather", "arguments": '{"city": "Oslo"}'}]
