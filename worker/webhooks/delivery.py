"""One delivery attempt of a webhook, and where a delivery may go.

Timeouts, connection errors, 429 and 5xx are retried (by the Celery task) with exponential
backoff and jitter up to the attempt limit; 410 stops at once; any other answer is final;
redirects are never followed. A URL whose host resolves to a private, loopback, link-local or
otherwise non-public address is refused unless FERRY_WEBHOOK_ALLOW_PRIVATE is set, and the
connection goes to the address that was checked (no second DNS lookup to rebind).

An attempt is bounded whatever the receiver does, so a slow receiver holds a delivery thread for
at most one deadline:

- time: one wall-clock deadline (FERRY_WEBHOOK_TIMEOUT_S) for the whole attempt: resolving the
  host, connecting, the TLS handshake, sending, and the answer's status line and headers. Every
  socket operation waits at most until the deadline (a per-read timeout alone would let a receiver
  that sends a byte a second hold the attempt forever);
- bytes: an attempt needs only the status code. It reads at most MAX_RESPONSE_BYTES of the answer,
  which its status line and headers must fit, and closes the connection without reading the body.
"""

from __future__ import annotations

import random
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass

import httpcore
import httpx

from ferry.worker.common.addresses import IPAddress, RefusedUrl, check_addresses, literal_address, resolve
from ferry.worker.webhooks.signing import sign

MAX_RESPONSE_BYTES = 8192  # what an attempt reads of an answer: its status line and headers must fit


class AttemptTimedOut(Exception):
    """The attempt's deadline passed; the message says during what."""


class AnswerTooLong(Exception):
    """The answer's status line and headers did not fit in MAX_RESPONSE_BYTES."""


@dataclass(frozen=True, slots=True)
class Target:
    url: str  # the URL, normalised: its host names the TLS server (certificates are checked against it)
    address: IPAddress  # the checked address the connection goes to, whatever the URL's host resolves to later
    host_header: str  # host[:port] as the URL names it


def resolve_target(url: str, allow_private: bool, timeout_s: float) -> Target:
    """Resolve the URL's host once (waiting at most `timeout_s`), refuse non-public addresses
    (`worker.common.addresses`), pin the connection to one of the checked addresses."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise RefusedUrl(f"invalid URL: {exc}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise RefusedUrl("webhook URL must be http(s)://host/...")
    host = parsed.raw_host.decode("ascii")
    addresses = _resolve_within(host, parsed.port or (443 if parsed.scheme == "https" else 80), timeout_s)
    check_addresses(parsed.host, addresses, allow_private)
    return Target(url=str(parsed), address=addresses[0], host_header=parsed.netloc.decode("ascii"))


def _resolve_within(host: str, port: int, timeout_s: float) -> list[IPAddress]:
    """`resolve`, waited for at most `timeout_s`. The system resolver takes no deadline (a slow name
    server holds it for its own timeouts, tens of seconds), so it runs on a daemon thread of its own,
    which an overrun leaves behind to finish."""
    literal = literal_address(host)
    if literal is not None:
        return [literal]
    answer: Future[list[IPAddress]] = Future()

    def run() -> None:
        try:
            answer.set_result(resolve(host, port))
        except Exception as exc:  # RefusedUrl, or whatever the resolver raised: the attempt reports it
            answer.set_exception(exc)

    threading.Thread(target=run, name="webhook-dns", daemon=True).start()
    try:
        return answer.result(timeout=max(0.0, timeout_s))
    except TimeoutError:
        if answer.done():
            raise
        raise AttemptTimedOut(f"resolving {host!r}") from None


@dataclass(frozen=True, slots=True)
class WebhookMessage:
    """One event for one receiver: everything a task needs. The body is fixed when the relay hands
    it over, so every retry sends the same bytes under the same id."""

    webhook_id: str  # stable across retries; receivers de-duplicate on it
    job_id: str
    event: str  # one of EVENTS
    url: str
    body: str  # JSON text, signed as bytes (utf-8)
    tenant: str = ""  # whose job or batch: its own webhook secrets sign, if its key configuration has any
    traceparent: str = ""  # W3C context of the relay's hand-off span (tracing on): each attempt is its child


@dataclass(frozen=True, slots=True)
class Attempt:
    outcome: str  # "delivered" | "retry" | "gone" | "rejected" | "refused"
    status_code: int | None
    detail: str


def backoff_s(attempt: int, base_s: float, cap_s: float) -> float:
    """Delay before attempt `attempt + 1`: base * 2^(attempt-1), capped, with ±50% jitter."""
    delay = min(cap_s, base_s * 2 ** (attempt - 1))
    return delay * random.uniform(0.5, 1.5)


class _BoundedStream(httpcore.NetworkStream):
    """httpcore's view of one attempt's socket: every read, write and TLS handshake waits at most
    until the attempt's deadline, whatever timeout httpcore asks for, and reads stop at a byte budget."""

    def __init__(self, sock: socket.socket, deadline: float, budget: int) -> None:
        self._sock = sock
        self._deadline = deadline  # time.monotonic() when the attempt must be over
        self._budget = budget  # bytes this stream may still read

    @classmethod
    def connect(cls, address: IPAddress, port: int, deadline: float) -> _BoundedStream:
        family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
        stream = cls(socket.socket(family, socket.SOCK_STREAM), deadline, MAX_RESPONSE_BYTES)
        try:
            with stream._until_deadline("connecting", httpcore.ConnectError):
                stream._sock.connect((str(address), port))
        except BaseException:
            stream.close()
            raise
        return stream

    @contextmanager
    def _until_deadline(self, doing: str, error: type[Exception]) -> Iterator[None]:
        """Arm the socket with the time left; a timeout is the deadline, any other socket error `error`."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise AttemptTimedOut(doing)
        self._sock.settimeout(left)
        try:
            yield
        except TimeoutError as exc:  # socket.timeout, and ssl's handshake timeout
            raise AttemptTimedOut(doing) from exc
        except OSError as exc:  # ssl.SSLError too
            raise error(f"{doing}: {exc}") from exc

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._budget <= 0:
            raise AnswerTooLong(f"the answer's status line and headers exceed {MAX_RESPONSE_BYTES} bytes")
        with self._until_deadline("reading the answer", httpcore.ReadError):
            data = self._sock.recv(min(max_bytes, self._budget))
        self._budget -= len(data)
        return data

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        view = memoryview(buffer)
        while view:
            with self._until_deadline("sending", httpcore.WriteError):
                sent = self._sock.send(view)
            view = view[sent:]

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> _BoundedStream:
        try:
            with self._until_deadline("doing the TLS handshake", httpcore.ConnectError):
                sock = ssl_context.wrap_socket(self._sock, server_hostname=server_hostname)
        except BaseException:
            self.close()  # httpcore closes the streams it got, and it gets none from a failed handshake
            raise
        return _BoundedStream(sock, self._deadline, self._budget)

    def close(self) -> None:
        self._sock.close()

    def get_extra_info(self, info: str):
        if info == "ssl_object" and isinstance(self._sock, ssl.SSLSocket):
            return self._sock  # httpcore asks it for the negotiated ALPN protocol
        return None


class _PinnedBackend(httpcore.NetworkBackend):
    """Connects to the checked address, whatever host the URL names, under one attempt's deadline."""

    def __init__(self, address: IPAddress, deadline: float) -> None:
        self._address = address
        self._deadline = deadline

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options=None) -> _BoundedStream:
        return _BoundedStream.connect(self._address, port, self._deadline)


