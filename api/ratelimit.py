"""Per-tenant rate limits: requests and tokens per minute, token buckets in Redis.

Each tenant has two budgets, `live` (POST /v1/jobs, /v1/chat/completions, /v1/completions) and
`batch` (the Batch API's lines, admitted by the batch driver), each a hash of two buckets
(`Keys.rate_bucket`) that one `lua.RATE_LIMIT` call refills, checks and takes from atomically:
any number of API replicas share them without a race. A request takes one request and the
tokens it may use: its prompt, estimated here (the API holds no tokenizer: about four bytes of
text per token), plus its `max_tokens` (unset: the rest of the model's context window). The job
hash keeps what was reserved; when the job ends, whoever writes its end gives back the
difference to the tokens really used (`worker.protocol.usage`), for live, async and batch jobs
alike.

Over a limit: 429 `rate_limit_exceeded` with `Retry-After` and OpenAI's `x-ratelimit-*` headers,
which successful answers carry too (set on the request's state, added by `RateLimitHeaders`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ferry.api.errors import ApiError
from ferry.api.services import Services, model_limits
from ferry.worker.protocol import JobRequest, lua

BUCKET_TTL_S = 300  # an idle bucket refills fully within a minute; its hash goes after this
_BYTES_PER_TOKEN = 4
_MESSAGE_OVERHEAD_TOKENS = 4  # a chat template's role markers per message
_UNKNOWN_WINDOW_TOKENS = 2048  # completion tokens reserved for an unset max_tokens before any worker reported the model


class RateLimited(ApiError):
    """The 429: `too_large` when the request alone is over the whole per-minute budget (waiting cannot help)."""

    def __init__(self, message: str, headers: dict[str, str], too_large: bool) -> None:
        super().__init__(429, "rate_limit_exceeded", message, headers=headers)
        self.too_large = too_large


@dataclass(frozen=True, slots=True)
class Admission:
    headers: dict[str, str]  # x-ratelimit-* for the answer
    budget: str | None  # the budget the tokens were taken from; None: the tenant has no limits there


async def estimate_tokens(svc: Services, request: JobRequest) -> int:
    """Tokens a job may use: its prompt (estimated) plus what it may generate."""
    if isinstance(request.prompt, list):
        prompt = len(request.prompt)
    elif request.prompt is not None:
        prompt = math.ceil(len(request.prompt.encode()) / _BYTES_PER_TOKEN)
    else:
        text = sum(len(m.text.encode()) for m in request.messages or [])
        text += sum(len(t.model_dump_json().encode()) for t in request.tools or [])
        prompt = math.ceil(text / _BYTES_PER_TOKEN) + _MESSAGE_OVERHEAD_TOKENS * len(request.messages or [])
    if request.max_tokens is not None:
        return prompt + request.max_tokens
    limits = await model_limits(svc, request.model)
    return prompt + (max(limits.max_model_len - prompt, 1) if limits else _UNKNOWN_WINDOW_TOKENS)


def _duration(ms: int) -> str:
    # OpenAI's reset format: "20ms", "1.5s", "6m0s".
    if ms < 1000:
        return f"{max(ms, 0)}ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.3g}s"
    return f"{int(seconds // 60)}m{int(seconds % 60)}s"


async def admit(svc: Services, tenant: str, budget: str, tokens: int) -> Admission:
    """Take one request and `tokens` from the tenant's `budget`, or raise the 429."""
    rpm, tpm = svc.keyring.tenant(tenant).limits.for_budget(budget)
    if rpm is None and tpm is None:
        return Admission({}, None)
    script = svc.redis.register_script(lua.RATE_LIMIT)
    answer = await script(keys=[svc.keys.rate_bucket(tenant, budget)],
                          args=[int(time.time() * 1000), rpm or 0, tpm or 0, tokens, BUCKET_TTL_S])
    admitted, too_large, req_left, req_reset, tok_left, tok_reset, wait_ms = (int(x) for x in answer)
    headers: dict[str, str] = {}
    if rpm is not None:
        headers |= {"x-ratelimit-limit-requests": str(rpm), "x-ratelimit-remaining-requests": str(req_left),
                    "x-ratelimit-reset-requests": _duration(req_reset)}
    if tpm is not None:
        headers |= {"x-ratelimit-limit-tokens": str(tpm), "x-ratelimit-remaining-tokens": str(tok_left),
                    "x-ratelimit-reset-tokens": _duration(tok_reset)}
    if too_large:
        raise RateLimited(f"this request needs {tokens} tokens (prompt + max_tokens), more than the {budget} budget "
                          f"of {tpm} tokens per minute: lower max_tokens", headers | {"Retry-After": "60"}, True)
    if not admitted:
        what = "requests" if rpm is not None and req_left < 1 else "tokens"
        raise RateLimited(f"rate limit of the {budget} budget reached ({what} per minute); retry after Retry-After",
                          headers | {"Retry-After": str(max(1, math.ceil(wait_ms / 1000)))}, False)
    return Admission(headers, budget)


async def admit_jobs(svc: Services, http_state, tenant: str, jobs: list[JobRequest]) -> list[tuple[str, int] | None]:
    """Admit one HTTP request that becomes `jobs` against the tenant's live budget; the answer's
    headers go on `http_state`. Returns each job's reservation (budget, tokens) for its hash."""
    estimates = [await estimate_tokens(svc, job) for job in jobs]
    admission = await admit(svc, tenant, "live", sum(estimates))
    http_state.ratelimit_headers = admission.headers
    return [(admission.budget, n) if admission.budget else None for n in estimates]


class RateLimitHeaders:
    """Pure ASGI: adds the `x-ratelimit-*` headers a route's admission left on the request's state."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                extra = scope.get("state", {}).get("ratelimit_headers")
                if extra:
                    headers = list(message.get("headers", []))
                    have = {name.lower() for name, _ in headers}
                    headers += [(k.encode(), v.encode()) for k, v in extra.items() if k.encode() not in have]
                    message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_headers)
