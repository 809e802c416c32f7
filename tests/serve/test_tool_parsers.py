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


def run(parser, text: str, cuts: list[int], finish: bool = True) -> tuple[str, list[dict]]:
    """Feed `text` cut at `cuts` (then end the output, unless `finish` is False); (content released,
    tool-call deltas) in stream order."""
    pieces, last = [], 0
    for cut in [*cuts, len(text)]:
        pieces.append(text[last:cut])
        last = cut
    deltas: list[ChatDelta] = [parser.feed(p) for p in pieces] + ([parser.finish()] if finish else [])
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


# --- arguments streamed as fragments of the model's JSON text -----------------------------------

# Arguments with what a scan must not be fooled by: braces and quotes inside strings, escapes, nesting,
# blanks and non-ASCII text (kept as written: the arguments are the model's own text of the value).
TRICKY = '{"q": "a \\"}\\" {[ \\\\", "n": [1, {"m": null}],  "city": "Zürich"}'
PARSED_OUTPUTS = {
    "hermes": (lambda: HermesParser("j"), f'Sure. <tool_call>\n{{"name": "search", "arguments": {TRICKY}}}\n'
                                          '</tool_call> <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'),
    "hermes-parameters": (lambda: HermesParser("j"), f'<tool_call>{{"name": "search", "parameters": {TRICKY}}}'
                                                     '</tool_call>'),
    "llama3_json": (lambda: Llama3JsonParser("j"), f'<|python_tag|>{{"name": "search", "parameters": {TRICKY}}}; '
                                                   '{"name": "get_time", "parameters": {}}'),
    "required": (lambda: RequiredCalls("j"), f'[{{"name": "search", "arguments": {TRICKY}}}, '
                                             '{"name": "get_time", "arguments": {}}]'),
    "named": (lambda: NamedCall("j", "search"), TRICKY),
}


def released(make, text: str, cuts: list[int], finish: bool = True) -> tuple[str, list[dict]]:
    """What a new parser releases for `text` cut at `cuts`: content, and the calls a client rebuilds;
    each call's joined fragments are exactly its `arguments` in the parser's calls."""
    parser = make()
    content, deltas = run(parser, text, cuts, finish)
    calls = merged_calls(deltas)
    assert [c["arguments"] for c in calls] == [c.function.arguments for c in parser.calls]
    return content, calls


@pytest.mark.parametrize("kind", PARSED_OUTPUTS)
def test_arguments_are_the_models_text_of_the_value_joined_from_fragments(kind):
    make, text = PARSED_OUTPUTS[kind]
    _, calls = released(make, text, list(range(1, len(text))))
    assert calls[0]["name"] == "search" and calls[0]["arguments"] == TRICKY
    assert [c["arguments"] for c in calls[1:]] == ["{}"] * (len(calls) - 1)


@pytest.mark.parametrize("kind", PARSED_OUTPUTS)
def test_every_split_of_the_text_releases_the_same(kind):
    make, text = PARSED_OUTPUTS[kind]
    whole = released(make, text, [])
    for cut in range(1, len(text)):
        assert released(make, text, [cut]) == whole, cut
        # The state after a prefix does not depend on its pieces either (a resumed job's parser).
        assert released(make, text[:cut], [], finish=False) == released(make, text[:cut], list(range(1, cut)),
                                                                       finish=False), cut


