"""A worker at FERRY_TENSOR_PARALLEL_SIZE=2 whose rank process is killed mid-generation hands
its jobs back and exits non-zero; a second worker finishes them with no gap and no duplicate."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import redis

from ferry.worker.engine import LLM, SamplingParams
from ferry.worker.protocol import JobState, Keys
from ferry.worker.serve.main import EXIT_ENGINE_FAILED
from tests.serve.conftest import (
    RedisServer,
    assert_seq,
    enqueue,
    events,
    record,
    start_worker,
    streamed_tokens,
    wait_for,
    wait_ready,
    wait_terminal,
)

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]

PREFIX = "ferrytest-tp"


def _rank_pids(worker_pid: int) -> list[int]:
    """The worker's spawned rank processes (not multiprocessing's resource tracker)."""
    pids = []
    for task in Path(f"/proc/{worker_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                pids.append(int(child))
    return pids


def test_a_killed_rank_hands_the_jobs_back_and_the_worker_exits(tmp_path, llama_dir):
    server = RedisServer(tmp_path)
    server.start()
    client = redis.Redis.from_url(server.url, decode_responses=True)
    keys = Keys(PREFIX)
    victim = start_worker(llama_dir, server.url, PREFIX, tmp_path, FERRY_TENSOR_PARALLEL_SIZE=2)
    survivor = None
    try:
        wait_ready(client, keys, [victim])
        prompts = [f"rank {i}: the quick brown fox" for i in range(4)]
        ids = [enqueue(client, keys, prompt=p, max_tokens=150) for p in prompts]

        def mid_generation():
            return all(record(client, keys, j).state is JobState.running for j in ids) and all(
                len(events(client, keys, j)) >= 4 for j in ids)

        wait_for(mid_generation, 60, "the jobs to stream on the tensor-parallel worker", interval=0.02)
        [rank] = _rank_pids(victim.proc.pid)
        os.kill(rank, signal.SIGKILL)
        assert victim.proc.wait(60) == EXIT_ENGINE_FAILED
        log = victim.log()
        assert '"tensor-parallel rank failed: handing every job back"' in log and '"job handed back"' in log
        assert all(record(client, keys, j).state is JobState.queued or record(client, keys, j).terminal for j in ids)

        survivor = start_worker(llama_dir, server.url, PREFIX, tmp_path)
        recs = wait_terminal(client, keys, ids, timeout=120)
        params = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
        refs = LLM(str(llama_dir), kv_cache_bytes=16 << 20).generate(prompts, params, use_tqdm=False)
        for job_id, rec, ref in zip(ids, recs, refs, strict=True):
            evs = events(client, keys, job_id)
            assert_seq(evs)
            assert rec.state is JobState.succeeded and streamed_tokens(evs) == ref.token_ids
            assert rec.worker_id == survivor.worker_id and rec.attempts == 1  # a hand-back is no failed attempt
    finally:
        for w in (victim, survivor):
            if w is not None and w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait(10)
        client.close()
        server.stop()
