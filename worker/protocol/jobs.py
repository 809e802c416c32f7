"""The wire contract between the API and the workers: job request, job record, queue envelope, events.

Pydantic models and plain redis-py calls only (no torch): this module and `worker.protocol.keys` are all
that `api` imports from `worker`. Key names are in `worker.keys.Keys`; `{p}` below is its prefix.

Life of a job
-------------
1. The API validates a `JobRequest` and calls `enqueue_job` (or `enqueue_job_async`): one Lua
   script, so atomic and one round trip, that
     - with an idempotency key: `GET {p}:idem:{tenant}:{key}`; if set, returns that job id and
       writes nothing; else `SET ... job_id EX idempotency_ttl_s`;
     - `HSET {p}:job:{id}` the fields of `JobRecord.new(...)` (state `queued`, `request` JSON,
       model, tenant, priority, created_at, attempts 0);
     - `XADD {p}:q:{model}:{priority} * job_id {id} attempt 1` (the `Envelope`).
   The XLEN of a queue stream is the number of jobs waiting or in flight (workers XACK and XDEL
   an entry once the job is terminal), which is what the API compares with its queue limit.
2. A worker of `model` reads its queue streams (group `workers`, high before normal before low)
   and moves the job to `running` (fields `state`, `worker_id`, `attempts`, `started_at`), writing
   a `started` event (seq 0) on the first attempt only.
3. After every engine step the worker appends events to `{p}:job:{id}:events` and publishes the
   same JSON on the pub/sub channel `{p}:job:{id}`. Events of a job are numbered by `seq` from 0
   without gaps: `started`, then `token`s, then exactly one terminal event (`completed`, `failed`,
   `cancelled` or `timed_out`). The stream entry id of event `seq` is `{seq}-1`
   (`event_stream_id`), so Redis itself refuses a duplicate seq, SSE `Last-Event-ID: n` resumes
   with `XRANGE events (n-1 +` / `XREAD ... STREAMS events n-1`, and a subscriber that also
   replays the stream drops pub/sub messages whose seq it has already seen.
   Stream entry fields: `seq`, `type`, `data` (the event's JSON, exactly what is published).
4. On a terminal event the worker writes the result into the job hash (`state`, `text`,
   `token_ids`, `finish_reason`, `usage`, `timings`, `error_code`, `error_message`,
   `finished_at`) in the same round trip, sets EXPIRE `result_ttl_s` on the hash and the event
   stream, and only then XACKs (and XDELs) the envelope.
5. Cancel: the API calls `cancel_job` (Lua, atomic): sets `cancel` = "1" on the hash; a job still
   `queued` is finished right there (state `cancelled`, a `cancelled` event at the next seq,
   published, expiry set); every call also PUBLISHes the job id on `{p}:cancel`, which makes the
   worker running the job abort it within one step.
6. A job re-delivered after a worker died, or handed back by a draining worker (which sets its
   state back to `queued` and re-adds it to the `high` stream), resumes from the tokens already
   in its event stream: the client sees no gap and no duplicate. After more than `max_attempts`
   deliveries it goes to `{p}:dlq` and fails with `max_attempts_exceeded`.

Job states: `queued -> running -> succeeded | failed | cancelled | timed_out` (running may go back
to queued on a drain hand-back). Timestamps are unix seconds (float). Hash values are strings;
`JobRecord.from_redis` / `to_redis` convert. Error codes are the `ErrorCode` constants.
"""

from __future__ import annotations

import json
import time
import uuid
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from worker.protocol import lua
from worker.protocol.keys import Keys

PROTOCOL_VERSION = 1


