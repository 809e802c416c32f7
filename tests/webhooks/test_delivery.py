"""One delivery attempt against a real local receiver, its backoff, and the guard on where it may go."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import socket
import ssl
import threading
import time

import pytest

from ferry.worker.webhooks.delivery import (
    MAX_RESPONSE_BYTES,
    RefusedUrl,
    WebhookMessage,
    attempt_delivery,
    backoff_s,
    resolve_target,
)
from ferry.worker.webhooks.signing import verify
from tests.serve.conftest import wait_for

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def test_backoff_doubles_with_jitter_and_is_capped():
    for attempt in range(1, 8):
        delays = [backoff_s(attempt, 2.0, 60.0) for _ in range(200)]
        nominal = min(60.0, 2.0 * 2 ** (attempt - 1))
        assert nominal * 0.5 <= min(delays) and max(delays) <= nominal * 1.5
        assert max(delays) - min(delays) > nominal * 0.2  # jittered, not a fixed schedule


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:9/hook", "http://localhost:9/hook", "http://[::1]:9/hook", "http://[::ffff:127.0.0.1]:9/",
     "https://127.0.0.2/"],
)
def test_loopback_urls_are_refused_without_the_allowance(url):
    with pytest.raises(RefusedUrl, match="non-public"):
        resolve_target(url, allow_private=False, timeout_s=5)


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/x", "file:///etc/passwd", "http://", "not a url"])
def test_non_http_urls_are_refused(url):
    with pytest.raises(RefusedUrl):
        resolve_target(url, allow_private=True, timeout_s=5)


def test_allowed_target_is_pinned_to_the_checked_address():
    target = resolve_target("https://localhost:8443/hook?x=1", allow_private=True, timeout_s=5)
    assert target.address.is_loopback
    assert target.url == "https://localhost:8443/hook?x=1"  # the TLS server name, checked against its certificate
    assert target.host_header == "localhost:8443"


def _delivery(url: str) -> WebhookMessage:
    return WebhookMessage("msg_job1_completed", "job1", "job.completed", url, '{"type":"job.completed"}')


@pytest.mark.parametrize(
    ("status", "outcome"),
    [(200, "delivered"), (204, "delivered"), (500, "retry"), (503, "retry"), (429, "retry"), (410, "gone"),
     (400, "rejected"), (302, "rejected")],
)
def test_one_attempt_maps_the_receivers_answer(receiver, status, outcome):
    receiver.script.append(status)
    attempt = attempt_delivery(_delivery(receiver.base + "/hook"), [SECRET], allow_private=True, timeout_s=5)
    assert (attempt.outcome, attempt.status_code) == (outcome, status)
    (got,) = receiver.wait_for(1)
    assert got.path == "/hook"  # a redirect is never followed
    assert got.headers["webhook-id"] == "msg_job1_completed"
    assert got.headers["content-type"] == "application/json"
    verify(SECRET, got.headers, got.body)


def test_unanswered_and_refused_connections_are_retried():
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)  # accepts into the backlog, never answers
        attempt = attempt_delivery(_delivery(f"http://127.0.0.1:{silent.getsockname()[1]}/"), [SECRET],
                                   allow_private=True, timeout_s=0.3)
    assert (attempt.outcome, attempt.detail) == ("retry", "timed out after 0.3 s while reading the answer")
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    attempt = attempt_delivery(_delivery(f"http://127.0.0.1:{port}/"), [SECRET], allow_private=True, timeout_s=1)
    assert attempt.outcome == "retry"


def test_refused_attempt_sends_nothing(receiver):
    attempt = attempt_delivery(_delivery(receiver.base + "/hook"), [SECRET], allow_private=False, timeout_s=5)
    assert attempt.outcome == "refused"
    time.sleep(0.2)
    assert receiver.requests == []


# --- bounded attempts: one wall-clock deadline, a few KB read ------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("part", "pace_s", "status", "outcome", "detail"),
    [
        ("headers", 0.05, 200, "retry", "timed out after 1 s while reading the answer"),  # slow drip
        ("headers", 0, 200, "retry", f"the answer's status line and headers exceed {MAX_RESPONSE_BYTES} bytes"),
        ("body", 0.05, 200, "delivered", "ok"),  # the status is all an attempt needs
        ("body", 0, 200, "delivered", "ok"),
        ("body", 0, 302, "rejected", "receiver answered 302 (redirects are not followed)"),
    ],
)
def test_an_attempt_ends_at_its_deadline_or_byte_cap_whatever_the_receiver_sends(
        slow_receiver, part, pace_s, status, outcome, detail):
    slow_receiver.part, slow_receiver.pace_s, slow_receiver.status = part, pace_s, status
    attempt = attempt_delivery(_delivery(slow_receiver.base + "/hook"), [SECRET], allow_private=True, timeout_s=1)
    assert (attempt.outcome, attempt.detail) == (outcome, detail)
    assert attempt.status_code == (None if part == "headers" else status)
    (got,) = slow_receiver.wait_for(1)
    verify(SECRET, got.headers, got.body)  # the whole signed request went out first
    wait_for(lambda: slow_receiver.hung_up == ["msg_job1_completed"], 30, "the attempt to hang up")


@pytest.mark.timeout(60)
def test_resolving_the_host_counts_against_the_deadline(monkeypatch):
    resolved = threading.Event()
    system_getaddrinfo = socket.getaddrinfo

    def slow_name_server(host, *args, **kwargs):
        if host == "slow-dns.example":
            resolved.wait()  # a name server that never answers (until the test ends)
        return system_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow_name_server)
    try:
        attempt = attempt_delivery(_delivery("http://slow-dns.example/hook"), [SECRET], allow_private=True,
                                   timeout_s=0.5)
    finally:
        resolved.set()
    assert (attempt.outcome, attempt.detail) == ("retry", "timed out after 0.5 s while resolving 'slow-dns.example'")


def _self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 that no CA signed, and its key (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


@pytest.mark.timeout(60)
def test_https_certificates_are_checked_and_a_silent_handshake_ends_at_the_deadline(tmp_path):
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)  # accepts into the backlog, never says hello
        attempt = attempt_delivery(_delivery(f"https://127.0.0.1:{silent.getsockname()[1]}/"), [SECRET],
                                   allow_private=True, timeout_s=0.5)
    assert (attempt.outcome, attempt.detail) == ("retry", "timed out after 0.5 s while doing the TLS handshake")

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*_self_signed(tmp_path))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)

        def serve_one_handshake():
            conn, _ = listener.accept()
            with conn, contextlib.suppress(OSError):
                context.wrap_socket(conn, server_side=True)

        server = threading.Thread(target=serve_one_handshake, daemon=True)
        server.start()
        attempt = attempt_delivery(_delivery(f"https://127.0.0.1:{listener.getsockname()[1]}/"), [SECRET],
                                   allow_private=True, timeout_s=5)
        server.join(10)
    assert attempt.outcome == "retry" and "certificate verify failed" in attempt.detail
