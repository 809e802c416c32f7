"""`ferry worker`: one engine fed by Redis Streams, tokens out over pub/sub and a durable event stream.

Threads (the engine's never waits on the network):
- engine (`JobRunner`): admits jobs, steps, hands each step's events to the publisher;
- publisher: one pipelined round trip per batch of steps (`worker.serve.publisher`);
- intake: renews leases, reaps dead workers' jobs, reads the queues while the engine has room,
  decides and starts jobs (`worker.serve.intake`);
- cancel listener (`{p}:cancel`), heartbeat (`{p}:worker:{id}` with a TTL), HTTP (`worker.serve.health`);
- main: signals, idle exit, drain.

Drain (SIGTERM/SIGINT, or idle for `idle_timeout_s`): stop pulling; let running jobs finish for up
to `drain_timeout_s`; hand the rest back to the queue at once (another worker resumes them from
their event streams); snapshot the prefix cache when the engine can and a URL is set; exit 0.
A tensor-parallel rank that dies or hangs ends the engine: its jobs are handed back at once, the
worker drains the same way (no snapshot) and exits with EXIT_ENGINE_FAILED.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import signal
import socket
import threading
import time

from ferry.worker.common.connect import UNAVAILABLE, connect, is_cluster
from ferry.worker.engine.parallel.group import RankFailedError
from ferry.worker.protocol import ENGINE_PRIORITY, Keys, Priority
from ferry.worker.serve import jsonlog
from ferry.worker.serve.health import serve
from ferry.worker.serve.intake import Consumer
from ferry.worker.serve.metrics import WorkerMetrics
from ferry.worker.serve.publisher import Publisher, PublisherThread
from ferry.worker.serve.retry import Stopped, call_with_backoff
from ferry.worker.serve.settings import WorkerSettings
from ferry.worker.serve.writes import Delivery, Discard, Finish, HandBack, JobWrite, Lost, ends_job
from ferry.worker.snapshots.stats import SnapshotCollector, SnapshotStats

log = logging.getLogger("ferry.worker")

MODEL_LIMITS_TTL_S = 7 * 86400  # a model scaled to zero keeps its limits known to the API this long
_FIRST_CHUNK = 8  # jobs of a burst decided and started first, so the engine can start stepping early
_LIVE_ONLY_BLOCK_MS = 50  # blocking read for live jobs while every slot holds a low-lane one
EXIT_ENGINE_FAILED = 3  # a tensor-parallel rank failed: the jobs were handed back, the orchestrator restarts us
_HAND_BACK_WAIT_S = 10.0  # how long a drain waits for hand-backs to reach Redis before leaving them to the reaper


class Worker:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.worker_id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.model = settings.served_model_name
        self.keys = Keys(settings.key_prefix, settings.queue_shards)
        self.client = connect(
            settings.redis_url, cluster=settings.redis_cluster, decode_responses=True, socket_connect_timeout=2.0,
            socket_timeout=max(5.0, settings.read_block_ms / 1000 + 2.0), health_check_interval=5,
        )
        self.metrics = WorkerMetrics()
        self.draining = threading.Event()  # stop pulling new jobs
        self.stop = threading.Event()  # every thread exits
        self.leases: dict[str, Delivery] = {}  # job id -> its queue entry, from start until its last write
        self._leases_lock = threading.Lock()
        self._room = threading.Event()
        self._renew_now = threading.Event()  # renew the leases before the interval runs out (Redis restarted)
        self._redis_run_id: str | None = None  # the Redis server's run id at the last heartbeat
        self._intake_ok_at = 0.0  # monotonic time the intake last went round its loop
        self.model_limits: dict[str, str] = {}  # what the API checks requests against (vocab size, context)
        self._ready = False
        self.engine = None
        self.runner = None
        self.snapshots = None  # SnapshotKeeper when FERRY_SNAPSHOT_URL is set
        self.snapshot_stats = SnapshotStats()  # ferry_snapshot_* (all zero without a snapshot URL)
        self.metrics.registry.register(SnapshotCollector(lambda: self.snapshot_stats))
        self._intake_thread: threading.Thread | None = None
        self.fingerprint = ""
        self.consumer = Consumer(self.client, self.keys, settings, self.worker_id)
        self._low_streams = {self.keys.queue(settings.served_model_name, "low", n) for n in range(self.keys.shards)}
        self.publisher = Publisher(self.client, self.keys, self.model, self.worker_id, settings.result_ttl_s,
                                   settings.redis_min_replicas, settings.redis_replica_timeout_ms)
        self.publisher_thread = PublisherThread(
            self.publisher, self._on_written, self.stop, settings.redis_backoff_max_s
        )

    # --- process -------------------------------------------------------------------------------

    def run(self) -> int:
        threading.excepthook = self._thread_crashed
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._begin_drain("signal"))
        http = serve(self.settings.metrics_host, self.settings.metrics_port, self.metrics.registry, self._is_ready)
        try:
            try:
                self._load_engine()
            except ValueError as exc:  # the model or the engine settings (a bad GGUF, a missing directory)
                log.critical("cannot serve the model: refusing to start",
                             extra={"model": self.settings.engine.model, "error": f"{type(exc).__name__}: {exc}"})
                return 2
            except RankFailedError as exc:  # a tensor-parallel rank died or failed while loading
                log.critical("a tensor-parallel rank failed to start", extra={"error": str(exc)})
                return EXIT_ENGINE_FAILED
            if self.draining.is_set():
                return 0
            self._backoff("ensure groups", self.draining, self.consumer.ensure_groups)
            self._start_threads()
            self._ready = True
            self.metrics.ready.set(1)
            log.info("worker ready", extra={"model": self.model, "max_num_seqs": self.settings.engine.max_num_seqs})
            self._wait_until_drain()
            return self._drain()
        except Stopped:
            return self._drain()
        finally:
            self.stop.set()
            http.shutdown()
            if self.engine is not None:
                self.engine.close()  # stops tensor-parallel ranks

    def _is_ready(self) -> bool:
        """/readyz: loaded, not draining, and the intake went round its loop recently (it is stuck
        in a retry while Redis is unreachable, and then the worker takes no job)."""
        intake_stale_s = max(5.0, 4 * self.settings.read_block_ms / 1000)
        return self._ready and not self.draining.is_set() and time.monotonic() - self._intake_ok_at < intake_stale_s

    def _thread_crashed(self, args: threading.ExceptHookArgs) -> None:
        """A worker thread died: the process cannot keep its promises, so it exits at once (non-zero:
        the orchestrator restarts it). Its jobs are not ACKed; another worker reclaims them after the lease."""
        try:
            log.critical("thread crashed: exiting", exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
                         extra={"thread_name": args.thread.name if args.thread else None})
            logging.shutdown()
        finally:
            os._exit(70)

    def _load_engine(self) -> None:
        import torch

        from ferry.worker.engine import Engine
        from ferry.worker.serve.engine_loop import BackgroundPacing, EngineLoop
        from ferry.worker.serve.snapshot_keeper import SnapshotKeeper
        from ferry.worker.snapshots import fingerprint

        s = self.settings
        if s.torch_threads:
            torch.set_num_threads(s.torch_threads)
        started = time.monotonic()
        engine_config = s.engine
        if engine_config.background_priority is None:  # the low lane is the batch lane: it yields to live prompts
            engine_config = dataclasses.replace(engine_config, background_priority=ENGINE_PRIORITY[Priority.low])
        self.engine = Engine.from_config(engine_config)
        idle_task = None
        if s.snapshot_url:
            self.snapshots = SnapshotKeeper(self.engine, s.snapshot_url, s.snapshot_interval_s, s.snapshot_max_bytes,
                                            s.snapshot_keep, self.snapshot_stats, s.s3_endpoint_url)
            self.snapshots.restore()
            idle_task = self.snapshots.save_if_due
        self.fingerprint = fingerprint(self.engine)
        self.model_limits = {"vocab_size": str(self.engine.arch.vocab_size),
                             "max_model_len": str(self.engine.max_model_len)}
        log.info("engine loaded", extra={"model": self.model, "seconds": round(time.monotonic() - started, 2),
                                         "fingerprint": self.fingerprint})
        pacing = BackgroundPacing(self.settings.background_pause_ratio, self.settings.background_pause_window_s)
        self.runner = EngineLoop(self.engine, self.worker_id, self.metrics, self.publisher_thread.submit, idle_task,
                                 tool_call_parser=self.settings.tool_call_parser, pacing=pacing)

    def _start_threads(self) -> None:
        self.runner.thread.start()
        self.publisher_thread.thread.start()
        self._intake_thread = threading.Thread(target=self._intake, name="intake", daemon=True)
        self._intake_thread.start()
        threading.Thread(target=self._cancel_listener, name="cancel", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True).start()

    def _wait_until_drain(self) -> None:
        idle_since = time.monotonic()
        while not self.draining.wait(0.1):
            if self.runner.fatal is not None:
                self._begin_drain("engine failed")
            elif self.leases or self.runner.runs or self.runner.arriving:
                idle_since = time.monotonic()
            elif (
                self.settings.idle_timeout_s is not None
                and time.monotonic() - idle_since > self.settings.idle_timeout_s
            ):
                self._begin_drain("idle")

    def _begin_drain(self, reason: str) -> None:
        if not self.draining.is_set():
            log.info("drain started", extra={"reason": reason, "jobs": len(self.leases)})
            self.draining.set()
            self._room.set()

    def _drain(self) -> int:
        self._begin_drain("stopped")
        if self.runner is None:
            return 0
        if self._intake_thread is not None and self._intake_thread.is_alive():
            self._intake_thread.join(self.settings.read_block_ms / 1000 + 5.0)
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self.leases and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.leases:
            log.info("handing back jobs", extra={"jobs": len(self.leases)})
            self.runner.hand_back_all()
            deadline = time.monotonic() + _HAND_BACK_WAIT_S
            while self.leases and time.monotonic() < deadline:
                time.sleep(0.02)
        self.runner.stop.set()
        self.runner.thread.join(30.0)
        self.publisher_thread.flush(_HAND_BACK_WAIT_S)
        if self.leases:
            log.warning("jobs left to the reaper", extra={"jobs": sorted(self.leases)})
        self._save_snapshot()
        self.stop.set()
        try:
            self.client.delete(self.keys.worker(self.worker_id))
            self.client.zrem(self.keys.workers, self.worker_id)
        except UNAVAILABLE:
            pass  # the heartbeat key expires by itself
        log.info("drain finished")
        return 0 if self.runner.fatal is None else EXIT_ENGINE_FAILED

    def _save_snapshot(self) -> None:
        """Save the prefix cache on the way out (the engine thread has stopped: safe to touch the engine)."""
        if self.snapshots is not None and self.runner.fatal is None:
            self.snapshots.save_now()

    def _backoff(self, what: str, stop: threading.Event, fn, *args):
        """fn(*args), retried while Redis is unreachable (raises Stopped once `stop` is set)."""
        return call_with_backoff(functools.partial(fn, *args), what=what, stop=stop,
                                 max_delay_s=self.settings.redis_backoff_max_s)

    # --- intake --------------------------------------------------------------------------------

    def _room_now(self) -> tuple[int, int]:
        """(room for jobs of any lane, room for high and normal jobs alone). Live jobs may take
        the place of low-lane ones the worker holds (the engine preempts the batch's requests for
        theirs), up to max_num_seqs live jobs in all."""
        held = list(self.leases.values())
        held_low = sum(d.stream in self._low_streams for d in held)
        max_num_seqs = self.settings.engine.max_num_seqs
        live_room = min(max_num_seqs - (len(held) - held_low), held_low)
        stats = self.runner.stats
        if stats is not None and stats.num_waiting > 0:
            return 0, live_room  # the engine is short of KV: let the queue hold the work
        room = max_num_seqs - len(held)
        return room, max(room, live_room)

    def _intake(self) -> None:
        s = self.settings
        next_renew = next_reap = 0.0
        try:
            while not self.draining.is_set():
                now = time.monotonic()
                self._intake_ok_at = now
                if now >= next_renew or self._renew_now.is_set():
                    self._renew_now.clear()
                    self._backoff("renew leases", self.draining, self._renew)
                    next_renew = now + s.lease_renew_interval_s
                self._room.clear()
                room, live_room = self._room_now()
                if live_room <= 0:
                    self._room.wait(min(0.1, max(0.0, next_renew - now)))
                    continue
                deliveries: list[Delivery] = []
                reap_room = room - self.consumer.in_flight  # blocked reads may still claim that many
                if reap_room > 0 and now >= next_reap:
                    held = {d.entry_id for d in list(self.leases.values())}
                    deliveries = self._backoff("reap", self.draining, self.consumer.reap, reap_room, held)
                    next_reap = now + s.reaper_interval_s
                if not deliveries:
                    block_ms = int(min(s.read_block_ms, 1000 * max(0.001, min(next_renew, next_reap) - now)))
                    # Full of low-lane jobs: read live ones only, which take the batch's places,
                    # in short blocks, so a slot a batch job frees is soon filled again.
                    live_only = room <= 0
                    if live_only:
                        block_ms = min(block_ms, _LIVE_ONLY_BLOCK_MS)
                    deliveries = self._backoff("read queue", self.draining, self.consumer.read,
                                               live_room if live_only else room, block_ms, live_only)
                if deliveries:
                    self._take_safely(deliveries)
        except Stopped:
            pass
        finally:
            self._hand_back_unread()

    def _hand_back_unread(self) -> None:
        """Entries the shard reads still in flight claimed after the intake stopped: back to the
        queue now, not after a lease (another worker takes them at once)."""
        try:
            claimed = self.consumer.settle(self.settings.read_block_ms / 1000)
            back = [HandBack(d.fields["job_id"], d) for d in claimed if d.fields.get("job_id")]
            if back:
                log.info("handing back jobs read during the drain", extra={"jobs": [w.job_id for w in back]})
                self.publisher.write(back)
        except UNAVAILABLE as exc:  # they stay pending under our name: the reaper offers them after the lease
            log.warning("could not hand back the jobs read during the drain: %s", exc)

    def _take_safely(self, deliveries: list[Delivery]) -> None:
        """Start `deliveries` in two chunks: the engine may begin a step with the first while the
        rest are prepared (it waits for them only while its next step is not full). The rest go
        together: each chunk costs two round trips and a hand-over to the engine thread."""
        pending = len(deliveries)
        self.runner.announce(pending)
        try:
            for chunk in (deliveries[:_FIRST_CHUNK], deliveries[_FIRST_CHUNK:]):
                if not chunk:
                    continue
                self._backoff("start jobs", self.draining, self._take, chunk)
                pending -= len(chunk)
        except Stopped:
            raise
        except Exception:
            # A bug or an entry we cannot handle: keep serving. The entries stay pending under our
            # name, so the reaper offers them again after the lease (counting attempts up to the DLQ).
            log.exception("could not take jobs", extra={"entries": [d.entry_id for d in deliveries]})
            self.draining.wait(1.0)
        finally:
            if pending:
                self.runner.settle(pending)

    def _take(self, deliveries: list[Delivery]) -> None:
        """Decide and start `deliveries`; ends by telling the engine they all arrived (started or settled)."""
        if self.draining.is_set():
            # Read after the drain began: give them straight back (another worker takes them now).
            self.publisher.write([HandBack(d.fields["job_id"], d) for d in deliveries if d.fields.get("job_id")])
            self.runner.start([], arrived=len(deliveries))
            return
        fresh, duplicates = [], []
        for d in deliveries:
            (duplicates if d.fields.get("job_id") in self.leases else fresh).append(d)
        starts, writes = self.consumer.prepare(fresh)
        writes += [Discard(d) for d in duplicates]  # a second entry for a job running here
        if writes:
            self._on_written(writes, self.publisher.write(writes))
        for job in starts:
            with self._leases_lock:
                self.leases[job.job_id] = job.delivery
            if job.delivery.reclaimed:
                self.metrics.reclaimed.inc()
            if job.attempts == 1:
                self.metrics.queue_time.observe(job.started_at - job.request.created_at)
            log.info("job reclaimed" if job.delivery.reclaimed else "job picked",
                     extra={"job_id": job.job_id, "attempt": job.attempts, "priority": job.request.priority.value,
                            "resume_tokens": len(job.streamed.token_ids)})
        self.runner.start(starts, arrived=len(deliveries))

    def _renew(self) -> None:
        held = list(self.leases.items())
        lost, cancelled = self.consumer.renew(held)
        for job_id in lost:
            self._release(job_id)
            self.runner.abort(job_id, lost=True)
        for job_id in cancelled - lost:
            self.runner.abort(job_id)

    def _release(self, job_id: str) -> None:
        with self._leases_lock:
            self.leases.pop(job_id, None)
        self._room.set()

    def _on_written(self, writes: list[JobWrite], lost: dict[str, Lost]) -> None:
        """Called once writes reached Redis: ended and handed-back jobs free their slot."""
        for w in writes:
            if not ends_job(w) or w.job_id in lost:
                continue
            if isinstance(w, Finish):
                self.metrics.jobs.labels(w.state).inc()
                code = w.result.get("error_code")
                log.info("job finished", extra={"job_id": w.job_id, "state": w.state, "code": code})
            else:
                self.metrics.handed_back.inc()
                log.info("job handed back", extra={"job_id": w.job_id})
            self._release(w.job_id)
        for job_id, reason in lost.items():
            with self._leases_lock:
                first_report = job_id in self.leases
            if not first_report:  # writes already in flight when the first one found the job lost
                continue
            log.warning("job lost", extra={"job_id": job_id, "reason": reason.value})
            if reason is Lost.RECORD_GONE:
                self.metrics.records_lost.inc()
            self._release(job_id)
            self.runner.abort(job_id, lost=True)

    # --- side threads ---------------------------------------------------------------------------

    def _cancel_listener(self) -> None:
        delay = 0.05
        while not self.stop.is_set():
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.keys.cancel)
                delay = 0.05
                while not self.stop.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message and message["data"] in self.leases:
                        log.info("cancel requested", extra={"job_id": message["data"]})
                        self.runner.abort(message["data"])
            except UNAVAILABLE:
                self.stop.wait(delay)  # cancels missed meanwhile are caught by the lease renewal's flag check
                delay = min(self.settings.redis_backoff_max_s, delay * 2)
            finally:
                pubsub.close()

    def _heartbeat(self) -> None:
        s = self.settings
        while not self.stop.is_set():
            stats = self.runner.stats
            now = time.time()
            beat = {
                "model": self.model,
                "fingerprint": self.fingerprint,
                "load": f"{len(self.leases) / s.engine.max_num_seqs:.3f}",
                "jobs": str(len(self.leases)),
                "running": str(stats.num_running if stats else 0),
                "waiting": str(stats.num_waiting if stats else 0),
                "max_num_seqs": str(s.engine.max_num_seqs),
                "state": "draining" if self.draining.is_set() else "ready",
                "ts": repr(now),
            }
            try:
                pipe = self.client.pipeline(transaction=False)
                pipe.hset(self.keys.worker(self.worker_id), mapping=beat)
                pipe.expire(self.keys.worker(self.worker_id), max(1, int(s.heartbeat_ttl_s)))
                pipe.zadd(self.keys.workers, {self.worker_id: now})
                pipe.zadd(self.keys.models, {self.model: now})
                pipe.hset(self.keys.model_limits(self.model), mapping=self.model_limits)
                pipe.expire(self.keys.model_limits(self.model), MODEL_LIMITS_TTL_S)
                for stream in self.consumer.streams:
                    pipe.xinfo_groups(stream)
                results = pipe.execute(raise_on_error=False)
                groups = results[-len(self.consumer.streams):]
                self.metrics.queue_lag.set(sum(_lag(g) for g in groups))
                if not is_cluster(self.client):  # a cluster's failover promotes a replica that kept the data
                    self._note_run_id(self.client.info("server"))
            except UNAVAILABLE:
                pass  # the intake logs the outage; the key's TTL tells the others
            self.stop.wait(s.heartbeat_interval_s)

    def _note_run_id(self, info) -> None:
        """A Redis that restarted (a new run id) may have come back empty: recreate the consumer
        groups now and renew the leases at once, so jobs whose entries are gone stop here."""
        run_id = info.get("run_id") if isinstance(info, dict) else None
        if run_id is None:
            return
        if self._redis_run_id is not None and run_id != self._redis_run_id:
            log.warning("redis restarted: recreating consumer groups", extra={"run_id": run_id})
            try:
                self.consumer.ensure_groups()
            except UNAVAILABLE:
                return  # the next heartbeat tries again
            self._renew_now.set()
            self._room.set()
        self._redis_run_id = run_id


def _lag(groups) -> int:
    if isinstance(groups, Exception):
        return 0
    return sum(g.get("lag") or 0 for g in groups if g.get("name") == "workers")


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
    worker = Worker(settings)
    jsonlog.configure(worker.worker_id, logging.getLevelName(settings.log_level))
    return worker.run()


if __name__ == "__main__":
    raise SystemExit(main())
