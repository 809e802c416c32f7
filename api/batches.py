"""Batch API batches: the record in Redis, what a line of the input file must be, and the lines
of the output and error files, all in OpenAI's shapes.

A line is parsed by the same code as a live request (`api.routes.openai`: the request schemas,
`chat_jobs` / `completion_jobs`, model routing and the vocabulary check), so every sampling field
and structured outputs behave as on `/v1/chat/completions` and `/v1/completions`; a line's job
goes to the `low` lane with its `custom_id` and the batch id on the job hash.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from types import SimpleNamespace

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import iterate_in_threadpool

from ferry.api.errors import ApiError, error_body
from ferry.api.openai_schemas import ChatCompletionRequest, CompletionRequest
from ferry.api.routes.openai import Shape, chat_jobs, completion_jobs, job_error
from ferry.api.services import Services, check_against_model, resolve_model
from ferry.worker.common.objectstore import ObjectStore
from ferry.worker.protocol import JobRecord, JobRequest, JobState, Priority

BATCH_ID_PATTERN = r"^batch_[0-9a-f]{32}$"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
WINDOW_S = {"24h": 86400.0}
FINAL = ("completed", "failed", "expired", "cancelled")
MAX_REPORTED_ERRORS = 1000  # line errors kept on a batch that fails validation
# Timestamps of the statuses, OpenAI's names: set once, when the batch enters that status.
STATUS_TIMES = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
                "failed": "failed_at", "expired": "expired_at", "cancelling": "cancelling_at",
                "cancelled": "cancelled_at"}


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def batch_json(raw: dict) -> dict:
    """The hash `Keys.batch` as OpenAI's `batch` object."""

    def ts(name: str) -> int | None:
        return int(float(raw[name])) if raw.get(name) else None

    errors = json.loads(raw["errors"]) if raw.get("errors") else None
    return {
        "id": raw["id"], "object": "batch", "endpoint": raw["endpoint"],
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": raw["input_file_id"], "completion_window": raw["completion_window"],
        "status": raw["status"], "output_file_id": raw.get("output_file_id") or None,
        "error_file_id": raw.get("error_file_id") or None, "created_at": ts("created_at"),
        "in_progress_at": ts("in_progress_at"), "expires_at": ts("expires_at"), "finalizing_at": ts("finalizing_at"),
        "completed_at": ts("completed_at"), "failed_at": ts("failed_at"), "expired_at": ts("expired_at"),
        "cancelling_at": ts("cancelling_at"), "cancelled_at": ts("cancelled_at"),
        "request_counts": {"total": int(raw.get("total", 0)), "completed": int(raw.get("completed", 0)),
                           "failed": int(raw.get("failed", 0))},
        "metadata": json.loads(raw.get("metadata") or "null"),
    }


@dataclass(slots=True)
class Line:
    """One request line of the input file."""

    number: int  # 1-based line number in the file
    custom_id: str
    job: JobRequest


class LineError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param

    def to_json(self, line: int) -> dict:
        return {"code": self.code, "message": self.message, "param": self.param, "line": line}


async def read_lines(store: ObjectStore, object_name: str) -> AsyncIterator[tuple[int, bytes]]:
    """(1-based line number, bytes) of every non-blank line, streamed from the store."""
    chunks: Iterator[bytes] = store.read_chunks(object_name)
    pending = b""
    number = 0
    async for chunk in iterate_in_threadpool(chunks):
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for raw in complete:
            number += 1
            if raw.strip():
                yield number, raw
    if pending.strip():
        yield number + 1, pending


