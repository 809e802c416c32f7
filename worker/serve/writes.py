"""What the worker writes about jobs: one small type per kind of write, handed to the publisher.

The engine loop and the intake decide; the publisher (`worker.serve.publisher`) writes each kind
with one script call in the next round trip:

- `Progress`: a running job's new events (tokens), and its first-token time;
- `Finish`: a job ends: its last events, the terminal event, the result fields of its hash, the
  expiries, then the ACK of its queue entry (and an entry in `{p}:dlq` for a dead-lettered job);
- `HandBack`: a job goes back to the queue for any worker to take now (a drain);
- `Discard`: a queue entry with no job to run (malformed, or a duplicate of a job already running
  here, or already settled): ACK it, dead-lettering it when it is malformed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pydantic import BaseModel

from ferry.worker.protocol import STATE_AFTER_EVENT, FailedEvent, JobResult, TimedOutEvent
from ferry.worker.serve.job_trace import AttemptTrace


@dataclass(slots=True)
class Delivery:
    """One queue entry this worker holds (pending under its consumer name)."""

    stream: str  # the queue stream the entry is in
    entry_id: str
    fields: dict[str, str]  # the raw envelope
    reclaimed: bool = False  # taken over from another worker by the reaper
    handed: bool = False  # moved here by the worker that read it (`worker.serve.lora_affinity`): never moved on


@dataclass(slots=True)
class Progress:
    job_id: str
    events: list[BaseModel]  # protocol events with consecutive seqs
    first_token_at: float | None = None  # set once on the job hash (HSETNX), survives retries
    background: bool = False  # a background-lane job's: written after the others of its round trip


@dataclass(slots=True)
class Finish:
    job_id: str
    delivery: Delivery  # the queue entry to ACK once the result is written
    events: list[BaseModel]  # the job's last events, ending with its terminal event
    result: dict[str, str]  # job hash fields: state, finished_at, the result or the error
    dead_letter: dict[str, str] | None = None  # an entry for {p}:dlq
    background: bool = False  # a background-lane job's: written after the others of its round trip
    trace: AttemptTrace | None = None  # tracing on: the attempt's times, made spans once this is written

    @property
    def state(self) -> str:
        return self.result["state"]


@dataclass(slots=True)
class HandBack:
    job_id: str
    delivery: Delivery
    events: list[BaseModel] = field(default_factory=list)  # events produced since the last write
    attempts: int | None = None  # a started job's attempts to record (it goes to the high stream); None: not started


@dataclass(slots=True)
class Discard:
    delivery: Delivery
    dead_letter: dict[str, str] | None = None


JobWrite = Progress | Finish | HandBack | Discard


class Lost(StrEnum):
    """Why a write found the job no longer this worker's: it stops the job and writes nothing more."""

    TAKEN = "taken over by another worker"  # its queue entry was reclaimed during a stall
    RECORD_GONE = "its record is gone from Redis"  # a restart without persistence, or an eviction


def finish(job_id: str, delivery: Delivery, event: BaseModel, worker_id: str, output: dict[str, Any] | None = None,
           events_before: list[BaseModel] | None = None, background: bool = False) -> Finish:
    """The write that ends a job with terminal `event` (after `events_before`, e.g. the last
    tokens); `output`: the `JobResult` fields of what it generated."""
    error = {}
    if isinstance(event, FailedEvent | TimedOutEvent):
        error = {"error_code": event.code, "error_message": event.message}
    result = JobResult(state=STATE_AFTER_EVENT[event.type], finished_at=event.ts, worker_id=worker_id, **error,
                       **(output or {}))
    return Finish(job_id, delivery, [*(events_before or []), event], result.to_redis(), background=background)


def ends_job(write: JobWrite) -> bool:
    """Whether the job leaves this worker with the write (its slot frees once it is written)."""
    return isinstance(write, Finish | HandBack)
