"""Real HTTP servers on 127.0.0.1 that receive webhooks: one records every request and answers from a
script; one answers too slowly or too much, forever (a slow-drip or flooding receiver)."""

from __future__ import annotations

import json
import socketserver
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


@dataclass
class Received:
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


@dataclass
class Receiver:
    """A real HTTP server on 127.0.0.1 that records every request and answers from a script."""

    server: ThreadingHTTPServer
    requests: list[Received] = field(default_factory=list)
    script: deque = field(default_factory=deque)  # statuses to answer, in order; then 200

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def wait_for(self, n: int, timeout: float = 30.0, path: str | None = None) -> list[Received]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = [r for r in self.requests if path is None or r.path == path]
            if len(got) >= n:
                return got
            time.sleep(0.05)
        raise TimeoutError(f"receiver got {len(self.requests)} requests, wanted {n}: {self.requests}")


@pytest.fixture
def receiver():
    holder: dict = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            rec = holder["receiver"]
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            rec.requests.append(Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
            status = rec.script.popleft() if rec.script else 200
            self.send_response(status)
            if 300 <= status < 400:
                self.send_header("Location", "/redirected")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    rec = Receiver(server)
    holder["receiver"] = rec
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield rec
    server.shutdown()
    server.server_close()


@dataclass
class SlowReceiver:
    """A real HTTP server on 127.0.0.1 that takes each request whole, then answers `status` and never
    finishes: with `part="headers"` the header block never ends (the status code never arrives),
    with `part="body"` the headers are complete and the body never ends. `pace_s` is the pause
    between two bytes (a drip); 0 sends 64 KiB at a time as fast as the socket takes them (a flood)."""

    server: socketserver.ThreadingTCPServer
    stop: threading.Event
    status: int = 200
    part: str = "headers"  # "headers" | "body"
    pace_s: float = 0.05
    requests: list[Received] = field(default_factory=list)
    hung_up: list[str] = field(default_factory=list)  # webhook-ids whose sender closed the connection

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def wait_for(self, n: int, timeout: float = 30.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.requests) >= n:
                return list(self.requests)
            time.sleep(0.05)
        raise TimeoutError(f"slow receiver got {len(self.requests)} requests, wanted {n}")

    def answer(self, handler: socketserver.StreamRequestHandler) -> None:
        request_line = handler.rfile.readline().decode("latin-1").split()
        headers = {}
        while (line := handler.rfile.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        body = handler.rfile.read(int(headers.get("content-length", 0)))
        self.requests.append(Received(request_line[1], headers, body))
        head = f"HTTP/1.1 {self.status} Whatever\r\n"
        head += "Content-Length: 1000000000000\r\n\r\n" if self.part == "body" else "X-Never-Ends: "
        chunk = b"a" if self.pace_s else b"a" * 65536
        try:
            handler.wfile.write(head.encode())
            while not self.stop.is_set():
                handler.wfile.write(chunk)
                if self.pace_s:
                    self.stop.wait(self.pace_s)
        except OSError:  # the sender hung up
            self.hung_up.append(headers.get("webhook-id", ""))


@pytest.fixture
def slow_receiver():
    holder: dict = {}

    class Handler(socketserver.StreamRequestHandler):
        def handle(self):
            holder["receiver"].answer(self)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    rec = SlowReceiver(server, threading.Event())
    holder["receiver"] = rec
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield rec
    rec.stop.set()
    server.shutdown()
    server.server_close()
