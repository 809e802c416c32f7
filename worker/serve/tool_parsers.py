"""Tool calls out of a model's text, as it streams: one parser per output format, named like vLLM's
`--tool-call-parser` (the worker's `FERRY_TOOL_CALL_PARSER`).

- `hermes`: calls inside `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` tags, text
  around them is content (Hermes, Qwen 2.5/3, SmolLM-style templates).
- `llama3_json`: an output that starts with `{` (or `<|python_tag|>`) is one or more
  `{"name": ..., "parameters": {...}}` objects separated by `;`; any other output is content.

Two more read the output a grammar forced (`tool_choice` required or a named function, see
`worker.protocol.tools.forced_tool_schema`): `RequiredCalls` (a JSON array of calls) and
`NamedCall` (the arguments object of one known function).

A parser is fed text pieces and returns what may be released (`ChatDelta`): content it can no
longer mistake for the start of a call, and each call once its JSON is complete (its id and name,
then its arguments). What it has released after a text depends on that text only, never on how it
was cut into pieces: a resumed job's parser is fed the text already streamed and goes on from there.
"""

from __future__ import annotations

import json
from typing import Any

from ferry.worker.protocol.tools import (
    ChatDelta,
    FunctionCall,
    FunctionCallDelta,
    Tool,
    ToolCall,
    ToolCallDelta,
    tool_call_id,
)

_DECODER = json.JSONDecoder()


class ToolCallParser:
    """Base: holds the calls found so far and turns each new one into its stream deltas."""

    def __init__(self, job_id: str, parallel: bool = True) -> None:
        self.job_id = job_id
        self.parallel = parallel  # False: calls after the first are dropped
        self.calls: list[ToolCall] = []
        self.content = ""  # all content released so far

    def feed(self, text: str) -> ChatDelta:
        raise NotImplementedError

    def finish(self) -> ChatDelta:
        """The output ended: release what was held back."""
        raise NotImplementedError

    def _call(self, name: str, arguments: str) -> list[ToolCallDelta]:
        if self.calls and not self.parallel:
            return []
        index = len(self.calls)
        call = ToolCall(id=tool_call_id(self.job_id, index), function=FunctionCall(name=name, arguments=arguments))
        self.calls.append(call)
        return [
            ToolCallDelta(index=index, id=call.id, type="function", function=FunctionCallDelta(name=name)),
            ToolCallDelta(index=index, function=FunctionCallDelta(arguments=arguments)),
        ]

    def _call_from_json(self, value: Any) -> list[ToolCallDelta] | None:
        """Deltas of a decoded `{"name", "arguments" | "parameters"}` object; None if it is not one."""
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return self._call(value["name"], json.dumps(arguments, ensure_ascii=False))

    def _content(self, text: str) -> ChatDelta:
        self.content += text
        return ChatDelta(content=text)

    # --- prompts for chat templates that do not know tools --------------------------------------

    @staticmethod
    def system_prompt(tools: list[Tool]) -> str:
        """Instructions that describe `tools` and this parser's call format."""
        raise NotImplementedError

    @staticmethod
    def render_calls(calls: list[ToolCall]) -> str:
        """An earlier assistant turn's calls, written the way this parser reads them."""
        raise NotImplementedError


def _tools_json(tools: list[Tool]) -> str:
    return "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: the tag may follow)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesParser(ToolCallParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, job_id: str, parallel: bool = True) -> None:
        super().__init__(job_id, parallel)
        self._pending = ""  # text not yet released: a possible tag start, blanks, or an open call's body
        self._in_call = False
        self._gap = ""  # blanks before an open call: dropped if it is a call, content if it is not

    def feed(self, text: str) -> ChatDelta:
        self._pending += text
        out = ChatDelta()
        while True:
            if self._in_call:
                end = self._pending.find(self.CLOSE)
                if end < 0:
                    return out
                body, self._pending = self._pending[:end], self._pending[end + len(self.CLOSE):]
                self._in_call = False
                self._end_call(body, out)
                continue
            start = self._pending.find(self.OPEN)
            if start >= 0:
                before = self._pending[:start]
                self._release(out, before.rstrip())  # blanks before a call are not content
                self._gap = before[len(before.rstrip()):]
                self._pending = self._pending[start + len(self.OPEN):]
                self._in_call = True
                continue
            # Release up to the last non-blank character that cannot begin a tag.
            held = partial_tag(self._pending, self.OPEN)
            safe = self._pending[: len(self._pending) - held]
            keep_from = len(safe.rstrip())
            self._release(out, self._pending[:keep_from])
            self._pending = self._pending[keep_from:]
            return out

    def finish(self) -> ChatDelta:
        out = ChatDelta()
        if self._in_call:  # the output ended inside a call (its closing tag never came)
            self._end_call(self._pending, out)
        elif not self.calls:
            self._release(out, self._pending.rstrip())
        self._pending, self._in_call = "", False
        return out

    def _end_call(self, body: str, out: ChatDelta) -> None:
        try:
            deltas = self._call_from_json(json.loads(body))
        except ValueError:
            deltas = None
        if deltas is None:  # not a call after all: it was content
            self._release(out, self._gap + self.OPEN + body + self.CLOSE)
        else:
            out.tool_calls += deltas
        self._gap = ""

    def _release(self, out: ChatDelta, text: str) -> None:
        if text:
            out.content += self._content(text).content

    @staticmethod
    def system_prompt(tools: list[Tool]) -> str:
        return (
            "You can call functions. They are described, one JSON object per line, between <tools> and "
            f"</tools>:\n<tools>\n{_tools_json(tools)}\n</tools>\n"
            "To call one, answer with a JSON object holding its name and its arguments, between "
            '<tool_call> and </tool_call>:\n<tool_call>\n{"name": "function name", "arguments": {...}}\n</tool_call>'
        )

    @staticmethod
    def render_calls(calls: list[ToolCall]) -> str:
        return "\n".join(
            "<tool_call>\n"
            + json.dumps({"name": c.function.name, "arguments": c.for_template()["function"]["arguments"]})
            + "\n</tool_call>"
            for c in calls
        )


