"""Regular expressions, a `regex` spec's and a schema's `pattern`: `check_regex` refuses what the
grammar compiler does not have and a regex that unrolls past the budget; `grammar_regex` writes
a checked regex anew from its parse, so that xgrammar reads it as the same language or less of it.
"""

from __future__ import annotations

import re
import re._constants as sre
import re._parser as sre_parse

from ferry.worker.protocol.structured.limits import MAX_REGEX_SIZE, MAX_SPEC_CHARS, SpecError, too_big

# Constructs of Python's regexes that the grammar compiler does not have.
_REGEX_REFUSED = {
    sre.ASSERT: "a lookaround", sre.ASSERT_NOT: "a lookaround", sre.GROUPREF: "a backreference",
    sre.GROUPREF_EXISTS: "a conditional group", sre.ATOMIC_GROUP: "an atomic group",
    sre.POSSESSIVE_REPEAT: "a possessive repeat",
}
_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT)
_ANCHORS = (sre.AT_BEGINNING, sre.AT_END, sre.AT_BEGINNING_STRING, sre.AT_END_STRING)  # the others: \\b, \\B


def grammar_regex(pattern: str, what: str, json_string: bool = True) -> str:
    """A regex as the compiler gets it (checked by `check_regex`): the same language or less of
    it, spelt so that xgrammar 0.2.9 reads it right. Its JSON-string regexes (a schema's
    `pattern`) lose the first item of a group under `?` when the group ends in a variable repeat
    (`^a(x[0-9]{1,3})?$` accepted "a1"; `^\\d+(\\.\\d{1,2})?$`, a price, accepted "1234"), where
    `{0,1}` reads right, and mishandle some classes (`_UTF8_SPANS`); its plain regexes let `.` and
    negated classes take surrogates, and `.` a newline. So the regex is written anew from its
    parse, `?` as `{0,1}` and every class as ranges. `json_string`: the text goes into a JSON
    string (a schema's `pattern`), not the whole output (`regex`)."""
    parsed = check_regex(pattern, what)
    try:
        return _RegexWriter(json_string).text(parsed)
    except SpecError as exc:
        raise SpecError(f"{what}: {exc}") from None


def check_regex(pattern: str, what: str) -> list:
    """The parsed regex; SpecError if `pattern` does not compile as a regex, uses what the grammar
    compiler does not have (lookarounds, backreferences, word boundaries, inline flags, named
    groups), or unrolls to more than `MAX_REGEX_SIZE` characters (SpecTooComplexError)."""
    if len(pattern) > MAX_SPEC_CHARS:
        raise too_big(f"{what}: {len(pattern)} characters", MAX_SPEC_CHARS)
    try:
        parsed = sre_parse.parse(pattern)
    except re.error as exc:
        raise SpecError(f"{what} is not a valid regular expression: {exc}") from None
    if parsed.state.flags & ~(re.UNICODE | re.NOFLAG) or parsed.state.groupdict:
        raise SpecError(f"{what}: inline flags and named groups are not supported")
    size = _regex_size(parsed, what)
    if size > MAX_REGEX_SIZE:
        raise too_big(f"{what} unrolls to {size} characters", MAX_REGEX_SIZE)
    return list(parsed)


def _regex_size(items, what: str) -> int:
    """How many characters the regex spells out at most once its repetitions are unrolled (an
    unbounded repeat counts its minimum, at least once)."""
    size = 0
    for op, arg in items:
        if op in _REGEX_REFUSED:
            raise SpecError(f"{what}: {_REGEX_REFUSED[op]} is not supported")
        if op in _REPEATS:
            low, high, sub = arg
            size += (max(low, 1) if high == sre.MAXREPEAT else high) * _regex_size(sub, what)
        elif op == sre.SUBPATTERN:
            if arg[1] or arg[2]:
                raise SpecError(f"{what}: inline flags are not supported")
            size += _regex_size(arg[3], what)
        elif op == sre.BRANCH:
            size += max(_regex_size(branch, what) for branch in arg[1])
        elif op == sre.AT:  # an anchor spells nothing
            if arg not in _ANCHORS:
                raise SpecError(f"{what}: a word boundary is not supported")
        else:
            size += 1
    return size


_PRINTABLE = ((0x20, 0x10FFFF),)  # what `.` and a negated class choose from in a JSON string
_ASCII_PRINTABLE = ((0x20, 0x7E),)
_DIGITS = ((0x30, 0x39),)
_WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_SPACE = ((0x09, 0x0D), (0x20, 0x20))
# Python's classes are Unicode's; the grammar's are ASCII's. A class stands for its ASCII part (a
# subset: the grammar is stricter, never looser), and a negated one for its complement within
# printable ASCII (the complement within Unicode would hold, say, the Arabic digits `[^\\d]` refuses).
_CATEGORY_RANGES = {
    sre.CATEGORY_DIGIT: _DIGITS, sre.CATEGORY_WORD: _WORD, sre.CATEGORY_SPACE: _SPACE,
    sre.CATEGORY_NOT_DIGIT: None, sre.CATEGORY_NOT_WORD: None, sre.CATEGORY_NOT_SPACE: None,
}
_NEGATED = {sre.CATEGORY_NOT_DIGIT: _DIGITS, sre.CATEGORY_NOT_WORD: _WORD, sre.CATEGORY_NOT_SPACE: _SPACE}
# xgrammar's JSON-string regexes take UTF-8 overlongs (E0 80 A7 for "'") for a class whose range
# crosses a UTF-8 length, and a negated class or `.` also takes them and the encodings of
# surrogates: bytes a byte-level model can write that decode to U+FFFD, not to what matched; and
# they write a class's '"', '\\' and control characters raw, which ends or breaks the JSON. So a
# class is written as positive ranges cut at those lengths, without the surrogates and without
# the characters JSON escapes.
_ESCAPED = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))  # control characters, '"' and '\\'
_UTF8_SPANS = ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF))
_ANCHOR_TEXT = {sre.AT_BEGINNING: "^", sre.AT_END: "$", sre.AT_BEGINNING_STRING: "\\A", sre.AT_END_STRING: "\\Z"}
_SPECIAL = frozenset(".^$*+?()[]{}|\\/")
_CLASS_SPECIAL = frozenset("[]\\^-")
_ATOMS = (sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN, sre.SUBPATTERN, sre.BRANCH)


