"""Anthropic's Messages API bodies (`POST /v1/messages`): the request the official `anthropic`
client sends, and the message it reads back.

Only what Ferry implements is declared. Any other field is refused with a 422 naming it, as on the
OpenAI routes, never ignored: an unknown one as `unsupported_parameter` ("unknown field"), the
ones Anthropic's clients commonly send with the reason (`REFUSED_FIELDS`); a content block other
than text, tool_use, tool_result and a thinking block given back (an image, a document) is refused
by its `type`.
docs/api.md lists every field and what it does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, create_model, model_validator

from ferry.api.schemas import check_body_json
from ferry.worker.protocol.fields import ModelName, sampling_annotation
from ferry.worker.protocol.sampling import LIMITS
from ferry.worker.protocol.tools import FUNCTION_NAME_PATTERN, MAX_TOOLS

# Top-level fields of Anthropic's API that Ferry does not implement, and why: refused when set.
REFUSED_FIELDS = {
    "thinking": "extended thinking is not implemented",
    "service_tier": "Ferry has one service tier (use the OpenAI routes' `priority` for its queue lanes)",
    "cache_control": "Ferry's prefix cache is automatic and best-effort: a cache breakpoint cannot be pinned",
    "container": "no code-execution containers",
    "mcp_servers": "no MCP connector",
}
_ToolId = Annotated[str, Field(min_length=1, max_length=128)]  # as Ferry's tool-call ids (worker.protocol.tools)
_StopSequence = Annotated[str, Strict(), Field(min_length=1)]  # an empty one would end every output at once


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Strict):
    """An assistant's earlier call of a tool."""

    type: Literal["tool_use"]
    id: _ToolId
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    input: dict[str, Any]


def _as_blocks(value: Any) -> Any:
    """Anthropic's shorthand: a string is one text block (so an error names the block it is in)."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


_Texts = Annotated[list[TextBlock], BeforeValidator(_as_blocks)]


class ToolResultBlock(_Strict):
    """A user's answer to the call `tool_use_id`; `is_error` says the tool failed (its text is
    marked so for the model: `api.anthropic_jobs`)."""

    type: Literal["tool_result"]
    tool_use_id: _ToolId
    content: _Texts = Field(default_factory=list)
    is_error: bool = False

    @property
    def text(self) -> str:
        return "".join(b.text for b in self.content)


class ThinkingBlock(_Strict):
    """An assistant's earlier thinking, as clients give a message's content back: accepted and left
    out of the prompt (chat templates drop earlier turns' thinking)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None  # redacted_thinking's


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: Annotated[list[ContentBlock], BeforeValidator(_as_blocks), Field(min_length=1)]

    @model_validator(mode="after")
    def _blocks_of_its_role(self) -> InputMessage:
        wrong = ("tool_result",) if self.role == "assistant" else ("tool_use", "thinking", "redacted_thinking")
        for block in self.content:
            if block.type in wrong:
                raise ValueError(f"{self.role} messages cannot carry {block.type} blocks")
        return self


class AnthropicTool(_Strict):
    """A client tool (`type` absent or `custom`); Anthropic's server tools are refused by their `type`."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    input_schema: dict[str, Any]  # a JSON schema of the input object (checked as the job's tool parameters)


class AnthropicToolChoice(_Strict):
    """`auto` (the default with tools), `any` (at least one call), `tool` (exactly the call of
    `name`) or `none`; `disable_parallel_tool_use`: at most one call."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> AnthropicToolChoice:
        if (self.name is not None) != (self.type == "tool"):
            raise ValueError("name is required with type 'tool' and only then")
        if self.type == "none" and self.disable_parallel_tool_use is not None:
            raise ValueError("disable_parallel_tool_use does not apply to type 'none'")
        return self


class AnthropicMetadata(_Strict):
    user_id: str | None = Field(default=None, max_length=256)


# The refused fields, declared so that the 422 can say why (`api.anthropic_jobs` refuses them when set).
_RefusedFields = create_model(
    "_RefusedFields", __config__=ConfigDict(extra="forbid"),
    **{name: (Any, Field(default=None, description=f"refused: {why}")) for name, why in REFUSED_FIELDS.items()},
)


class MessagesRequest(_RefusedFields):
    model: ModelName | None = Field(default=None, description="the served model (optional while one is served)")
    max_tokens: sampling_annotation(LIMITS["max_tokens"], nullable=False) = Field(  # type: ignore[valid-type]
        description="tokens to generate at most (required, as Anthropic requires it)")
    messages: list[InputMessage] = Field(min_length=1)
    system: _Texts | None = None
    stop_sequences: Annotated[list[_StopSequence], Field(max_length=LIMITS["stop"].max_items)] | None = None
    temperature: sampling_annotation(LIMITS["temperature"]) = None  # type: ignore[valid-type]
    top_p: sampling_annotation(LIMITS["top_p"]) = None  # type: ignore[valid-type]
    top_k: sampling_annotation(LIMITS["top_k"]) = None  # type: ignore[valid-type]
    tools: Annotated[list[AnthropicTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    metadata: AnthropicMetadata | None = None
    stream: bool = False

    @model_validator(mode="before")
    @classmethod
    def _valid_json(cls, data: Any) -> Any:
        return check_body_json(data)


class CountTokensRequest(_RefusedFields):
    """`POST /v1/messages/count_tokens`: the prompt fields of a message; nothing is generated."""

    model: ModelName | None = Field(default=None, description="the served model (optional while one is served)")
    messages: list[InputMessage] = Field(min_length=1)
    system: _Texts | None = None
    tools: Annotated[list[AnthropicTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: AnthropicToolChoice | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_json(cls, data: Any) -> Any:
        return check_body_json(data)

    def as_message(self) -> MessagesRequest:
        """The message request with the same prompt (its max_tokens matters to nothing here)."""
        return MessagesRequest(**dict(self), max_tokens=1)


class TokenCount(BaseModel):
    input_tokens: int  # every token of the prompt, as the model reads it


# --- the message ---------------------------------------------------------------------------------


class ResponseTextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ResponseThinkingBlock(BaseModel):
    """A reasoning worker's thinking (`FERRY_REASONING_PARSER`); unsigned: Ferry does not check a
    thinking block given back, it leaves it out of the next prompt."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ResponseToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(BaseModel):
    """Anthropic's counts: a prompt's tokens are `input_tokens` (computed) plus
    `cache_read_input_tokens` (served from the prefix cache); Ferry writes no cache entries on
    request, so `cache_creation_input_tokens` is 0."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[Annotated[ResponseThinkingBlock | ResponseTextBlock | ResponseToolUseBlock,
                            Field(discriminator="type")]]
    stop_reason: StopReason | None  # None only in the stream's `message_start`
    stop_sequence: str | None = None  # the stop sequence that ended the output
    usage: MessageUsage


class AnthropicErrorDetail(BaseModel):
    type: str  # invalid_request_error, authentication_error, not_found_error, rate_limit_error, api_error, ...
    message: str
    code: str  # Ferry's stable code, as on every route
    param: str | None = None  # the offending request field, when there is one


class AnthropicError(BaseModel):
    """Anthropic's error shape, as `api.errors.anthropic_error_body` writes it."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


def anthropic_error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for the error statuses a route under /v1/messages can answer."""
    return {status: {"model": AnthropicError} for status in statuses}
