"""How every Ferry process reaches Redis: one node, or a Redis Cluster (`FERRY_REDIS_CLUSTER=true`).

The settings every process shares (whether `FERRY_REDIS_URL` is a cluster node, the queue shards
per model, how many replicas must hold an acknowledged write) are in `worker.common.settings`.
`connect` and `connect_async` build the client: `redis.Redis` / `redis.asyncio.Redis` for one node, or
`RedisCluster` and its asyncio twin, seeded from the one node named, which follow MOVED/ASK and
retry a command with jittered exponential backoff while a primary fails over (connection errors,
CLUSTERDOWN, TRYAGAIN, a slot briefly uncovered).

`wait_replicated` / `ReplicationWaiter`: acknowledged means replicated. WAIT counts the replicas
that have every write its own connection sent, so it follows, on one connection to the primary
that owns the slot, a write of a marker key in that slot (`Keys.ack`): a replica holding the
marker holds everything the primary wrote before it, the enqueue or the terminal write included.
A slot that moved meanwhile (a failover) answers MOVED: not replicated, as far as the caller knows.

`UNAVAILABLE` lists the errors that mean "Redis is not there right now" (a restart, a failover,
the network), as opposed to "this command is wrong": a process retries them, and the API
answers them with 503 + Retry-After.
"""

from __future__ import annotations

import inspect

import redis
import redis.asyncio as aredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    MasterDownError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.retry import Retry

# What a caller retries (the worker) or answers with 503 (the API): the store is away for now. On a
# cluster a failover can also end a command's own retries with a redirection it could not follow
# (AskError, MovedError: the slot map was stale every time) or "TTL exhausted" (ClusterError): the
# same outage, never a reason to crash a worker or answer 500.
UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, redis.ReadOnlyError,
               ClusterDownError, TryAgainError, SlotNotCoveredError, MasterDownError, ClusterError, AskError)

_RETRIES = 6  # per command; with the backoff below, about 3 s: a failover with a 1-2 s node timeout fits
_BACKOFF_BASE_S, _BACKOFF_CAP_S = 0.05, 1.0


def _retry() -> Retry:
    return Retry(ExponentialWithJitterBackoff(base=_BACKOFF_BASE_S, cap=_BACKOFF_CAP_S), _RETRIES)


def connect(url: str, *, cluster: bool, **kwargs) -> redis.Redis | RedisCluster:
    """A sync client for `url` (`kwargs`: redis-py's connection options)."""
    if cluster:
        return RedisCluster.from_url(url, retry=_retry(), **kwargs)
    return redis.Redis.from_url(url, **kwargs)


def connect_async(url: str, *, cluster: bool, max_connections: int, pool_timeout_s: float,
                  **kwargs) -> aredis.Redis | AsyncRedisCluster:
    """An asyncio client for `url`. On one node, a blocking pool: under a burst, requests queue for
    a connection (up to `pool_timeout_s`) instead of failing; on a cluster, a pool per node."""
    if cluster:
        return AsyncRedisCluster.from_url(url, retry=_retry(), max_connections=max_connections, **kwargs)
    pool = aredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=pool_timeout_s,
                                                  **kwargs)
    return aredis.Redis.from_pool(pool)


def is_cluster(client) -> bool:
    return isinstance(client, RedisCluster | AsyncRedisCluster)


_MARKER_TTL_MS = 60_000


def wait_replicated(client: redis.Redis | RedisCluster, marker: str, replicas: int, timeout_ms: int) -> int:
    """Replicas (of the primary owning `marker`'s slot) that hold every write made there so far
    (waits up to `timeout_ms` for `replicas` of them)."""
    node_client = client.get_node_from_key(marker).redis_connection if is_cluster(client) else client
    pipe = node_client.pipeline(transaction=False)  # one connection: the WAIT covers the marker's write
    pipe.set(marker, "1", px=_MARKER_TTL_MS)
    pipe.execute_command("WAIT", replicas, timeout_ms)
    return int(pipe.execute()[1])


def _direct_kwargs(client: aredis.Redis | AsyncRedisCluster, timeout_ms: int) -> dict:
    """The client's connection options (credentials, TLS, timeouts) for a client of one node, its
    read timeout past the WAIT's."""
    kwargs = client.get_connection_kwargs() if is_cluster(client) else client.connection_pool.connection_kwargs
    accepted = inspect.signature(aredis.Redis.__init__).parameters
    out = {k: v for k, v in kwargs.items() if k in accepted and k not in ("host", "port", "connection_class",
                                                                          "max_connections", "response_callbacks")}
    if issubclass(kwargs.get("connection_class") or aredis.Connection, aredis.SSLConnection):
        out["ssl"] = True
    out["socket_timeout"] = max(out.get("socket_timeout") or 0, timeout_ms / 1000 + 1.0)
    return out


class ReplicationWaiter:
    """`wait_replicated` for an asyncio client, through one direct client per primary (WAIT blocks
    its connection for up to the timeout: not one of the shared pool's)."""

    def __init__(self, client: aredis.Redis | AsyncRedisCluster, replicas: int, timeout_ms: int) -> None:
        self.client = client
        self.replicas = replicas
        self.timeout_ms = timeout_ms
        self._nodes: dict[tuple[str, int], aredis.Redis] = {}

    async def wait(self, marker: str) -> int:
        """Replicas holding every write made so far on the primary owning `marker`'s slot (waits up
        to the timeout for `replicas` of them)."""
        if is_cluster(self.client):
            await self.client.initialize()  # a no-op once the slot map is known
            node = self.client.get_node_from_key(marker)
            address = (node.host, node.port)
        else:
            kwargs = self.client.connection_pool.connection_kwargs
            address = (kwargs.get("host", "localhost"), kwargs.get("port", 6379))
        direct = self._nodes.get(address)
        if direct is None:
            direct = self._nodes[address] = aredis.Redis(host=address[0], port=address[1],
                                                         **_direct_kwargs(self.client, self.timeout_ms))
        pipe = direct.pipeline(transaction=False)
        pipe.set(marker, "1", px=_MARKER_TTL_MS)
        pipe.execute_command("WAIT", self.replicas, self.timeout_ms)
        return int((await pipe.execute())[1])

    async def aclose(self) -> None:
        for direct in self._nodes.values():
            await direct.aclose()
