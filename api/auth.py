"""Bearer API keys mapped to tenants.

Keys are configured only as sha256 hex digests ("<sha256hex>:<tenant>", comma-separated in
FERRY_API_KEYS or one per line in FERRY_API_KEYS_FILE), so the API never holds a usable key.
With no keys configured the API is open: every caller is the tenant `OPEN_TENANT`, and
start-up says so loudly.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.errors import ApiError

log = logging.getLogger("ferry.api")

OPEN_TENANT = "public"


@dataclass(frozen=True, slots=True)
class KeyRing:
    """sha256 hex of an API key -> tenant. Empty means open mode."""

    tenants: dict[str, str]

    @property
    def open(self) -> bool:
        return not self.tenants

    @classmethod
    def parse(cls, spec: str | None = None, file: str | None = None) -> KeyRing:
        entries: list[str] = []
        if spec:
            entries += spec.split(",")
        if file:
            entries += Path(file).read_text().splitlines()
        tenants: dict[str, str] = {}
        for raw in entries:
            entry = raw.strip()
            if not entry or entry.startswith("#"):
                continue
            digest, sep, tenant = entry.partition(":")
            digest, tenant = digest.strip().lower(), tenant.strip()
            if not sep or not tenant or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(f"API key entry {entry[:12]!r}…: expected '<sha256 hex>:<tenant>'")
            tenants[digest] = tenant
        return cls(tenants)

    def tenant_for(self, token: str | None) -> str:
        """The tenant for a bearer token; ApiError 401 when missing or wrong."""
        if self.open:
            return OPEN_TENANT
        if not token:
            raise _unauthorized("missing bearer API key (Authorization: Bearer <key>)")
        digest = hashlib.sha256(token.encode()).hexdigest()
        # Compare against every configured digest so timing does not reveal near misses.
        tenant = None
        for known, owner in self.tenants.items():
            if hmac.compare_digest(known, digest):
                tenant = owner
        if tenant is None:
            raise _unauthorized("invalid API key")
        return tenant

    def announce(self) -> None:
        if self.open:
            banner = "!" * 78
            log.warning(
                "\n%s\n!! OPEN MODE: no API keys configured (FERRY_API_KEYS / FERRY_API_KEYS_FILE).\n"
                "!! Every request is accepted as tenant %r. Do not expose this API publicly.\n%s",
                banner, OPEN_TENANT, banner,
            )
        else:
            log.info("API keys loaded for %d key(s), %d tenant(s)", len(self.tenants), len(set(self.tenants.values())))


def hash_key(key: str) -> str:
    """The digest to put in FERRY_API_KEYS for a key handed to a client."""
    return hashlib.sha256(key.encode()).hexdigest()


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, "unauthorized", message, headers={"WWW-Authenticate": "Bearer"})


# Declares the bearer scheme in the OpenAPI schema; the check itself is KeyRing.tenant_for.
_bearer = HTTPBearer(auto_error=False)


async def tenant(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> str:
    """FastAPI dependency: the calling tenant (async: a sync dependency costs a threadpool hop)."""
    token = credentials.credentials.strip() if credentials else None
    return request.app.state.keyring.tenant_for(token)
