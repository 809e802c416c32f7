"""Grammars for structured outputs: compiled with xgrammar off the engine thread, cached, and
turned into per-request matchers whose token bitmasks constrain that request's logits.

A request's spec is compiled once per (spec, tokenizer) in a small thread pool; the future is
cached (LRU), so requests that share a schema share one compile, even while it runs. The
scheduler leaves a request waiting until its grammar is ready (`GrammarState.ready`), and the
other requests keep stepping meanwhile.

JSON grammars allow no free whitespace between tokens (`any_whitespace=False`) and numbers of
bounded length (19 integer digits, 17 fraction digits, 3 exponent digits: every double and int64
fits): a model cannot spin on blanks or on digits until max_tokens, so every constrained output can
complete. (SmolLM2 given `{"type": "integer"}` otherwise writes 1000000... to the token limit.)
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr

from ferry.worker.engine.structured.params import InvalidStructuredOutputError, StructuredOutputs

_COMPILE_THREADS = 2  # compiles run beside the engine thread, which keeps stepping other requests


class GrammarState:
    """One request's grammar: the compile it waits for, then its matcher, which has accepted
    exactly the request's output tokens so far."""

    __slots__ = ("compiled", "matcher")

    def __init__(self, compiled: Future) -> None:
        self.compiled = compiled  # Future[xgr.CompiledGrammar]
        self.matcher: xgr.GrammarMatcher | None = None  # set on the engine thread once compiled

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    def start(self, output_token_ids: Sequence[int]) -> None:
        """Make the matcher (the compile is done) and advance it over tokens already generated
        (a resumed request's). InvalidStructuredOutputError if the compile failed or the
        tokens do not match."""
        try:
            compiled = self.compiled.result()
        except Exception as exc:
            raise InvalidStructuredOutputError(f"structured_outputs cannot be compiled: {_message(exc)}") from exc
        matcher = xgr.GrammarMatcher(compiled)
        for i, token in enumerate(output_token_ids):
            if matcher.is_terminated() or not matcher.accept_token(token):
                raise InvalidStructuredOutputError(
                    f"output token {i} (id {token}) does not match the request's structured_outputs"
                )
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance over a generated token; False if the grammar does not allow it."""
        return not self.matcher.is_terminated() and self.matcher.accept_token(token)

    @property
    def finished(self) -> bool:
        """The grammar accepted its end (a stop token): nothing may follow."""
        return self.matcher.is_terminated()

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` the grammar allows next (the matcher is left as it was)."""
        n = 0
        for token in token_ids:
            if not self.accept(token):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    def fill(self, bitmask: torch.Tensor, row: int, extra: Sequence[int]) -> None:
        """Write into bitmask[row] the tokens allowed after the output so far plus `extra`
        (proposals assumed accepted); the matcher is left as it was."""
        n = self.valid_prefix(extra)  # (rolls back itself)
        if n != len(extra):
            raise InvalidStructuredOutputError(f"proposed token {extra[n]} does not match the grammar")
        for token in extra:
            self.matcher.accept_token(token)
        try:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        finally:
            if extra:
                self.matcher.rollback(len(extra))


