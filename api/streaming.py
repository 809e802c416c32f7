"""Following a job's events: replay the durable stream, then live pub/sub, once each, in order.

A job's events are numbered by `seq` without gaps and stored in `{p}:job:{s<n>}:{id}:events` with
entry id `{seq}-1` (worker/protocol/jobs.py). A follower subscribes first, then replays the stream
after the last seq it has, then takes live messages, dropping any seq it already has and going
back to the stream when it sees a gap or the pub/sub connection was lost. So a client that
connects before, during or after the run, or resumes with `Last-Event-ID`, sees every event
exactly once.

One pub/sub connection per API process serves every follower (`PubSubHub`). On a Redis Cluster
the job channels are shard channels (SSUBSCRIBE: the workers SPUBLISH), one connection per node
that owns a followed channel's slot.

When the process shuts down (`PubSubHub.stop`), every follow ends at once, before its job does:
a stream then ends with `resume_comment`, and the client picks the job up with `Last-Event-ID`
from any API process, since the events are stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator

import anyio
import redis.asyncio as aredis
from redis.exceptions import RedisError

from ferry.api.tasks import cancel_and_wait
from ferry.worker.common.connect import is_cluster
from ferry.worker.protocol import TERMINAL_EVENT_TYPES, Event, Keys, decode_event, event_from_fields, seq_of_stream_id

log = logging.getLogger("ferry.api")

RESYNC = object()  # put on every follower's queue when live messages may have been missed
STOP = object()  # put on every follower's queue when the process shuts down: its follow ends there
# A cluster's pub/sub polls its node connections in turn, each for up to the timeout: short, so one
# idle node never holds back another's messages.
_SHARDED_POLL_S = 0.002
_REPLAY_PAGE = 1000


class PubSubHub:
    """One pub/sub connection shared by the process: channel -> the queues of its followers."""

    def __init__(self, client: aredis.Redis):
        self._client = client
        self._sharded = is_cluster(client)
        self._pubsub = client.pubsub()
        self._queues: dict[str, set[asyncio.Queue]] = {}
        self._subscribed = asyncio.Event()
        # One (un)subscribe at a time: redis-py's pub/sub opens its connection lazily, and concurrent
        # first subscribes would each open one, leaving all but the last unread (their messages lost).
        self._subscribing = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self.stopping = False  # set by stop(): follows end before their jobs do

    def start(self) -> None:
        self._task = asyncio.create_task(self._read(), name="pubsub-hub")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        await self._pubsub.aclose()

    def stop(self) -> None:
        """End every follow (`follow_events`) at its next message, and any begun from now on right
        after its stored events: the process is shutting down, and its streams must end cleanly
        while there is time."""
        self.stopping = True
        for followers in self._queues.values():
            for queue in followers:
                queue.put_nowait(STOP)

    @property
    def num_followers(self) -> int:
        return sum(len(queues) for queues in self._queues.values())

    @contextlib.asynccontextmanager
    async def subscribe(self, channel: str) -> AsyncIterator[asyncio.Queue]:
        queue: asyncio.Queue = asyncio.Queue()
        followers = self._queues.setdefault(channel, set())
        followers.add(queue)
        if self.stopping:
            queue.put_nowait(STOP)
        try:
            if len(followers) == 1:
                async with self._subscribing:
                    if self._sharded:
                        await self._client.initialize()  # the slot map (a no-op once known) names the node
                        await self._pubsub.ssubscribe(channel)
                    else:
                        await self._pubsub.subscribe(channel)
            self._subscribed.set()
            yield queue
        finally:
            followers.discard(queue)
            if not followers and self._queues.get(channel) is followers:
                del self._queues[channel]
                # Shielded: a follower is often closed by a cancelled request (client gone).
                with anyio.CancelScope(shield=True), contextlib.suppress(RedisError, OSError):
                    async with self._subscribing:
                        await (self._pubsub.sunsubscribe if self._sharded else self._pubsub.unsubscribe)(channel)

    async def _read(self) -> None:
        while True:
            if not self._queues or not self._subscribed.is_set():
                # Nothing to read, or a first follower still subscribing: redis-py's pub/sub has no
                # connection before its first subscribe, and reading it then raises.
                if not self._queues:
                    self._subscribed.clear()
                await self._subscribed.wait()
                continue
            try:
                if self._sharded:
                    message = await self._pubsub.get_sharded_message(ignore_subscribe_messages=True,
                                                                     timeout=_SHARDED_POLL_S)
                    if message is None and not self._pubsub.node_pubsub_mapping:
                        await asyncio.sleep(_SHARDED_POLL_S)  # between a subscribe and its connection
                else:
                    message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            except (RedisError, OSError) as exc:
                # redis-py reconnects and re-subscribes on the next call; what was published in
                # between is lost, so every follower re-reads its stream.
                log.warning("pub/sub connection error (%s): followers resync from the streams", exc)
                for followers in self._queues.values():
                    for queue in followers:
                        queue.put_nowait(RESYNC)
                await asyncio.sleep(0.5)
                continue
            if message is not None and message["type"] in ("message", "smessage"):
                for queue in self._queues.get(message["channel"], ()):
                    queue.put_nowait(message["data"])


async def read_events_after(client: aredis.Redis, keys: Keys, job_id: str, after: int) -> list[Event]:
    """Stored events with seq > `after` (-1: all), in order."""
    events: list[Event] = []
    start = "-" if after < 0 else f"({after}-1"
    while True:
        entries = await client.xrange(keys.events(job_id), min=start, max="+", count=_REPLAY_PAGE)
        events += [event_from_fields(fields) for _, fields in entries]
        if len(entries) < _REPLAY_PAGE:
            return events
        start = f"({entries[-1][0]}"


async def _ended_by(client: aredis.Redis, keys: Keys, job_id: str, seq: int) -> bool:
    """Whether the job's terminal event is stored with a seq of at most `seq`: a follower who has
    everything up to `seq` (or claims to, with a Last-Event-ID beyond the end) has nothing to wait for."""
    entries = await client.xrevrange(keys.events(job_id), count=1)
    if not entries:
        return False
    entry_id, fields = entries[0]
    return fields.get("type") in TERMINAL_EVENT_TYPES and seq_of_stream_id(entry_id) <= seq


async def follow_events(
    client: aredis.Redis, hub: PubSubHub, keys: Keys, job_id: str, after: int = -1, idle_s: float = 15.0,
    resync_s: float | None = None,
) -> AsyncIterator[list[Event] | None]:
    """Yield the job's events with seq > `after` once each, in order, ending with the terminal one.

    Events come in batches of whatever is available at once, so a burst (a replay, or a follower
    that fell behind) goes out in one write. Yields None after each `idle_s` without an event (time
    for a keep-alive, or to see whether the client is still there); after `resync_s` (default
    `idle_s`) without one it reads the stream again, so nothing pub/sub lost stays missed. A tick
    costs no Redis call: idle followers must not keep the process's Redis pool busy, since every
    other request waits its turn for a connection behind them. Ends early, without the terminal
    event, once `hub.stopping`.
    """
    resync_s = idle_s if resync_s is None else resync_s
    if after >= 0 and await _ended_by(client, keys, job_id, after):
        return  # resuming at or after the last event: nothing follows
    async with hub.subscribe(keys.channel(job_id)) as live:
        last = after
        while True:
            replayed = await read_events_after(client, keys, job_id, last)
            if replayed:
                yield replayed
                last = replayed[-1].seq
                if replayed[-1].type in TERMINAL_EVENT_TYPES:
                    return
            quiet_since = time.monotonic()
            while True:
                try:
                    # Under load the next message is usually there already: skip wait_for's timer.
                    first = live.get_nowait() if not live.empty() else await asyncio.wait_for(live.get(), idle_s)
                except TimeoutError:
                    yield None
                    if time.monotonic() - quiet_since < resync_s:
                        continue
                    if await _ended_by(client, keys, job_id, last):
                        return  # the end was at or before where this follower started
                    break  # re-read the stream after every quiet spell: nothing can stay missed
                quiet_since = time.monotonic()
                drained = [first, *(live.get_nowait() for _ in range(live.qsize()))]
                stop = any(data is STOP for data in drained)
                batch, resync = [], False
                for data in drained:
                    if data is STOP:
                        break
                    if data is RESYNC:
                        resync = True
                        break
                    event = decode_event(data)
                    if event.seq <= last:
                        if event.type in TERMINAL_EVENT_TYPES:
                            return  # the job ended where this follower already is
                        continue
                    if event.seq != last + 1:
                        resync = True  # a gap: the stream has what pub/sub skipped
                        break
                    batch.append(event)
                    last = event.seq
                if batch:
                    yield batch
                    if batch[-1].type in TERMINAL_EVENT_TYPES:
                        return
                if stop:
                    return
                if resync:
                    break


PRIME_S = 2.0  # how long a stream waits for its job's first token before sending its headers
DEADLINE_MARGIN_S = 30.0  # an answer waits for its job's ttl_s + timeout_s and this long, then gives up


async def prime(events: AsyncIterator[list[Event] | None]) -> list[Event]:
    """Events up to the job's first token or end, or what came within `PRIME_S`: so a job that
    fails at once (say, a prompt too long) is still answered with an HTTP error status."""
    buffered: list[Event] = []
    started = time.monotonic()
    async for batch in events:
        if batch is not None:
            buffered += batch
            if buffered[-1].type != "started":
                break
        elif time.monotonic() - started > PRIME_S:
            break
    return buffered


def sse(data: str, *, event: str | None = None, id: int | str | None = None) -> str:
    """One SSE message; `data` is a single line (JSON)."""
    head = ""
    if id is not None:
        head += f"id: {id}\n"
    if event is not None:
        head += f"event: {event}\n"
    return f"{head}data: {data}\n\n"


def sse_json(payload: dict, **kwargs) -> str:
    return sse(json.dumps(payload, separators=(",", ":"), ensure_ascii=False), **kwargs)


KEEPALIVE = ": keep-alive\n\n"


def resume_comment(job_id: str, last_seq: int) -> str:
    """The last message of a stream ended by the process shutting down (an SSE comment, which
    clients skip): where the job's events go on. The job itself goes on."""
    after = f" with Last-Event-ID: {last_seq}" if last_seq >= 0 else ""
    return f": shutting down; resume at /v1/jobs/{job_id}/events{after}\n\n"
# OpenAPI for an SSE response: the schema of one event (as OpenAPI 3.2's itemSchema describes it).
SSE_EVENT_SCHEMA = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
    "required": ["data"],
}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