def _post_status(target: Target, headers: dict[str, str], body: bytes, deadline: float) -> int:
    """POST `body` on a connection of its own to the checked address; the answer's status code. The
    connection is closed as soon as the status line and headers are in: the body is never read."""
    with (
        httpcore.ConnectionPool(network_backend=_PinnedBackend(target.address, deadline)) as pool,
        pool.stream("POST", target.url, headers=headers, content=body) as response,
    ):
        return response.status


def attempt_delivery(delivery: WebhookMessage, secrets: Sequence[str], *, allow_private: bool,
                     timeout_s: float, traceparent: str | None = None) -> Attempt:
    """POST the message once, signed with every secret in `secrets` (space-separated signatures:
    during a rotation a receiver holding either secret verifies it), within `timeout_s` of wall-clock
    time from resolving the host to the answer's last header. `traceparent`: the attempt's span, sent
    to the receiver (W3C trace context) so its own spans can join the job's trace."""
    deadline = time.monotonic() + timeout_s
    body = delivery.body.encode()
    try:
        target = resolve_target(delivery.url, allow_private, timeout_s)
        timestamp = int(time.time())
        headers = {
            "host": target.host_header,
            "content-type": "application/json",
            "content-length": str(len(body)),
            "user-agent": "ferry-webhooks",
            "webhook-id": delivery.webhook_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": " ".join(sign(secret, delivery.webhook_id, timestamp, body) for secret in secrets),
        }
        if traceparent:
            headers["traceparent"] = traceparent
        code = _post_status(target, headers, body, deadline)
    except RefusedUrl as exc:
        return Attempt("refused", None, str(exc))
    except AttemptTimedOut as exc:
        return Attempt("retry", None, f"timed out after {timeout_s:g} s while {exc}")
    except AnswerTooLong as exc:
        return Attempt("retry", None, str(exc))
    except (httpcore.NetworkError, httpcore.ProtocolError) as exc:  # refused connections, TLS failures, bad answers
        return Attempt("retry", None, f"{type(exc).__name__}: {exc}")
    if 200 <= code < 300:
        return Attempt("delivered", code, "ok")
    if code == 410:
        return Attempt("gone", code, "receiver answered 410 Gone: no more retries")
    if code == 429 or code >= 500:
        return Attempt("retry", code, f"receiver answered {code}")
    return Attempt(
        "rejected", code, f"receiver answered {code}" + (" (redirects are not followed)" if 300 <= code < 400 else "")
    )
