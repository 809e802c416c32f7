"""OpenAI-compatible completions, chat completions and models, through the same job queue.

A request becomes a job like any other (so it is queued, prioritised, retried and visible at
`/v1/jobs/{id}`); the handler follows the job's events and answers in OpenAI's shapes, as one
JSON body or as `stream: true` SSE chunks ending in `data: [DONE]`. A client that goes away
cancels its job.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ferry.api.auth import tenant
from ferry.api.errors import ApiError, error_body
from ferry.api.offloop import OffLoopBodyRoute
from ferry.api.openai_schemas import (
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    lane,
    sse_200,
)
from ferry.api.ratelimit import admit_jobs
from ferry.api.schemas import error_responses
from ferry.api.services import (
    Services,
    cancel_job,
    check_against_model,
    live,
    new_job_request,
    refund,
    resolve_model,
    services,
    submit,
)
from ferry.api.streaming import KEEPALIVE, SSE_HEADERS, follow_events, resume_comment, sse, sse_json
from ferry.worker.protocol import (
    TERMINAL_EVENT_TYPES,
    ErrorCode,
    Event,
    JobRequest,
    TokenLogprob,
    Usage,
)
from ferry.worker.protocol.sampling import SAMPLING_LIMITS
from ferry.worker.protocol.tools import ChatDelta, ToolCall

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OffLoopBodyRoute)

Svc = Annotated[Services, Depends(services)]
Tenant = Annotated[str, Depends(tenant)]

_SAMPLING = tuple(limit.name for limit in SAMPLING_LIMITS if limit.name != "logprobs")  # logprobs: per route
_INPUT_ERRORS = {
    ErrorCode.INVALID_REQUEST, ErrorCode.INVALID_SAMPLING_PARAMS, ErrorCode.INVALID_PROMPT, ErrorCode.PROMPT_TOO_LONG,
    ErrorCode.INVALID_STRUCTURED_OUTPUT,
}
MAX_PROMPTS = 64  # prompts in one /v1/completions request: each is a job of its own
_PRIME_S = 2.0  # how long a stream waits for its job's first token before sending headers
_TICK_S = 0.5  # idle ticks: disconnect checks and keep-alive timing
_ENDED = object()  # what anext() gives for a follow that has ended
DEADLINE_MARGIN_S = 30.0  # an answer waits for its job's ttl_s + timeout_s and this long, then gives up


# --- requests -> jobs ----------------------------------------------------------------------------


def _job_request(svc: Services, tenant_name: str, model: str, body, **fields) -> JobRequest:
    for name in _SAMPLING:
        value = getattr(body, name)
        if value is not None and name not in fields:
            fields[name] = value
    if body.logit_bias:
        fields["logit_bias"] = body.logit_bias
    for name in UNSUPPORTED_FIELDS:
        value = getattr(body, name)
        if value not in (None, [], "none"):  # no tools, or tools never called, is what Ferry does
            hint = "; use structured_outputs" if name.startswith("guided_") else ""
            raise ApiError(422, "unsupported", f"{name} is not supported{hint}", field=name)
    fields["structured_outputs"] = _structured_outputs(body)
    metadata = {"api": "openai", "user": body.user} if body.user else {"api": "openai"}
    return new_job_request(svc, tenant_name, model, fields, priority=lane(body.priority), metadata=metadata)


def _structured_outputs(body):
    """vLLM's `structured_outputs`, or OpenAI's `response_format` (not both)."""
    from_format = body.response_format.structured_outputs() if body.response_format is not None else None
    if from_format is not None and body.structured_outputs is not None:
        raise ApiError(422, "invalid_request", "give response_format or structured_outputs, not both",
                       field="response_format")
    return from_format or body.structured_outputs


def prompts(prompt) -> list:
    """OpenAI's prompt: one text or token-id list, or a batch of them (one job and one choice each)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return prompt
    return [prompt]