async def parse_line(svc: Services, tenant: str, batch_id: str, endpoint: str, number: int, raw: bytes,
                     ttl_s: float) -> Line:
    """A line as the job it becomes; LineError says what is wrong with it (OpenAI's error codes)."""
    try:
        item = json.loads(raw)
    except ValueError as exc:
        raise LineError("invalid_json_line", f"this line is not valid JSON: {exc}") from None
    if not isinstance(item, dict):
        raise LineError("invalid_json_line", "a line must be a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("missing_required_parameter", "custom_id: a non-empty string is required", "custom_id")
    if item.get("method", "POST") != "POST":
        raise LineError("invalid_request", "method: only POST is supported", "method")
    if item.get("url") != endpoint:
        raise LineError("mismatched_endpoint", f"url: {item.get('url')!r} is not the batch's endpoint {endpoint!r}",
                        "url")
    body = item.get("body")
    if not isinstance(body, dict):
        raise LineError("missing_required_parameter", "body: a JSON object is required", "body")
    if body.get("stream"):
        raise LineError("invalid_request", "body.stream: a batch line is answered whole", "body.stream")
    try:
        return await _line_job(svc, tenant, batch_id, endpoint, number, custom_id, body, ttl_s)
    except (ValidationError, RequestValidationError) as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        raise LineError("invalid_request", f"body.{where}: {first['msg']}", f"body.{where}") from None
    except ApiError as exc:
        param = f"body.{exc.field}" if exc.field else None
        raise LineError(exc.code, exc.message, param) from None


async def _line_job(svc: Services, tenant: str, batch_id: str, endpoint: str, number: int, custom_id: str,
                    body: dict, ttl_s: float) -> Line:
    echo = False  # completions' `echo`: the output puts the prompt before the text
    if endpoint == "/v1/chat/completions":
        request = ChatCompletionRequest.model_validate(body)
        if request.logprobs:
            raise ApiError(422, "unsupported", "logprobs: not supported in batch lines", field="logprobs")
        model = await resolve_model(svc, request.model)
        jobs = chat_jobs(svc, tenant, model, request)
        if len(jobs) != 1:
            raise ApiError(422, "unsupported", "n: one choice per batch line", field="n")
        job = jobs[0]
    else:
        request = CompletionRequest.model_validate(body)
        if request.logprobs is not None:
            raise ApiError(422, "unsupported", "logprobs: not supported in batch lines", field="logprobs")
        model = await resolve_model(svc, request.model)
        jobs = completion_jobs(svc, tenant, model, request)
        if len(jobs) != 1:
            raise ApiError(422, "invalid_request", "prompt: one prompt (and n = 1) per batch line", field="prompt")
        job = jobs[0]
        echo = request.echo
    await check_against_model(svc, job)
    metadata = {**job.metadata, "batch_id": batch_id, "custom_id": custom_id} | ({"echo": True} if echo else {})
    job = job.model_copy(update={"priority": Priority.low, "ttl_s": max(ttl_s, 1.0), "metadata": metadata,
                                 "created_at": time.time()})
    return Line(number, custom_id, job)


def request_id(job_id: str) -> str:
    return f"batch_req_{job_id}"


def output_line(record: JobRecord, custom_id: str, chat: bool, echo: str) -> tuple[bool, str]:
    """(succeeded, the JSONL line) for a finished line's job."""
    if record.state == JobState.succeeded:
        prefix = "chatcmpl" if chat else "cmpl"
        tools = record.tool_calls is not None  # a chat with tools: content and calls parsed by the worker
        shape = Shape(f"{prefix}-{record.id}", record.model, int(record.created_at), chat=chat, logprobs=False,
                      echo=echo, text=record.text or "", tools=tools, content=record.content or "",
                      tool_calls=list(record.tool_calls or []))
        response = {"status_code": 200, "request_id": record.id, "body": shape.body(record.finish_reason, record.usage)}
        return True, _jsonl({"id": request_id(record.id), "custom_id": custom_id, "response": response, "error": None})
    ended = SimpleNamespace(type={JobState.cancelled: "cancelled", JobState.timed_out: "timed_out"}.get(
        record.state, "failed"), code=record.error_code or "job_failed", message=record.error_message or "")
    error = job_error(ended)
    response = {"status_code": error.status, "request_id": record.id,
                "body": error_body(error.status, error.code, error.message)}
    return False, _jsonl({"id": request_id(record.id), "custom_id": custom_id, "response": response, "error": None})


def unanswered_line(custom_id: str, code: str, message: str) -> str:
    """The error-file line of a line that never ran (the batch expired first)."""
    return _jsonl({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
                   "error": {"code": code, "message": message}})


def _jsonl(value: dict) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False) + "\n"
