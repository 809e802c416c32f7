"""One JSON object per log line, carrying the worker id and, where there is one, the job id.

Use `log.info("job picked", extra={"job_id": ..., "attempt": ...})`: every `extra` key becomes a
field of the line. A line logged inside a span (tracing on: `worker.common.tracing`) carries its
`trace_id` and `span_id`, or the ones given in `extra`.
"""

from __future__ import annotations

import json
import logging
import sys

from ferry.worker.common.tracing import current_ids

# Attributes every LogRecord has; anything else on a record came in through `extra`.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def __init__(self, worker_id: str) -> None:
        super().__init__()
        self.worker_id = worker_id

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "worker_id": self.worker_id,
        }
        ids = current_ids()
        if ids is not None:
            line["trace_id"], line["span_id"] = ids
        line.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(worker_id: str, level: int = logging.INFO) -> None:
    """Route the root logger to stderr as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(worker_id))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
