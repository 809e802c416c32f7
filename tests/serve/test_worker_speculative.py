"""A worker configured for speculative decoding (FERRY_SPECULATIVE_*), as a real subprocess:
the streamed tokens are the greedy ones, several arrive per event, and /metrics counts the
verifications as soon as the job is seen finished."""

from __future__ import annotations

import urllib.request

import pytest
import redis

from ferry.worker.engine import LLM, SamplingParams
from ferry.worker.protocol import JobState, Keys
from tests.serve.conftest import (
    RedisServer,
    assert_seq,
    enqueue,
    events,
    start_worker,
    streamed_text,
    streamed_tokens,
    wait_ready,
    wait_terminal,
)

pytestmark = pytest.mark.redis

PREFIX = "ferrytest-spec-worker"
PROMPTS = ["Ferry serves language models", "def fibonacci(n):", "a"]


@pytest.fixture(scope="module")
def spec_worker(tmp_path_factory, llama_dir):
    directory = tmp_path_factory.mktemp("spec-worker")
    server = RedisServer(directory)
    server.start()
    # The target as its own draft: every greedy proposal is accepted, so each verification
    # emits k + 1 tokens and the counters below are known exactly.
    worker = start_worker(llama_dir, server.url, PREFIX, directory, FERRY_SPECULATIVE_METHOD="draft",
                          FERRY_SPECULATIVE_DRAFT_MODEL=str(llama_dir), FERRY_SPECULATIVE_NUM_SPECULATIVE_TOKENS=3,
                          FERRY_SPECULATIVE_MEASURE_SPEEDUP="false")
    client = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        wait_ready(client, Keys(PREFIX), [worker])
        yield client, worker
    finally:
        worker.proc.kill()
        worker.proc.wait(10)
        server.stop()


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    return {
        name: float(value)
        for name, value in (line.rsplit(" ", 1) for line in lines if line.startswith("ferry_spec_decode"))
    }


def test_speculating_worker_streams_the_greedy_tokens_and_counts_verifications(spec_worker, llama_dir):
    client, worker = spec_worker
    keys = Keys(PREFIX)
    ids = [enqueue(client, keys, prompt=p, max_tokens=17) for p in PROMPTS]
    records = wait_terminal(client, keys, ids)
    metrics = _metrics(worker.http_port)  # no wait: a job's end refreshes the engine's figures first
    reference = LLM(str(llama_dir)).generate(PROMPTS, SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True),
                                             use_tqdm=False)
    for job_id, rec, ref in zip(ids, records, reference, strict=True):
        evs = events(client, keys, job_id)
        assert_seq(evs)
        assert rec.state is JobState.succeeded and rec.token_ids == ref.token_ids and rec.text == ref.text
        assert streamed_tokens(evs) == ref.token_ids and streamed_text(evs) == ref.text
        tokens_per_event = [len(e.token_ids) for e in evs if e.type == "token"]
        assert max(tokens_per_event) == 4  # k + 1 accepted at once
    # 17 tokens: the prompt's step gives 1, then verifications give 4, 4, 4, 4 (all accepted).
    assert metrics["ferry_spec_decode_num_drafts_total"] == 4 * len(PROMPTS)
    assert (
        metrics["ferry_spec_decode_num_draft_tokens_total"]
        == metrics["ferry_spec_decode_num_accepted_tokens_total"]
        == 12 * len(PROMPTS)
    )
    assert (
        metrics["ferry_spec_decode_acceptance_rate"] == 1.0 and metrics["ferry_spec_decode_mean_accepted_length"] == 4.0
    )
    assert metrics['ferry_spec_decode_num_accepted_tokens_per_pos_total{position="2"}'] == 4 * len(PROMPTS)
