"""LoRA adapters in the worker: FERRY_LORA_MODULES and the LoRA settings, a job's adapter found in the
registry (and the jobs a worker cannot serve failed with `lora_not_found`), the engine's adapter
errors as `lora_load_failed`. The end-to-end serving tests are tests/api/test_lora_serving.py."""

from __future__ import annotations

import os
import time
import uuid

import pytest
import redis

from ferry.worker.engine.errors import LoraAdapterError
from ferry.worker.models.sources import parse_ref
from ferry.worker.protocol import ErrorCode, Keys
from ferry.worker.protocol.loras import LoraEntry, lora_path_problem, parse_lora_modules, read_lora, write_loras
from ferry.worker.serve import loras
from ferry.worker.serve.errors import error_code
from ferry.worker.serve.loras import LoraResolver, LoraUnavailable
from ferry.worker.serve.settings import WorkerSettings
from tests.serve.conftest import enqueue, events, start_worker, wait_ready, wait_terminal

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def env(monkeypatch):
    """Set FERRY_* variables for one test (every other FERRY_ variable unset)."""
    for name in [n for n in os.environ if n.startswith("FERRY_")]:
        monkeypatch.delenv(name)

    def set_(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(f"FERRY_{name}", value)

    return set_


# --- settings --------------------------------------------------------------------------------------


def test_lora_modules_turn_lora_on_and_reach_the_engine_config(env):
    env(MODEL="/models/tiny", LORA_MODULES="sql=/adapters/sql, poet=s3://bucket/poet/", MAX_LORAS="2",
        MAX_LORA_RANK="32", MAX_CPU_LORAS="8")
    s = WorkerSettings()
    assert [(m.name, m.path) for m in s.lora_modules] == [("sql", "/adapters/sql"), ("poet", "s3://bucket/poet/")]
    assert (s.engine.enable_lora, s.engine.max_loras, s.engine.max_lora_rank, s.engine.max_cpu_loras) == (
        True, 2, 32, 8)
    assert s.engine.model == "/models/tiny"
    assert "FERRY_LORA_MODULES" in WorkerSettings.variable_names()


def test_lora_is_off_by_default_and_on_when_asked_without_modules(env):
    assert not WorkerSettings().engine.enable_lora and WorkerSettings().lora_modules == []
    env(ENABLE_LORA="true")
    s = WorkerSettings()
    assert s.engine.enable_lora and (s.engine.max_loras, s.engine.max_lora_rank, s.engine.max_cpu_loras) == (
        4, 16, None)


@pytest.mark.parametrize(("settings", "problem"), [
    ({"LORA_MODULES": "sql=/a", "ENABLE_LORA": "false"}, "FERRY_ENABLE_LORA is false"),
    ({"LORA_MODULES": "tiny=/a"}, "has the served model's name"),
    ({"LORA_MODULES": '{"name": "sql", "path": "/a", "base_model_name": "other"}'}, "this worker serves 'tiny'"),
    ({"LORA_MODULES": "sql"}, "is not name=path"),
    ({"LORA_MODULES": "sql=adapters/sql"}, "is not an absolute path"),
])
def test_lora_settings_a_worker_cannot_serve_stop_it_at_start(env, settings, problem):
    env(MODEL="/models/tiny", **settings)
    with pytest.raises(ValueError, match=problem):
        WorkerSettings()


def test_lora_modules_take_vllms_three_forms():
    pairs = "sql=/a,poet=hf://org/poet@v1"
    objects = '{"name": "sql", "path": "/a"}, {"name": "poet", "path": "hf://org/poet@v1", "base_model_name": "tiny"}'
    listed = '[{"name": "sql", "path": "/a"}, {"name": "poet", "path": "hf://org/poet@v1"}]'
    for text in (pairs, objects, listed):
        assert [(m.name, m.path) for m in parse_lora_modules(text)] == [("sql", "/a"), ("poet", "hf://org/poet@v1")]
    assert parse_lora_modules("") == parse_lora_modules("  ") == parse_lora_modules(None) == []


@pytest.mark.parametrize(("text", "problem"), [
    ("sql=/a,sql=/b", "adapter 'sql' is named twice"),
    ("=/a", "is not name=path"),
    ("sql=", "is not name=path"),
    ("sql=ftp://host/a", "only local paths, s3:// and hf:// are supported"),
    ("sql=s3://Bad_Bucket/a", "is not s3://bucket/prefix/"),
    ('{"name": "sql"}', "path: Field required"),
    ('{"name": "sql", "path": "/a", "rank": 8}', "rank: Extra inputs are not permitted"),
    ('{"name": "sql", "path": "/a"', "is not JSON"),
    ('[{"name": "sql", "path": "/a"}', "not a JSON list"),
    ('{"name": "", "path": "/a"}', "name: String should have at least 1 character"),
])
def test_lora_modules_that_do_not_parse_name_the_entry(text, problem):
    with pytest.raises(ValueError, match="FERRY_LORA_MODULES") as refused:
        parse_lora_modules(text)
    assert problem in str(refused.value)


@pytest.mark.parametrize("path", ["/adapters/sql", "s3://bucket/a/b/", "s3://my.bucket", "hf://org/name",
                                  "hf://org/name@v1.2", "hf://org/name/", "hf://org/name@refs/pr/1"])
def test_every_path_the_api_accepts_is_one_the_loader_reads(path):
    assert lora_path_problem(path) is None
    ref = parse_ref(path)
    assert (ref is None) == path.startswith("/") and (ref is None or not ref.gguf)


@pytest.mark.parametrize("path", ["s3://b/x", "s3://Bad/x", "hf://org", "hf://org/name/file.gguf", "org/name",
                                  "file:///a", "./a"])
def test_a_path_the_loader_would_refuse_is_refused_up_front(path):
    assert lora_path_problem(path) is not None


# --- the registry and the resolver ------------------------------------------------------------------


@pytest.fixture
def registry():
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    keys = Keys(f"ferrytest-{uuid.uuid4().hex}")
    yield client, keys
    client.delete(keys.loras)
    client.close()


@pytest.mark.redis
def test_operator_adapters_are_registered_for_the_served_model(registry):
    client, keys = registry
    entries = loras.operator_entries(parse_lora_modules("sql=/a/sql,poet=s3://bucket/poet/"), "tiny")
    loras.register(client, keys, entries)
    sql = read_lora(client, keys, "sql")
    assert (sql.name, sql.base_model, sql.path, sql.source, sql.tenants) == ("sql", "tiny", "/a/sql", "operator", None)
    assert read_lora(client, keys, "poet").path == "s3://bucket/poet/" and read_lora(client, keys, "nope") is None
    assert client.ttl(keys.loras) == -1


@pytest.mark.redis
def test_the_resolver_serves_only_registered_adapters_of_its_own_model(registry, monkeypatch):
    client, keys = registry
    write_loras(client, keys, [LoraEntry(name="sql", base_model="tiny", path="/a/sql", source="runtime"),
                               LoraEntry(name="big-sql", base_model="big", path="/a/big", source="operator")])
    resolver = LoraResolver(client, keys, "tiny", enabled=True)
    resolver.prefetch({"sql", "big-sql", "nope"})
    lora = resolver.request_for("sql")
    assert (lora.lora_name, lora.lora_path) == ("sql", "/a/sql")
    with pytest.raises(LoraUnavailable, match="is an adapter of 'big', not of 'tiny'"):
        resolver.request_for("big-sql")
    with pytest.raises(LoraUnavailable, match="'nope' is not registered"):
        resolver.request_for("nope")
    off = LoraResolver(client, keys, "tiny", enabled=False)
    off.prefetch({"sql"})
    with pytest.raises(LoraUnavailable, match="without LoRA"):
        off.request_for("sql")
    client.hdel(keys.loras, "sql")  # unloaded: seen once the cached entry is older than CACHE_S
    resolver.prefetch({"sql"})
    assert resolver.request_for("sql").lora_path == "/a/sql"
    monkeypatch.setattr(loras, "CACHE_S", 0.0)
    time.sleep(0.01)
    resolver.prefetch({"sql"})
    with pytest.raises(LoraUnavailable, match="not registered"):
        resolver.request_for("sql")


def test_the_engines_adapter_errors_are_lora_load_failed():
    assert error_code(LoraAdapterError("LoRA adapter 'x': rank 64 is over max_lora_rank 16")) == "lora_load_failed"
    assert ErrorCode.LORA_LOAD_FAILED == "lora_load_failed" and ErrorCode.LORA_NOT_FOUND == "lora_not_found"


# --- a worker process --------------------------------------------------------------------------------


@pytest.mark.redis
@pytest.mark.timeout(180)
def test_a_worker_without_lora_fails_an_adapters_job_and_serves_the_next(llama_dir, registry, tmp_path):
    client, keys = registry
    write_loras(client, keys, [LoraEntry(name="sql", base_model="tiny", path="/a/sql", source="runtime")])
    worker = start_worker(llama_dir, REDIS_URL, keys.prefix, tmp_path)
    try:
        wait_ready(client, keys, [worker])
        assert client.hget(keys.worker(worker.worker_id), "loras") == "[]"
        adapted = enqueue(client, keys, prompt="hello", max_tokens=3, lora="sql")
        plain = enqueue(client, keys, prompt="hello", max_tokens=3)
        failed, served = wait_terminal(client, keys, [adapted, plain])
        assert (failed.state, failed.error_code) == ("failed", "lora_not_found")
        assert "without LoRA" in failed.error_message and events(client, keys, adapted)[-1].code == "lora_not_found"
        assert served.state == "succeeded" and len(served.token_ids) == 3
    finally:
        worker.sigterm()
        worker.proc.wait(30)
        for key in client.scan_iter(f"{keys.prefix}:*"):
            client.delete(key)
