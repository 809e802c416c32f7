"""An upload the API cannot record leaves nothing behind: `ferry api` as a subprocess on a Redis
of the test's own (made full, then killed) and a file:// store."""

from __future__ import annotations

import httpx
import pytest
import redis

from tests.api.conftest import KEY_A, Proc, api_keys_setting, free_port, new_prefix, stack_env, wait_until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]


def test_an_upload_refused_with_503_leaves_no_bytes_in_the_file_store(private, tmp_path):
    files, spool = tmp_path / "files", tmp_path / "up"
    port = free_port()
    env = stack_env(new_prefix(), tmp_path, FERRY_REDIS_URL=private.url, FERRY_API_KEYS=api_keys_setting(),
                    FERRY_FILES_URL=files.as_uri(), FERRY_UPLOAD_DIR=str(spool))
    api = Proc("api", ["api", "--host", "127.0.0.1", "--port", str(port)], env, tmp_path)
    url = f"http://127.0.0.1:{port}"

    def upload() -> httpx.Response:
        return httpx.post(url + "/v1/files", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30,
                          files={"file": ("in.jsonl", b'{"custom_id": "a"}\n' * 1000)}, data={"purpose": "batch"})

    def stored() -> list[str]:
        return sorted(p.name for p in files.rglob("*") if p.is_file())

    try:
        wait_until(lambda: httpx.get(url + "/healthz").status_code == 200, 60, "the API", [api])
        admin = redis.Redis.from_url(private.url)
        admin.config_set("maxmemory", 1)  # full: every write is refused (noeviction)
        refused = upload()
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "redis_unavailable", refused.text
        assert stored() == [] and list(spool.iterdir()) == []
        admin.config_set("maxmemory", 0)
        kept = upload()
        assert kept.status_code == 200 and stored() == [f"{kept.json()['id']}.jsonl"]
        private.kill9()  # away
        refused = upload()
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "redis_unavailable", refused.text
        assert stored() == [f"{kept.json()['id']}.jsonl"] and list(spool.iterdir()) == []
    finally:
        api.stop()
