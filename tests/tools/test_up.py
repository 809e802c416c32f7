"""`ferry up` as a user runs it: a real subprocess that starts and stops real processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import redis

from tests.api.conftest import delete_prefix, free_port, new_prefix
from tests.conftest import MODEL_CACHE_DIR

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(300)]


def up_env(tmp_path, prefix: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    env.update(
        FERRY_KEY_PREFIX=prefix,
        FERRY_MODEL_CACHE_DIR=str(MODEL_CACHE_DIR),  # SmolLM2's conversion, shared by the test run
        FERRY_STATE_DIR=str(tmp_path / "state"),
        FERRY_PORT=str(free_port()),
        FERRY_METRICS_PORT="0",
        FERRY_WEBHOOK_METRICS_PORT="0",
        FERRY_TORCH_THREADS="1",
        OMP_NUM_THREADS="1",
        FERRY_HEARTBEAT_INTERVAL_S="0.5",
    )
    env.update(extra)
    return env


def pids_started(output: str) -> dict[str, int]:
    return {name: int(pid) for name, pid in re.findall(r"started (\w+) \(pid (\d+)\)", output)}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_demo_answers_questions_with_the_default_model_and_stops_cleanly(tmp_path):
    """No FERRY_MODEL: SmolLM2-135M-Instruct from the wheel answers through the chat API."""
    prefix = new_prefix()
    try:
        done = subprocess.run([sys.executable, "-m", "ferry.worker.cli", "up", "--demo"], env=up_env(tmp_path, prefix),
                              capture_output=True, text=True, timeout=280, cwd=tmp_path)
    finally:
        delete_prefix(prefix)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert (tmp_path / "state" / "webhook_secret").read_text().startswith("whsec_")
    assert len(re.findall(r"<<< \d+ tokens, TTFT \d+\.\d ms, TBT \d+\.\d ms", out)) == 3, out[-6000:]
    answer = out.split(">>> What is the capital of France?")[1].split("<<<")[0]
    assert "Paris" in answer, answer
    assert re.search(r"^api +\| ", out, re.M) and re.search(r"^webhooks +\| ", out, re.M)
    pids = pids_started(out)
    assert set(pids) == {"api", "worker", "webhooks"}  # Redis already answered: not started
    assert not any(alive(pid) for pid in pids.values())


def test_up_refuses_a_model_that_is_not_there(tmp_path):
    env = up_env(tmp_path, new_prefix(), FERRY_MODEL=str(tmp_path / "nowhere"))
    done = subprocess.run([sys.executable, "-m", "ferry.worker.cli", "up"], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 1 and "no model at" in done.stdout + done.stderr
    assert "started api" not in done.stdout


def test_up_starts_redis_when_none_answers_and_sigterm_stops_everything(tmp_path, llama_dir):
    redis_port = free_port()
    env = up_env(
        tmp_path, new_prefix(), FERRY_REDIS_URL=f"redis://127.0.0.1:{redis_port}/0", FERRY_MODEL=str(llama_dir)
    )
    up = subprocess.Popen([sys.executable, "-m", "ferry.worker.cli", "up"], env=env, cwd=tmp_path,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            assert line, "".join(lines[-80:])
            lines.append(line)
            if "ready: http://" in line:
                break
        pids = pids_started("".join(lines))
        assert set(pids) == {"redis", "api", "worker", "webhooks"}
        assert redis.Redis(port=redis_port).ping()
        up.send_signal(signal.SIGTERM)
        rest, _ = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 0, "".join(lines) + rest
    assert not any(alive(pid) for pid in pids.values())
    # Stopped last-started first: Redis goes last.
    assert [m for m in re.findall(r"up +\| (\w+) stopped", rest)] == ["webhooks", "worker", "api", "redis"]
