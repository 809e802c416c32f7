"""A response's job in the Responses API's shapes: the Response object (from the job record), and its
typed stream events (from the job's events).

The stream is a pure function of the job's stored events: `ResponseEvents` numbers what it emits
from 0, so a stream resumed with `starting_after` (after a client or API restart) replays the job's
events from its start and sends only what comes after that number: the same events with the same
numbers. Output items, in the order they begin: reasoning (a reasoning parser's thinking), the
message (the answer's text), function calls. Item ids derive from the job id.
"""

from __future__ import annotations

from typing import Any

from ferry.api.responses_jobs import ResponseMeta, response_id
from ferry.worker.protocol import STATE_AFTER_EVENT, JobRecord, JobRequest, JobState, Usage
from ferry.worker.protocol.tools import NamedToolChoice, ToolCall, ToolCallDelta

_STATUS = {JobState.queued: "queued", JobState.running: "in_progress", JobState.succeeded: "completed",
           JobState.failed: "failed", JobState.cancelled: "cancelled", JobState.timed_out: "failed"}


def usage_json(usage: Usage | None, reasoning_tokens: int = 0) -> dict | None:
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage.total_tokens}


def _tool_choice(request: JobRequest) -> Any:
    choice = request.effective_tool_choice
    if isinstance(choice, NamedToolChoice):
        return {"type": "function", "name": choice.function.name}
    return choice


def _text_format(request: JobRequest, meta: ResponseMeta) -> dict:
    structured = request.structured_outputs
    if structured is None:
        return {"type": "text"}
    if structured.json_object:
        return {"type": "json_object"}
    return {"type": "json_schema", "name": meta.format_name, "schema": structured.json_schema, "strict": None,
            "description": None}


def shell(job_id: str, request: JobRequest, meta: ResponseMeta, status: str) -> dict:
    """The Response object without output: what the request set, in OpenAI's names."""
    instructions = request.messages[0].text if meta.instructions and request.messages else None
    return {
        "id": response_id(job_id), "object": "response", "created_at": int(request.created_at), "status": status,
        "background": meta.background, "error": None, "incomplete_details": None, "instructions": instructions,
        "max_output_tokens": request.max_tokens, "model": request.lora or request.model, "output": [],
        "parallel_tool_calls": request.parallel_tool_calls, "previous_response_id": meta.previous_response_id,
        "reasoning": {"effort": request.reasoning_effort, "summary": None}, "store": meta.store,
        "temperature": request.temperature, "top_p": request.top_p,
        "text": {"format": _text_format(request, meta)}, "tool_choice": _tool_choice(request),
        "tools": [{"type": "function", "name": t.function.name, "description": t.function.description,
                   "parameters": t.function.parameters, "strict": t.function.strict} for t in request.tools or []],
        "truncation": "disabled", "usage": None, "user": meta.user, "metadata": meta.metadata, "completed_at": None,
    }


