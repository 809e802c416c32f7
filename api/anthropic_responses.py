"""A job's events in Anthropic's shapes: the message of `POST /v1/messages`, or its stream.

One `MessageBuilder` per job takes in its token events in order and keeps the content blocks they
make (a reasoning worker's thinking as a `thinking` block, text, and with tools each call as a
`tool_use` block), so the whole message and the stream are the same blocks. The stream is
Anthropic's named SSE events:

    message_start                        the message, without content or stop reason
    content_block_start                  a block opens (text "", or a tool_use with input {})
    content_block_delta *                thinking_delta, text_delta, or input_json_delta (the input's JSON)
    content_block_stop                   ... then the next block, if any
    message_delta                        stop_reason, stop_sequence and the usage
    message_stop
    ping                                 keep-alive while nothing else is sent
    error                                the job failed, or ran out of time, after the stream began

The prompt is tokenized by the worker, so `message_start`'s input counts are 0: `message_delta`
carries them, as Anthropic's own stream may.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic_core import from_json

from ferry.api.anthropic_schemas import MessageResponse, MessageUsage, StopReason
from ferry.api.errors import anthropic_error_body
from ferry.api.openai_responses import job_error
from ferry.api.streaming import sse_json
from ferry.worker.protocol import TERMINAL_EVENT_TYPES, CompletedEvent, Event, TokenEvent, Usage
from ferry.worker.protocol.tools import ChatDelta


def _event(name: str, **payload) -> str:
    return sse_json({"type": name, **payload}, event=name)


PING = _event("ping")


def stream_error(status: int, code: str, message: str) -> str:
    """The `error` event of a stream that has begun (its HTTP status is already 200)."""
    return sse_json(anthropic_error_body(status, code, message), event="error")


def usage_of(usage: Usage) -> MessageUsage:
    return MessageUsage(input_tokens=usage.prompt_tokens - usage.cached_tokens, output_tokens=usage.completion_tokens,
                        cache_read_input_tokens=usage.cached_tokens)


def _input(arguments: str) -> dict:
    """A call's input from its JSON text; a call cut by max_tokens is parsed as far as it goes
    (as Anthropic's client parses a stream's partial JSON)."""
    try:
        value = from_json(arguments or "{}", allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass(slots=True)
class MessageBuilder:
    """One job rendered as Anthropic's message: its content blocks so far, and the stream's events
    for each new piece."""

    id: str
    model: str
    tools: bool  # the job may call tools: its token events carry their text parsed into content and calls
    blocks: list[dict] = field(default_factory=list)  # in order; a tool_use's `input` is its JSON text so far
    call_blocks: dict[int, int] = field(default_factory=dict)  # a tool call's index -> its block's index

    def add(self, event: TokenEvent) -> list[str]:
        """Take in a token event; returns the stream's events for what it adds."""
        if event.chat is not None:  # the worker parsed the text: its thinking, content and tool calls
            delta = event.chat
        else:  # unparsed: with tools, text is never released so; without, it is all content
            delta = ChatDelta() if self.tools else ChatDelta(content=event.text)
        out: list[str] = []
        if delta.reasoning_content:
            if not self.blocks or self.blocks[-1]["type"] != "thinking":
                out += self._open({"type": "thinking", "thinking": "", "signature": ""})
            self.blocks[-1]["thinking"] += delta.reasoning_content
            out.append(self._delta(len(self.blocks) - 1, {"type": "thinking_delta",
                                                          "thinking": delta.reasoning_content}))
        if delta.content:
            if not self.blocks or self.blocks[-1]["type"] != "text":
                out += self._open({"type": "text", "text": ""})
            self.blocks[-1]["text"] += delta.content
            out.append(self._delta(len(self.blocks) - 1, {"type": "text_delta", "text": delta.content}))
        for piece in delta.tool_calls:
            if piece.id is not None:  # a call's first piece: its id and name
                out += self._open({"type": "tool_use", "id": piece.id, "name": piece.function.name or "", "input": ""})
                self.call_blocks[piece.index] = len(self.blocks) - 1
            if piece.function.arguments:
                index = self.call_blocks[piece.index]
                self.blocks[index]["input"] += piece.function.arguments
                out.append(self._delta(index, {"type": "input_json_delta", "partial_json": piece.function.arguments}))
        return out

    def _open(self, block: dict) -> list[str]:
        out = self._close()
        self.blocks.append(block)
        shown = block | {"input": {}} if block["type"] == "tool_use" else dict(block)
        return out + [_event("content_block_start", index=len(self.blocks) - 1, content_block=shown)]

    def _close(self) -> list[str]:
        return [_event("content_block_stop", index=len(self.blocks) - 1)] if self.blocks else []

    def _delta(self, index: int, delta: dict) -> str:
        return _event("content_block_delta", index=index, delta=delta)

    def stop_reason(self, end: CompletedEvent) -> tuple[StopReason, str | None]:
        """Anthropic's stop reason and stop sequence. The worker's `stop_reason` is the stop string
        that ended the output (or a stop token's id: the end of a turn); a named tool's call ends
        with `stop` (OpenAI's rule), and is a `tool_use` here as any call is."""
        if end.finish_reason == "length":
            return "max_tokens", None
        if isinstance(end.stop_reason, str):
            return "stop_sequence", end.stop_reason
        if any(block["type"] == "tool_use" for block in self.blocks):
            return "tool_use", None
        return "end_turn", None

    def message(self, end: CompletedEvent | None = None) -> MessageResponse:
        """The message: whole once `end` is given; without it, the stream's first (no content yet)."""
        if end is None:
            return MessageResponse(id=self.id, model=self.model, content=[], stop_reason=None,
                                   usage=MessageUsage(input_tokens=0, output_tokens=0))
        reason, sequence = self.stop_reason(end)
        content = [b | {"input": _input(b["input"])} if b["type"] == "tool_use" else b for b in self.blocks]
        return MessageResponse(id=self.id, model=self.model, content=content, stop_reason=reason,
                               stop_sequence=sequence, usage=usage_of(end.usage))

    def body(self, end: CompletedEvent) -> dict:
        return self.message(end).model_dump(mode="json")

    def start(self) -> str:
        return _event("message_start", message=self.message().model_dump(mode="json"))

    def render(self, event: Event) -> list[str]:
        """The stream's events for one job event; a terminal one ends the stream."""
        if event.type == "token":
            return self.add(event)
        if event.type == "completed":
            reason, sequence = self.stop_reason(event)
            usage = usage_of(event.usage).model_dump()
            return self._close() + [
                _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage),
                _event("message_stop"),
            ]
        if event.type in TERMINAL_EVENT_TYPES:
            error = job_error(event)
            return [stream_error(error.status, error.code, error.message)]
        return []

