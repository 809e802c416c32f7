"""OpenAI-compatible request and response bodies (completions, chat completions, models).

Requests accept OpenAI's names plus vLLM's extras (top_k, min_p, repetition_penalty, bad_words,
allowed_token_ids, chat_template_kwargs, ...). No field is ignored: a field Ferry does not implement
is refused with a 422 `unsupported_parameter` naming it when set to anything but its neutral value
(`UNSUPPORTED_FIELDS`), and so is an unknown field, as OpenAI's own API refuses one. docs/api.md
lists every field of each route and what it does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, create_model, field_validator, model_validator

from ferry.api.schemas import check_body_json
from ferry.api.streaming import SSE_EVENT_SCHEMA
from ferry.worker.protocol import Message, Priority, StructuredOutputsRequest
from ferry.worker.protocol.chat_template import ChatTemplateFields
from ferry.worker.protocol.fields import LogitBias, ModelName, TokenIds, sampling_annotation, sampling_fields
from ferry.worker.protocol.loras import LoraEntry
from ferry.worker.protocol.sampling import LIMITS
from ferry.worker.protocol.structured import check_json_schema
from ferry.worker.protocol.tools import MAX_TOOLS, Tool, ToolCall, ToolChoice


class StreamOptions(BaseModel):
    include_usage: Annotated[bool, Strict()] = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _valid_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_json_schema(value)


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text (no constraint), any JSON object, or a JSON schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema' and only then")
        return self

    def structured_outputs(self) -> StructuredOutputsRequest | None:
        if self.type == "json_object":
            return StructuredOutputsRequest(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputsRequest(json=self.json_schema.schema_)
        return None


# Fields clients send that Ferry does not implement, and why: refused with the field named when set.
UNSUPPORTED_FIELDS = {
    "functions": "OpenAI's older spelling of tools; use tools",
    "function_call": "OpenAI's older spelling of tool_choice; use tools and tool_choice",
    **{f"guided_{kind}": "vLLM's older spelling; use structured_outputs"
       for kind in ("json", "regex", "choice", "grammar", "decoding_backend")},
}
MAX_N = 16  # choices per request: each is a job of its own, sharing the prompt's KV through the prefix cache
OPENAI_MAX_STOP = 4  # stop strings OpenAI allows (jobs take more: worker.protocol.sampling)
_StopString = Annotated[str, Strict(), Field(min_length=1)]  # an empty one would end every output at once


# The sampling fields with the engine's names and limits (worker.protocol.sampling); unset (None)
# leaves the engine's default. `logprobs` is spelled per route below (an int for completions, a
# bool plus `top_logprobs` for chat).
_SamplingFields = create_model(
    "_SamplingFields",
    __config__=ConfigDict(extra="forbid"),
    model=(ModelName | None, None),
    n=(Annotated[int, Strict()], Field(default=1, ge=1, le=MAX_N, description="choices to generate for the prompt")),
    stream=(bool, False),
    stream_options=(StreamOptions | None, None),
    logit_bias=(LogitBias | None, Field(default=None, description="token id -> bias in [-100, 100], at most 300")),
    user=(str | None, None),
    structured_outputs=(StructuredOutputsRequest | None, Field(default=None, description="vLLM's: a grammar")),
    response_format=(ResponseFormat | None, None),
    **{name: (Any, Field(default=None, description=f"not supported: {why}"))
       for name, why in UNSUPPORTED_FIELDS.items()},
    **sampling_fields(optional=True, exclude=("logprobs", "stop")),
    stop=(_StopString | Annotated[list[_StopString], Field(max_length=OPENAI_MAX_STOP)] | None,
          Field(default=None, description=f"up to {OPENAI_MAX_STOP} strings that end generation")),
)
_LOGPROBS = sampling_annotation(LIMITS["logprobs"])
_MAX_TOKENS = sampling_annotation(LIMITS["max_tokens"], nullable=True)


def lane(priority: Priority | int) -> Priority:
    """vLLM's integer priority (lower is served first, 0 by default) as one of the queue lanes:
    below 0 is `high`, 0 is `normal`, above 0 is `low`; a lane's name is taken as is."""
    if isinstance(priority, Priority):
        return priority
    return Priority.high if priority < 0 else Priority.low if priority > 0 else Priority.normal


class _Body(_SamplingFields):
    priority: Priority | Annotated[int, Strict()] = Field(
        default=Priority.normal,
        description="the queue lane: high, normal or low; or vLLM's integer (< 0 high, 0 normal, > 0 low)",
    )

    @model_validator(mode="before")
    @classmethod
    def _valid_json(cls, data: Any) -> Any:
        return check_body_json(data)


class CompletionRequest(_Body):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    logprobs: _LOGPROBS = None  # type: ignore[valid-type]
    echo: bool = Field(default=False, description="put the prompt before the completion (text prompts, no logprobs)")
    suffix: str | None = Field(default=None, description="not supported")
    best_of: int | None = Field(default=None, ge=1, le=MAX_N, description="only equal to n (every choice is returned)")
    tools: Any = Field(default=None, description="not supported: tools need /v1/chat/completions")
    tool_choice: Any = Field(default=None, description="not supported: tools need /v1/chat/completions")


class ChatCompletionRequest(_Body, ChatTemplateFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: _MAX_TOKENS = None  # type: ignore[valid-type]
    logprobs: bool = False
    top_logprobs: _LOGPROBS = None  # type: ignore[valid-type]
    tools: list[Tool] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = Field(default=None, description="none, auto (default with tools), required, or "
                                           '{"type": "function", "function": {"name": ...}}')
    parallel_tool_calls: bool | None = None


# --- responses ------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt position None (the first) or token id -> its logprob and rank
PromptLogprobsJson = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobsJson | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None


class TopLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(TopLogprobEntry):
    top_logprobs: list[TopLogprobEntry] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry] = Field(default_factory=list)


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    # A worker with a reasoning parser (FERRY_REASONING_PARSER): the model's thinking, left out of content
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage | None = None
    prompt_logprobs: PromptLogprobsJson | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ferry"
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    root: str | None = None  # a LoRA adapter's path (vLLM's field)

    @classmethod
    def of_lora(cls, entry: LoraEntry) -> ModelCard:
        """A registered LoRA adapter, as vLLM lists one."""
        return cls(id=entry.name, created=int(entry.created_at), parent=entry.base_model, root=entry.path)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def sse_200(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI for a 200 that is JSON, or SSE chunks when `stream` is true."""
    return {
        200: {
            "model": model,
            "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
            "description": "the completion, or with `stream: true` SSE chunks ending in `data: [DONE]`",
        }
    }
