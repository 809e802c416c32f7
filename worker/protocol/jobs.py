"""A job on the wire: the request a client made, its record in Redis, its queue envelope.

Job states: `queued -> running -> succeeded | failed | cancelled | timed_out` (running goes back
to queued when a draining worker hands the job back). Timestamps are unix seconds (float).
docs/architecture.md tells the whole life of a job; `worker.protocol.events` holds its events.
"""

from __future__ import annotations

import json
import time
import uuid
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, create_model, field_validator, model_validator

from ferry.worker.protocol.chat_template import ChatTemplateFields
from ferry.worker.protocol.codec import compact_json, decoded
from ferry.worker.protocol.fields import (
    JobSeconds,
    LogitBias,
    Metadata,
    ModelName,
    TokenIds,
    check_json,
    sampling_annotation,
    sampling_fields,
)
from ferry.worker.protocol.lanes import Priority
from ferry.worker.protocol.logprobs import PromptLogprobs
from ferry.worker.protocol.sampling import LIMITS, SAMPLING_LIMITS, combination_problem
from ferry.worker.protocol.structured import StructuredOutputsRequest
from ferry.worker.protocol.tools import MAX_TOOLS, Tool, ToolCall, ToolChoice, check_tool_choice, forced_tool_schema

PROTOCOL_VERSION = 1
JOB_ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"  # no ':' or '.': an id never spells another key's name


