"""API process settings: environment variables `FERRY_*` (pydantic-settings). Those every process
shares (Redis, job defaults, keys, the address) are `FerrySettings`'."""

from __future__ import annotations

from pydantic import Field

from ferry.worker.common.settings import FerrySettings


class ApiSettings(FerrySettings):
    redis_max_connections: int = 64  # the API's pool; requests wait for a free connection
    redis_pool_timeout_s: float = 2.0  # longest wait for one (then 503)
    redis_socket_timeout_s: float = 1.0  # connect and read timeout of every Redis call (then 503)
    max_body_bytes: int = 1 << 20
    # Processes (at the lowest CPU priority) that parse and check request bodies over 32 KiB, so that
    # one tenant's large bodies never hold the event loop every other request waits on (api/offloop.py)
    body_check_processes: int = Field(1, ge=1)
    max_queue_len: int = 10_000  # 429 above this many waiting jobs for a model
    retry_after_s: int = 5  # the Retry-After a 429 suggests
    # Models accepted even with no live worker (scale to zero: the queue wakes the pool),
    # comma-separated; models whose workers sent a heartbeat recently are always accepted.
    models: str | None = None
    model_liveness_s: float = 15.0  # a model is live while a worker's heartbeat is this recent
    max_wait_s: float = 60.0  # cap on `Prefer: wait=N`
    idempotency_ttl_s: int = 86400
    sse_keepalive_s: float = 15.0
    # After SIGTERM: how long requests in flight may go on. Open streams and waits end cleanly before
    # it is over (a stream with a comment saying where to resume), at most 2 s before (api.main).
    shutdown_grace_s: float = 10.0
    http_keep_alive_s: int = 5  # an idle keep-alive connection is closed after this (uvicorn's timeout_keep_alive)
    http_head_timeout_s: float = 10.0  # a request's line and headers must all arrive within this (slowloris)
    http_body_timeout_s: float = 30.0  # and a JSON body within this (408); file uploads are not limited so
    usage_metrics_tenants: int = 20  # tenants (first by name) with their own `tenant` label on /metrics; rest: other
    # --- Batch API ---
    files_url: str = "ferry-files"  # where files live: file:///dir, a local path, or s3://bucket/prefix
    upload_dir: str = "/tmp/ferry-uploads"  # uploads are spooled here while they stream in
    max_file_bytes: int = 200 << 20  # largest upload (413 above)
    batch_backlog: int = 256  # lines of one batch queued or running at once (the rest wait in the file)
    batch_poll_s: float = 0.25  # how often the batch driver looks at its batches' jobs
    batch_lease_s: float = 10.0  # a batch whose driver stops renewing for this long is taken over
    batch_window_s: float | None = None  # test-only: overrides every batch's 24 h completion window
