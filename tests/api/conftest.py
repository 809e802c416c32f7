"""The real stack for API tests: Redis, `ferry worker` on a tiny model, `ferry api` under uvicorn,
`ferry webhooks` (Celery), each a subprocess, on a key prefix of its own; and a real local HTTP
receiver for webhooks on 127.0.0.1."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from ferry.worker.webhooks.signing import new_secret
from tests.webhooks.receiver import receiver  # noqa: F401 (a fixture the webhook tests use)

REDIS_URL = "redis://127.0.0.1:6379/0"
KEY_A, KEY_B = "sk-ferrytest-tenant-a", "sk-ferrytest-tenant-b"
MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_prefix() -> str:
    return f"ferrytest-{uuid.uuid4().hex}"


def delete_prefix(prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(f"{prefix}:*", count=1000):
        client.delete(key)
    client.close()


def api_keys_setting() -> str:
    return ",".join(
        f"{hashlib.sha256(k.encode()).hexdigest()}:{t}" for k, t in ((KEY_A, "tenant-a"), (KEY_B, "tenant-b"))
    )


class Proc:
    """A `ferry <command>` subprocess in its own session, its output in a log file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "ferry.worker.cli", *args], env=env, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 15.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()
        return self.popen.returncode


def wait_until(predicate, timeout: float, what: str, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            proc.check_alive()
        with contextlib.suppress(httpx.HTTPError):
            if predicate():
                return
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


def stack_env(prefix: str, model_dir: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        FERRY_REDIS_URL=REDIS_URL,
        FERRY_KEY_PREFIX=prefix,
        FERRY_MODEL=str(model_dir),
        FERRY_MODEL_NAME=MODEL,
        FERRY_METRICS_PORT="0",
        FERRY_WEBHOOK_METRICS_PORT="0",
        FERRY_TORCH_THREADS="1",
        OMP_NUM_THREADS="1",
        FERRY_HEARTBEAT_INTERVAL_S="0.5",
        FERRY_SSE_KEEPALIVE_S="1",
        FERRY_LOG_LEVEL="WARNING",
    )
    env.update(extra)
    return env


@dataclass
class Stack:
    url: str
    prefix: str
    secret: str
    procs: dict[str, Proc]

    def client(self, key: str | None = KEY_A, **kwargs) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60, **kwargs)


@pytest.fixture(scope="session")
def stack(tiny_model_factory, tmp_path_factory):
    """API + worker + webhook worker, API keys for two tenants, webhooks allowed to 127.0.0.1."""
    prefix = new_prefix()
    logs = tmp_path_factory.mktemp("stack-logs")
    port = free_port()
    env = stack_env(
        prefix,
        tiny_model_factory("llama"),
        FERRY_API_KEYS=api_keys_setting(),
        FERRY_WEBHOOK_SECRET=new_secret(),
        FERRY_WEBHOOK_ALLOW_PRIVATE="1",
        FERRY_WEBHOOK_RETRY_BASE_S="0.2",
        FERRY_WEBHOOK_MAX_ATTEMPTS="4",
        FERRY_WEBHOOK_CONCURRENCY="4",
    )
    procs = {
        "worker": Proc("worker", ["worker"], env, logs),
        "api": Proc("api", ["api", "--host", "127.0.0.1", "--port", str(port)], env, logs),
        "webhooks": Proc("webhooks", ["webhooks", "--loglevel", "WARNING"], env, logs),
    }
    stack = Stack(f"http://127.0.0.1:{port}", prefix, env["FERRY_WEBHOOK_SECRET"], procs)
    try:
        wait_until(lambda: httpx.get(stack.url + "/readyz").status_code == 200, 120, "the stack", procs.values())
        yield stack
    finally:
        for proc in procs.values():
            proc.stop()
        delete_prefix(prefix)


@pytest.fixture
def api(stack):
    with stack.client() as client:
        yield client


@pytest.fixture
def rdb():
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    yield client
    client.close()
