"""An Anthropic Messages request as a Ferry chat job: the same `JobRequest` a `/v1/chat/completions`
body becomes (`api.openai_jobs.chat_jobs`), so the worker cannot tell the two apart.

- `system` is a first `system` message; a user message's `tool_result` blocks are `tool` messages
  (a failed tool's text marked `Error: `, since chat templates have no flag for it) and its text
  blocks a `user` message, in the blocks' order; an assistant message's `tool_use` blocks are its
  `tool_calls`.
- `tools` are functions whose `parameters` are the `input_schema`; `tool_choice` `any` is
  Ferry's `required`, `tool` a named function, `disable_parallel_tool_use` `parallel_tool_calls: false`.
- `stop_sequences` is `stop`; `metadata.user_id` is kept as the job's `metadata.user`.

A last assistant message (Anthropic's prefill, which its answer continues) is refused: Ferry's chat
template renders a new assistant turn after it, so the answer would not continue it.
"""

from __future__ import annotations

import json

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from ferry.api.anthropic_schemas import REFUSED_FIELDS, AnthropicTool, InputMessage, MessagesRequest
from ferry.api.errors import ApiError, unsupported
from ferry.api.services import ModelRoute, Services, new_job_request
from ferry.worker.protocol import JobRequest, Message, TextPart
from ferry.worker.protocol.tools import (
    FunctionCall,
    FunctionDefinition,
    FunctionName,
    NamedToolChoice,
    Tool,
    ToolCall,
    ToolChoice,
)

_TOOL_CHOICES: dict[str, ToolChoice] = {"auto": "auto", "any": "required", "none": "none"}  # and `tool`: named


def message_job(svc: Services, tenant_name: str, route: ModelRoute, body: MessagesRequest) -> JobRequest:
    """The job for a `/v1/messages` body (422s naming the field it cannot take)."""
    for name, why in REFUSED_FIELDS.items():
        if getattr(body, name) is not None:
            raise unsupported(name, f"not supported ({why})")
    if body.messages[-1].role == "assistant":
        raise unsupported("messages", "a last assistant message (a prefill) is not supported: the answer "
                          "would start a new turn instead of continuing it")
    fields: dict = {"messages": chat_messages(body), "max_tokens": body.max_tokens}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    if body.stop_sequences:
        fields["stop"] = body.stop_sequences
    if body.tools:
        fields |= _tool_fields(body)
    elif body.tool_choice is not None:
        raise ApiError(422, "invalid_request", "tool_choice needs tools", field="tool_choice")
    metadata = {"api": "anthropic"}
    if body.metadata is not None and body.metadata.user_id is not None:
        metadata["user"] = body.metadata.user_id
    return new_job_request(svc, tenant_name, route, fields, metadata=metadata)


def chat_messages(body: MessagesRequest) -> list[Message]:
    """The conversation as Ferry's messages (OpenAI's roles)."""
    out = []
    if body.system:
        out.append(Message(role="system", content=[TextPart(text=b.text) for b in body.system]))
    for message in body.messages:
        out += _messages(message)
    return out


def _messages(message: InputMessage) -> list[Message]:
    if message.role == "assistant":
        parts = [TextPart(text=b.text) for b in message.content if b.type == "text"]  # thinking blocks: left out
        calls = [ToolCall(id=b.id, function=FunctionCall(name=b.name,
                                                         arguments=json.dumps(b.input, ensure_ascii=False)))
                 for b in message.content if b.type == "tool_use"]
        return [Message(role="assistant", content=parts or None, tool_calls=calls or None)]
    out: list[Message] = []
    parts: list[TextPart] = []
    for block in message.content:
        if block.type == "text":
            parts.append(TextPart(text=block.text))
            continue
        if parts:
            out.append(Message(role="user", content=parts))
            parts = []
        text = f"Error: {block.text}" if block.is_error else block.text
        out.append(Message(role="tool", tool_call_id=block.tool_use_id, content=text))
    return out + ([Message(role="user", content=parts)] if parts else [])


def _tool_fields(body: MessagesRequest) -> dict:
    choice = body.tool_choice
    fields: dict = {"tools": [_tool(i, tool) for i, tool in enumerate(body.tools or [])]}
    if choice is None:
        return fields
    fields["tool_choice"] = _TOOL_CHOICES.get(choice.type) or NamedToolChoice(function=FunctionName(name=choice.name))
    if choice.disable_parallel_tool_use is not None:
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields


def _tool(index: int, tool: AnthropicTool) -> Tool:
    """A function tool; an input_schema that is not a JSON schema is a 422 naming it."""
    try:
        function = FunctionDefinition(name=tool.name, description=tool.description, parameters=tool.input_schema)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", "tools", index, "input_schema")}
                                      for e in exc.errors()]) from exc
    return Tool(function=function)
