"""Loading what a worker serves: the engine (and its tensor-parallel ranks), its operator LoRA
adapters (`worker.serve.loras`), the prefix-cache snapshot restored into it, the engine loop around
it, and the intake's own prompt renderer.

An hf:// or s3:// model downloads into the node's cache on a thread of its own while the engine is
built: the engine starts once the configs and tokenizer are in, and its loader reads each tensor
as its bytes arrive (worker/models/sources/background.py, arriving.py). The load phases
(`ferry_model_load_seconds`) then overlap: `download` is from the download's start (under `ferry
worker`, before the worker's imports: worker/serve/early_start.py) until the whole model is in the
cache; `load` is the engine's construction, from the configs being there (its wait
for weight files included) to the engine built; `warmup` is what follows (snapshot, adapters, renderer).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ferry.worker.engine import Engine
from ferry.worker.models.sources import background, parse_ref
from ferry.worker.serve import loras
from ferry.worker.serve.engine_loop import EngineLoop
from ferry.worker.serve.metrics import WorkerMetrics
from ferry.worker.serve.pacing import BackgroundPacing
from ferry.worker.serve.reasoning_parsers import Reasoning
from ferry.worker.serve.render import PromptRenderer
from ferry.worker.serve.settings import WorkerSettings
from ferry.worker.serve.snapshot_keeper import SnapshotKeeper
from ferry.worker.serve.writes import JobWrite
from ferry.worker.snapshots import SnapshotStats, fingerprint

log = logging.getLogger("ferry.worker")


@dataclass(slots=True)
class Served:
    """Everything loaded to serve one model."""

    engine: Engine
    loop: EngineLoop  # the engine's thread (not started yet)
    renderer: PromptRenderer  # the intake's: a tokenizer of its own
    snapshots: SnapshotKeeper | None  # None without FERRY_SNAPSHOT_URL
    fingerprint: str  # the model's snapshot fingerprint (heartbeat)
    model_limits: dict[str, str]  # what the API checks requests against (vocab size, context)


def load(settings: WorkerSettings, worker_id: str, metrics: WorkerMetrics, submit: Callable[[list[JobWrite]], None],
         snapshot_stats: SnapshotStats) -> Served:
    """Load the engine and restore its snapshot (ValueError for a model or settings it cannot serve;
    RankFailedError when a tensor-parallel rank fails to start)."""
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    started = time.monotonic()
    fetch = _start_fetch(settings)
    model = settings.engine.model if fetch is None else fetch.entry()
    engine_started = time.monotonic()
    try:
        engine = Engine.from_config(dataclasses.replace(settings.engine, model=str(model)))
    except BaseException:
        error = None if fetch is None else fetch.cancel()
        if error is not None:
            raise error from None  # why a weight file never arrived: the source's own error
        raise
    engine_built = time.monotonic()
    try:
        if fetch is not None:
            fetch.result()  # the rest (source.json: the fingerprint's Hub commit) before anything reads it
        snapshots, idle_task = None, None
        if settings.snapshot_url:
            snapshots = SnapshotKeeper(engine, settings.snapshot_url, settings.snapshot_interval_s,
                                       settings.snapshot_max_bytes, settings.snapshot_keep, snapshot_stats,
                                       settings.s3_endpoint_url)
            snapshots.restore()
            idle_task = snapshots.save_if_due
        loras.load_all(engine, loras.operator_entries(settings.lora_modules, settings.served_model_name))
        pacing = BackgroundPacing(settings.background_pause_ratio, settings.background_pause_window_s)
        renderer = PromptRenderer.for_model(engine.model_dir, settings.tool_call_parser)
        reasoning = (None if settings.reasoning_parser is None
                     else Reasoning.for_tokenizer(settings.reasoning_parser, renderer.tokenizer))
        loop = EngineLoop(engine, worker_id, metrics, submit, idle_task, settings.tool_call_parser, pacing, reasoning)
        served = Served(engine, loop, renderer, snapshots, fingerprint(engine),
                        {"vocab_size": str(engine.arch.vocab_size), "max_model_len": str(engine.max_model_len),
                         **renderer.reported()})
    except BaseException:
        engine.close()
        raise
    # Everything loaded so far (torch, transformers, the model: millions of objects) lives as long as
    # the process: kept out of the cyclic collector, a full collection scans only what serving makes.
    # Left in, one took 120-150 ms of the engine thread, held back every first token due meanwhile
    # (bench.api: worker TTFT p50 +100 ms when it fell in a burst's first step).
    gc.collect()
    gc.freeze()
    phases = {"download": 0.0 if fetch is None else fetch.finished - fetch.started,
              "load": engine_built - engine_started, "warmup": time.monotonic() - engine_built}
    for phase, seconds in phases.items():
        metrics.model_load.labels(phase).set(seconds)
    log.info("engine loaded", extra={"model": settings.served_model_name, "fingerprint": served.fingerprint,
                                     "seconds": round(time.monotonic() - started, 2),
                                     **{f"{phase}_s": round(seconds, 2) for phase, seconds in phases.items()}})
    return served


def _start_fetch(settings: WorkerSettings) -> background.BackgroundFetch | None:
    """The download of an hf:// or s3:// model: the one `ferry worker` began before its imports, or
    one started now; None for a model on this machine."""
    ref = parse_ref(str(settings.engine.model))
    if ref is None:
        return None
    max_bytes = None if settings.model_cache_max_gb is None else int(settings.model_cache_max_gb * 1e9)
    return background.take(ref, Path(settings.engine.model_cache_dir).expanduser(), max_bytes)
