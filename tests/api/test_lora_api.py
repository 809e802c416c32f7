"""LoRA adapters in the API (docs/lora.md#serving-adapters), on an in-process app over the real Redis
(no worker: the served models are configured): the admin routes, which tenant sees which adapter,
/v1/models' shape, and a request naming an adapter queued on its base model with `lora` set."""

from __future__ import annotations

import contextlib
import hashlib

import pytest
import redis
from fastapi.testclient import TestClient

from ferry.api.main import create_app
from ferry.api.settings import ApiSettings
from ferry.worker.protocol import JobRecord, Keys
from ferry.worker.protocol.loras import LoraEntry, write_loras
from tests.api.conftest import REDIS_URL, delete_prefix, new_prefix

pytestmark = pytest.mark.redis

KEY_ADMIN, KEY_A, KEY_B = "sk-lora-admin", "sk-lora-a", "sk-lora-b"
KEYS = ",".join(f"{hashlib.sha256(k.encode()).hexdigest()}:{spec}"
                for k, spec in ((KEY_ADMIN, "ops;admin=true"), (KEY_A, "tenant-a"), (KEY_B, "tenant-b")))


@contextlib.contextmanager
def lora_app(models: str = "tiny"):
    """(a client per key, the app's Keys): the app serves `models` (configured, no worker)."""
    prefix = new_prefix()
    try:
        with TestClient(create_app(ApiSettings(redis_url=REDIS_URL, key_prefix=prefix, models=models,
                                               api_keys=KEYS))) as client:
            yield {key: _as(client, key) for key in (KEY_ADMIN, KEY_A, KEY_B)}, Keys(prefix)
    finally:
        delete_prefix(prefix)


class _as:
    """The app's test client, calling with one API key."""

    def __init__(self, client: TestClient, key: str) -> None:
        self.client, self.headers = client, {"Authorization": f"Bearer {key}"}

    def get(self, url: str, **kw):
        return self.client.get(url, headers=self.headers, **kw)

    def post(self, url: str, **kw):
        return self.client.post(url, headers=self.headers, **kw)


def error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def load(api, name: str = "sql", path: str = "/adapters/sql", **more):
    return api.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path, **more})


def submit(api, model: str):
    return api.post("/v1/jobs", json={"input": {"model": model, "prompt": "SELECT", "max_tokens": 2}})


def test_only_admin_keys_may_load_or_unload_adapters():
    with lora_app() as (api, _):
        for key in (KEY_A, KEY_B):
            assert error(load(api[key]), 403)["code"] == "admin_required"
            r = api[key].post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
            assert error(r, 403)["code"] == "admin_required"
        assert load(api[KEY_ADMIN]).status_code == 200


def test_loading_the_same_adapter_again_is_idempotent_and_a_taken_name_is_a_409():
    with lora_app() as (api, keys):
        first = load(api[KEY_ADMIN], path="s3://bucket/sql/")
        assert first.status_code == 200, first.text
        card = first.json()
        assert card["id"] == "sql" and card["object"] == "model"
        assert (card["parent"], card["root"]) == ("tiny", "s3://bucket/sql/")
        again = load(api[KEY_ADMIN], path="s3://bucket/sql/")
        assert again.status_code == 200 and again.json() == card  # the first registration, unchanged
        e = error(load(api[KEY_ADMIN], path="/adapters/other"), 409)
        assert e["code"] == "lora_exists" and e["param"] == "lora_name"
        assert error(load(api[KEY_ADMIN], name="tiny"), 409)["code"] == "model_exists"
        rdb = redis.Redis.from_url(REDIS_URL, decode_responses=True)
        stored = LoraEntry.model_validate_json(rdb.hget(keys.loras, "sql"))
        assert (stored.path, stored.base_model, stored.source, stored.tenants) == ("s3://bucket/sql/", "tiny",
                                                                                  "runtime", None)
        assert rdb.ttl(keys.loras) == -1  # runtime adapters persist
        rdb.close()


@pytest.mark.parametrize(("body", "status", "code", "param"), [
    ({"lora_name": "x", "lora_path": "/a", "rank": 8}, 422, "unsupported_parameter", "rank"),
    ({"lora_name": "x", "lora_path": "relative/dir"}, 422, "invalid_request", "lora_path"),
    ({"lora_name": "x", "lora_path": "https://example.com/a"}, 422, "invalid_request", "lora_path"),
    ({"lora_name": "x", "lora_path": "hf://just-a-name"}, 422, "invalid_request", "lora_path"),
    ({"lora_name": "", "lora_path": "/a"}, 422, "invalid_request", "lora_name"),
    ({"lora_path": "/a"}, 422, "invalid_request", "lora_name"),
    ({"lora_name": "x", "lora_path": "/a", "tenants": []}, 422, "invalid_request", "tenants"),
    ({"lora_name": "x", "lora_path": "/a", "base_model": "nobody"}, 404, "model_not_found", "base_model"),
])
def test_load_refuses_a_body_it_cannot_register(body, status, code, param):
    with lora_app() as (api, keys):
        e = error(api[KEY_ADMIN].post("/v1/load_lora_adapter", json=body), status)
        assert (e["code"], e["param"]) == (code, param)
        assert not redis.Redis.from_url(REDIS_URL).exists(keys.loras)


