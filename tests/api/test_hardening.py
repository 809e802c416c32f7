"""The API against hostile input and a failing Redis: every answer a definite 4xx or 503, nothing
queued for bad input, one tenant never reaching another's jobs. An in-process app over a private
redis-server (a real one: killed, restarted empty, paused), and `ferry api` as a subprocess for
its shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import select
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
from fastapi.testclient import TestClient
from pydantic import ValidationError

from ferry.api.auth import hash_key
from ferry.api.main import create_app
from ferry.api.offloop import INLINE_BYTES
from ferry.api.openai_schemas import ChatCompletionRequest
from ferry.api.routes import openai as openai_routes
from ferry.api.schemas import JobCreate
from ferry.api.settings import ApiSettings
from ferry.worker.common.addresses import RefusedUrl, is_public
from ferry.worker.protocol import (
    CompletedEvent,
    JobRecord,
    Keys,
    StartedEvent,
    Timings,
    TokenEvent,
    Usage,
    encode_event,
    event_to_fields,
    new_job_id,
)
from ferry.worker.webhooks.delivery import resolve_target
from tests.api.conftest import REDIS_URL, Proc, delete_prefix, free_port, new_prefix, wait_until
from tests.serve.conftest import RedisServer

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]


@contextlib.contextmanager
def app_on(server: RedisServer, **overrides):
    prefix = new_prefix()
    settings = ApiSettings(redis_url=server.url, key_prefix=prefix, **overrides)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        client.keys = Keys(prefix)
        client.redis = redis.Redis.from_url(server.url, decode_responses=True)
        yield client


def start_api(redis_url: str, prefix: str, log_dir: Path, **env: str) -> tuple[Proc, str]:
    """`ferry api` as a subprocess (uvicorn: the real HTTP server), serving `tiny` with no worker
    (its jobs stay queued); (the process, its base URL) once it answers."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "FERRY_REDIS_URL": redis_url, "FERRY_KEY_PREFIX": prefix, "FERRY_MODELS": "tiny", **env}
    proc = Proc("api", ["api", "--host", "127.0.0.1", "--port", str(port)], env, log_dir)
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{base}/healthz", timeout=1).status_code == 200, 60, "the API to answer", [proc])
    return proc, base


