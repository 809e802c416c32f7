"""Reasoning parsers: thinking and answer split the same way however the text was cut."""

from __future__ import annotations

import json

import pytest

from ferry.worker.protocol.tools import ChatDelta
from ferry.worker.serve.reasoning_parsers import DeepSeekR1Parser, Qwen3Parser, Reasoning, chained
from ferry.worker.serve.tool_parsers import HermesParser
from tests.serve.test_tool_parsers import merged_calls


def pieces(text: str, cuts: list[int]) -> list[str]:
    edges = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(edges, edges[1:], strict=False)]


def released(parser, text: str, cuts: list[int]) -> list[ChatDelta]:
    return [parser.feed(p) for p in pieces(text, cuts)] + [parser.finish()]


def split(parser, text: str, cuts: list[int]) -> tuple[str, str]:
    """(reasoning, content) released over the whole output."""
    deltas = released(parser, text, cuts)
    reasoning, content = "".join(d.reasoning_content for d in deltas), "".join(d.content for d in deltas)
    assert (parser.reasoning, parser.content) == (reasoning, content)
    return reasoning, content


def every_cut(text: str) -> list[list[int]]:
    """No cut, each single cut, and a cut between every two characters."""
    return [[], *([i] for i in range(1, len(text))), list(range(1, len(text)))]


CASES = [
    # (parser, output, reasoning, content)
    (Qwen3Parser, "<think>\nThe user greets.\n</think>\n\nHello!", "\nThe user greets.\n", "\n\nHello!"),
    (Qwen3Parser, "Hello, <think>no</think> here", "", "Hello, <think>no</think> here"),  # not at the start
    (Qwen3Parser, "<thin", "", "<thin"),  # an output that only looked like it might open a block
    (Qwen3Parser, "<think>a < b and </thin", "a < b and </thin", ""),  # unfinished: all reasoning
    (Qwen3Parser, "<think></think>", "", ""),
    (DeepSeekR1Parser, "Let me think. 2+2=4\n</think>\n\nIt is 4.", "Let me think. 2+2=4\n", "\n\nIt is 4."),
    (DeepSeekR1Parser, "<think>x</think>y</think>", "x", "y</think>"),  # a written <think> is dropped
    (DeepSeekR1Parser, "thinking until the end", "thinking until the end", ""),  # never closed
    (DeepSeekR1Parser, "<thi", "<thi", ""),
]


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_released_parts_do_not_depend_on_the_cuts(parser, text, reasoning, content):
    for cuts in every_cut(text):
        assert split(parser(), text, cuts) == (reasoning, content), cuts


def test_a_possible_tag_is_held_back_until_it_is_told():
    parser = Qwen3Parser()
    assert not parser.feed("<thi")  # may still open a think block
    assert parser.feed("nk>abc</th") == ChatDelta(reasoning_content="abc")  # `</th` may close it
    assert parser.feed("ink>ok") == ChatDelta(content="ok")
    assert DeepSeekR1Parser().feed("a</") == ChatDelta(reasoning_content="a")


def test_a_resumed_parser_fed_the_streamed_text_goes_on_where_it_was():
    text = "<think>plan</think>answer"
    whole = Qwen3Parser()
    first, second = whole.feed(text[:9]), whole.feed(text[9:])
    resumed = Qwen3Parser()
    resumed.feed(text[:9])  # what the client already has
    assert resumed.feed(text[9:]) == second
    assert first.reasoning_content + second.reasoning_content == "plan"


HERMES_AFTER_THINKING = (
    '<think>The weather tool fits.</think>\nChecking. <tool_call>\n{"name": "get_weather", '
    '"arguments": {"city": "Paris"}}\n</tool_call>'
)


def test_chained_with_hermes_the_calls_come_from_the_answer_only():
    for cuts in every_cut(HERMES_AFTER_THINKING):
        reasoning, tools = Qwen3Parser(), HermesParser("job-1")
        deltas = [chained(reasoning.feed(p), tools) for p in pieces(HERMES_AFTER_THINKING, cuts)]
        deltas += [chained(reasoning.finish(), tools), tools.finish()]
        assert "".join(d.reasoning_content for d in deltas) == "The weather tool fits."
        assert "".join(d.content for d in deltas) == "\nChecking." == tools.content
        calls = merged_calls([t.model_dump(exclude_none=True) for d in deltas for t in d.tool_calls])
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_a_tool_call_inside_the_thinking_is_not_a_call():
    reasoning, tools = DeepSeekR1Parser(), HermesParser("job-1")
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call></think>no call'
    deltas = [chained(reasoning.feed(text), tools), chained(reasoning.finish(), tools), tools.finish()]
    assert tools.calls == [] and "".join(d.content for d in deltas) == "no call"


class _Tokenizer:
    """A tokenizer spelling the tags as `vocab` says."""

    def __init__(self, vocab: dict[str, list[int]]) -> None:
        self.vocab = vocab

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.vocab[text]


def test_grammar_kwargs_wait_for_the_end_tokens_and_qwen3_for_an_opened_block():
    tokenizer = _Tokenizer({"<think>": [7, 8], "</think>": [9, 10, 8]})  # no single tag token
    r1 = Reasoning.for_tokenizer("deepseek_r1", tokenizer)
    assert r1.grammar_kwargs() == {"reasoning_end_token_ids": [9, 10, 8]}
    qwen3 = Reasoning.for_tokenizer("qwen3", tokenizer)
    assert qwen3.grammar_kwargs() == {"reasoning_end_token_ids": [9, 10, 8], "reasoning_start_token_id": 7}
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        Reasoning.for_tokenizer("nope", tokenizer)
