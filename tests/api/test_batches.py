"""The Batch API through the official `openai` client, against real processes: `ferry api`,
`ferry worker` on a tiny model, Redis, and a file:// file store."""

from __future__ import annotations

import io
import json
import time
import uuid

import httpx
import openai
import pytest

from ferry.worker.webhooks.signing import new_secret, verify
from tests.api.conftest import (
    KEY_A,
    KEY_B,
    MODEL,
    Proc,
    api_keys_setting,
    delete_prefix,
    free_port,
    new_prefix,
    stack_env,
    wait_until,
)
from tests.webhooks.receiver import receiver  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]

FINAL = ("completed", "failed", "expired", "cancelled")


class BatchStack:
    def __init__(self, tiny_model_factory, tmp_path, webhooks: bool = False, **extra: str) -> None:
        self.prefix = new_prefix()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        settings = dict(FERRY_API_KEYS=api_keys_setting(), FERRY_FILES_URL=(tmp_path / "files").as_uri(),
                        FERRY_UPLOAD_DIR=str(tmp_path / "up"), FERRY_BATCH_POLL_S="0.05", FERRY_BATCH_LEASE_S="2",
                        FERRY_WEBHOOK_SECRET=new_secret(), FERRY_WEBHOOK_ALLOW_PRIVATE="1")
        self.env = stack_env(self.prefix, tiny_model_factory("llama"), **(settings | extra))
        self.logs = tmp_path
        self.procs = {"worker": Proc("worker", ["worker"], self.env, tmp_path),
                      "api": self.start_api("api", self.port)}
        if webhooks:
            self.procs["webhooks"] = Proc("webhooks", ["webhooks", "--loglevel", "WARNING"], self.env, tmp_path)
        try:
            wait_until(lambda: httpx.get(self.url + "/readyz").status_code == 200, 120, "the stack",
                       self.procs.values())
        except BaseException:  # a stack that never got ready must not outlive the test
            self.close()
            raise

    def start_api(self, name: str, port: int) -> Proc:
        return Proc(name, ["api", "--host", "127.0.0.1", "--port", str(port)], self.env, self.logs)

    def client(self, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=2, timeout=60)

    def close(self) -> None:
        for proc in self.procs.values():
            proc.stop()
        delete_prefix(self.prefix)


@pytest.fixture(scope="module")
def bstack(tiny_model_factory, tmp_path_factory):
    stack = BatchStack(tiny_model_factory, tmp_path_factory.mktemp("batch"), webhooks=True)
    yield stack
    stack.close()


@pytest.fixture
def client(bstack):
    with bstack.client() as c:
        yield c


def chat_line(custom_id: str, content: str, max_tokens: int = 4, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     "temperature": 0, "ignore_eos": True, **body}}


def jsonl(lines: list) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


def upload(client, lines: list):
    return client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")


def wait_final(client, batch_id: str, timeout: float = 240, until=FINAL):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id} still {batch.status}")


def read_jsonl(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line]


def test_files_round_trip_list_and_delete(client):
    data = jsonl([chat_line("a", "hello")])
    created = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    assert created.id.startswith("file-") and created.bytes == len(data) and created.purpose == "batch"
    assert created.filename == "in.jsonl"
    assert client.files.retrieve(created.id).bytes == len(data)
    assert client.files.content(created.id).content == data
    assert created.id in [f.id for f in client.files.list()]
    assert client.files.delete(created.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)


def test_an_upload_over_the_limit_is_413(bstack):
    body = b"x" * (200 << 20) + b"x"
    response = httpx.post(bstack.url + "/v1/files", headers={"Authorization": f"Bearer {KEY_A}"},
                          files={"file": ("big.jsonl", body)}, data={"purpose": "batch"}, timeout=120)
    assert response.status_code == 413 and response.json()["error"]["code"] == "file_too_large"


