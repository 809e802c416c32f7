"""Workers against a Redis that dies, restarts empty or stalls (real redis-server and worker processes).

Each test starts its own redis-server on a free port, so it can kill it (-9), restart it empty,
or pause it (SIGSTOP), and workers that talk to it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import pytest
import redis

from ferry.worker.protocol import JobRequest, JobState, Keys, enqueue_job
from tests.serve.conftest import (
    REPO,
    enqueue,
    record,
    start_worker,
    wait_for,
    wait_ready,
    wait_terminal,
)

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]


def _readyz(worker) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{worker.http_port}/readyz", timeout=3) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _metric(worker, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.http_port}/metrics", timeout=3) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def test_a_worker_whose_redis_restarts_empty_mid_run_takes_jobs_again(private, llama_dir, tmp_path):
    """More jobs than slots run when Redis is killed and restarted empty: the groups and the
    running jobs' entries are gone. The worker recreates its groups, stops the jobs whose
    records are gone without writing a partial record, and takes new jobs without a restart."""
    prefix = f"ferrytest-{uuid.uuid4().hex[:8]}"
    worker = start_worker(llama_dir, private.url, prefix, tmp_path, FERRY_MAX_NUM_SEQS="2",
                          FERRY_LEASE_S="3", FERRY_HEARTBEAT_INTERVAL_S="0.3")
    client = redis.Redis.from_url(private.url, decode_responses=True)
    keys = Keys(prefix)
    try:
        wait_ready(client, keys, [worker])
        old = [enqueue(client, keys, prompt="fox " * 20, max_tokens=100_000, ignore_eos=True) for _ in range(5)]
        wait_for(lambda: sum(record(client, keys, j).state is JobState.running for j in old) == 2, 30, "2 running")
        private.kill9()
        private.start()
        client = redis.Redis.from_url(private.url, decode_responses=True)
        fresh = enqueue(client, keys, prompt="after the restart", max_tokens=5)
        [rec] = wait_terminal(client, keys, [fresh], timeout=60)
        assert rec.state is JobState.succeeded
        assert worker.proc.poll() is None
        # The lost jobs were stopped, and nothing was written for them: no partial record.
        time.sleep(1.0)
        assert [client.exists(keys.job(j)) for j in old] == [0] * len(old)
        assert [client.exists(keys.events(j)) for j in old] == [0] * len(old)
        wait_for(lambda: _readyz(worker) == 200, 20, "/readyz to be 200 again")
        log = worker.log()
        assert '"redis restarted: recreating consumer groups"' in log or "lost their group" in log
    finally:
        worker.kill9()


def test_readyz_reflects_the_intake_while_redis_stalls(private, llama_dir, tmp_path):
    prefix = f"ferrytest-{uuid.uuid4().hex[:8]}"
    worker = start_worker(llama_dir, private.url, prefix, tmp_path)
    client = redis.Redis.from_url(private.url, decode_responses=True)
    try:
        wait_ready(client, Keys(prefix), [worker])
        wait_for(lambda: _readyz(worker) == 200, 20, "ready")
        private.pause()
        wait_for(lambda: _readyz(worker) == 503, 30, "/readyz to turn 503 while Redis is stalled")
        private.resume()
        wait_for(lambda: _readyz(worker) == 200, 30, "/readyz to be 200 again")
        assert worker.proc.poll() is None
    finally:
        private.resume()
        worker.kill9()


def test_a_job_whose_record_vanished_is_stopped_without_a_partial_record(private, llama_dir, tmp_path):
    """The record of a running job disappears (an eviction, a FLUSHDB): the worker's next write
    finds it gone and writes nothing; before, the terminal write left a half hash behind."""
    prefix = f"ferrytest-{uuid.uuid4().hex[:8]}"
    worker = start_worker(llama_dir, private.url, prefix, tmp_path)
    client = redis.Redis.from_url(private.url, decode_responses=True)
    keys = Keys(prefix)
    try:
        wait_ready(client, keys, [worker])
        job = enqueue(client, keys, prompt="fox " * 10, max_tokens=100_000, ignore_eos=True)
        wait_for(lambda: record(client, keys, job).state is JobState.running, 30, "running")
        client.delete(keys.job(job))
        wait_for(lambda: _metric(worker, "ferry_job_records_lost_total") == 1, 30, "the loss to be counted")
        time.sleep(0.5)
        assert client.exists(keys.job(job)) == 0
        other = enqueue(client, keys, prompt="still serving", max_tokens=4)
        assert wait_terminal(client, keys, [other])[0].state is JobState.succeeded
    finally:
        worker.kill9()


def test_a_bad_job_fails_alone_and_a_neighbour_in_the_batch_finishes(private, llama_dir, tmp_path):
    """A job whose stop ids are beyond the vocabulary (bypassing the API) fails with a stable
    code; a job running beside it is not touched."""
    prefix = f"ferrytest-{uuid.uuid4().hex[:8]}"
    worker = start_worker(llama_dir, private.url, prefix, tmp_path)
    client = redis.Redis.from_url(private.url, decode_responses=True)
    keys = Keys(prefix)
    try:
        wait_ready(client, keys, [worker])
        good = enqueue(client, keys, prompt="fox " * 10, max_tokens=40, ignore_eos=True)
        bad = enqueue_job(client, keys, JobRequest(model="tiny", prompt="fox", max_tokens=8, min_tokens=4,
                                                   stop_token_ids=[10**9])).job_id
        good_rec, bad_rec = wait_terminal(client, keys, [good, bad])
        assert good_rec.state is JobState.succeeded and len(good_rec.token_ids) == 40
        assert bad_rec.state is JobState.failed and bad_rec.error_code == "invalid_sampling_params"
        assert "stop_token_ids" in bad_rec.error_message
    finally:
        worker.kill9()


def test_a_crashed_thread_takes_the_process_down_with_a_non_zero_exit():
    """The crash handler logs and exits 70 (it used to fail on a reserved log field and leave the
    process up, heartbeating but taking no job)."""
    code = (
        "import threading\n"
        "from worker.serve import jsonlog\n"
        "from worker.serve.main import Worker\n"
        "from worker.serve.settings import WorkerSettings\n"
        "worker = Worker(WorkerSettings(redis_url='redis://127.0.0.1:1/0'))\n"
        "jsonlog.configure('crash-test')\n"
        "threading.excepthook = worker._thread_crashed\n"
        "t = threading.Thread(target=lambda: 1 / 0, name='intake')\n"
        "t.start(); t.join()\n"
        "import time; time.sleep(5)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 70, done.stderr
    line = json.loads(next(ln for ln in done.stderr.splitlines() if '"thread crashed' in ln))
    assert line["thread_name"] == "intake" and "ZeroDivisionError" in line["exc"]


def test_chaos_redis_restarts_empty_under_80_jobs(private, llama_dir, tmp_path):
    """80 jobs through the API, two workers; Redis is killed and restarted empty while they run.
    Afterwards the workers take new jobs without a restart, and every one of the 80 jobs the API
    accepted has a definite answer: succeeded, or the stable `job_state_lost` (never a 500, never
    an unknown job)."""
    from fastapi.testclient import TestClient

    from ferry.api.main import create_app
    from ferry.api.settings import ApiSettings

    prefix = f"ferrytest-{uuid.uuid4().hex[:8]}"
    workers = [start_worker(llama_dir, private.url, prefix, tmp_path, FERRY_LEASE_S="3",
                            FERRY_HEARTBEAT_INTERVAL_S="0.3") for _ in range(2)]
    client = redis.Redis.from_url(private.url, decode_responses=True)
    keys = Keys(prefix)
    settings = ApiSettings(redis_url=private.url, key_prefix=prefix, models="tiny")
    try:
        wait_ready(client, keys, workers)
        with TestClient(create_app(settings), raise_server_exceptions=False) as api:
            accepted = []
            for i in range(80):
                r = api.post("/v1/jobs", json={"input": {"prompt": f"job {i} " * 8, "max_tokens": 24,
                                                         "temperature": 0, "ignore_eos": True}})
                assert r.status_code == 202, r.text
                accepted.append(r.json()["id"])
            time.sleep(2.0)  # the restart must be clearly after every job (Redis reports its start to the second)
            private.kill9()
            private.start()
            client = redis.Redis.from_url(private.url, decode_responses=True)

            def answered(job_id: str):
                r = api.get(f"/v1/jobs/{job_id}")
                if r.status_code == 503:
                    return None  # the API's pool reconnecting: ask again
                assert r.status_code != 500, r.text
                return r

            for job_id in accepted:
                r = wait_for(lambda j=job_id: answered(j), 30, "an answer about an accepted job")
                if r.status_code == 200:
                    assert r.json()["status"] in ("queued", "running", "succeeded"), r.text
                else:
                    assert (r.status_code, r.json()["error"]["code"]) == (404, "job_state_lost"), r.text
            fresh = [api.post("/v1/jobs", json={"input": {"prompt": "after", "max_tokens": 4}}).json()["id"]
                     for _ in range(4)]

            def done(job_id: str) -> bool:
                r = api.get(f"/v1/jobs/{job_id}")
                return r.status_code == 200 and r.json()["status"] == "succeeded"

            for job_id in fresh:
                wait_for(lambda j=job_id: done(j), 90, "new jobs to succeed after the restart")
        assert all(w.proc.poll() is None for w in workers)
    finally:
        for w in workers:
            w.kill9()
