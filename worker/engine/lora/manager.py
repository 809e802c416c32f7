"""Which adapters the engine holds, and where.

Three tiers, as in vLLM and S-LoRA:
- files: the adapter's directory, or its copy in the node's model cache (an s3:// or hf:// ref,
  downloaded once per node);
- host memory: adapters read and checked (`lora_adapter.read_adapter`), up to
  `host_capacity`. Reading happens on loader threads, never on the engine's: a request whose
  adapter is not in memory waits (`Request.awaiting_lora`) while the batch goes on without it.
  Memory holds the adapters the waiting requests need first, in the scheduler's order
  (`poll`): only those are read, and only others are dropped to make room, least recently used
  first (an adapter in a slot needs no host copy). So an adapter read for a waiting request stays until that request
  runs (it is never read twice while it waits), and a queue of many adapters is read a window at
  a time instead of all at once;
- device slots: `max_loras` of them in the model (worker/models/lora_layers.py). A request is
  admitted only with its adapter in a slot (`acquire`); a slot no running request uses is
  reused for another adapter, least recently used first. Copying an adapter into a slot is a
  few small copies, done on the engine thread between steps.

Each adapter's KV lives in its own prefix-cache namespace (the adapter's content digest joins
the model salt), so no block is shared across adapters, or between an adapter and the base.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from ferry.worker.engine.errors import LoraAdapterError
from ferry.worker.engine.kv_cache import cache_extra
from ferry.worker.engine.lora.request import LoRARequest
from ferry.worker.engine.request import Request
from ferry.worker.models.config import ModelArch
from ferry.worker.models.loader import local_model
from ferry.worker.models.lora_adapter import LoraWeights, read_adapter

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (name, path): LoRARequest.key
_LOADER_THREADS = 4  # adapters read at once (downloads and file reads: mostly waiting on I/O)


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    lora: LoRARequest
    directory: Path  # the local copy (what tensor-parallel ranks read their shards from)
    weights: LoraWeights


@dataclass(slots=True)
class LoraStats:
    host_loads: int = 0  # adapters read into host memory
    slot_loads: int = 0  # adapters copied into a device slot
    load_failures: int = 0


class LoraManager:
    def __init__(self, executor, arch: ModelArch, dtype: torch.dtype, model_salt: str, max_loras: int,
                 max_rank: int, host_capacity: int, cache_dir: str) -> None:
        self._executor = executor  # write_lora(slot, LoadedAdapter) / clear_lora(slot) on every rank
        self._arch, self._dtype, self._model_salt = arch, dtype, model_salt
        self.max_rank, self.host_capacity, self._cache_dir = max_rank, host_capacity, cache_dir
        self._loaded: OrderedDict[Key, LoadedAdapter] = OrderedDict()  # host memory, least recent first
        self._loading: dict[Key, Future] = {}
        self._slot_key: list[Key | None] = [None] * max_loras
        self._slot_refs = [0] * max_loras  # running requests using each slot
        self._slot_of: dict[Key, int] = {}
        self._slot_fingerprint: dict[Key, str] = {}  # of each adapter in a slot (its host copy may be gone)
        self._slot_lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))
        self._pool = ThreadPoolExecutor(max_workers=_LOADER_THREADS, thread_name_prefix="lora-load")
        self._protected: set[Key] = set()  # adapters the next waiting requests need: never dropped
        self.stats = LoraStats()

    # --- loading ---------------------------------------------------------------------------------

    def load_now(self, lora: LoRARequest) -> None:
        """Read an adapter into host memory now (LoraAdapterError says why it cannot serve)."""
        if lora.key not in self._loaded:
            self._keep(self._read(lora))

    def prepare(self, request: Request) -> None:
        """A new request's adapter: ready if in memory; otherwise `poll` starts reading it when it
        is among the adapters the waiting requests need first."""
        fingerprint = self._fingerprint(request.lora.key)
        if fingerprint is not None:
            self._ready(request, fingerprint)

    def poll(self, waiting: list[Request]) -> list[tuple[Request, LoraAdapterError]]:
        """Take in the loads that finished; start reading the adapters the first waiting requests
        (scheduler order) need, as far as host memory goes; mark the waiting requests whose adapter
        is in memory ready. Returns the requests whose adapter failed to load, with why (they end alone)."""
        failures: dict[Key, LoraAdapterError] = {}
        for key, future in list(self._loading.items()):
            if future.done():
                del self._loading[key]
                error = future.exception()
                if error is None:
                    self._keep(future.result())
                else:
                    self.stats.load_failures += 1
                    failures[key] = error if isinstance(error, LoraAdapterError) else LoraAdapterError(str(error))
        # The adapters memory keeps for the waiting requests, in their order. (One in a slot needs
        # no host copy: the slot holds it, and a request for it takes the slot as it is.)
        wanted: dict[Key, LoRARequest] = {}
        for request in waiting:
            if len(wanted) >= self.host_capacity:
                break
            if request.lora is not None and request.lora.key not in self._slot_of and request.lora.key not in failures:
                wanted.setdefault(request.lora.key, request.lora)
        self._protected = set(wanted)
        for key, lora in wanted.items():
            if key in self._loaded or key in self._loading:
                continue
            self._make_room(1)
            if len(self._loaded) + len(self._loading) >= self.host_capacity:
                break  # memory is full of adapters wanted sooner
            self._loading[key] = self._pool.submit(self._read, lora)
        failed = []
        for request in waiting:
            if not request.awaiting_lora:
                continue
            key = request.lora.key
            if key in failures:
                failed.append((request, failures[key]))
            elif (fingerprint := self._fingerprint(key)) is not None:
                self._ready(request, fingerprint)
        return failed

    def _fingerprint(self, key: Key) -> str | None:
        """The adapter's content digest, when it is in memory or in a slot (else None: not read yet)."""
        if key in self._loaded:
            return self._loaded[key].weights.fingerprint
        return self._slot_fingerprint.get(key)

    def wait(self, timeout_s: float) -> None:
        """Block until some adapter finishes loading, at most `timeout_s` (a step with nothing to run)."""
        if self._loading:
            wait(list(self._loading.values()), timeout_s, FIRST_COMPLETED)

    def _read(self, lora: LoRARequest) -> LoadedAdapter:
        """On the loader thread: the adapter's files (downloaded for a reference) read and checked."""
        try:
            directory = Path(local_model(lora.lora_path, self._cache_dir))
            if not directory.is_dir():
                raise LoraAdapterError(f"{directory} is not a directory")
            weights = read_adapter(directory, self._arch, self.max_rank, self._dtype)
        except Exception as exc:  # a missing path, a download's failure, a refused adapter: all one error
            cause = str(exc) if isinstance(exc, LoraAdapterError) else f"{type(exc).__name__}: {exc}"
            raise LoraAdapterError(f"LoRA adapter {lora.lora_name!r} ({lora.lora_path}): {cause}") from None
        self.stats.host_loads += 1
        log.info("LoRA adapter %s loaded from %s: rank %d, %s, %.1f MiB", lora.lora_name, lora.lora_path,
                 weights.rank, ", ".join(sorted(weights.projections)), weights.nbytes / 2**20)
        return LoadedAdapter(lora, directory, weights)

    def _keep(self, adapter: LoadedAdapter) -> None:
        self._loaded[adapter.lora.key] = adapter
        self._loaded.move_to_end(adapter.lora.key)
        self._make_room(0)

    def _make_room(self, more: int) -> None:
        """Drop adapters, least recently used first, until `more` fit beside the loaded and loading
        ones; never one the next waiting requests want (memory may then stay over `host_capacity`
        by what add_lora loaded on request)."""
        while len(self._loaded) + len(self._loading) + more > self.host_capacity:
            victim = next((k for k in self._loaded if k not in self._protected), None)
            if victim is None:
                return
            del self._loaded[victim]

    def _ready(self, request: Request, fingerprint: str) -> None:
        """The request's KV goes into the adapter's own prefix-cache namespace (by its content)."""
        salt, cache_salt = f"{self._model_salt}|lora:{fingerprint}", request.params.cache_salt
        request.cache_extra = cache_extra(salt, cache_salt)
        if request.long_rope_after is not None:
            request.long_rope_cache_extra = cache_extra(f"{salt}|longrope-long", cache_salt)
            if request.rope_long:
                request.cache_extra = request.long_rope_cache_extra
        request.block_keys.clear()
        request.lora_ready = True

    # --- slots -----------------------------------------------------------------------------------

    def acquire(self, request: Request) -> bool:
        """Give a request its adapter's slot, copying the adapter in where needed. False when
        every slot is in use by running requests of other adapters (it stays waiting)."""
        key = request.lora.key
        slot = self._slot_of.get(key)
        if slot is None:
            adapter = self._loaded.get(key)
            if adapter is None:  # its slot was refilled and its host copy dropped since: poll reads it again
                request.lora_ready = False
                return False
            slot = next((s for s in self._slot_lru if self._slot_refs[s] == 0), None)
            if slot is None:
                return False
            old = self._slot_key[slot]
            if old is not None:
                del self._slot_of[old], self._slot_fingerprint[old]
            self._executor.write_lora(slot, adapter)
            self._slot_key[slot], self._slot_of[key] = key, slot
            self._slot_fingerprint[key] = adapter.weights.fingerprint
            self.stats.slot_loads += 1
        self._slot_refs[slot] += 1
        self._slot_lru.move_to_end(slot)
        if key in self._loaded:
            self._loaded.move_to_end(key)
        request.lora_slot = slot
        return True

    def release(self, request: Request) -> None:
        """The request stopped running (finished or preempted): it no longer holds its slot."""
        if request.lora_slot >= 0:
            self._slot_refs[request.lora_slot] -= 1
            request.lora_slot = -1

    # --- what is held ----------------------------------------------------------------------------

    def remove(self, name: str) -> bool:
        """Forget every adapter of this name: from host memory, and from slots no request uses."""
        keys = {k for k in (*self._loaded, *self._slot_of) if k[0] == name}
        for key in keys:
            self._loaded.pop(key, None)
            slot = self._slot_of.get(key)
            if slot is not None and self._slot_refs[slot] == 0:
                self._executor.clear_lora(slot)
                del self._slot_of[key], self._slot_fingerprint[key]
                self._slot_key[slot] = None
        return bool(keys)

    def held(self) -> list[str]:
        """Names of the adapters in host memory or in a slot."""
        return sorted({k[0] for k in (*self._loaded, *self._slot_of)})

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
