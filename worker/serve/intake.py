"""The Redis side of taking jobs: read, reclaim, decide, start, renew.

- `read`: XREADGROUP on the served model's queue streams, high before normal before low across
  every shard, never more entries than the engine has room for (the rest wait in Redis, visible
  to other workers and the autoscaler). Each call on a shard touches that shard's slot only; the
  shard read first rotates, so no shard's jobs wait behind another's of the same priority. An
  idle worker with several shards blocks on all of them at once (`worker.serve.shard_watch`).
  `live_only` reads the high and normal lanes alone, for the room a worker full of low-lane jobs
  keeps for live ones (their requests preempt the batch's).
- `reap`: XAUTOCLAIM entries whose lease ran out (their worker died), stream by stream.
- `prepare`: per delivered entry, read the job hash and its event stream in one round trip and
  decide: skip (already terminal), fail (malformed envelope, unknown job, bad request, too many
  deliveries -> `{p}:dlq`), cancel, time out (TTL passed before it ever started), or start. A
  start is one atomic script (`running`, attempts + 1, `started` event on the first attempt) and
  carries what was already generated, so the job resumes where the client left off.
- `renew`: XCLAIM JUSTID every running entry still ours (resets its idle time, which is the
  lease) and read the cancel flags, in one round trip; reports entries another worker took over.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import redis
from pydantic import ValidationError

from ferry.worker.protocol import (
    PRIORITIES,
    TERMINAL_EVENT_TYPES,
    TERMINAL_STATES,
    CancelledEvent,
    Envelope,
    ErrorCode,
    FailedEvent,
    JobRequest,
    JobState,
    Keys,
    StartedEvent,
    TimedOutEvent,
    TokenEvent,
    event_from_fields,
    event_json_tail,
    lua,
)
from ferry.worker.protocol.codec import pairs_to_dict
from ferry.worker.protocol.jobs import TERMINAL_STATES_ARG
from ferry.worker.serve.settings import WorkerSettings
from ferry.worker.serve.shard_watch import ShardWatch
from ferry.worker.serve.writes import Delivery, Discard, Finish, JobWrite, finish

log = logging.getLogger("ferry.worker.intake")
_LIVE_LANES = PRIORITIES.index("low")  # the lanes before `low` in read order: high, normal

@dataclass(slots=True)
class Streamed:
    """What the client already has of a re-delivered job (empty for a first delivery)."""

    token_ids: list[int]  # generated tokens already in the event stream
    text: str  # text already in the event stream
    next_seq: int  # seq of the next event


@dataclass(slots=True)
class JobStart:
    """A job this worker now runs: everything the engine thread needs."""

    job_id: str
    delivery: Delivery
    request: JobRequest
    attempts: int  # deliveries that started running, this one included
    started_at: float  # unix time the job first started (on any worker)
    first_token_at: float | None  # unix time of its first token, if an earlier attempt had one
    deadline: float  # unix time its execution timeout runs out
    streamed: Streamed  # what earlier attempts already streamed


@dataclass(slots=True)
class _Candidate:
    delivery: Delivery
    job_id: str
    envelope_error: str | None  # why the envelope is malformed (its job id was still readable)


class Consumer:
    def __init__(self, client: redis.Redis, keys: Keys, settings: WorkerSettings, worker_id: str) -> None:
        self.client = client
        self.keys = keys
        self.settings = settings
        self.worker_id = worker_id
        self.model = settings.served_model_name
        self.streams = keys.queues(self.model)  # every shard's, in read order
        self.shard_streams = [keys.shard_queues(self.model, n) for n in range(keys.shards)]
        self._stream_shard = {stream: n for n, streams in enumerate(self.shard_streams) for stream in streams}
        self._start = lua.register(client, lua.START)
        self._read = client.register_script(lua.READ)
        self._renew = client.register_script(lua.RENEW)
        self._reap_cursor = dict.fromkeys(self.streams, "0-0")
        self._next_shard = 0  # the shard read first next time (rotates)
        # Several shards: a blocked read per shard, so an idle worker takes a job from any at once.
        self._watch = ShardWatch(keys.shards, self._read_shard) if keys.shards > 1 else None

    def ensure_groups(self) -> None:
        """Create the consumer group on each queue stream (and the stream) if missing."""
        for stream in self.streams:
            try:
                self.client.xgroup_create(stream, self.keys.group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    # --- taking entries ------------------------------------------------------------------------

    def read(self, room: int, block_ms: int, live_only: bool = False) -> list[Delivery]:
        """Up to `room` new entries, strictly by priority (of the high and normal lanes alone with
        `live_only`); blocks up to `block_ms` when all are empty. With several shards the blocked
        reads may outlive the call (`ShardWatch`): what they may still claim counts against `room`."""
        lanes = _LIVE_LANES if live_only else len(PRIORITIES)
        out = self._watch.collect() if self._watch is not None else []
        free = room - self.in_flight
        if free - len(out) > 0:
            out += self._read_by_priority(free - len(out), lanes)
        if out or block_ms <= 0:
            return out
        if self._watch is not None:
            # Straight back with what woke it: reading the rest of a burst here would cost a read
            # per shard and lane before the first job starts; the next call reads it at once.
            return self._in_read_order(self._watch.wait(lanes, block_ms, free))
        out = self._xreadgroup(dict.fromkeys(self.shard_streams[0][:lanes], ">"), count=1, block=block_ms)
        # Whatever else arrived with it, then the lot in priority order. A client's batch can reach
        # Redis in several reads (its pipeline is processed in chunks, and the blocked read is
        # served after the first), so read until nothing more comes: jobs sent together then
        # share their first step instead of the rest waiting a whole step behind the first few.
        while out and len(out) < free:
            more = self._read_by_priority(free - len(out), lanes)
            if not more:
                break
            out += more
        return self._in_read_order(out)

    @property
    def in_flight(self) -> int:
        """Entries blocked reads in flight may still claim (0 on one shard: its read ends with `read`)."""
        return self._watch.in_flight if self._watch is not None else 0

    def settle(self, timeout_s: float) -> list[Delivery]:
        """Stop reading: wait up to `timeout_s` for the blocked reads in flight, and return what they
        claimed (a draining worker hands it back)."""
        return self._watch.settle(timeout_s) if self._watch is not None else []

    def _read_shard(self, shard: int, lanes: int, block_ms: int) -> list[Delivery]:
        """One blocked read of a shard's first `lanes` priorities, at most one entry (`ShardWatch`)."""
        return self._xreadgroup(dict.fromkeys(self.shard_streams[shard][:lanes], ">"), count=1, block=block_ms)

    def _in_read_order(self, deliveries: list[Delivery]) -> list[Delivery]:
        return sorted(deliveries, key=lambda d: self.streams.index(d.stream))

    def _rotate(self) -> int:
        shard = self._next_shard
        self._next_shard = (shard + 1) % len(self.shard_streams)
        return shard

    def _read_by_priority(self, room: int, lanes: int) -> list[Delivery]:
        """One READ script per call, each on one slot: the first `lanes` priorities of a single
        shard at once; with several shards, one priority across the shards (first shard rotating)
        before the next."""
        if len(self.shard_streams) == 1:
            return self._read_streams(self.shard_streams[0][:lanes], room)
        first = self._rotate()
        order = [self.shard_streams[(first + i) % len(self.shard_streams)] for i in range(len(self.shard_streams))]
        out: list[Delivery] = []
        for lane in range(lanes):
            for streams in order:
                if len(out) >= room:
                    return out
                out += self._read_streams([streams[lane]], room - len(out))
        return out

    def _read_streams(self, streams: list[str], room: int) -> list[Delivery]:
        read, missing = self._read(keys=streams, args=[self.keys.group, self.worker_id, room])
        if missing:
            self.ensure_groups()
        return [
            Delivery(stream, entry_id, pairs_to_dict(fields))
            for stream, entries in read
            for entry_id, fields in entries
        ]

    def _xreadgroup(self, streams: dict[str, str], count: int, block: int | None) -> list[Delivery]:
        try:
            answer = self.client.xreadgroup(self.keys.group, self.worker_id, streams, count=count, block=block)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_groups()  # Redis restarted empty, or someone deleted the stream
            return []
        return [
            Delivery(stream, entry_id, fields or {})
            for stream, entries in (answer or [])
            for entry_id, fields in entries
        ]

    def reap(self, room: int, held: set[str]) -> list[Delivery]:
        """Claim up to `room` entries idle longer than the lease (their worker is gone)."""
        out: list[Delivery] = []
        min_idle_ms = int(self.settings.lease_s * 1000)
        for stream in self.streams:
            if len(out) >= room:
                break
            try:
                answer = self.client.xautoclaim(stream, self.keys.group, self.worker_id, min_idle_ms,
                                                start_id=self._reap_cursor[stream], count=room - len(out))
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                self.ensure_groups()
                continue
            self._reap_cursor[stream] = answer[0]
            for entry_id, fields in answer[1]:
                if entry_id not in held:  # our own, late in renewing: still running here
                    out.append(Delivery(stream, entry_id, fields or {}, reclaimed=True))
        return out

    def renew(self, held: list[tuple[str, Delivery]]) -> tuple[set[str], set[str]]:
        """Renew the leases of `held` (job id, delivery); returns (lost job ids, cancelled job ids)."""
        if not held:
            return set(), set()
        by_shard: dict[int, list[tuple[str, Delivery]]] = {}  # one RENEW per shard: a script's keys share a slot
        for job_id, d in held:
            by_shard.setdefault(self._stream_shard[d.stream], []).append((job_id, d))
        groups = list(by_shard.values())

        def build():
            pipe = self.client.pipeline(transaction=False)
            for group in groups:
                lua.add(pipe, self._renew, [d.stream for _, d in group],
                        [self.keys.group, self.worker_id] + [d.entry_id for _, d in group])
            for job_id, _ in held:
                pipe.hget(self.keys.job(job_id), "cancel")
            return pipe

        results = lua.raise_errors(lua.execute(build, [self._renew]))
        lost: set[str] = set()
        missing: list[str] = []
        for group, (lost_entries, missing_streams) in zip(groups, results[:len(groups)], strict=True):
            lost |= {job_id for job_id, d in group if d.entry_id in set(lost_entries)}
            missing += missing_streams
        flags = results[len(groups):]
        if missing:
            log.warning("queue streams lost their group: recreating it", extra={"streams": missing})
            self.ensure_groups()
        cancelled = {job_id for (job_id, _), flag in zip(held, flags, strict=True) if flag == "1"}
        return lost, cancelled

    # --- deciding what to do with an entry -----------------------------------------------------

    def prepare(self, deliveries: list[Delivery]) -> tuple[list[JobStart], list[JobWrite]]:
        """Decide every delivery: jobs to start, and writes that settle the others (skip/fail/cancel/time out)."""
        writes: list[JobWrite] = []
        candidates: list[_Candidate] = []
        for d in deliveries:
            try:
                env = Envelope.from_fields(d.fields)
                candidates.append(_Candidate(d, env.job_id, None))
            except ValidationError as exc:
                reason = _validation_summary(exc)
                job_id = d.fields.get("job_id")
                log.warning("malformed envelope", extra={"entry_id": d.entry_id, "job_id": job_id, "error": reason})
                if isinstance(job_id, str) and job_id:
                    candidates.append(_Candidate(d, job_id, reason))
                else:
                    writes.append(self._dead_letter(None, d, ErrorCode.MALFORMED_ENVELOPE, reason, attempts=0))
        if not candidates:
            return [], writes
        pipe = self.client.pipeline(transaction=False)
        for c in candidates:
            pipe.hgetall(self.keys.job(c.job_id))
            pipe.xrange(self.keys.events(c.job_id))
        answers = pipe.execute()
        starts: list[tuple[_Candidate, JobStart]] = []
        for i, c in enumerate(candidates):
            decision = self._decide(c, answers[2 * i], answers[2 * i + 1])
            if isinstance(decision, JobStart):
                starts.append((c, decision))
            elif decision is not None:
                writes.append(decision)
        return self._start_all(starts, writes)

    def _decide(self, c: _Candidate, job: dict[str, str], entries: list) -> JobStart | JobWrite:
        d, job_id, now = c.delivery, c.job_id, time.time()
        if not job:
            return self._dead_letter(
                None,
                d,
                ErrorCode.JOB_NOT_FOUND,
                f"job {job_id} does not exist (expired or never written)",
                attempts=0,
                job_id=job_id,
            )
        events = [event_from_fields(fields) for _, fields in entries]
        if job.get("state") in TERMINAL_STATES or (events and events[-1].type in TERMINAL_EVENT_TYPES):
            return Discard(d)  # settled already (e.g. cancelled while queued)
        next_seq = events[-1].seq + 1 if events else 0
        attempts = int(job.get("attempts", "0"))
        if c.envelope_error is not None:
            return self._dead_letter(next_seq, d, ErrorCode.MALFORMED_ENVELOPE, c.envelope_error, attempts, job_id)
        try:
            request = JobRequest.model_validate_json(job.get("request", ""))
        except ValidationError as exc:
            return finish(
                job_id,
                d,
                FailedEvent(seq=next_seq, code=ErrorCode.INVALID_REQUEST, message=_validation_summary(exc)),
                self.worker_id,
            )
        if job.get("cancel") == "1":
            return finish(job_id, d, CancelledEvent(seq=next_seq), self.worker_id)
        if attempts >= self.settings.max_attempts:
            message = f"delivered {attempts + 1} times, more than max_attempts={self.settings.max_attempts}"
            return self._dead_letter(next_seq, d, ErrorCode.MAX_ATTEMPTS_EXCEEDED, message, attempts, job_id)
        started_at = float(job["started_at"]) if "started_at" in job else None
        ttl = request.ttl_s or self.settings.job_ttl_s
        if started_at is None and now > request.created_at + ttl:
            message = f"waited {now - request.created_at:.1f}s in the queue, more than ttl_s={ttl:g}"
            return finish(
                job_id, d, TimedOutEvent(seq=next_seq, code=ErrorCode.TTL_EXPIRED, message=message), self.worker_id
            )
        timeout = request.timeout_s or self.settings.job_timeout_s
        if started_at is not None and now > started_at + timeout:
            message = f"ran longer than timeout_s={timeout:g}"
            return finish(job_id, d, TimedOutEvent(seq=next_seq, code=ErrorCode.EXECUTION_TIMEOUT, message=message),
                             self.worker_id)
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        streamed = Streamed(
            token_ids=[t for e in tokens for t in e.token_ids],
            text="".join(e.text for e in tokens),
            next_seq=max(next_seq, 1),  # the start writes `started` as seq 0 when the stream is empty
        )
        first_token_at = float(job["first_token_at"]) if "first_token_at" in job else None
        return JobStart(job_id, d, request, attempts + 1, started_at or now, first_token_at,
                        (started_at or now) + timeout, streamed)

    def _start_all(self, starts: list[tuple[_Candidate, JobStart]], writes: list[JobWrite]):
        if not starts:
            return [], writes
        def build():
            pipe = self.client.pipeline(transaction=False)
            for _, js in starts:
                started = event_json_tail(StartedEvent(seq=0, worker_id=self.worker_id, attempt=js.attempts))
                args = [TERMINAL_STATES_ARG, JobState.running.value, self.worker_id, repr(js.started_at),
                        self.keys.channel(js.job_id), started]
                lua.add(pipe, self._start, [self.keys.job(js.job_id), self.keys.events(js.job_id)], args)
            return pipe

        answers = lua.raise_errors(lua.execute(build, [self._start]))
        ok: list[JobStart] = []
        again: list[Delivery] = []
        for (c, js), attempts in zip(starts, answers, strict=True):
            if attempts:
                js.attempts = int(attempts)
                ok.append(js)
            else:
                again.append(c.delivery)  # cancelled or settled between the read and the start
        if again:
            more_starts, more_writes = self.prepare(again)
            ok += more_starts
            writes += more_writes
        return ok, writes

    def _dead_letter(self, seq: int | None, d: Delivery, code: str, message: str, attempts: int,
                     job_id: str | None = None) -> Finish | Discard:
        """Fail the job (when it exists: `seq` is its next event) and park the entry in {p}:dlq."""
        entry = {
            "job_id": job_id or "",
            "code": code,
            "message": message,
            "attempts": str(attempts),
            "worker_id": self.worker_id,
            "stream": d.stream,
            "entry_id": d.entry_id,
            "envelope": json.dumps(d.fields),
            "ts": repr(time.time()),
        }
        log.warning("dead-lettered", extra={"job_id": job_id, "code": code, "entry_id": d.entry_id})
        if seq is None:
            return Discard(d, dead_letter=entry)
        write = finish(job_id, d, FailedEvent(seq=seq, code=code, message=message), self.worker_id)
        write.dead_letter = entry
        return write


def _validation_summary(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "request"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)
