"""Grammars for structured outputs: compiled with xgrammar off the engine thread, cached, and
turned into per-request matchers whose token bitmasks constrain that request's logits.

A request's spec is compiled once per (spec, tokenizer) in a small thread pool; the future is
cached (LRU), so requests that share a spec share one compile, even while it runs, and a spec
that failed fails again at once. The scheduler leaves a request waiting until its grammar is
ready (`GrammarState.ready`), and the other requests keep stepping meanwhile.

No compile may stall the other tenants (issue 35). The wire's check refuses, before anything is
queued, the specs known to compile slowly (worker.protocol.structured: size, properties, regex
repetitions). What only a compile can tell is bounded here: each compile thread first compiles
the spec in a child process of its own at the lowest CPU priority (`compile_process`), which is
killed once it has used `compile_budget_s` of CPU (`SchemaTooComplexError`, the wire's
`schema_too_complex`) or if the grammar it built is over `MAX_GRAMMAR_BYTES`; only then does the
thread compile the same source for the engine, at the lowest priority too. xgrammar releases the
GIL while it compiles (the engine thread never waited more than 9 ms in a 37 s compile), so what a
compile takes from the engine is CPU, and the priority hands that back. A compile thread is thus
held at most a budget's worth of CPU by one spec. `bench/structured_isolation.py` measures a
neighbour's TTFT while hostile specs arrive.

A compile's failure reaches the client in our words: xgrammar's own only where it speaks of the
user's text (an EBNF or regex syntax error); anything else it says is logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch
import xgrammar as xgr

from ferry.worker.engine.errors import InvalidStructuredOutputError
from ferry.worker.engine.structured.compile_process import CompileProcess
from ferry.worker.engine.structured.grammars import compile_source, tokenizer_info
from ferry.worker.engine.structured.params import StructuredOutputs
from ferry.worker.engine.structured.reasoning import ANSWER, THINKING, UNDECIDED, ReasoningGate

log = logging.getLogger(__name__)

_COMPILE_THREADS = 2  # compiles run beside the engine thread, which keeps stepping other requests
COMPILE_BUDGET_S = 5.0  # CPU seconds a spec's first compile may take
MAX_GRAMMAR_BYTES = 64 << 20  # a compiled grammar's memory (xgrammar's count); the cache holds many


class GrammarState:
    """One request's grammar: the compile it waits for, then its matcher, which has accepted
    exactly the request's answer tokens so far: its output tokens, less any thinking a
    `ReasoningGate` keeps the grammar off (worker.engine.structured.reasoning)."""

    __slots__ = ("compiled", "matcher", "gate")

    def __init__(self, compiled: Future, gate: ReasoningGate | None = None) -> None:
        self.compiled = compiled  # Future[xgr.CompiledGrammar]
        self.matcher: xgr.GrammarMatcher | None = None  # set on the engine thread once compiled
        self.gate = gate  # None: the grammar applies from the first output token

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    def start(self, output_token_ids: Sequence[int]) -> None:
        """Make the matcher (the compile is done) and advance it over tokens already generated
        (a resumed request's). InvalidStructuredOutputError if the compile failed or the
        tokens do not match."""
        try:
            compiled = self.compiled.result()
        except InvalidStructuredOutputError:
            raise
        except Exception as exc:
            log.error("grammar compile failed", exc_info=exc)
            raise InvalidStructuredOutputError("structured_outputs could not be compiled (an internal error; the "
                                               "worker's log has it)") from exc
        self.matcher = xgr.GrammarMatcher(compiled)
        for i, token in enumerate(output_token_ids):
            if not self.accept(token):
                self.matcher = None
                raise InvalidStructuredOutputError(
                    f"output token {i} (id {token}) does not match the request's structured_outputs"
                )

    def accept(self, token: int) -> bool:
        """Advance over a generated token; False if the grammar does not allow it."""
        if self.gate is not None and self.gate.state != ANSWER and self.gate.advance([token]):
            return True  # thinking
        return not self.matcher.is_terminated() and self.matcher.accept_token(token)

    @property
    def finished(self) -> bool:
        """The grammar accepted its end (a stop token): nothing may follow."""
        return self.matcher.is_terminated()

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` the grammar allows next (the state is left as it was)."""
        thinking = self.gate.split(token_ids)[0] if self.gate is not None else 0
        return thinking + self._answer_prefix(token_ids[thinking:])

    def _answer_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading `token_ids` the matcher allows next (it is left as it was)."""
        n = 0
        for token in token_ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    def fill(self, bitmask: torch.Tensor, row: int, extra: Sequence[int]) -> bool:
        """Write into bitmask[row] the tokens allowed after the output so far plus `extra`
        (proposals assumed accepted); the state is left as it was. False when the row is not
        to be masked: the output is thinking then."""
        thinking, state = self.gate.split(extra)[:2] if self.gate is not None else (0, ANSWER)
        if state == THINKING:
            return False
        answer = extra[thinking:]
        n = self._answer_prefix(answer)
        if n != len(answer):
            raise InvalidStructuredOutputError(f"proposed token {answer[n]} does not match the grammar")
        for token in answer:
            self.matcher.accept_token(token)
        try:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        finally:
            if answer:
                self.matcher.rollback(len(answer))
        if state == UNDECIDED:  # the first token may also open the thinking
            word, bit = divmod(self.gate.start_token_id, 32)
            bitmask[row, word] |= bit_value(bit)
        return True


def bit_value(bit: int) -> int:
    """The int32 whose only set bit is `bit` (xgrammar's bitmasks are int32 words)."""
    return (1 << bit) - (1 << 32 if bit == 31 else 0)


class StructuredOutputManager:
    """Compiles specs for one tokenizer; `vocab_size` is the model's logits width (it may exceed
    the tokenizer's: the extra ids are never allowed). `compile_budget_s`: CPU seconds a spec's
    first compile may take before it is refused as too complex."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        cache_size: int,
        compile_budget_s: float = COMPILE_BUDGET_S,
    ) -> None:
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.compile_budget_s = compile_budget_s
        self._tokenizer = tokenizer
        self._stop_token_ids = list(stop_token_ids)
        self._pool = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="ferry-grammar")
        self._cache: OrderedDict[str, Future] = OrderedDict()  # key -> Future[CompiledGrammar], oldest first
        self._lock = threading.Lock()  # guards the compiler and the children, made on first use
        self._compiler: xgr.GrammarCompiler | None = None
        self._info_json = ""  # the compiler's tokenizer info, for the children
        self._children: dict[int, CompileProcess] = {}  # compile thread's id -> its child
        self._tokenizer_key: str | None = None
        weakref.finalize(self, _close_all, self._children)

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

    def _compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        kind = spec.kind
        child, compiler = self._tools()
        try:
            source = child.source(kind, getattr(spec, kind))
        except InvalidStructuredOutputError as exc:
            raise type(exc)(f"structured_outputs.{kind} cannot be compiled: {exc}") from None
        with _idle_priority():
            return compile_source(compiler, source)

    def _tools(self) -> tuple[CompileProcess, xgr.GrammarCompiler]:
        """This thread's child and the engine's compiler, made on first use (an engine that never
        sees a grammar never starts a child nor reads its vocabulary into xgrammar)."""
        with self._lock:
            if self._compiler is None:
                info = tokenizer_info(self._tokenizer, self.vocab_size, self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                self._info_json = info.serialize_json()
            child = self._children.get(threading.get_ident())
            if child is None:
                child = CompileProcess(self._info_json, self.compile_budget_s, MAX_GRAMMAR_BYTES)
                self._children[threading.get_ident()] = child
            return child, self._compiler


@contextmanager
def _idle_priority() -> Iterator[None]:
    """Idle scheduling for this thread while it compiles without the GIL, so the engine's threads
    come first; normal again after, since a thread at idle priority that waits for the GIL keeps
    the engine's thread, which hands it over, waiting too. (Linux schedules threads one by one;
    where going back is not allowed, the thread stays idle, which only slows its compiles.)"""
    thread = threading.get_native_id()
    if sys.platform == "linux":
        os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
    try:
        yield
    finally:
        if sys.platform == "linux":
            try:
                os.sched_setscheduler(thread, os.SCHED_OTHER, os.sched_param(0))
            except PermissionError:
                pass


def _close_all(children: dict[int, CompileProcess]) -> None:
    for child in list(children.values()):
        child.close()


def apply_grammars(logits: torch.Tensor, rows: Sequence[tuple[int, GrammarState, Sequence[int]]]) -> dict[int, str]:
    """Mask logits [n, vocab] in place: for each (row, grammar, extra), every token the grammar
    does not allow after the output plus `extra` goes to -inf (a row still thinking is left as it
    is). Returns row -> error for rows whose mask could not be made (left unmasked: the caller
    fails them)."""
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    failed: dict[int, str] = {}
    masked = []
    for row, grammar, extra in rows:
        try:
            if grammar.fill(bitmask, row, extra):
                masked.append(row)
        except InvalidStructuredOutputError as exc:  # this request's grammar state: it fails alone
            failed[row] = str(exc)
        except Exception as exc:
            log.error("grammar mask failed", exc_info=exc)
            failed[row] = "its grammar could not make a token mask (an internal error; the worker's log has it)"
    if masked:
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=masked)
    return failed
