"""The key configuration's options, and the rate-limit and usage scripts on the real Redis with a
given clock: bucket arithmetic, refusal, refill, correction at the end, counting once, one slot."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from redis.crc import key_slot

from ferry.worker.common.tenants import KeyConfig, Limits, hash_key
from ferry.worker.protocol import Keys, lua
from ferry.worker.protocol.usage import ACCOUNT_FIELDS, account_jobs
from ferry.worker.webhooks.signing import new_secret

REDIS_URL = "redis://127.0.0.1:6379/0"


def test_old_entries_still_parse_and_options_belong_to_the_tenant():
    secret = new_secret()
    config = KeyConfig.parse(f"{hash_key('k1')}:plain,{hash_key('k2')}:acme;rpm=60;tpm=1000;admin=true,"
                             f"{hash_key('k3')}:acme;batch_tpm=50000;webhook_secret={secret}")
    assert config.keys[hash_key("k1")].tenant == "plain" and not config.keys[hash_key("k1")].admin
    assert config.keys[hash_key("k2")].admin and not config.keys[hash_key("k3")].admin  # admin is per key
    assert config.tenant("acme").limits == Limits(rpm=60, tpm=1000, batch_tpm=50000)
    assert config.tenant("acme").webhook_secrets == (secret,)
    assert config.tenant("plain").limits == Limits() and config.tenant("nobody").webhook_secrets == ()
    assert config.tenant("acme").limits.for_budget("batch") == (None, 50000)


@pytest.mark.parametrize(("spec", "message"), [
    ("rpm=0", "positive integer"), ("tpm=lots", "positive integer"), ("burst=3", "unknown option"),
    ("rpm", "needs a value"), ("webhook_secret=plain", "whsec_"), ("webhook_secret=whsec_@@", "whsec_"),
    ("admin=maybe", "true or false"),
])
def test_bad_options_are_refused_with_the_entry_named(spec, message):
    with pytest.raises(ValueError, match=message) as raised:
        KeyConfig.parse(f"{hash_key('k')}:acme;{spec}")
    assert hash_key("k")[:12] in str(raised.value)


def test_two_keys_of_a_tenant_with_different_limits_are_refused():
    with pytest.raises(ValueError, match="rpm=60 on another key"):
        KeyConfig.parse(f"{hash_key('a')}:acme;rpm=60,{hash_key('b')}:acme;rpm=61")


def test_a_tenants_keys_share_one_slot():
    keys = Keys("ferry")
    names = [keys.tenant_jobs("acme"), keys.rate_bucket("acme", "live"), keys.rate_bucket("acme", "batch"),
             keys.usage("acme"), keys.usage_day("acme", "2026-12-03"), keys.usage_counted("acme", "j1")]
    assert len({key_slot(n.encode()) for n in names}) == 1


@pytest.fixture
def rdb():
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    prefix = f"ferrytest-{uuid.uuid4().hex}"
    yield client, Keys(prefix)
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)
    client.close()


def _admit(client, key, now_ms, rpm, tpm, tokens):
    answer = client.register_script(lua.RATE_LIMIT)(keys=[key], args=[now_ms, rpm, tpm, tokens, 300])
    return dict(zip(("admitted", "too_large", "req_left", "req_reset", "tok_left", "tok_reset", "wait"),
                    answer, strict=True))


@pytest.mark.redis
def test_bucket_takes_refuses_and_refills_at_the_per_minute_rate(rdb):
    client, keys = rdb
    key = keys.rate_bucket("acme", "live")
    t = 1_000_000
    assert _admit(client, key, t, 2, 600, 500) | {"req_reset": 0, "tok_reset": 0} == {
        "admitted": 1, "too_large": 0, "req_left": 1, "req_reset": 0, "tok_left": 100, "tok_reset": 0, "wait": 0}
    refused = _admit(client, key, t, 2, 600, 500)  # a request is left, tokens are not: neither is taken
    assert refused["admitted"] == 0 and refused["wait"] == 40_000 and refused["req_left"] == 1
    assert _admit(client, key, t, 2, 600, 100)["admitted"] == 1  # both buckets now empty
    assert _admit(client, key, t + 29_000, 2, 600, 1)["admitted"] == 0  # half a request refilled
    later = _admit(client, key, t + 30_000, 2, 600, 1)
    assert later["admitted"] == 1 and later["tok_left"] == 299
    assert _admit(client, key, t + 30_000, 0, 600, 700)["too_large"] == 1
    unlimited = _admit(client, key, t, 0, 0, 10**9)
    assert unlimited["admitted"] == 1 and unlimited["req_left"] == unlimited["tok_left"] == -1


@pytest.mark.redis
def test_a_job_that_ends_gives_back_unused_tokens_and_is_counted_once(rdb):
    client, keys = rdb
    bucket = keys.rate_bucket("acme", "live")
    _admit(client, bucket, int(time.time() * 1000), 0, 600, 550)
    client.hset(keys.job("j1"), mapping={"tenant": "acme", "rate_budget": "live", "reserved_tokens": "550",
                                         "usage": '{"prompt_tokens": 20, "completion_tokens": 30}'})
    client.hset(keys.job("j2"), mapping={"tenant": "acme", "usage": '{"prompt_tokens": 7, "completion_tokens": 1}'})
    assert set(ACCOUNT_FIELDS) <= set(client.hgetall(keys.job("j1")))
    account_jobs(client, keys, ["j1", "j2", "gone"], 60)
    account_jobs(client, keys, ["j1"], 60)  # a retried write: nothing more
    assert client.hgetall(keys.usage("acme")) == {"requests": "2", "prompt_tokens": "27", "completion_tokens": "31"}
    assert 549 <= float(client.hget(bucket, "tok")) < 560  # 50 left + 500 given back (+ 10 per second since)
