"""What xgrammar compiles for a spec, and its errors in our words.

`grammar_source(kind, value)` turns a checked spec (worker.protocol.structured) into a `Source`:
an EBNF grammar (a JSON schema's, the choices', or the request's own) or a regex.

JSON grammars allow no free whitespace between tokens (`any_whitespace=False`, one blank after
':' and ','), so a weak model cannot spin on blanks until max_tokens. Their builtin rules are
tightened here, each edit checked to have applied (a new xgrammar that renames a rule fails
loudly, not silently looser):
  - a number has at most 19 integer digits, 17 fraction digits and an exponent of at most 289,
    so every number it allows is a finite double (up to 1e308), and an integer without bounds at
    most 18 digits, so it is an int64 (a bounded one is by its bounds, which the wire's check
    keeps within int64's): a model cannot write digits until max_tokens either;
  - a string holds no raw control character and no UTF-8 encoding of a surrogate (JSON allows
    neither; a byte-level model's tokens can spell one, which decodes to three U+FFFD), and
    escapes only what cannot be written raw (`\\"`, `\\\\`, `\\b\\f\\n\\r\\t`, `\\u0000`-`\\u001f`): every
    string has one spelling, so an additional property can never be a declared one in disguise
    (`"\\u0061"` is `"a"`), and no escape spells a lone surrogate.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import xgrammar as xgr

from ferry.worker.protocol.structured import check_spec

# xgrammar 0.2.9's builtin JSON rules: (rule, its loose part, what replaces it).
_RULE_EDITS = (
    ("basic_integer", "[1-9] [0-9]*", "[1-9] [0-9]{0, 17}"),  # an integer without bounds: 1 to 18 digits
    ("basic_number_2", "[1-9] [0-9]*", "[1-9] [0-9]{0, 18}"),  # a number's integer part: 1 to 19 digits
    ("basic_number_3", "basic_number_digits{1, -1}", "basic_number_digits{1, 17}"),  # its fraction
    # its exponent: 0 to 289, so that 19 integer digits times 10^289 stay below a double's maximum
    ("basic_number_5", "basic_number_digits{1, -1}",
     '([0-9] | [1-9] [0-9] | "1" [0-9] [0-9] | "2" [0-7] [0-9] | "28" [0-9])'),
    ("basic_escape", '([\\"\\\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9])',
     '([\\"\\\\bfnrt]) | ("u" "0" "0" [01] [A-Fa-f0-9])'),
)
# A negated character class, as xgrammar writes the characters of a JSON string.
_NEGATED_CLASS = re.compile(r"\[\^((?:\\.|[^\]\\])*)\]")
_CONTROL, _SURROGATES = "\\0-\\x1f", "\\uD800-\\uDFFF"

# The messages of xgrammar's that speak of the user's own text (a grammar's syntax, a regex's);
# any other is about xgrammar's insides, which a client gets in our words (and the log in its).
_USER_ERRORS = ("EBNF lexer error", "EBNF parser error", "Regex parsing error")


@dataclass(frozen=True, slots=True)
class Source:
    """What xgrammar compiles: `text` is an EBNF grammar (`method` "grammar") or a regex ("regex")."""

    method: str
    text: str


def grammar_source(kind: str, value) -> Source:
    """The source of a spec (kind and value as `StructuredOutputs` holds them)."""
    if kind in ("json", "json_object"):
        schema = check_spec("json", value) if kind == "json" else {"type": "object"}
        return Source("grammar", json_grammar(json.dumps(schema)))
    if kind == "regex":
        return Source("regex", check_spec("regex", value))
    if kind == "choice":  # EBNF string literals take JSON's escapes
        return Source("grammar", "root ::= " + " | ".join(json.dumps(c) for c in value))
    return Source("grammar", value)


def compile_source(compiler: xgr.GrammarCompiler, source: Source) -> xgr.CompiledGrammar:
    if source.method == "regex":
        return compiler.compile_regex(source.text)
    return compiler.compile_grammar(source.text)


def json_grammar(schema: str) -> str:
    """The EBNF of a (checked, rewritten) JSON schema, tightened as the module says."""
    lines = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False)).splitlines()
    for rule, loose, tight in _RULE_EDITS:
        head = rule + " ::= "
        at = next((i for i, line in enumerate(lines) if line.startswith(head) and loose in line), None)
        if at is None:
            raise RuntimeError(f"xgrammar's JSON rule {rule} is not as expected (is xgrammar newer than 0.2.9?)")
        lines[at] = lines[at].replace(loose, tight)
    return "\n".join(_json_string_chars(line) for line in lines)


def _json_string_chars(line: str) -> str:
    """A rule whose negated classes are JSON string characters (they exclude '"' and '\\'), with
    control characters and surrogates excluded too. A pattern's `Regex(...)` is left alone."""
    if "Regex(" in line:
        return line

    def tighten(match: re.Match) -> str:
        body = match.group(1)
        if '\\"' not in body or "\\\\" not in body:
            return match.group(0)
        return "[^" + ("" if _CONTROL in body else _CONTROL) + body + _SURROGATES + "]"

    return _NEGATED_CLASS.sub(tighten, line)


def compiler_message(exc: BaseException) -> str | None:
    """xgrammar's message when it speaks of the user's text (without its source location), or None."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if text.startswith("[") and "] " in text:  # "[07:44:03] /project/cpp/regex_converter.cc:94: Regex ..."
        text = text.split("] ", 1)[1]
        head, _, rest = text.partition(": ")
        text = rest if "/" in head or ".cc" in head else text
    return text if text.startswith(_USER_ERRORS) else None


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, with every special token of the tokenizer marked special.

    xgrammar detects special tokens from the vocabulary alone and can miss some (a byte-level
    tokenizer's `<s>` and `<unk>` read as five ordinary characters), which it would then allow
    inside a JSON string; the detokenizer drops them from the text, so the text would no longer
    be what the grammar matched. A token whose text is empty is special to xgrammar: never
    allowed, stop tokens aside."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    special = set(tokenizer.all_special_ids) | {
        i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special
    }
    missed = special - set(info.special_token_ids) - set(stop_token_ids)
    if not missed:
        return info
    encoded = [""] * vocab_size
    for token, index in tokenizer.get_vocab().items():
        if index < vocab_size and index not in missed:
            encoded[index] = token
    return xgr.TokenizerInfo(
        encoded,
        vocab_type=info.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids,
        add_prefix_space=info.add_prefix_space,
    )
