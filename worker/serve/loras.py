"""LoRA adapters in a worker (docs/lora.md): its operator adapters registered and loaded at start,
and each job's adapter found in the registry (`worker.protocol.loras`).

A job names its adapter (`JobRequest.lora`); the intake looks the name up in `{p}:loras` (one HMGET
per batch of deliveries for the names it has not read within `CACHE_S`) before it starts the jobs,
so the engine thread never waits on Redis. A job whose adapter is not registered for this worker's
model, or that reaches a worker without LoRA, fails with `lora_not_found`; one whose adapter does not
load fails with `lora_load_failed` (the engine's `LoraAdapterError`, `worker.serve.errors`).
"""

from __future__ import annotations

import logging
import time

import redis

from ferry.worker.engine import Engine, LoRARequest
from ferry.worker.engine.errors import LoraAdapterError
from ferry.worker.protocol import Keys
from ferry.worker.protocol.loras import LoraEntry, LoraModule, decode_lora, write_loras

log = logging.getLogger("ferry.worker.loras")

CACHE_S = 1.0  # a registry entry read this recently is not read again (an unloaded adapter fails within this)


def operator_entries(modules: list[LoraModule], model: str) -> list[LoraEntry]:
    """FERRY_LORA_MODULES as registry entries of the served model `model`."""
    return [LoraEntry(name=m.name, base_model=model, path=m.path, source="operator") for m in modules]


def register(client: redis.Redis, keys: Keys, entries: list[LoraEntry]) -> None:
    """Write the operator adapters into the registry (an entry of the same name is replaced)."""
    write_loras(client, keys, entries)
    if entries:
        log.info("LoRA adapters registered", extra={"loras": [e.name for e in entries]})


def load_all(engine: Engine, entries: list[LoraEntry]) -> list[str]:
    """Load each adapter into the engine now; one that does not load is logged and skipped (its jobs
    fail with `lora_load_failed`, the rest of the worker serves on). The names that loaded."""
    loaded = []
    for entry in entries:
        try:
            engine.add_lora(LoRARequest(entry.name, 0, entry.path))
        except LoraAdapterError as exc:
            log.error("LoRA adapter not loaded: its jobs will fail",
                      extra={"lora": entry.name, "path": entry.path, "error": str(exc)})
            continue
        loaded.append(entry.name)
    return loaded


class LoraUnavailable(Exception):
    """A job's adapter this worker cannot serve; the message says why."""


class LoraResolver:
    """A job's adapter as the engine takes it, from the registry through a short cache (intake thread)."""

    def __init__(self, client: redis.Redis, keys: Keys, model: str, enabled: bool) -> None:
        self.client, self.keys = client, keys
        self.model = model  # the served model: an adapter of another base is not this worker's
        self.enabled = enabled  # the engine was built with LoRA (FERRY_ENABLE_LORA)
        self._entries: dict[str, tuple[float, LoraEntry | None]] = {}  # name -> (monotonic read time, entry)

    def prefetch(self, names: set[str]) -> None:
        """Read the entries of `names` not read within CACHE_S, in one round trip (redis errors propagate)."""
        now = time.monotonic()
        stale = sorted(n for n in names if now - self._entries.get(n, (float("-inf"), None))[0] > CACHE_S)
        if self.enabled and stale:
            for name, raw in zip(stale, self.client.hmget(self.keys.loras, stale), strict=True):
                self._entries[name] = (now, decode_lora(raw))

    def request_for(self, name: str) -> LoRARequest:
        """The adapter `name` as a LoRARequest (`prefetch` read it); LoraUnavailable: this worker cannot serve it."""
        if not self.enabled:
            raise LoraUnavailable(f"LoRA adapter {name!r}: this worker of {self.model!r} runs without LoRA "
                                  "(FERRY_ENABLE_LORA)")
        entry = self._entries.get(name, (0.0, None))[1]
        if entry is None:
            raise LoraUnavailable(f"LoRA adapter {name!r} is not registered")
        if entry.base_model != self.model:
            raise LoraUnavailable(f"LoRA adapter {name!r} is an adapter of {entry.base_model!r}, not of {self.model!r}")
        return LoRARequest(entry.name, 0, entry.path)
