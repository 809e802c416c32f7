"""A `/v1/responses` body as a Ferry job: input items become chat messages, function tools Ferry's
tools, `text.format` a structured-output request; `previous_response_id` puts the earlier response's
conversation (its input and its output) before the new input.

A response is its job: `resp_<job id>`. What the Responses API returns beside the job's own fields
(instructions, the caller's metadata, store, background, the format's name) is kept in the job's
`metadata` under `responses` (`ResponseMeta`), so a stored response needs no record of its own and
expires with its job.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ferry.api.errors import ApiError, unsupported
from ferry.api.openai_schemas import lane
from ferry.api.responses_schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    MessageItem,
    ResponseCreate,
)
from ferry.api.services import ModelRoute, Services, get_job, new_job_request
from ferry.worker.protocol import JobRecord, JobRequest, JobState, Message
from ferry.worker.protocol.tools import FunctionCall, FunctionName, NamedToolChoice, Tool, ToolCall

RESPONSE_PREFIX = "resp_"


def response_id(job_id: str) -> str:
    return RESPONSE_PREFIX + job_id


def job_id_of(response: str) -> str:
    return response.removeprefix(RESPONSE_PREFIX)


@dataclass(slots=True)
class ResponseMeta:
    """What a response keeps beside its job (in the job's metadata, key `responses`)."""

    instructions: bool = False  # the job's first message is the request's `instructions`
    store: bool = True  # False: the response cannot be read back or chained
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)  # the caller's, returned as given
    format_name: str | None = None  # text.format's name (a json_schema format)
    user: str | None = None

    @classmethod
    def of(cls, record: JobRecord) -> ResponseMeta | None:
        """The response's fields of a job made by /v1/responses; None for any other job."""
        meta = record.request.metadata if record.request is not None else {}
        raw = meta.get("responses") if meta.get("api") == "responses" else None
        return cls(**raw) if isinstance(raw, dict) else None


def input_messages(items: str | list) -> list[Message]:
    """Input items as chat messages: consecutive function calls join the assistant turn before them;
    reasoning items are left out (earlier turns' thinking is not part of the prompt)."""
    if isinstance(items, str):
        return [Message(role="user", content=items)]
    messages: list[Message] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append(Message(role=item.role, content=item.text()))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(Message(role="assistant", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(Message(role="tool", tool_call_id=item.call_id, content=item.output))
    return messages


def answer_message(record: JobRecord) -> Message:
    """A finished response's output as the assistant turn of its conversation."""
    content = (record.content if record.content is not None else record.text) or ""
    if record.tool_calls:  # a turn of calls: content only where the model wrote some beside them
        return Message(role="assistant", content=content or None, tool_calls=record.tool_calls)
    return Message(role="assistant", content=content)


async def conversation_before(svc: Services, tenant_name: str, previous_response_id: str) -> list[Message]:
    """The messages of the response `previous_response_id` names (its instructions left out) and its
    answer: what a chained response's input follows."""
    try:
        record = await get_job(svc, job_id_of(previous_response_id), tenant_name)
    except ApiError:
        record = None
    meta = ResponseMeta.of(record) if record is not None else None
    if record is None or meta is None or not meta.store:
        raise ApiError(404, "previous_response_not_found", f"previous response {previous_response_id!r} not found",
                       field="previous_response_id")
    if record.state != JobState.succeeded:
        raise ApiError(409, "previous_response_unfinished", f"previous response {previous_response_id!r} is "
                       f"{record.state.value}: chain a response once it has completed", field="previous_response_id")
    messages = list(record.request.messages or [])
    if meta.instructions:
        messages = messages[1:]
    return [*messages, answer_message(record)]


def _tool_fields(body: ResponseCreate) -> dict[str, Any]:
    if body.tools is None:
        if body.tool_choice not in (None, "none"):
            raise ApiError(422, "invalid_request", "tool_choice needs tools", field="tool_choice")
        if body.parallel_tool_calls is not None:
            raise ApiError(422, "invalid_request", "parallel_tool_calls: only with tools", field="parallel_tool_calls")
        return {}
    choice = body.tool_choice
    if isinstance(choice, FunctionToolChoice):
        choice = NamedToolChoice(function=FunctionName(name=choice.name))
    fields: dict[str, Any] = {"tools": [Tool(function=t.definition()) for t in body.tools], "tool_choice": choice}
    if body.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = body.parallel_tool_calls
    return fields


def check_supported(body: ResponseCreate) -> None:
    refused = body.refused_field()
    if refused is not None:
        raise unsupported(refused, f"not supported ({body.why_refused(refused)})")
    if body.background and not body.store:
        raise ApiError(422, "invalid_request", "background: a background response is stored; store must be true",
                       field="background")


async def response_job(svc: Services, tenant_name: str, route: ModelRoute, body: ResponseCreate) -> JobRequest:
    """The job that answers `body`."""
    check_supported(body)
    before = []
    if body.previous_response_id is not None:
        before = await conversation_before(svc, tenant_name, body.previous_response_id)
    return response_request(svc, tenant_name, route, body, before)


def response_request(svc: Services, tenant_name: str, route: ModelRoute, body: ResponseCreate,
                     before: Sequence[Message] = ()) -> JobRequest:
    """The job that answers `body` after the conversation `before` (a previous response's)."""
    check_supported(body)
    messages = [Message(role="system", content=body.instructions)] if body.instructions else []
    messages += [*before, *input_messages(body.input)]
    fields: dict[str, Any] = {"messages": messages, **_tool_fields(body)}
    for name in ("temperature", "top_p"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    if body.max_output_tokens is not None:
        fields["max_tokens"] = body.max_output_tokens
    text_format = body.text.format if body.text is not None else None
    if text_format is not None:
        fields["structured_outputs"] = text_format.structured_outputs()
    if body.reasoning is not None and body.reasoning.effort is not None:
        fields["reasoning_effort"] = body.reasoning.effort
    meta = ResponseMeta(instructions=bool(body.instructions), store=body.store, background=body.background,
                        previous_response_id=body.previous_response_id, metadata=body.metadata or {},
                        format_name=text_format.name if text_format is not None else None,
                        user=body.user or body.safety_identifier)
    return new_job_request(svc, tenant_name, route, fields, priority=lane(body.priority), webhook=body.webhook,
                           metadata={"api": "responses", "responses": asdict(meta)})