@pytest.mark.parametrize("kind", PARSED_OUTPUTS)
def test_fragments_go_out_while_the_model_writes_the_arguments(kind):
    make, text = PARSED_OUTPUTS[kind]
    start = text.index(TRICKY)
    for written in (1, 10, len(TRICKY) - 1):  # the `{`, a few characters, all but the closing `}`
        _, calls = released(make, text[:start + written], [start, start + written // 2], finish=False)
        assert calls[0]["name"] == "search" and calls[0]["id"] == tool_call_id("j", 0)
        assert calls[0]["arguments"] == TRICKY[:written]


def test_a_streamed_call_starts_once_its_name_and_the_arguments_brace_are_written():
    text = '<tool_call>{"name": "search", "arguments": {"q": 1}}</tool_call>'
    assert released(lambda: HermesParser("j"), text[:text.index('{"q"')], [], finish=False) == ("", [])
    _, calls = released(lambda: HermesParser("j"), text[:text.index('{"q"') + 1], [], finish=False)
    assert calls == [{"id": tool_call_id("j", 0), "name": "search", "arguments": "{"}]


def test_a_possible_closing_tag_inside_the_arguments_is_held_back():
    text = '<tool_call>{"name": "f", "arguments": {"html": "</b>"}}</tool_call>'
    _, calls = released(lambda: HermesParser("j"), text[:text.index("</b>") + 2], [], finish=False)
    assert calls[0]["arguments"] == '{"html": "'  # `</` may begin `</tool_call>`
    assert released(lambda: HermesParser("j"), text, [])[1][0]["arguments"] == '{"html": "</b>"}'


@pytest.mark.parametrize("body", ['{"arguments": {"q": 1}, "name": "f"}', '{"name": "f", "arguments": "{\\"q\\": 1}"}'],
                         ids=["arguments-first", "arguments-as-a-string"])
def test_a_call_not_written_name_then_arguments_object_goes_out_whole_at_its_end(body):
    text = f"<tool_call>{body}</tool_call>"
    assert released(lambda: HermesParser("j"), text[:-1], [], finish=False) == ("", [])
    assert released(lambda: HermesParser("j"), text, [5, 30]) == (
        "", [{"id": tool_call_id("j", 0), "name": "f", "arguments": '{"q": 1}'}])


def test_a_streamed_call_whose_text_breaks_stands_as_streamed_and_its_rest_is_dropped():
    # `</tool_call>` before the arguments' JSON closed: the client has the call's start already.
    content, calls = released(lambda: HermesParser("j"), 'A <tool_call>{"name": "f", "arguments": {"q": 1'
                                                         '</tool_call> B', [20])
    assert (content, calls) == ("A B", [{"id": tool_call_id("j", 0), "name": "f", "arguments": '{"q": 1'}])
    content, calls = released(lambda: HermesParser("j"), '<tool_call>{"name": "f", "arguments": {}} x</tool_call>',
                              [])
    assert (content, [c["arguments"] for c in calls]) == ("", ["{}"])


def test_a_call_with_nothing_released_that_is_not_a_call_stays_content():
    for text in ['<tool_call>{"arguments": {}, "name": 3}</tool_call>', '<tool_call>{"name": "f"} x</tool_call>']:
        assert released(lambda: HermesParser("j"), text, [9]) == (text, [])
    # The output ended inside it: content as written (no closing tag added).
    assert released(lambda: HermesParser("j"), 'a <tool_call>{"nam', [4]) == ('a <tool_call>{"nam', [])


@pytest.mark.parametrize("kind", ["hermes", "llama3_json", "required"])
def test_a_call_cut_by_max_tokens_mid_arguments_keeps_its_fragments(kind):
    make, text = PARSED_OUTPUTS[kind]
    cut = text.index(TRICKY) + 12
    content, calls = released(make, text[:cut], [cut - 3])
    assert content == ("Sure." if kind == "hermes" else "")
    assert calls == [{"id": tool_call_id("j", 0), "name": "search", "arguments": TRICKY[:12]}]


@pytest.mark.parametrize("make", [lambda: HermesParser("j", parallel=False), lambda: RequiredCalls("j", False),
                                  lambda: Llama3JsonParser("j", parallel=False)], ids=["hermes", "required", "llama"])
def test_without_parallel_calls_a_second_streamed_call_is_dropped(make):
    text = {HermesParser: PARSED_OUTPUTS["hermes"][1], RequiredCalls: PARSED_OUTPUTS["required"][1],
            Llama3JsonParser: PARSED_OUTPUTS["llama3_json"][1]}[type(make())]
    _, calls = released(make, text, list(range(1, len(text))))
    assert [(c["name"], c["arguments"]) for c in calls] == [("search", TRICKY)]
