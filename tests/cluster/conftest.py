"""A real Redis Cluster for the cluster tests: 3 primaries + 3 replicas on loopback, once per session.

A test that kills a primary (failover) leaves the cluster one replica short; `cluster` restarts
the killed nodes (they rejoin as replicas) and waits until it is healthy before handing it to
the next test, and each test works under a key prefix of its own.
"""

from __future__ import annotations

import shutil
import uuid

import pytest

from ferry.worker.common.connect import connect
from ferry.worker.protocol import Keys
from ferry.worker.tools.local_cluster import LocalCluster

SHARDS = 3

pytestmark = pytest.mark.redis


@pytest.fixture(scope="session")
def local_cluster():
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server and redis-cli are needed for a local cluster")
    cluster = LocalCluster().start()
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster(local_cluster):
    local_cluster.restart_dead()
    return local_cluster


@pytest.fixture
def ckeys() -> Keys:
    return Keys(f"ferrytest-{uuid.uuid4().hex[:12]}", SHARDS)


@pytest.fixture
def cclient(cluster):
    client = connect(cluster.url, cluster=True, decode_responses=True)
    yield client
    client.close()
