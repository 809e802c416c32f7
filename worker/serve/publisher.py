"""Everything the worker writes about jobs, one pipelined round trip per batch.

After each engine step the engine thread hands over one `JobWrite` per job that produced
something; the publisher thread sends all pending writes in a single pipeline: per job one
`emit` script call that appends the events to `{p}:job:{id}:events` (entry id `{seq}-1`),
publishes each on `{p}:job:{id}`, and, when the job ends, writes the result into the job hash,
sets the expiries and only then XACKs and XDELs the queue entry. Scripts make each job's write
atomic: either all of it lands or none, so a re-delivered job never sees events without the
state that goes with them.

Seq fencing: Redis refuses an event whose seq already exists. A worker that finds another
worker's event at its next seq has lost the job (it was reclaimed during a stall) and stops
writing it; the same seq with the same bytes is its own earlier write, retried after a lost reply.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from worker.protocol import lua
from worker.protocol.jobs import STATE_AFTER_EVENT, FailedEvent, TimedOutEvent, event_to_fields
from worker.protocol.keys import PRIORITIES, Keys
from worker.serve.retry import Stopped, call_with_backoff

log = logging.getLogger("ferry.worker.serve.publisher")

# KEYS[1] events stream, KEYS[2] job hash (also the name of the job's pub/sub channel)
#   [, KEYS[3] queue stream: the job ends with this write]
# ARGV[1] first_token_at or '', ARGV[2] number of events n, n x (seq, type, data),
# then, when the job ends: result ttl, group, entry id, job hash field/value pairs...
_EMIT_LUA = """
local n = tonumber(ARGV[2])
local i = 3
for _ = 1, n do
  local seq, kind, data = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local added = redis.pcall('XADD', KEYS[1], seq .. '-1', 'seq', seq, 'type', kind, 'data', data)
  if type(added) == 'table' and added.err then
    local have = redis.call('XRANGE', KEYS[1], seq .. '-1', seq .. '-1')
    if #have == 0 or have[1][2][6] ~= data then return 0 end
  else
    redis.call('PUBLISH', KEYS[2], data)
  end
  i = i + 3
end
if ARGV[1] ~= '' then redis.call('HSETNX', KEYS[2], 'first_token_at', ARGV[1]) end
if #KEYS == 3 then
  if #ARGV > i + 2 then redis.call('HSET', KEYS[2], unpack(ARGV, i + 3)) end
  redis.call('EXPIRE', KEYS[1], ARGV[i])
  redis.call('EXPIRE', KEYS[2], ARGV[i])
  redis.call('XACK', KEYS[3], ARGV[i + 1], ARGV[i + 2])
  redis.call('XDEL', KEYS[3], ARGV[i + 2])
end
return 1
"""

# Hand a job back to the queue so any worker takes it now, not after the lease runs out.
# KEYS[1] queue stream holding the entry, KEYS[2] stream to re-add it to, KEYS[3] job hash
# ARGV: group, entry id, this worker's consumer name, job id, next envelope attempt,
#       attempts to record ('' for a job that never started here: its hash is left alone)
_HAND_BACK_LUA = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #p == 0 or p[1][2] ~= ARGV[3] then return 0 end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
local state = redis.call('HGET', KEYS[3], 'state')
if state == 'queued' or state == 'running' then
  if ARGV[6] ~= '' then redis.call('HSET', KEYS[3], 'state', 'queued', 'attempts', ARGV[6]) end
  redis.call('XADD', KEYS[2], '*', 'job_id', ARGV[4], 'attempt', ARGV[5])
end
return 1
"""


@dataclass(slots=True)
class Delivery:
    """One queue entry this worker holds (pending under its consumer name)."""

    stream: str  # the queue stream the entry is in
    entry_id: str
    fields: dict[str, str]  # the raw envelope
    reclaimed: bool = False  # taken over from another worker by the reaper


@dataclass(slots=True)
class JobWrite:
    """What to write for one job (or one bad envelope) in the next round trip."""

    job_id: str | None  # None: an envelope without a usable job id (only dead-letter + ack)
    delivery: Delivery | None  # the queue entry to ACK when the job ends or is handed back
    events: list = field(default_factory=list)  # protocol events, consecutive seqs
    first_token_at: float | None = None  # set once on the job hash (HSETNX), survives retries
    result: dict[str, str] | None = None  # job hash fields written when the job ends
    terminal: bool = False  # the job ends with this write: expire, ACK, XDEL
    hand_back: bool = False  # re-queue at once instead of ACK: a started job on the high stream, else its own
    attempts: int | None = None  # on hand-back of a started job: the attempts to record in its hash
    dead_letter: dict[str, str] | None = None  # an entry for {p}:dlq


def end_write(job_id: str, delivery: Delivery, event, worker_id: str, result: dict[str, str] | None = None,
              events_before: list | None = None) -> JobWrite:
    """The write that ends a job with terminal `event` (after `events_before`, e.g. the last tokens)."""
    fields = {"state": STATE_AFTER_EVENT[event.type].value, "finished_at": repr(event.ts), "worker_id": worker_id}
    if isinstance(event, FailedEvent | TimedOutEvent):
        fields |= {"error_code": event.code, "error_message": event.message}
    fields |= result or {}
    return JobWrite(job_id, delivery, events=[*(events_before or []), event], result=fields, terminal=True)


