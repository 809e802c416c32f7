"""A Redis Cluster on loopback for tests and benchmarks: 3 primaries + 3 replicas, no persistence.

`LocalCluster().start()` launches six `redis-server --cluster-enabled yes` on free ports (a low
`cluster-node-timeout`, so a failover takes a second or two, not fifteen), joins them with
`redis-cli --cluster create --cluster-replicas 1`, and waits until every node reports
`cluster_state:ok`. `kill_primary_for_slot` kills -9 the primary owning a slot (its replica is
promoted); `wait_healthy` waits until every slot is served again; `restart_dead` brings the
killed nodes back as replicas. `stop` kills every node and
removes their files.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis

MAX_PORT = 55535  # a node's cluster bus listens on port + 10000, which must stay a valid port
NODE_TIMEOUT_MS = 1000


@dataclass(slots=True)
class Node:
    port: int
    proc: subprocess.Popen

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class LocalCluster:
    """Six loopback nodes in one cluster; `url` is the first node's address (any node would do)."""

    def __init__(self, primaries: int = 3, replicas: int = 1, directory: Path | None = None) -> None:
        self.primaries = primaries
        self.replicas = replicas
        self._own_dir = directory is None
        self.directory = directory or Path(tempfile.mkdtemp(prefix="ferry-cluster-"))
        self.nodes: list[Node] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    @property
    def urls(self) -> list[str]:
        return [f"redis://127.0.0.1:{n.port}" for n in self.nodes if n.alive]

    def start(self, timeout: float = 30.0) -> LocalCluster:
        for port in _free_ports(self.primaries * (1 + self.replicas)):
            self.nodes.append(Node(port, self._launch(port)))
        for node in self.nodes:
            _wait(lambda n=node: _ping(n.port), timeout, f"redis-server on port {node.port}")
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
             "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout,
        )
        self.wait_healthy(timeout)
        return self

    def _launch(self, port: int) -> subprocess.Popen:
        node_dir = self.directory / str(port)
        node_dir.mkdir(parents=True, exist_ok=True)
        return subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--cluster-config-file", "nodes.conf",
             "--save", "", "--appendonly", "no", "--dir", str(node_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

    def restart_dead(self, timeout: float = 30.0) -> None:
        """Start every killed node again: it rejoins from its nodes.conf, empty, as a replica of the
        primary that took over its slots, and syncs; then wait until the cluster is healthy."""
        for node in self.nodes:
            if not node.alive:
                node.proc = self._launch(node.port)
        self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Until every live node says `cluster_state:ok`, every replica is in sync with its primary,
        and every slot's owner is a live primary."""
        _wait(self._healthy, timeout, "the cluster to be healthy")

    def _healthy(self) -> bool:
        live = [n for n in self.nodes if n.alive]
        if not all(_cluster_info(n.port).get("cluster_state") == "ok" and _replica_synced(n.port) for n in live):
            return False
        ports = {n.port for n in live}
        return all(self.primary_for_slot(slot) in ports for slot in (0, 5461, 10923, 16383))

    def primary_for_slot(self, slot: int) -> int | None:
        """The port of the primary that a live node says owns `slot`."""
        for node in self.nodes:
            if not node.alive:
                continue
            try:
                with redis.Redis(port=node.port, socket_timeout=1.0) as client:
                    ranges = client.execute_command("CLUSTER", "SLOTS")
            except redis.RedisError:
                continue
            for start, end, primary, *_ in ranges:
                if start <= slot <= end:
                    return int(primary[1])
        return None

    def replicas_of(self, port: int) -> list[int]:
        with redis.Redis(port=port, socket_timeout=1.0, decode_responses=True) as client:
            info = client.info("replication")
        return [int(info[k]["port"]) for k in info if k.startswith("slave") and isinstance(info[k], dict)]

    def kill_primary_for_slot(self, slot: int) -> int:
        """kill -9 the primary that owns `slot`; returns its port. Its replica takes over within
        about two node timeouts (`wait_healthy` waits for that)."""
        port = self.primary_for_slot(slot)
        if port is None:
            raise RuntimeError(f"no live primary owns slot {slot}")
        node = next(n for n in self.nodes if n.port == port)
        node.proc.kill()
        node.proc.wait(10)
        return port

    def stop(self) -> None:
        for node in self.nodes:
            if node.alive:
                node.proc.kill()
                node.proc.wait(10)
        self.nodes.clear()
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _free_ports(n: int) -> list[int]:
    """`n` ports free on loopback whose cluster bus port (+10000) is free too."""
    ports: list[int] = []
    while len(ports) < n:
        port = random.randint(20000, MAX_PORT)
        if port not in ports and _free(port) and _free(port + 10000):
            ports.append(port)
    return ports


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ping(port: int) -> bool:
    try:
        with redis.Redis(port=port, socket_timeout=1.0) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


def _replica_synced(port: int) -> bool:
    """A primary, or a replica whose link to its primary is up (only a synced replica can take over)."""
    try:
        with redis.Redis(port=port, socket_timeout=1.0, decode_responses=True) as client:
            info = client.info("replication")
    except redis.RedisError:
        return False
    return info.get("role") == "master" or info.get("master_link_status") == "up"


def _cluster_info(port: int) -> dict[str, str]:
    try:
        with redis.Redis(port=port, socket_timeout=1.0, decode_responses=True) as client:
            raw = client.execute_command("CLUSTER", "INFO")
    except redis.RedisError:
        return {}
    if isinstance(raw, dict):
        return {str(k): str(v) for k, v in raw.items()}
    return dict(line.split(":", 1) for line in str(raw).splitlines() if ":" in line)


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