class StructuredOutputManager:
    """Compiles specs for one tokenizer; `vocab_size` is the model's logits width (it may exceed
    the tokenizer's: the extra ids are never allowed)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int], cache_size: int) -> None:
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._tokenizer = tokenizer
        self._stop_token_ids = list(stop_token_ids)
        self._pool = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="ferry-grammar")
        self._cache: OrderedDict[str, Future] = OrderedDict()  # key -> Future[CompiledGrammar], oldest first
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._tokenizer_key: str | None = None

    @property
    def tokenizer_key(self) -> str:
        """sha256 of the vocabulary, the logits width and the stop tokens: what a grammar's masks depend on."""
        if self._tokenizer_key is None:  # on first use: an engine that never sees a grammar never pays for it
            vocab = sorted(self._tokenizer.get_vocab().items())
            fingerprint = json.dumps([vocab, self.vocab_size, self._stop_token_ids], ensure_ascii=False)
            self._tokenizer_key = hashlib.sha256(fingerprint.encode()).hexdigest()
        return self._tokenizer_key

    def compile(self, spec: StructuredOutputs) -> Future:
        """The compiled grammar of `spec`, as a future (shared by every request with the same spec)."""
        key = hashlib.sha256(f"{self.tokenizer_key}|{spec.key()}".encode()).hexdigest()
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        future = self._pool.submit(self._compile, spec)
        self._cache[key] = future
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return future

    # --- on the pool's threads ------------------------------------------------------------------

    def _compile(self, spec: StructuredOutputs):
        compiler = self._get_compiler()
        kind = spec.kind
        if kind in ("json", "json_object"):
            schema = json.dumps(spec.json) if kind == "json" else '{"type": "object"}'
            return compiler.compile_grammar(_json_grammar(schema))
        if kind == "regex":
            return compiler.compile_regex(spec.regex)
        if kind == "choice":
            # EBNF string literals take JSON's escapes.
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
        return compiler.compile_grammar(spec.grammar)

    def _get_compiler(self) -> xgr.GrammarCompiler:
        # Built on first use, like tokenizer_key.
        with self._compiler_lock:
            if self._compiler is None:
                info = _tokenizer_info(self._tokenizer, self.vocab_size, self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler


def _tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
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


# xgrammar 0.2.9 writes a string's characters as one of these classes: with minLength/maxLength
# the first, which lets raw control characters (U+0000-U+001F) through, and both let the UTF-8
# encodings of surrogates (U+D800-U+DFFF, three bytes each) through. JSON allows neither raw in a
# string; a byte-level model's tokens can spell a surrogate, which decodes to three U+FFFD.
_STRING_CHARS = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\uD800-\uDFFF]'


# ... and these rules of its numbers, unbounded there: (rule, unbounded part, bounded part).
_NUMBER_RULES = (
    ("basic_integer", "[1-9] [0-9]*", "[1-9] [0-9]{0, 18}"),  # an integer: 1 to 19 digits
    ("basic_number_2", "[1-9] [0-9]*", "[1-9] [0-9]{0, 18}"),  # a number's integer part, likewise
    ("basic_number_3", "basic_number_digits{1, -1}", "basic_number_digits{1, 17}"),  # its fraction
    ("basic_number_5", "basic_number_digits{1, -1}", "basic_number_digits{1, 3}"),  # its exponent
)


def _json_grammar(schema: str) -> str:
    """The EBNF of a JSON schema, with no whitespace between tokens beyond one blank after ':'
    and ',' (any_whitespace=False), numbers of bounded length, and only characters JSON allows
    unescaped in its strings."""
    lines = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False)).splitlines()
    for rule, unbounded, bounded in _NUMBER_RULES:
        lines = [
            line.replace(unbounded, bounded) if line.startswith(rule + " ::= ") else line for line in lines
        ]
    text = "\n".join(lines)
    for loose in _STRING_CHARS:
        text = text.replace(loose, _JSON_STRING_CHAR)
    return text


def apply_grammars(logits: torch.Tensor, rows: Sequence[tuple[int, GrammarState, Sequence[int]]]) -> dict[int, str]:
    """Mask logits [n, vocab] in place: for each (row, grammar, extra), every token the grammar
    does not allow after the output plus `extra` goes to -inf. Returns row -> error for rows
    whose mask could not be made (left unmasked: the caller fails them)."""
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    failed: dict[int, str] = {}
    masked = []
    for row, grammar, extra in rows:
        try:
            grammar.fill(bitmask, row, extra)
            masked.append(row)
        except Exception as exc:  # this request's grammar state: it fails alone
            failed[row] = f"{type(exc).__name__}: {exc}"
    if masked:
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=masked)
    return failed


def _message(exc: BaseException) -> str:
    """The compiler's message without its C++ source location prefix."""
    text = str(exc).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1] if "/" in text.split(": ", 1)[0] else text
    return text.splitlines()[0] if text else type(exc).__name__
