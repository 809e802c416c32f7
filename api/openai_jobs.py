"""OpenAI requests as Ferry jobs: a `/v1/completions` or `/v1/chat/completions` body becomes one
job per choice (per prompt, times `n`), checked as the live routes and the Batch API both need.

A field Ferry does not implement is refused with the field named (`UNSUPPORTED_FIELDS`, and the
values of a field it does not implement: 422 `unsupported_parameter`); a field that only means
something beside another (top_logprobs without logprobs, stream_options without stream) is refused
alone rather than ignored; the sampling fields map one to one onto the job's (`SAMPLING_LIMITS`).
"""

from __future__ import annotations

from ferry.api.errors import ApiError, unsupported
from ferry.api.openai_schemas import UNSUPPORTED_FIELDS, ChatCompletionRequest, CompletionRequest, lane
from ferry.api.services import ModelRoute, Services, new_job_request
from ferry.worker.protocol import JobRequest
from ferry.worker.protocol.sampling import SAMPLING_LIMITS

_SAMPLING = tuple(limit.name for limit in SAMPLING_LIMITS if limit.name != "logprobs")  # logprobs: per route
MAX_PROMPTS = 64  # prompts in one /v1/completions request: each is a job of its own


def _job_request(svc: Services, tenant_name: str, route: ModelRoute, body, **fields) -> JobRequest:
    for name in _SAMPLING:
        value = getattr(body, name)
        if value is not None and name not in fields:
            fields[name] = value
    if body.logit_bias:
        fields["logit_bias"] = body.logit_bias
    for name, why in UNSUPPORTED_FIELDS.items():
        if getattr(body, name) not in (None, [], "none"):  # no tools, or tools never called, is what Ferry does
            raise unsupported(name, f"not supported ({why})")
    if body.stream_options is not None and not body.stream:
        raise ApiError(422, "invalid_request", "stream_options: only with stream: true", field="stream_options")
    fields["structured_outputs"] = _structured_outputs(body)
    metadata = {"api": "openai", "user": body.user} if body.user else {"api": "openai"}
    return new_job_request(svc, tenant_name, route, fields, priority=lane(body.priority), metadata=metadata)


def _structured_outputs(body):
    """vLLM's `structured_outputs`, or OpenAI's `response_format` (not both)."""
    from_format = body.response_format.structured_outputs() if body.response_format is not None else None
    if from_format is not None and body.structured_outputs is not None:
        raise ApiError(422, "invalid_request", "give response_format or structured_outputs, not both",
                       field="response_format")
    return from_format or body.structured_outputs


def prompts(prompt) -> list:
    """OpenAI's prompt: one text or token-id list, or a batch of them (one job and one choice each)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return prompt
    return [prompt]


def completion_jobs(svc: Services, tenant_name: str, route: ModelRoute, body: CompletionRequest) -> list[JobRequest]:
    """One job per prompt, in the prompts' order (the choices' indexes)."""
    if body.suffix:
        raise unsupported("suffix", "not supported (insertion needs a model trained for it)")
    for name in ("tools", "tool_choice"):
        if getattr(body, name) is not None:
            raise unsupported(name, "tools need /v1/chat/completions")
    batch = prompts(body.prompt)
    if not batch or any(len(p) == 0 for p in batch):
        raise ApiError(422, "invalid_request", "prompt: give at least one prompt, none of them empty", field="prompt")
    if len(batch) > MAX_PROMPTS:
        raise ApiError(422, "invalid_request", f"prompt: at most {MAX_PROMPTS} prompts per request", field="prompt")
    if len(batch) > 1 and body.stream:
        raise unsupported("stream", "a list of prompts is answered whole; stream one prompt per request")
    if body.echo and (body.logprobs is not None or any(not isinstance(p, str) for p in batch)):
        raise unsupported("echo", "supported for text prompts without logprobs")
    if body.best_of is not None and body.best_of != body.n:
        raise unsupported("best_of", "only equal to n (every choice is returned)")
    if body.n > 1 and body.stream:
        raise unsupported("stream", "n > 1 is answered whole; stream with n = 1")
    if len(batch) * body.n > MAX_PROMPTS:
        raise ApiError(422, "invalid_request", f"prompt x n: at most {MAX_PROMPTS} choices per request", field="n")
    fields = {}
    if body.logprobs is not None:
        fields |= {"logprobs": True, "top_logprobs": body.logprobs}
    # Choices prompt-major, as OpenAI orders them: prompt i's j-th choice has index i * n + j.
    requests = [_job_request(svc, tenant_name, route, body, prompt=p, **fields) for p in batch]
    return [choice for request in requests for choice in _choices(request, body.n)]


def _choices(job: JobRequest, n: int) -> list[JobRequest]:
    """`n` jobs of one request, one per choice (a seed, if given, moves by the choice's index so
    sampled choices differ); their prompts are the same tokens, shared through the prefix cache."""
    return [job] + [job.model_copy(update={"seed": job.seed + i} if job.seed is not None else {}) for i in range(1, n)]


def chat_jobs(svc: Services, tenant_name: str, route: ModelRoute, body: ChatCompletionRequest) -> list[JobRequest]:
    fields: dict = {"messages": body.messages, "chat_template_kwargs": body.chat_template_kwargs,
                    "reasoning_effort": body.reasoning_effort}
    if body.max_completion_tokens is not None:
        if body.max_tokens is not None:
            raise ApiError(422, "invalid_request", "max_tokens: give max_tokens or max_completion_tokens, not both",
                           field="max_tokens")
        fields["max_tokens"] = body.max_completion_tokens
    if body.logprobs:
        fields |= {"logprobs": True, "top_logprobs": body.top_logprobs or 0}
    elif body.top_logprobs is not None:
        raise ApiError(422, "invalid_request", "top_logprobs: only with logprobs: true", field="top_logprobs")
    if body.tools is not None:
        fields |= {"tools": body.tools, "tool_choice": body.tool_choice}
        if body.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = body.parallel_tool_calls
    elif body.tool_choice not in (None, "none"):
        raise ApiError(422, "invalid_request", "tool_choice needs tools", field="tool_choice")
    elif body.parallel_tool_calls is not None:
        raise ApiError(422, "invalid_request", "parallel_tool_calls: only with tools", field="parallel_tool_calls")
    return _choices(_job_request(svc, tenant_name, route, body, **fields), body.n)
