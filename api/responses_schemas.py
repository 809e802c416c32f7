"""OpenAI's Responses API request body (`POST /v1/responses`): input items, function tools,
`text.format`, and the fields that steer the job.

Every field OpenAI defines is here: honoured, or refused with a 422 `unsupported_parameter` naming it
when set to anything but its neutral value (`_REFUSED`). An unknown field is refused too. The
output shapes are plain dicts built in `api.responses_render` (the `openai` client parses them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

from ferry.api.schemas import check_body_json
from ferry.worker.protocol import Priority, StructuredOutputsRequest, Webhook
from ferry.worker.protocol.fields import ModelName, sampling_annotation
from ferry.worker.protocol.jobs import JOB_ID_PATTERN
from ferry.worker.protocol.sampling import LIMITS
from ferry.worker.protocol.structured import check_json_schema
from ferry.worker.protocol.tools import FUNCTION_NAME_PATTERN, MAX_TOOLS, FunctionDefinition

RESPONSE_ID_PATTERN = "^resp_" + JOB_ID_PATTERN.removeprefix("^")  # a response is a job: resp_<job id>
MAX_INPUT_ITEMS = 2048


class _Item(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputText(_Item):
    type: Literal["input_text", "output_text"]  # output_text: an earlier assistant turn given back
    text: str
    annotations: list[Any] | None = None  # output_text's; given back by clients, carries nothing Ferry reads
    logprobs: list[Any] | None = None


class MessageItem(_Item):
    """A message: the user's turn, instructions (system/developer), or an earlier assistant turn."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None  # an output item's id, when a client gives an earlier response's items back
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(_Item):
    """A call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=128)
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Item):
    """The result of a call, for the model's next turn."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=128)
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Item):
    """An earlier turn's reasoning, as clients give a response's output back: accepted and left out
    of the prompt (chat templates drop earlier turns' thinking; docs/api.md says so)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem, Field(
    discriminator="type")]


class FunctionTool(_Item):
    """A function tool (Responses' flat shape: no nested `function`)."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def definition(self) -> FunctionDefinition:
        return FunctionDefinition(name=self.name, description=self.description, parameters=self.parameters,
                                  strict=self.strict)


class FunctionToolChoice(_Item):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)


class TextFormat(_Item):
    """`text.format`: free text, any JSON object, or a JSON schema (flat: name and schema beside type)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _valid_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else check_json_schema(value)

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> TextFormat:
        if (self.type == "json_schema") != (self.schema_ is not None):
            raise ValueError("schema is required with type 'json_schema' and only then")
        if self.type == "json_schema" and not self.name:
            raise ValueError("name is required with type 'json_schema'")
        return self

    def structured_outputs(self) -> StructuredOutputsRequest | None:
        if self.type == "json_object":
            return StructuredOutputsRequest(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputsRequest(json=self.schema_)
        return None


class TextConfig(_Item):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the neutral value only: Ferry has no length steering


class ReasoningConfig(_Item):
    effort: Literal["low", "medium", "high"] | None = None  # the chat template's reasoning_effort
    summary: None = None  # Ferry returns the reasoning text itself, never a summary
    generate_summary: None = None


# Fields OpenAI defines that Ferry does not implement, with why; refused when set to anything but
# their neutral value (None, an empty list, or the value in `_NEUTRAL`).
_REFUSED = {
    "include": "no extra output data is available (encrypted reasoning, logprobs, search results)",
    "top_logprobs": "output logprobs are on /v1/chat/completions",
    "max_tool_calls": "the model's calls are not capped across turns",
    "prompt": "stored prompt templates are not kept",
    "conversation": "conversations are chained with previous_response_id",
    "prompt_cache_key": "the prefix cache needs no key: every tenant's prompts are cached",
    "stream_options": "no stream options are implemented",
    "service_tier": "one tier; `priority` picks the queue lane",
    "truncation": "a conversation longer than the model's context is refused, never cut",
}
_NEUTRAL = {"service_tier": ("auto", "default"), "truncation": ("disabled",)}


class ResponseCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: ModelName | None = None
    input: str | list[InputItem] = Field(description="a user message, or items: messages, function calls and "
                                         "their outputs")
    instructions: str | None = Field(default=None, description="a system message put first; not carried over "
                                     "to a response chained with previous_response_id")
    previous_response_id: str | None = Field(default=None, pattern=RESPONSE_ID_PATTERN)
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: sampling_annotation(LIMITS["max_tokens"], nullable=True) = None  # type: ignore[valid-type]
    temperature: sampling_annotation(LIMITS["temperature"], nullable=True) = None  # type: ignore[valid-type]
    top_p: sampling_annotation(LIMITS["top_p"], nullable=True) = None  # type: ignore[valid-type]
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(default=None, max_length=16)
    store: bool = True
    stream: bool = False
    background: bool = False
    user: str | None = None
    safety_identifier: str | None = None
    priority: Priority | Annotated[int, Strict()] = Field(
        default=Priority.normal, description="Ferry's: the queue lane (high, normal, low), or vLLM's integer")
    webhook: Webhook | None = Field(default=None, description="Ferry's: signed job webhooks (job.completed, ...) "
                                    "for this response's job, as on /v1/jobs")
    include: list[str] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    prompt: Any = None
    conversation: Any = None
    prompt_cache_key: str | None = None
    stream_options: Any = None
    service_tier: str | None = None
    truncation: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_json(cls, data: Any) -> Any:
        return check_body_json(data)

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: str | list) -> str | list:
        if isinstance(value, list) and not 1 <= len(value) <= MAX_INPUT_ITEMS:
            raise ValueError(f"give 1 to {MAX_INPUT_ITEMS} input items")
        if isinstance(value, str) and not value:
            raise ValueError("input is empty")
        return value

    def refused_field(self) -> str | None:
        """The first field set that Ferry does not implement (None: none)."""
        for name in _REFUSED:
            value = getattr(self, name)
            if value not in (None, []) and value not in _NEUTRAL.get(name, ()):
                return name
        return None

    @staticmethod
    def why_refused(name: str) -> str:
        return _REFUSED[name]
