"""The wire contract between the API and the workers: jobs, their events, Redis key names and scripts.

`api` imports only this package (and the torch-free `worker.common`) from `worker`, and importing
it never imports torch (the API is a torch-free process; a test checks both).

- `jobs`: the job request, its record in Redis, its result, the queue envelope, states, error codes;
- `lanes`: a job's queue lane (`Priority`), the one type every process uses for it;
- `events`: what a job streams, in order, and how it is stored and published;
- `sampling`: every sampling field and the values it allows (also read by the engine);
- `structured`, `tools`: structured outputs and tool calling on the wire;
- `keys`: every Redis key and channel name; `lua`: every script;
- `queue`: the atomic writes of a queue client (enqueue, cancel); `usage`: counting a job that ended.
"""

from ferry.worker.protocol.events import (
    STATE_AFTER_EVENT,
    TERMINAL_EVENT_TYPES,
    CancelledEvent,
    CompletedEvent,
    Event,
    FailedEvent,
    StartedEvent,
    TimedOutEvent,
    TokenEvent,
    decode_event,
    encode_event,
    event_from_fields,
    event_json_tail,
    event_stream_id,
    event_to_fields,
    seq_of_stream_id,
)
from ferry.worker.protocol.jobs import (
    PROTOCOL_VERSION,
    TERMINAL_STATES,
    WEBHOOK_EVENT_FOR,
    WEBHOOK_EVENTS,
    Envelope,
    ErrorCode,
    JobRecord,
    JobRequest,
    JobResult,
    JobState,
    Message,
    TextPart,
    Timings,
    UnreadableRecord,
    Usage,
    Webhook,
    job_id_created_at,
    new_job_id,
)
from ferry.worker.protocol.keys import GROUP, Keys
from ferry.worker.protocol.lanes import LIVE_LANES, Priority
from ferry.worker.protocol.logprobs import TokenLogprob, TopLogprob
from ferry.worker.protocol.queue import (
    EnqueueResult,
    cancel_job,
    cancel_job_async,
    enqueue_job,
    enqueue_job_async,
    enqueue_jobs,
    new_job_id_for,
)
from ferry.worker.protocol.structured import StructuredOutputsRequest

__all__ = [
    "GROUP",
    "LIVE_LANES",
    "PROTOCOL_VERSION",
    "STATE_AFTER_EVENT",
    "TERMINAL_EVENT_TYPES",
    "TERMINAL_STATES",
    "WEBHOOK_EVENTS",
    "WEBHOOK_EVENT_FOR",
    "CancelledEvent",
    "CompletedEvent",
    "EnqueueResult",
    "Envelope",
    "ErrorCode",
    "Event",
    "FailedEvent",
    "JobRecord",
    "JobRequest",
    "JobResult",
    "StructuredOutputsRequest",
    "JobState",
    "Keys",
    "Message",
    "Priority",
    "StartedEvent",
    "TextPart",
    "TimedOutEvent",
    "Timings",
    "TokenEvent",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "Webhook",
    "cancel_job",
    "cancel_job_async",
    "decode_event",
    "encode_event",
    "enqueue_job",
    "enqueue_job_async",
    "enqueue_jobs",
    "event_from_fields",
    "event_json_tail",
    "event_stream_id",
    "event_to_fields",
    "UnreadableRecord",
    "job_id_created_at",
    "new_job_id",
    "new_job_id_for",
    "seq_of_stream_id",
]
