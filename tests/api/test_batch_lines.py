"""How the batch driver reads a line, without Redis: the splitter under every chunking, what fails
validation and what becomes the line's own answer, and the JSONL it writes."""

from __future__ import annotations

import json
import random

import pytest

from ferry.api.auth import KeyRing
from ferry.api.batches import Envelope, LineError, Route, build_line, envelope_groups, read_envelope, refused_line
from ferry.api.errors import ApiError
from ferry.api.services import ApiMetrics, ModelLimits, ModelRoute, Services
from ferry.api.settings import ApiSettings

CHAT = "/v1/chat/completions"


def line(custom_id: str, **body) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | body
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}).encode()


def outcomes(data: bytes, chunk_sizes, max_bytes: int) -> list[tuple[int, str]]:
    chunks, start = [], 0
    for size in chunk_sizes:
        chunks.append(data[start:start + size])
        start += size
    chunks.append(data[start:])
    return [(item.number, item.custom_id if isinstance(item, Envelope) else item.code)
            for group in envelope_groups(iter(chunks), CHAT, max_bytes) for item in group]


def test_lines_are_numbered_and_limited_the_same_under_every_chunking():
    huge = line("huge", messages=[{"role": "user", "content": "x" * 5000}])
    data = line("a") + b"\n\n" + line("b") + b"\r\n" + huge + b"\n  \n" + line("c") + b"\n" + line("d")
    expected = [(1, "a"), (3, "b"), (4, "line_too_large"), (6, "c"), (7, "d")]
    rng = random.Random(7)
    for _ in range(200):
        sizes = [rng.randint(1, 700) for _ in range(rng.randint(0, 40))]
        assert outcomes(data, sizes, max_bytes=1000) == expected, sizes
    assert outcomes(data, [], max_bytes=len(huge)) == [(1, "a"), (3, "b"), (4, "huge"), (6, "c"), (7, "d")]


@pytest.mark.parametrize(("raw", "code", "param"), [
    (b'{"custom_id": "x", "body": ' + b"[" * 5000 + b"]" * 5000 + b"}", "invalid_json_line", None),
    (b'{"custom_id": "x\\ud800", "url": "/v1/chat/completions", "body": {}}', "invalid_request", "custom_id"),
    (b'{"custom_id": "", "url": "/v1/chat/completions", "body": {}}', "missing_required_parameter", "custom_id"),
    (b'{"custom_id": "x", "url": "/v1/completions", "body": {}}', "mismatched_endpoint", "url"),
    (b'[1]', "invalid_json_line", None),
])
def test_a_line_that_is_not_a_batch_line_fails_validation(raw, code, param):
    with pytest.raises(LineError) as info:
        read_envelope(5, raw, CHAT, 1 << 20)
    assert (info.value.to_json()["line"], info.value.code, info.value.param) == (5, code, param)


def services() -> Services:
    return Services(settings=ApiSettings(), redis=None, keys=None, hub=None, keyring=KeyRing.parse(None, None),
                    metrics=ApiMetrics(lambda: 0), configured_models=frozenset({"m"}))


ROUTES = {"m": Route(ModelRoute("m"), ModelLimits(vocab_size=100, max_model_len=16))}


def build(raw: bytes, endpoint: str = CHAT):
    return build_line(services(), "t", "batch_x", endpoint, read_envelope(1, raw, endpoint, 1 << 20), ROUTES, 60.0)


@pytest.mark.parametrize(("raw", "code"), [
    (b'{"custom_id": "x", "url": "/v1/chat/completions", "body": {"model": "m", "messages": '
     b'[{"role": "user", "content": "hi"}], "\\udfff": 1}}', "invalid_request"),  # pydantic itself would raise
    (line("x", temperature=-1), "invalid_request"),
    (line("x", stream=True), "unsupported_parameter"),
    (line("x", use_beam_search=True), "unsupported_parameter"),  # unknown: refused as the live route refuses it
    (line("x", prompt_logprobs=30), "invalid_request"),  # over the limit, as live
    (line("x", model="nobody"), "model_not_found"),
])
def test_a_request_the_live_route_refuses_is_that_lines_answer(raw, code):
    with pytest.raises(ApiError) as info:
        build(raw)
    assert info.value.code == code


def test_a_token_prompt_is_checked_against_max_model_len():
    def completion(n: int) -> bytes:
        body = {"model": "m", "prompt": [1] * n, "max_tokens": 2}
        return json.dumps({"custom_id": "x", "url": "/v1/completions", "body": body}).encode()

    assert build(completion(15), "/v1/completions").job.prompt == [1] * 15
    with pytest.raises(ApiError) as info:
        build(completion(16), "/v1/completions")
    assert (info.value.status, info.value.code) == (422, "prompt_too_long")


def test_written_lines_keep_unicode_line_breaks_and_lone_surrogates_escaped():
    written = refused_line("a\u2028b\u2029c\x85d\ud800", ApiError(422, "invalid_request", "x"))
    assert written.endswith("\n") and len(written.splitlines()) == 1
    written.encode("utf-8")  # a lone surrogate is written as its escape
    assert json.loads(written)["custom_id"] == "a\u2028b\u2029c\x85d\ud800"
