"""One tenant's batch never holds back another's: real `ferry api` and `ferry worker` processes on a
tiny model, real Redis, a file:// store. A hostile tenant (A) submits poisoned lines, a huge line and
a batch it cancels mid-run next to a normal tenant (B); B's work is answered, and A's lines are each
answered exactly once."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.api.conftest import KEY_A, KEY_B, MODEL
from tests.api.test_batches import BatchStack, chat_line, read_jsonl, upload, wait_final

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]

_CHAT = b'"method":"POST","url":"/v1/chat/completions"'
_BODY = b'"model":"' + MODEL.encode() + b'","max_tokens":2,"messages":[{"role":"user","content":"hi"}]'
POISONED = {  # one line of tenant A's file, as the adversarial run sent it
    "nested 5000 deep": b'{"custom_id":"p",' + _CHAT + b',"body":{' + _BODY + b',"x":' + b"[" * 5000 + b"]" * 5000
                        + b"}}",
    "lone surrogate in custom_id": b'{"custom_id":"p\\ud800",' + _CHAT + b',"body":{' + _BODY + b"}}",
    "lone surrogate in a body key": b'{"custom_id":"p",' + _CHAT + b',"body":{' + _BODY + b',"\\udfff":1}}',
}


@pytest.fixture(scope="module")
def istack(tiny_model_factory, tmp_path_factory):
    stack = BatchStack(tiny_model_factory, tmp_path_factory.mktemp("isolation"), FERRY_BATCH_BACKLOG="8")
    yield stack
    stack.close()


def create(client, lines: list, endpoint: str = "/v1/chat/completions"):
    return client.batches.create(input_file_id=upload(client, lines).id, endpoint=endpoint, completion_window="24h")


def batch_below(client, lines: list, bound: str = "batch_8"):
    """A batch of `lines` whose id sorts in the lower half of all ids: a batch made after it then
    sorts after it at every other try (a first id near the top, `batch_f...`, left `batch_after`
    a one-in-a-hundred chance per try)."""
    for _ in range(40):
        if (batch := create(client, lines)).id < bound:
            return batch
    raise AssertionError(f"no batch id below {bound} in 40 tries")


def batch_after(client, lines: list, after: str):
    """A batch of `lines` whose id sorts after `after`: the driver advances it after that one (ids
    are random; the ones before it run too)."""
    for _ in range(40):
        if (batch := create(client, lines)).id > after:
            return batch
    raise AssertionError(f"no batch id after {after} in 40 tries")


@pytest.mark.parametrize("poison", list(POISONED.values()), ids=list(POISONED))
def test_a_poisoned_line_never_holds_back_another_tenants_batch(istack, poison):
    with istack.client(KEY_A) as a, istack.client(KEY_B) as b:
        poisoned = batch_below(a, [chat_line("a1", "hi", max_tokens=2), poison, chat_line("a3", "hi", max_tokens=2)])
        normal = batch_after(b, [chat_line(f"b{i}", "hi", max_tokens=2) for i in range(3)], after=poisoned.id)
        done = wait_final(b, normal.id, timeout=120)
        assert done.status == "completed" and done.request_counts.completed == 3
        ended = wait_final(a, poisoned.id, timeout=120)
        if ended.status == "failed":  # the line cannot be read as a batch line: validation names it
            assert [(e.line, e.code) for e in ended.errors.data] in ([(2, "invalid_json_line")],
                                                                     [(2, "invalid_request")])
        else:  # a request the live route refuses with a 422: that line's answer, the others run
            assert ended.status == "completed", ended
            assert [o["custom_id"] for o in read_jsonl(a, ended.output_file_id)] in (["a1", "a3"], ["a3", "a1"])
            (refused,) = read_jsonl(a, ended.error_file_id)
            assert refused["custom_id"] == "p" and refused["response"]["status_code"] == 422
            assert refused["response"]["body"]["error"]["code"] == "invalid_request"
            assert (ended.request_counts.completed, ended.request_counts.failed) == (2, 1)


def test_a_huge_line_is_refused_by_size_while_another_tenant_is_answered(istack):
    huge = (b'{"custom_id":"big","method":"POST","url":"/v1/completions","body":{"model":"' + MODEL.encode()
            + b'","prompt":[' + b"1," * 15_000_000 + b'1],"max_tokens":2}}')  # 15M token ids, 30 MB
    small = {"custom_id": "small", "method": "POST", "url": "/v1/completions",
             "body": {"model": MODEL, "prompt": "hi", "max_tokens": 2}}
    with istack.client(KEY_A) as a, istack.client(KEY_B) as b:
        batch = create(a, [small, huge], endpoint="/v1/completions")
        live = b.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert live.choices[0].finish_reason in ("stop", "length")
        done = wait_final(a, batch.id, timeout=120)
        assert done.status == "failed"
        assert [(e.line, e.code) for e in done.errors.data] == [(2, "line_too_large")]


def test_a_token_prompt_longer_than_the_model_is_refused_without_a_job(istack):
    lines = [{"custom_id": "long", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": [1] * 2000, "max_tokens": 2}},  # max_model_len is 1024
             {"custom_id": "short", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": [1] * 8, "max_tokens": 2}}]
    with istack.client(KEY_A) as a:
        done = wait_final(a, create(a, lines, endpoint="/v1/completions").id, timeout=120)
        assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (1, 1)
        (refused,) = read_jsonl(a, done.error_file_id)
        assert refused["custom_id"] == "long" and refused["response"]["status_code"] == 422
        assert refused["response"]["body"]["error"]["code"] == "prompt_too_long"
        with httpx.Client(base_url=istack.url, headers={"Authorization": f"Bearer {KEY_A}"}) as http:
            jobs = http.get("/v1/jobs", params={"batch_id": done.id, "limit": 100}).json()["data"]
        assert [job["metadata"]["custom_id"] for job in jobs] == ["short"]


def test_a_cancelled_batch_answers_every_line_exactly_once(istack):
    lines = [chat_line(f"c-{i}", f"Line {i}", max_tokens=64) for i in range(400)]
    with istack.client(KEY_A) as a:
        batch = create(a, lines)
        deadline = time.monotonic() + 120
        while a.batches.retrieve(batch.id).request_counts.completed < 1:  # cancelled mid-run: some lines answered
            assert time.monotonic() < deadline
            time.sleep(0.1)
        a.batches.cancel(batch.id)
        done = wait_final(a, batch.id)
        assert done.status == "cancelled"
        outputs, errors = read_jsonl(a, done.output_file_id), read_jsonl(a, done.error_file_id)
        assert sorted(o["custom_id"] for o in outputs + errors) == sorted(line["custom_id"] for line in lines)
        counts = done.request_counts
        assert (counts.total, counts.completed, counts.failed) == (400, len(outputs), len(errors))
        unrun = [e for e in errors if e["error"] is not None]
        assert unrun and {e["error"]["code"] for e in unrun} == {"batch_cancelled"}


def test_output_lines_escape_unicode_line_breaks(istack):
    prompt = "one\u2028two\u2029three\x85four"
    lines = [{"custom_id": f"sep\u2028{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": prompt, "max_tokens": 2, "echo": True}} for i in range(2)]
    lines.append({"custom_id": "refused\u2029", "method": "POST", "url": "/v1/completions",
                  "body": {"model": MODEL, "prompt": [1] * 2000, "max_tokens": 2}})  # over max_model_len
    with istack.client(KEY_A) as a:
        done = wait_final(a, create(a, lines, endpoint="/v1/completions").id, timeout=120)
        assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (2, 1)
        outputs, errors = read_jsonl(a, done.output_file_id), read_jsonl(a, done.error_file_id)  # splitlines()
        assert sorted(o["custom_id"] for o in outputs) == ["sep\u20280", "sep\u20281"]
        assert all(o["response"]["body"]["choices"][0]["text"].startswith(prompt) for o in outputs)
        assert [e["custom_id"] for e in errors] == ["refused\u2029"]
