"""The API key configuration: which key is which tenant, and what each tenant may do.

One entry per key, `<sha256 hex of the key>:<tenant>`, optionally followed by `;name=value`
options (comma-separated in FERRY_API_KEYS, or one per line in FERRY_API_KEYS_FILE):

    3f9a…c1:acme;rpm=600;tpm=200000;batch_rpm=6000;batch_tpm=2000000;webhook_secret=whsec_…
    77b0…e2:ops;admin=true

- `rpm` / `tpm`: live requests and tokens per minute (POST /v1/jobs, /v1/chat/completions,
  /v1/completions); `batch_rpm` / `batch_tpm`: the same for the Batch API's lines, a budget of
  its own. An option not given is unlimited.
- `webhook_secret`: a `whsec_` secret signing this tenant's webhooks instead of
  FERRY_WEBHOOK_SECRET; give it twice while rotating: every configured secret signs.
- `admin`: the key may call /v1/admin/* (per key, not per tenant).

Limits and secrets belong to the tenant (its keys share one bucket); they may be written on any
of its keys, and two of its keys naming different values is a configuration error. Both the API
and the webhook worker read this (the webhook worker for the secrets), so it lives in the
protocol package.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

_LIMIT_OPTIONS = ("rpm", "tpm", "batch_rpm", "batch_tpm")


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-minute budgets of one tenant; None is unlimited."""

    rpm: int | None = None  # live requests per minute
    tpm: int | None = None  # live tokens per minute (prompt + max_tokens reserved, corrected at the end)
    batch_rpm: int | None = None  # Batch API lines per minute
    batch_tpm: int | None = None  # Batch API tokens per minute

    def for_budget(self, budget: str) -> tuple[int | None, int | None]:
        """(requests, tokens) per minute of the `live` or `batch` budget."""
        return (self.rpm, self.tpm) if budget == "live" else (self.batch_rpm, self.batch_tpm)


@dataclass(frozen=True, slots=True)
class TenantConfig:
    limits: Limits = field(default_factory=Limits)
    webhook_secrets: tuple[str, ...] = ()  # all sign each delivery; empty: FERRY_WEBHOOK_SECRET


@dataclass(frozen=True, slots=True)
class KeyEntry:
    tenant: str
    admin: bool = False


@dataclass(frozen=True, slots=True)
class KeyConfig:
    keys: dict[str, KeyEntry]  # sha256 hex of a key -> whose it is
    tenants: dict[str, TenantConfig]  # every tenant named by a key

    def tenant(self, name: str) -> TenantConfig:
        return self.tenants.get(name) or TenantConfig()

    @classmethod
    def parse(cls, spec: str | None = None, file: str | None = None) -> KeyConfig:
        """Read FERRY_API_KEYS (`spec`) and FERRY_API_KEYS_FILE (`file`); ValueError names a bad entry."""
        entries: list[str] = []
        if spec:
            entries += spec.split(",")
        if file:
            entries += Path(file).read_text().splitlines()
        keys: dict[str, KeyEntry] = {}
        tenants: dict[str, TenantConfig] = {}
        for raw in entries:
            entry = raw.strip()
            if not entry or entry.startswith("#"):
                continue
            digest, tenant, options = _split(entry)
            admin, config = _options(entry, options)
            keys[digest] = KeyEntry(tenant, admin)
            tenants[tenant] = _merge(entry, tenant, tenants.get(tenant), config)
        return cls(keys, tenants)


def _split(entry: str) -> tuple[str, str, list[str]]:
    digest, sep, rest = entry.partition(":")
    tenant, *options = rest.split(";")
    digest, tenant = digest.strip().lower(), tenant.strip()
    if not sep or not tenant or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"API key entry {_shown(entry)}: expected '<sha256 hex>:<tenant>[;option=value...]'")
    return digest, tenant, options


def _options(entry: str, options: list[str]) -> tuple[bool, TenantConfig | None]:
    admin = False
    limits: dict[str, int] = {}
    secrets: list[str] = []
    for option in options:
        name, sep, value = (part.strip() for part in option.partition("="))
        if not sep or not value:
            raise ValueError(f"API key entry {_shown(entry)}: option {name!r} needs a value (name=value)")
        if name in _LIMIT_OPTIONS:
            if not value.isdigit() or int(value) <= 0:
                raise ValueError(f"API key entry {_shown(entry)}: {name} must be a positive integer")
            limits[name] = int(value)
        elif name == "webhook_secret":
            if not value.startswith("whsec_") or not _base64(value.removeprefix("whsec_")):
                raise ValueError(f"API key entry {_shown(entry)}: webhook_secret must look like 'whsec_<base64>'")
            secrets.append(value)
        elif name == "admin":
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"API key entry {_shown(entry)}: admin must be true or false")
            admin = value.lower() in ("true", "1")
        else:
            known = ", ".join((*_LIMIT_OPTIONS, "webhook_secret", "admin"))
            raise ValueError(f"API key entry {_shown(entry)}: unknown option {name!r} (known: {known})")
    if not limits and not secrets:
        return admin, None
    return admin, TenantConfig(Limits(**limits), tuple(secrets))


def _merge(entry: str, tenant: str, have: TenantConfig | None, new: TenantConfig | None) -> TenantConfig:
    if have is None or new is None:
        return have or new or TenantConfig()
    merged = {}
    for f in fields(Limits):
        a, b = getattr(have.limits, f.name), getattr(new.limits, f.name)
        if a is not None and b is not None and a != b:
            raise ValueError(f"API key entry {_shown(entry)}: tenant {tenant!r} has {f.name}={a} on another key")
        merged[f.name] = a if a is not None else b
    if have.webhook_secrets and new.webhook_secrets and have.webhook_secrets != new.webhook_secrets:
        raise ValueError(f"API key entry {_shown(entry)}: tenant {tenant!r} has other webhook secrets on another key")
    return replace(have, limits=Limits(**merged), webhook_secrets=have.webhook_secrets or new.webhook_secrets)


def _base64(text: str) -> bool:
    try:
        return bool(base64.b64decode(text, validate=True))
    except ValueError:
        return False


def _shown(entry: str) -> str:
    # Never the whole entry: it may hold a webhook secret.
    return f"{entry[:12]!r}…"


def hash_key(key: str) -> str:
    """The digest to put in the configuration for a key handed to a client."""
    return hashlib.sha256(key.encode()).hexdigest()
