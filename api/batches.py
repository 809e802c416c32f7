"""Batch API batches: the record in Redis, what a line of the input file must be, and the lines
of the output and error files, all in OpenAI's shapes.

A line is read in two steps, both off the event loop (the batch driver runs them in a thread):
- its envelope (`read_envelope`): one JSON object of at most `max_body_bytes`, a `custom_id`, the
  batch's `url`, a `body` object. A line that fails here fails the batch's validation with a line
  error (`LineError`), as OpenAI's validation does;
- its request (`build_line`): the body, checked by the same code as a live request
  (the request schemas, `chat_jobs` / `completion_jobs` of `api.openai_jobs`, model routing, the
  model's limits), so every sampling field and structured outputs behave as on
  `/v1/chat/completions` and `/v1/completions`. A body the live route would refuse becomes that
  line's answer in the error file, with the live route's status and error body (`refused_line`);
  the other lines run. A line's job goes to the `low` lane with its `custom_id` and the batch id.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import iterate_in_threadpool

from ferry.api.errors import ApiError, error_body, unsupported, validation_answer
from ferry.api.openai_jobs import chat_jobs, completion_jobs
from ferry.api.openai_responses import Shape, job_error
from ferry.api.openai_schemas import ChatCompletionRequest, CompletionRequest
from ferry.api.responses_jobs import ResponseMeta, response_request
from ferry.api.responses_render import response_object
from ferry.api.responses_schemas import ResponseCreate
from ferry.api.services import ModelLimits, ModelRoute, Services, model_limits, resolve_model
from ferry.worker.common.objectstore import ObjectStore
from ferry.worker.protocol import JobRecord, JobRequest, JobState, Priority, UnreadableRecord
from ferry.worker.protocol.fields import MAX_JSON_DEPTH, json_problem, nested_deeper_than

BATCH_ID_PATTERN = r"^batch_[0-9a-f]{32}$"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
WINDOW_S = {"24h": 86400.0}
FINAL = ("completed", "failed", "expired", "cancelled")
MAX_REPORTED_ERRORS = 1000  # line errors kept on a batch that fails validation
# Timestamps of the statuses, OpenAI's names: set once, when the batch enters that status.
STATUS_TIMES = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
                "failed": "failed_at", "expired": "expired_at", "cancelling": "cancelling_at",
                "cancelled": "cancelled_at"}
# One read of the input file hands over at most this many lines or bytes: the thread that splits
# and parses them gives the event loop back between two groups.
_GROUP_LINES = 256
_GROUP_BYTES = 4 << 20
INTERNAL_ERROR = ApiError(500, "internal_error", "internal server error")  # a line the driver could not handle


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


# --- reading the input file ----------------------------------------------------------------------


@dataclass(slots=True)
class Envelope:
    """A line of the input file that passed validation's checks; its body is checked when it runs."""

    number: int  # 1-based line number in the file
    custom_id: str
    body: dict  # the request, as the line has it


class LineError(Exception):
    """Why a line fails validation (OpenAI's `errors.data` entry)."""

    def __init__(self, number: int, code: str, message: str, param: str | None = None, custom_id: str = "") -> None:
        super().__init__(message)
        self.number, self.code, self.message, self.param = number, code, message, param
        self.custom_id = custom_id  # when the line got as far as naming one

    def to_json(self) -> dict:
        # Up to MAX_REPORTED_ERRORS of these live in the batch's hash: a message quoting the line
        # (a model name, a url) is cut short.
        message = self.message if len(self.message) <= 512 else self.message[:509] + "..."
        return {"code": self.code, "message": message, "param": self.param, "line": self.number}


