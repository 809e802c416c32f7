"""The error shape and the 4xx paths, on an in-process app over the real Redis (no worker needed)."""

from __future__ import annotations

import contextlib
import hashlib
import logging

import pytest
from fastapi.testclient import TestClient

from ferry.api.auth import OPEN_TENANT, KeyRing, hash_key
from ferry.api.main import create_app
from ferry.api.settings import ApiSettings
from tests.api.conftest import REDIS_URL, delete_prefix, new_prefix


def test_keyring_parses_hashed_keys_from_settings_and_file(tmp_path):
    file = tmp_path / "keys"
    file.write_text(f"# ops keys\n{hash_key('k2')}:beta\n\n")
    ring = KeyRing.parse(f"{hash_key('k1')}:alpha", str(file))
    assert ring.tenant_for("k1") == "alpha" and ring.tenant_for("k2") == "beta" and not ring.open
    for token in (None, "", "k3", hash_key("k1")):  # the digest itself is not a key
        with pytest.raises(Exception, match="API key"):
            ring.tenant_for(token)
    assert KeyRing.parse(None, None).tenant_for(None) == OPEN_TENANT


@pytest.mark.parametrize("spec", ["nocolon", f"{'0' * 63}:t", f"{'g' * 64}:t", f"{hash_key('x')}:"])
def test_keyring_refuses_malformed_entries(spec):
    with pytest.raises(ValueError, match="sha256"):
        KeyRing.parse(spec)


@contextlib.contextmanager
def local_app(**overrides):
    prefix = new_prefix()
    try:
        with TestClient(create_app(ApiSettings(redis_url=REDIS_URL, key_prefix=prefix, **overrides))) as client:
            yield client
    finally:
        delete_prefix(prefix)


pytestmark = pytest.mark.redis


def error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    e = body["error"]
    assert e["type"] == ("server_error" if status >= 500 else e["type"]) and e["type"].endswith("_error")
    assert e["param"] == e.get("field")  # `field` stays for older clients, the same as OpenAI's `param`
    return e


def test_open_mode_is_announced_loudly(caplog):
    with caplog.at_level(logging.WARNING, logger="ferry.api"), local_app(models="m") as api:
        assert api.post("/v1/jobs", json={"input": {"prompt": "x"}}).status_code == 202
    assert "OPEN MODE" in caplog.text


def test_errors_have_openais_shape_and_keep_field():
    with local_app(models="m") as api:
        r = api.post("/v1/completions", json={"model": "m", "prompt": "x", "temperature": -1})
        assert r.status_code == 422
        message = r.json()["error"]["message"]
        assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": "temperature",
                                      "code": "invalid_request", "field": "temperature"}}
        r = api.get("/v1/jobs/nope")
        assert r.json()["error"] == {"message": "job 'nope' not found", "type": "invalid_request_error",
                                     "param": None, "code": "job_not_found"}
    with local_app(models="m", api_keys=f"{hash_key('k')}:t") as api:
        assert error(api.get("/v1/models"), 401)["type"] == "authentication_error"


def test_models_lists_configured_models_with_no_worker():
    with local_app(models="m,other") as api:
        r = api.get("/v1/models")
        assert r.status_code == 200
        assert [(m["id"], m["created"]) for m in r.json()["data"]] == [("m", 0), ("other", 0)]