@dataclass
class Served:
    base: str
    proc: Proc
    keys: Keys
    redis: redis.Redis


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One `ferry api` process on the shared Redis for the tests that only send it requests."""
    prefix = new_prefix()
    proc, base = start_api(REDIS_URL, prefix, tmp_path_factory.mktemp("api"), FERRY_HTTP_HEAD_TIMEOUT_S="1",
                           FERRY_HTTP_KEEP_ALIVE_S="1", FERRY_HTTP_BODY_TIMEOUT_S="1")
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        yield Served(base, proc, Keys(prefix), client)
    finally:
        proc.stop()
        client.close()
        delete_prefix(prefix)


def queued(client) -> int:
    return sum(client.redis.xlen(q) for q in client.keys.queues("tiny"))


def error(r, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    if code is not None:
        assert body["code"] == code, body
    return body


# --- job records Redis lost --------------------------------------------------------------------


def test_a_record_redis_lost_is_a_definite_404_never_a_500(private):
    with app_on(private, models="tiny") as api:
        job_id = api.post("/v1/jobs", json={"input": {"prompt": "x", "max_tokens": 2}}).json()["id"]
        # A worker's write after a restart used to leave exactly this: a hash without its request.
        api.redis.delete(api.keys.job(job_id))
        api.redis.hset(api.keys.job(job_id), mapping={"state": "succeeded", "text": "half"})
        error(api.get(f"/v1/jobs/{job_id}"), 404, "job_state_lost")
        error(api.get(f"/v1/jobs/{job_id}/events"), 404, "job_state_lost")
        error(api.get(f"/v1/jobs/{new_job_id()}"), 404, "job_not_found")


def test_jobs_accepted_before_redis_restarted_empty_are_reported_lost(private):
    with app_on(private, models="tiny") as api:
        job_id = api.post("/v1/jobs", json={"input": {"prompt": "x", "max_tokens": 2}}).json()["id"]
        time.sleep(2.1)  # Redis reports its start to the second: the restart must be clearly after the job
        private.kill9()
        private.start()
        deadline = time.monotonic() + 10
        while (r := api.get(f"/v1/jobs/{job_id}")).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.2)
        error(r, 404, "job_state_lost")
        error(api.get(f"/v1/jobs/{new_job_id()}"), 404, "job_not_found")  # accepted after the restart: unknown


# --- Redis stalled or restarted ------------------------------------------------------------------


def test_a_stalled_redis_is_a_quick_503_with_retry_after(private):
    with app_on(private, models="tiny") as api:
        assert api.post("/v1/jobs", json={"input": {"prompt": "x"}}).status_code == 202
        private.pause()
        try:
            for call in (lambda: api.post("/v1/jobs", json={"input": {"prompt": "x"}}),
                         lambda: api.get(f"/v1/jobs/{new_job_id()}")):
                started = time.monotonic()
                r = call()
                assert time.monotonic() - started < 4, "a stalled Redis must not hang the request"
                error(r, 503, "redis_unavailable")
                assert int(r.headers["Retry-After"]) >= 1
        finally:
            private.resume()
        assert api.post("/v1/jobs", json={"input": {"prompt": "x"}}).status_code == 202


def test_a_model_seen_before_a_restart_still_queues(private):
    """Right after Redis restarts empty no worker has sent a heartbeat yet: a model this API has
    seen served is still accepted (it queues, and scales from zero), never a 404."""
    with app_on(private) as api:
        api.redis.zadd(api.keys.models, {"tiny": time.time()})
        assert api.post("/v1/jobs", json={"input": {"model": "tiny", "prompt": "x"}}).status_code == 202
        private.kill9()
        private.start()
        deadline = time.monotonic() + 10
        while (r := api.post("/v1/jobs", json={"input": {"model": "tiny", "prompt": "x"}})).status_code == 503:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert r.status_code == 202, r.text
        error(api.post("/v1/jobs", json={"input": {"model": "never-served", "prompt": "x"}}), 404, "model_not_found")


def test_a_model_with_reported_limits_is_routable_and_its_token_ids_checked(private):
    with app_on(private) as api:
        api.redis.hset(api.keys.model_limits("tiny"), mapping={"vocab_size": "300", "max_model_len": "1024"})
        before = queued(api)
        body = error(api.post("/v1/jobs", json={"input": {"model": "tiny", "prompt": "x", "stop_token_ids": [300]}}),
                     422)
        assert body["field"] == "input.stop_token_ids" and "vocabulary" in body["message"]
        error(api.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 999]}), 422)
        assert queued(api) == before
        assert api.post("/v1/jobs", json={"input": {"model": "tiny", "prompt": [1, 2], "stop_token_ids": [299]}}
                        ).status_code == 202


# --- streams that must end -------------------------------------------------------------------------


def test_a_finished_jobs_stream_ends_whatever_the_last_event_id(private):
    with app_on(private, models="tiny", sse_keepalive_s=0.2) as api:
        job_id = api.post("/v1/jobs", json={"input": {"prompt": "x"}}).json()["id"]
        done = CompletedEvent(seq=1, finish_reason="length", usage=Usage(), timings=Timings())
        api.redis.xadd(api.keys.events(job_id), event_to_fields(done), id="1-1")
        for last_id in ("1", "5", "999"):
            started = time.monotonic()
            with api.stream("GET", f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": last_id}) as r:
                assert r.status_code == 200
                body = "".join(r.iter_text())
            assert time.monotonic() - started < 5 and "data:" not in body, (last_id, body)


def test_a_stream_whose_job_never_runs_ends_at_the_jobs_deadline(private, monkeypatch):
    """An OpenAI stream of a job no worker takes stayed open for ever, keep-alives only (the answer
    that is not streamed gave up at the job's ttl_s + timeout_s, plus a margin, with a 504). Now
    the stream ends then too, with the same error, and its job is cancelled."""
    monkeypatch.setattr(openai_routes, "DEADLINE_MARGIN_S", 0.0)
    with app_on(private, models="tiny", job_ttl_s=0.5, job_timeout_s=0.5) as api:
        with api.stream("POST", "/v1/chat/completions", json=_CHAT_BODY | {"stream": True}) as r:
            data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
        job_id = json.loads(data[0])["id"].removeprefix("chatcmpl-")
        assert json.loads(data[-2])["error"]["code"] == "timeout" and data[-1] == "[DONE]"
        assert api.redis.hget(api.keys.job(job_id), "state") == "cancelled"


def emit(client: redis.Redis, keys: Keys, job_id: str, event) -> None:
    """Write an event as a worker does: into the job's stream (entry id `{seq}-1`), then published."""
    client.xadd(keys.events(job_id), event_to_fields(event), id=f"{event.seq}-1")
    client.publish(keys.channel(job_id), encode_event(event))


async def _read_stream(client: httpx.AsyncClient, got: list[str], method: str, url: str, **kwargs) -> str:
    """A stream's whole body, also appended to `got` as it comes. Raises if the body is cut."""
    async with client.stream(method, url, **kwargs) as r:
        assert r.status_code == 200, await r.aread()
        async for text in r.aiter_text():
            got.append(text)
    return "".join(got)


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.02)


