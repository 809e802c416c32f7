"""One trace per job across real processes: `ferry api`, two `ferry worker`s and `ferry webhooks`
export OTLP/HTTP to a receiver in the test, which decodes the protobufs the SDK sends.

The job is submitted with a W3C `traceparent` and a webhook; the trace must hold the API's request
and enqueue spans, the worker's queue wait (as long as the job record says), attempt and phases,
and the relay's hand-off and delivery attempts, each under the right parent. A worker killed
mid-job (kill -9) leaves the resumed attempt, on the other worker, in the same trace.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import redis
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from ferry.worker.common.tracing import TracingConfigError, tracing_from_env
from ferry.worker.protocol import JobRecord, JobState, Keys
from ferry.worker.serve.job_trace import AttemptStart, AttemptTrace, JobTracer
from ferry.worker.webhooks.signing import new_secret
from tests.api import conftest as api_stack
from tests.api.conftest import Proc, wait_until
from tests.webhooks.receiver import receiver  # noqa: F401 (a fixture)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


# --- configuration (no processes) ------------------------------------------------------------------


def test_tracing_is_off_without_an_endpoint():
    assert tracing_from_env("x", {}) is None
    assert tracing_from_env("x", {"OTEL_SERVICE_NAME": "y", "OTEL_TRACES_SAMPLER": "always_on"}) is None
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert tracing_from_env("x", endpoint | {"OTEL_SDK_DISABLED": "true"}) is None
    assert tracing_from_env("x", endpoint | {"OTEL_TRACES_EXPORTER": "none"}) is None


@pytest.mark.parametrize("env, named", [
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "grpc://c:4317"}, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
    ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"}, "OTEL_TRACES_SAMPLER_ARG"),
    ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "half"},
     "OTEL_TRACES_SAMPLER_ARG"),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
])
def test_bad_tracing_settings_are_refused_naming_the_variable(env, named):
    with pytest.raises(TracingConfigError, match=named):
        tracing_from_env("x", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"} | env)


def test_a_bad_setting_stops_the_worker_at_start(tmp_path):
    env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:1", OTEL_TRACES_SAMPLER="sometimes",
               FERRY_METRICS_PORT="0")
    proc = Proc("bad-worker", ["worker"], env, tmp_path)
    assert proc.popen.wait(120) == 2
    proc.stop()
    assert "OTEL_TRACES_SAMPLER='sometimes'" in proc.log()


def test_a_collector_that_is_down_costs_spans_never_a_job(tmp_path):
    """The API answers every job (its record keeps its context) and the worker's tracing thread
    drops what the exporter cannot send: nothing raises, nothing waits on the collector."""
    dead = f"http://127.0.0.1:{api_stack.free_port()}"
    prefix, port = api_stack.new_prefix(), api_stack.free_port()
    env = api_stack.stack_env(prefix, tmp_path, FERRY_MODELS="tiny", OTEL_EXPORTER_OTLP_ENDPOINT=dead)
    api = Proc("api-dead-collector", ["api", "--host", "127.0.0.1", "--port", str(port)], env, tmp_path)
    client = redis.Redis.from_url(api_stack.REDIS_URL, decode_responses=True)
    try:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200, 60, "the API", [api])
        for _ in range(20):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/jobs", headers=_headers(TRACE_ID), timeout=30,
                           json={"input": {"model": "tiny", "prompt": "x", "max_tokens": 1}})
            assert r.status_code == 202, r.text
            record = JobRecord.from_redis(client.hgetall(Keys(prefix).job(r.json()["id"])))
            assert record.traceparent.startswith(f"00-{TRACE_ID}-")
    finally:
        api.stop()
        client.close()
        api_stack.delete_prefix(prefix)

    tracing = tracing_from_env("ferry-worker", {"OTEL_EXPORTER_OTLP_ENDPOINT": dead})
    tracer = JobTracer(tracing, "tiny", "w-dead")
    now = time.time()
    for i in range(3000):  # more than the batch processor's queue (2048): the rest is dropped
        tracer.started(AttemptStart(f"job-{i}", f"00-{TRACE_ID}-{CALLER_SPAN}-01", 1, "chat", now - 1, now - 0.5,
                                    now - 0.5, now - 0.4, 0))
        tracer.ended(AttemptTrace(f"job-{i}", now - 0.4, now - 0.39, now - 0.38, now - 0.3, now, "succeeded", 8, 0,
                                  4, 4), now, now)
    tracer.close(timeout_s=60)
    assert not tracer.thread.is_alive()
    tracing.shutdown()  # bounded: it gives up on the collector after a few seconds


# --- the receiver ---------------------------------------------------------------------------------


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict
    links: list[tuple[str, str]]  # (trace id, span id)


class OtlpReceiver:
    """A real OTLP/HTTP endpoint on 127.0.0.1: every exported span, decoded."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        spans, lock = self.spans, self.lock

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
                got = [_span(resource, span) for resource in request.resource_spans
                       for scope in resource.scope_spans for span in scope.spans]
                with lock:
                    spans.extend(got)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def _span(resource, span) -> Span:
    service = next(_value(a.value) for a in resource.resource.attributes if a.key == "service.name")
    return Span(service, span.name, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(), span.kind,
                span.start_time_unix_nano, span.end_time_unix_nano, {a.key: _value(a.value) for a in span.attributes},
                [(link.trace_id.hex(), link.span_id.hex()) for link in span.links])


