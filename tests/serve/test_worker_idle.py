"""Scale to zero: a worker serves what is queued, exits 0 after `idle_timeout_s`, and snapshots on the way out.

Runs `Worker.run()` in this process (the engine loads in a second here; a subprocess would
spend most of this test importing torch).
"""

from __future__ import annotations

import signal
import threading
import time
import uuid

import pytest
import redis

from ferry.worker.protocol import JobState, Keys
from ferry.worker.serve.main import Worker
from ferry.worker.serve.settings import WorkerSettings
from tests.serve.conftest import enqueue, record

pytestmark = pytest.mark.redis


@pytest.fixture
def restore_process_hooks():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    hook = threading.excepthook
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    threading.excepthook = hook


def test_idle_worker_exits_zero_and_saves_a_snapshot(llama_dir, tmp_path, restore_process_hooks):
    prefix = f"ferrytest-{uuid.uuid4().hex}"
    client = redis.Redis(decode_responses=True)
    keys = Keys(prefix)
    # idle_timeout_s: 2 s, so that on a loaded machine the queued job is surely read before the
    # worker counts itself idle (1 s failed once when this machine ran 2.4x slower).
    settings = WorkerSettings(
        key_prefix=prefix, model_name="tiny", worker_id="idle-1", metrics_port=0,
        engine={"model": str(llama_dir), "kv_cache_bytes": 16 << 20, "max_num_seqs": 4},
        metrics_host="127.0.0.1", idle_timeout_s=2.0,
        snapshot_url=f"file://{tmp_path}/snap", heartbeat_interval_s=0.2,
    )
    try:
        job_id = enqueue(client, keys, prompt="The quick brown fox jumps over the lazy dog " * 3, max_tokens=4)
        started = time.monotonic()
        assert Worker(settings).run() == 0
        assert time.monotonic() - started < 60
        assert record(client, keys, job_id).state is JobState.succeeded
        assert client.exists(keys.worker("idle-1")) == 0 and client.zscore(keys.workers, "idle-1") is None
        assert (tmp_path / "snap" / "latest.json").is_file()
    finally:
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)
        client.close()
