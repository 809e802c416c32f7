"""LoRA adapters on the wire: the registry every process reads, and the operator's module list.

An adapter is served by the workers of its base model: a request names the adapter as its `model`,
the API routes it to the base's queue with `JobRequest.lora` set, and whichever worker of that base
takes the job loads the adapter (if it does not hold it yet) and batches it with everything else.

The registry is one hash, `{p}:loras` (`Keys.loras`): adapter name -> `LoraEntry` as JSON. Workers
write their operator adapters (`FERRY_LORA_MODULES`, source `operator`) at start; the admin route
`POST /v1/load_lora_adapter` writes runtime ones (source `runtime`), which stay until unloaded. The
API reads it to route a request and to list adapters in `/v1/models`; a worker reads it to find a
job's adapter.

`FERRY_LORA_MODULES` takes vLLM's forms: `name=ref,name2=ref2`; one JSON object per entry
(`{"name": ..., "path": ..., "base_model_name": ...}`); or a JSON list of such objects.
"""

from __future__ import annotations

import json
import re
import time
from typing import Annotated, Literal

import redis
import redis.asyncio as aredis
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, ValidationError

from ferry.worker.protocol.fields import ModelName
from ferry.worker.protocol.keys import Keys

# The shapes of an adapter's location the API accepts before anything is stored. The worker's loader
# (`worker.models.sources.parse_ref`) reads them fully when it loads the adapter.
_S3 = re.compile(r"s3://[a-z0-9][a-z0-9.\-]{1,62}(/.*)?")
_HF = re.compile(r"hf://[\w.\-]+/[\w.\-]+/?(@[\w.\-/]+)?")


def lora_path_problem(path: str) -> str | None:
    """Why `path` cannot name an adapter (None: it can): an absolute local directory, `s3://bucket/prefix/`
    or `hf://org/name[@revision]`."""
    if path.startswith("s3://"):
        return None if _S3.fullmatch(path) else f"{path!r} is not s3://bucket/prefix/"
    if path.startswith("hf://"):
        return None if _HF.fullmatch(path) else f"{path!r} is not hf://org/name[@revision]"
    if "://" in path:
        return f"{path!r}: only local paths, s3:// and hf:// are supported"
    if not path.startswith("/"):
        return f"{path!r} is not an absolute path"
    return None


def _check_path(path: str) -> str:
    problem = lora_path_problem(path)
    if problem is not None:
        raise ValueError(problem)
    return path


LoraPath = Annotated[str, Strict(), Field(min_length=1, max_length=4096), AfterValidator(_check_path)]


class LoraEntry(BaseModel):
    """One adapter in the registry."""

    model_config = ConfigDict(extra="forbid")

    name: ModelName  # what a request's `model` names it by
    base_model: ModelName  # the served model it applies to: its jobs go to that model's queue
    path: LoraPath  # local directory, s3:// or hf:// reference (`lora_path_problem`)
    tenants: list[str] | None = None  # who may use and see it; None: every tenant
    source: Literal["operator", "runtime"]  # FERRY_LORA_MODULES of a worker, or the admin route
    created_at: float = Field(default_factory=time.time)

    def visible_to(self, tenant: str) -> bool:
        return self.tenants is None or tenant in self.tenants


class LoraModule(BaseModel):
    """One entry of FERRY_LORA_MODULES (vLLM's `--lora-modules`)."""

    model_config = ConfigDict(extra="forbid")

    name: ModelName
    path: LoraPath
    base_model_name: ModelName | None = None  # must be the worker's served model when given


def parse_lora_modules(text: str | None) -> list[LoraModule]:
    """FERRY_LORA_MODULES as a list (ValueError naming the entry that does not parse, or a name given twice)."""
    text = (text or "").strip()
    if not text:
        return []
    if text.startswith("["):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"FERRY_LORA_MODULES: not a JSON list ({exc})") from None
        if not isinstance(raw, list):
            raise ValueError("FERRY_LORA_MODULES: a JSON list of {name, path} objects")
        modules = [_module(item, json.dumps(item)) for item in raw]
    else:
        modules = [_entry(part.strip()) for part in _split(text) if part.strip()]
    seen: set[str] = set()
    for module in modules:
        if module.name in seen:
            raise ValueError(f"FERRY_LORA_MODULES: adapter {module.name!r} is named twice")
        seen.add(module.name)
    return modules


def _split(text: str) -> list[str]:
    """Entries separated by commas outside JSON objects (a JSON entry holds commas of its own)."""
    parts, depth, start, quoted, escaped = [], 0, 0, False, False
    for i, char in enumerate(text):
        if escaped:
            escaped = False
        elif quoted:
            escaped, quoted = char == "\\", char != '"'
        elif char == '"':
            quoted = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def _entry(part: str) -> LoraModule:
    if part.startswith("{"):
        try:
            return _module(json.loads(part), part)
        except json.JSONDecodeError as exc:
            raise ValueError(f"FERRY_LORA_MODULES: entry {part!r} is not JSON ({exc})") from None
    name, sep, path = part.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"FERRY_LORA_MODULES: entry {part!r} is not name=path")
    return _module({"name": name.strip(), "path": path.strip()}, part)


def _module(raw: object, text: str) -> LoraModule:
    try:
        return LoraModule.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'entry'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"FERRY_LORA_MODULES: entry {text!r}: {problems}") from None


# --- the registry (`{p}:loras`) ---------------------------------------------------------------------


def decode_lora(raw: str | bytes | None) -> LoraEntry | None:
    """An entry, or None for a missing or unreadable one (an entry another version wrote)."""
    if raw is None:
        return None
    try:
        return LoraEntry.model_validate_json(raw)
    except ValidationError:
        return None


def write_loras(client: redis.Redis, keys: Keys, entries: list[LoraEntry]) -> None:
    """Write (or overwrite) `entries`: a worker's operator adapters at start."""
    if entries:
        client.hset(keys.loras, mapping={e.name: e.model_dump_json() for e in entries})


def read_lora(client: redis.Redis, keys: Keys, name: str) -> LoraEntry | None:
    return decode_lora(client.hget(keys.loras, name))


async def read_lora_async(client: aredis.Redis, keys: Keys, name: str) -> LoraEntry | None:
    return decode_lora(await client.hget(keys.loras, name))


async def add_lora_async(client: aredis.Redis, keys: Keys, entry: LoraEntry) -> LoraEntry:
    """Register `entry` unless the name is taken: the entry now under the name (`entry` itself, or the
    one already there, which the caller compares)."""
    if await client.hsetnx(keys.loras, entry.name, entry.model_dump_json()):
        return entry
    existing = await read_lora_async(client, keys, entry.name)
    if existing is None:  # unreadable: the new entry replaces it
        await client.hset(keys.loras, entry.name, entry.model_dump_json())
        return entry
    return existing


async def remove_lora_async(client: aredis.Redis, keys: Keys, name: str) -> bool:
    return bool(await client.hdel(keys.loras, name))
