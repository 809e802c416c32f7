"""An idle worker waits on every queue shard at once.

A blocking XREADGROUP names streams of one hash slot, so one read cannot wait on all of a model's
shards when they live on different primaries. Blocking on one shard at a time, in turn, leaves a
job in another shard waiting for its turn (up to block_ms / N, ~166 ms at the 500 ms default and
3 shards): that is TTFT. `ShardWatch` keeps one blocked read per shard in flight instead, each on
a thread of its own (the client is thread-safe; each blocked read holds its own connection), and
wakes the intake as soon as any of them delivers.

A read outlives the `wait` that started it: the intake stops waiting to renew leases or reap,
and the read stays blocked for the next wait. Each read claims at most one entry (count=1), so
`in_flight` is the room the reads may still take; the consumer keeps that much room back from
everything else it reads. What a read delivers after the intake stopped caring (a drain) comes
back from `settle`, for the worker to hand back.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from ferry.worker.serve.writes import Delivery

ReadShard = Callable[[int, int, int], list[Delivery]]  # (shard, lanes, block_ms) -> at most one delivery


class ShardWatch:
    """At most one blocked read per shard; `wait` returns whatever finished reads delivered."""

    def __init__(self, shards: int, read_shard: ReadShard) -> None:
        self.shards = shards
        self._read_shard = read_shard
        self._reads: dict[int, Future[list[Delivery]]] = {}  # shard -> its blocked read
        self._delivered: list[Delivery] = []  # collected, not yet handed to the caller (a read failed)
        self._next_shard = 0  # the shard armed first when room allows fewer reads than shards
        self._pool = ThreadPoolExecutor(max_workers=shards, thread_name_prefix="shard-watch")

    @property
    def in_flight(self) -> int:
        """Entries the reads may still claim: one per read not yet collected."""
        return len(self._reads)

    def collect(self) -> list[Delivery]:
        """What the reads that have finished delivered (no waiting). A read that failed (Redis
        unreachable) raises here, once; what the others delivered comes with the next call, and
        the failed read's shard gets a new read at the next `wait`."""
        failure: BaseException | None = None
        for shard, read in list(self._reads.items()):
            if not read.done():
                continue
            del self._reads[shard]
            if read.exception() is not None:
                failure = failure or read.exception()
            else:
                self._delivered += read.result()
        if failure is not None:
            raise failure
        out, self._delivered = self._delivered, []
        return out

    def wait(self, lanes: int, block_ms: int, room: int) -> list[Delivery]:
        """Start a read (of the first `lanes` priorities) on each shard without one, at most `room`
        new ones (the room left besides the reads already in flight); then wait up to `block_ms`
        until any read finishes. Returns what finished reads delivered (often nothing: a read
        timed out)."""
        started = 0
        for i in range(self.shards):
            shard = (self._next_shard + i) % self.shards
            if started >= room:
                break
            if shard not in self._reads:
                self._reads[shard] = self._pool.submit(self._read_shard, shard, lanes, block_ms)
                started += 1
        self._next_shard = (self._next_shard + 1) % self.shards
        if self._reads:
            wait(list(self._reads.values()), timeout=block_ms / 1000, return_when=FIRST_COMPLETED)
        return self.collect()

    def settle(self, timeout_s: float) -> list[Delivery]:
        """Wait up to `timeout_s` for the reads in flight to end; what they claimed (the caller hands it back)."""
        if self._reads:
            wait(list(self._reads.values()), timeout=timeout_s)
        try:
            return self.collect()
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)