# --- the stack ------------------------------------------------------------------------------------


class TracedStack:
    def __init__(self, model_dir, tmp_path, otlp: OtlpReceiver) -> None:
        self.prefix = api_stack.new_prefix()
        self.port = api_stack.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.keys = Keys(self.prefix)
        self.env = api_stack.stack_env(self.prefix, model_dir, FERRY_API_KEYS=api_stack.api_keys_setting(),
                             FERRY_WEBHOOK_SECRET=new_secret(), FERRY_WEBHOOK_ALLOW_PRIVATE="1",
                             FERRY_LEASE_S="3", FERRY_REAPER_INTERVAL_S="0.3", FERRY_READ_BLOCK_MS="200",
                             OTEL_EXPORTER_OTLP_ENDPOINT=otlp.endpoint, OTEL_BSP_SCHEDULE_DELAY="100",
                             FERRY_LOG_LEVEL="INFO", FERRY_FILES_URL=(tmp_path / "files").as_uri(),
                             FERRY_UPLOAD_DIR=str(tmp_path / "up"), FERRY_BATCH_POLL_S="0.05")
        self.metrics_ports = {name: api_stack.free_port() for name in ("worker-1", "worker-2")}
        self.procs = {name: Proc(name, ["worker"], self.env | {"FERRY_METRICS_PORT": str(port)}, tmp_path)
                      for name, port in self.metrics_ports.items()}
        self.procs["api"] = Proc("api", ["api", "--host", "127.0.0.1", "--port", str(self.port)], self.env, tmp_path)
        self.procs["webhooks"] = Proc("webhooks", ["webhooks", "--loglevel", "INFO"], self.env, tmp_path)
        self.redis = redis.Redis.from_url(api_stack.REDIS_URL, decode_responses=True)
        try:
            wait_until(lambda: httpx.get(self.url + "/readyz").status_code == 200
                       and self.redis.zcard(self.keys.workers) == 2, 120, "the stack", self.procs.values())
        except BaseException:
            self.close()
            raise

    def submit(self, body: dict) -> str:
        r = httpx.post(self.url + "/v1/jobs", json=body, headers=_headers(TRACE_ID), timeout=30)
        assert r.status_code == 202, r.text
        return r.json()["id"]

    def record(self, job_id: str) -> JobRecord:
        return JobRecord.from_redis(self.redis.hgetall(self.keys.job(job_id)))

    def worker_of(self, worker_id: str) -> Proc:
        return next(p for name, p in self.procs.items()
                    if name.startswith("worker") and worker_id == f"{socket.gethostname()}-{p.popen.pid}")

    def close(self) -> None:
        for proc in self.procs.values():
            proc.stop()
        self.redis.close()
        api_stack.delete_prefix(self.prefix)


def _headers(trace_id: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_stack.KEY_A}", "traceparent": f"00-{trace_id}-{CALLER_SPAN}-01"}


@pytest.fixture(scope="module")
def otlp():
    server = OtlpReceiver()
    yield server
    server.close()


@pytest.fixture(scope="module")
def tstack(tiny_model_factory, tmp_path_factory, otlp):
    stack = TracedStack(tiny_model_factory("llama"), tmp_path_factory.mktemp("traced"), otlp)
    yield stack
    stack.close()


def _one(spans: list[Span], name: str, **attributes) -> Span:
    found = [s for s in spans if s.name == name and all(s.attributes.get(k) == v for k, v in attributes.items())]
    assert len(found) == 1, (name, attributes, [(s.service, s.name, s.attributes) for s in spans])
    return found[0]


def _wait_for_spans(otlp: OtlpReceiver, want, trace_id: str = TRACE_ID) -> list[Span]:
    holder: list[list[Span]] = []

    def ready() -> bool:
        spans = otlp.trace(trace_id)
        holder[:] = [spans]
        return want(spans)

    wait_until(ready, 60, "the trace's spans")
    return holder[0]


