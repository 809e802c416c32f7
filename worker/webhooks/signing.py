"""Standard Webhooks signatures (https://www.standardwebhooks.com).

Every attempt carries `webhook-id` (stable across retries, so receivers de-duplicate),
`webhook-timestamp` (seconds, per attempt) and `webhook-signature: v1,<base64 HMAC-SHA256 of
"id.timestamp.body">` keyed by the secret `whsec_<base64>`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import random
import time
from collections.abc import Mapping

SIGNATURE_TOLERANCE_S = 300


class InvalidSignature(Exception):
    pass


def secret_key(secret: str) -> bytes:
    """The HMAC key inside a `whsec_<base64>` secret."""
    if not secret.startswith("whsec_"):
        raise ValueError("webhook secret must look like 'whsec_<base64>'")
    return base64.b64decode(secret.removeprefix("whsec_"))


def new_secret() -> str:
    return "whsec_" + base64.b64encode(random.SystemRandom().randbytes(32)).decode()


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """`v1,<base64 HMAC-SHA256(key, "id.timestamp.body")>`."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def verify(secret: str, headers: Mapping[str, str], body: bytes, *, now: float | None = None) -> None:
    """Check a delivery as a receiver would; raises InvalidSignature. `headers` keys lower-case."""
    try:
        msg_id, timestamp = headers["webhook-id"], int(headers["webhook-timestamp"])
        signatures = headers["webhook-signature"].split()
    except (KeyError, ValueError) as exc:
        raise InvalidSignature(f"missing or malformed webhook headers: {exc}") from exc
    if abs((time.time() if now is None else now) - timestamp) > SIGNATURE_TOLERANCE_S:
        raise InvalidSignature("timestamp outside the tolerance")
    expected = sign(secret, msg_id, timestamp, body)
    # The header may carry several space-separated signatures (secret rotation).
    if not any(hmac.compare_digest(expected, s) for s in signatures if s.startswith("v1,")):
        raise InvalidSignature("no signature matches")
