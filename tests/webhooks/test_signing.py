"""Standard Webhooks signatures: the reference vector, and what a receiver's check refuses."""

from __future__ import annotations

import time

import pytest

from ferry.worker.webhooks.signing import InvalidSignature, new_secret, sign, verify

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def test_signature_matches_the_standard_webhooks_reference_vector():
    # From the Standard Webhooks reference implementations' test suite.
    body = b'{"test": 2432232314}'
    assert (
        sign(SECRET, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body)
        == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    )


def test_verify_checks_body_secret_and_timestamp():
    now = int(time.time())
    body = b'{"type":"job.completed"}'
    headers = {
        "webhook-id": "msg_1",
        "webhook-timestamp": str(now),
        "webhook-signature": sign(SECRET, "msg_1", now, body),
    }
    verify(SECRET, headers, body)
    # Several signatures (secret rotation): one match is enough.
    verify(SECRET, headers | {"webhook-signature": "v1,AAAA " + headers["webhook-signature"]}, body)
    with pytest.raises(InvalidSignature):
        verify(SECRET, headers, body + b" ")
    with pytest.raises(InvalidSignature):
        verify(new_secret(), headers, body)
    with pytest.raises(InvalidSignature):
        verify(SECRET, headers, body, now=now + 301)
    with pytest.raises(InvalidSignature):
        verify(SECRET, {"webhook-id": "msg_1"}, body)
