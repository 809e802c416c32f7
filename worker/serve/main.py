"""`ferry worker`: one engine fed by Redis Streams, tokens out over pub/sub and a durable event stream.

`Worker` only wires the parts, each a thread of its own (the engine's never waits on the network):
- engine loop (`worker.serve.engine_loop`): admits jobs, steps, hands each step's writes over;
- publisher (`worker.serve.publisher`): one pipelined round trip per batch of steps;
- intake (`worker.serve.intake`): renews leases, reaps dead workers' jobs, reads the queues while
  the engine has room, decides, starts and renders jobs;
- heartbeat and cancel listener (`worker.serve.components`), HTTP (`worker.serve.health`);
- main: signals, idle exit, drain.

Drain (SIGTERM/SIGINT, or idle for `idle_timeout_s`): stop pulling; let running jobs finish for up
to `drain_timeout_s`; hand the rest back to the queue at once (another worker resumes them from
their event streams); snapshot the prefix cache when the engine can and a URL is set; exit 0.
A tensor-parallel rank that dies or hangs ends the engine: its jobs are handed back at once, the
worker drains the same way (no snapshot) and exits with EXIT_ENGINE_FAILED.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time

from ferry.worker.common.connect import UNAVAILABLE, connect
from ferry.worker.common.tracing import TracingConfigError, tracing_from_env
from ferry.worker.engine import RankFailedError
from ferry.worker.protocol import Keys
from ferry.worker.serve import jsonlog, loras, startup
from ferry.worker.serve.components import CancelListener, Component, Heartbeat
from ferry.worker.serve.health import serve
from ferry.worker.serve.intake import Intake
from ferry.worker.serve.job_starts import JobStarter
from ferry.worker.serve.job_trace import JobTracer
from ferry.worker.serve.lora_affinity import LoraAffinity
from ferry.worker.serve.metrics import WorkerMetrics
from ferry.worker.serve.publisher import Publisher, PublisherThread
from ferry.worker.serve.retry import RetryAbandoned, call_with_backoff
from ferry.worker.serve.settings import WorkerSettings
from ferry.worker.serve.writes import JobWrite, Lost
from ferry.worker.snapshots.stats import SnapshotCollector, SnapshotStats

log = logging.getLogger("ferry.worker")

EXIT_ENGINE_FAILED = 3  # a tensor-parallel rank failed: the jobs were handed back, the orchestrator restarts us
_HAND_BACK_WAIT_S = 10.0  # how long a drain waits for hand-backs to reach Redis before leaving them to the reaper


class Worker:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.worker_id: str = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.keys = Keys(settings.key_prefix, settings.queue_shards)
        self.client = connect(
            settings.redis_url, cluster=settings.redis_cluster, decode_responses=True, socket_connect_timeout=2.0,
            socket_timeout=max(5.0, settings.read_block_ms / 1000 + 2.0), health_check_interval=5,
        )
        self.metrics = WorkerMetrics()
        self.snapshot_stats = SnapshotStats()  # ferry_snapshot_* (all zero without a snapshot URL)
        self.metrics.registry.register(SnapshotCollector(lambda: self.snapshot_stats))
        self.draining = threading.Event()  # stop pulling new jobs
        self.stop = threading.Event()  # the publisher exits
        self.publisher = Publisher(self.client, self.keys, settings.served_model_name, self.worker_id,
                                   settings.result_ttl_s, settings.redis_min_replicas,
                                   settings.redis_replica_timeout_ms)
        self.tracing = tracing_from_env("ferry-worker")  # None unless OTEL_* names an endpoint
        self.tracer = JobTracer(self.tracing, settings.served_model_name, self.worker_id) if self.tracing else None
        self.publisher_thread = PublisherThread(self.publisher, self._on_written, self.stop,
                                                settings.redis_backoff_max_s, self.tracer)
        self.served: startup.Served | None = None  # once loaded
        self.intake: Intake | None = None  # once loaded
        self.components: list[Component] = []  # started once ready, stopped last first
        self._ready = False

    # --- process -------------------------------------------------------------------------------

    def run(self) -> int:
        threading.excepthook = self._thread_crashed
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._begin_drain("signal"))
        http = serve(self.settings.metrics_host, self.settings.metrics_port, self.metrics.registry, self._is_ready)
        try:
            try:
                self.served = startup.load(self.settings, self.worker_id, self.metrics, self.publisher_thread.submit,
                                           self.snapshot_stats)
            except ValueError as exc:  # the model or the engine settings (a bad GGUF, a missing directory)
                log.critical("cannot serve the model: refusing to start",
                             extra={"model": self.settings.engine.model, "error": f"{type(exc).__name__}: {exc}"})
                return 2
            except RankFailedError as exc:  # a tensor-parallel rank died or failed while loading
                log.critical("a tensor-parallel rank failed to start", extra={"error": str(exc)})
                return EXIT_ENGINE_FAILED
            if self.draining.is_set():
                return 0
            self._start()
            log.info("worker ready", extra={"model": self.settings.served_model_name,
                                            "max_num_seqs": self.settings.engine.max_num_seqs})
            self._wait_until_drain()
            return self._drain()
        except RetryAbandoned:
            return self._drain()
        finally:
            self.stop.set()
            self._stop_components()
            http.shutdown()
            if self.served is not None:
                self.served.engine.close()  # stops tensor-parallel ranks
            if self.tracing is not None:
                self.tracer.close()
                self.tracing.shutdown()

    def _start(self) -> None:
        """Wire the intake and the side components to the loaded engine, start every thread, turn ready."""
        served, s = self.served, self.settings
        affinity = LoraAffinity.for_worker(self.client, self.keys, s, self.worker_id, served.loop, self.metrics)
        starter = JobStarter(self.client, self.keys, s, self.worker_id, served.renderer, self.tracer, affinity)
        self.intake = intake = Intake(self.client, self.keys, s, self.worker_id, starter, served.loop, self.publisher,
                                      self.metrics, self.draining)
        call_with_backoff(intake.reader.ensure_groups, what="ensure groups", stop=self.draining,
                          max_delay_s=s.redis_backoff_max_s)
        adapters = loras.operator_entries(s.lora_modules, s.served_model_name)
        call_with_backoff(lambda: loras.register(self.client, self.keys, adapters), what="register LoRA adapters",
                          stop=self.draining, max_delay_s=s.redis_backoff_max_s)
        served.loop.thread.start()
        self.publisher_thread.thread.start()
        intake.thread.start()
        self.components = [
            CancelListener(self.client, self.keys, intake, served.loop, s.redis_backoff_max_s),
            Heartbeat(self.client, self.keys, s, self.worker_id, served.fingerprint, served.model_limits, served.loop,
                      intake, self.metrics, self.draining.is_set),
        ]
        for component in self.components:
            component.start()
        self._ready = True
        self.metrics.ready.set(1)

    def _stop_components(self) -> None:
        for component in reversed(self.components):
            component.stop()
        self.components = []

    def _on_written(self, writes: list[JobWrite], lost: dict[str, Lost]) -> None:
        if self.intake is not None:
            self.intake.on_written(writes, lost)

    def _is_ready(self) -> bool:
        """/readyz: loaded, not draining, and the intake went round its loop recently (it is stuck
        in a retry while Redis is unreachable, and then the worker takes no job)."""
        intake_stale_s = max(5.0, 4 * self.settings.read_block_ms / 1000)
        return (self._ready and not self.draining.is_set()
                and time.monotonic() - self.intake.ok_at < intake_stale_s)

    def _thread_crashed(self, args: threading.ExceptHookArgs) -> None:
        """A worker thread died: the process cannot keep its promises, so it exits at once (non-zero:
        the orchestrator restarts it). Its jobs are not ACKed; another worker reclaims them after the lease."""
        try:
            log.critical("thread crashed: exiting", exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
                         extra={"thread_name": args.thread.name if args.thread else None})
            logging.shutdown()
        finally:
            os._exit(70)

    def _wait_until_drain(self) -> None:
        loop, intake, idle_since = self.served.loop, self.intake, time.monotonic()
        while not self.draining.wait(0.1):
            if loop.fatal is not None:
                self._begin_drain("engine failed")
            elif intake.leases or loop.runs or loop.arriving:
                idle_since = time.monotonic()
            elif (idle_s := self.settings.idle_timeout_s) is not None and time.monotonic() - idle_since > idle_s:
                self._begin_drain("idle")

    def _begin_drain(self, reason: str) -> None:
        if not self.draining.is_set():
            log.info("drain started", extra={"reason": reason, "jobs": len(self.intake.leases) if self.intake else 0})
            self.draining.set()
            if self.intake is not None:
                self.intake.wake()

    def _drain(self) -> int:
        self._begin_drain("stopped")
        if self.intake is None:
            return 0
        loop, leases = self.served.loop, self.intake.leases
        self.intake.thread.join(self.settings.read_block_ms / 1000 + 5.0)
        _wait_until_empty(leases, self.settings.drain_timeout_s)
        if leases:
            log.info("handing back jobs", extra={"jobs": len(leases)})
            loop.hand_back_all()
            _wait_until_empty(leases, _HAND_BACK_WAIT_S)
        loop.stop.set()
        loop.thread.join(30.0)
        self.publisher_thread.flush(_HAND_BACK_WAIT_S)
        if leases:
            log.warning("jobs left to the reaper", extra={"jobs": sorted(leases)})
        if self.served.snapshots is not None and loop.fatal is None:
            self.served.snapshots.save_now()  # the engine thread has stopped: safe to touch the engine
        self.stop.set()
        self._stop_components()  # no heartbeat after the worker's key is gone
        try:
            self.client.delete(self.keys.worker(self.worker_id))
            self.client.zrem(self.keys.workers, self.worker_id)
        except UNAVAILABLE:
            pass  # the heartbeat key expires by itself
        log.info("drain finished")
        return 0 if loop.fatal is None else EXIT_ENGINE_FAILED


def _wait_until_empty(leases: dict, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while leases and time.monotonic() < deadline:
        time.sleep(0.02)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ferry worker", description="Run a worker: Redis Streams in, tokens out. "
                                "Every option also reads FERRY_<NAME> from the environment.")
    p.add_argument("--model", help="model directory (FERRY_MODEL)")
    p.add_argument("--model-name", help="served model name (default: the directory's name)")
    p.add_argument("--redis-url")
    p.add_argument("--key-prefix")
    p.add_argument("--worker-id")
    p.add_argument("--dtype")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--metrics-port", type=int, help="port of /healthz, /readyz, /metrics (0: any free port)")
    p.add_argument("--idle-timeout-s", type=float, help="exit after this long with nothing to do")
    p.add_argument("--drain-timeout-s", type=float)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = vars(_parse(argv))
    given = {k: v for k, v in args.items() if v is not None}
    engine = {k: given.pop(k) for k in ("model", "dtype", "max_num_seqs") if k in given}
    settings = WorkerSettings(**given, **({"engine": engine} if engine else {}))
    try:
        worker = Worker(settings)
    except TracingConfigError as exc:
        print(f"ferry worker: {exc}", file=sys.stderr)
        return 2
    jsonlog.configure(worker.worker_id, logging.getLevelName(settings.log_level))
    return worker.run()


if __name__ == "__main__":
    raise SystemExit(main())
