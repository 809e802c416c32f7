"""A chat's thinking out of its text, as it streams: one parser per output format, named like
vLLM's `--reasoning-parser` (the worker's `FERRY_REASONING_PARSER`).

- `qwen3`: the output reasons only when it starts with `<think>`: the text up to `</think>` is
  reasoning, the rest content. An output that does not start with it is all content (Qwen3 with
  `enable_thinking: false`, whose template puts an empty think block into the prompt).
- `deepseek_r1`: the output is reasoning from its start until `</think>` (R1 distills' templates
  open the block in the prompt); a leading `<think>`, if the model writes one, is dropped. An
  output that never closes the block was all reasoning.

A parser is fed text pieces and returns what may be released (`ChatDelta`: content and
reasoning_content); a possible tag's start is held back. What it has released after a text depends
on that text only, never on how it was cut into pieces (a resumed job's parser is fed the text
already streamed). When the chat may call tools, the content goes on into the tool-call parser
(`chained`).

The structured-output grammar of such a chat applies to the answer only: `Reasoning.grammar_kwargs`
are the engine's `SamplingParams` fields that make it wait for the model's `</think>` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferry.worker.protocol.tools import ChatDelta
from ferry.worker.serve.tool_parsers import ToolCallParser, partial_tag

OPEN, CLOSE = "<think>", "</think>"


class ReasoningParser:
    """Base: `<think>...</think>` at the output's start is reasoning, the rest content."""

    # True: the output is reasoning from its start even without `<think>`; False: only after it.
    THINKS_FROM_START = False

    def __init__(self) -> None:
        self.reasoning = ""  # all reasoning released so far
        self.content = ""  # all content released so far
        self._pending = ""  # text not released yet: the output's start, or a possible `</think>`
        self._state = "head"  # "head" (until the output's start tells), "reasoning", "content"

    def feed(self, text: str) -> ChatDelta:
        self._pending += text
        if self._state == "head":
            if OPEN.startswith(self._pending) and self._pending != OPEN:
                return ChatDelta()  # may still become `<think>`
            self._decide()
        if self._state == "reasoning":
            end = self._pending.find(CLOSE)
            if end < 0:
                cut = len(self._pending) - partial_tag(self._pending, CLOSE)
                reasoning, self._pending = self._pending[:cut], self._pending[cut:]
                return self._release(reasoning, "")
            reasoning, self._pending = self._pending[:end], self._pending[end + len(CLOSE):]
            self._state = "content"
            return self._release(reasoning, self._take())
        return self._release("", self._take())

    def finish(self) -> ChatDelta:
        """The output ended: release what was held back (an unfinished think block is reasoning)."""
        if self._state == "head":
            self._decide()
        rest = self._take()
        return self._release(rest, "") if self._state == "reasoning" else self._release("", rest)

    def _decide(self) -> None:
        opened = self._pending.startswith(OPEN)
        if opened:
            self._pending = self._pending[len(OPEN):]
        self._state = "reasoning" if opened or self.THINKS_FROM_START else "content"

    def _take(self) -> str:
        text, self._pending = self._pending, ""
        return text

    def _release(self, reasoning: str, content: str) -> ChatDelta:
        self.reasoning += reasoning
        self.content += content
        return ChatDelta(content=content, reasoning_content=reasoning)


class Qwen3Parser(ReasoningParser):
    THINKS_FROM_START = False


class DeepSeekR1Parser(ReasoningParser):
    THINKS_FROM_START = True


PARSERS: dict[str, type[ReasoningParser]] = {"qwen3": Qwen3Parser, "deepseek_r1": DeepSeekR1Parser}


def chained(part: ChatDelta, tools: ToolCallParser | None) -> ChatDelta:
    """A reasoning parser's delta with its content read by the tool-call parser (when the chat may
    call tools): the content part then holds what is not a call."""
    if tools is None or not part.content:
        return part
    delta = tools.feed(part.content)
    delta.reasoning_content = part.reasoning_content
    return delta


@dataclass(frozen=True, slots=True)
class Reasoning:
    """A worker's reasoning parser and its model's think tags as token ids (found at start)."""

    parser: str  # a PARSERS name
    end_token_ids: list[int]  # `</think>` in the model's tokenizer (one added token, or a few)
    start_token_id: int  # the first token of `<think>`

    @classmethod
    def for_tokenizer(cls, parser: str, tokenizer) -> Reasoning:
        """ValueError when the tokenizer cannot spell the tags (or the parser is unknown)."""
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; known: {', '.join(PARSERS)}")
        if tokenizer is None:
            raise ValueError("a reasoning parser needs a model with a tokenizer")
        end = tokenizer.encode(CLOSE, add_special_tokens=False)
        start = tokenizer.encode(OPEN, add_special_tokens=False)
        if not end or not start:
            raise ValueError("the model's tokenizer cannot spell <think> and </think>")
        return cls(parser, list(end), start[0])

    def new_parser(self) -> ReasoningParser:
        return PARSERS[self.parser]()

    def grammar_kwargs(self) -> dict:
        """The engine's SamplingParams fields that keep a grammar off the thinking: it starts once
        the output has generated `</think>`; with `qwen3` only an output whose first token opens a
        think block waits for it (any other is the answer from its first token)."""
        kwargs: dict = {"reasoning_end_token_ids": self.end_token_ids}
        if not PARSERS[self.parser].THINKS_FROM_START:
            kwargs["reasoning_start_token_id"] = self.start_token_id
        return kwargs