def read_envelope(number: int, raw: bytes | None, endpoint: str, max_bytes: int) -> Envelope:
    """The line `raw` (None: longer than `max_bytes`, its bytes skipped) as an envelope, or LineError."""
    if raw is None:
        raise LineError(number, "line_too_large", f"this line is over the {max_bytes}-byte limit of a request body")
    too_deep = LineError(number, "invalid_json_line", f"this line nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        item = json.loads(raw)
    except RecursionError:  # below the interpreter's recursion limit the depth check below says it
        raise too_deep from None
    except ValueError as exc:
        raise LineError(number, "invalid_json_line", f"this line is not valid JSON: {exc}") from None
    if nested_deeper_than(item, MAX_JSON_DEPTH + 2):  # the line's object and its body hold the request
        raise too_deep
    if not isinstance(item, dict):
        raise LineError(number, "invalid_json_line", "a line must be a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(number, "missing_required_parameter", "custom_id: a non-empty string is required", "custom_id")
    if json_problem(custom_id, 1) is not None:  # it is written back in the output, which is UTF-8
        raise LineError(number, "invalid_request", "custom_id: not valid Unicode (a lone surrogate)", "custom_id")
    if item.get("method", "POST") != "POST":
        raise LineError(number, "invalid_request", "method: only POST is supported", "method", custom_id)
    if item.get("url") != endpoint:
        raise LineError(number, "mismatched_endpoint",
                        f"url: {item.get('url')!r} is not the batch's endpoint {endpoint!r}", "url", custom_id)
    body = item.get("body")
    if not isinstance(body, dict):
        raise LineError(number, "missing_required_parameter", "body: a JSON object is required", "body", custom_id)
    return Envelope(number, custom_id, body)


def _split_lines(chunks: Iterable[bytes], max_bytes: int) -> Iterator[list[tuple[int, bytes | None]]]:
    """Groups of (1-based line number, bytes) of the non-blank lines; a line over `max_bytes` is
    (number, None), its bytes skipped as they stream by, never held."""
    group: list[tuple[int, bytes | None]] = []
    group_bytes = number = size = 0
    pieces: list[bytes] = []
    for chunk in chunks:
        start = 0
        while start <= len(chunk):
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            size += len(piece)
            if size <= max_bytes:
                pieces.append(piece)
            if end < 0:
                break
            number += 1
            line = b"".join(pieces) if size <= max_bytes else None
            if line is None or line.strip():
                group.append((number, line))
                group_bytes += min(size, max_bytes)
            pieces, size, start = [], 0, end + 1
            if len(group) >= _GROUP_LINES or group_bytes >= _GROUP_BYTES:
                yield group
                group, group_bytes = [], 0
    line = b"".join(pieces) if size <= max_bytes else None
    if line is None or line.strip():
        group.append((number + 1, line))
    if group:
        yield group


def envelope_groups(chunks: Iterable[bytes], endpoint: str, max_bytes: int) -> Iterator[list[Envelope | LineError]]:
    """The file's lines, read and parsed group by group (a thread's work)."""
    for group in _split_lines(chunks, max_bytes):
        items: list[Envelope | LineError] = []
        for number, raw in group:
            try:
                items.append(read_envelope(number, raw, endpoint, max_bytes))
            except LineError as exc:
                items.append(exc)
        yield items


def read_envelopes(store: ObjectStore, object_name: str, endpoint: str, max_bytes: int
                   ) -> AsyncIterator[list[Envelope | LineError]]:
    """`envelope_groups` of a stored file, each group read and parsed in a worker thread (the store's
    first read too: on S3 it is a request)."""

    def groups() -> Iterator[list[Envelope | LineError]]:
        yield from envelope_groups(store.read_chunks(object_name), endpoint, max_bytes)

    return iterate_in_threadpool(groups())


# --- a line's request ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Route:
    """Where a line's `model` goes: routed on the event loop, read by the thread that builds the job."""

    to: ModelRoute  # the served model, and the LoRA adapter it names, if any
    limits: ModelLimits | None  # what its workers reported (None: none has run yet)


async def route_models(svc: Services, tenant: str, envelopes: Iterable[Envelope],
                       routes: dict[str | None, Route | ApiError]) -> None:
    """Add to `routes` each model the envelopes name (a string, or none for the default) that is not
    there yet, routed as the live route does (ApiError: the live route's refusal)."""
    for envelope in envelopes:
        name = envelope.body.get("model")
        if (name is None or isinstance(name, str)) and name not in routes:
            try:
                to = await resolve_model(svc, name, tenant)
                routes[name] = Route(to, await model_limits(svc, to.model))
            except ApiError as exc:
                routes[name] = exc


@dataclass(slots=True)
class Line:
    """One request line of the input file, as the job it becomes."""

    number: int  # 1-based line number in the file
    custom_id: str
    job: JobRequest


def build_line(svc: Services, tenant: str, batch_id: str, endpoint: str, envelope: Envelope,
               routes: dict[str | None, Route | ApiError], ttl_s: float) -> Line:
    """The line's job as the live route would make it; ApiError with the live route's answer when it
    would refuse the request. Parses the whole body: run it in a thread."""
    body = envelope.body
    problem = json_problem(body, MAX_JSON_DEPTH)  # pydantic itself fails on a lone surrogate in a key
    if problem is not None:
        raise ApiError(422, "invalid_request", problem)
    if body.get("stream"):
        raise unsupported("stream", "a batch line is answered whole")
    try:
        request, route, job = _line_job(svc, tenant, endpoint, body, routes)
    except (ValidationError, RequestValidationError) as exc:
        raise _invalid(exc.errors()) from None
    if route.limits is not None and isinstance(job.prompt, list) and len(job.prompt) >= route.limits.max_model_len:
        raise ApiError(422, "prompt_too_long", f"prompt has {len(job.prompt)} tokens; max_model_len is "
                       f"{route.limits.max_model_len}")
    # completions' echo: the prompt before the text
    echo = {"echo": True} if isinstance(request, CompletionRequest) and request.echo else {}
    metadata = {**job.metadata, "batch_id": batch_id, "custom_id": envelope.custom_id} | echo
    job = job.model_copy(update={"priority": Priority.low, "ttl_s": max(ttl_s, 1.0), "metadata": metadata,
                                 "created_at": time.time()})
    return Line(envelope.number, envelope.custom_id, job)


def _line_job(svc: Services, tenant: str, endpoint: str, body: dict,
              routes: dict[str | None, Route | ApiError]) -> tuple[Any, Route, JobRequest]:
    """(the parsed body, its model's route, its one job), as the live route builds them."""
    schema = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
              "/v1/responses": ResponseCreate}[endpoint]
    request = schema.model_validate(body)
    route = routes.get(request.model) or ApiError(404, "model_not_found", f"model {request.model!r} is not served")
    if isinstance(route, ApiError):
        raise route
    if isinstance(request, ResponseCreate):
        for name in ("background", "previous_response_id"):
            if getattr(request, name):
                raise unsupported(name, "not in batch lines (a line runs in its batch, from its own input)")
        return request, route, response_request(svc, tenant, route.to, request)
    if isinstance(request, ChatCompletionRequest):
        if request.logprobs:
            raise unsupported("logprobs", "not supported in batch lines")
        jobs = chat_jobs(svc, tenant, route.to, request)
        if len(jobs) != 1:
            raise unsupported("n", "one choice per batch line")
        return request, route, jobs[0]
    if request.logprobs is not None:
        raise unsupported("logprobs", "not supported in batch lines")
    jobs = completion_jobs(svc, tenant, route.to, request)
    if len(jobs) != 1:
        raise ApiError(422, "invalid_request", "prompt: one prompt (and n = 1) per batch line", field="prompt")
    return request, route, jobs[0]


def _invalid(errors: list[dict]) -> ApiError:
    """A validation error as the live route answers it (`api.errors`)."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    field = ""
    for part in (p for p in first.get("loc", ()) if p != "body"):
        field += f"[{part}]" if isinstance(part, int) else (f".{part}" if field else str(part))
    code, message = validation_answer(first, field or None)
    return ApiError(422, code, message, field=field or None)


# --- output and error lines ----------------------------------------------------------------------


def request_id(job_id: str) -> str:
    return f"batch_req_{job_id}"


@dataclass(frozen=True, slots=True)
class JobEnd:
    """How a job that did not complete ended, as its record keeps it: what `job_error` reads of a
    terminal event (the record has no event's `seq` or `ts`)."""

    type: Literal["failed", "cancelled", "timed_out"]
    code: str  # an ErrorCode
    message: str

    @classmethod
    def of(cls, record: JobRecord) -> JobEnd:
        kind = {JobState.cancelled: "cancelled", JobState.timed_out: "timed_out"}.get(record.state, "failed")
        return cls(kind, record.error_code or "job_failed", record.error_message or "")


def output_line(record: JobRecord, custom_id: str, chat: bool, echo: str) -> tuple[bool, str]:
    """(succeeded, the JSONL line) for a finished line's job."""
    meta = ResponseMeta.of(record)
    if meta is not None and record.state == JobState.succeeded:  # a /v1/responses line: the Response object
        response = {"status_code": 200, "request_id": record.id, "body": response_object(record, meta)}
        return True, _jsonl({"id": request_id(record.id), "custom_id": custom_id, "response": response, "error": None})
    if record.state == JobState.succeeded:
        prefix = "chatcmpl" if chat else "cmpl"
        tools = record.tool_calls is not None  # a chat with tools: content and calls parsed by the worker
        shape = Shape(f"{prefix}-{record.id}", record.model_asked, int(record.created_at), chat=chat, logprobs=False,
                      echo=echo, text=record.text or "", tools=tools, content=record.content or "",
                      tool_calls=list(record.tool_calls or []), reasoning=record.reasoning_content or "",
                      parsed=record.reasoning_content is not None, prompt_logprobs=record.prompt_logprobs)
        response = {"status_code": 200, "request_id": record.id, "body": shape.body(record.finish_reason, record.usage)}
        return True, _jsonl({"id": request_id(record.id), "custom_id": custom_id, "response": response, "error": None})
    error = job_error(JobEnd.of(record))
    response = {"status_code": error.status, "request_id": record.id,
                "body": error_body(error.status, error.code, error.message)}
    return False, _jsonl({"id": request_id(record.id), "custom_id": custom_id, "response": response, "error": None})


def answer_line(fields: dict, custom_id: str, chat: bool) -> tuple[bool, str]:
    """(succeeded, the JSONL line) for a line whose job ended, from the job's hash; a hash that is
    gone or unreadable (Redis lost it) is answered `job_state_lost`, never left in flight."""
    try:
        record = JobRecord.from_redis(fields)
    except UnreadableRecord:
        record = None
    if record is None:
        return False, unanswered_line(custom_id, "job_state_lost",
                                      "the job store lost this request's job (Redis restarted without persistence, "
                                      "or the job expired): submit it again")
    request = record.request
    echoed = request is not None and request.metadata.get("echo") and isinstance(request.prompt, str)
    return output_line(record, custom_id, chat, request.prompt if echoed else "")


def refused_line(custom_id: str, error: ApiError) -> str:
    """The error-file line of a request refused before it ran, as the live route answers it."""
    response = {"status_code": error.status, "request_id": None,
                "body": error_body(error.status, error.code, error.message, error.field)}
    return _jsonl({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": None})


def unanswered_line(custom_id: str, code: str, message: str) -> str:
    """The error-file line of a line the batch never ran (it expired or was cancelled first)."""
    return _jsonl({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
                   "error": {"code": code, "message": message}})


# JSON leaves these raw inside strings, but a reader that splits text on Unicode line breaks (Python's
# str.splitlines, JavaScript's) would cut such a record in two: OpenAI's JSONL escapes them.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def _jsonl(value: Any) -> str:
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False).translate(_LINE_BREAKS)
    # A lone surrogate (no UTF-8 encoder takes one) can only sit inside a JSON string: written as its escape.
    return text.encode("utf-8", "backslashreplace").decode("utf-8") + "\n"
