"""`/healthz`, `/readyz` and `/metrics` on a small stdlib HTTP server (one daemon thread).

- `/healthz`: 200 while the process serves HTTP at all (liveness).
- `/readyz`: 200 once the model (and its snapshot) are loaded and until a drain starts; else 503.
- `/metrics`: the worker's Prometheus registry; in OpenMetrics when the scraper accepts it (Prometheus
  does), which is the format that carries the latency histograms' trace-id exemplars.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger("ferry.worker.http")


def serve(host: str, port: int, registry: CollectorRegistry, ready: Callable[[], bool]) -> ThreadingHTTPServer:
    """Start serving on a daemon thread; port 0 picks a free one (see `server.server_address`)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                encode, content_type = choose_encoder(self.headers.get("Accept", ""))
                self._send(200, encode(registry), content_type)
            elif path == "/healthz":
                self._json(200, {"status": "ok"})
            elif path == "/readyz":
                is_ready = ready()
                self._json(200 if is_ready else 503, {"status": "ready" if is_ready else "not ready"})
            else:
                self._json(404, {"code": "not_found"})

        def _json(self, status: int, body: dict) -> None:
            self._send(status, json.dumps(body).encode(), "application/json")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # scrapes every few seconds: keep the log quiet
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    log.info("http listening", extra={"host": host, "port": server.server_address[1]})
    return server
