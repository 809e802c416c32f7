"""A job's events in OpenAI's shapes: the chunks of a stream, the final body, logprobs and usage,
and the HTTP error of a job that ended without a completion. Shared by the live routes and the
Batch API's output lines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ferry.api.errors import ApiError
from ferry.worker.protocol import ErrorCode, TokenLogprob, Usage
from ferry.worker.protocol.logprobs import PromptLogprobs
from ferry.worker.protocol.tools import ChatDelta, ToolCall

_INPUT_ERRORS = {
    ErrorCode.INVALID_REQUEST, ErrorCode.INVALID_SAMPLING_PARAMS, ErrorCode.INVALID_PROMPT, ErrorCode.PROMPT_TOO_LONG,
    ErrorCode.INVALID_STRUCTURED_OUTPUT,
    ErrorCode.LORA_LOAD_FAILED,  # the adapter the request named cannot serve (corrupt, rank too high)
}


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


def prompt_logprobs_json(prompt_logprobs: PromptLogprobs) -> list[dict | None]:
    """vLLM's shape: per prompt position None (the first) or token id -> logprob, rank, decoded_token."""
    def entry(position) -> dict:
        return {str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.token}
                for tid, lp in position.items()}

    return [None if position is None else entry(position) for position in prompt_logprobs]


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
    if event.code == ErrorCode.LORA_NOT_FOUND:  # unloaded after the request was routed to its base model
        return ApiError(404, event.code, event.message)
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
    content: str = ""  # a parsed chat (tools, or a worker's reasoning parser): the released answer text
    tool_calls: list[ToolCall] = field(default_factory=list)  # with tools: the calls, once complete
    reasoning: str = ""  # a chat on a worker with a reasoning parser: the released thinking (reasoning_content)
    parsed: bool = False  # the events carry the chat parsed (`event.chat`): the answer is `content`, not `text`
    prompt_logprobs: PromptLogprobs | None = None  # asked for: the prompt's, from the job's first token event

    def add(self, event) -> None:
        """Take in a token event's text (and, parsed, its content, reasoning and calls)."""
        self.text += event.text
        self.token_logprobs += event.logprobs or []
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.chat is not None:
            self.parsed = True
            self.content += event.chat.content
            self.reasoning += event.chat.reasoning_content

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chat_delta_chunk(self, delta: ChatDelta, logprobs: list[TokenLogprob] | None) -> dict | None:
        """A parsed chat's chunk: reasoning, content and tool-call pieces (OpenAI's stream shape,
        vLLM's `reasoning_content`), or None when the step released nothing (text held back while
        it may still be a call or a tag)."""
        if not delta and not (self.logprobs and logprobs):
            return None
        out: dict = {}
        if delta.reasoning_content:
            out["reasoning_content"] = delta.reasoning_content
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

    def prompt_logprobs_chunk(self, prompt_logprobs: PromptLogprobs) -> dict:
        """A chunk that carries only the prompt's logprobs (vLLM's place: the choice's for completions,
        the chunk's for chat), sent before the first token's."""
        scored = prompt_logprobs_json(prompt_logprobs)
        if self.chat:
            choice = {"index": self.index, "delta": {}, "logprobs": None, "finish_reason": None}
            return self._head("chat.completion.chunk") | {"choices": [choice], "prompt_logprobs": scored}
        choice = {"index": self.index, "text": "", "logprobs": None, "finish_reason": None, "prompt_logprobs": scored}
        return self._head("text_completion") | {"choices": [choice]}

    def usage_chunk(self, usage: Usage) -> dict:
        return self._head("chat.completion.chunk" if self.chat else "text_completion") | {
            "choices": [],
            "usage": usage_json(usage),
        }

    def body(self, finish_reason: str, usage: Usage) -> dict:
        if self.chat:
            message: dict = {"role": "assistant", "content": self.content if self.parsed else self.text}
            if self.tools:
                message = {"role": "assistant", "content": self.content or None,
                           "tool_calls": [c.model_dump() for c in self.tool_calls] or None}
            if self.reasoning:
                message["reasoning_content"] = self.reasoning
            choice = {
                "index": self.index,
                "message": message,
                "logprobs": chat_logprobs(self.token_logprobs) if self.logprobs else None,
                "finish_reason": finish_reason,
            }
            head = self._head("chat.completion")
            if self.prompt_logprobs is not None:
                head["prompt_logprobs"] = prompt_logprobs_json(self.prompt_logprobs)
        else:
            lps = completion_logprobs(self.token_logprobs, 0) if self.logprobs else None
            choice = {"index": self.index, "text": self.echo + self.text, "logprobs": lps,
                      "finish_reason": finish_reason}
            if self.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(self.prompt_logprobs)
            head = self._head("text_completion")
        return head | {"choices": [choice], "usage": usage_json(usage)}
