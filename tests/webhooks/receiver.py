"""A real HTTP server on 127.0.0.1 that receives webhooks: records every request, answers from a script."""

from __future__ import annotations

import json
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