class _RegexWriter:
    """Writes a parsed regex anew (`grammar_regex`)."""

    def __init__(self, json_string: bool) -> None:
        # What `.` and a negated class choose from, and what no class may yield: xgrammar writes a
        # JSON string's class characters raw, so no '"', '\\' or control character there.
        self.anything = _PRINTABLE if json_string else ((0, 0x10FFFF),)
        self.unwritable = _ESCAPED if json_string else ()

    def text(self, items) -> str:
        return "".join(self.item(op, arg) for op, arg in items)

    def item(self, op, arg) -> str:
        if op == sre.LITERAL:
            if _minus([(arg, arg)], self.unwritable) != [(arg, arg)]:
                raise SpecError("a quote, a backslash or a control character is not supported (JSON escapes them)")
            return _char(arg, _SPECIAL)
        if op == sre.NOT_LITERAL:
            return self.char_class(_minus(self.anything, [(arg, arg)]))
        if op == sre.ANY:
            return self.char_class(_minus(self.anything, [(0x0A, 0x0A)]))
        if op == sre.IN:
            return self.char_class(_class_ranges(arg, self.anything))
        if op == sre.AT:
            return _ANCHOR_TEXT[arg]
        if op == sre.BRANCH:
            return "(" + "|".join(self.text(branch) for branch in arg[1]) + ")"
        if op == sre.SUBPATTERN:
            sub = arg[3]
            return self.text(sub) if len(sub) == 1 and sub[0][0] == sre.BRANCH else "(" + self.text(sub) + ")"
        low, high, sub = arg  # a repeat (check_regex let no other construct through)
        atom = self.text(sub)
        if not (len(sub) == 1 and sub[0][0] in _ATOMS):
            atom = "(" + atom + ")"
        if high == sre.MAXREPEAT:
            return atom + ("*" if low == 0 else "+" if low == 1 else f"{{{low},}}")
        return atom + (f"{{{low}}}" if low == high else f"{{{low},{high}}}")

    def char_class(self, ranges) -> str:
        """A class of these code points: one per UTF-8 length, as alternatives (xgrammar merges
        the ranges of one class, and a merged range across lengths takes overlongs)."""
        ranges = _minus(ranges, self.unwritable)
        classes = []
        for span_low, span_high in _UTF8_SPANS:
            pieces = []
            for low, high in ranges:
                a, b = max(low, span_low), min(high, span_high)
                if a <= b:
                    pieces.append(_char(a, _CLASS_SPECIAL) + ("" if a == b else "-" + _char(b, _CLASS_SPECIAL)))
            if pieces:
                classes.append("[" + "".join(pieces) + "]")
        if not classes:
            raise SpecError("a class that allows no character")
        return classes[0] if len(classes) == 1 else "(" + "|".join(classes) + ")"


def _class_ranges(items, anything) -> list[tuple[int, int]]:
    """The code points a parsed class stands for, as sorted ranges (see `_CATEGORY_RANGES`); a
    negated one's are taken from `anything`."""
    negate = bool(items) and items[0][0] == sre.NEGATE
    ranges: list[tuple[int, int]] = []
    ascii_only = False
    for op, arg in items[negate:]:
        if op == sre.LITERAL:
            ranges.append((arg, arg))
        elif op == sre.RANGE:
            ranges.append(arg)
        elif arg in _NEGATED:  # \\D, \\W, \\S
            ranges += _minus(_ASCII_PRINTABLE, _NEGATED[arg])
            ascii_only = True
        else:
            ranges += _CATEGORY_RANGES[arg]
            ascii_only = True
    if not negate:
        return _minus(ranges, [])
    return _minus(_ASCII_PRINTABLE if ascii_only else anything, ranges)


def _minus(ranges, removed) -> list[tuple[int, int]]:
    """`ranges` without `removed` and without the surrogates, merged and sorted."""
    points: list[tuple[int, int]] = []
    for low, high in sorted(ranges):
        if points and low <= points[-1][1] + 1:
            points[-1] = (points[-1][0], max(points[-1][1], high))
        else:
            points.append((low, high))
    for cut_low, cut_high in [*removed, (0xD800, 0xDFFF)]:
        kept = []
        for low, high in points:
            if high < cut_low or low > cut_high:
                kept.append((low, high))
                continue
            if low < cut_low:
                kept.append((low, cut_low - 1))
            if high > cut_high:
                kept.append((cut_high + 1, high))
        points = kept
    return points


def _char(code: int, special: frozenset) -> str:
    """One character of a regex: escaped where special, a control character as \\xHH, any other
    as itself (xgrammar reads \\U00010000 as letters and digits)."""
    if code < 0x20 or code == 0x7F:
        return f"\\x{code:02x}"
    char = chr(code)
    return "\\" + char if char in special else char

