"""API keys mapped to tenants, sent as `Authorization: Bearer <key>` or, as Anthropic's clients
send them, `x-api-key: <key>`.

Keys are configured only as sha256 hex digests ("<sha256hex>:<tenant>[;option=value...]",
comma-separated in FERRY_API_KEYS or one per line in FERRY_API_KEYS_FILE; the options are
`worker.common.tenants`'), so the API never holds a usable key. With no keys configured the
API is open: every caller is the tenant `OPEN_TENANT`, and start-up says so loudly.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from ferry.api.errors import ApiError
from ferry.worker.common.key_source import KeySource
from ferry.worker.common.tenants import KeyConfig, KeyEntry, TenantConfig, hash_key

log = logging.getLogger("ferry.api")

OPEN_TENANT = "public"
__all__ = ["OPEN_TENANT", "KeyRing", "hash_key"]


@dataclass(frozen=True, slots=True)
class KeyRing:
    """The key configuration as the API checks it, kept current from FERRY_API_KEYS_FILE
    (`worker.common.key_source`: a key revoked there stops working within seconds). No keys
    means open mode."""

    source: KeySource

    @property
    def config(self) -> KeyConfig:
        return self.source.current()

    @property
    def open(self) -> bool:
        return not self.config.keys

    @classmethod
    def parse(cls, spec: str | None = None, file: str | None = None) -> KeyRing:
        return cls(KeySource(spec, file))

    def tenant_names(self) -> list[str]:
        """Every tenant a key names, sorted (the open tenant alone in open mode)."""
        return sorted(self.config.tenants) if not self.open else [OPEN_TENANT]

    def tenant(self, name: str) -> TenantConfig:
        """The tenant's limits and webhook secrets (none for the open tenant)."""
        return self.config.tenant(name)

    def entry_for(self, token: str | None) -> KeyEntry:
        """Whose a bearer token is; ApiError 401 when missing or wrong."""
        keys = self.config.keys  # one version of the configuration for the whole check
        if not keys:
            return KeyEntry(OPEN_TENANT)
        if not token:
            raise _unauthorized("missing API key (Authorization: Bearer <key>, or x-api-key: <key>)")
        digest = hashlib.sha256(token.encode()).hexdigest()
        # Compare against every configured digest so timing does not reveal near misses.
        found = None
        for known, entry in keys.items():
            if hmac.compare_digest(known, digest):
                found = entry
        if found is None:
            raise _unauthorized("invalid API key")
        return found

    def tenant_for(self, token: str | None) -> str:
        return self.entry_for(token).tenant

    def announce(self) -> None:
        if self.open:
            banner = "!" * 78
            log.warning(
                "\n%s\n!! OPEN MODE: no API keys configured (FERRY_API_KEYS / FERRY_API_KEYS_FILE).\n"
                "!! Every request is accepted as tenant %r. Do not expose this API publicly.\n%s",
                banner, OPEN_TENANT, banner,
            )
        else:
            log.info("API keys loaded for %d key(s), %d tenant(s)", len(self.config.keys), len(self.config.tenants))


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, "unauthorized", message, headers={"WWW-Authenticate": "Bearer"})


# Declare the two ways to send a key in the OpenAPI schema; the check itself is KeyRing.entry_for.
_bearer = HTTPBearer(auto_error=False)
_x_api_key = APIKeyHeader(name="x-api-key", auto_error=False, description="the API key, as Anthropic's clients send it")


async def caller(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    x_api_key: Annotated[str | None, Depends(_x_api_key)],
) -> KeyEntry:
    """FastAPI dependency: the calling key's entry (async: a sync dependency costs a threadpool hop).
    Two different keys in the two headers are a 401: which one is meant cannot be told."""
    token = credentials.credentials.strip() if credentials else None
    other = x_api_key.strip() if x_api_key else None
    if token and other and token != other:
        raise _unauthorized("Authorization and x-api-key carry different API keys; send one")
    return request.app.state.keyring.entry_for(token or other)


async def tenant(entry: Annotated[KeyEntry, Depends(caller)]) -> str:
    """FastAPI dependency: the calling tenant."""
    return entry.tenant


async def admin(entry: Annotated[KeyEntry, Depends(caller)]) -> KeyEntry:
    """FastAPI dependency: the calling key, which must be an admin key (403 `admin_required`)."""
    if not entry.admin:
        raise ApiError(403, "admin_required", "this route needs an admin API key (admin=true in its configuration)")
    return entry
