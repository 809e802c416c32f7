"""The jobs of a batch's lines: built from the lines' bodies, admitted against the tenant's batch
budget and enqueued at most once each (idempotency key `batch:{id}:{line}`), and read back once
they ended.
"""

from __future__ import annotations

from ferry.api.batches import Envelope, Line, LineError, Route, build_line
from ferry.api.errors import ApiError
from ferry.api.joblist import index_job
from ferry.api.ratelimit import admit, estimate_tokens
from ferry.api.services import Services, cancel_job, check_against_model
from ferry.api.tracing import enqueue_span
from ferry.worker.protocol import TERMINAL_STATES, enqueue_job_async, new_job_id_for
from ferry.worker.protocol.codec import text


def build_jobs(svc: Services, tenant: str, batch_id: str, endpoint: str, items: list[Envelope | LineError],
               routes: dict[str | None, Route | ApiError], ttl_s: float) -> list[Line | Exception]:
    """Each line's job, or why it has none (a thread's work: it parses every body)."""
    built: list[Line | Exception] = []
    for item in items:
        try:
            built.append(item if isinstance(item, LineError) else
                         build_line(svc, tenant, batch_id, endpoint, item, routes, ttl_s))
        except Exception as exc:  # the line's answer, raised again by enqueue_line
            built.append(exc)
    return built


async def enqueue_line(svc: Services, batch_id: str, raw: dict, line: Line | Exception, ttl_s: float) -> list:
    """Admit and enqueue one line's job: its in-flight entry [job id, custom_id, chat]."""
    if isinstance(line, Exception):
        raise line
    await check_against_model(svc, line.job)
    tokens = await estimate_tokens(svc, line.job)
    admission = await admit(svc, raw["tenant"], "batch", tokens)
    line_key = f"batch:{batch_id}:{line.number}"
    job_id = new_job_id_for(svc.keys, line.job, line_key)
    await index_job(svc.redis, svc.keys, svc.settings, line.job.tenant, job_id)
    # A batch is one trace (its POST's, kept in its hash): each line's enqueue is a span of it.
    with enqueue_span(svc.tracing, line.job.model, job_id, parent=raw.get("traceparent")) as traceparent:
        result = await enqueue_job_async(
            svc.redis, svc.keys, line.job, job_id=job_id, idempotency_key=line_key,
            idempotency_ttl_s=int(ttl_s) + 86400, batch_line=(batch_id, line.custom_id),
            reservation=(admission.budget, tokens) if admission.budget else None, traceparent=traceparent)
    return [result.job_id, line.custom_id, raw["endpoint"] == "/v1/chat/completions"]


async def ended_jobs(svc: Services, inflight: dict, cancel: bool) -> dict[int, dict]:
    """The in-flight lines whose jobs ended, with their job hashes (empty: the hash is gone); with
    `cancel`, the others' jobs are cancelled. Each tick looks at every line in flight (up to
    `batch_backlog`), so it reads only the state first and the whole hash only of the jobs that
    ended: the driver shares its event loop and Redis with live traffic."""
    pipe = svc.redis.pipeline(transaction=False)
    for job_id, _, _ in inflight.values():
        pipe.hmget(svc.keys.job(job_id), "state", "cancel")
    ended: list[int] = []
    for number, (state, cancelled) in zip(inflight, await pipe.execute(), strict=True):
        # No hash: Redis lost it, or it expired; its job was enqueued before the line was in flight.
        if state is None or text(state) in TERMINAL_STATES:
            ended.append(number)
        elif cancel and text(cancelled or "") != "1":
            await cancel_job(svc, inflight[number][0])
    pipe = svc.redis.pipeline(transaction=False)
    for number in ended:
        pipe.hgetall(svc.keys.job(inflight[number][0]))
    return dict(zip(ended, await pipe.execute() if ended else [], strict=True))