def completion_jobs(svc: Services, tenant_name: str, model: str, body: CompletionRequest) -> list[JobRequest]:
    """One job per prompt, in the prompts' order (the choices' indexes)."""
    if body.suffix:
        raise ApiError(422, "unsupported", "suffix is not supported", field="suffix")
    batch = prompts(body.prompt)
    if not batch or any(len(p) == 0 for p in batch):
        raise ApiError(422, "invalid_request", "prompt: give at least one prompt, none of them empty", field="prompt")
    if len(batch) > MAX_PROMPTS:
        raise ApiError(422, "invalid_request", f"prompt: at most {MAX_PROMPTS} prompts per request", field="prompt")
    if len(batch) > 1 and body.stream:
        raise ApiError(422, "unsupported", "stream: a list of prompts is answered whole; stream one prompt per "
                       "request", field="stream")
    if body.echo and (body.logprobs is not None or any(not isinstance(p, str) for p in batch)):
        raise ApiError(422, "unsupported", "echo: supported for text prompts without logprobs", field="echo")
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(422, "unsupported", "best_of: only equal to n (every choice is returned)", field="best_of")
    if body.n > 1 and body.stream:
        raise ApiError(422, "unsupported", "stream: n > 1 is answered whole; stream with n = 1", field="stream")
    if len(batch) * body.n > MAX_PROMPTS:
        raise ApiError(422, "invalid_request", f"prompt x n: at most {MAX_PROMPTS} choices per request", field="n")
    fields = {}
    if body.logprobs is not None:
        fields |= {"logprobs": True, "top_logprobs": body.logprobs}
    # Choices prompt-major, as OpenAI orders them: prompt i's j-th choice has index i * n + j.
    requests = [_job_request(svc, tenant_name, model, body, prompt=p, **fields) for p in batch]
    return [choice for request in requests for choice in _choices(request, body.n)]


def _choices(job: JobRequest, n: int) -> list[JobRequest]:
    """`n` jobs of one request, one per choice (a seed, if given, moves by the choice's index so
    sampled choices differ); their prompts are the same tokens, shared through the prefix cache."""
    return [job] + [job.model_copy(update={"seed": job.seed + i} if job.seed is not None else {}) for i in range(1, n)]


def chat_jobs(svc: Services, tenant_name: str, model: str, body: ChatCompletionRequest) -> list[JobRequest]:
    fields: dict = {"messages": body.messages}
    if body.max_completion_tokens is not None:
        fields["max_tokens"] = body.max_completion_tokens
    if body.logprobs:
        fields |= {"logprobs": True, "top_logprobs": body.top_logprobs or 0}
    if body.tools is not None:
        fields |= {"tools": body.tools, "tool_choice": body.tool_choice}
        if body.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = body.parallel_tool_calls
    elif body.tool_choice not in (None, "none"):
        raise ApiError(422, "invalid_request", "tool_choice needs tools", field="tool_choice")
    return _choices(_job_request(svc, tenant_name, model, body, **fields), body.n)


# --- events -> OpenAI shapes ---------------------------------------------------------------------


def _token(lp) -> str:
    return lp.token if lp.token is not None else f"token_id:{lp.token_id}"


def completion_logprobs(logprobs: list[TokenLogprob], offset: int) -> dict:
    tokens = [_token(lp) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    tops = []
    for lp in logprobs:
        top: dict[str, float] = {}
        for t in lp.top:  # best first; distinct ids may decode to the same string (byte fragments)
            top.setdefault(_token(t), t.logprob)
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(logprobs: list[TokenLogprob]) -> dict:
    def entry(lp) -> dict:
        token = _token(lp)
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode())}

    return {"content": [entry(lp) | {"top_logprobs": [entry(t) for t in lp.top]} for lp in logprobs]}


