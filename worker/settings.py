"""Worker settings: moved to `worker.serve.settings`; this alias keeps old imports working."""

from worker.serve.settings import WorkerSettings

__all__ = ["WorkerSettings"]
