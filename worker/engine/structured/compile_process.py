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

The budget is CPU seconds of the spec's process, read from /proc where there is one, so that a
loaded machine, where a niced process gets little CPU, does not refuse a schema an idle one
compiles; wall time is capped too (`_WALL_FACTOR` times the budget). Past either, the parent
kills the spec's process; the server goes on.

Messages are JSON lines. The parent writes the tokenizer info, the server answers `{"ready": true}`;
then per spec the parent writes `{"kind", "value"}`, the server answers `{"pid"}` (the spec's
process) and then `{"method", "text", "bytes"}`, `{"error", "message"}` or, if it was killed,
`{"killed": true}`. The server exits when its stdin closes (the parent went away).
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
_POLL_S = 0.05
_WALL_FACTOR = 4
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
        self._send(server, {"kind": kind, "value": value})
        pid = self._reply(server, _START_TIMEOUT_S)["pid"]
        reply = self._reply(server, self.budget_s * _WALL_FACTOR, pid)
        if reply is None:
            _kill(pid)
            self._reply(server, _START_TIMEOUT_S)  # the server's word that it reaped the process
            raise SchemaTooComplexError(f"its grammar did not compile within {self.budget_s:g} s of CPU: simplify it")
        if "killed" in reply:  # it died of itself (a crash in the compiler)
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
        server = subprocess.Popen(
            [sys.executable, "-c", f"from {__name__} import main; main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
        )
        self._server = server
        self._send(server, {"tokenizer_info": self._tokenizer_info_json})
        if self._reply(server, _START_TIMEOUT_S) is None:
            self.close()
            raise RuntimeError(f"the grammar compile server did not start within {_START_TIMEOUT_S:g} s")
        return server

    @staticmethod
    def _send(server: subprocess.Popen, message: dict) -> None:
        server.stdin.write(json.dumps(message).encode() + b"\n")
        server.stdin.flush()

    def _reply(self, server: subprocess.Popen, wall_s: float, budgeted: int | None = None) -> dict | None:
        """The server's next message; None after `wall_s`, or once process `budgeted` has used
        the budget's CPU."""
        deadline = time.monotonic() + wall_s
        while b"\n" not in self._received:  # read unbuffered: select sees only what is not read yet
            if time.monotonic() > deadline or (budgeted is not None and _cpu_seconds(budgeted) > self.budget_s):
                return None
            if select.select([server.stdout], [], [], _POLL_S)[0]:
                chunk = os.read(server.stdout.fileno(), 1 << 20)
                if not chunk:
                    self.close()
                    raise RuntimeError("the grammar compile server ended")
                self._received += chunk
        line, self._received = self._received.split(b"\n", 1)
        return json.loads(line)


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


def main() -> None:
    import xgrammar as xgr

    if hasattr(os, "nice"):
        os.nice(19)  # the engine's threads come first; the spec's processes inherit it
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever else writes to stdout goes to stderr; stdout carries replies only

    def answer(message: dict) -> None:
        replies.write(json.dumps(message).encode() + b"\n")
        replies.flush()

    requests = sys.stdin.buffer
    info = xgr.TokenizerInfo.deserialize_json(json.loads(requests.readline())["tokenizer_info"])
    answer({"ready": True})
    for line in requests:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            with os.fdopen(write_end, "wb") as out:
                out.write(json.dumps(_compile_one(info, json.loads(line))).encode())
            os._exit(0)
        os.close(write_end)
        answer({"pid": pid})
        with os.fdopen(read_end, "rb") as result:
            reply = result.read()
        os.waitpid(pid, 0)
        answer(json.loads(reply) if reply else {"killed": True})
