"""A job's prompt as token ids: its chat (tools included) through the model's chat template, or its
text through the tokenizer. Runs in the intake with a tokenizer of its own (Hugging Face's fast
tokenizers must not be shared between threads), so the engine thread only ever admits token ids
(vLLM's InputProcessor, SGLang's TokenizerManager).

A chat template that knows tools (it mentions `tools`: Qwen, Llama 3.1, Hermes, ...) is given
them, the earlier turns' `tool_calls` and the `tool` results as Hugging Face's templates take
them. A template that does not (SmolLM2's) would drop them silently; then the tools are described
in the system message in the format of the worker's parser (`FERRY_TOOL_CALL_PARSER`), earlier
calls are written into the assistant turns that made them in that format, and tool results go in
as user turns, so the conversation still reaches the model whole.

The chat's own template variables (`chat_template_kwargs`, `reasoning_effort`) go to the template
only when it reads them (`template_variables`, the names its source uses); any other is refused,
never dropped (`worker.protocol.chat_template`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2.meta
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import _compile_jinja_template

from ferry.worker.engine import InvalidPromptError
from ferry.worker.protocol import JobRequest
from ferry.worker.serve.tool_parsers import PARSERS, ToolCallParser

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


class PromptRenderer:
    """Turns a job's request into prompt token ids; `render` raises InvalidPromptError for a prompt
    the model cannot take (no tokenizer or chat template, a template that fails on the messages)."""

    def __init__(self, tokenizer, tool_call_parser: str) -> None:
        self.tokenizer = tokenizer  # None: the model has none, prompts must be token ids
        self.parser = PARSERS[tool_call_parser]
        self.native_tools = "tools" in (getattr(tokenizer, "chat_template", None) or "")
        # The variables the chat template reads (None: its source does not parse here; then any is passed).
        self.template_variables = template_variables(getattr(tokenizer, "chat_template", None))

    @classmethod
    def for_model(cls, model_dir: Path, tool_call_parser: str) -> PromptRenderer:
        """With a tokenizer instance of its own, loaded from the model's directory."""
        has_tokenizer = any((model_dir / name).is_file() for name in _TOKENIZER_FILES)
        return cls(AutoTokenizer.from_pretrained(model_dir) if has_tokenizer else None, tool_call_parser)

    def reported(self) -> dict[str, str]:
        """What the API is told of the model's chat template, with its limits: the variables it reads
        (JSON; null when unknown), so a request setting one it does not read is refused before it is queued."""
        known = self.template_variables
        return {"chat_template_variables": json.dumps(sorted(known) if known is not None else None)}

    def render(self, request: JobRequest) -> list[int]:
        if isinstance(request.prompt, list):
            return list(request.prompt)
        if self.tokenizer is None:
            raise InvalidPromptError("this model has no tokenizer: give the prompt as token ids")
        try:
            if request.messages is None:
                return self.tokenizer.encode(request.prompt)
            if not getattr(self.tokenizer, "chat_template", None):
                raise InvalidPromptError("this model has no chat template; send a plain prompt instead")
            problem = request.template_problem(self.template_variables) if self.template_variables is not None else None
            if problem is not None:
                raise InvalidPromptError(": ".join(problem))
            messages, tools = chat_messages(request, self.parser, self.native_tools)
            ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                     **request.template_kwargs())
        except InvalidPromptError:
            raise
        except Exception as exc:  # the template's own errors (jinja raises its own types) are the request's
            raise InvalidPromptError(f"{type(exc).__name__}: {exc}") from exc
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


    def decode(self, token_ids: list[int]) -> str:
        """The text of `token_ids` (special tokens kept), as /detokenize answers it."""
        if self.tokenizer is None:
            raise InvalidPromptError("this model has no tokenizer: token ids cannot be decoded")
        if any(t >= len(self.tokenizer) for t in token_ids):
            raise InvalidPromptError(f"a token id is beyond the vocabulary ({len(self.tokenizer)})")
        return self.tokenizer.decode(token_ids)


def template_variables(template: object) -> frozenset[str] | None:
    """The names a chat template's source reads from its context (messages, tools, enable_thinking,
    ...); an empty set without a template, None for a source that does not parse (or several
    named templates)."""
    if not template:
        return frozenset()
    if not isinstance(template, str):
        return None
    try:
        env = _compile_jinja_template(template).environment  # transformers' own: its extensions and globals
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template))) - set(env.globals)
    except jinja2.TemplateError:
        return None


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