def test_base_model_is_required_while_several_models_are_served():
    with lora_app(models="tiny,big") as (api, _):
        e = error(load(api[KEY_ADMIN]), 422)
        assert e["param"] == "base_model" and "2 models" in e["message"]
        assert load(api[KEY_ADMIN], base_model="big").json()["parent"] == "big"


def test_unload_removes_the_adapter_and_an_unknown_one_is_a_404():
    with lora_app() as (api, _):
        load(api[KEY_ADMIN])
        assert submit(api[KEY_A], "sql").status_code == 202
        r = api[KEY_ADMIN].post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert r.status_code == 200 and r.json() == {"id": "sql", "object": "model", "deleted": True}
        assert error(submit(api[KEY_A], "sql"), 404)["code"] == "model_not_found"
        assert "sql" not in [m["id"] for m in api[KEY_A].get("/v1/models").json()["data"]]
        r = api[KEY_ADMIN].post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert error(r, 404)["code"] == "model_not_found"
        r = api[KEY_ADMIN].post("/v1/unload_lora_adapter", json={"lora_name": "sql", "force": True})
        assert error(r, 422)["code"] == "unsupported_parameter"


def test_a_tenants_adapter_is_a_404_to_other_tenants_and_missing_from_their_models():
    with lora_app() as (api, _):
        assert load(api[KEY_ADMIN], name="a-only", tenants=["tenant-a"]).status_code == 200
        load(api[KEY_ADMIN], name="shared", path="hf://org/shared@v2")
        listed = {m["id"]: m for m in api[KEY_A].get("/v1/models").json()["data"]}
        assert listed["a-only"] | {"created": 0} == {"id": "a-only", "object": "model", "created": 0,
                                                     "owned_by": "ferry", "parent": "tiny", "root": "/adapters/sql"}
        assert listed["shared"]["root"] == "hf://org/shared@v2" and listed["tiny"]["parent"] is None
        assert set(m["id"] for m in api[KEY_B].get("/v1/models").json()["data"]) == {"tiny", "shared"}
        assert submit(api[KEY_A], "a-only").status_code == 202
        hidden = error(submit(api[KEY_B], "a-only"), 404)
        unknown = error(submit(api[KEY_B], "no-such"), 404)
        assert hidden["code"] == unknown["code"] == "model_not_found"
        assert hidden["message"].replace("a-only", "X") == unknown["message"].replace("no-such", "X")
        r = api[KEY_B].post("/v1/chat/completions", json={"model": "a-only", "messages": [{"role": "user",
                                                                                           "content": "hi"}]})
        assert error(r, 404)["code"] == "model_not_found"
        assert submit(api[KEY_B], "shared").status_code == 202


def test_an_adapter_of_a_model_no_longer_served_is_not_routed():
    with lora_app() as (api, keys):
        rdb = redis.Redis.from_url(REDIS_URL)
        write_loras(rdb, keys, [LoraEntry(name="orphan", base_model="gone", path="/a", source="operator")])
        rdb.close()
        assert error(submit(api[KEY_A], "orphan"), 404)["code"] == "model_not_found"
        assert "orphan" not in [m["id"] for m in api[KEY_A].get("/v1/models").json()["data"]]


def test_a_job_for_an_adapter_is_queued_on_its_base_model_with_lora_set():
    with lora_app(models="tiny,big") as (api, keys):
        load(api[KEY_ADMIN], base_model="tiny")
        r = submit(api[KEY_A], "sql")
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        assert r.json()["model"] == "sql"  # the job shows the model its client named
        rdb = redis.Redis.from_url(REDIS_URL, decode_responses=True)
        entries = rdb.xrange(keys.queue("tiny", "normal"))
        assert [fields["job_id"] for _, fields in entries] == [job_id]
        assert not rdb.exists(keys.queue("sql", "normal")) and not rdb.exists(keys.queue("big", "normal"))
        record = JobRecord.from_redis(rdb.hgetall(keys.job(job_id)))
        assert (record.model, record.request.model, record.request.lora) == ("tiny", "tiny", "sql")
        plain = submit(api[KEY_A], "tiny").json()["id"]
        assert JobRecord.from_redis(rdb.hgetall(keys.job(plain))).request.lora is None
        assert api[KEY_A].get(f"/v1/jobs/{job_id}").json()["model"] == "sql"
        rdb.close()