class JobState(StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"
    timed_out = "timed_out"


TERMINAL_STATES = frozenset({JobState.succeeded, JobState.failed, JobState.cancelled, JobState.timed_out})


class Priority(StrEnum):
    high = "high"
    normal = "normal"
    low = "low"


# Engine priority per job priority: lower is served first and preempted last.
ENGINE_PRIORITY = {Priority.high: 0, Priority.normal: 1, Priority.low: 2}


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


# --- the request --------------------------------------------------------------------------------


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"] = "text"
    text: str


class Message(BaseModel):
    """One chat message (OpenAI shape; text content only)."""

    model_config = ConfigDict(extra="forbid")
    role: str
    content: str | list[TextPart] = ""
    name: str | None = None

    def for_template(self) -> dict[str, str]:
        """The message as a chat template expects it: content as one string."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        out = {"role": self.role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        return out


WebhookEventName = Literal["job.started", "job.completed", "job.failed", "job.cancelled"]


class Webhook(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str
    events: list[WebhookEventName] = Field(
        default_factory=lambda: ["job.started", "job.completed", "job.failed", "job.cancelled"]
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("webhook url must start with http:// or https://")
        return v


class JobRequest(BaseModel):
    """What a client asked for: one prompt (text or token ids) or one chat, plus sampling fields.

    Field names are OpenAI's; ranges mirror the engine's `SamplingParams` so the API can answer
    422 before enqueueing. `logprobs=True` asks for the sampled token's logprob and the
    `top_logprobs` most likely alternatives per token (the completions API's `logprobs: int` maps
    to `logprobs=True, top_logprobs=n`).
    """

    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: str | list[int] | None = None
    messages: list[Message] | None = None

    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # 0 or -1: no limit
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)
    n: Literal[1] = 1

    priority: Priority = Priority.normal
    ttl_s: float | None = Field(default=None, gt=0)  # max time queued before it starts; None: worker default
    timeout_s: float | None = Field(default=None, gt=0)  # max running time; None: worker default
    tenant: str = "default"
    metadata: dict[str, Any] = Field(default_factory=dict)
    webhook: Webhook | None = None
    created_at: float = Field(default_factory=time.time)  # unix seconds when the API accepted it
    cache_salt: str | None = None  # prefix-cache namespace (per tenant or per user)

    @model_validator(mode="after")
    def _one_input(self) -> JobRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.messages is not None and not self.messages:
            raise ValueError("'messages' must not be empty")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the engine's `SamplingParams`."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "logprobs": self.top_logprobs if self.logprobs else None,
            "cache_salt": self.cache_salt,
        }


# --- results -------------------------------------------------------------------------------------


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


class TopLogprob(BaseModel):
    token_id: int
    token: str | None = None
    logprob: float


class TokenLogprob(BaseModel):
    """The sampled token's logprob and the most likely alternatives at its position."""

    token_id: int
    token: str | None = None
    logprob: float
    top: list[TopLogprob] = Field(default_factory=list)


# --- events --------------------------------------------------------------------------------------


class _EventBase(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seq: int = Field(ge=0)  # 0, 1, 2, ... per job without gaps; first field (see `cancel_job`)
    ts: float = Field(default_factory=time.time)  # unix seconds when the worker wrote it


class StartedEvent(_EventBase):
    type: Literal["started"] = "started"
    worker_id: str
    attempt: int


class TokenEvent(_EventBase):
    type: Literal["token"] = "token"
    text: str  # text released by this step ("" while a possible stop string is held back)
    token_ids: list[int]  # tokens generated by this step (usually one)
    logprobs: list[TokenLogprob] | None = None  # one per token id when the request asked for logprobs


class CompletedEvent(_EventBase):
    type: Literal["completed"] = "completed"
    finish_reason: Literal["stop", "length"]
    stop_reason: str | int | None = None  # the stop string or stop token id, when one ended it
    usage: Usage
    timings: Timings


class FailedEvent(_EventBase):
    type: Literal["failed"] = "failed"
    code: str  # an ErrorCode constant
    message: str


class CancelledEvent(_EventBase):
    type: Literal["cancelled"] = "cancelled"


class TimedOutEvent(_EventBase):
    type: Literal["timed_out"] = "timed_out"
    code: str  # ErrorCode.TTL_EXPIRED or ErrorCode.EXECUTION_TIMEOUT
    message: str


Event = Annotated[
    StartedEvent | TokenEvent | CompletedEvent | FailedEvent | CancelledEvent | TimedOutEvent,
    Field(discriminator="type"),
]
TERMINAL_EVENT_TYPES = frozenset({"completed", "failed", "cancelled", "timed_out"})
# Terminal event type -> the job state it leaves.
STATE_AFTER_EVENT = {
    "completed": JobState.succeeded,
    "failed": JobState.failed,
    "cancelled": JobState.cancelled,
    "timed_out": JobState.timed_out,
}
_EVENT_ADAPTER: TypeAdapter = TypeAdapter(Event)


def encode_event(event: BaseModel) -> str:
    """The event's JSON: what is published on `{p}:job:{id}` and stored as the stream's `data`."""
    return event.model_dump_json()


def decode_event(data: str | bytes) -> Event:
    return _EVENT_ADAPTER.validate_json(data)


def event_stream_id(seq: int) -> str:
    """Stream entry id of event `seq`: `{seq}-1`, so Redis refuses a second event with the same seq."""
    return f"{seq}-1"


def seq_of_stream_id(entry_id: str | bytes) -> int:
    return int(_text(entry_id).split("-", 1)[0])


def event_to_fields(event: BaseModel) -> dict[str, str]:
    """Field map of the event's stream entry."""
    return {"seq": str(event.seq), "type": event.type, "data": encode_event(event)}


def event_from_fields(fields: dict) -> Event:
    """Decode a stream entry's field map (bytes or str keys) back into an event."""
    return decode_event(_decoded(fields)["data"])


# --- the queue envelope and the job record ------------------------------------------------------


class Envelope(BaseModel):
    """One queue stream entry: which job, and how many times it has been (re)queued."""

    model_config = ConfigDict(extra="forbid")
    job_id: str = Field(min_length=1)
    attempt: int = Field(default=1, ge=1)

    def to_fields(self) -> dict[str, str]:
        return {"job_id": self.job_id, "attempt": str(self.attempt)}

    @classmethod
    def from_fields(cls, fields: dict) -> Envelope:
        """Raises pydantic.ValidationError on a malformed entry."""
        return cls.model_validate(_decoded(fields))


_JSON_FIELDS = ("request", "token_ids", "usage", "timings", "stop_reason")


class JobRecord(BaseModel):
    """The job hash `{p}:job:{id}`: one field per attribute, strings in Redis.

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
    finish_reason: str | None = None  # "stop" | "length" on success
    stop_reason: str | int | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error_code: str | None = None
    error_message: str | None = None

    @classmethod
    def new(cls, job_id: str, request: JobRequest) -> JobRecord:
        return cls(
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

    def to_redis(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for name, value in self.model_dump(mode="json", exclude_none=True).items():
            if name in _JSON_FIELDS:
                out[name] = _json(value)
            elif isinstance(value, bool):
                out[name] = "1" if value else "0"
            else:
                out[name] = str(value)
        return out

    @classmethod
    def from_redis(cls, mapping: dict) -> JobRecord | None:
        """Decode HGETALL's answer (bytes or str); None for an empty answer (no such job)."""
        if not mapping:
            return None
        data: dict[str, Any] = dict(_decoded(mapping))
        for name in _JSON_FIELDS:
            if name in data:
                data[name] = _unjson_or_none(data[name]) if name == "request" else _unjson(data[name])
        if "cancel" in data:
            data["cancel"] = data["cancel"] == "1"
        return cls.model_validate(data)


def new_job_id() -> str:
    return uuid.uuid4().hex


# --- atomic writes the API makes -----------------------------------------------------------------

# KEYS: job hash, queue stream[, idempotency key]. ARGV: job id, idempotency ttl, field, value, ...
_ENQUEUE_LUA = """
if #KEYS == 3 then
  local existing = redis.call('GET', KEYS[3])
  if existing then return {0, existing} end
  redis.call('SET', KEYS[3], ARGV[1], 'EX', ARGV[2])
end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('XADD', KEYS[2], '*', 'job_id', ARGV[1], 'attempt', '1')
return {1, ARGV[1]}
"""

# KEYS: job hash, events stream. ARGV: result ttl, now, cancel channel, job channel, job id,
# the cancelled event's JSON after its leading `{"seq":N` (seq is decided here, atomically).
_CANCEL_LUA = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return false end
if state == 'succeeded' or state == 'failed' or state == 'cancelled' or state == 'timed_out' then
  return state
end
redis.call('HSET', KEYS[1], 'cancel', '1')
if state == 'queued' then
  local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
  local seq = 0
  if #last > 0 then seq = tonumber(string.match(last[1][1], '^(%d+)')) + 1 end
  local data = '{"seq":' .. seq .. ARGV[6]
  redis.call('XADD', KEYS[2], seq .. '-1', 'seq', tostring(seq), 'type', 'cancelled', 'data', data)
  redis.call('HSET', KEYS[1], 'state', 'cancelled', 'finished_at', ARGV[2])
  redis.call('EXPIRE', KEYS[1], ARGV[1])
  redis.call('EXPIRE', KEYS[2], ARGV[1])
  redis.call('PUBLISH', ARGV[4], data)
  state = 'cancelled'
end
redis.call('PUBLISH', ARGV[3], ARGV[5])
return state
"""


class EnqueueResult(BaseModel):
    job_id: str
    created: bool  # False: the idempotency key already named `job_id`, nothing was written


def _enqueue_call(keys: Keys, request: JobRequest, job_id: str | None, idempotency_key: str | None, idempotency_ttl_s: int):
    job_id = job_id or new_job_id()
    record = JobRecord.new(job_id, request)
    redis_keys = [keys.job(job_id), keys.queue(request.model, request.priority.value)]
    if idempotency_key is not None:
        redis_keys.append(keys.idempotency(request.tenant, idempotency_key))
    args: list[str] = [job_id, str(int(idempotency_ttl_s))]
    for field, value in record.to_redis().items():
        args += [field, value]
    return redis_keys, args


def _enqueue_result(answer) -> EnqueueResult:
    created, job_id = answer
    return EnqueueResult(job_id=_text(job_id), created=bool(int(created)))


def enqueue_job(
    client,
    keys: Keys,
    request: JobRequest,
    *,
    job_id: str | None = None,
    idempotency_key: str | None = None,
    idempotency_ttl_s: int = 86400,
) -> EnqueueResult:
    """Write the job hash and its envelope atomically (sync `redis.Redis`). See the module docstring."""
    redis_keys, args = _enqueue_call(keys, request, job_id, idempotency_key, idempotency_ttl_s)
    return _enqueue_result(client.register_script(_ENQUEUE_LUA)(keys=redis_keys, args=args))


async def enqueue_job_async(
    client,
    keys: Keys,
    request: JobRequest,
    *,
    job_id: str | None = None,
    idempotency_key: str | None = None,
    idempotency_ttl_s: int = 86400,
) -> EnqueueResult:
    """`enqueue_job` for `redis.asyncio.Redis`."""
    redis_keys, args = _enqueue_call(keys, request, job_id, idempotency_key, idempotency_ttl_s)
    return _enqueue_result(await client.register_script(_ENQUEUE_LUA)(keys=redis_keys, args=args))


def enqueue_jobs(client, keys: Keys, requests: list[JobRequest], *, job_ids: list[str] | None = None) -> list[EnqueueResult]:
    """Many jobs in one round trip (sync client), each atomic on its own: a batch arrives at the
    workers together instead of trickling in over many round trips."""
    script = client.register_script(_ENQUEUE_LUA)
    calls = [_enqueue_call(keys, request, job_id, None, 0)
             for request, job_id in zip(requests, job_ids or [None] * len(requests), strict=True)]

    def build():
        pipe = client.pipeline(transaction=False)
        for redis_keys, args in calls:
            lua.add(pipe, script, redis_keys, args)
        return pipe

    # Bare EVALSHAs: redis-py's own pipelined scripts first ask SCRIPT EXISTS, one more round trip.
    answers = lua.execute(build, [script])
    for answer in answers:
        if isinstance(answer, Exception):
            raise answer
    return [_enqueue_result(answer) for answer in answers]


def _cancel_call(keys: Keys, job_id: str, result_ttl_s: int):
    now = time.time()
    data = encode_event(CancelledEvent(seq=0, ts=now))
    head = '{"seq":0'
    assert data.startswith(head), data  # seq is the events' first field
    args = [str(int(result_ttl_s)), repr(now), keys.cancel, keys.channel(job_id), job_id, data[len(head):]]
    return [keys.job(job_id), keys.events(job_id)], args


def cancel_job(client, keys: Keys, job_id: str, *, result_ttl_s: int = 86400) -> JobState | None:
    """Request cancellation (sync client). Returns the state after the call, None for an unknown job.

    A queued job is `cancelled` at once; a running one stays `running` until its worker aborts it
    within one step (watch the events); a terminal one is left as it is.
    """
    redis_keys, args = _cancel_call(keys, job_id, result_ttl_s)
    answer = client.register_script(_CANCEL_LUA)(keys=redis_keys, args=args)
    return None if answer is None else JobState(_text(answer))


async def cancel_job_async(client, keys: Keys, job_id: str, *, result_ttl_s: int = 86400) -> JobState | None:
    """`cancel_job` for `redis.asyncio.Redis`."""
    redis_keys, args = _cancel_call(keys, job_id, result_ttl_s)
    answer = await client.register_script(_CANCEL_LUA)(keys=redis_keys, args=args)
    return None if answer is None else JobState(_text(answer))


# --- small codecs --------------------------------------------------------------------------------


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _decoded(mapping: dict) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in mapping.items()}


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _unjson(value: str) -> Any:
    return json.loads(value)


def _unjson_or_none(value: str) -> JobRequest | None:
    try:
        return JobRequest.model_validate_json(value)
    except ValueError:
        return None