def test_batch_answers_every_line_once_as_the_live_route_does(client):
    lines = [chat_line(f"req-{i}", f"Count to {i}.", max_tokens=3 + i % 4) for i in range(12)]
    lines.append(chat_line("schema", "A person.", max_tokens=30,
                           response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": {
                               "type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}}}))
    batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"run": "t1"})
    assert batch.status == "validating" and batch.metadata == {"run": "t1"}
    done = wait_final(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (13, 13, 0)
    assert done.error_file_id is None and done.completed_at >= done.in_progress_at >= done.created_at
    outputs = read_jsonl(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in outputs) == sorted(line["custom_id"] for line in lines)
    by_id = {o["custom_id"]: o for o in outputs}
    for line in lines:
        sent = {k: v for k, v in line["body"].items() if k != "ignore_eos"}
        live = client.chat.completions.create(**sent, extra_body={"ignore_eos": True}) \
            if "response_format" not in sent else None
        out = by_id[line["custom_id"]]
        assert out["response"]["status_code"] == 200 and out["error"] is None
        body = out["response"]["body"]
        if live is not None:
            assert body["choices"][0]["message"]["content"] == live.choices[0].message.content
            assert body["usage"]["completion_tokens"] == live.usage.completion_tokens
    assert isinstance(json.loads(by_id["schema"]["response"]["body"]["choices"][0]["message"]["content"])["age"], int)
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"


def test_malformed_lines_fail_validation_with_line_numbers(client):
    lines = [chat_line("ok", "hi"), b"{not json", {**chat_line("wrong", "hi"), "url": "/v1/completions"},
             chat_line("nomodel", "hi", model="no-such-model"), chat_line("ok", "again")]
    batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = wait_final(client, batch.id)
    assert done.status == "failed" and done.failed_at is not None
    errors = {(e.line, e.code) for e in done.errors.data}
    assert errors == {(2, "invalid_json_line"), (3, "mismatched_endpoint"), (4, "model_not_found"),
                      (5, "duplicate_custom_id")}


def test_cancel_mid_run_keeps_the_finished_lines(client):
    lines = [chat_line(f"c-{i}", f"Line {i}", max_tokens=150) for i in range(120)]
    batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    deadline = time.monotonic() + 120
    while client.batches.retrieve(batch.id).request_counts.completed < 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = wait_final(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    outputs = read_jsonl(client, done.output_file_id)
    errors = read_jsonl(client, done.error_file_id)
    assert len(outputs) >= 1 and len(outputs) == done.request_counts.completed < 120
    ids = [o["custom_id"] for o in outputs + errors]
    assert len(ids) == len(set(ids))
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_a_batch_cancelled_at_once_ends_cancelled(client):
    lines = [chat_line(f"q-{i}", f"Line {i}") for i in range(50)]
    batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    client.batches.cancel(batch.id)
    done = wait_final(client, batch.id)
    assert done.status == "cancelled"
    outputs, errors = read_jsonl(client, done.output_file_id), read_jsonl(client, done.error_file_id)
    assert len({o["custom_id"] for o in outputs + errors}) == len(outputs + errors) <= 50


def test_another_tenants_files_and_batches_are_404(bstack, client):
    file = upload(client, [chat_line("x", "hi")])
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    with bstack.client(KEY_B) as other:
        for call in (lambda: other.files.retrieve(file.id), lambda: other.files.content(file.id),
                     lambda: other.files.delete(file.id), lambda: other.batches.retrieve(batch.id),
                     lambda: other.batches.cancel(batch.id),
                     lambda: other.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h")):
            with pytest.raises(openai.NotFoundError):
                call()
        assert file.id not in [f.id for f in other.files.list()]
        assert batch.id not in [b.id for b in other.batches.list()]
    wait_final(client, batch.id)


def test_batches_list_pages_newest_first(client):
    file = upload(client, [chat_line("x", "hi")])
    ids = [client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id for _ in range(3)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    seen = [b.id for b in client.batches.list(limit=2)]  # auto-pagination follows `after`
    assert seen[:3] == ids[::-1]
    for batch_id in ids:
        wait_final(client, batch_id)


def _all_lines_once(client, batch, lines) -> tuple[list[dict], list[dict]]:
    outputs, errors = read_jsonl(client, batch.output_file_id), read_jsonl(client, batch.error_file_id)
    ids = [o["custom_id"] for o in outputs + errors]
    assert sorted(ids) == sorted(line["custom_id"] for line in lines)  # each line once, none twice
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(outputs), len(errors))
    return outputs, errors


def test_a_batch_past_its_window_expires_and_keeps_its_finished_lines(tiny_model_factory, tmp_path):
    stack = BatchStack(tiny_model_factory, tmp_path, FERRY_BATCH_WINDOW_S="3", FERRY_BATCH_BACKLOG="4")
    try:
        with stack.client() as client:
            lines = [chat_line(f"e-{i}", f"Line {i}", max_tokens=100) for i in range(400)]
            batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
            done = wait_final(client, batch.id)
            assert done.status == "expired" and done.expired_at is not None
            outputs, errors = _all_lines_once(client, done, lines)
            assert outputs and all(o["response"]["status_code"] == 200 for o in outputs)
            assert "batch_expired" in {e["error"]["code"] for e in errors if e["error"]}
    finally:
        stack.close()


def test_killing_an_api_process_and_a_worker_loses_and_duplicates_no_line(tiny_model_factory, tmp_path):
    stack = BatchStack(tiny_model_factory, tmp_path, FERRY_BATCH_BACKLOG="64", FERRY_LEASE_S="2",
                       FERRY_REAPER_INTERVAL_S="0.5")
    try:
        stack.procs["worker-2"] = Proc("worker-2", ["worker"], stack.env, stack.logs)
        with stack.client() as client:
            lines = [chat_line(f"k-{i}", f"Say {i}", max_tokens=2) for i in range(500)]
            batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
            deadline = time.monotonic() + 120
            while client.batches.retrieve(batch.id).request_counts.completed < 50:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            stack.procs["worker"].popen.kill()  # kill -9: its running jobs are reclaimed by worker-2
            stack.procs["api"].popen.kill()  # the only API process: the batch's driver, mid-run
        port = free_port()
        stack.procs["api-2"] = stack.start_api("api-2", port)  # takes the lease over once it lapses
        stack.url = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(stack.url + "/readyz").status_code == 200, 120, "api-2", [stack.procs["api-2"]])
        with stack.client() as client:
            done = wait_final(client, batch.id)
            assert done.status == "completed"
            assert done.request_counts.total == 500
            outputs, errors = _all_lines_once(client, done, lines)
            assert len(outputs) == 500 and not errors
    finally:
        stack.close()


def test_finished_batches_send_signed_webhooks(bstack, client, receiver):  # noqa: F811 (the fixture)
    good = client.batches.create(input_file_id=upload(client, [chat_line("w", "hi")]).id,
                                 endpoint="/v1/chat/completions", completion_window="24h",
                                 extra_body={"webhook": {"url": receiver.base + "/done"}})
    bad = client.batches.create(input_file_id=upload(client, [b"[]"]).id, endpoint="/v1/chat/completions",
                                completion_window="24h", extra_body={"webhook": {"url": receiver.base + "/bad"}})
    wait_final(client, good.id)
    wait_final(client, bad.id)
    for path, event, batch_id in (("/done", "batch.completed", good.id), ("/bad", "batch.failed", bad.id)):
        (got,) = receiver.wait_for(1, path=path)
        verify(bstack.env["FERRY_WEBHOOK_SECRET"], got.headers, got.body)
        payload = got.json()
        assert payload["type"] == event and payload["data"]["id"] == batch_id
        assert payload["data"]["status"] == event.removeprefix("batch.")
        assert got.headers["webhook-id"] == f"msg_{batch_id}_{event.removeprefix('batch.')}"


def test_responses_lines_answer_as_the_live_responses_route(client):
    def line(custom_id: str, **body) -> dict:
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses",
                "body": {"model": MODEL, "max_output_tokens": 5, "temperature": 0, **body}}

    lines = [line("plain", input="Say hi"), line("told", input="Say hi", instructions="Shout."),
             line("chained", input="x", previous_response_id="resp_0123abc")]
    batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/responses",
                                  completion_window="24h")
    done = wait_final(client, batch.id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 2, 1)
    by_id = {o["custom_id"]: o for o in read_jsonl(client, done.output_file_id) + read_jsonl(client,
                                                                                            done.error_file_id)}
    for custom_id in ("plain", "told"):
        body = by_id[custom_id]["response"]["body"]
        live = client.responses.create(**{k: v for k, v in lines[0 if custom_id == "plain" else 1]["body"].items()})
        text = "".join(part["text"] for item in body["output"] if item["type"] == "message" for part in item["content"])
        assert body["object"] == "response" and text == live.output_text
        assert client.responses.retrieve(body["id"]).output_text == live.output_text  # a line's response is stored
    refused = by_id["chained"]["response"]
    assert refused["status_code"] == 422 and refused["body"]["error"]["code"] == "unsupported_parameter"


def test_an_idempotency_key_makes_one_batch_for_every_retry(bstack, client):
    file_id = upload(client, [chat_line("a", "hi")]).id
    key = {"Idempotency-Key": f"nightly-{uuid.uuid4().hex}"}
    first = client.batches.with_raw_response.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                                    completion_window="24h", extra_headers=key)
    retry = client.batches.with_raw_response.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                                    completion_window="24h", extra_headers=key)
    assert retry.parse().id == first.parse().id
    assert retry.headers.get("idempotent-replayed") == "true" and "idempotent-replayed" not in first.headers
    with pytest.raises(openai.ConflictError) as info:
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"other": "body"}, extra_headers=key)
    assert info.value.body["code"] == "idempotency_conflict"
    # The key is the caller's own: another tenant's same key makes its own batch.
    with bstack.client(KEY_B) as other:
        theirs = other.batches.create(input_file_id=upload(other, [chat_line("b", "hi")]).id,
                                      endpoint="/v1/chat/completions", completion_window="24h", extra_headers=key)
    assert theirs.id != first.parse().id
    assert wait_final(client, first.parse().id).request_counts.completed == 1
