"""One delivery attempt against a real local receiver, its backoff, and the guard on where it may go."""

from __future__ import annotations

import socket
import time

import pytest

from ferry.worker.webhooks.delivery import RefusedUrl, WebhookMessage, attempt_delivery, backoff_s, resolve_target
from ferry.worker.webhooks.signing import verify

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
        resolve_target(url, allow_private=False)


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/x", "file:///etc/passwd", "http://", "not a url"])
def test_non_http_urls_are_refused(url):
    with pytest.raises(RefusedUrl):
        resolve_target(url, allow_private=True)


def test_allowed_target_is_pinned_to_the_checked_address():
    target = resolve_target("https://localhost:8443/hook?x=1", allow_private=True)
    assert target.url.split("//")[1].split(":")[0] in ("127.0.0.1", "[")
    assert target.url.endswith(":8443/hook?x=1")
    assert target.host_header == "localhost:8443"
    assert target.sni_hostname == "localhost"


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
    assert attempt.outcome == "retry" and "Timeout" in attempt.detail
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