N_JOB_STREAMS = 200
N_CHAT_STREAMS = 10
_CHAT_BODY = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}


def test_sigterm_ends_every_open_stream_cleanly_where_it_can_resume(private, tmp_path):
    """SIGTERM with hundreds of streams open: each ends before the grace period is over with a
    complete body whose last message says where to resume (uvicorn used to cut them mid-body at
    its end, with a CancelledError traceback), a request waiting for its job gets a definite
    answer, and after a restart a stream resumes from its Last-Event-ID."""
    prefix = new_prefix()
    rdb = redis.Redis.from_url(private.url, decode_responses=True)
    proc, base = start_api(private.url, prefix, tmp_path / "before", FERRY_SHUTDOWN_GRACE_S="6")
    api = Served(base, proc, Keys(prefix), rdb)
    job_ids = [httpx.post(f"{base}/v1/jobs", json={"input": {"prompt": "x"}}).json()["id"]
               for _ in range(N_JOB_STREAMS)]
    for job_id in job_ids:
        emit(rdb, api.keys, job_id, StartedEvent(seq=0, worker_id="w", attempt=1))
    chat_ids: list[str] = []

    async def run() -> tuple[list, httpx.Response, httpx.Response]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
            got: list[list[str]] = [[] for _ in range(N_JOB_STREAMS + N_CHAT_STREAMS)]
            streams = [asyncio.create_task(_read_stream(client, got[i], "GET", f"/v1/jobs/{job_id}/events"))
                       for i, job_id in enumerate(job_ids)]
            streams += [asyncio.create_task(_read_stream(client, got[i], "POST", "/v1/chat/completions",
                                                         json=_CHAT_BODY | {"stream": True}))
                        for i in range(N_JOB_STREAMS, N_JOB_STREAMS + N_CHAT_STREAMS)]
            chat = asyncio.create_task(client.post("/v1/chat/completions", json=_CHAT_BODY))
            prefer = asyncio.create_task(client.post("/v1/jobs", json={"input": {"prompt": "x"}},
                                                     headers={"Prefer": "wait=60"}))
            # Every stream open, and the two waits past their enqueue (each request queues one job).
            await asyncio.wait_for(_until(lambda: all(got) and queued(api) == len(got) + 2), 60)
            for pieces in got[N_JOB_STREAMS:]:  # each chat stream's job is mid-answer
                chat_ids.append(json.loads(pieces[0].split("data: ", 1)[1].split("\n", 1)[0])["id"][len("chatcmpl-"):])
                emit(rdb, api.keys, chat_ids[-1], StartedEvent(seq=0, worker_id="w", attempt=1))
                emit(rdb, api.keys, chat_ids[-1], TokenEvent(seq=1, text="hi", token_ids=[1]))
            await asyncio.wait_for(_until(lambda: all('"hi"' in "".join(g) for g in got[N_JOB_STREAMS:])), 60)
            proc.popen.send_signal(signal.SIGTERM)
            return await asyncio.gather(*streams, return_exceptions=True), await chat, await prefer

    try:
        bodies, chat, prefer = asyncio.run(run())
        proc.popen.wait(30)  # uvicorn re-raises the SIGTERM once it has shut down: -15
    finally:
        proc.stop()
    cut = [b for b in bodies if isinstance(b, BaseException)]
    assert not cut, f"{len(cut)} streams cut: {cut[:3]}"
    for job_id, body in zip(job_ids + chat_ids, bodies, strict=True):
        last = 0 if job_id in job_ids else 1
        assert body.endswith(f": shutting down; resume at /v1/jobs/{job_id}/events with Last-Event-ID: {last}\n\n")
    assert all(rdb.hget(api.keys.job(job_id), "state") == "queued" for job_id in chat_ids)  # they go on
    error(chat, 503, "shutting_down")
    assert prefer.status_code == 202 and prefer.json()["status"] == "queued"
    log = proc.log()
    assert "Traceback" not in log and "CancelledError" not in log and "Cancel " not in log, log[-3000:]

    proc, base = start_api(private.url, prefix, tmp_path / "after")
    try:
        for job_id, last in ((job_ids[0], 0), (chat_ids[0], 1)):
            done = CompletedEvent(seq=last + 1, finish_reason="length", usage=Usage(), timings=Timings())
            emit(rdb, api.keys, job_id, done)
            with httpx.stream("GET", f"{base}/v1/jobs/{job_id}/events", headers={"Last-Event-ID": str(last)}) as r:
                body = "".join(r.iter_text())
            assert body.startswith(f"id: {last + 1}\nevent: completed\n") and body.count("id: ") == 1, body
    finally:
        proc.stop()