@pytest.mark.redis
@pytest.mark.timeout(300)
def test_one_trace_holds_the_api_the_worker_and_the_webhooks(tstack, otlp, receiver):  # noqa: F811
    job_id = tstack.submit({"input": {"prompt": "trace me", "max_tokens": 6, "temperature": 0, "ignore_eos": True},
                            "webhook": {"url": receiver.base + "/hook"}})
    receiver.wait_for(2, timeout=120)  # job.started and job.completed

    def whole(spans: list[Span]) -> bool:
        names = [s.name for s in spans]
        return names.count("POST") >= 2 and "publish" in names and "POST /v1/jobs" in names

    spans = _wait_for_spans(otlp, whole)
    rec = tstack.record(job_id)
    assert rec.state is JobState.succeeded
    assert {s.service for s in spans} == {"ferry-api", "ferry-worker", "ferry-webhooks"}

    request = _one(spans, "POST /v1/jobs")
    assert request.service == "ferry-api" and request.parent_id == CALLER_SPAN  # the caller's traceparent goes on
    assert request.attributes["http.request.method"] == "POST" and request.attributes["http.route"] == "/v1/jobs"
    assert request.attributes["http.response.status_code"] == 202
    enqueue = _one(spans, "send tiny")
    assert enqueue.parent_id == request.span_id and enqueue.attributes["messaging.message.id"] == job_id
    assert rec.traceparent == f"00-{TRACE_ID}-{enqueue.span_id}-01"

    queue_wait = _one(spans, "queue wait")
    assert queue_wait.service == "ferry-worker" and queue_wait.parent_id == enqueue.span_id
    assert queue_wait.start_ns == int(rec.created_at * 1e9) and queue_wait.end_ns == int(rec.started_at * 1e9)
    assert abs((queue_wait.end_ns - queue_wait.start_ns) / 1e9 - rec.timings.queue_s) < 1e-3
    attempt = _one(spans, "process tiny")
    assert attempt.parent_id == enqueue.span_id and attempt.attributes["ferry.job.attempt"] == 1
    assert attempt.attributes["gen_ai.usage.output_tokens"] == 6
    assert attempt.attributes["gen_ai.usage.input_tokens"] == rec.usage.prompt_tokens
    phases = [_one(spans, name) for name in ("intake", "admission", "prefill", "decode", "publish")]
    assert all(p.parent_id == attempt.span_id for p in phases)
    assert [p.start_ns for p in phases] == sorted(p.start_ns for p in phases)
    assert attempt.start_ns <= phases[0].start_ns and phases[-1].end_ns <= attempt.end_ns
    assert phases[2].attributes["gen_ai.usage.input_tokens"] == rec.usage.prompt_tokens
    assert phases[3].attributes["ferry.decode.steps"] >= 1 and phases[3].attributes["ferry.decode.preemptions"] == 0

    handoffs = [s for s in spans if s.service == "ferry-webhooks" and s.kind == 4]  # PRODUCER
    assert {s.attributes["ferry.webhook.event"] for s in handoffs} == {"job.started", "job.completed"}
    assert all(s.parent_id == enqueue.span_id for s in handoffs)
    deliveries = [s for s in spans if s.name == "POST" and s.service == "ferry-webhooks"]
    assert sorted(d.parent_id for d in deliveries) == sorted(h.span_id for h in handoffs)
    assert all(d.attributes["http.response.status_code"] == 200 for d in deliveries)
    # The receiver got each attempt's own context: its spans could join the trace.
    sent = {r.headers["traceparent"] for r in receiver.requests}
    assert sent == {f"00-{TRACE_ID}-{d.span_id}-01" for d in deliveries}

    # Logs: the worker's JSON line of the job's admission, the webhook worker's of each delivery.
    worker = next(n for n in ("worker-1", "worker-2") if attempt.attributes["ferry.worker.id"]
                  == f"{socket.gethostname()}-{tstack.procs[n].popen.pid}")
    admitted = [json.loads(line) for line in tstack.procs[worker].log().splitlines()
                if line.startswith("{") and job_id in line and "job admitted" in line]
    assert [line["trace_id"] for line in admitted] == [TRACE_ID]
    delivered = [line for line in tstack.procs["webhooks"].log().splitlines() if "webhook job." in line
                 and job_id in line]
    assert len(delivered) == 2 and all(f"trace_id={TRACE_ID}" in line for line in delivered)
    # Metrics: TTFT and end-to-end samples carry the trace id as an exemplar (OpenMetrics).
    metrics = httpx.get(f"http://127.0.0.1:{tstack.metrics_ports[worker]}/metrics",
                        headers={"Accept": "application/openmetrics-text; version=1.0.0"}).text
    for histogram in ("ferry_time_to_first_token_seconds_bucket", "ferry_e2e_request_latency_seconds_bucket"):
        assert any(line.startswith(histogram) and f'# {{trace_id="{TRACE_ID}"}}' in line
                   for line in metrics.splitlines()), histogram


