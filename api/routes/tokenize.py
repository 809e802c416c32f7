"""vLLM's `/tokenize` and `/detokenize`: a prompt (or a chat, through the model's chat template and
tools) as the model reads it, and token ids back to text.

The worker is what renders prompts (the API holds no tokenizer), so each is a job that does not
generate (`task`): it queues on its model like any job, a worker of that model answers it as soon as
it starts it, and the answer is exactly the token ids a generation job with the same prompt gets.
Only vLLM's default rendering options are implemented; any other value is refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ferry.api.auth import tenant
from ferry.api.errors import ApiError, unsupported
from ferry.api.job_wait import run_without_generating
from ferry.api.offloop import OffLoopBodyRoute
from ferry.api.schemas import check_body_json, error_responses
from ferry.api.services import (
    Services,
    model_limits,
    new_job_request,
    resolve_model,
    services,
)
from ferry.worker.protocol import Message
from ferry.worker.protocol.fields import ModelName, TokenIds
from ferry.worker.protocol.tools import MAX_TOOLS, Tool

router = APIRouter(tags=["tokenize"], route_class=OffLoopBodyRoute)

Svc = Annotated[Services, Depends(services)]
Tenant = Annotated[str, Depends(tenant)]


class TokenizeRequest(BaseModel):
    """A prompt, or a chat (with its tools and template variables), to tokenize as a job would."""

    model_config = ConfigDict(extra="forbid")
    model: ModelName | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's rendering options: only their defaults are implemented (the ones generation uses)
    add_special_tokens: bool | None = Field(default=None, description="a prompt's are added, a chat's are not")
    add_generation_prompt: bool | None = Field(default=None, description="a chat ends with the assistant's turn")
    continue_final_message: bool | None = Field(default=None, description="not supported")
    return_token_strs: bool | None = Field(default=None, description="not supported")

    @model_validator(mode="before")
    @classmethod
    def _valid_json(cls, data: Any) -> Any:
        return check_body_json(data)

    def refused(self) -> tuple[str, str] | None:
        """(field, why) for a rendering option Ferry does not implement."""
        chat = self.messages is not None
        defaults = {"add_special_tokens": not chat, "add_generation_prompt": True, "continue_final_message": False,
                    "return_token_strs": False}
        for name, default in defaults.items():
            value = getattr(self, name)
            if value is not None and value != default:
                return name, f"only {str(default).lower()} (how generation renders the prompt)"
        if not chat and (self.tools is not None or self.chat_template_kwargs is not None):
            return ("tools" if self.tools is not None else "chat_template_kwargs"), "only with messages"
        return None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None  # None: no worker of the model has reported it
    tokens: list[int]
    token_strs: None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: ModelName | None = None
    tokens: TokenIds


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post("/tokenize", response_model=TokenizeResponse, responses=error_responses(401, 404, 422, 429, 504),
             summary="A prompt or a chat as the model's token ids (vLLM's shape)")
async def tokenize(body: TokenizeRequest, http: Request, svc: Svc, tenant_name: Tenant) -> TokenizeResponse:
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(422, "invalid_request", "give exactly one of prompt or messages", field="prompt")
    refused = body.refused()
    if refused is not None:
        raise unsupported(*refused)
    route = await resolve_model(svc, body.model, tenant_name)
    fields = body.model_dump(include={"prompt", "messages", "tools", "chat_template_kwargs"}, exclude_none=True)
    record = await run_without_generating(svc, http, tenant_name,
                                          new_job_request(svc, tenant_name, route, fields | {"task": "tokenize"}))
    limits = await model_limits(svc, route.model)
    tokens = record.token_ids or []
    return TokenizeResponse(count=len(tokens), max_model_len=limits.max_model_len if limits else None, tokens=tokens)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=error_responses(401, 404, 422, 429, 504),
             summary="Token ids as text (vLLM's shape)")
async def detokenize(body: DetokenizeRequest, http: Request, svc: Svc, tenant_name: Tenant) -> DetokenizeResponse:
    route = await resolve_model(svc, body.model, tenant_name)
    job = new_job_request(svc, tenant_name, route, {"prompt": body.tokens, "task": "detokenize"})
    record = await run_without_generating(svc, http, tenant_name, job)
    return DetokenizeResponse(prompt=record.text or "")