class Publisher:
    """Writes batches of `JobWrite`s; thread-safe (holds no state besides the Redis client)."""

    def __init__(self, client: redis.Redis, keys: Keys, model: str, worker_id: str, result_ttl_s: int) -> None:
        self.client = client
        self.keys = keys
        self.model = model
        self.worker_id = worker_id
        self.result_ttl_s = int(result_ttl_s)
        self._emit = client.register_script(_EMIT_LUA)
        self._hand_back = client.register_script(_HAND_BACK_LUA)

    def write(self, writes: list[JobWrite]) -> set[str]:
        """One pipelined round trip for all `writes`; returns the ids of jobs found lost to another worker."""
        answers: list[str | None] = []  # job id whose emit result comes at this position, else None

        def build():
            answers.clear()
            pipe = self.client.pipeline(transaction=False)
            for w in writes:
                if w.dead_letter is not None:
                    pipe.xadd(self.keys.dlq, w.dead_letter)
                    answers.append(None)
                if w.job_id is not None and (w.events or w.first_token_at is not None or w.terminal):
                    self._add_emit(pipe, w)
                    answers.append(w.job_id)
                if w.hand_back:
                    self._add_hand_back(pipe, w)
                    answers.append(None)
                elif w.terminal and w.delivery is not None and w.job_id is None:
                    self._add_ack(pipe, w.delivery)
                    answers.extend([None, None])
            return pipe

        results = lua.execute(build, [self._emit, self._hand_back])
        lost = set()
        for job_id, result in zip(answers, results, strict=True):
            if isinstance(result, Exception) and not isinstance(result, redis.ResponseError):
                raise result
            if isinstance(result, Exception):
                log.error("redis refused a write", extra={"job_id": job_id, "error": str(result)})
            elif job_id is not None and result == 0:
                lost.add(job_id)
        return lost

    def _add_emit(self, pipe, w: JobWrite) -> None:
        keys = [self.keys.events(w.job_id), self.keys.job(w.job_id)]
        args: list = ["" if w.first_token_at is None else repr(w.first_token_at), len(w.events)]
        for event in w.events:
            f = event_to_fields(event)
            args += [f["seq"], f["type"], f["data"]]
        if w.terminal and w.delivery is not None:
            keys.append(w.delivery.stream)
            args += [self.result_ttl_s, self.keys.group, w.delivery.entry_id]
            for name, value in (w.result or {}).items():
                args += [name, value]
        lua.add(pipe, self._emit, keys, args)

    def _add_hand_back(self, pipe, w: JobWrite) -> None:
        d = w.delivery
        attempt = int(d.fields.get("attempt", "1") or 1) + 1
        started = w.attempts is not None
        target = self.keys.queue(self.model, PRIORITIES[0]) if started else d.stream
        keys = [d.stream, target, self.keys.job(w.job_id)]
        args = [self.keys.group, d.entry_id, self.worker_id, w.job_id, attempt, w.attempts if started else ""]
        lua.add(pipe, self._hand_back, keys, args)

    def _add_ack(self, pipe, d: Delivery) -> None:
        pipe.xack(d.stream, self.keys.group, d.entry_id)
        pipe.xdel(d.stream, d.entry_id)


class PublisherThread:
    """Drains the engine's writes into Redis: everything queued goes out in one round trip."""

    def __init__(self, publisher: Publisher, on_written: Callable[[list[JobWrite], set[str]], None],
                 stop: threading.Event, max_delay_s: float) -> None:
        self.publisher = publisher
        self.on_written = on_written
        self.stop = stop
        self.max_delay_s = max_delay_s
        self.inbox: queue.SimpleQueue[list[JobWrite]] = queue.SimpleQueue()
        self._unwritten = 0  # batches submitted and not yet written
        self._done = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="publisher", daemon=True)

    def submit(self, writes: list[JobWrite]) -> None:
        """Queue writes (never blocks on Redis: the engine thread calls this after every step)."""
        with self._done:
            self._unwritten += 1
        self.inbox.put(writes)

    def flush(self, timeout: float) -> bool:
        """Wait until everything submitted so far is written; False on timeout."""
        with self._done:
            return self._done.wait_for(lambda: self._unwritten == 0, timeout)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                batch = self.inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            taken = 1
            while True:  # everything queued behind it rides along in the same round trip
                try:
                    batch = batch + self.inbox.get_nowait()
                except queue.Empty:
                    break
                taken += 1
            try:
                lost = call_with_backoff(lambda b=batch: self.publisher.write(b), what="publish", stop=self.stop,
                                         max_delay_s=self.max_delay_s)
            except Stopped:
                return
            self.on_written(batch, lost)
            with self._done:
                self._unwritten -= taken
                self._done.notify_all()
