"""Worker test helpers: a private redis-server, worker subprocesses, and job helpers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import redis

from ferry.worker.protocol import JobRecord, JobRequest, Keys, enqueue_job, event_from_fields

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class RedisServer:
    """A redis-server of our own (no persistence), so a test can stop and restart it."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.directory = directory
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port)
        wait_for(lambda: _pings(client), 10, "redis-server to answer")
        client.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def kill9(self) -> None:
        """Die at once, as a crashed or evicted Redis does (it keeps nothing: the next start is empty)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@dataclass
class WorkerProc:
    worker_id: str
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def sigterm(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    @property
    def http_port(self) -> int:
        import json

        for line in self.log().splitlines():
            if '"http listening"' in line:
                return json.loads(line)["port"]
        raise AssertionError("worker logged no http port")


def start_worker(model_dir: Path, redis_url: str, prefix: str, log_dir: Path, **env) -> WorkerProc:
    worker_id = f"w-{uuid.uuid4().hex[:6]}"
    settings = {
        "FERRY_REDIS_URL": redis_url,
        "FERRY_KEY_PREFIX": prefix,
        "FERRY_MODEL": str(model_dir),
        "FERRY_MODEL_NAME": "tiny",
        "FERRY_WORKER_ID": worker_id,
        "FERRY_METRICS_PORT": "0",
        "FERRY_METRICS_HOST": "127.0.0.1",
        "FERRY_TORCH_THREADS": "1",
        "FERRY_MAX_NUM_SEQS": "4",
        "FERRY_LEASE_S": "4",
        "FERRY_REAPER_INTERVAL_S": "0.5",
        "FERRY_HEARTBEAT_INTERVAL_S": "0.5",
        "FERRY_READ_BLOCK_MS": "200",
        "FERRY_DRAIN_TIMEOUT_S": "0",
        "FERRY_REDIS_BACKOFF_MAX_S": "0.5",
        "FERRY_KV_CACHE_BYTES": str(16 << 20),
    }
    settings.update({k: str(v) for k, v in env.items()})
    log_path = log_dir / f"{worker_id}.log"
    proc = subprocess.Popen([sys.executable, "-m", "ferry.worker.serve.main"], cwd=REPO, env={**os.environ, **settings},
                            stdout=subprocess.DEVNULL, stderr=log_path.open("w"))
    return WorkerProc(worker_id, proc, log_path)


def wait_ready(client: redis.Redis, keys: Keys, workers: list[WorkerProc], timeout: float = 120) -> None:
    for w in workers:
        def ready(w=w):
            if w.proc.poll() is not None:
                raise AssertionError(f"worker {w.worker_id} exited with {w.proc.returncode}:\n{w.log()[-3000:]}")
            return client.hget(keys.worker(w.worker_id), "state") == "ready"

        wait_for(ready, timeout, f"worker {w.worker_id} to be ready", interval=0.2)


def greedy(**fields) -> JobRequest:
    return JobRequest(**{"model": "tiny", "temperature": 0.0, "ignore_eos": True, **fields})


def enqueue(client: redis.Redis, keys: Keys, **fields) -> str:
    return enqueue_job(client, keys, greedy(**fields)).job_id


def record(client: redis.Redis, keys: Keys, job_id: str) -> JobRecord | None:
    return JobRecord.from_redis(client.hgetall(keys.job(job_id)))


def wait_terminal(client: redis.Redis, keys: Keys, job_ids: list[str], timeout: float = 60) -> list[JobRecord]:
    def done():
        records = [record(client, keys, j) for j in job_ids]
        return records if all(r is not None and r.terminal for r in records) else None

    return wait_for(done, timeout, f"{len(job_ids)} jobs to end", interval=0.1)


def events(client: redis.Redis, keys: Keys, job_id: str) -> list:
    return [event_from_fields(fields) for _, fields in client.xrange(keys.events(job_id))]


def assert_seq(evs: list) -> None:
    assert [e.seq for e in evs] == list(range(len(evs))), [(e.seq, e.type) for e in evs]
    assert evs[-1].type in ("completed", "failed", "cancelled", "timed_out")
    assert all(e.type not in ("completed", "failed", "cancelled", "timed_out") for e in evs[:-1])


def streamed_text(evs: list) -> str:
    return "".join(e.text for e in evs if e.type == "token")


def streamed_tokens(evs: list) -> list[int]:
    return [t for e in evs if e.type == "token" for t in e.token_ids]
