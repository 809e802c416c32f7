"""The queue side of taking jobs, in Redis: read, reclaim, renew.

- `read`: XREADGROUP on the served model's queue streams, high before normal before low across
  every shard, never more entries than the engine has room for (the rest wait in Redis, visible
  to other workers and the autoscaler). Each call on a shard touches that shard's slot only; the
  shard read first rotates, so no shard's jobs wait behind another's of the same priority. An
  idle worker with several shards blocks on all of them at once (`worker.serve.shard_watch`).
  `live_only` reads the live lanes alone, for the room a worker full of background jobs keeps
  for live ones (their requests preempt the batch's).
  With LoRA, each shard's read takes the worker's hand-off stream first: the jobs a peer moved
  here because this worker holds their adapter (`worker.serve.lora_affinity`); each becomes the
  queue entry it names, now this worker's (`TAKE_HANDOFF`), or nothing if a reaper took it meanwhile.
- `reap`: XAUTOCLAIM entries whose lease ran out (their worker died), stream by stream.
- `renew`: XCLAIM JUSTID every running entry still ours (resets its idle time, which is the
  lease) and read the cancel flags, in one round trip; reports entries another worker took over
  and entries Redis no longer has (a restart without persistence).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis

from ferry.worker.protocol import LIVE_LANES, Keys, Priority, lua
from ferry.worker.protocol.codec import pairs_to_dict
from ferry.worker.protocol.keys import HANDOFF_TTL_S
from ferry.worker.serve.shard_watch import ShardWatch
from ferry.worker.serve.writes import Delivery

log = logging.getLogger("ferry.worker.intake")


@dataclass(frozen=True, slots=True)
class Renewal:
    """What renewing the leases found: jobs to stop, and jobs to cancel."""

    taken: set[str]  # job ids whose entry another worker holds now (reclaimed during a stall)
    gone: set[str]  # job ids whose entry Redis no longer has (it restarted empty, or the entry was trimmed)
    cancelled: set[str]  # job ids whose cancel flag is set


class QueueReader:
    """One worker's reads of one model's queue streams (consumer `worker_id` of the group)."""

    def __init__(self, client: redis.Redis, keys: Keys, model: str, worker_id: str, lease_s: float,
                 handoffs: bool = False) -> None:
        self.client = client
        self.keys = keys
        self.worker_id = worker_id
        self.lease_s = lease_s
        self.streams = keys.queues(model)  # every shard's, in read order
        self.shard_streams = [keys.shard_queues(model, n) for n in range(keys.shards)]
        self._stream_shard = {stream: n for n, streams in enumerate(self.shard_streams) for stream in streams}
        # handoffs (LoRA on): each shard's hand-off stream of this worker, read before its queue
        self.handoff_streams = [keys.handoff(model, n, worker_id) for n in range(keys.shards)] if handoffs else []
        self._read = client.register_script(lua.READ)
        self._take_handoff = client.register_script(lua.TAKE_HANDOFF)
        self._renew = client.register_script(lua.RENEW)
        self._reap_cursor = dict.fromkeys(self.streams, "0-0")
        self._next_shard = 0  # the shard read first next time (rotates)
        # Several shards: a blocked read per shard, so an idle worker takes a job from any at once.
        self._watch = ShardWatch(keys.shards, self._read_shard) if keys.shards > 1 else None

    def ensure_groups(self) -> None:
        """Create the consumer group on each queue and hand-off stream (and the stream) if missing."""
        for stream in self.streams + self.handoff_streams:
            try:
                self.client.xgroup_create(stream, self.keys.group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        for stream in self.handoff_streams:  # a dead worker's goes away
            self.client.expire(stream, HANDOFF_TTL_S)

    # --- taking entries ------------------------------------------------------------------------

    def read(self, room: int, block_ms: int, live_only: bool = False) -> list[Delivery]:
        """Up to `room` new entries, strictly by priority (of the high and normal lanes alone with
        `live_only`); blocks up to `block_ms` when all are empty. With several shards the blocked
        reads may outlive the call (`ShardWatch`): what they may still claim counts against `room`."""
        lanes = len(LIVE_LANES) if live_only else len(Priority)
        out = self._watch.collect() if self._watch is not None else []
        free = room - self.in_flight
        if free - len(out) > 0:
            out += self._read_by_priority(free - len(out), lanes)
        if out or block_ms <= 0:
            return self._taken(self._in_read_order(out))
        if self._watch is not None:
            # Straight back with what woke it: reading the rest of a burst here would cost a read
            # per shard and lane before the first job starts; the next call reads it at once.
            return self._taken(self._in_read_order(self._watch.wait(lanes, block_ms, free)))
        out = self._xreadgroup(dict.fromkeys(self._shard_read(0, lanes), ">"), count=1, block=block_ms)
        # Whatever else arrived with it, then the lot in priority order. A client's batch can reach
        # Redis in several reads (its pipeline is processed in chunks, and the blocked read is
        # served after the first), so read until nothing more comes: jobs sent together then
        # share their first step instead of the rest waiting a whole step behind the first few.
        while out and len(out) < free:
            more = self._read_by_priority(free - len(out), lanes)
            if not more:
                break
            out += more
        return self._taken(self._in_read_order(out))

    @property
    def in_flight(self) -> int:
        """Entries blocked reads in flight may still claim (0 on one shard: its read ends with `read`)."""
        return self._watch.in_flight if self._watch is not None else 0

    def settle(self, timeout_s: float) -> list[Delivery]:
        """Stop reading: wait up to `timeout_s` for the blocked reads in flight, and return what they
        claimed (a draining worker hands it back)."""
        return self._taken(self._watch.settle(timeout_s)) if self._watch is not None else []

    def handoffs(self, room: int = 1000) -> list[Delivery]:
        """The jobs peers moved here that no read took yet (a draining worker hands them back)."""
        return self._taken([d for stream in self.handoff_streams for d in self._read_streams([stream], room)])

    def _read_shard(self, shard: int, lanes: int, block_ms: int) -> list[Delivery]:
        """One blocked read of a shard's first `lanes` priorities, at most one entry (`ShardWatch`)."""
        return self._xreadgroup(dict.fromkeys(self._shard_read(shard, lanes), ">"), count=1, block=block_ms)

    def _shard_read(self, shard: int, lanes: int) -> list[str]:
        """The streams one read of a shard takes, in order: its hand-off stream, then `lanes` lanes."""
        return self.handoff_streams[shard:shard + 1] + self.shard_streams[shard][:lanes]

    def _in_read_order(self, deliveries: list[Delivery]) -> list[Delivery]:
        """Hand-offs first, then by lane."""
        handoffs = self.handoff_streams
        return sorted(deliveries, key=lambda d: -1 if d.stream in handoffs else self.streams.index(d.stream))

    def _taken(self, deliveries: list[Delivery]) -> list[Delivery]:
        """`deliveries` with each hand-off replaced by the queue entry it names, now ours (or
        dropped: a reaper took the entry meanwhile)."""
        handoffs = [d for d in deliveries if d.stream in self.handoff_streams]
        if not handoffs:
            return deliveries
        def build():
            pipe = self.client.pipeline(transaction=False)
            for d in handoffs:
                lua.add(pipe, self._take_handoff, [d.stream, d.fields.get("stream", "")],
                        [self.keys.group, d.entry_id, d.fields.get("entry_id", ""), self.worker_id])
            return pipe

        # by stream and id: two shards' hand-off streams may give entries the same id
        taken = dict(zip(((d.stream, d.entry_id) for d in handoffs), lua.execute(build, [self._take_handoff]),
                         strict=True))
        out = []
        for d in deliveries:
            if d.stream not in self.handoff_streams:
                out.append(d)
            elif isinstance(fields := taken[d.stream, d.entry_id], list) and fields:
                out.append(Delivery(d.fields["stream"], d.fields["entry_id"], pairs_to_dict(fields), handed=True))
            else:  # nil: a reaper took the entry meanwhile; an error: it stays pending for the reaper
                log.info("hand-off dropped: its queue entry is no longer ours",
                         extra={"job_id": d.fields.get("job_id"), "error": str(fields) if fields else None})
        return out

    def _rotate(self) -> int:
        shard = self._next_shard
        self._next_shard = (shard + 1) % len(self.shard_streams)
        return shard

    def _read_by_priority(self, room: int, lanes: int) -> list[Delivery]:
        """One READ script per call, each on one slot: the first `lanes` priorities of a single
        shard at once; with several shards, one priority across the shards (first shard rotating)
        before the next."""
        if len(self.shard_streams) == 1:
            return self._read_streams(self._shard_read(0, lanes), room)
        first = self._rotate()
        order = [(first + i) % len(self.shard_streams) for i in range(len(self.shard_streams))]
        out: list[Delivery] = []
        for lane in range(lanes):
            for shard in order:
                if len(out) >= room:
                    return out
                first = self.handoff_streams[shard:shard + 1] if lane == 0 else []
                out += self._read_streams(first + [self.shard_streams[shard][lane]], room - len(out))
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
        min_idle_ms = int(self.lease_s * 1000)
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

    def renew(self, held: list[tuple[str, Delivery]]) -> Renewal:
        """Renew the leases of `held` (job id, delivery)."""
        if not held:
            return Renewal(set(), set(), set())
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
        taken: set[str] = set()
        gone: set[str] = set()
        missing: list[str] = []
        for group, (taken_entries, gone_entries, missing_streams) in zip(groups, results[:len(groups)], strict=True):
            taken |= {job_id for job_id, d in group if d.entry_id in set(taken_entries)}
            gone |= {job_id for job_id, d in group if d.entry_id in set(gone_entries)}
            missing += missing_streams
        flags = results[len(groups):]
        if missing:
            log.warning("queue streams lost their group: recreating it", extra={"streams": missing})
            self.ensure_groups()
        cancelled = {job_id for (job_id, _), flag in zip(held, flags, strict=True) if flag == "1"}
        return Renewal(taken, gone, cancelled)

