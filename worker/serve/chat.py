"""A job's chat as prompt tokens, its tools included, and the parser that reads tool calls out of
its output.

A chat template that knows tools (it mentions `tools`: Qwen, Llama 3.1, Hermes, ...) is given
them, the earlier turns' `tool_calls` and the `tool` results as Hugging Face's templates take
them. A template that does not (SmolLM2's) would drop them silently; then the tools are described
in the system message in the format of the worker's parser (`FERRY_TOOL_CALL_PARSER`), earlier
calls are written into the assistant turns that made them in that format, and tool results go in
as user turns, so the conversation still reaches the model whole.
"""

from __future__ import annotations

from typing import Any

from ferry.worker.protocol import JobRequest
from ferry.worker.protocol.tools import NamedToolChoice
from ferry.worker.serve.tool_parsers import PARSERS, NamedCall, RequiredCalls, ToolCallParser


def template_knows_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def chat_messages(request: JobRequest, parser: type[ToolCallParser], native: bool) -> tuple[list[dict], list | None]:
    """(messages, tools) for the chat template: `native` when the template renders tools itself.
    With tool_choice `none` the tools stay out of the prompt: the model is not asked to call them."""
    tools = request.tools if request.effective_tool_choice != "none" else None
    if native:
        rendered_tools = [t.model_dump(exclude_none=True) for t in tools or []] or None
        return [m.for_template() for m in request.messages], rendered_tools
    messages: list[dict[str, Any]] = []
    for m in request.messages:
        if m.role == "tool":
            messages.append({"role": "user", "content": f"<tool_response>\n{m.text}\n</tool_response>"})
        elif m.tool_calls:
            calls = parser.render_calls(m.tool_calls)
            messages.append({"role": "assistant", "content": f"{m.text}\n{calls}" if m.text else calls})
        else:
            messages.append({"role": m.role, "content": m.text} | ({"name": m.name} if m.name else {}))
    if tools:
        prompt = parser.system_prompt(tools)
        if messages[0]["role"] in ("system", "developer"):
            messages[0] = messages[0] | {"content": f"{messages[0]['content']}\n\n{prompt}"}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages, None


def output_parser(request: JobRequest, job_id: str, parser_name: str) -> ToolCallParser | None:
    """What reads this job's output for tool calls; None when it may not call any."""
    choice = request.effective_tool_choice
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        return NamedCall(job_id, choice.function.name)
    if choice == "required":
        return RequiredCalls(job_id, request.parallel_tool_calls)
    return PARSERS[parser_name](job_id, request.parallel_tool_calls)
