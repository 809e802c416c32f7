"""Request and response bodies of the jobs API (the OpenAI ones are in api/openai_schemas.py)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Header
from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from ferry.worker.protocol import JobRequest, JobState, Priority, Timings, Usage, Webhook
from ferry.worker.protocol.fields import JobSeconds, Metadata, check_json, sampling_annotation
from ferry.worker.protocol.logprobs import PromptLogprobs
from ferry.worker.protocol.sampling import LIMITS
from ferry.worker.protocol.tools import ToolCall

# JobRequest fields the API sets itself or takes from the job envelope rather than from `input`.
_NOT_INPUT = {"model", "lora", "tenant", "created_at", "priority", "ttl_s", "timeout_s", "metadata", "webhook",
              "cache_salt", "task"}  # lora: from `model` (api.services.resolve_model); task: /tokenize, /detokenize

# `input`: a completion (`prompt`) or chat (`messages`) request with OpenAI's field names; the
# sampling fields and their limits are JobRequest's own, so the API and the worker agree.
JobInput = create_model(
    "JobInput",
    __config__=ConfigDict(extra="forbid"),
    __doc__="A completion (`prompt`) or chat (`messages`) request, OpenAI field names.",
    model=(str | None, Field(default=None, description="may be omitted while exactly one model is served")),
    max_completion_tokens=(sampling_annotation(LIMITS["max_tokens"], nullable=True),
                           Field(default=None, description="chat name of max_tokens")),
    **{name: (field.annotation, field) for name, field in JobRequest.model_fields.items() if name not in _NOT_INPUT},
)


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: JobInput  # type: ignore[valid-type]
    webhook: Webhook | None = None
    priority: Priority = Priority.normal
    ttl_s: JobSeconds | None = Field(default=None, description="max seconds queued before it starts")
    timeout_s: JobSeconds | None = Field(default=None, description="max seconds running")
    metadata: Metadata = Field(default_factory=dict, description="returned as given, also in webhooks")

    @model_validator(mode="before")
    @classmethod
    def _valid_json(cls, data: Any) -> Any:
        return check_body_json(data)


def check_body_json(data: Any) -> Any:
    """A request body's JSON as a pydantic before-validator (`check_json`: surrogates, non-finite
    numbers, depth; HTTP bodies were checked for the first two before any route, batch lines were
    not). Its messages never hold the offending text, so they can be rendered."""
    return check_json(data)


class JobOutput(BaseModel):
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    content: str | None = None  # a chat with tools or a reasoning parser: the answer's text (no calls, no thinking)
    reasoning_content: str | None = None  # a chat on a worker with a reasoning parser: the think block's text
    tool_calls: list[ToolCall] | None = None  # a chat with tools: the calls parsed out of `text`
    prompt_logprobs: PromptLogprobs | None = None  # asked for: each prompt token's logprob and the top-n there


class JobErrorInfo(BaseModel):
    code: str
    message: str


class JobUrls(BaseModel):
    self: str
    events: str
    cancel: str


class WebhookDelivery(BaseModel):
    webhook_id: str
    url: str
    outcome: str  # delivered | failed | refused | rejected | gone
    status_code: int | None = None
    attempts: int
    detail: str
    at: float


class JobView(BaseModel):
    id: str
    object: str = "job"
    status: JobState
    model: str
    priority: Priority
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    attempts: int = 0
    output: JobOutput | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error: JobErrorInfo | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    batch_id: str | None = None  # the Batch API batch the job is a line of
    webhook_deliveries: dict[str, WebhookDelivery] = Field(default_factory=dict)
    urls: JobUrls


class JobList(BaseModel):
    """A page of the caller's jobs, newest first (OpenAI's list shape); `after=<last_id>` reads the next."""

    object: str = "list"
    data: list[JobView]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


class ErrorDetail(BaseModel):
    """OpenAI's error shape; `code` is Ferry's stable code, `field` the same as `param` (older clients)."""

    message: str
    type: str  # invalid_request_error, authentication_error, rate_limit_error, server_error, ...
    param: str | None = None  # the offending request field, or null
    code: str
    field: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# The create routes' Idempotency-Key (/v1/jobs' semantics: the same key and body answer the same job,
# another body is a 409). The OpenAI routes declare their own, 3 characters shorter (a choice's suffix).
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key", min_length=1, max_length=255)]


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for the error statuses a route can answer."""
    return {status: {"model": ErrorResponse} for status in statuses}
