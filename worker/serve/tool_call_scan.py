"""One tool call's JSON object, `{"name": ..., "arguments": {...}}` (or `"parameters"`), read a
character at a time, so that its arguments can stream while the model writes them (OpenAI's stream
and vLLM's streaming tool parsers send the arguments' JSON text in fragments).

`CallScan` follows JSON strings (and their escapes) and the depth of braces and brackets, so it
knows where each of the object's own values starts and ends before the object is complete. The
arguments may stream once the name came first, as a complete string, and the arguments value opens
with `{`: `arguments_start` is then that `{` and `arguments_end` the place after its matching `}`.
Any other shape (the arguments before the name, arguments written as a JSON string) is read whole
at the object's end (`call`). Reading goes a character at a time, so what a scan has found after a
text depends on that text only, never on how it was cut into pieces.
"""

from __future__ import annotations

import json

BLANKS = " \t\r\n"  # JSON's whitespace
ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes-style and Llama 3's name for the arguments object


class CallScan:
    """Where one call object's parts are in its text, read so far."""

    def __init__(self) -> None:
        self.text = ""  # what was read: blanks, then the object from its `{` (up to its `}` once ended)
        self.ended = False  # the object's closing `}` was read: later text is not taken
        self.broken = False  # the text cannot be such an object: later text is not taken
        self.name: str | None = None  # the `name` value, once read as a complete string
        self.arguments_start: int | None = None  # in text: the arguments' `{`, when they may stream
        self.arguments_end: int | None = None  # in text: just after the streaming arguments' `}`
        self._spans: dict[str, tuple[int, int]] = {}  # each key of the object -> its value's [start, end)
        self._expect = "open"  # outside nested values: open, first (key or `}`), key, colon, value, scalar, next
        self._depth = 0  # braces and brackets open, the object's own included
        self._string: int | None = None  # in text: where the string being read starts
        self._escape = False  # the last character in that string was a lone backslash
        self._key: str | None = None  # the key whose value is being read
        self._value: int | None = None  # in text: where that value starts
        self._arguments_seen = False  # an arguments value began: streaming is decided

    def feed(self, text: str) -> int:
        """Read `text`; how much of it was taken (all, or up to the object's end or the character
        that broke it)."""
        if self.ended or self.broken:
            return 0
        base = len(self.text)
        self.text += text
        for i in range(base, len(self.text)):
            self._step(i, self.text[i])
            if self.broken:
                self.text = self.text[:i]
                return i - base
            if self.ended:
                self.text = self.text[:i + 1]
                return i + 1 - base
        return len(text)

    def call(self, text: str) -> tuple[str, str] | None:
        """The name and arguments text of the object read, whose whole JSON is `text` (the object,
        blanks around it allowed); None when it is not a call. The arguments are the model's own text:
        the object as written, or the JSON text of arguments written as a string; `{}` if absent."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        key = next((k for k in ARGUMENT_KEYS if k in value), None)
        if key is None:
            return value["name"], "{}"
        arguments = value[key]
        if isinstance(arguments, dict):
            start, end = self._spans[key]
            return value["name"], self.text[start:end]
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                decoded = json.loads(arguments)
            except ValueError:
                return None
            return (value["name"], arguments) if isinstance(decoded, dict) else None
        return None

    def _step(self, i: int, ch: str) -> None:
        if self._string is not None:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                start, self._string = self._string, None
                if self._depth == 1:
                    self._string_ended(start, i + 1)
            return
        if self._depth > 1:  # inside an object or array that is one of the object's values
            if ch == '"':
                self._string = i
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 1:
                    self._value_ended(i + 1)
            return
        if self._expect == "scalar":  # a number, true, false or null ends at a blank, `,` or `}`
            if ch not in BLANKS and ch not in ",}":
                return
            self._value_ended(i)
        if ch not in BLANKS:
            self._syntax(i, ch)

    def _syntax(self, i: int, ch: str) -> None:
        """A character of the object's own syntax (outside its values' insides)."""
        expect = self._expect
        if expect == "open" and ch == "{":
            self._depth, self._expect = 1, "first"
        elif expect in ("first", "key") and ch == '"':
            self._string = i
        elif (expect == "first" or expect == "next") and ch == "}":
            self._depth, self.ended = 0, True
        elif expect == "colon" and ch == ":":
            self._expect = "value"
        elif expect == "next" and ch == ",":
            self._expect = "key"
        elif expect == "value":
            self._value = i
            self._value_began(i, ch)
            if ch == '"':
                self._string = i
            elif ch in "{[":
                self._depth = 2
            else:
                self._expect = "scalar"
        else:
            self.broken = True

    def _value_began(self, i: int, ch: str) -> None:
        if self._key in ARGUMENT_KEYS and not self._arguments_seen:
            self._arguments_seen = True
            if ch == "{" and self.name is not None:
                self.arguments_start = i

    def _string_ended(self, start: int, end: int) -> None:
        if self._expect == "value":
            self._value_ended(end)
            return
        try:
            self._key = json.loads(self.text[start:end])
        except ValueError:  # a bad escape
            self.broken = True
        self._expect = "colon"

    def _value_ended(self, end: int) -> None:
        start = self._value
        self._spans[self._key] = (start, end)
        if self._key == "name" and self.name is None and self.text[start] == '"':
            try:
                self.name = json.loads(self.text[start:end])
            except ValueError:
                self.name = None
        if start == self.arguments_start:
            self.arguments_end = end
        self._key, self._value, self._expect = None, None, "next"
