"""A worker prefers the LoRA adapters it holds, without starving anything (docs/lora.md).

Jobs of every adapter share the base model's queue, so any worker of the base may read a job whose
adapter it does not hold while another worker holds it: serving it here costs a read from disk, S3
or the Hub and an adapter slot, where the holder serves it at once. So when the intake has decided
to start such a job (`JobStarter.prepare`), and a live peer of the same model holds the adapter (the
heartbeat's `loras`, in host memory or a slot) and has room, one script moves the queue entry to
that peer (`HAND_OFF`: the entry changes owner, so its lease goes with it and a peer
that dies before starting it loses it to the reaper: nothing is lost) and wakes the peer's blocked
read through its hand-off stream, which the peer reads before the queue (`QueueReader`).

Nothing starves: a job moves at most once (a handed-over or reclaimed entry is never moved on), only
to a peer with room, and a job whose adapter no live peer holds, or whose holders are full, is
served where it was read. A peer's room is its `max_num_seqs` (heartbeat) plus a short queue
(`queue_allowance`), less the queue entries it holds now (the consumer group's pending count per
consumer, read at each decision: a heartbeat's job count is up to an interval old, and jobs end
faster than that). The queue: a holder whose batch is full is still the better place for a few
more, which wait there for a slot (less than one job's length; and past the lease the reaper gives
them to any worker) instead of an adapter read elsewhere; it also covers the entries a peer has
just read and not yet started or moved on, which its pending count holds for a moment.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis

from ferry.worker.protocol import Keys, lua
from ferry.worker.protocol.keys import HANDOFF_TTL_S
from ferry.worker.serve.settings import WorkerSettings
from ferry.worker.serve.writes import Delivery

if TYPE_CHECKING:  # the engine loop imports the job starts, which use this module
    from ferry.worker.serve.engine_loop import EngineLoop
    from ferry.worker.serve.metrics import WorkerMetrics

log = logging.getLogger("ferry.worker.intake")


@dataclass(frozen=True, slots=True)
class Peer:
    """Another live worker of the served model, as its last heartbeat described it."""

    worker_id: str
    loras: frozenset[str]  # adapters it holds (host memory or a slot)
    max_num_seqs: int  # jobs it runs at once


def queue_allowance(max_num_seqs: int) -> int:
    """Jobs a holder whose batch is full may still be handed, to wait there for a slot."""
    return max(2, max_num_seqs // 8)


def parse_peer(worker_id: str, beat: dict[str, str], model: str, now: float, max_age_s: float) -> Peer | None:
    """A heartbeat hash as a Peer able to take hand-offs: of `model`, ready, beaten within `max_age_s`,
    holding an adapter; else None (a malformed beat too: it is only a preference)."""
    try:
        if beat.get("model") != model or beat.get("state") != "ready" or now - float(beat["ts"]) > max_age_s:
            return None
        loras = frozenset(json.loads(beat.get("loras") or "[]"))
        return Peer(worker_id, loras, int(beat["max_num_seqs"])) if loras else None
    except (KeyError, ValueError, TypeError):
        return None


class LoraAffinity:
    """Which started jobs go to a peer that holds their adapter, and the moves (intake thread)."""

    def __init__(self, client: redis.Redis, keys: Keys, model: str, worker_id: str, held: Callable[[], list[str]],
                 refresh_s: float, max_age_s: float, on_moved: Callable[[int], None] = lambda n: None) -> None:
        self.client, self.keys, self.model, self.worker_id = client, keys, model, worker_id
        self.held = held  # the adapters this worker's engine holds now (`EngineLoop.loras`)
        self.refresh_s = refresh_s  # the peers' heartbeats are read at most this often
        self.max_age_s = max_age_s  # a heartbeat older than this is a gone worker's
        self.peers: dict[str, Peer] = {}
        self._read_at = float("-inf")  # monotonic time of the last read of the peers
        self.streams = keys.queues(model)  # where a peer's queue entries are pending
        self.on_moved = on_moved  # told how many jobs each `move` handed over (a metric)
        self._hand_off = lua.register(client, lua.HAND_OFF)

    @classmethod
    def for_worker(cls, client: redis.Redis, keys: Keys, settings: WorkerSettings, worker_id: str, loop: EngineLoop,
                   metrics: WorkerMetrics) -> LoraAffinity | None:
        """A worker's, None without LoRA or with FERRY_LORA_AFFINITY=false. A peer's beat counts for
        three heartbeat intervals (at most the heartbeat's TTL)."""
        if not settings.lora_handoffs:
            return None
        return cls(client, keys, settings.served_model_name, worker_id, lambda: loop.loras,
                   refresh_s=settings.heartbeat_interval_s,
                   max_age_s=min(settings.heartbeat_ttl_s, 3 * settings.heartbeat_interval_s),
                   on_moved=metrics.lora_handoffs.labels("sent").inc)

    def choose(self, deliveries: list[tuple[Delivery, str, str | None]]) -> dict[str, str]:
        """Of (delivery, job id, adapter name) started here, the job ids to move, with the peer each
        goes to. Reads the peers' heartbeats when they are older than `refresh_s`."""
        wanted = [(d, job_id, lora) for d, job_id, lora in deliveries
                  if lora is not None and not d.handed and not d.reclaimed]
        if not wanted:
            return {}
        held = set(self.held())
        wanted = [(d, job_id, lora) for d, job_id, lora in wanted if lora not in held]
        if not wanted:
            return {}
        self._refresh()
        holders = {p.worker_id: p for p in self.peers.values() if any(lora in p.loras for _, _, lora in wanted)}
        if not holders:
            return {}
        room = {w: p.max_num_seqs + queue_allowance(p.max_num_seqs) - n
                for w, (p, n) in zip(holders, self._pending(list(holders)), strict=True)}
        moves: dict[str, str] = {}
        for _, job_id, lora in wanted:
            able = [w for w, p in holders.items() if lora in p.loras and room[w] > 0]
            if able:
                peer = max(able, key=room.__getitem__)
                room[peer] -= 1
                moves[job_id] = peer
        return moves

    def move(self, moves: list[tuple[Delivery, str, str]]) -> set[str]:
        """Move each (delivery, job id, peer) to its peer, in one round trip: the job ids now the peers'.
        A job left out stays here: its entry is no longer ours (settled elsewhere), or Redis refused."""
        def build():
            pipe = self.client.pipeline(transaction=False)
            for d, job_id, peer in moves:
                handoff = self.keys.handoff(self.model, self.keys.shard_of(job_id), peer)
                lua.add(pipe, self._hand_off, [d.stream, handoff],
                        [self.keys.group, d.entry_id, self.worker_id, peer, job_id, HANDOFF_TTL_S])
            return pipe

        moved = set()
        for (_, job_id, peer), answer in zip(moves, lua.execute(build, [self._hand_off]) if moves else [], strict=True):
            if answer == 1:
                moved.add(job_id)
                log.info("job handed to the worker holding its LoRA adapter", extra={"job_id": job_id, "peer": peer})
            elif isinstance(answer, Exception):
                log.warning("could not hand a job to the worker holding its LoRA adapter: serving it here",
                            extra={"job_id": job_id, "peer": peer, "error": str(answer)})
        self.on_moved(len(moved))
        return moved

    def _pending(self, workers: list[str]) -> list[tuple[Peer, int]]:
        """(peer, queue entries it holds now) for each of `workers`: XPENDING's per-consumer counts
        over the model's queue streams, in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xpending(stream, self.keys.group)
        held = dict.fromkeys(workers, 0)
        for summary in pipe.execute(raise_on_error=False):
            if isinstance(summary, Exception):
                continue  # a stream without its group (Redis restarted empty): nothing pending there
            for consumer in summary.get("consumers") or []:
                if consumer["name"] in held:
                    held[consumer["name"]] += int(consumer["pending"])
        return [(self.peers[w], held[w]) for w in workers]

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._read_at < self.refresh_s:
            return
        self._read_at = now
        wall = time.time()
        ids = [w for w in self.client.zrangebyscore(self.keys.workers, wall - self.max_age_s, "+inf")
               if w != self.worker_id]
        pipe = self.client.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hgetall(self.keys.worker(worker_id))
        beats = pipe.execute() if ids else []
        peers = (parse_peer(w, beat, self.model, wall, self.max_age_s) for w, beat in zip(ids, beats, strict=True))
        self.peers = {p.worker_id: p for p in peers if p is not None}