def usage_json(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def job_error(event) -> ApiError:
    """The HTTP error for a job that ended without a completion."""
    if event.type == "cancelled":
        return ApiError(409, "job_cancelled", "the job was cancelled")
    if event.type == "timed_out":
        return ApiError(504, event.code, event.message)
    if event.code in _INPUT_ERRORS:
        return ApiError(422, event.code, event.message)
    return ApiError(500, event.code, event.message)


@dataclass(slots=True)
class Shape:
    """How one API renders a job: a chunk per token event, and the final body."""

    id: str
    model: str
    created: int
    chat: bool
    logprobs: bool
    index: int = 0  # the choice's index: the prompt's place in a batch of prompts
    echo: str = ""  # the prompt, put before the completion (completions' `echo`)
    text: str = ""  # everything released so far
    token_logprobs: list[TokenLogprob] = field(default_factory=list)
    tools: bool = False  # a chat that may call tools: its events carry the text parsed into content and calls
    content: str = ""  # with tools: the released text that is not a tool call
    tool_calls: list[ToolCall] = field(default_factory=list)  # with tools: the calls, once complete

    def add(self, event) -> None:
        """Take in a token event's text (and, with tools, its content and calls)."""
        self.text += event.text
        self.token_logprobs += event.logprobs or []
        if self.tools and event.chat is not None:
            self.content += event.chat.content

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chat_delta_chunk(self, delta: ChatDelta, logprobs: list[TokenLogprob] | None) -> dict | None:
        """A chat-with-tools chunk: content and tool-call pieces (OpenAI's stream shape), or None
        when the step released nothing (text held back while it may still be a call)."""
        if not delta and not (self.logprobs and logprobs):
            return None
        out: dict = {}
        if delta.content:
            out["content"] = delta.content
        if delta.tool_calls:
            out["tool_calls"] = [d.model_dump(exclude_none=True) for d in delta.tool_calls]
        choice = {"index": self.index, "delta": out,
                  "logprobs": chat_logprobs(logprobs) if self.logprobs and logprobs else None, "finish_reason": None}
        return self._head("chat.completion.chunk") | {"choices": [choice]}

    def chunk(self, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None = None) -> dict:
        if self.chat:
            choice = {
                "index": self.index,
                "delta": {"content": text} if text or finish_reason is None else {},
                "logprobs": chat_logprobs(logprobs) if self.logprobs and logprobs else None,
                "finish_reason": finish_reason,
            }
            return self._head("chat.completion.chunk") | {"choices": [choice]}
        lps = completion_logprobs(logprobs, len(self.text)) if self.logprobs and logprobs else None
        choice = {"index": self.index, "text": text, "logprobs": lps, "finish_reason": finish_reason}
        return self._head("text_completion") | {"choices": [choice]}

    def first_chunk(self) -> dict | None:
        if not self.chat:
            return self.chunk(self.echo, None) if self.echo else None
        choice = {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return self._head("chat.completion.chunk") | {"choices": [choice]}

    def usage_chunk(self, usage: Usage) -> dict:
        return self._head("chat.completion.chunk" if self.chat else "text_completion") | {
            "choices": [],
            "usage": usage_json(usage),
        }

    def body(self, finish_reason: str, usage: Usage) -> dict:
        if self.chat:
            message: dict = {"role": "assistant", "content": self.text}
            if self.tools:
                message = {"role": "assistant", "content": self.content or None,
                           "tool_calls": [c.model_dump() for c in self.tool_calls] or None}
            choice = {
                "index": self.index,
                "message": message,
                "logprobs": chat_logprobs(self.token_logprobs) if self.logprobs else None,
                "finish_reason": finish_reason,
            }
            head = self._head("chat.completion")
        else:
            lps = completion_logprobs(self.token_logprobs, 0) if self.logprobs else None
            choice = {"index": self.index, "text": self.echo + self.text, "logprobs": lps,
                      "finish_reason": finish_reason}
            head = self._head("text_completion")
        return head | {"choices": [choice], "usage": usage_json(usage)}


# --- running a job for one HTTP request ----------------------------------------------------------


async def _cancel_quietly(svc: Services, job_id: str) -> None:
    with anyio.CancelScope(shield=True):
        await cancel_job(svc, job_id)


async def _answer(svc: Services, http: Request, jobs: list[JobRequest], shape_for: Callable[[str, int], Shape],
                  stream: bool, include_usage: bool):
    """Run the jobs (one per prompt; only a single job streams) and answer with one body whose
    choices are theirs, in order. Any job's failure, a timeout or a client gone cancels them all."""
    for job in jobs:
        await check_against_model(svc, job)
    reservations = await admit_jobs(svc, http.state, jobs[0].tenant, jobs)
    job_ids: list[str] = []
    try:
        for job, reservation in zip(jobs, reservations, strict=True):
            job_ids.append((await submit(svc, job, None, source="openai", reservation=reservation)).job_id)
    except BaseException:
        # A job that did not get in (a full queue: 429 queue_full) gave its tokens back in submit;
        # the ones queued before it are cancelled (which gives theirs back), those after it never
        # ran, and the request is refunded when none of its jobs was queued.
        await _cancel_all(svc, job_ids)
        if reservations[0] is not None:  # one admission: every job's reservation names its budget
            unsent = sum(tokens for _, tokens in reservations[len(job_ids) + 1:])
            await refund(svc, jobs[0].tenant, (reservations[0][0], unsent), requests=int(not job_ids))
        raise
    shapes = [shape_for(job_id, i) for i, job_id in enumerate(job_ids)]
    # Past its queueing and running limits a job can only have been lost (no worker took it): the
    # answer, streamed or not, ends then.
    deadline_s = (jobs[0].ttl_s or 0) + (jobs[0].timeout_s or 0) + DEADLINE_MARGIN_S
    if stream:
        events = follow_events(svc.redis, svc.hub, svc.keys, job_ids[0], idle_s=_TICK_S,
                               resync_s=svc.settings.sse_keepalive_s)
        return await _stream(svc, http, job_ids[0], events, shapes[0], include_usage, deadline_s)
    try:
        async with asyncio.timeout(deadline_s):
            ends = await asyncio.gather(*(_collect(svc, http, shape, job_id) for shape, job_id in zip(shapes, job_ids,
                                                                                                    strict=True)))
    except TimeoutError:
        await _cancel_all(svc, job_ids)
        raise ApiError(504, "timeout", "no result in time; the job was cancelled") from None
    except BaseException:
        await _cancel_all(svc, job_ids)
        raise
    if any(end is None for end in ends):  # the client went away, or the process is shutting down
        await _cancel_all(svc, job_ids)
        if svc.hub.stopping:
            raise ApiError(503, "shutting_down", "this server is shutting down; retry",
                           headers={"Retry-After": "1"})
        return JSONResponse({}, status_code=499)
    bodies = [shape.body(end.finish_reason, end.usage) for shape, end in zip(shapes, ends, strict=True)]
    body = bodies[0] | {"choices": [b["choices"][0] for b in bodies]}
    body["usage"] = usage_json(Usage(**{name: sum(getattr(end.usage, name) for end in ends)
                                        for name in Usage.model_fields}))
    return JSONResponse(body)


async def _cancel_all(svc: Services, job_ids: list[str]) -> None:
    for job_id in job_ids:
        await _cancel_quietly(svc, job_id)


async def _collect(svc: Services, http: Request, shape: Shape, job_id: str) -> Event | None:
    """Follow one job into `shape` until its `completed` event (returned); None when the client
    went away; raises the job's error when it ended otherwise."""
    events = follow_events(svc.redis, svc.hub, svc.keys, job_id, idle_s=_TICK_S,
                           resync_s=svc.settings.sse_keepalive_s)
    try:
        async for batch in events:
            if batch is None:
                if await http.is_disconnected():
                    return None
                continue
            for event in batch:
                if event.type == "token":
                    shape.add(event)
                elif event.type == "completed":
                    shape.tool_calls = list(event.tool_calls or [])
                    return event
                elif event.type in TERMINAL_EVENT_TYPES:
                    raise job_error(event)
        return None
    finally:
        await events.aclose()


async def _prime(events: AsyncIterator[list[Event] | None]) -> list[Event]:
    """Events up to the job's first token or end, or what came within `_PRIME_S`: so a job that
    fails at once (say, a prompt too long) is still answered with an HTTP error status."""
    buffered: list[Event] = []
    started = time.monotonic()
    async for batch in events:
        if batch is not None:
            buffered += batch
            if buffered[-1].type != "started":
                break
        elif time.monotonic() - started > _PRIME_S:
            break
    return buffered


async def _stream(svc: Services, http: Request, job_id: str, events, shape: Shape, include_usage: bool,
                  deadline_s: float):
    try:
        buffered = await _prime(events)
    except BaseException:
        await events.aclose()
        raise
    if buffered and buffered[-1].type in TERMINAL_EVENT_TYPES and buffered[-1].type != "completed":
        await events.aclose()
        raise job_error(buffered[-1])

    def chunk(payload: dict) -> str:
        if include_usage and "usage" not in payload:
            payload["usage"] = None
        return sse_json(payload)

    def render(event: Event) -> list[str]:
        """The SSE messages for one event; the last event's end with `[DONE]`."""
        if event.type == "token" and shape.tools:
            piece = shape.chat_delta_chunk(event.chat or ChatDelta(), event.logprobs)
            shape.add(event)
            return [chunk(piece)] if piece is not None else []
        if event.type == "token":
            out = (
                [chunk(shape.chunk(event.text, event.logprobs))]
                if event.text or (shape.logprobs and event.logprobs)
                else []
            )
            shape.text += event.text
            return out
        if event.type == "completed":
            out = [chunk(shape.chunk("", None, event.finish_reason))]
            return out + ([chunk(shape.usage_chunk(event.usage))] if include_usage else []) + [sse("[DONE]")]
        if event.type in TERMINAL_EVENT_TYPES:
            error = job_error(event)
            return [sse_json(error_body(error.status, error.code, error.message)), sse("[DONE]")]
        return []

    async def body():
        finished, last_seq = False, -1
        last_write = time.monotonic()
        deadline = last_write + deadline_s
        try:
            first = shape.first_chunk()
            out = [chunk(first)] if first is not None else []
            batch: list[Event] | None = buffered
            while True:
                if batch is not None:
                    for event in batch:
                        out += render(event)
                    finished = bool(batch) and batch[-1].type in TERMINAL_EVENT_TYPES
                    last_seq = batch[-1].seq if batch else last_seq
                if out or (batch is None and time.monotonic() - last_write >= svc.settings.sse_keepalive_s):
                    last_write = time.monotonic()
                    yield "".join(out) or KEEPALIVE  # a burst of events goes out as one write
                    out = []
                if finished:
                    break
                batch = await anext(events, _ENDED)
                if batch is _ENDED:  # before the terminal event: the process is shutting down
                    yield resume_comment(job_id, last_seq)
                    break
                if batch is None and time.monotonic() > deadline:
                    late = error_body(504, "timeout", "no result in time; the job was cancelled")
                    yield sse_json(late) + sse("[DONE]")
                    break
        finally:
            with anyio.CancelScope(shield=True):
                await events.aclose()
            if not finished and not svc.hub.stopping:  # the client went away mid-stream, or the deadline passed
                await _cancel_quietly(svc, job_id)

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


@router.post(
    "/completions",
    response_model=CompletionResponse,
    responses=sse_200(CompletionResponse) | error_responses(401, 404, 409, 413, 422, 429, 503, 504),
    summary="Create a completion (OpenAI-compatible)",
)
async def completions(body: CompletionRequest, http: Request, svc: Svc, tenant_name: Tenant):
    model = await resolve_model(svc, body.model)
    jobs = completion_jobs(svc, tenant_name, model, body)
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)

    def shape(job_id: str, index: int) -> Shape:
        return Shape(f"cmpl-{job_id}", model, int(jobs[0].created_at), chat=False, logprobs=body.logprobs is not None,
                     index=index, echo=jobs[index].prompt if body.echo else "")

    return await _answer(svc, http, jobs, shape, body.stream, include_usage)


@router.post(
    "/chat/completions",
    response_model=ChatCompletionResponse,
    responses=sse_200(ChatCompletionResponse) | error_responses(401, 404, 409, 413, 422, 429, 503, 504),
    summary="Create a chat completion (OpenAI-compatible)",
)
async def chat_completions(body: ChatCompletionRequest, http: Request, svc: Svc, tenant_name: Tenant):
    model = await resolve_model(svc, body.model)
    jobs = chat_jobs(svc, tenant_name, model, body)
    if len(jobs) > 1 and body.stream:
        raise ApiError(422, "unsupported", "stream: n > 1 is answered whole; stream with n = 1", field="stream")
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    tools = jobs[0].effective_tool_choice != "none"

    def shape(job_id: str, index: int) -> Shape:
        return Shape(f"chatcmpl-{job_id}", model, int(jobs[0].created_at), chat=True, logprobs=body.logprobs,
                     index=index, tools=tools)

    return await _answer(svc, http, jobs, shape, body.stream, include_usage)


@router.get("/models", response_model=ModelList, responses=error_responses(401),
            summary="Models served: those with a live worker and every configured one (FERRY_MODELS)")
async def models(svc: Svc, _: Tenant) -> ModelList:
    """A configured model is listed even while its pool is scaled to zero: its jobs queue and wake
    the pool. `created` is the model's last worker heartbeat (0: no worker of it seen yet)."""
    seen = await svc.heartbeats.beats()
    names = set(live(seen, svc.settings.model_liveness_s)) | svc.configured_models
    return ModelList(data=[ModelCard(id=name, created=int(seen.get(name, 0))) for name in sorted(names)])
