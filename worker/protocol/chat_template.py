"""What a chat passes to the model's chat template besides its messages and tools: vLLM's
`chat_template_kwargs` (Qwen3's `enable_thinking`, say) and OpenAI's `reasoning_effort`.

A Jinja template reads only the variables it names: a kwarg it does not read would be ignored
without a word, so each is refused unless the template reads it (`template_problem`). The worker
knows its template's variables (`worker.serve.render`) and reports them with the model's limits,
so the API refuses such a request before it is queued; a worker that renders one refuses it too.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

REASONING_EFFORTS = ("low", "medium", "high")
# Names Ferry itself gives `apply_chat_template` (its own parameters, the messages and tools, the
# tokenizer's special tokens and helpers): a kwarg of one of these would change how the prompt is
# made, not what the template says.
RESERVED_NAMES = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "bos_token", "eos_token", "unk_token", "pad_token",
    "sep_token", "cls_token", "mask_token", "additional_special_tokens", "raise_exception", "strftime_now",
})


class ChatTemplateFields(BaseModel):
    """The chat template's extra variables, as a job request carries them (chats only)."""

    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="variables for the model's chat template (e.g. enable_thinking); each one the "
        "template does not read is refused")
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        default=None, description="the chat template's `reasoning_effort` variable; refused where the template "
        "takes none")

    @model_validator(mode="after")
    def _chat_only(self) -> ChatTemplateFields:
        if (self.chat_template_kwargs or self.reasoning_effort) and getattr(self, "messages", None) is None:
            raise ValueError("chat_template_kwargs and reasoning_effort need 'messages' (a chat)")
        if self.reasoning_effort is not None and "reasoning_effort" in (self.chat_template_kwargs or {}):
            raise ValueError("give reasoning_effort or chat_template_kwargs.reasoning_effort, not both")
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """The variables to render the chat template with, beyond messages and tools."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs

    def template_problem(self, variables: frozenset[str]) -> tuple[str, str] | None:
        """(field, why) for the first template variable the chat template, which reads `variables`,
        would ignore, or None when it reads every one."""
        for key in self.chat_template_kwargs or {}:
            if key in RESERVED_NAMES:
                return f"chat_template_kwargs.{key}", "not a template variable a request may set"
            if key not in variables:
                return f"chat_template_kwargs.{key}", "the model's chat template does not read this variable"
        if self.reasoning_effort is not None and "reasoning_effort" not in variables:
            return "reasoning_effort", "the model's chat template takes no reasoning_effort"
        return None
