"""Each spec's first compile runs in a process of its own, at the lowest CPU priority, where a
compile over the budget can be killed (a thread cannot be).

A compile server (`main`, in a process of its own: one per compile thread of the manager, started
on first use and kept) imports xgrammar and reads the vocabulary once, then forks a process per
spec, which builds the spec's source (`grammars.grammar_source`), compiles it and answers with the
source and the compiled grammar's size, or with why it failed. The manager's thread then compiles
that source itself, a compile now known to end within the budget. xgrammar can serialize a
compiled grammar, but its JSON is far bigger and slower than the compile (115 MB and 20 s, 2 s
of it holding the GIL, for a 300-property schema that compiles in 0.2 s), so the source comes
back, not the grammar. A fork costs 50 ms; a fresh server, 2 s or more (it imports torch).

The server watches its fork and kills it past the budget: CPU seconds, read from /proc where
there is one, so that a loaded machine, where an idle-priority process gets little CPU, does not
refuse a schema an idle one compiles (while the engine keeps the CPU busy, a compile waits); wall
time is capped too, at `_WALL_FACTOR` times the budget. The watching is the server's, not the
engine process's: a thread of the engine that woke to poll would take the GIL from the engine's
thread at every wake, and one at idle priority might not give it back soon.

The server and its forks run at nice 19 and idle scheduling priority in the engine's session (a
session of their own would weigh as much as the engine's under the kernel's autogroup
scheduling: a neighbour's TTFT on two cores went from 7 ms to 1 s while one compiled).

Messages are JSON lines. The parent writes the tokenizer info, the server answers `{"ready": true}`;
then per spec the parent writes `{"kind", "value", "budget_s"}`, the server answers `{"method",
"text", "bytes"}`, `{"error", "message"}`, `{"over_budget": true}` or, if the fork died of itself,
`{"crashed": true}`. The server exits when its stdin closes (the parent went away).
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time

from ferry.worker.engine.errors import InvalidStructuredOutputError
from ferry.worker.engine.structured.grammars import Source, compile_source, compiler_message, grammar_source
from ferry.worker.engine.structured.params import SchemaTooComplexError

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0  # importing xgrammar (and torch with it) and reading the vocabulary
_POLL_S = 0.05  # how often the server reads its fork's CPU time
_WALL_FACTOR = 30  # a compile starved of CPU that long (a hang, or a machine never idle) is refused too
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class CompileProcess:
    """The parent's handle on one compile server; not thread-safe (each compile thread has its own)."""

    def __init__(self, tokenizer_info_json: str, budget_s: float, max_grammar_bytes: int) -> None:
        self.budget_s = budget_s
        self.max_grammar_bytes = max_grammar_bytes
        self._tokenizer_info_json = tokenizer_info_json
        self._server: subprocess.Popen | None = None
        self._received = b""  # read from the server past the last whole message

    def source(self, kind: str, value) -> Source:
        """The spec's source, compiled once within the budget. SchemaTooComplexError past the
        budget or over the size, InvalidStructuredOutputError if it does not compile."""
        server = self._started()
        self._send(server, {"kind": kind, "value": value, "budget_s": self.budget_s})
        reply = self._reply(server, self.budget_s * _WALL_FACTOR + _START_TIMEOUT_S)
        if reply is None:
            self.close()
            raise RuntimeError("the grammar compile server did not answer")
        if "over_budget" in reply:
            raise SchemaTooComplexError(f"its grammar did not compile within the budget ({self.budget_s:g} s of "
                                        f"CPU, {self.budget_s * _WALL_FACTOR:g} s in all): simplify it")
        if "crashed" in reply:
            raise InvalidStructuredOutputError("the grammar compiler failed on it")
        if "error" in reply:
            if reply["message"] is None:
                log.warning("grammar compiler refused a spec: %s", reply["error"])
                raise InvalidStructuredOutputError("the grammar compiler refused it (the worker's log has its words)")
            raise InvalidStructuredOutputError(reply["message"])
        if reply["bytes"] > self.max_grammar_bytes:
            raise SchemaTooComplexError(
                f"its compiled grammar takes {reply['bytes'] >> 20} MiB (at most {self.max_grammar_bytes >> 20} MiB)"
            )
        return Source(reply["method"], reply["text"])

    def close(self) -> None:
        if self._server is not None:
            self._server.kill()
            self._server.wait()
            self._server = None
            self._received = b""

    def _started(self) -> subprocess.Popen:
        if self._server is not None and self._server.poll() is None:
            return self._server
        # A group of its own (a terminal's Ctrl-C is the parent's to handle) but not a session
        # (see the module's docstring).
        server = subprocess.Popen(
            [sys.executable, "-c", f"from {__name__} import main; main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, process_group=0,
        )
        self._server = server
        lowest_priority(server.pid)  # from its start: importing torch and xgrammar takes seconds of CPU
        self._send(server, {"tokenizer_info": self._tokenizer_info_json})
        if self._reply(server, _START_TIMEOUT_S) is None:
            self.close()
            raise RuntimeError(f"the grammar compile server did not start within {_START_TIMEOUT_S:g} s")
        return server

    @staticmethod
    def _send(server: subprocess.Popen, message: dict) -> None:
        server.stdin.write(json.dumps(message).encode() + b"\n")
        server.stdin.flush()

    def _reply(self, server: subprocess.Popen, wall_s: float) -> dict | None:
        """The server's next message; None after `wall_s`."""
        deadline = time.monotonic() + wall_s
        while b"\n" not in self._received:  # read unbuffered: select sees only what is not read yet
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if select.select([server.stdout], [], [], left)[0]:
                chunk = os.read(server.stdout.fileno(), 1 << 20)
                if not chunk:
                    self.close()
                    raise RuntimeError("the grammar compile server ended")
                self._received += chunk
        line, self._received = self._received.split(b"\n", 1)
        return json.loads(line)


def lowest_priority(pid: int) -> None:
    """The lowest CPU priority for a process or, on Linux, a thread (`pid` a thread's id):
    nice 19 and idle scheduling, so that the engine's threads come first."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, 19)
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):  # gone already, or no such call here
        pass


def main() -> None:
    """The compile server: reads requests on stdin, answers on stdout (see the module's docstring)."""
    import xgrammar as xgr

    replies = os.fdopen(os.dup(1), "wb")  # (the parent set the priority at the start; the forks inherit it)
    os.dup2(2, 1)  # whatever else writes to stdout goes to stderr; stdout carries replies only
    requests = sys.stdin.buffer
    info = xgr.TokenizerInfo.deserialize_json(json.loads(requests.readline())["tokenizer_info"])
    try:
        replies.write(b'{"ready": true}\n')
        replies.flush()
        for line in requests:
            replies.write(json.dumps(_served(info, json.loads(line))).encode() + b"\n")
            replies.flush()
    except BrokenPipeError:  # the parent went away
        return


def _served(info, request: dict) -> dict:
    """Compile one spec in a fork of this server, killed past the request's budget."""
    budget_s = request.pop("budget_s")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        with os.fdopen(write_end, "wb") as out:
            out.write(json.dumps(_compile_one(info, request)).encode())
        os._exit(0)
    os.close(write_end)
    reply = b""
    deadline = time.monotonic() + budget_s * _WALL_FACTOR
    with os.fdopen(read_end, "rb") as result:
        while True:
            if select.select([result], [], [], _POLL_S)[0]:
                chunk = os.read(result.fileno(), 1 << 20)
                if not chunk:
                    break
                reply += chunk
            elif _cpu_seconds(pid) > budget_s or time.monotonic() > deadline:
                _kill(pid)
                os.waitpid(pid, 0)
                return {"over_budget": True}
    os.waitpid(pid, 0)
    return json.loads(reply) if reply else {"crashed": True}


def _compile_one(info, request: dict) -> dict:
    """In the spec's own process: what the parent is told about the spec."""
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    try:
        source = grammar_source(request["kind"], request["value"])
        compiled = compile_source(compiler, source)
    except Exception as exc:  # the spec's own failure: the parent says it in our words
        return {"error": f"{type(exc).__name__}: {exc}", "message": compiler_message(exc)}
    return {"method": source.method, "text": source.text, "bytes": compiled.memory_size_bytes}


def _cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) the process has used; 0 where /proc cannot tell (wall time rules)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime: fields 14 and 15 of stat


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended on its own meanwhile
        pass
