"""`ferry worker` and `ferry models` on hf:// and s3:// models: a worker serves what the local
files serve, workers starting together download once, and every bad input is one log line and
exit code 2 before the worker registers, with nothing left in the cache."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis

from ferry.worker.common.objectstore import s3_client
from ferry.worker.engine import LLM, SamplingParams
from ferry.worker.models.sources import NodeCache
from ferry.worker.protocol import JobState, Keys
from ferry.worker.serve.main import Worker
from ferry.worker.serve.settings import WorkerSettings
from tests.serve.conftest import enqueue, record
from tests.serve.test_worker_idle import restore_process_hooks  # noqa: F401 (fixture)

pytestmark = [pytest.mark.s3, pytest.mark.redis]

PROMPT = "The quick brown fox jumps over the lazy dog"


def ferry(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ferry.worker.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def worker_env(model: str, cache: Path, **extra: str | None) -> dict[str, str]:
    """The environment of a worker on `model`; an `extra` variable set to None is removed."""
    env = dict(os.environ, FERRY_MODEL=model, FERRY_MODEL_CACHE=str(cache), FERRY_MODEL_NAME="tiny",
               FERRY_KEY_PREFIX=f"ferrytest-{uuid.uuid4().hex}", FERRY_METRICS_PORT="0", FERRY_TORCH_THREADS="1",
               OMP_NUM_THREADS="1", FERRY_KV_CACHE_BYTES=str(4 << 20), FERRY_IDLE_TIMEOUT_S="0.5",
               FERRY_LOG_LEVEL="WARNING")
    env.update(extra)
    return {name: value for name, value in env.items() if value is not None}


def assert_cache_empty(cache: Path) -> None:
    assert NodeCache(cache).entries() == []
    downloads = cache / "downloads"
    assert not downloads.exists() or [p.name for p in downloads.iterdir()] in ([], [".locks"])


def test_a_worker_on_an_s3_model_serves_the_tokens_of_its_local_directory(
        llama_dir, s3_bucket, tmp_path, restore_process_hooks):  # noqa: F811
    for path in llama_dir.iterdir():
        s3_client().upload_file(str(path), s3_bucket, f"tiny/{path.name}")
    prefix = f"ferrytest-{uuid.uuid4().hex}"
    client, keys = redis.Redis(decode_responses=True), Keys(prefix)
    settings = WorkerSettings(key_prefix=prefix, model_name="tiny", metrics_port=0, idle_timeout_s=1.0,
                              engine={"model": f"s3://{s3_bucket}/tiny/", "kv_cache_bytes": 4 << 20,
                                      "model_cache_dir": str(tmp_path / "cache")})
    try:
        job_id = enqueue(client, keys, prompt=PROMPT, max_tokens=10)
        worker = Worker(settings)
        assert worker.run() == 0
        rec = record(client, keys, job_id)
        local = LLM(str(llama_dir), kv_cache_bytes=4 << 20).generate(
            PROMPT, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
        assert rec.state is JobState.succeeded and rec.token_ids == local.token_ids
        phases = {s.labels["phase"]: s.value for m in worker.metrics.registry.collect()
                  if m.name == "ferry_model_load_seconds" for s in m.samples}
        assert set(phases) == {"download", "load", "warmup"} and phases["download"] > 0
    finally:
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)
        client.close()


def test_two_workers_starting_together_download_once(llama_dir, hub, tmp_path):
    hub.add("org/together", llama_dir)
    cache = tmp_path / "cache"
    workers = [ferry(["worker"], worker_env("hf://org/together", cache)) for _ in range(2)]
    for w in workers:
        _, err = w.communicate(timeout=120)
        assert w.returncode == 0, err
    assert hub.count_gets("org/together") == len(list(llama_dir.iterdir()))  # each file once
    assert len(NodeCache(cache).entries()) == 1


def bad_inputs(s3_bucket: str) -> dict[str, tuple[dict[str, str | None], str]]:
    """Reference -> (extra environment, the cause its line must give)."""
    no_credentials = {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None, "AWS_EC2_METADATA_DISABLED": "true",
                      "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent"}
    return {
        "hf://org/no-such-repo": ({}, "does not exist"),
        "hf://org/bad@no-such-revision": ({}, "the revision 'no-such-revision' does not exist"),
        "hf://org/private": ({}, "HF_TOKEN"),
        "hf://org/truncated": ({}, "model.safetensors is truncated"),
        "hf://org/huge": ({}, "not enough disk space"),
        "hf://org-only": ({}, "use hf://org/name"),
        f"s3://{s3_bucket}-missing/tiny/": ({}, "does not exist"),
        f"s3://{s3_bucket}/no-such-prefix/": ({}, "no model under"),
        f"s3://{s3_bucket}/tiny/": (no_credentials, "no AWS credentials found"),
    }


@pytest.fixture
def bad_sources(llama_dir, hub, s3_bucket):
    """The Hub and S3 holding what bad_inputs names (and a good copy to refuse without credentials)."""
    hub.add("org/bad", llama_dir)
    hub.add("org/private", llama_dir, token="hf_secret")
    hub.add("org/truncated", llama_dir, truncate={"model.safetensors": 1000})
    hub.add("org/huge", llama_dir, claim_size={"model.safetensors": 10**18})
    for path in llama_dir.iterdir():
        s3_client().upload_file(str(path), s3_bucket, f"tiny/{path.name}")
    return bad_inputs(s3_bucket)


def test_each_bad_input_is_one_line_and_exit_2_with_nothing_cached(
        bad_sources, tmp_path, monkeypatch, caplog, restore_process_hooks):  # noqa: F811
    """In this process (Worker.run, what `ferry worker` returns as its exit code), one cause after another."""
    for i, (ref, (extra, cause)) in enumerate(bad_sources.items()):
        with monkeypatch.context() as env:
            for name, value in extra.items():
                env.delenv(name, raising=False) if value is None else env.setenv(name, value)
            caplog.clear()
            settings = WorkerSettings(redis_url="redis://127.0.0.1:1", metrics_port=0, model_name="tiny",
                                      engine={"model": ref, "model_cache_dir": str(tmp_path / f"cache-{i}")})
            assert Worker(settings).run() == 2, ref
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and errors[0].model == ref, (ref, [r.getMessage() for r in errors])
        assert ref in errors[0].error and cause in errors[0].error, errors[0].error
        assert_cache_empty(tmp_path / f"cache-{i}")


def test_the_worker_process_exits_2_with_one_json_line(bad_sources, s3_bucket, tmp_path):
    refs = ["hf://org/no-such-repo", f"s3://{s3_bucket}/tiny/"]  # the second without credentials
    runs = {ref: ferry(["worker"], worker_env(ref, tmp_path / f"cache-{i}", FERRY_REDIS_URL="redis://127.0.0.1:1",
                                              **bad_sources[ref][0]))
            for i, ref in enumerate(refs)}
    for i, (ref, proc) in enumerate(runs.items()):
        _, err = proc.communicate(timeout=120)
        lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
        errors = [line for line in lines if line["level"] in ("error", "critical")]
        assert proc.returncode == 2, (ref, err[-2000:])
        assert len(errors) == 1 and errors[0]["model"] == ref and bad_sources[ref][1] in errors[0]["error"], err
        assert_cache_empty(tmp_path / f"cache-{i}")


def test_models_pull_ls_rm_round_trip(llama_dir, hub, tmp_path):
    repo = hub.add("org/cli", llama_dir)
    env = dict(os.environ, FERRY_MODEL_CACHE=str(tmp_path / "cache"))

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ferry.worker.cli", "models", *args], env=env,
                              capture_output=True, text=True, timeout=60)

    assert "no models cached" in run("ls").stdout
    pulled = run("pull", "hf://org/cli")
    assert pulled.returncode == 0, pulled.stderr
    assert (Path(pulled.stdout.strip()) / "model.safetensors").is_file()
    listed = run("ls").stdout
    assert "hf://org/cli" in listed and repo.commit[:12] in listed
    assert run("pull", f"hf://org/cli@{repo.commit}").stdout == pulled.stdout  # the same copy, no download
    assert hub.count_gets("org/cli") == len(list(llama_dir.iterdir()))
    removed = run("rm", "hf://org/cli")
    assert removed.returncode == 0 and "removed hf://org/cli" in removed.stdout
    assert "no models cached" in run("ls").stdout
    assert run("rm", "hf://org/cli").returncode == 1
    failed = run("pull", "hf://org/missing")
    assert failed.returncode == 2 and failed.stderr.strip().count("\n") == 0
    assert "hf://org/missing: the repository 'org/missing' does not exist" in failed.stderr
