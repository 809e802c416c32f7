"""What bench.redis_capacity (one node) and bench.redis_cluster (shards, added TTFT) both run: a
private `redis-server`, the token path's script as the publisher runs it, and the command line of
`redis-benchmark` (the C client), pipelined like the publisher.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import redis

CONNECTIONS, PIPELINE = 16, 16  # redis-benchmark's -c and -P; it sends exactly -n requests when P divides n
BENCH_KEYS = 1000  # job hashes the benchmark's random key names fall on (`__rand_int__`: 12 digits)

# The token path's server work per event, as lua.EMIT does it on its common path: one script call
# that checks the job hash, appends to the job's event stream and publishes on its channel.
# JOB_PUBLISH stands for the publish command (`emit_like`): PUBLISH on a node, SPUBLISH on a cluster.
_EMIT_LIKE = """
if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', '1000', '*', 'seq', '1', 'type', 'token', 'data', ARGV[1])
redis.call('JOB_PUBLISH', KEYS[2], ARGV[1])
return 1
"""


def emit_like(publish: str) -> str:
    """The token path's script, publishing with `publish` (PUBLISH or SPUBLISH)."""
    return _EMIT_LIKE.replace("JOB_PUBLISH", publish)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(directory: Path) -> tuple[subprocess.Popen, int]:
    """A private redis-server without persistence: its counters hold this benchmark's commands only."""
    port = _free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(directory)], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            return proc, port
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def benchmark_argv(port: int, requests: int, command: list[str], keyspace: int = BENCH_KEYS) -> list[str]:
    """redis-benchmark sending `command` `requests` times over 16 connections, pipelined 16 deep,
    each `__rand_int__` in it drawn from [0, keyspace); CSV out: a header row, then "test","rps",..."""
    return ["redis-benchmark", "-p", str(port), "-n", str(requests), "-c", str(CONNECTIONS), "-P", str(PIPELINE),
            "-r", str(keyspace), "--csv", *command]