def test_validation_errors_name_the_field():
    with local_app(models="m") as api:
        e = error(api.post("/v1/jobs", json={"input": {"prompt": "x", "temperature": -1}}), 422)
        assert (e["code"], e["field"]) == ("invalid_request", "input.temperature")
        e = error(api.post("/v1/jobs", json={"input": {"messages": [{"role": "user", "content": 3}]}}), 422)
        assert e["field"].startswith("input.messages[0].content")
        e = error(api.post("/v1/jobs", json={"input": {"prompt": "x", "min_tokens": 9, "max_tokens": 2}}), 422)
        assert e["field"] == "input" and "min_tokens" in e["message"]
        e = error(api.post("/v1/jobs", json={"input": {"prompt": "x"}, "webhook": {"url": "ftp://x"}}), 422)
        assert e["field"] == "webhook.url"
        assert error(api.post("/v1/jobs", json={"input": {"prompt": "x", "bogus": 1}}), 422)["field"] == "input.bogus"
        assert error(api.post("/v1/jobs", json={}), 422)["field"] == "input"
        e = error(api.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"}), 422)
        assert e["code"] == "invalid_json"
        assert error(api.get("/v1/jobs/x", headers={"Last-Event-ID": "x"}), 404)["code"] == "job_not_found"
        e = error(api.get("/v1/jobs/x/events", headers={"Last-Event-ID": "abc"}), 422)
        assert e["field"] == "Last-Event-ID"
        e = error(api.post("/v1/completions", json={"prompt": ["a", "b"], "stream": True}), 422)
        assert (e["code"], e["field"]) == ("unsupported_parameter", "stream")
        assert error(api.post("/v1/completions", json={"prompt": []}), 422)["field"] == "prompt"
        assert error(api.post("/v1/completions", json={"prompt": ["a"] * 65}), 422)["field"] == "prompt"
        assert error(api.post("/v1/completions", json={"prompt": "a", "n": 17}), 422)["field"] == "n"
        e = error(api.post("/v1/completions", json={"prompt": "a", "echo": True, "logprobs": 1}), 422)
        assert (e["code"], e["field"]) == ("unsupported_parameter", "echo")
        assert error(api.post("/v1/completions", json={"prompt": [1, 2], "echo": True}), 422)["field"] == "echo"
        assert error(api.post("/v1/chat/completions", json={"messages": []}), 422)["field"] == "messages"


def test_unknown_routes_methods_jobs_and_models():
    with local_app(models="m") as api:
        assert error(api.get("/v1/nope"), 404)["code"] == "not_found"
        assert error(api.delete("/v1/jobs"), 405)["code"] == "method_not_allowed"
        assert error(api.get("/v1/jobs/0123abc"), 404)["code"] == "job_not_found"
        assert error(api.post("/v1/jobs/0123abc/cancel"), 404)["code"] == "job_not_found"
        e = error(api.post("/v1/jobs", json={"input": {"prompt": "x", "model": "other"}}), 404)
        assert (e["code"], e["field"]) == ("model_not_found", "input.model")
        assert (
            error(api.post("/v1/completions", json={"model": "other", "prompt": "x"}), 404)["code"] == "model_not_found"
        )
    with local_app(models="m1,m2") as api:  # the model may be omitted only while one is served
        assert error(api.post("/v1/jobs", json={"input": {"prompt": "x"}}), 422)["field"] == "input.model"
    with local_app() as api:
        assert error(api.post("/v1/jobs", json={"input": {"prompt": "x"}}), 404)["code"] == "model_not_found"
        assert error(api.get("/readyz"), 503)["code"] == "no_workers"


def test_body_over_the_limit_is_413_declared_or_streamed():
    with local_app(models="m", max_body_bytes=1000) as api:
        big = {"input": {"prompt": "x" * 2000}}
        assert error(api.post("/v1/jobs", json=big), 413)["code"] == "body_too_large"

        def chunks():
            yield b'{"input": {"prompt": "'
            yield b"x" * 2000
            yield b'"}}'

        r = api.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
        assert error(r, 413)["code"] == "body_too_large"
        assert api.post("/v1/jobs", json={"input": {"prompt": "x" * 500}}).status_code == 202


def test_full_queue_is_429_with_retry_after_but_replays_still_answer():
    with local_app(models="m", max_queue_len=2, retry_after_s=7) as api:
        first = api.post("/v1/jobs", json={"input": {"prompt": "a"}}, headers={"Idempotency-Key": "k"})
        assert api.post("/v1/jobs", json={"input": {"prompt": "b"}}).status_code == 202
        r = api.post("/v1/jobs", json={"input": {"prompt": "c"}})
        assert error(r, 429)["code"] == "queue_full" and r.headers["retry-after"] == "7"
        r = api.post("/v1/completions", json={"prompt": "c"})
        assert error(r, 429)["code"] == "queue_full"
        replay = api.post("/v1/jobs", json={"input": {"prompt": "a"}}, headers={"Idempotency-Key": "k"})
        assert replay.status_code == 202 and replay.json()["id"] == first.json()["id"]


def test_tenant_scoping_in_process():
    keys = f"{hashlib.sha256(b'a').hexdigest()}:ta,{hashlib.sha256(b'b').hexdigest()}:tb"
    with local_app(models="m", api_keys=keys) as api:
        job = api.post("/v1/jobs", json={"input": {"prompt": "x"}}, headers={"Authorization": "Bearer a"}).json()
        assert api.get(f"/v1/jobs/{job['id']}", headers={"Authorization": "Bearer a"}).status_code == 200
        assert error(api.get(f"/v1/jobs/{job['id']}", headers={"Authorization": "Bearer b"}), 404)
        assert error(api.get(f"/v1/jobs/{job['id']}", headers={"Authorization": "Basic YTpi"}), 401)
        assert api.get("/healthz").status_code == 200  # health needs no key