class JobState(StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"
    timed_out = "timed_out"


TERMINAL_STATES = frozenset({JobState.succeeded, JobState.failed, JobState.cancelled, JobState.timed_out})
TERMINAL_STATES_ARG = " ".join(sorted(TERMINAL_STATES))  # how the Lua scripts take them (worker.protocol.lua)


class ErrorCode:
    """Stable error codes of `failed` / `timed_out` events and of the job hash's `error_code`."""

    INVALID_REQUEST = "invalid_request"  # the stored request does not parse (unknown fields, wrong types)
    INVALID_SAMPLING_PARAMS = "invalid_sampling_params"  # the engine refused the sampling values
    INVALID_PROMPT = "invalid_prompt"  # empty prompt, token ids out of the vocabulary, no chat template
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt leaves no room to generate within max_model_len
    MALFORMED_ENVELOPE = "malformed_envelope"  # the queue entry lacks a usable job_id / attempt
    JOB_NOT_FOUND = "job_not_found"  # the envelope names a job whose hash is gone
    MAX_ATTEMPTS_EXCEEDED = "max_attempts_exceeded"  # delivered too many times: dead-lettered
    TTL_EXPIRED = "ttl_expired"  # waited in the queue longer than ttl_s (state timed_out)
    EXECUTION_TIMEOUT = "execution_timeout"  # ran longer than timeout_s (state timed_out)
    ENGINE_ERROR = "engine_error"  # the engine raised while serving the job
    INVALID_STRUCTURED_OUTPUT = "invalid_structured_output"  # the grammar compiler refused structured_outputs
    SCHEMA_TOO_COMPLEX = "schema_too_complex"  # structured_outputs over the compile budget (worker.protocol.structured)
    LORA_NOT_FOUND = "lora_not_found"  # the adapter is not registered for this worker's model, or LoRA is off
    LORA_LOAD_FAILED = "lora_load_failed"  # the adapter would not load: corrupt, rank too high, wrong shapes


# Webhook event names, and the job event type each is sent for. A timeout is a failure to the
# receiver (its `data.status` says `timed_out`).
WEBHOOK_EVENTS = ("job.started", "job.completed", "job.failed", "job.cancelled")
WebhookEventName = Literal["job.started", "job.completed", "job.failed", "job.cancelled"]
WEBHOOK_EVENT_FOR = {
    "started": "job.started",
    "completed": "job.completed",
    "failed": "job.failed",
    "timed_out": "job.failed",
    "cancelled": "job.cancelled",
}


# --- the request ---------------------------------------------------------------------------------


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"] = "text"
    text: str


ROLES = ("system", "developer", "user", "assistant", "tool")


class Message(BaseModel):
    """One chat message (OpenAI shape; text content only). A `user`, `system`, `developer` or `tool`
    message needs content; an `assistant` message may carry `tool_calls` instead; a `tool`
    message answers the call named by its `tool_call_id`."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant only: the calls it made
    tool_call_id: str | None = Field(default=None, min_length=1)  # tool only: the call this is the result of

    @model_validator(mode="after")
    def _content(self) -> Message:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        return self

    @property
    def text(self) -> str:
        content = self.content or ""
        return content if isinstance(content, str) else "".join(p.text for p in content)

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template expects it: content as one string (Hugging Face's
        shape for tool calls and tool results)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class Webhook(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str
    events: list[WebhookEventName] = Field(default_factory=lambda: list(WEBHOOK_EVENTS))

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("webhook url must start with http:// or https://")
        return v


# The engine's sampling fields as the job request carries them. `logprobs` is the engine's top-n
# count; the request says it OpenAI's way: `logprobs: bool` + `top_logprobs: n` (below).
_JobSampling = create_model(
    "_JobSampling", __config__=ConfigDict(extra="forbid"), **sampling_fields(exclude=("logprobs",))
)


class JobRequest(_JobSampling, ChatTemplateFields):
    """What a client asked for: one prompt (text or token ids) or one chat, plus sampling fields
    and, for a chat, the chat template's variables (`worker.protocol.chat_template`).

    Field names are OpenAI's; sampling ranges come from `worker.protocol.sampling`, so the API
    answers 422 before enqueueing exactly what the engine would refuse. `logprobs=True` asks for
    the sampled token's logprob and the `top_logprobs` most likely alternatives per token (the
    completions API's `logprobs: int` maps to `logprobs=True, top_logprobs=n`).
    """

    model_config = ConfigDict(extra="forbid")

    model: ModelName  # the served (base) model: it picks the queue
    lora: ModelName | None = None  # a LoRA adapter of `model` to apply (`worker.protocol.loras`)
    prompt: str | TokenIds | None = None
    messages: list[Message] | None = None

    logprobs: Annotated[bool, Strict()] = False
    top_logprobs: sampling_annotation(LIMITS["logprobs"], nullable=False) = 0  # type: ignore[valid-type]
    n: Literal[1] = 1

    priority: Priority = Priority.normal
    ttl_s: JobSeconds | None = None  # max time queued before it starts; None: worker default
    timeout_s: JobSeconds | None = None  # max running time; None: worker default
    tenant: str = "default"
    metadata: Metadata = Field(default_factory=dict)
    webhook: Webhook | None = None
    created_at: float = Field(default_factory=time.time)  # unix seconds when the API accepted it
    cache_salt: str | None = None  # prefix-cache namespace (per tenant or per user)
    structured_outputs: StructuredOutputsRequest | None = None  # a grammar the output must match
    logit_bias: LogitBias | None = None  # token id -> bias added to its logit
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None  # functions it may call
    # none | auto | required | {"type": "function", "function": {"name"}}; unset: auto with tools
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: Annotated[bool, Strict()] = True  # False: at most one call
    # generate; or, without generating, `tokenize` (the result's token_ids: the prompt as the model
    # reads it, chat template applied) or `detokenize` (the result's text: the prompt's token ids decoded)
    task: Literal["generate", "tokenize", "detokenize"] = "generate"

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, value: ToolChoice | None, info) -> ToolChoice | None:
        check_tool_choice(info.data.get("tools"), value)
        return value

    @model_validator(mode="before")
    @classmethod
    def _valid_json(cls, data: Any) -> Any:
        return check_json(data)

    @model_validator(mode="after")
    def _one_input(self) -> JobRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.messages is not None and not self.messages:
            raise ValueError("'messages' must not be empty")
        problem = combination_problem(self.min_tokens, self.max_tokens, self.structured_outputs is not None)
        if problem is not None:
            raise ValueError(problem)
        if self.tools is not None and self.messages is None:
            raise ValueError("tools need 'messages' (a chat)")
        if self.task == "detokenize" and not isinstance(self.prompt, list):
            raise ValueError("detokenize needs the prompt as token ids")
        if self.forced_tool_schema() is not None and (self.structured_outputs is not None or self.min_tokens):
            raise ValueError("tool_choice required or a named function is a grammar of its own: it cannot be "
                             "combined with structured_outputs or min_tokens")
        return self

    @property
    def effective_tool_choice(self) -> ToolChoice:
        """`none` without tools; `auto` with tools and no tool_choice (OpenAI's defaults)."""
        if not self.tools:
            return "none"
        return self.tool_choice or "auto"

    def forced_tool_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must match when tool_choice forces calls (see worker.protocol.tools)."""
        if not self.tools:
            return None
        return forced_tool_schema(self.tools, self.effective_tool_choice, self.parallel_tool_calls)

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the engine's `SamplingParams`."""
        kwargs = {limit.name: getattr(self, limit.name) for limit in SAMPLING_LIMITS if limit.name != "logprobs"}
        kwargs["logprobs"] = self.top_logprobs if self.logprobs else None
        kwargs["cache_salt"] = self.cache_salt
        kwargs["logit_bias"] = self.logit_bias
        if self.structured_outputs is not None:
            kwargs["structured_outputs"] = self.structured_outputs.engine_kwargs()
        forced = self.forced_tool_schema()
        if forced is not None:
            kwargs["structured_outputs"] = StructuredOutputsRequest(json=forced).engine_kwargs()
        return kwargs


# --- results ---------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (OpenAI prompt_tokens_details)


class Timings(BaseModel):
    """Seconds, measured from `created_at` (when the API accepted the job), across retries."""

    queue_s: float | None = None  # accepted -> first started on a worker
    ttft_s: float | None = None  # accepted -> first token
    tbt_s: float | None = None  # mean time between tokens after the first
    total_s: float | None = None  # accepted -> terminal


# --- the queue envelope and the job record ------------------------------------------------------


class Envelope(BaseModel):
    """One queue stream entry: which job, and how many times it has been (re)queued."""

    model_config = ConfigDict(extra="forbid")
    job_id: str = Field(pattern=JOB_ID_PATTERN)
    attempt: int = Field(default=1, ge=1)

    def to_fields(self) -> dict[str, str]:
        return {"job_id": self.job_id, "attempt": str(self.attempt)}

    def to_args(self) -> list[str]:
        """The entry's fields as a script takes them: their count, then field/value pairs."""
        fields = self.to_fields()
        return [str(len(fields)), *(x for pair in fields.items() for x in pair)]

    @classmethod
    def from_fields(cls, fields: dict) -> Envelope:
        """Raises pydantic.ValidationError on a malformed entry."""
        return cls.model_validate(decoded(fields))


_JSON_FIELDS = ("request", "token_ids", "usage", "timings", "stop_reason", "tool_calls", "prompt_logprobs")


def _encode_fields(values: dict[str, Any]) -> dict[str, str]:
    """Fields of a job hash as Redis holds them: JSON for the structured ones, "1"/"0" for booleans,
    decimal strings for numbers."""
    out: dict[str, str] = {}
    for name, value in values.items():
        if name in _JSON_FIELDS:
            out[name] = compact_json(value)
        elif isinstance(value, bool):
            out[name] = "1" if value else "0"
        else:
            out[name] = str(value)
    return out


class JobResult(BaseModel):
    """What a job's terminal write adds to its hash: the `JobRecord` fields a worker fills in when
    the job ends, encoded as `JobRecord` encodes them."""

    state: JobState
    finished_at: float
    worker_id: str
    text: str | None = None  # the whole generated text
    token_ids: list[int] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "tool_calls" on success
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    content: str | None = None  # a chat with tools or a reasoning parser: the answer's text (no calls, no thinking)
    reasoning_content: str | None = None  # a chat with a reasoning parser: the text of its think block
    tool_calls: list[ToolCall] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error_code: str | None = None
    error_message: str | None = None

    def to_redis(self) -> dict[str, str]:
        return _encode_fields(self.model_dump(mode="json", exclude_none=True))


class JobRecord(BaseModel):
    """The job hash `{p}:job:{s<n>}:{id}`: one field per attribute, strings in Redis.

    `request`, `token_ids`, `usage`, `timings` and `stop_reason` are stored as JSON; numbers as
    decimal strings; `cancel` as "1"; absent fields are simply not in the hash.
    """

    id: str
    state: JobState
    model: str
    tenant: str = "default"
    priority: Priority = Priority.normal
    request: JobRequest | None  # None when the stored request does not parse (the job fails: invalid_request)
    created_at: float
    attempts: int = 0  # deliveries that started running (a drain hand-back does not count)
    worker_id: str | None = None  # the worker that ran it last
    cancel: bool = False  # cancellation requested
    started_at: float | None = None  # first time a worker started it
    first_token_at: float | None = None
    finished_at: float | None = None
    text: str | None = None  # the whole generated text, once terminal
    token_ids: list[int] | None = None  # the whole generated token ids, once terminal
    finish_reason: str | None = None  # "stop" | "length" | "tool_calls" on success
    stop_reason: str | int | None = None
    content: str | None = None  # a chat with tools or a reasoning parser: the answer's text, once terminal
    reasoning_content: str | None = None  # a chat with a reasoning parser: its thinking, once terminal
    tool_calls: list[ToolCall] | None = None  # a chat with tools: the calls parsed out of the output
    prompt_logprobs: PromptLogprobs | None = None  # asked for with prompt_logprobs, once terminal
    usage: Usage | None = None
    timings: Timings | None = None
    error_code: str | None = None
    error_message: str | None = None
    batch_id: str | None = None  # the Batch API batch the job is a line of
    custom_id: str | None = None  # that line's custom_id
    rate_budget: str | None = None  # the tenant's rate-limit budget (`live`, `batch`) the tokens were reserved in
    reserved_tokens: int | None = None  # tokens reserved at admission; the difference to the usage is given back
    traceparent: str | None = None  # W3C context of the span that enqueued it (tracing on): its trace goes on there

    @classmethod
    def new(cls, job_id: str, request: JobRequest, batch_id: str | None = None, custom_id: str | None = None,
            reservation: tuple[str, int] | None = None, traceparent: str | None = None) -> JobRecord:
        return cls(
            batch_id=batch_id, custom_id=custom_id, traceparent=traceparent,
            rate_budget=reservation[0] if reservation else None,
            reserved_tokens=reservation[1] if reservation else None,
            id=job_id,
            state=JobState.queued,
            model=request.model,
            tenant=request.tenant,
            priority=request.priority,
            request=request,
            created_at=request.created_at,
        )

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def model_asked(self) -> str:
        """The `model` its client named: the LoRA adapter, if it has one, else the served model."""
        return (self.request.lora if self.request is not None else None) or self.model

    def to_redis(self) -> dict[str, str]:
        return _encode_fields(self.model_dump(mode="json", exclude_none=True))

    @classmethod
    def from_redis(cls, mapping: dict) -> JobRecord | None:
        """Decode HGETALL's answer (bytes or str); None for an empty answer (no such job).
        Raises UnreadableRecord for a hash that is there but incomplete or malformed."""
        if not mapping:
            return None
        data: dict[str, Any] = dict(decoded(mapping))
        try:
            for name in _JSON_FIELDS:
                if name in data:
                    data[name] = _request_or_none(data[name]) if name == "request" else json.loads(data[name])
            if "cancel" in data:
                data["cancel"] = data["cancel"] == "1"
            return cls.model_validate(data)
        except ValueError as exc:  # pydantic's ValidationError and json's errors are ValueErrors
            raise UnreadableRecord(f"job record {data.get('id', '?')!r} is incomplete or malformed: {exc}") from exc


def new_job_id(created_at: float | None = None, shard: int = 0) -> str:
    """32 hex digits, then `-s<shard>`: the creation time in milliseconds (12), 20 random, and the
    queue shard whose hash slot holds the job's keys (`Keys.shard_of`). Ids of one shard sort by
    creation, and an id says when its job was accepted even after the job's record is gone."""
    millis = int((time.time() if created_at is None else created_at) * 1000)
    return f"{millis & 0xFFFF_FFFF_FFFF:012x}{uuid.uuid4().hex[:20]}-s{shard}"


def job_id_created_at(job_id: str) -> float | None:
    """The creation time `new_job_id` put into an id (unix seconds); None for ids of another shape."""
    stamp, _, _ = job_id.partition("-")
    if len(stamp) != 32:
        return None
    try:
        return int(stamp[:12], 16) / 1000
    except ValueError:
        return None


class UnreadableRecord(ValueError):
    """A job hash that exists but does not parse (fields missing: written after its store lost it)."""


def _request_or_none(value: str) -> JobRequest | None:
    try:
        return JobRequest.model_validate_json(value)
    except ValueError:
        return None
