"""Tool calling on the wire: OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`, the tool calls
an assistant message carries, and the deltas a stream sends.

`tool_choice`: `none` (the model answers in text; the tools still go into the prompt, as OpenAI
does), `auto` (the model may call tools; the worker parses calls out of its text with the
model's parser, `worker.serve.tool_parsers`), `required` (at least one call) or a named
function (exactly that call). `required` and a named function are enforced with a grammar over
the call JSON (`forced_tool_schema`), through the structured-output machinery: their schemas must
then be ones a grammar enforces (worker.protocol.structured). With `none` and `auto` a function's
`parameters` only describe it to the model, so any valid JSON schema goes. No torch here.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ferry.worker.protocol.structured import SpecError, check_spec, pydantic_error

MAX_TOOLS = 128
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            try:
                jsonschema.Draft202012Validator.check_schema(value)
            except jsonschema.SchemaError as exc:
                where = "/".join(str(p) for p in exc.path)
                raise ValueError(f"not a valid JSON schema{f' at {where}' if where else ''}: {exc.message}") from None
        return value

    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else _NO_PARAMETERS


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str  # the arguments object as JSON text (OpenAI's shape)


class ToolCall(BaseModel):
    """One call in an assistant message (a response's, or a conversation's earlier turn)."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        """The call as chat templates expect it: arguments as an object (Hugging Face's convention)."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str = ""


class ToolCallDelta(BaseModel):
    """A piece of one streamed tool call: the first piece of call `index` carries its id and name,
    later ones append to its arguments (OpenAI's stream shape)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    """What one step adds to a chat answer whose output is parsed (for tool calls, or for its
    reasoning: `worker.serve.reasoning_parsers`): text meant as content, text of the model's
    thinking, and tool-call pieces."""

    content: str = ""
    reasoning_content: str = ""  # with a reasoning parser: text inside the think block
    tool_calls: list[ToolCallDelta] = Field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)


def tool_call_id(job_id: str, index: int) -> str:
    """The id of a job's `index`-th tool call: the same on every worker and attempt."""
    return "call_" + hashlib.sha256(f"{job_id}:{index}".encode()).hexdigest()[:24]


def check_tool_choice(tools: list[Tool] | None, choice: ToolChoice | None) -> None:
    """ValueError if `choice` cannot apply to `tools` (no tools, or a function that is not one of them)."""
    if choice is None or choice == "none":
        return
    if not tools:
        raise ValueError("tool_choice needs tools")
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in tools]
        if choice.function.name not in names:
            raise ValueError(f"function {choice.function.name!r} is not among the tools ({', '.join(names)})")


def check_tool_names(tools: list[Tool]) -> None:
    """ValueError naming a function that two tools share: a call names its function, so the model
    could not say which one it calls."""
    seen: dict[str, list[int]] = {}
    for i, tool in enumerate(tools):
        seen.setdefault(tool.function.name, []).append(i)
    for name, places in seen.items():
        if len(places) > 1:
            where = ", ".join(f"tools[{i}]" for i in places)
            raise ValueError(f"tools: function names must be unique; {name!r} is the name of {where}")


def forced_tool_schema(tools: list[Tool], choice: ToolChoice | None, parallel: bool) -> dict[str, Any] | None:
    """The JSON schema an output must match when `choice` forces calls, or None (`none`, `auto`):
    a named function's output is its arguments object; `required` is an array of
    `{"name", "arguments"}` calls (one at most without parallel calls). For pydantic validators:
    ValueError for tools that share a name, PydanticCustomError (the wire's code) for a schema a
    grammar cannot enforce or afford (the tools' schemas together, with `required`)."""
    check_tool_names(tools)
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == choice.function.name)
        schema = tool.function.arguments_schema()
        what = f"tool_choice {tool.function.name}: its parameters"
    elif choice == "required":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "arguments": t.function.arguments_schema()},
                "required": ["name", "arguments"],
            }
            for t in tools
        ]
        schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        what = "tool_choice required: the calls' schema (every tool's together)"
    else:
        return None
    try:
        check_spec("json", schema)
    except SpecError as exc:
        raise pydantic_error(type(exc)(f"{what}: {exc}")) from None
    return schema