def reasoning_item(job_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": f"rs_{job_id}", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else []}


def call_item(job_id: str, index: int, call: ToolCall, status: str = "completed") -> dict:
    return {"type": "function_call", "id": f"fc_{job_id}_{index}", "call_id": call.id, "name": call.function.name,
            "arguments": call.function.arguments, "status": status}


def _ended(response: dict, state: JobState, finish_reason: str | None, usage: Usage | None,
           error: tuple[str, str] | None, finished_at: float | None) -> dict:
    """`response` with its end: status, why it is incomplete, its error, its usage."""
    status = _STATUS[state]
    response["completed_at"] = int(finished_at) if finished_at is not None and state == JobState.succeeded else None
    if state == JobState.succeeded and finish_reason == "length":
        status, response["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
    if error is not None:
        response["error"] = {"code": error[0], "message": error[1]}
    response["status"] = status
    response["usage"] = usage_json(usage)
    return response


def response_object(record: JobRecord, meta: ResponseMeta) -> dict:
    """The Response object of a response's job, as it stands."""
    response = shell(record.id, record.request, meta, _STATUS[record.state])
    if not record.terminal:
        return response
    if record.state == JobState.succeeded:
        reasoning = record.reasoning_content
        if reasoning:
            response["output"].append(reasoning_item(record.id, reasoning))
        text = record.content if record.content is not None else record.text
        status = "incomplete" if record.finish_reason == "length" else "completed"
        if text:
            response["output"].append(message_item(f"msg_{record.id}", text, status))
        calls = record.tool_calls or []  # the last one is incomplete where max_output_tokens cut it
        response["output"] += [call_item(record.id, i, c, status if i == len(calls) - 1 else "completed")
                               for i, c in enumerate(calls)]
    error = (record.error_code, record.error_message or "") if record.error_code else None
    return _ended(response, record.state, record.finish_reason, record.usage, error, record.finished_at)


class ResponseEvents:
    """The typed stream events of one response, built from its job's events in order."""

    def __init__(self, job_id: str, request: JobRequest, meta: ResponseMeta) -> None:
        self.job_id = job_id
        self.response = shell(job_id, request, meta, "queued" if meta.background else "in_progress")
        self.seq = 0  # the next event's sequence_number
        self.open: dict | None = None  # the item being streamed (its dict, as it will be in the output)
        self.messages = 0  # message items begun: a second one (text after a call) gets its own id
        self.calls = 0
        self.started = False

    def _event(self, kind: str, **payload: Any) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **payload}

    def begin(self) -> list[dict]:
        return [self._event("response.created", response=dict(self.response, output=[]))]

    def _add(self, item: dict) -> list[dict]:
        self.response["output"].append(item)
        self.open = item
        out = [self._event("response.output_item.added", output_index=len(self.response["output"]) - 1,
                           item=dict(item, content=[]) if "content" in item else dict(item))]
        if item["type"] in ("message", "reasoning"):
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []} \
                if item["type"] == "message" else {"type": "reasoning_text", "text": ""}
            item["content"] = [part]
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=self._index(),
                                   content_index=0, part=dict(part)))
        return out

    def _index(self) -> int:
        return len(self.response["output"]) - 1

    def _close(self, status: str = "completed") -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        index, out = self.response["output"].index(item), []
        if item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            kind = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            out.append(self._event(kind, item_id=item["id"], output_index=index, content_index=0, text=part["text"],
                                   **extra))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=dict(part)))
        return out + [self._event("response.output_item.done", output_index=index, item=dict(item))]

    def _text(self, kind: str, delta: str) -> list[dict]:
        out: list[dict] = []
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            if kind == "reasoning":
                out += self._add({"type": "reasoning", "id": f"rs_{self.job_id}", "summary": [],
                                  "status": "in_progress", "content": []})
            else:
                item_id = f"msg_{self.job_id}" + (f"_{self.messages}" if self.messages else "")
                self.messages += 1
                out += self._add(message_item(item_id, "", "in_progress"))
        self.open["content"][0]["text"] += delta
        event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return out + [self._event(event, item_id=self.open["id"], output_index=self._index(), content_index=0,
                                  delta=delta, **extra)]

    def _call(self, delta: ToolCallDelta) -> list[dict]:
        out: list[dict] = []
        if delta.id is not None:  # a call's first piece: its id and name
            out += self._close()
            call = ToolCall(id=delta.id, function={"name": delta.function.name or "", "arguments": ""})
            out += self._add(call_item(self.job_id, self.calls, call, "in_progress"))
            self.calls += 1
        if delta.function.arguments and self.open is not None and self.open["type"] == "function_call":
            self.open["arguments"] += delta.function.arguments
            out.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                   output_index=self._index(), delta=delta.function.arguments))
        return out

    def on_event(self, event) -> list[dict]:
        """The stream events one job event makes."""
        if event.type == "started":
            if self.started:
                return []  # a later attempt: the response was in progress already
            self.started = True
            self.response["status"] = "in_progress"
            return [self._event("response.in_progress", response=dict(self.response, output=[]))]
        if event.type == "token":
            return self._token(event)
        return self._end(event)

    def _token(self, event) -> list[dict]:
        chat = event.chat
        if chat is None:
            return self._text("message", event.text) if event.text else []
        out: list[dict] = []
        reasoning = chat.reasoning_content
        if reasoning:
            out += self._text("reasoning", reasoning)
        if chat.content:
            out += self._text("message", chat.content)
        for delta in chat.tool_calls:
            out += self._call(delta)
        return out

    def _end(self, event) -> list[dict]:
        state = STATE_AFTER_EVENT[event.type]
        length = event.type == "completed" and event.finish_reason == "length"
        out = self._close("incomplete" if length else "completed" if state == JobState.succeeded else "incomplete")
        error = (event.code, event.message) if event.type in ("failed", "timed_out") else None
        response = _ended(self.response, state, getattr(event, "finish_reason", None), getattr(event, "usage", None),
                          error, event.ts)
        kind = {"completed": "response.incomplete" if length else "response.completed", "failed": "response.failed",
                "timed_out": "response.failed", "cancelled": "response.cancelled"}[event.type]
        return out + [self._event(kind, response=response)]


def input_items(record: JobRecord, meta: ResponseMeta) -> list[dict]:
    """The items the response's model read, oldest first (a chained response's include the conversation
    before it; instructions are the Response's own field, not an item)."""
    messages = record.request.messages or []
    messages = messages[1:] if meta.instructions else messages
    items: list[dict] = []
    for i, message in enumerate(messages):
        if message.role == "tool":
            items.append({"type": "function_call_output", "id": f"fco_{record.id}_{i}", "status": "completed",
                          "call_id": message.tool_call_id, "output": message.text})
            continue
        if message.content is not None:
            kind = "output_text" if message.role == "assistant" else "input_text"
            items.append({"type": "message", "id": f"msg_{record.id}_in{i}", "status": "completed",
                          "role": message.role, "content": [{"type": kind, "text": message.text}]})
        items += [{"type": "function_call", "id": f"fc_{record.id}_in{i}_{j}", "status": "completed",
                   "call_id": call.id, "name": call.function.name, "arguments": call.function.arguments}
                  for j, call in enumerate(message.tool_calls or [])]
    return items
