"""Small codecs between Redis answers (bytes or str, flat lists) and Python values."""

from __future__ import annotations

import json
from typing import Any


def text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def decoded(mapping: dict) -> dict[str, str]:
    """A hash or stream entry's field map with str keys and values."""
    return {text(k): text(v) for k, v in mapping.items()}


def pairs_to_dict(fields: list | None) -> dict[str, str]:
    """A stream entry's flat [field, value, ...] list (as a script returns it) as a dict."""
    fields = fields or []
    return dict(zip(fields[::2], fields[1::2], strict=True))


def compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