class Llama3JsonParser(ToolCallParser):
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, job_id: str, parallel: bool = True) -> None:
        super().__init__(job_id, parallel)
        self._text = ""  # everything fed
        self._mode: str | None = None  # None until the first non-blank text: "calls" or "content"
        self._pos = 0  # in calls mode: where the next call starts in _text

    def feed(self, text: str) -> ChatDelta:
        self._text += text
        if self._mode is None:
            head = self._text.lstrip()
            if not head or (self.PYTHON_TAG.startswith(head) and head != self.PYTHON_TAG):
                return ChatDelta()  # still undecided
            self._mode = "calls" if head.startswith(("{", self.PYTHON_TAG)) else "content"
            if self._mode == "calls":
                self._pos = len(self._text) - len(head)
                if head.startswith(self.PYTHON_TAG):
                    self._pos += len(self.PYTHON_TAG)
            else:
                return self._content(self._text)
        if self._mode == "content":
            return self._content(text)
        return ChatDelta(tool_calls=self._complete_calls())

    def _complete_calls(self) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        while True:
            rest = self._text[self._pos:]
            skipped = len(rest) - len(rest.lstrip(" \t\r\n;"))
            try:
                value, end = _DECODER.raw_decode(rest, skipped)
            except ValueError:
                return deltas  # incomplete (or not JSON: decided at the end)
            call = self._call_from_json(value)
            if call is None:
                return deltas
            deltas += call
            self._pos += end

    def finish(self) -> ChatDelta:
        if self._mode == "calls":
            rest = self._text[self._pos:].strip(" \t\r\n;")
            if rest and not self.calls:  # never a call: the whole output was content
                self._mode = "content"
                return self._content(self._text.strip())
            return ChatDelta()
        if self._mode is None and self._text.strip():
            return self._content(self._text.strip())
        return ChatDelta()

    @staticmethod
    def system_prompt(tools: list[Tool]) -> str:
        return (
            "You can call functions. They are described, one JSON object per line:\n"
            f"{_tools_json(tools)}\n"
            "To call one, answer only with a JSON object holding its name and its arguments: "
            '{"name": "function name", "parameters": {...}}. Separate several calls with "; ".'
        )

    @staticmethod
    def render_calls(calls: list[ToolCall]) -> str:
        return "; ".join(
            json.dumps({"name": c.function.name, "parameters": c.for_template()["function"]["arguments"]})
            for c in calls
        )


class RequiredCalls(ToolCallParser):
    """A grammar-forced JSON array of `{"name", "arguments"}` calls; each released once complete."""

    def __init__(self, job_id: str, parallel: bool = True) -> None:
        super().__init__(job_id, parallel)
        self._text = ""
        self._pos: int | None = None  # after '[' : where the next element starts

    def feed(self, text: str) -> ChatDelta:
        self._text += text
        if self._pos is None:
            start = self._text.find("[")
            if start < 0:
                return ChatDelta()
            self._pos = start + 1
        deltas: list[ToolCallDelta] = []
        while True:
            rest = self._text[self._pos:]
            skipped = len(rest) - len(rest.lstrip(" \t\r\n,"))
            try:
                value, end = _DECODER.raw_decode(rest, skipped)
            except ValueError:
                return ChatDelta(tool_calls=deltas)
            deltas += self._call_from_json(value) or []
            self._pos += end

    def finish(self) -> ChatDelta:
        return ChatDelta()


class NamedCall(ToolCallParser):
    """A grammar-forced arguments object of the one named function: streamed as it comes."""

    def __init__(self, job_id: str, name: str) -> None:
        super().__init__(job_id, parallel=False)
        self._name = name
        self._arguments = ""

    def feed(self, text: str) -> ChatDelta:
        out = ChatDelta()
        if not self.calls:
            call = ToolCall(id=tool_call_id(self.job_id, 0), function=FunctionCall(name=self._name, arguments=""))
            self.calls.append(call)
            out.tool_calls.append(ToolCallDelta(index=0, id=call.id, type="function",
                                                function=FunctionCallDelta(name=self._name)))
        if text:
            self._arguments += text
            self.calls[0].function.arguments = self._arguments
            out.tool_calls.append(ToolCallDelta(index=0, function=FunctionCallDelta(arguments=text)))
        return out

    def finish(self) -> ChatDelta:
        return ChatDelta()


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
DEFAULT_PARSER = "hermes"