# --- connections that must be closed ----------------------------------------------------------------

_HEAD = b"GET /healthz HTTP/1.1\r\nHost: ferry\r\nX-Padding: " + b"a" * 300 + b"\r\n\r\n"


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True


def _answered(sock: socket.socket) -> bool:
    """Read one /healthz answer whole; whether it was a 200."""
    answer = b""
    while not answer.endswith(b'{"status":"ok"}'):
        chunk = sock.recv(4096)
        if not chunk:
            return False
        answer += chunk
    return answer.startswith(b"HTTP/1.1 200 ")


def _send_slowly(sock: socket.socket, data: bytes) -> bool:
    """Send `data` a byte at a time, 50 ms apart; whether the server closed the connection first."""
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            return True
        readable, _, _ = select.select([sock], [], [], 0.05)
        if readable and _closed(sock):
            return True
    return False


def test_a_connection_sending_its_headers_a_byte_at_a_time_is_closed(served):
    """Slowloris: uvicorn's keep-alive timer stops at a request's first byte, so a head that never
    ends held its connection for ever. With FERRY_HTTP_HEAD_TIMEOUT_S=1 the whole head must be in
    within a second: these bytes would take 17 s."""
    port = int(served.base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        assert _send_slowly(sock, _HEAD), "the connection outlived its whole head, sent a byte at a time"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:  # after a first answer, too
        sock.sendall(_HEAD)
        assert _answered(sock)
        assert _send_slowly(sock, _HEAD)


def test_a_body_that_never_ends_is_a_408(served):
    """The same with a body: a request whose body came a byte at a time, or stopped coming, held a
    task and a connection for ever. With FERRY_HTTP_BODY_TIMEOUT_S=1 it is answered 408 and the
    connection closed (a socket timeout, 30 s, fails the test)."""
    port = int(served.base.rsplit(":", 1)[1])
    head = b"POST /v1/jobs HTTP/1.1\r\nHost: ferry\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + b'{"input": ')  # and no more: 90 bytes never come
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"code":"body_timeout"' in answer, answer


def test_a_connection_that_sends_nothing_is_closed(served):
    port = int(served.base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        assert _closed(sock)  # within FERRY_HTTP_HEAD_TIMEOUT_S; a socket timeout (30 s) fails the test


def test_an_idle_keep_alive_connection_is_closed(served):
    port = int(served.base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(_HEAD)
        assert _answered(sock)
        assert _closed(sock)  # after FERRY_HTTP_KEEP_ALIVE_S


# --- tenants ---------------------------------------------------------------------------------------


def test_both_apis_make_a_tenants_job_alike(private):
    """/v1/jobs and the OpenAI routes build their jobs in one place (`new_job_request`): each is the
    caller's, in its own prefix-cache namespace (no timing side channel between tenants), with the
    process's default limits."""
    with app_on(private, models="tiny", api_keys=f"{hash_key('sk-acme')}:acme", job_ttl_s=77,
                job_timeout_s=88) as api:
        auth = {"Authorization": "Bearer sk-acme"}
        job_ids = [api.post("/v1/jobs", json={"input": {"prompt": "x"}}, headers=auth).json()["id"]]
        with api.stream("POST", "/v1/chat/completions", headers=auth, json={
                "model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True}) as r:
            first = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[len("data: "):])
            job_ids.append(first["id"].removeprefix("chatcmpl-"))
        for job_id in job_ids:
            request = JobRecord.from_redis(api.redis.hgetall(api.keys.job(job_id))).request
            assert (request.tenant, request.cache_salt, request.ttl_s, request.timeout_s) == ("acme", "acme", 77, 88)


def test_idempotency_keys_never_collide_across_tenants(private):
    keys = f"{hash_key('sk-acme')}:acme,{hash_key('sk-acme-x')}:acme:x"
    with app_on(private, models="tiny", api_keys=keys) as api:
        a = api.post("/v1/jobs", json={"input": {"prompt": "x"}},
                     headers={"Authorization": "Bearer sk-acme", "Idempotency-Key": "x:K"})
        b = api.post("/v1/jobs", json={"input": {"prompt": "y"}},
                     headers={"Authorization": "Bearer sk-acme-x", "Idempotency-Key": "K"})
        assert (a.status_code, b.status_code) == (202, 202), (a.text, b.text)
        assert a.json()["id"] != b.json()["id"]


# --- bad input: a 4xx, and nothing queued ----------------------------------------------------------


def _nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


BAD_JOBS = {
    "metadata nested 260 deep": '{"input": {"prompt": "x"}, "metadata": ' + _nested(260) + "}",
    "metadata nested 9 deep": '{"input": {"prompt": "x"}, "metadata": ' + _nested(9) + "}",
    "metadata too big": json.dumps({"input": {"prompt": "x"}, "metadata": {"k": "v" * 20000}}),
    "surrogate in metadata": '{"input": {"prompt": "x"}, "metadata": {"k": "\\udfff"}}',
    "surrogate in prompt": '{"input": {"prompt": "x\\udfff"}}',
    "surrogate in a stop string": '{"input": {"prompt": "x", "stop": ["\\ud800"]}}',
    "seed 2**64": '{"input": {"prompt": "x", "seed": 18446744073709551616}}',
    "max_tokens as a string": '{"input": {"prompt": "x", "max_tokens": "16"}}',
    "max_tokens as a bool": '{"input": {"prompt": "x", "max_tokens": true}}',
    "prompt of bools": '{"input": {"prompt": [true]}}',
    "temperature Infinity": '{"input": {"prompt": "x", "temperature": Infinity}}',
    "temperature NaN": '{"input": {"prompt": "x", "temperature": NaN}}',
    "top_k 10**20": '{"input": {"prompt": "x", "top_k": 100000000000000000000}}',
    "stop id 2**64": '{"input": {"prompt": "x", "stop_token_ids": [18446744073709551616]}}',
    "unknown chat role": '{"input": {"messages": [{"role": "wizard", "content": "hi"}]}}',
    "user message without content": '{"input": {"messages": [{"role": "user"}]}}',
    "ttl Infinity": '{"input": {"prompt": "x"}, "ttl_s": Infinity}',
}


@pytest.mark.parametrize("body", list(BAD_JOBS.values()), ids=list(BAD_JOBS))
def test_bad_job_input_is_a_422_and_nothing_is_queued(private, body):
    with app_on(private, models="tiny") as api:
        before = queued(api)
        r = api.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        assert queued(api) == before


BAD_OPENAI = {
    "top_k 10**20": {"top_k": 10**20},
    "stop id 2**64": {"stop_token_ids": [2**64]},
    "seed 2**64": {"seed": 2**64},
    "max_tokens as a string": {"max_tokens": "16"},
}


@pytest.mark.parametrize("extra", list(BAD_OPENAI.values()), ids=list(BAD_OPENAI))
def test_bad_openai_input_is_a_422(private, extra):
    with app_on(private, models="tiny") as api:
        before = queued(api)
        for path, base in (("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            r = api.post(path, json={"model": "tiny", **base, **extra})
            assert r.status_code == 422, (path, r.text)
        assert queued(api) == before


def _job(rest: str) -> str:
    return '{"input": {"prompt": "x"}, ' + rest + "}"


def _chat(rest: str) -> str:
    return '{"model": "tiny", "messages": [{"role": "user", "content": "x"}], ' + rest + "}"


def _schema(schema: str) -> str:
    return _chat('"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ' + schema + "}}")


# (route, body, the place the 422 names). A lone surrogate in an object key was a 500 (the message
# naming the key could not be encoded), on which uvicorn closed the connection; a number beyond a
# double's range (1e999 reads as inf) was taken, and stored as null.
ODD_JSON = {
    "surrogate in a metadata key": ("/v1/jobs", _job('"metadata": {"\\udfff": "v"}'), "metadata.\\udfff"),
    "surrogate in a nested metadata key": ("/v1/jobs", _job('"metadata": {"k": [{"\\ud800x": 1}]}'),
                                           "metadata.k[0].\\ud800x"),
    "surrogate in an input key": ("/v1/jobs", '{"input": {"prompt": "x", "\\udfff": 1}}', "input.\\udfff"),
    "surrogate in a top-level key": ("/v1/jobs", _job('"\\udfff": 1'), "\\udfff"),
    "surrogate in a chat body key": ("/v1/chat/completions", _chat('"\\udfff": 1'), "\\udfff"),
    "surrogate in a logit_bias key": ("/v1/chat/completions", _chat('"logit_bias": {"\\udc00": 1}'),
                                      "logit_bias.\\udc00"),
    "surrogate as a JSON-schema property name": (
        "/v1/chat/completions", _schema('{"type": "object", "properties": {"\\udfff": {"type": "string"}}}'),
        "response_format.json_schema.schema.properties.\\udfff"),
    "surrogate in a batch's metadata": (
        "/v1/batches", '{"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h", '
        '"metadata": {"k": "\\udfff"}}', "metadata.k"),
    "1e999 in metadata": ("/v1/jobs", _job('"metadata": {"k": 1e999}'), "metadata.k"),
    "-1e999 in a metadata list": ("/v1/jobs", _job('"metadata": {"k": [1, -1e999]}'), "metadata.k[1]"),
    "NaN in metadata": ("/v1/jobs", _job('"metadata": {"k": NaN}'), "metadata.k"),
    "1e999 in an unknown field": ("/v1/chat/completions", _chat('"stream": true, "x": 1e999'), "x"),
    "1e999 as a JSON-schema bound": ("/v1/chat/completions", _schema('{"type": "number", "maximum": 1e999}'),
                                     "response_format.json_schema.schema.maximum"),
}


@pytest.mark.parametrize(("path", "body", "where"), list(ODD_JSON.values()), ids=list(ODD_JSON))
def test_odd_json_anywhere_in_a_body_is_a_422_naming_the_place(served, path, body, where):
    before = queued(served)
    with httpx.Client(base_url=served.base, timeout=10) as client:
        r = client.post(path, content=body, headers={"content-type": "application/json"})
        assert error(r, 422, "invalid_request")["param"] == where
        assert client.get("/healthz").status_code == 200
    assert queued(served) == before
    assert "Traceback" not in served.proc.log()


LONG_TEXT = "many words " * 4000  # 44 KB: over INLINE_BYTES, so these bodies are checked in the checker process


def _long(body: str) -> str:
    body = body.replace('"prompt": "x"', f'"prompt": "{LONG_TEXT}"')
    return body.replace('"content": "x"', f'"content": "{LONG_TEXT}"')


LONG_ODD_JSON = {name: (path, _long(body), where) for name, (path, body, where) in ODD_JSON.items()
                 if len(_long(body)) > INLINE_BYTES}


@pytest.mark.parametrize(("path", "body", "where"), list(LONG_ODD_JSON.values()), ids=list(LONG_ODD_JSON))
def test_odd_json_in_a_large_body_is_the_same_422(served, path, body, where):
    """Bodies over INLINE_BYTES are parsed and checked off the event loop (`ferry.api.offloop`): the
    answer must not change with the path taken."""
    with httpx.Client(base_url=served.base, timeout=10) as client:
        r = client.post(path, content=body, headers={"content-type": "application/json"})
        assert error(r, 422, "invalid_request")["param"] == where


def test_a_large_body_its_model_refuses_is_the_422_a_small_one_gets(served):
    with httpx.Client(base_url=served.base, timeout=10) as client:
        answers = []
        for text in ("x", LONG_TEXT):
            body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": "16",
                    "temperature": -1}
            answers.append(error(client.post("/v1/chat/completions", json=body), 422, "invalid_request"))
        assert answers[0] == answers[1]
        job = {"input": {"prompt": LONG_TEXT, "max_tokens": 0}}
        assert error(client.post("/v1/jobs", json=job), 422, "invalid_request")["param"] == "input.max_tokens"


def test_a_large_valid_body_is_queued_whole(private):
    with app_on(private, models="tiny") as api:
        before = queued(api)
        r = api.post("/v1/jobs", json={"input": {"prompt": LONG_TEXT, "max_tokens": 2}, "metadata": {"k": "v"}})
        assert r.status_code == 202, r.text
        assert queued(api) == before + 1
        assert LONG_TEXT in json.dumps(api.redis.hgetall(api.keys.job(r.json()["id"])))


def test_a_body_without_a_content_type_is_a_422(private):
    """FastAPI hands such a body to the request model as bytes, not decoded JSON: still a 422."""
    with app_on(private, models="tiny") as api:
        for path in ("/v1/jobs", "/v1/chat/completions"):
            error(api.post(path, content=b'{"input": {"prompt": "x"}}'), 422, "invalid_request")


def test_a_batch_line_with_a_surrogate_key_is_refused_as_that_line():
    """Batch lines never pass through the HTTP body check: the request models refuse them too."""
    line = {"messages": [{"role": "user", "content": "x"}], "\udfff": 1}
    with pytest.raises(ValidationError, match=r"\\udfff: not valid Unicode"):
        ChatCompletionRequest.model_validate(line)
    with pytest.raises(ValidationError, match="metadata.k: not a finite number"):
        JobCreate.model_validate({"input": {"prompt": "x"}, "metadata": {"k": float("inf")}})


def test_ids_that_spell_another_key_are_refused_before_redis(private):
    with app_on(private, models="tiny") as api:
        for path in ("/v1/jobs/abc:events", "/v1/jobs/abc.def", "/v1/jobs/a:b/events"):
            assert api.get(path).status_code in (404, 422), path


# --- where a webhook may go --------------------------------------------------------------------------

# Each is a private or metadata address written as IPv6 (NAT64, 6to4, IPv4-compatible, -mapped, Teredo).
HIDDEN_PRIVATE = [
    "http://[64:ff9b::a9fe:a9fe]/",  # NAT64 of 169.254.169.254
    "http://[64:ff9b:1::a9fe:a9fe]/",  # local-use NAT64
    "http://[2002:a9fe:a9fe::1]/",  # 6to4 of 169.254.169.254
    "http://[::a9fe:a9fe]/",  # IPv4-compatible
    "http://[::7f00:1]/",  # IPv4-compatible 127.0.0.1
    "http://[::ffff:10.0.0.1]/",  # IPv4-mapped
    "http://[2001:0:4136:e378:8000:63bf:3fff:fdd2]/",  # Teredo with a private client (192.0.2.45)
    "http://[::ffff:0:7f00:1]/",  # SIIT (IPv4-translated, RFC 6145) of 127.0.0.1
    "http://[::ffff:0:169.254.169.254]/",  # SIIT, dotted
    "http://[64:ff9b::127.0.0.1]/",  # NAT64, dotted
    "http://[2002:7f00:1::1]/",  # 6to4 of 127.0.0.1
    "http://[2001:0:a00:1:8000:63bf:f7f7:f7f7]/",  # Teredo with a private server (10.0.0.1)
]

_V4 = ["127.0.0.1", "10.0.0.1", "169.254.169.254", "100.64.0.1", "0.0.0.0", "192.168.1.1", "8.8.8.8", "1.1.1.1"]


def _carriers(v4: str) -> dict[str, str]:
    """Every IPv6 form that carries `v4`."""
    hi, lo = divmod(int(ipaddress.IPv4Address(v4)), 1 << 16)
    inverted = ipaddress.IPv4Address(~int(ipaddress.IPv4Address(v4)) & 0xFFFF_FFFF)
    return {"mapped": f"::ffff:{v4}", "SIIT": f"::ffff:0:{v4}", "compatible": f"::{v4}", "NAT64": f"64:ff9b::{v4}",
            "6to4": f"2002:{hi:x}:{lo:x}::1", "Teredo client": f"2001:0:4136:e378:8000:63bf:{inverted}",
            "Teredo server": f"2001:0:{hi:x}:{lo:x}:8000:63bf:f7f7:f7f7"}  # client 8.8.8.8


@pytest.mark.parametrize("v4", _V4)
def test_an_ipv6_address_carrying_an_ipv4_one_is_as_public_as_it(v4):
    for form, v6 in _carriers(v4).items():
        assert is_public(ipaddress.ip_address(v6)) == is_public(ipaddress.ip_address(v4)), (form, v6)
    assert not is_public(ipaddress.ip_address(f"64:ff9b:1::{v4}"))  # local-use NAT64: never public


@pytest.mark.parametrize("url", HIDDEN_PRIVATE)
def test_ipv6_forms_of_private_addresses_are_refused_at_delivery(url):
    with pytest.raises(RefusedUrl, match="non-public"):
        resolve_target(url, allow_private=False, timeout_s=5)


@pytest.mark.parametrize("url", HIDDEN_PRIVATE + ["http://127.0.0.1:9/", "http://localhost/hook"])
def test_webhook_urls_to_private_addresses_are_refused_at_submission(private, url):
    with app_on(private, models="tiny", webhook_allow_private=False) as api:
        before = queued(api)
        body = error(api.post("/v1/jobs", json={"input": {"prompt": "x"}, "webhook": {"url": url}}), 422,
                     "webhook_refused")
        assert body["field"] == "webhook.url"
        assert queued(api) == before


def test_a_public_ipv6_address_is_still_allowed_at_submission(private):
    with app_on(private, models="tiny", webhook_allow_private=False) as api:
        r = api.post("/v1/jobs", json={"input": {"prompt": "x"}, "webhook": {"url": "http://[2606:4700:4700::1111]/"}})
        assert r.status_code == 202, r.text


# --- acknowledged means replicated -------------------------------------------------------------


def test_a_job_no_replica_confirms_is_a_503_never_a_silent_202(private):
    body = {"input": {"prompt": "hi", "max_tokens": 2}}
    with app_on(private, models="tiny", redis_min_replicas=1, redis_replica_timeout_ms=200) as api:
        r = api.post("/v1/jobs", json=body)
        error(r, 503, "not_replicated")
        assert r.headers["Retry-After"]
    with app_on(private, models="tiny") as api:  # 0, the default: no WAIT
        assert api.post("/v1/jobs", json=body).status_code == 202


def _children(pid: int) -> set[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.add(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except OSError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process parents from /proc")
def test_a_killed_api_leaves_no_body_checker_behind(tmp_path):
    """The body checker (`ferry.api.offloop`) is a process of its own: an API process killed with
    SIGKILL must not leave it running (it held both ends of its task pipe and waited for ever)."""
    prefix = new_prefix()
    proc, _ = start_api(REDIS_URL, prefix, tmp_path)
    try:
        wait_until(lambda: any("spawn_main" in open(f"/proc/{c}/cmdline").read() for c in _children(proc.popen.pid)),
                   60, "the body checker to start", [proc])
        checkers = {c for c in _children(proc.popen.pid) if "spawn_main" in open(f"/proc/{c}/cmdline").read()}
    finally:
        proc.popen.kill()
        proc.stop()
        delete_prefix(prefix)
    wait_until(lambda: all(_gone(c) for c in checkers), 30, "the body checkers to exit")
