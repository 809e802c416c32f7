"""`ferry api` and `ferry worker` as real processes on a real Redis Cluster, every 202 replicated.

FERRY_REDIS_MIN_REPLICAS=1: each accepted job is on its shard's primary and its replica. The
failover test, last, kills the primary of shard 0 while jobs stream through the API: requests
in the window are answered 503 with Retry-After (the store is unreachable, or a job could not be
replicated), never 500, and the API recovers by itself once the killed node is back as a replica.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from ferry.worker.protocol import Keys
from tests.api.conftest import Proc, free_port, stack_env, wait_until
from tests.api.test_jobs import all_events, sse_events, submit, wait_done
from tests.cluster.conftest import SHARDS

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def capi(local_cluster, llama_dir, tmp_path_factory):
    local_cluster.restart_dead()
    logs = tmp_path_factory.mktemp("cluster-api")
    keys = Keys("ferrytest-capi", SHARDS)
    port = free_port()
    env = stack_env(keys.prefix, llama_dir, FERRY_REDIS_URL=local_cluster.url, FERRY_REDIS_CLUSTER="true",
                    FERRY_QUEUE_SHARDS=str(SHARDS), FERRY_REDIS_MIN_REPLICAS="1", FERRY_LEASE_S="3",
                    FERRY_MAX_NUM_SEQS="8")
    procs = [Proc("worker", ["worker"], env, logs), Proc("api", ["api", "--host", "127.0.0.1", "--port", str(port)],
                                                          env, logs)]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(url + "/readyz").status_code == 200, 120, "the stack", procs)
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client, keys, procs
    finally:
        for proc in procs:
            proc.stop()


def test_a_job_is_accepted_in_its_shard_and_streams_every_event(capi):
    api, keys, _ = capi
    jobs = []
    while {keys.shard_of(j["id"]) for j in jobs} != set(range(SHARDS)):  # shards are drawn at random
        assert len(jobs) < 40
        jobs.append(submit(api, max_tokens=10))
    for created in jobs:
        events = all_events(api, created["id"])  # live from the start: SSUBSCRIBE, then the stream
        assert [e["data"]["seq"] for e in events] == list(range(len(events)))
        assert events[-1]["event"] == "completed"
        job = wait_done(api, created["id"])
        assert "".join(e["data"]["text"] for e in events if e["event"] == "token") == job["output"]["text"]


def test_last_event_id_resumes_mid_run_with_nothing_lost_or_repeated(capi):
    api, _, _ = capi
    job_id = submit(api, max_tokens=120, ignore_eos=True)["id"]
    with api.stream("GET", f"/v1/jobs/{job_id}/events") as r:
        first = sse_events(r, limit=5)
    rest = all_events(api, job_id, int(first[-1]["id"]))
    seqs = [e["data"]["seq"] for e in first + rest]
    assert seqs == list(range(len(seqs))) and rest[-1]["event"] == "completed"


def test_idempotency_key_answers_the_same_job_on_a_cluster(capi):
    api, _, _ = capi
    body = {"input": {"prompt": "idempotent", "max_tokens": 4, "temperature": 0}}
    first = api.post("/v1/jobs", json=body, headers={"Idempotency-Key": "cluster-k1"})
    again = api.post("/v1/jobs", json=body, headers={"Idempotency-Key": "cluster-k1"})
    assert first.status_code == 202 and again.status_code in (200, 202)
    assert again.json()["id"] == first.json()["id"]


def test_cancel_a_running_job_through_the_api(capi):
    api, _, _ = capi
    job_id = submit(api, max_tokens=1000, ignore_eos=True)["id"]
    with api.stream("GET", f"/v1/jobs/{job_id}/events") as r:
        sse_events(r, limit=3)
    assert api.post(f"/v1/jobs/{job_id}/cancel").status_code in (200, 202)
    assert wait_done(api, job_id)["status"] == "cancelled"


def test_failover_gives_503_not_500_and_every_accepted_job_completes(capi, local_cluster):
    api, keys, procs = capi
    accepted = [submit(api, max_tokens=200, ignore_eos=True)["id"] for _ in range(20)]
    statuses: list[int] = []
    stop = threading.Event()

    def keep_submitting():
        with httpx.Client(base_url=str(api.base_url), timeout=30) as client:
            while not stop.is_set():
                r = client.post("/v1/jobs", json={"input": {"prompt": "during", "max_tokens": 4}})
                statuses.append(r.status_code)
                if r.status_code == 202:
                    accepted.append(r.json()["id"])
                else:
                    assert r.status_code == 503 and r.headers.get("Retry-After"), r.text
                time.sleep(0.05)

    submitter = threading.Thread(target=keep_submitting)
    submitter.start()
    try:
        time.sleep(0.5)
        local_cluster.kill_primary_for_slot(keys.shard_slot(0))
        local_cluster.wait_healthy()
        local_cluster.restart_dead()  # shard 0 has a replica again: its enqueues are acknowledged again
        time.sleep(2.0)
    finally:
        stop.set()
        submitter.join(30)
    assert 500 not in statuses and 503 in statuses, statuses
    assert statuses[-5:] == [202] * 5  # recovered by itself
    for job_id in accepted:
        try:
            job = wait_done(api, job_id, timeout=120)
        except TimeoutError as exc:
            for proc in procs:
                proc.check_alive()  # a worker that crashed says why
            raise AssertionError(f"{exc}\nworker log:\n{procs[0].log()[-6000:]}") from exc
        assert job["status"] == "succeeded", job
        events = all_events(api, job_id)
        assert [e["data"]["seq"] for e in events] == list(range(len(events)))  # none lost, none twice
    for proc in procs:
        proc.check_alive()
