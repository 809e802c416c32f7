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
longer mistake for the start of a call, and tool-call pieces. What it has released after a text
depends on that text only, never on how it was cut into pieces: a resumed job's parser is fed the
text already streamed and goes on from there.

Arguments stream as OpenAI's do: a call's first delta (its index, id and name) goes out once its
object has shown the name and the `{` that opens its arguments (`worker.serve.tool_call_scan`), and
then the arguments' JSON text in fragments, as the model writes it. A call's `arguments` (in
`calls`, the job's result) is exactly the model's text of that value, the concatenation of its
fragments. A call written otherwise (the arguments before the name, or as a JSON string) goes out
whole once its object is complete. Once its first delta is out a call stands, as with vLLM's
parsers: if its text then turns out not to be a valid call (a `</tool_call>` before its JSON
closed, a broken object), or the output ends inside it (max_tokens), its arguments are the text
streamed so far and the rest of its object is dropped. A call with nothing released yet that is not
a valid call is content, as it was written.
"""

from __future__ import annotations

import json

from ferry.worker.protocol.tools import (
    ChatDelta,
    FunctionCall,
    FunctionCallDelta,
    Tool,
    ToolCall,
    ToolCallDelta,
    tool_call_id,
)
from ferry.worker.serve.tool_call_scan import BLANKS, CallScan


class ToolCallParser:
    """Base: holds the calls found so far, reads the call object being written (`_read_call`), and
    turns calls into their stream deltas."""

    def __init__(self, job_id: str, parallel: bool = True) -> None:
        self.job_id = job_id
        self.parallel = parallel  # False: calls after the first are dropped
        self.calls: list[ToolCall] = []
        self.content = ""  # all content released so far
        self._scan: CallScan | None = None  # the call object being read
        self._index: int | None = None  # its place in `calls`, once its first delta is out
        self._sent: int | None = None  # in its scan's text: where its arguments not yet released start

    def feed(self, text: str) -> ChatDelta:
        raise NotImplementedError

    def finish(self) -> ChatDelta:
        """The output ended: release what was held back."""
        raise NotImplementedError

    def _open_call(self, name: str) -> int | None:
        """A new call's index, or None when it is dropped (a second call without parallel calls)."""
        if self.calls and not self.parallel:
            return None
        self.calls.append(ToolCall(id=tool_call_id(self.job_id, len(self.calls)),
                                   function=FunctionCall(name=name, arguments="")))
        return len(self.calls) - 1

    def _first_delta(self, index: int) -> ToolCallDelta:
        call = self.calls[index]
        return ToolCallDelta(index=index, id=call.id, type="function",
                             function=FunctionCallDelta(name=call.function.name))

    def _arguments(self, index: int, text: str) -> ToolCallDelta:
        self.calls[index].function.arguments += text
        return ToolCallDelta(index=index, function=FunctionCallDelta(arguments=text))

    def _read_call(self, text: str) -> tuple[list[ToolCallDelta], int]:
        """Read `text` into the open call object (`_scan`): the deltas it releases (the call's first
        once its arguments open after its name, then their text), and how much of `text` it took
        (all, or up to the object's end)."""
        scan = self._scan
        taken = scan.feed(text)
        deltas: list[ToolCallDelta] = []
        if self._sent is None and scan.arguments_start is not None:
            self._sent = scan.arguments_start
            self._index = self._open_call(scan.name)
            if self._index is not None:
                deltas.append(self._first_delta(self._index))
        if self._index is not None:
            end = scan.arguments_end if scan.arguments_end is not None else len(scan.text)
            if end > self._sent:
                deltas.append(self._arguments(self._index, scan.text[self._sent:end]))
                self._sent = end
        return deltas, taken

    def _end_call(self, text: str) -> list[ToolCallDelta] | None:
        """The open call object's end (or the output's), its JSON `text`: [] when the call streamed
        (it stands) or is dropped, all its deltas when it is read whole, None when it is no call."""
        scan, streamed = self._scan, self._index is not None
        self._scan, self._index, self._sent = None, None, None
        if streamed:
            return []
        call = scan.call(text)
        if call is None:
            return None
        index = self._open_call(call[0])
        return [] if index is None else [self._first_delta(index), self._arguments(index, call[1])]

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
        self._pending = ""  # text not yet read: a possible tag start, blanks, or an open call's `</tool_call>`
        self._gap = ""  # blanks before an open call: dropped if it is a call, content if it is not
        self._body = ""  # the open call's text read so far (`_scan` is not None inside a call)

    def feed(self, text: str) -> ChatDelta:
        self._pending += text
        out = ChatDelta()
        while True:
            if self._scan is not None:
                end = self._pending.find(self.CLOSE)
                if end < 0:  # read all but a possible start of the closing tag
                    cut = len(self._pending) - partial_tag(self._pending, self.CLOSE)
                    self._read_body(self._pending[:cut], out)
                    self._pending = self._pending[cut:]
                    return out
                self._read_body(self._pending[:end], out)
                self._pending = self._pending[end + len(self.CLOSE):]
                self._close_call(out, self.CLOSE)
                continue
            start = self._pending.find(self.OPEN)
            if start >= 0:
                before = self._pending[:start]
                self._release(out, before.rstrip())  # blanks before a call are not content
                self._gap = before[len(before.rstrip()):]
                self._pending = self._pending[start + len(self.OPEN):]
                self._scan = CallScan()
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
        if self._scan is not None:  # the output ended inside a call (its closing tag never came)
            self._read_body(self._pending, out)
            self._close_call(out, "")
        elif not self.calls:
            self._release(out, self._pending.rstrip())
        self._pending = ""
        return out

    def _read_body(self, text: str, out: ChatDelta) -> None:
        self._body += text
        out.tool_calls += self._read_call(text)[0]

    def _close_call(self, out: ChatDelta, close: str) -> None:
        deltas = self._end_call(self._body)
        if deltas is None:  # not a call after all: it was content, as written
            self._release(out, self._gap + self.OPEN + self._body + close)
        else:
            out.tool_calls += deltas
        self._gap, self._body = "", ""

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


class _CallSequence(ToolCallParser):
    """Call objects one after another from `_pos` on, with blanks and `SEPARATOR` between them:
    each streams as it is read; anything else ends the reading (what follows is not read)."""

    SEPARATOR = ""

    def __init__(self, job_id: str, parallel: bool = True) -> None:
        super().__init__(job_id, parallel)
        self._text = ""  # everything fed
        self._pos: int | None = None  # where reading goes on in _text; None until the calls begin
        self._stopped = False  # a text that is not a call came: nothing after it is read

    def _read_calls(self) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        while not self._stopped:
            if self._scan is None:
                rest = self._text[self._pos:]
                self._pos += len(rest) - len(rest.lstrip(BLANKS + self.SEPARATOR))
                if self._pos == len(self._text):
                    return deltas
                if self._text[self._pos] != "{":
                    self._stopped = True
                    return deltas
                self._scan = CallScan()
            scan = self._scan
            new, taken = self._read_call(self._text[self._pos:])
            deltas += new
            self._pos += taken
            if not (scan.ended or scan.broken):
                return deltas  # the object goes on in the next piece
            call = self._end_call(scan.text)
            deltas += call or []
            self._stopped = call is None or scan.broken
        return deltas


class Llama3JsonParser(_CallSequence):
    PYTHON_TAG = "<|python_tag|>"
    SEPARATOR = ";"

    def __init__(self, job_id: str, parallel: bool = True) -> None:
        super().__init__(job_id, parallel)
        self._mode: str | None = None  # None until the first non-blank text: "calls" or "content"

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
        return ChatDelta(tool_calls=self._read_calls())

    def finish(self) -> ChatDelta:
        if self._mode == "calls":
            head = self._text.lstrip().removeprefix(self.PYTHON_TAG)
            if not self.calls and head.strip(BLANKS + self.SEPARATOR):  # never a call: all content
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


class RequiredCalls(_CallSequence):
    """A grammar-forced JSON array of `{"name", "arguments"}` calls, each streamed as it is written."""

    SEPARATOR = ","

    def feed(self, text: str) -> ChatDelta:
        self._text += text
        if self._pos is None:
            start = self._text.find("[")
            if start < 0:
                return ChatDelta()
            self._pos = start + 1
        return ChatDelta(tool_calls=self._read_calls())

    def finish(self) -> ChatDelta:
        return ChatDelta()


class NamedCall(ToolCallParser):
    """A grammar-forced arguments object of the one named function: its first delta goes out at
    once, then every piece of text is its arguments."""

    def __init__(self, job_id: str, name: str) -> None:
        super().__init__(job_id, parallel=False)
        self._name = name

    def feed(self, text: str) -> ChatDelta:
        out = ChatDelta()
        if not self.calls:
            out.tool_calls.append(self._first_delta(self._open_call(self._name)))
        if text:
            out.tool_calls.append(self._arguments(0, text))
        return out

    def finish(self) -> ChatDelta:
        return ChatDelta()


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
DEFAULT_PARSER = "hermes"