@pytest.mark.redis
@pytest.mark.timeout(300)
def test_a_batch_is_one_trace_with_a_span_per_line(tstack, otlp, receiver):  # noqa: F811
    batch_trace = "0af7651916cd43dd8448eb211c80319c"
    lines = b"".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions", "body": {
        "model": "tiny", "prompt": f"line {i}", "max_tokens": 3, "temperature": 0}}).encode() + b"\n" for i in range(3))
    auth = {"Authorization": f"Bearer {api_stack.KEY_A}"}
    uploaded = httpx.post(tstack.url + "/v1/files", headers=auth, files={"file": ("in.jsonl", lines)},
                          data={"purpose": "batch"}, timeout=30).json()
    batch = httpx.post(tstack.url + "/v1/batches", headers=_headers(batch_trace), timeout=30, json={
        "input_file_id": uploaded["id"], "endpoint": "/v1/completions", "completion_window": "24h",
        "webhook": {"url": receiver.base + "/batch"}}).json()
    wait_until(lambda: httpx.get(f"{tstack.url}/v1/batches/{batch['id']}", headers=auth).json()["status"]
               == "completed", 120, "the batch")

    def every_line_ran(spans: list[Span]) -> bool:
        return (sum(s.name == "process tiny" for s in spans) == 3 and sum(s.name == "send tiny" for s in spans) == 3
                and any(s.attributes.get("ferry.webhook.event") == "batch.completed" for s in spans))

    spans = _wait_for_spans(otlp, every_line_ran, batch_trace)
    created = _one(spans, "POST /v1/batches")
    assert created.parent_id == CALLER_SPAN
    lines_sent = [s for s in spans if s.name == "send tiny"]
    assert all(s.parent_id == created.span_id for s in lines_sent)  # enqueued later, by the driver, in its trace
    runs = [s for s in spans if s.name == "process tiny"]
    assert sorted(r.parent_id for r in runs) == sorted(s.span_id for s in lines_sent)
    assert {s.attributes["messaging.message.id"] for s in lines_sent} == {
        r.attributes["messaging.message.id"] for r in runs}
    webhook = _one(spans, "POST", **{"ferry.webhook.event": "batch.completed"})  # the batch's own webhook
    assert webhook.parent_id == created.span_id and webhook.attributes["http.response.status_code"] == 200


@pytest.mark.redis
@pytest.mark.timeout(300)
def test_a_job_resumed_after_kill9_stays_in_its_trace(tstack, otlp):
    before = {s.span_id for s in otlp.trace(TRACE_ID)}
    job_id = tstack.submit({"input": {"prompt": "kill me", "max_tokens": 900, "temperature": 0,
                                      "ignore_eos": True}})
    holder: list = []

    def mid_generation() -> bool:
        rec = tstack.record(job_id)
        holder[:] = [rec]
        return rec.state is JobState.running and tstack.redis.xlen(tstack.keys.events(job_id)) >= 4

    def queue_wait_sent() -> bool:  # the start's spans leave within OTEL_BSP_SCHEDULE_DELAY (100 ms here)
        return any(s.name == "queue wait" and s.attributes["messaging.message.id"] == job_id
                   for s in otlp.trace(TRACE_ID))

    wait_until(lambda: mid_generation() and queue_wait_sent(), 120, "the job mid-generation, its queue wait sent")
    victim = tstack.worker_of(holder[0].worker_id)
    os.kill(victim.popen.pid, signal.SIGSTOP)  # frozen at once: it cannot finish the job while we look
    assert tstack.record(job_id).state is JobState.running
    victim.popen.kill()
    victim.popen.wait(10)

    def resumed(spans: list[Span]) -> bool:
        return any(s.name == "process tiny" and s.attributes.get("ferry.job.resumed") for s in spans)

    spans = [s for s in _wait_for_spans(otlp, resumed) if s.span_id not in before]
    rec = tstack.record(job_id)
    assert rec.state is JobState.succeeded and rec.attempts == 2
    enqueue = _one(spans, "send tiny", **{"messaging.message.id": job_id})
    attempt = _one(spans, "process tiny", **{"messaging.message.id": job_id})
    assert attempt.trace_id == TRACE_ID and attempt.parent_id == enqueue.span_id
    assert attempt.attributes["ferry.job.attempt"] == 2 and attempt.attributes["ferry.job.resumed_tokens"] >= 3
    assert attempt.links == [(TRACE_ID, enqueue.span_id)]
    assert attempt.attributes["ferry.worker.id"] != holder[0].worker_id
    # The queue wait went out when the first attempt started: the dead worker had sent it.
    queue_wait = _one(spans, "queue wait", **{"messaging.message.id": job_id})
    assert queue_wait.parent_id == enqueue.span_id and queue_wait.end_ns == int(rec.started_at * 1e9)
